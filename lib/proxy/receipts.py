"""What the proxy checks of a group when it arrives, beyond its schema (docs/trust.md): that it answers a
prompt lease of the participant sending it, once, and that its completions are not another group's sent
again. Both are rules of the book (book.py): the live proxy applies them as requests come and replay
(ledger.py) as the journal's records say, so a restarted proxy checks exactly what its predecessor did.

Prompt leases. `POST /v1/prompts/lease` answers with a lease_id, and the proxy journals which indices of
which dataset it leased to whom (a `prompts` record). A group names `lease_id` and `prompt_index`, and is
taken only from the participant the lease went to (the admin token's leases: from the admin token), for an
index of that lease, once (a participant's lease holds each index once: one that runs past the end of an epoch
leaves out the indices it already holds; the admin's own leases, as often as they hold it). The group's journal line then carries the lease's dataset, and a `receipt` record says which
lease index it used up. Whether `prompt_ids` are that prompt's tokens the proxy cannot tell (it has no
tokenizer): the trainer checks that (lib/train/audit.py).

Bounded. A worker leases prompts after it swaps in an adapter, so a lease taken while version L was the
latest is answered by groups of version <= L, and those are refused as stale once the staleness floor
passes L: the lease is forgotten then. Besides, a participant holds at most MAX_PROMPTS leased prompts; past
that its oldest leases are forgotten. The ids of the last FORGOTTEN forgotten leases are kept, so that a late
group hears why (409, not counted as a lie).

Owed. When a participant's lease is forgotten, the indices it never answered are owed: they count against its
share of the batches to come (shares.py), so that leasing many prompts to answer a chosen few costs what answering
them all would. A lease record pays them off (book.Book.lease).

Fingerprints. A group's fingerprint is a hash of its completions' tokens and behaviour logprobs, in any order
(prompt and rewards left out): a participant that sends another group's completions again under a new
group_id (under its own name, for another prompt, with other rewards) is refused. Kept as the duplicate
window is: for the groups accepted at versions >= the staleness floor (older ones are refused as stale).
"""
from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict

MAX_PROMPTS = 16384  # leased prompts one participant may hold at once (a worker holds a round's: 8)
FORGOTTEN = 1024     # ids of forgotten leases remembered, so that their late groups hear why


def fingerprint(group) -> str:
    """Of a TrajectoryGroup: its completions' token ids and behaviour logprobs, order-free. Two honest groups
    share one only if every completion's tokens and every logprob agree to the last bit."""
    def one(c) -> bytes:
        lps = c.logprobs if None not in c.logprobs else [math.nan if x is None else x for x in c.logprobs]
        return hashlib.blake2b(array("q", c.token_ids).tobytes() + array("d", lps).tobytes(), digest_size=16).digest()
    return hashlib.blake2b(b"".join(sorted(one(c) for c in group.completions)), digest_size=16).hexdigest()


class Receipts:
    """Open prompt leases (lease_id -> who, dataset, the version latest when leased, how often each index may
    still be answered and by which group it last was) and the fingerprints of the recently accepted groups."""

    def __init__(self):
        self.leases: OrderedDict[str, dict] = OrderedDict()   # in the order they were leased
        self.held: dict[str, int] = {}                         # participant ("" for the admin) -> prompts in its leases
        self.forgotten: OrderedDict[str, str] = OrderedDict()  # lease_id -> why
        self.floor = 0
        self.prints: dict[str, str] = {}                       # fingerprint -> group_id
        self.by_version: dict[int, list[str]] = {}             # version -> fingerprints accepted at it
        self.owed: dict[str, int] = {}                         # participant -> prompts it left unanswered (shares.py)

    # ---- the rules ---------------------------------------------------------------------------------
    def bind(self, lease_id: str, who: str | None, dataset: str, indices: list[int], latest: int) -> None:
        """Prompts `indices` of `dataset` were leased to `who` (None: the admin token) while `latest` was the
        latest version."""
        left: dict[int, int] = {}
        for i in indices:  # a participant answers each index of its lease once (the proxy leases it each once)
            left[i] = 1 if who is not None else left.get(i, 0) + 1
        self.leases[lease_id] = {"who": who, "dataset": dataset, "latest": latest, "size": len(indices),
                                 "left": left, "by": {}}
        key = who or ""
        self.held[key] = self.held.get(key, 0) + len(indices)
        while self.held[key] > MAX_PROMPTS:  # its oldest lease goes (another's leases are never touched)
            oldest = next(lid for lid, x in self.leases.items() if x["who"] == who)
            self._forget(oldest, f"more than {MAX_PROMPTS} prompts were leased to this participant after it")

    def judge(self, who: str | None, lease_id: str | None, index: int | None, fp: str, gid: str) -> tuple[str, str] | None:
        """None when group `gid` of `who` may be taken, else (check, why): `unleased`, `reused` or `replayed`
        (a lie, counted against the participant), or `forgotten` (a lease let go: too late, not a lie)."""
        if lease_id is not None:
            lease = self.leases.get(lease_id)
            if lease is None:
                if lease_id in self.forgotten:
                    return "forgotten", f"prompt lease {lease_id} was let go ({self.forgotten[lease_id]})"
                return "unleased", f"no prompt lease {lease_id} was handed out"
            if lease["who"] != who:
                return "unleased", f"prompt lease {lease_id} was handed to another participant"
            if index not in lease["left"] and index not in lease["by"]:
                return "unleased", f"prompt index {index} is not one of prompt lease {lease_id}'s"
            if not lease["left"].get(index):
                return "reused", f"prompt index {index} of lease {lease_id} was answered already, by group {lease['by'][index]}"
        if who is not None and (other := self.prints.get(fp)) is not None and other != gid:
            return "replayed", f"its completions (tokens and logprobs) are those of group {other}, accepted already"
        return None

    def take(self, gid: str, lease_id: str | None, index: int | None) -> None:
        """Group `gid` answers `index` of `lease_id` (judged fine just before: no await in between)."""
        if lease_id is not None and (lease := self.leases.get(lease_id)) is not None and lease["left"].get(index):
            lease["left"][index] -= 1
            if not lease["left"][index]:
                del lease["left"][index]
            lease["by"][index] = gid

    def untake(self, gid: str, lease_id: str | None, index: int | None) -> None:
        """The write of take()'s group failed: nothing changed."""
        if lease_id is not None and (lease := self.leases.get(lease_id)) is not None and lease["by"].get(index) == gid:
            lease["left"][index] = lease["left"].get(index, 0) + 1
            del lease["by"][index]

    def remember(self, fp: str, gid: str, version: int) -> None:
        """An accepted group's fingerprint (its receipt applied after its line was buffered)."""
        if version >= self.floor and fp not in self.prints:
            self.prints[fp] = gid
            self.by_version.setdefault(version, []).append(fp)

    def dataset(self, lease_id: str) -> str:
        return self.leases[lease_id]["dataset"]

    def advance(self, floor: int) -> None:
        """The staleness floor rose to `floor`: leases taken before it and older fingerprints go."""
        if floor <= self.floor:
            return
        self.floor = floor
        for lid in [lid for lid, x in self.leases.items() if x["latest"] < floor]:
            self._forget(lid, f"groups answering it are staler than the floor, version {floor}")
        for v in [v for v in self.by_version if v < floor]:
            for fp in self.by_version.pop(v):
                del self.prints[fp]

    def pay(self, paid: dict[str, int], sign: int = 1) -> None:
        """A batch spent these participants' quota on what they owe (shares.select; sign -1: its lease was undone)."""
        for who, n in paid.items():
            if left := self.owed.get(who, 0) - sign * n:
                self.owed[who] = left
            else:
                self.owed.pop(who, None)

    def _forget(self, lease_id: str, why: str) -> None:
        """A lease let go: a late group hears why, and the indices its participant never answered are owed (they
        count against its share of the batches to come, shares.py)."""
        lease = self.leases.pop(lease_id)
        if lease["who"] is not None and (unanswered := sum(lease["left"].values())):
            self.owed[lease["who"]] = self.owed.get(lease["who"], 0) + unanswered
        key = lease["who"] or ""
        self.held[key] -= lease["size"]
        if not self.held[key]:
            del self.held[key]
        self.forgotten[lease_id] = why
        while len(self.forgotten) > FORGOTTEN:
            self.forgotten.popitem(last=False)

    # ---- state ---------------------------------------------------------------------------------------
    def state(self) -> dict:
        """Plain JSON values (snapshots, GET /v1/state)."""
        return {"leases": [[lid, {**x, "left": [[i, n] for i, n in sorted(x["left"].items())],
                                  "by": [[i, g] for i, g in sorted(x["by"].items())]}] for lid, x in self.leases.items()],
                "forgotten": [[lid, why] for lid, why in self.forgotten.items()], "floor": self.floor,
                "owed": dict(sorted(self.owed.items())),
                "prints": {str(v): [[fp, self.prints[fp]] for fp in fps] for v, fps in sorted(self.by_version.items())}}

    @classmethod
    def from_state(cls, d: dict) -> Receipts:
        r = cls()
        for lid, x in d["leases"]:
            r.leases[lid] = {**x, "left": {int(i): n for i, n in x["left"]}, "by": {int(i): g for i, g in x["by"]}}
            r.held[x["who"] or ""] = r.held.get(x["who"] or "", 0) + x["size"]
        r.forgotten = OrderedDict((lid, why) for lid, why in d["forgotten"])
        r.floor = d["floor"]
        r.owed = dict(d.get("owed", {}))
        for v, pairs in d["prints"].items():
            r.by_version[int(v)] = [fp for fp, _ in pairs]
            r.prints.update(dict(pairs))
        return r

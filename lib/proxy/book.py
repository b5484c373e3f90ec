"""The proxy's book: the trajectory buffer, the batch leases, the duplicate window and the registry of
adapter versions, with every rule that changes them. The live proxy (proxy.py) holds one Book and calls
these methods as requests come; replay (ledger.Ledger, a Book fed by the journal's records) calls the
same methods for the records it reads. So a rule exists once, and the state a start rebuilds from the
journal is the state the proxy had (tests/test_proxy_state.py drives one sequence both ways).

A group is held as an item with `.gid` and `.version` (the live proxy: the line it logged; replay: where
that line is in the journal); the Book never looks inside. What the live proxy keeps beside its Book is
its own business: lease deadlines on its monotonic clock, journal writes in flight, a version being
registered.

Trust (docs/trust.md). Each item also names the participant that sent it (`.who`, None for the admin token).
The Book holds the receipts of arriving groups (receipts.py: which prompt lease each answered, the
fingerprints of recent ones) and the quarantine (quarantine.py: failed checks per participant); a suspended
participant's groups are held out of the buffer, now and whenever they would come back to it.

The duplicate window. A resubmitted group must be answered `duplicate` for as long as it could
otherwise be trained again. A group whose policy_version is below latest - max_staleness is answered
`stale` on arrival whether or not it came before, and is never buffered or leased: so the ids worth
remembering are those of accepted groups with policy_version >= floor, floor = latest - max_staleness
(never lowered, also when a restart raises --max-staleness: a group below it is `stale` either way).
"""
from __future__ import annotations

from collections import OrderedDict, namedtuple
from collections.abc import Iterable
from itertools import islice
from typing import Any

from common import too_stale
from pacing import Pacer
from quarantine import Quarantine
from receipts import Receipts

BATCHES = 1024  # acked and expired batch ids remembered, each
COUNTED = ("groups_accepted", "groups_duplicate", "groups_dropped_stale", "groups_leased", "groups_acked",
           "batches_leased", "batches_acked", "leases_expired", "groups_held_out")  # what the journal implies (429s it does not)

# a group as the live proxy holds it: the line it logged; paced: a participant's group its worker's grant covered on
# arrival (shares.py; live only: after a restart it is held to its participant's quota like the rest)
Entry = namedtuple("Entry", "gid version raw who paced", defaults=(None, False))
Held = namedtuple("Held", "items lease_s ids")   # an open lease: its groups, its duration, the ids it named


class Window:
    """The duplicate window: group id -> policy_version of every accepted group at version >= floor."""

    def __init__(self, floor: int = 0, by_version: dict[int, list[str]] | None = None):
        self.floor, self.by_version = floor, by_version or {}
        self.ids = {g: v for v, gids in self.by_version.items() for g in gids}

    def __contains__(self, gid: str) -> bool:
        return gid in self.ids

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, gid: str, version: int) -> None:
        if version >= self.floor and gid not in self.ids:
            self.ids[gid] = version
            self.by_version.setdefault(version, []).append(gid)

    def advance(self, floor: int) -> None:
        """Forget every group below `floor` (a handful of versions to drop, whatever the groups per version)."""
        if floor > self.floor:
            for v in [v for v in self.by_version if v < floor]:
                for gid in self.by_version.pop(v):
                    del self.ids[gid]
            self.floor = floor

    def state(self) -> dict:
        return {"floor": self.floor, "ids": {str(v): list(g) for v, g in self.by_version.items()}}

    @classmethod
    def from_state(cls, d: dict) -> Window:
        return cls(d["floor"], {int(v): list(g) for v, g in d["ids"].items()})


class Versions:
    """Registered adapter versions: the latest in full, all of them as ranges (membership is all a worker
    asks about an older one). Version 0, the base model, is the latest before any registration."""

    def __init__(self, last: dict | None = None, ranges: list[list[int]] | None = None):
        self.last = last or {"version": 0, "step": 0, "published_at": None, "registered": None}
        self.ranges = ranges or []  # [[first, last], ...], ascending

    @property
    def latest(self) -> int:
        return self.last["version"]

    def add(self, version: int, step: int, published_at: float, registered: float | None = None) -> None:
        """registered: this process's monotonic time of the registration (None: replayed or adopted)."""
        self.last = {"version": version, "step": step, "published_at": published_at, "registered": registered}
        if self.ranges and self.ranges[-1][1] == version - 1:
            self.ranges[-1][1] = version
        else:
            self.ranges.append([version, version])

    def __contains__(self, version: int) -> bool:
        return any(a <= version <= b for a, b in self.ranges)

    def state(self) -> dict:
        return {"last": {k: self.last[k] for k in ("version", "step", "published_at")}, "ranges": [list(r) for r in self.ranges]}

    @classmethod
    def from_state(cls, d: dict) -> Versions:
        return cls({**d["last"], "registered": None}, [list(r) for r in d["ranges"]])


class Recent(OrderedDict):
    """The last `cap` batch ids of one kind (acked, expired), each with its number of groups."""

    def __init__(self, items: Iterable = (), cap: int = BATCHES):
        super().__init__(items)
        self.cap = cap

    def add(self, batch_id: str, groups: int) -> None:
        self[batch_id] = groups
        self.move_to_end(batch_id)
        while len(self) > self.cap:
            self.popitem(last=False)


class Book:
    def __init__(self, max_staleness: int, lease_s: float):
        self.max_staleness, self.lease_s = max_staleness, lease_s
        self.buffer: OrderedDict[str, Any] = OrderedDict()  # group_id -> item (FIFO)
        self.leases: dict[str, Held] = {}                    # batch_id -> open lease
        self.holder: dict[str, str] = {}                     # group_id -> the open lease that named it
        self.window = Window()
        self.acked, self.expired = Recent(), Recent()
        self.versions = Versions()
        self.done = False                                    # the trainer registered its final version
        self.counts = dict.fromkeys(COUNTED, 0)
        self.staleness_hist: dict[int, int] = {}             # staleness at lease -> groups
        self.pacing = Pacer(max_staleness)                   # grants of prompts, the trainer's demand (pacing.py)
        self.receipts = Receipts()                           # prompt leases answered, fingerprints (receipts.py)
        self.quarantine = Quarantine()                       # failed checks, suspensions (quarantine.py)

    @property
    def latest(self) -> int:
        return self.versions.latest

    # ---- the rules ------------------------------------------------------------------------------------
    def too_stale(self, version: int, latest: int | None = None) -> bool:
        """common.too_stale against the latest (or `latest`), and never below the duplicate window's floor."""
        return version < self.window.floor or too_stale(version, self.latest if latest is None else latest, self.max_staleness)

    def drop_stale(self) -> int:
        """Remove groups staler than max_staleness from the buffer; returns how many. The buffer never holds
        a stale group, so a full buffer has nothing stale to give up."""
        stale = [gid for gid, it in self.buffer.items() if self.too_stale(it.version)]
        for gid in stale:
            del self.buffer[gid]
        self.counts["groups_dropped_stale"] += len(stale)
        return len(stale)

    def accept(self, item) -> bool:
        """A group whose line is in the journal: into the window and the buffer; False (counted as dropped)
        when a version registered while its line was being written made it stale."""
        self.counts["groups_accepted"] += 1
        if self.too_stale(item.version):
            self.counts["groups_dropped_stale"] += 1
            return False
        if self.quarantine.held(item.who):  # its sender was suspended while its line was being written
            self.counts["groups_held_out"] += 1
            return False
        self.window.add(item.gid, item.version)
        self.buffer[item.gid] = item
        return True

    def fresh(self, pending_version: int = 0) -> list:
        """The buffered groups a lease may take, oldest first. While version `pending_version` is being registered, or
        is the one a batch asked for ahead will be trained from, groups it will make stale are passed over (a lease
        decided now comes after that version in the log), not dropped: the registration may yet fail. Which of them a
        lease takes is the live proxy's choice (shares.py), journaled with the lease."""
        if pending_version <= self.latest:
            return list(self.buffer.values())
        return [it for it in self.buffer.values() if not self.too_stale(it.version, pending_version)]

    def lease(self, bid: str, ids: list[str], lease_s: float, latest: int, left: int | None = None,
              at: float | None = None, paid: dict[str, int] | None = None) -> list:
        """Groups `ids` out of the buffer into the open lease `bid`, to be trained from version `latest` (the
        latest one, or the next for a batch the trainer asked for while it trains the one before: for the
        staleness histogram, and how many batches the trainer holds, pacing.py); returns their items. A group
        another open lease names means that lease ran out and its expiry was never journaled (replay): it is
        returned first. left: the trainer's demand after this lease, as journaled; at: the live proxy's clock; paid:
        what each participant's share of it paid of the prompts it owes (shares.py), as journaled."""
        for b in {self.holder[g] for g in ids if g in self.holder}:
            self.return_lease(b)
        items = [self.buffer.pop(g) for g in ids if g in self.buffer]
        self.leases[bid] = Held(items, lease_s, list(ids))
        self.holder.update(dict.fromkeys(ids, bid))
        self.counts["batches_leased"] += 1
        self.counts["groups_leased"] += len(ids)
        for it in items:
            self.staleness_hist[latest - it.version] = self.staleness_hist.get(latest - it.version, 0) + 1
        self.pacing.leased(len(ids), left, at, held=max(1, latest + 1 - self.latest))
        if paid:
            self.receipts.pay(paid)
        return items

    def renew(self, bid: str, lease_s: float) -> None:
        self.leases[bid] = self.leases[bid]._replace(lease_s=lease_s)

    def return_lease(self, bid: str) -> None:
        """A lease ran out: its groups go back to the front of the buffer (they are the oldest)."""
        held = self._close(bid)
        self.expired.add(bid, len(held.ids))
        self.counts["leases_expired"] += 1
        self._to_front(held.items)
        self.drop_stale()

    def ack(self, bid: str) -> int:
        """The trainer's update from batch `bid` is safe: its groups are consumed for good. Returns how many
        (an ack the log holds for a lease that ran out first counts that lease's groups; a second ack, 0)."""
        if bid in self.acked:
            return 0
        groups = len(self._close(bid).ids) if bid in self.leases else self.expired.get(bid, 0)
        self.acked.add(bid, groups)
        self.counts["batches_acked"] += 1
        self.counts["groups_acked"] += groups
        return groups

    def register(self, version: int, step: int, published_at: float, final: bool = False,
                 registered: float | None = None) -> int:
        """A newer adapter version: groups it makes stale leave the buffer (returned: how many), the window
        forgets what is answered `stale` anyway. final: the run is over."""
        self.versions.add(version, step, published_at, registered)
        self.pacing.registered(registered)
        self.done = final
        dropped = self.drop_stale()
        self.window.advance(self.latest - self.max_staleness)
        self.receipts.advance(self.window.floor)
        return dropped

    def receive(self, gid: str, fp: str, lease_id: str | None = None, index: int | None = None) -> None:
        """The receipt of group `gid`, journaled right after its line: the prompt lease index it used up, and (if
        it was buffered) its fingerprint. (The live proxy takes the index before the write: receipts.take.)"""
        self.receipts.take(gid, lease_id, index)
        self.remember(gid, fp)

    def remember(self, gid: str, fp: str) -> None:
        if gid in self.window:
            self.receipts.remember(fp, gid, self.window.ids[gid])

    def fail(self, who: str, gid: str, check: str, detail: str, limit: int, at: float) -> bool:
        """A group of `who` failed `check`; past `limit` failures `who` is suspended and its buffered groups are
        held out. True when this suspended it."""
        if not self.quarantine.fail(who, gid, check, detail, limit, at):
            return False
        held = [g for g, it in self.buffer.items() if it.who == who]
        for g in held:
            del self.buffer[g]
        self.counts["groups_held_out"] += len(held)
        return True

    def reinstate(self, who: str, at: float) -> None:
        self.quarantine.reinstate(who, at)

    # ---- undoing a transition whose journal write failed (the live proxy: nothing changed) -------------
    def unlease(self, bid: str, latest: int, paid: dict[str, int] | None = None) -> None:
        held = self._close(bid)
        if paid:
            self.receipts.pay(paid, -1)
        self.pacing.unleased(len(held.ids))
        self.counts["batches_leased"] -= 1
        self.counts["groups_leased"] -= len(held.ids)
        for it in held.items:
            if (left := self.staleness_hist[latest - it.version] - 1) == 0:
                del self.staleness_hist[latest - it.version]
            else:
                self.staleness_hist[latest - it.version] = left
        self._to_front(held.items)
        self.drop_stale()

    def unack(self, bid: str, held: Held) -> None:
        groups = self.acked.pop(bid)
        self.counts["batches_acked"] -= 1
        self.counts["groups_acked"] -= groups
        self.leases[bid] = held
        self.holder.update(dict.fromkeys(held.ids, bid))

    # ---- helpers --------------------------------------------------------------------------------------
    def _close(self, bid: str) -> Held:
        held = self.leases.pop(bid)
        for g in held.ids:
            if self.holder.get(g) == bid:
                del self.holder[g]
        return held

    def _to_front(self, items: list) -> None:
        for it in reversed(items):
            if self.quarantine.held(it.who):  # a suspended participant's groups never come back
                self.counts["groups_held_out"] += 1
                continue
            self.buffer[it.gid] = it
            self.buffer.move_to_end(it.gid, last=False)

    def state(self) -> dict:
        """What the book holds, as plain JSON values in a canonical form: group ids in buffer order, each open
        lease's ids, the window, acked and expired batches, versions, counts. Two books in this state hold the
        same groups in the same places and answer every request the same way."""
        return {"buffer": list(self.buffer), "leases": {b: [it.gid for it in h.items] for b, h in sorted(self.leases.items())},
                "lease_ids": {b: h.ids for b, h in sorted(self.leases.items())},
                "window": self.window.state(), "acked": [[b, n] for b, n in self.acked.items()],
                "expired": [[b, n] for b, n in self.expired.items()],
                "versions": self.versions.state(), "done": self.done, "counts": dict(self.counts),
                "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
                "pacing": self.pacing.book_state(),
                "receipts": self.receipts.state(), "quarantine": self.quarantine.state()}

    @classmethod
    def adopt(cls, live: dict, max_staleness: int, lease_s: float) -> Book:
        """A Book holding what a start read back (ledger.Ledger.live): the live proxy's from then on."""
        book = cls(max_staleness, lease_s)
        book.buffer, book.window, book.acked, book.expired = live["buffer"], live["window"], live["acked"], live["expired"]
        book.versions, book.done, book.staleness_hist = live["versions"], live["done"], live["staleness_hist"]
        book.leases = {b: Held(items, s, ids) for b, (items, s, ids) in live["leases"].items()}
        book.holder = {g: b for b, h in book.leases.items() for g in h.ids}
        book.counts = {k: live["counters"][k] for k in COUNTED}
        book.receipts, book.quarantine = live["receipts"], live["quarantine"]
        book.pacing = Pacer.from_state(live["pacing"], max_staleness)
        return book

"""What the proxy's journal means: the state it describes after any commit, built by applying the
journal's records in log order. journal.py stores the records and knows nothing of their meaning;
proxy.py writes them, keeps its live state, and drives a Ledger:

- a start reads the newest snapshot (a Ledger's to_snapshot(), written by journal.write_snapshot),
  applies every commit after it, and takes its live state from live(); without a snapshot it applies
  every commit ever written (a full replay): the same code either way. A snapshot or commit written in
  another protocol than this code's (common.PROTOCOL: every commit header, fence and snapshot names it)
  is not read: the start stops, saying which (ProtocolError);
- while it runs, the proxy applies each commit to its Ledger once the commit is in the bucket, so a
  snapshot is exactly the state after the commit it names, however far the live state has run ahead
  (a lease is taken before its write, an accepted group is buffered after it).

What the records do to the buffer, leases, window and versions is book.py's (a Ledger is a Book), so
the live proxy and replay follow the same rules.

Memory. Everything here is bounded by the run's settings, not its length: the buffer and open leases
(--max-buffer, a group's place named by the commit that holds its line, not its bytes), the window
(the groups accepted at the last max_staleness + 1 versions), the last BATCHES acked and expired batch
ids (a retried ack answers 409/410, not 404), registered versions as ranges, the workers table
(participants.py), the prompt cursors (prompts.py), the open prompt leases and the window's fingerprints
(receipts.py), one quarantine entry per participant (quarantine.py).
"""
from __future__ import annotations

import json
import re
import sys
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Iterator

from common import PROTOCOL, check_protocol
from book import BATCHES, Book, Entry, Held, Recent, Versions, Window  # noqa: F401 - BATCHES: the bound, for callers

from pacing import Pacer
from participants import Senders, worker_key
from prompts import Cursors
from quarantine import Quarantine
from receipts import Receipts

# what a start on a journal or snapshot of another protocol tells the person who started it
RESUME = "finish that run with the clone (commit) of async-grpo that started it, or start a new run (another --run)"

# a group line as we write it leads with these fields (proxy.py keeps a body as sent only when it does)
HEAD = re.compile(rb'^\{"group_id":"([^"]+)","worker_id":"([^"]*)","policy_version":(\d+),')
TAIL = re.compile(rb',"participant":"([a-z0-9_-]+)"\}\s*$')  # appended by the proxy to a participant's group

Ref = namedtuple("Ref", "gid version key raw who")    # a group as the ledger holds it: which commit holds its line


def position(key: str) -> tuple[int, int]:
    """(incarnation, seq) of a journal object, from its name."""
    inc, seq = key.rsplit("/", 1)[1].split(".")[0].split("-")
    return int(inc), int(seq)


class Ledger(Book):
    """A Book fed by the journal: the proxy's state after the last commit applied, with what replay needs
    beyond the book (prompt cursors, senders, the log's position, fences) and its snapshots."""

    def __init__(self, max_staleness: int, lease_s: float, max_workers: int = 4096, max_datasets: int = 64,
                 keep_raw: bool = True):
        """keep_raw: hold each buffered or leased group's line as read (a start); a running proxy holds the
        lines itself and its ledger only their places."""
        super().__init__(max_staleness, lease_s)
        self.keep_raw, self.max_workers, self.max_datasets = keep_raw, max_workers, max_datasets
        self.cursors = Cursors(0, max_datasets)
        self.senders = Senders(max_workers)
        self.trailer: dict = {}    # the counters line of the last commit: counts the log does not imply (429s)
        self.at = 0.0              # time of the commit being applied
        self.covers: str | None = None  # the last commit applied
        self.commits = 0           # commits applied, ever
        self.tip = (-1, 0)         # (incarnation, next seq) of the newest writer the log names: a start fences it
        self.fenced: dict[int, int] = {}  # incarnation -> its last seq that counts (a later start fenced it off)

    # ---- applying the log ---------------------------------------------------------------------------
    def apply_object(self, key: str, blob: bytes) -> None:
        """One journal object as read from the bucket. A commit of an incarnation after the seq where a later
        start fenced it off is not part of the log: that proxy died at its first put there (journal.put_fence),
        and a put already in flight may have landed after it, its callers never answered. ProtocolError: its
        header (a commit's or a fence's) names another protocol than this code's, or none."""
        inc, seq = position(key)
        if seq > self.fenced.get(inc, seq):
            print(f"proxy: {key} is not applied: incarnation {inc} was fenced off after seq {self.fenced[inc]}",
                  file=sys.stderr)
            return
        if blob:  # (b"": listed, then gone before it was read)
            check_protocol(json.loads(blob.split(b"\n", 1)[0]).get("protocol"), f"the journal object {key}", RESUME)
        for line in blob.splitlines():
            if line.startswith(b'{"group_id"'):
                self.group_line(key, line)
            elif line.strip():
                self.event(json.loads(line))
        self._done_with(key)

    def commit(self, key: str, at: float, records: list[bytes | dict]) -> None:
        """One commit as the running proxy wrote it (journal.Writer's `committed`): bytes are group lines."""
        self.at = at
        for r in records:
            if isinstance(r, bytes):
                self.group_line(key, r)
            else:
                self.event(r)
        self._done_with(key)

    def _done_with(self, key: str) -> None:
        self.covers = key
        self.commits += 1
        inc, seq = position(key)
        self.tip = max(self.tip, (inc, seq + 1))

    def group_line(self, key: str, line: bytes) -> None:
        m, tail = HEAD.match(line), TAIL.search(line, max(0, len(line) - 64))  # lines are ~33 kB: no full parse
        gid, version = m[1].decode(), int(m[3])
        if gid in self.window:  # logged twice: its first commit was answered as failed but landed, and the group,
            return              # sent again, was logged again (a start applies such a commit: snapshots.py)
        participant, worker = tail[1].decode() if tail else None, m[2].decode()
        self.senders.touch(participant, worker, self.at, groups=1, live=False)
        self.accept(Ref(gid, version, key, line if self.keep_raw else None, participant))
        self.pacing.arrived(worker_key(participant, worker))

    def event(self, e: dict) -> None:
        t = e.get("t")
        if t == "commit":
            self.at = e["time"]
        elif t == "fence":  # incarnation e["incarnation"] ends before e["seq"]; e["by"] writes from now on
            self.fenced[e["incarnation"]] = e["seq"] - 1
            self.tip = max(self.tip, (e["by"], 0))
        elif t == "lease":
            self.lease(e["batch_id"], e["group_ids"], e["lease_s"], e["latest"], e.get("left"), paid=e.get("paid"))
        elif t == "renew" and e["batch_id"] in self.leases:
            self.renew(e["batch_id"], e["lease_s"])
        elif t == "ack":
            self.ack(e["batch_id"])
        elif t == "expire" and e["batch_id"] in self.leases:
            self.return_lease(e["batch_id"])
        elif t == "version" and e["version"] > self.latest:
            self.register(e["version"], e["step"], e["published_at"], e["final"])
        elif t == "cursor":
            self.cursors.apply(e)
        elif t == "stale":  # refused as stale on arrival
            self.counts["groups_dropped_stale"] += 1
            self.senders.touch(e.get("participant"), e["worker_id"], self.at, live=False)
            self.pacing.arrived(worker_key(e.get("participant"), e["worker_id"]))
        elif t == "grant":  # prompts granted to a worker (pacing.py)
            self.pacing.grant(e["key"], e["n"], e["version"], round_s=e["round_s"], dev_s=e["dev_s"])
        elif t == "release":  # a worker asked again: its open grant is closed (pacing.py)
            self.pacing.close(e["key"])
        elif t == "demand":  # what the trainer will still lease, as a lease request said (pacing.py)
            self.pacing.demand = e["groups_left"]
        elif t == "duplicate":
            self.counts["groups_duplicate"] += 1
        elif t == "prompts":  # a prompt lease and whom it went to (receipts.py)
            self.receipts.bind(e["lease_id"], e.get("participant"), e["dataset"], e["indices"], e["latest"])
        elif t == "receipt":  # what a group accepted in the same commit used up
            self.receive(e["group_id"], e["fp"], e.get("lease_id"), e.get("index"))
        elif t == "checked":  # the trainer audited these many groups of each participant (quarantine.py)
            self.quarantine.checked(e["counts"])
        elif t == "failed":
            self.fail(e["participant"], e["group_id"], e["check"], e["detail"], e["limit"], e["at"])
        elif t == "reinstate":
            self.reinstate(e["participant"], e["at"])
        elif t == "counters":
            self.trailer = dict(e["counters"])

    # ---- snapshots ------------------------------------------------------------------------------------
    def to_snapshot(self) -> dict:
        """The state after commit `covers`, as plain JSON values that share nothing with the ledger (taken on
        the event loop between two commits; encoded and written in a thread while the ledger moves on)."""
        ref = lambda r: [r.gid, r.version, r.key, r.who]  # noqa: E731
        return {"protocol": PROTOCOL, "covers": self.covers, "commits": self.commits, "at": self.at,
                "buffer": [ref(r) for r in self.buffer.values()],
                "leases": [[b, [ref(r) for r in h.items], h.lease_s, list(h.ids)] for b, h in self.leases.items()],
                "window": self.window.state(), "acked": [[b, n] for b, n in self.acked.items()],
                "expired": [[b, n] for b, n in self.expired.items()], "versions": self.versions.state(),
                "done": self.done, "cursors": {d: dict(c) for d, c in self.cursors.table.items()},
                "senders": self.senders.state(), "counts": dict(self.counts),
                "staleness_hist": {str(k): v for k, v in self.staleness_hist.items()}, "pacing": self.pacing.state(),
                "trailer": dict(self.trailer), "tip": list(self.tip),
                "fenced": {str(k): v for k, v in self.fenced.items()},
                "receipts": self.receipts.state(), "quarantine": self.quarantine.state()}

    @classmethod
    def from_snapshot(cls, d: dict, max_staleness: int, lease_s: float, max_workers: int = 4096,
                      max_datasets: int = 64, keep_raw: bool = True, name: str = "a snapshot") -> Ledger:
        """The ledger a snapshot (to_snapshot()) holds; ProtocolError when it was written in another protocol
        than this code's. name: the snapshot's key, for that message."""
        check_protocol(d.get("protocol"), f"the snapshot {name}", RESUME)
        led = cls(max_staleness, lease_s, max_workers, max_datasets, keep_raw)
        ref = lambda x: Ref(x[0], x[1], x[2], None, x[3])  # noqa: E731
        led.covers, led.commits, led.at = d["covers"], d["commits"], d["at"]
        led.buffer = OrderedDict((x[0], ref(x)) for x in d["buffer"])
        led.leases = {b: Held([ref(x) for x in refs], lease_s_, ids) for b, refs, lease_s_, ids in d["leases"]}
        led.holder = {g: b for b, h in led.leases.items() for g in h.ids}
        led.window = Window.from_state(d["window"])
        led.acked, led.expired = Recent(map(tuple, d["acked"])), Recent(map(tuple, d["expired"]))
        led.versions, led.done = Versions.from_state(d["versions"]), d["done"]
        led.cursors.table = {k: dict(v) for k, v in d["cursors"].items()}
        led.senders = Senders.from_state(d["senders"], max_workers)
        led.counts = dict(d["counts"])
        led.staleness_hist = {int(k): v for k, v in d["staleness_hist"].items()}
        led.trailer = d["trailer"]
        led.pacing = Pacer.from_state(d["pacing"], max_staleness, max_workers)
        led.fenced = {int(k): v for k, v in d["fenced"].items()}
        led.receipts, led.quarantine = Receipts.from_state(d["receipts"]), Quarantine.from_state(d["quarantine"])
        led.tip = tuple(d["tip"])
        return led

    # ---- what a start hands the live proxy ----------------------------------------------------------
    def counters(self) -> dict:
        """What the log implies, recounted; the rest (429s) from the last commit's counters line (none in an
        empty log)."""
        return {**self.trailer, **self.counts}

    def live(self, read: Callable[[list[str]], Iterator[tuple[str, bytes]]]) -> dict:
        """The live proxy's state, sharing nothing with the ledger. Groups whose line the ledger does not hold
        are read back from their commits (`read`: keys -> (key, bytes)); buffer and leases as Entry lists."""
        missing = {r.gid: r.key for r in self._refs() if r.raw is None}
        lines = {}
        for _, blob in read(sorted(set(missing.values()))):
            for line in blob.splitlines():
                if line.startswith(b'{"group_id"') and (gid := HEAD.match(line)[1].decode()) in missing:
                    lines[gid] = line
        entry = lambda r: Entry(r.gid, r.version, r.raw if r.raw is not None else lines.get(r.gid), r.who)  # noqa: E731
        lost = [gid for gid in missing if gid not in lines]
        snap = self.to_snapshot()
        return {"buffer": OrderedDict((g, entry(r)) for g, r in self.buffer.items() if g not in lost),
                "leases": {b: ([entry(r) for r in h.items if r.gid not in lost], h.lease_s, list(h.ids))
                           for b, h in self.leases.items()},
                "lost": lost, "window": Window.from_state(snap["window"]),
                "acked": Recent(self.acked.items()), "expired": Recent(self.expired.items()),
                "versions": Versions.from_state(snap["versions"]), "done": self.done, "cursors": snap["cursors"],
                "senders": Senders.from_state(snap["senders"], self.max_workers), "counters": self.counters(),
                "pacing": snap["pacing"],
                "receipts": Receipts.from_state(snap["receipts"]), "quarantine": Quarantine.from_state(snap["quarantine"]),
                "staleness_hist": dict(self.staleness_hist)}

    def _refs(self) -> Iterator[Ref]:
        yield from self.buffer.values()
        for h in self.leases.values():
            yield from h.items

    def forget_lines(self) -> None:
        """From now on the live proxy holds the lines: keep only their places."""
        self.keep_raw = False
        self.buffer = OrderedDict((g, r._replace(raw=None)) for g, r in self.buffer.items())
        self.leases = {b: h._replace(items=[r._replace(raw=None) for r in h.items]) for b, h in self.leases.items()}

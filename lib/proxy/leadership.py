"""Who leads a run's proxy, and the standby that takes over when the leader stops renewing (docs/proxy.md,
"A standby"). proxy.py owns one Term (when it leads) or one Follower (while it stands by).

    proxy/leader.json     {"writer", "incarnation", "url", "term_s", "n", "since", "released"}

The leader record. Each write is conditional on the ETag its writer last saw (If-Match; If-None-Match when
there is none), so of two proxies racing for it exactly one wins. The leader rewrites it every term_s / 4
(n counts the renewals, so every write has new bytes and a new ETag).

The clocks. Nothing compares two hosts' clocks, and no wall time is read to decide anything: each process
judges time with its own monotonic clock only.
- the leader: a renewal counts from the moment its put STARTED. Once SAFE * term_s has passed since the start
  of its last renewal that succeeded, it answers nothing but /health and /metrics (503 + Retry-After) until a
  renewal succeeds again; a renewal refused (412: someone else wrote the record) deposes it for good (it exits).
- a standby: a term counts from the moment IT SAW the record change (its poll that first read the new ETag),
  which is after the put that changed it began. It takes over once max(its --term-s, the record's term_s) has
  passed on its own clock without a change, with a put conditional on the ETag it saw: a renewal meanwhile
  makes that put fail, and it goes on standing by.
So the leader stops at most SAFE * term_s after its renewal began, the standby starts no sooner than term_s
after that renewal landed: the margin, (1 - SAFE) * term_s, absorbs the two clocks' rate difference and a
slow poll, not any offset. Safety never rests on this timing alone: the new leader fences the old
incarnation's next journal key (snapshots.Keeper.fence_off), so whatever the old one still tries to commit is
refused (412) and never answered as a success.

A clean stop marks the record released: a standby then takes over at its next poll, not after a term.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable

import journal
from common import Bucket, BucketError, ConflictError
from ledger import Ledger, position
from snapshots import Keeper

LEADER = "proxy/leader.json"
SAFE = 0.7    # of a term: how long after its last renewal began a leader still answers
RENEWS = 4    # renewals per term


def read_record(bucket: Bucket) -> tuple[dict, str] | None:
    """The leader record and its ETag, or None when nobody wrote one (a record that is not JSON: an empty one)."""
    got = bucket.get(LEADER)
    if got is None:
        return None
    try:
        record = json.loads(got[0])
    except ValueError:
        record = {}
    return (record if isinstance(record, dict) else {}), got[1]


class Deposed(RuntimeError):
    """Another proxy wrote the leader record: this one leads no more."""


class Term:
    """The leader's side: claim the record, renew it, and say whether this process may still answer."""

    def __init__(self, bucket: Bucket, term_s: float, url: str | None = None):
        self.bucket, self.term_s, self.url = bucket, term_s, url
        self.writer, self.incarnation, self.n = uuid.uuid4().hex, None, 0
        self.etag: str | None = None
        self.renewed_at = -float("inf")  # monotonic start of the last renewal that succeeded
        self.since = None                # wall time this process became leader (reported only)
        self.since_mono = None
        self.released = False

    def record(self) -> bytes:
        return json.dumps({"writer": self.writer, "incarnation": self.incarnation, "url": self.url, "term_s": self.term_s,
                           "n": self.n, "since": self.since, "released": self.released}).encode()

    def _put(self, etag: str | None) -> None:
        """One conditional write of the record; ConflictError when the ETag is not the record's any more."""
        t0 = time.monotonic()
        self.n += 1
        self.etag = self.bucket.put(LEADER, self.record(), if_match=etag, if_none_match=etag is None)
        self.renewed_at = t0

    def claim(self, seen: str | None) -> bool:
        """A standby's claim, conditional on the ETag it saw lapse: False when the record changed meanwhile."""
        self.since, self.since_mono = round(time.time(), 3), time.monotonic()
        try:
            self._put(seen)
        except ConflictError:
            self.since = self.since_mono = None
            return False
        except BaseException:  # the bucket unreachable: not claimed (the caller tries again)
            self.since = self.since_mono = None
            raise
        return True

    def seize(self) -> None:
        """A start without --standby leads at once (as a start always did: it fences whoever wrote the journal
        before it): the record is written over whatever it holds, still conditionally, so a concurrent claim is
        seen and read again."""
        while True:
            got = read_record(self.bucket)
            if self.claim(None if got is None else got[1]):
                return

    def holds(self, now: float | None = None) -> bool:
        """Whether this leader may still answer: its last renewal began less than SAFE * term_s ago."""
        return not self.released and (time.monotonic() if now is None else now) - self.renewed_at < SAFE * self.term_s

    def renew(self) -> None:
        """Deposed when the record was written by someone else since our last write."""
        try:
            self._put(self.etag)
        except ConflictError:
            raise Deposed("the leader record was written by another proxy: it leads now") from None

    def release(self) -> None:
        """A clean stop: the record says so, and a standby takes over at its next poll."""
        self.released = True
        try:
            self._put(self.etag)
        except (ConflictError, BucketError):
            pass

    async def run(self, deposed: Callable[[str], None]) -> None:
        """Renew every term_s / RENEWS until deposed (then deposed(why), which stops the process). A renewal that
        fails otherwise (the bucket unreachable) is tried again at the next turn; meanwhile holds() runs out."""
        began = time.monotonic()
        while not self.released:  # every term_s / RENEWS from the last one's start: a slow put shortens the pause
            await asyncio.sleep(max(0.0, began + self.term_s / RENEWS - time.monotonic()))
            began = time.monotonic()
            try:
                await asyncio.to_thread(self.renew)
            except Deposed as e:
                deposed(str(e))
                return
            except BucketError as e:
                print(f"proxy: leader record not renewed ({e}); {self.left():.1f}s of the term left", file=sys.stderr, flush=True)

    def left(self) -> float:
        return SAFE * self.term_s - (time.monotonic() - self.renewed_at)

    def stats(self) -> dict:
        now = time.monotonic()
        return {"role": "leader", "incarnation": self.incarnation, "since": self.since,
                "leading_s": None if self.since_mono is None else round(now - self.since_mono, 3),
                "term_s": self.term_s, "renewed_s_ago": round(now - self.renewed_at, 3), "holds": self.holds(now)}


class Follower:
    """A standby's side: the state of the journal as it is written (a Keeper's ledger, applied commit by commit),
    and the leader record, watched for a lapse. Blocking calls: proxy.py runs each step in a thread."""

    def __init__(self, keeper: Keeper, term_s: float, gap_s: float = 5.0):
        self.keeper, self.term_s, self.gap_s = keeper, term_s, gap_s
        self.keeper.ledger.keep_raw = True  # the lines of buffered groups in memory: a takeover reads none back
        self.after: str | None = None       # the last journal key handled (applied, or skipped as fenced)
        self.seen: str | None = None        # the leader record's ETag as last read
        self.record: dict = {}
        self.changed_at = time.monotonic()  # when this process saw the record change (or started)
        self.caught_up_at = time.monotonic()  # when it last applied every commit it listed
        self.stuck: tuple[str | None, float] = (None, 0.0)  # the key it waits behind, and since when
        self.unapplied = 0                  # commits listed but not applied at the last step
        self.applied_at = -float("inf")     # when it last applied a commit

    def load(self) -> str:
        """The newest snapshot, as a start reads it; then every commit after it (follow)."""
        got = journal.read_snapshot(self.keeper.bucket)
        if got:
            self.keeper.ledger = Ledger.from_snapshot(got[2], **self.keeper.limits, name=got[0])
        self.keeper.before = self.keeper.ledger.commits
        self.after = self.keeper.ledger.covers
        return f"snapshot {got[0]}" if got else "the first commit"

    def expected(self) -> tuple[int, int]:
        """The next journal key in log order: the tip's (an empty log: incarnation 0's first)."""
        tip = self.keeper.ledger.tip
        return (0, 0) if tip[0] < 0 else tip

    def follow(self, most: int = 512) -> int:
        """Apply the commits written since the last step, in log order, stopping before a gap (a commit still
        in flight, whose successor landed first: it is applied once it lands). Returns how many were applied."""
        ledger, bucket = self.keeper.ledger, self.keeper.bucket
        keys = journal.log_keys(bucket, after=self.after)
        done = 0
        for key, blob in journal.read_objects(bucket, keys[:most], threads=8):
            if position(key) > self.expected() or not blob:
                break
            ledger.apply_object(key, blob)
            self.after, done = key, done + 1
        self.unapplied = len(keys) - done
        now = time.monotonic()
        if done:
            self.applied_at = now
        if not self.unapplied:
            self.caught_up_at, self.stuck = now, (None, 0.0)
        elif self.stuck[0] != self.after:
            self.stuck = (self.after, now)
        elif now - self.stuck[1] > self.gap_s:
            self.skip_gap()
        return done

    def skip_gap(self) -> None:
        """A gap that stays is a commit that failed (its callers were told so): the leader writes a snapshot past
        it only once it knows that commit absent (snapshots.Keeper.snapshot); load that one."""
        got = journal.read_snapshot(self.keeper.bucket)
        if got and got[1] > (self.after or ""):
            self.keeper.ledger = Ledger.from_snapshot(got[2], **self.keeper.limits, name=got[0])
            self.after, self.stuck = self.keeper.ledger.covers, (None, 0.0)
            print(f"proxy standby: a journal gap stayed; continuing from {got[0]}", file=sys.stderr, flush=True)

    def lapsed(self) -> bool:
        """Read the leader record; True once it has not changed for a term on this process's clock (or says released)."""
        got = read_record(self.keeper.bucket)
        etag = None if got is None else got[1]
        now = time.monotonic()
        if etag != self.seen:
            self.seen, self.record, self.changed_at = etag, (got[0] if got else {}), now
        term = max(self.term_s, float(self.record.get("term_s") or 0))
        # no record at all, but commits coming: a leader started without --term-s writes; it is not taken over
        alive = self.changed_at if got is not None else max(self.changed_at, self.applied_at)
        return bool(self.record.get("released")) or now - alive > term

    def stats(self) -> dict:
        now = time.monotonic()
        return {"role": "standby", "leader": {k: self.record.get(k) for k in ("incarnation", "url", "since")},
                "record_unchanged_s": round(now - self.changed_at, 3), "applied_commits": self.keeper.ledger.commits,
                "last_applied": self.after, "lag_commits": self.unapplied,
                "behind_s": round(now - self.caught_up_at, 3), "term_s": self.term_s}


SERVED_ALWAYS = ("/health", "/metrics")  # a standby (or a leader unsure of its term) answers these, and only these


def gate(app, refusal: Callable[[], str | None]):
    """ASGI middleware: while refusal() says why, every request but SERVED_ALWAYS gets 503 + Retry-After, its
    body unread, so clients retry (ProxyClient: at the address proxy/endpoint.json names by then)."""
    async def middleware(scope, receive, send):
        if scope["type"] != "http" or scope["path"] in SERVED_ALWAYS or (why := refusal()) is None:
            return await app(scope, receive, send)
        body = json.dumps({"detail": why}).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
    return middleware

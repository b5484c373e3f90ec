"""How the proxy's state survives it: a start rebuilds the state from the newest snapshot and the commits
after it, and a running proxy writes a snapshot now and then, off its event loop. journal.py holds the
objects' format, ledger.py what the records mean; proxy.py owns a Keeper and hands its live state over.

When: every `every_s` seconds or `every_commits` commits, whichever comes first, if anything was
committed since the last one; at once after a start that read any commit past its snapshot (so that
quick restarts, a crash loop say, never pile up a long tail); and once more at a clean stop (a
relaunch after a timeout then reads no commits at all).
"""
from __future__ import annotations

import asyncio
import sys
import time

import journal
from common import Bucket, BucketError, ConflictError
from ledger import Ledger


class Keeper:
    def __init__(self, bucket: Bucket, **limits):
        """limits: Ledger's max_staleness, lease_s, max_workers, max_datasets (this start's settings)."""
        self.bucket, self.limits = bucket, limits
        self.ledger = Ledger(**limits)
        self.uncertain: list[str] = []  # commits that failed: a snapshot waits until each is known absent
        self.snapped = 0                # ledger.commits when the last snapshot was taken
        self.due = False                # a snapshot is due at once (the start read commits past its snapshot)
        self.before = 0                 # ledger.commits of the snapshot the start (or standby) read
        self.store_checked = False      # check_store ran

    def start(self) -> tuple[dict, int, str]:
        """Read the state back (before the server accepts requests): (Ledger.live()'s state, this start's
        incarnation, a line for the log). common.ProtocolError, before anything is written: the snapshot or a
        commit was written in another protocol than this code's (its message says which, and what to do);
        journal.UnfitStore, before the journal is written to: the bucket ignores conditional writes."""
        t0, snap, start = time.time(), journal.read_snapshot(self.bucket), "the first commit"
        if snap:
            self.ledger, start = Ledger.from_snapshot(snap[2], **self.limits, name=snap[0]), f"snapshot {snap[0]}"
        self.before = self.ledger.commits
        n = self.catch_up()
        self.check_store()
        live, incarnation = self.finish()
        return live, incarnation, f"state from {start} and {n} commits in {time.time() - t0:.1f}s"

    def check_store(self) -> None:
        """journal.require_conditional_writes, once: after the protocol is known (a run of another is refused with
        nothing written to it), before the first journal write (the fence)."""
        if not self.store_checked:
            journal.require_conditional_writes(self.bucket)
            self.store_checked = True

    def catch_up(self) -> int:
        """Apply every commit after the ledger's (a start; a standby taking over); returns how many."""
        keys = journal.log_keys(self.bucket, after=self.ledger.covers)
        for key, blob in journal.read_objects(self.bucket, keys):
            self.ledger.apply_object(key, blob)
        return len(keys)

    def finish(self) -> tuple[dict, int]:
        """Fence the last writer off and hand the state over: (Ledger.live()'s state, this start's incarnation)."""
        incarnation = self.fence_off()
        live = self.ledger.live(lambda keys: journal.read_objects(self.bucket, keys))
        self.ledger.forget_lines()
        self.snapped, self.due = self.before, self.ledger.commits > self.before
        if live["lost"]:  # only if someone deleted journal objects: a full replay could not find them either
            print(f"proxy: {len(live['lost'])} buffered or leased groups are missing from the journal", file=sys.stderr)
        return live, incarnation

    def fence_off(self) -> int:
        """Stop the proxy that wrote the log last, should it still run, from writing to it again (a fence at its
        next key, journal.put_fence); what it wrote before the fence is applied. Returns this start's
        incarnation: one more than the newest writer the log names."""
        while True:
            inc, seq = self.ledger.tip
            if inc < 0:
                return 0  # an empty log: nobody to fence
            try:
                key, data = journal.put_fence(self.bucket, inc, seq, by=inc + 1)
            except ConflictError:  # it wrote that commit meanwhile, or another start fenced it first
                key = journal.object_name(inc, seq)
                got = self.bucket.get(key)
                self.ledger.apply_object(key, got[0] if got else b"")
                continue
            self.ledger.apply_object(key, data)
            return inc + 1

    async def snapshot(self, incarnation: int, writer: str) -> bool:
        """Write one if anything was committed since the last: the ledger's state, taken between two commits,
        encoded and written in a thread (nothing waits for it). False: no more until the next start."""
        if self.ledger.commits == self.snapped:
            return True
        checked = list(self.uncertain)
        if checked and await asyncio.to_thread(lambda: [k for k in checked if self.bucket.get(k) is not None]):
            # a commit answered as failed is in the bucket after all: only a start applies it in its place
            print("proxy: a failed journal commit was written after all; no snapshots until the next start", file=sys.stderr)
            return False
        del self.uncertain[:len(checked)]
        commits, covers, state = self.ledger.commits, self.ledger.covers, self.ledger.to_snapshot()
        await asyncio.to_thread(journal.write_snapshot, self.bucket, covers, state, incarnation, writer)
        self.snapped = commits
        return True

    async def run(self, every_s: float, every_commits: int, incarnation: int, writer: str) -> None:
        last = time.monotonic() - (every_s if self.due else 0.0)
        while True:
            await asyncio.sleep(1.0)
            if self.ledger.commits - self.snapped < every_commits and time.monotonic() - last < every_s:
                continue
            try:
                if not await self.snapshot(incarnation, writer):
                    return
                last = time.monotonic()
            except (BucketError, ConflictError) as e:  # nothing depends on it: the next turn tries again
                print(f"proxy: snapshot not written, trying again later: {e}", file=sys.stderr, flush=True)

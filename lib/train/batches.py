"""How train.py gets its batches from the proxy: a lease, waited for as long as it takes, and the next one asked
for before a step ends (prefetch).

Why prefetch: a lease is not free. At 1,000 simulated workers and batches of 800 groups it took a median 0.33 s
beyond the wait for groups (the proxy's journal write, its turn in the proxy's event loop, the 2.4 MB answer's
transfer and parse), against steps of about 4.5 s (docs/results/fleet.md): seven points of the trainer's time. Asked for
once the step's update is made, the lease overlaps the step's publish and registration. The request says which
version the batch will be trained from (after_version: the one this step registers), so the proxy's staleness
filter and pacing count from it, not from the version before (lib/proxy/pacing.py).

Why not as the step begins: from the lease until the version registers the trainer holds two batches,
and a round granted meanwhile may be trained only by the leases after both (pacing's base), so the staleness
window open to new rounds is a batch shorter for the whole step; where steps are shorter than rounds that is
what the trainer waited behind (docs/results/fleet.md). Asked for at the publish, it is a batch shorter only while the
version is published and registered; and the batch takes the groups that came while the step trained.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import httpx

from proxy_client import ProxyClient
from trainer_state import Owner, TrainedGroups


def merged(a: dict, b: dict) -> dict:
    """Two batches' audit metrics as one step's: counts and seconds added, the largest deviations kept. A batch whose
    every group the audit left out (a liar's batch, say) is passed over, and its failures are counted in the row of
    the step that trains the next one, not lost."""
    out = dict(b)
    for k, x in a.items():
        out[k] = max(x, out.get(k, x)) if k.endswith("_max") else x + out.get(k, 0)
    return out


class Batches:
    """The trainer's batches: `batch_groups` groups a step, each lease long-polled `wait_s` seconds at a time, for
    steps up to `max_steps` (what is left tells the proxy's pacing how many more groups the trainer will lease,
    so that no round is generated past it). Every lease is kept renewed by `trained` from the moment it comes."""

    def __init__(self, client: ProxyClient, owner: Owner, trained: TrainedGroups, stop: threading.Event,
                 batch_groups: int, wait_s: float, max_steps: int):
        self.client, self.owner, self.trained, self.stop = client, owner, trained, stop
        self.batch_groups, self.wait_s, self.max_steps = batch_groups, wait_s, max_steps

    def ask(self, step: int, after: int | None = None,
            waiting: Callable[[dict], None] = lambda got: None) -> dict | None:
        """Batch `step` from the proxy, however long the rollouts take (None once we are stopping). after: the
        version we register before training it (a batch asked for while the step before trains); its
        latest_version is then the version it is trained from. waiting(answer): an empty answer came."""
        ask = {"num_groups": self.batch_groups, "wait_s": self.wait_s,
               "groups_left": (self.max_steps - step + 1) * self.batch_groups,
               **({} if after is None else {"after_version": after})}
        while not self.stop.is_set():
            try:
                got = self.client.post("/v1/batches/lease", ask)
            except httpx.HTTPError:  # the client waits out outages: this means SIGTERM
                return None
            if got["batch_id"]:
                got["latest_version"] = max(got["latest_version"], after or 0)
                return got
            waiting(got)
            self.owner.check()  # a starving trainer is alive: keep its heartbeat fresh, and notice a takeover
        return None

    def prefetch(self, step: int, after: int | None) -> Future:
        """ask() in a thread of its own, while this step publishes: its Future. The lease is renewed from the
        moment it comes (trained.hold), as a step may outlast it. A daemon thread: a trainer that stops does not
        wait for a long-poll; a batch that came and will not be trained is released (let_go)."""
        fut: Future = Future()

        def run() -> None:
            try:
                got = self.ask(step, after)
                if got is not None:
                    self.trained.hold(got)
                fut.set_result(got)
            except BaseException as e:  # noqa: BLE001 - a takeover (TakenOver) or a 4xx: raised where it is awaited
                fut.set_exception(e)
        threading.Thread(target=run, name=f"prefetch-{step}", daemon=True).start()
        return fut

    def lease(self, step: int, audit: Callable[[dict], tuple[list[dict], dict]] = lambda got: (got["fresh"], {}),
              ahead: Future | None = None, show: Callable[[str], None] = lambda line: None) -> dict | None:
        """Wait for a batch with something left to train on (the time spent here is the trainer starving
        for rollouts); None once we are stopping. ahead: the batch prefetched for this step (a Future), tried
        first. Adds `fresh` (the groups to train on: not trained already, and passed by `audit`, which also
        returns its metrics, `audit`) and `skipped` (the ids of those left out as already trained, from this
        batch and any passed over before it). show(line): what the trainer waits for, for its progress bar."""
        skipped: list[str] = []
        passed: dict = {}  # the audit's metrics of the batches passed over: counted in the batch returned

        def waiting(got: dict) -> None:
            show(f"waiting for rollouts (buffer {got['buffer_size']})")
        while not self.stop.is_set():
            got = ahead.result() if ahead is not None else self.ask(step, None, waiting)
            ahead = None
            if got is None:
                return None
            got["fresh"], left_out = self.trained.hold(got)
            skipped += left_out
            if got["fresh"]:
                got["fresh"], got["audit"] = audit(got)
            if got["fresh"]:
                return {**got, "audit": merged(passed, got.get("audit", {})), "skipped": skipped}
            passed = merged(passed, got.get("audit", {}))
            self.trained.trained_on(got)  # nothing (new, or that passed the audit) in it: acked with the next checkpoint's batches
        return None

    def let_go(self, ahead: Future | None) -> None:
        """We stop with the next batch asked for ahead: one that came goes back to the proxy's buffer now, not when
        its lease runs out. One still being asked for is left: its long-poll ends with the process, and the proxy
        gives nothing to a client that has gone."""
        if ahead is not None and ahead.done() and ahead.exception() is None and ahead.result() is not None:
            self.trained.release(ahead.result())

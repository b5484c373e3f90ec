"""Who sent the run's groups, for /v1/stats and /metrics: per participant (the name of the token that
sent them; the run's own jobs, on the admin token, are "admin") and per worker. A worker is keyed
`participant/worker_id` (the run's own: `worker_id`), so no participant can pass for another's worker:
the worker_id in a group is the participant's own label for one of its processes, nothing more.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque

from prometheus_client.core import GaugeMetricFamily

from access import ADMIN


def worker_key(participant: str | None, worker: str) -> str:
    """How a worker is keyed here and in pacing.py: `participant/worker_id`, the run's own `worker_id`."""
    return worker if participant is None else f"{participant}/{worker}"


class Senders:
    def __init__(self, max_workers: int = 4096):
        self.max_workers = max_workers  # worker ids are the clients' to choose: the least recently seen go first
        self.workers: OrderedDict[str, dict] = OrderedDict()  # key -> {last_seen, groups, recent}
        self.participants: dict[str, dict] = {}               # name -> {groups, last_seen}

    def touch(self, participant: str | None, worker: str, at: float, groups: int = 0, live: bool = True) -> None:
        """`worker` of `participant` (None: the admin token) sent `groups` groups (0: refused as stale) at `at`;
        live: now, rather than replayed from the journal (only live ones count toward groups per second)."""
        key = worker_key(participant, worker)
        d = self.workers.pop(key, None) or {"last_seen": 0.0, "groups": 0, "recent": deque(maxlen=100_000)}
        self.workers[key] = d  # most recent last
        if len(self.workers) > self.max_workers:
            self.workers.popitem(last=False)
        d["last_seen"] = at
        d["groups"] += groups
        if groups and live:
            d["recent"].append(at)
        p = self.participants.setdefault(participant or ADMIN, {"groups": 0, "last_seen": 0.0})
        p["groups"] += groups
        p["last_seen"] = at

    def state(self) -> dict:
        """What a snapshot keeps (the per-second window is live only: it starts empty after a restart)."""
        return {"workers": [[k, d["last_seen"], d["groups"]] for k, d in self.workers.items()],
                "participants": {n: dict(d) for n, d in self.participants.items()}}

    @classmethod
    def from_state(cls, state: dict, max_workers: int = 4096) -> "Senders":
        s = cls(max_workers)
        for key, last_seen, groups in state["workers"][-max_workers:]:
            s.workers[key] = {"last_seen": last_seen, "groups": groups, "recent": deque(maxlen=100_000)}
        s.participants = {n: dict(d) for n, d in state["participants"].items()}
        return s

    def stats(self, now: float, roles: dict[str, dict]) -> dict:
        """{"participants": {name: {groups, last_seen_s_ago?, **roles[name]}}, "workers": {key: {groups, last_seen_s_ago}}}"""
        people = {n: {"groups": 0, **info} for n, info in roles.items()}
        for n, d in self.participants.items():
            people.setdefault(n, {}).update(groups=d["groups"], last_seen_s_ago=round(now - d["last_seen"], 1))
        return {"participants": people,
                "workers": {w: {"last_seen_s_ago": round(now - d["last_seen"], 1), "groups": d["groups"]}
                            for w, d in self.workers.items()}}

    def collect(self):
        """Prometheus gauges: each worker's last group and groups/s over the last minute; each participant's groups."""
        seen = GaugeMetricFamily("proxy_worker_last_seen_timestamp", "unix time of a worker's last group", labels=["worker"])
        rate = GaugeMetricFamily("proxy_worker_groups_per_second", "a worker's groups over the last 60 s", labels=["worker"])
        part = GaugeMetricFamily("proxy_participant_groups", "groups accepted from a participant", labels=["participant"])
        for w, d in self.workers.items():
            while d["recent"] and d["recent"][0] < time.time() - 60:
                d["recent"].popleft()
            seen.add_metric([w], d["last_seen"])
            rate.add_metric([w], len(d["recent"]) / 60.0)
        for n, d in self.participants.items():
            part.add_metric([n], d["groups"])
        yield from (seen, rate, part)

"""What the proxy tells an autoscaler (lib/jobs/autoscale.py) about the fleet, in /v1/stats' `fleet`: how long the
trainer waited with nothing to train, how long workers waited for grants, and which workers were asked to leave.

    curl -s -H "Authorization: Bearer $PROXY_TOKEN" localhost:8000/v1/stats | python -m json.tool | grep -A12 fleet

Every time here is this process's monotonic clock, and `clock_s` is how long it has run: a reader takes the
difference of two readings of the same incarnation (utilisation over the window = 1 - d idle_s / d clock_s) and
compares no clock of its own with them. Live only: a restart starts every sum at 0 (a new incarnation), and the
asked-to-leave set is given again by whoever decided it (the supervisor tells it at every look).

The trainer is idle while a lease request of its is open and it holds no batch whose version it has still to make:
from the request when it asks with nothing in hand (train.py's first request, or after a restart), from the
registration of the version it was making when it asked ahead (prefetch: the request of the next batch is made
while the current one's version is published). A worker waits for a grant from its paced request to the answer.

A worker asked to leave gets, at its next prompt request naming its worker_id, no prompts and `leave` (the reason;
rollout.py exits cleanly): it asks only after sending its round, so the round it was generating is sent, not lost.
What its request closes of a grant (groups granted that never arrived) is counted as `groups_released_at_leave`;
the tokens of such groups were never generated, so they cost nothing but the place they held.
"""
from __future__ import annotations


class FleetClock:
    """The trainer's idle seconds and the workers' grant waits, summed on this process's clock."""

    def __init__(self, now: float):
        self.t0 = now
        self.trainer_idle_s = 0.0
        self.idle_since: float | None = None   # the trainer idles since (None: it does not)
        self.asking = 0                        # the trainer's lease requests open now
        self.grant_wait_s = 0.0
        self.waits_open: dict[int, float] = {}  # an open paced request -> when it began

    # the trainer
    def asked(self, now: float, holds_work: bool) -> None:
        """A lease request; holds_work: it asked ahead, while still making the version before this batch's."""
        self.asking += 1
        if not holds_work and self.idle_since is None:
            self.idle_since = now

    def registered(self, now: float) -> None:
        """A version registered: a trainer that asked ahead for its next batch and still waits has nothing to do."""
        if self.asking and self.idle_since is None:
            self.idle_since = now

    def answered(self, now: float) -> None:
        """A lease request answered (a batch, or none after its wait_s: the trainer asks again at once)."""
        self.asking = max(0, self.asking - 1)
        if not self.asking and self.idle_since is not None:
            self.trainer_idle_s += now - self.idle_since
            self.idle_since = None

    # the workers
    def wait_began(self, token: int, now: float) -> None:
        self.waits_open[token] = now

    def wait_ended(self, token: int, now: float) -> None:
        if (began := self.waits_open.pop(token, None)) is not None:
            self.grant_wait_s += now - began

    def stats(self, now: float) -> dict:
        """The sums up to now, the waits still open included."""
        idle = self.trainer_idle_s + (now - self.idle_since if self.idle_since is not None else 0.0)
        waits = self.grant_wait_s + sum(now - t for t in self.waits_open.values())
        return {"clock_s": round(now - self.t0, 3), "trainer_idle_s": round(idle, 3),
                "trainer_waiting": self.idle_since is not None, "grant_wait_s": round(waits, 3)}


class Leaving:
    """Workers asked to leave (by worker key), and the groups their last grants held when they left."""

    MAX = 4096  # keys are the supervisor's to give; a bound keeps a runaway caller from growing this for good

    def __init__(self):
        self.keys: dict[str, str] = {}   # key -> why
        self.left: set[str] = set()      # told, at a prompt request of theirs
        self.groups_released = 0

    def ask(self, key: str, why: str) -> bool:
        """Ask `key` to leave; False when the set is full."""
        if key not in self.keys and len(self.keys) >= self.MAX:
            return False
        self.keys[key] = why
        return True

    def told(self, key: str, released: int) -> str | None:
        """Why `key` must leave (None: it need not); its request closed `released` groups of a grant."""
        why = self.keys.get(key)
        if why is not None:
            self.left.add(key)
            self.groups_released += released
        return why

    def stats(self) -> dict:
        return {"asked_to_leave": sorted(self.keys), "told_to_leave": sorted(self.left),
                "groups_released_at_leave": self.groups_released}

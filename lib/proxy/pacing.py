"""Pacing: the proxy hands a worker prompts (a grant) only when the round it is about to generate can still
be trained within max_staleness, and within what the trainer will still lease; otherwise the worker waits
(a long-poll) instead of generating a round that would be dropped. proxy.py answers POST /v1/prompts/lease
with a grant from here; the Book holds one Pacer, so replay (ledger.py) follows the same rules, and a grant
outstanding when the proxy restarts still holds its place after the restart.

The rule, in groups leased from now on. The trainer leases `batch` groups at a time, oldest first, and one
version follows each batch (publish_every 1). So the j-th batch leased from now (j = 0, 1, ...) is trained
from version `base + j`, base = latest + the batches the trainer holds whose versions are not registered yet
(each one's version comes before the next batch is trained: 0, 1, or 2 for a trainer that asks for its next
batch while it trains one, train.py's prefetch). A group of version v is then trainable
only among the first

    limit(v) = (max_staleness - base + v + 1) * batch

groups leased from now on (groups are leased in the order they arrive). What may be leased before a grant's
groups: the buffer, then every open grant that may arrive before it (each worker's measured round time after
its grant says when). A grant of k groups at the latest version is admitted when
  - its own groups fit: the groups that may come before it + k <= limit(latest),
  - it pushes no open grant it may arrive before out of that grant's own window: for each, the buffer, the
    grant itself and every other open grant that may arrive before it, + k <= its limit. "Every other", not
    only those expected before it: a grant admitted as one that may overtake it may do so (counting only the
    expected order let two such grants each take the same slack, and a slow round came out a version too old),
  - and everything in flight fits in the trainer's remaining demand (groups_left on its lease requests;
    unknown: no bound). After the trainer's final version nothing is granted.
k is the most that fits, up to what was asked (a partial grant); 0: wait. Waiting workers are tried fastest
first (Waiting.order: where the window is short, it goes to the rounds that come back soonest). Arrival order
is predicted from the worker's measured round time r and its mean deviation d, as TCP times a retransmission
(RFC 6298): the groups come between r - m and r + m after the grant, m = max(jitter x r, 4 d) (a grant
expected within that counts as ahead of the new one and as pushed by it). A worker whose rounds vary a lot
thus gets a wide margin instead of being taken for late while it is still generating; a worker whose round
time is not known yet counts everything in flight as both. A worker's first round sets d from the fleet's
rounds (Spread: how far rounds land from their expected time, as a share of it), not from a fixed share.

The trainer's speed does not enter the rule: versions come per batch, not per second, so where a group lands
depends only on what arrives before it. Step time and round times say only when to expect things (the
arrival order, the wait a refused worker is told, when a grant is given up).

What it cannot know, and how it degrades: a round time is a prediction. A worker faster than predicted may
overtake a grant and push it out of its window; a worker much slower than the others is admitted only where
its groups still fit, so while the rest of the fleet keeps the trainer busy it waits. A grant whose worker
never delivers (a crash) holds its place until its deadline (grant_s after 3 round times of its worker, or
after its margin if longer), or until the same worker asks again: a worker asks for its next grant only
after sending its round, so its new request closes the earlier grant at once (proxy.release_grant, journaled
as "release"). A worker that cannot load the version its grant counts on gives that grant back the same way and
asks counted at the version it holds (Pacer.room's `version`: a shorter window), or is told at once that
nothing generated with it can be trained (Pacer.hopeless). A worker that
long-polls for new versions with its worker_id (rollout.py does, all through its rounds, opening the next poll
as soon as one is answered) says it is alive: one with no poll open for poll_grace_s since its last one ended
(its process died: the kernel closed the poll's connection, or it died between two polls) is taken for gone
(polling/polled). Its grant then no longer covers
the trainer's remaining demand, so the last batches are granted to others instead of waiting for the
deadline; it keeps its place in the staleness window like any grant (giving that up as well measured
worse at 1,000 simulated workers: docs/results/fleet.md). A worker lost without its connection closing (a host
gone) is seen once its open poll is answered (its wait_s) and the grace passes. A trainer that stops
leaves the pipeline full: nothing more is granted until it leases again. A late grant (past its expected
arrival) no longer covers the demand either: at the end of a run its groups are granted to another worker as
well, a backup round, so the last batch waits neither for a straggler nor for a death not seen yet; whichever
comes second is left over (counted as never leased). Before the end the demand binds nothing. The staleness
filter stays as the last guard (a group that arrives too stale anyway is dropped and counted).

Durable (journaled, replayed, in snapshots): each grant (worker, groups, version, the round time it was
expected to take) and its release, arrivals (group lines and stale records name their worker), the trainer's demand (in
lease records). Live only: the fleet's spread (a start measures it afresh), and, on this process's monotonic
clock, when each grant was made, is expected and runs out; at a start every open grant is taken as just made
(the lease rule: no clock of another process is compared). A prompt lease that does not ask for a grant (no
wait_s, or a proxy started with --no-pace) gets its prompts at once, unrecorded; the staleness filter guards
its rounds.
"""
from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from common import too_stale

EWMA = 0.3        # weight of the newest measurement in a round or step time
EWMA_DEV = 0.25   # ... in a round time's mean deviation (RFC 6298's beta)
DEVIATIONS = 4    # a round is expected within this many mean deviations of its mean (RFC 6298's K)


@dataclass
class Grant:
    key: str            # participant/worker_id (the run's own workers: worker_id), as participants.Senders keys them
    n: int              # groups granted
    left: int           # groups not arrived yet
    version: int        # the latest version when granted: the worker generates with it or a newer one
    round_s: float | None  # the worker's round time this grant was expected to take (None: not known)
    dev_s: float | None = None  # and its mean deviation (None: not known; the margin is then jitter x round_s)
    granted: float = 0.0   # this process's monotonic time of the grant (a start: the moment it took over)
    lo: float = 0.0        # its groups are expected between lo and hi (round time -+ margin; unknown: hi = inf)
    hi: float = 0.0
    deadline: float = 0.0  # after this it holds no place
    gone: bool = False     # its worker is taken for gone: it no longer covers the trainer's demand (live only)

    def when(self, now: float) -> tuple[float, float]:
        """When its groups may come, as seen at `now`: a late grant any moment (before any grant made now:
        protecting it until its deadline would hold every other worker up behind one that may have crashed)."""
        return (self.lo, self.hi) if now <= self.hi else (now, now)

    def record(self) -> dict:
        return {"t": "grant", "key": self.key, "n": self.n, "version": self.version, "round_s": self.round_s,
                "dev_s": self.dev_s}


def window(max_staleness: int, base: int, version: int, batch: int) -> int:
    """How many of the groups leased from now on may come before the last one of version `version` does."""
    return (max_staleness - base + version + 1) * batch


def room(n: int, version: int, lo: float, hi: float, buffered: int, in_flight: list[tuple[float, float, int, int]],
         base: int, batch: int, max_staleness: int, demand: int | None) -> int:
    """The most groups (<= n) a grant at `version`, expected between lo and hi, may have (module docstring).
    in_flight: the open grants as (lo, hi, version, groups left)."""
    total = buffered + sum(left for _, _, _, left in in_flight)
    best = n if demand is None else min(n, demand - total)
    ahead = buffered + sum(left for g_lo, _, _, left in in_flight if g_lo < hi)  # it may arrive before the new one
    best = min(best, window(max_staleness, base, version, batch) - ahead)
    for i, (_, g_hi, v, left) in enumerate(in_flight):
        if g_hi > lo:  # the new grant may arrive before it: pushed back by it
            # what may be leased before its last group: the buffer, itself, and every other open grant that may
            # arrive before it (not only those expected before it: each of them was admitted as possibly so)
            before = buffered + left + sum(h_left for j, (h_lo, _, _, h_left) in enumerate(in_flight)
                                           if j != i and h_lo < g_hi)
            slack = window(max_staleness, base, v, batch) - before
            if slack >= 0:  # one already out of its window is lost either way; it does not block the rest
                best = min(best, slack)
    return max(0, best)


class Flight:
    """The open grants of one pacing pass, indexed so that room() answers a request in O(log grants) instead of
    O(grants): at 1,000 workers a pass tries tens of requests against hundreds of open grants, on every arrival
    (docs/results/fleet.md). Gives exactly what room() gives for a request whose worker has no open grant of its own
    (for one that has, Pacer.room indexes the other grants afresh; room() answers while the trainer's batch is
    not known yet).
    in_flight: as Pacer.in_flight returns it, in the order the grants are expected; base, batch: room()'s."""

    def __init__(self, in_flight: list[tuple[float, float, int, int, str]], buffered: int, base: int, batch: int,
                 max_staleness: int):
        self.base, self.batch, self.max_staleness, self.buffered = base, batch, max_staleness, buffered
        self.fleet: tuple[float | None, float | None] | None = None  # Pacer.fleet_round() for this pass
        self.demand: int | None = None  # Pacer.open_demand() for this pass
        self.keys = {g[4] for g in in_flight}
        self.total = buffered + sum(g[3] for g in in_flight)
        by_lo = sorted((g[0], g[3]) for g in in_flight)  # "ahead of a new grant": those that may come before its hi
        self.lo = [x for x, _ in by_lo]
        self.left_before = [0, *itertools.accumulate(left for _, left in by_lo)]
        pushed = []  # "pushed by a new grant": those that may come after its lo, with their slack
        for g_lo, g_hi, v, left, _ in in_flight:
            # before its last group: the buffer, every open grant that may arrive before it, itself (counted once)
            before = buffered + self.left_before[bisect.bisect_left(self.lo, g_hi)] + (0 if g_lo < g_hi else left)
            slack = window(max_staleness, base, v, batch) - before
            pushed.append((g_hi, slack if slack >= 0 else math.inf))  # out of its window already: no bound
        pushed.sort()
        self.hi, self.slack = [h for h, _ in pushed], [x for _, x in pushed]
        self._suffix_min()

    def _suffix_min(self) -> None:
        self.min_slack_after = list(itertools.accumulate(reversed(self.slack), min, initial=math.inf))[::-1]

    def add(self, lo: float, hi: float, version: int, left: int, key: str) -> None:
        """A grant just made to a worker that held none (its when(now)): the index as if built with it, in O(grants)
        instead of a rebuild's sorts (a pass makes tens of grants at 1,000 workers). Every open grant it may arrive
        before (hi > lo) has `left` less slack; one pushed out of its window is then unbounded, as a rebuild
        would make it (room() gives no grant that does so)."""
        before = self.buffered + self.left_before[bisect.bisect_left(self.lo, hi)] + left
        i = bisect.bisect_right(self.hi, lo)
        self.slack[i:] = [x - left if x >= left else math.inf for x in self.slack[i:]]
        slack = window(self.max_staleness, self.base, version, self.batch) - before
        j = bisect.bisect_right(self.hi, hi)
        self.hi.insert(j, hi)
        self.slack.insert(j, slack if slack >= 0 else math.inf)
        self._suffix_min()
        j = bisect.bisect_right(self.lo, lo)
        self.lo.insert(j, lo)
        self.left_before.insert(j + 1, self.left_before[j] + left)
        self.left_before[j + 2:] = [x + left for x in self.left_before[j + 2:]]
        self.keys.add(key)
        self.total += left

    def room(self, n: int, version: int, lo: float, hi: float, demand: int | None) -> int:
        best = n if demand is None else min(n, demand - self.total)
        ahead = self.buffered + self.left_before[bisect.bisect_left(self.lo, hi)]  # g_lo < hi
        best = min(best, window(self.max_staleness, self.base, version, self.batch) - ahead)
        best = min(best, self.min_slack_after[bisect.bisect_right(self.hi, lo)])  # g_hi > lo
        return max(0, best)


class RoundTimes(OrderedDict):
    """Worker key -> measured (round time, its mean deviation), least recently used first. Keeps the fleet's
    medians of both until it changes: a pacing pass asks for them on every grant it makes, and at 1,000 workers
    each is a sort of 1,000 numbers (Pacer.fleet_round)."""

    medians: tuple[float | None, float | None] | None = None

    def __setitem__(self, key, value) -> None:
        self.medians = None
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self.medians = None
        super().__delitem__(key)

    def pop(self, *args):
        self.medians = None
        return super().pop(*args)

    def popitem(self, last: bool = True):
        self.medians = None
        return super().popitem(last)

    def clear(self) -> None:
        self.medians = None
        super().clear()


class Pacer:
    """Open grants, the trainer's demand and whether it holds a batch, measured round and step times."""

    def __init__(self, max_staleness: int, max_workers: int = 4096):
        self.max_staleness, self.max_workers = max_staleness, max_workers
        self.grants: dict[str, Grant] = {}        # key -> its open grant (a worker has at most one)
        # key -> measured (round time, its mean deviation), least recently used first
        self.round_s = RoundTimes()
        self.demand: int | None = None            # groups the trainer will still lease after what it holds (None: unknown)
        self.held = 0                             # batches it holds whose versions are not registered yet
        self.batch = 0                            # groups per lease (0: no lease request seen yet)
        self.counts = dict.fromkeys(("grants", "groups_granted", "groups_abandoned"), 0)  # what the journal implies
        # live only (the spread: measured afresh after a start; the rest on this process's clock)
        self.spread = Spread()                    # how far rounds land from their worker's expected time, fleet-wide
        self.grant_s, self.jitter = 30.0, 0.5     # set by the proxy from its options
        self.step_s: float | None = None          # lease -> the next version's registration
        self.leased_at: float | None = None
        self.live = dict.fromkeys(("waits", "groups_expired", "groups_gone", "groups_backed_up"), 0)
        self.poll_grace_s = 5.0                   # set by the proxy: a poll not renewed within this is gone
        self.polls: dict[str, int] = {}           # key -> its long-polls open now
        self.dropped: dict[str, float] = {}       # key -> when its last open poll ended (answered or dropped)

    # ---- the trainer ------------------------------------------------------------------------------------
    def requested(self, num_groups: int, groups_left: int | None, ahead: int = 0) -> bool:
        """A lease request: the trainer holds `ahead` batches whose versions it has not registered yet (0: it waits
        for a batch, so no version is on its way; a trainer restarted while holding one never registers it; 1:
        it asks for its next batch while it trains one). It will still lease groups_left. True when that changes
        the demand (a trainer's first request, or a restarted one's: the proxy journals it)."""
        self.held, self.batch = ahead, num_groups
        if groups_left is None or groups_left == self.demand:
            return False
        self.demand = groups_left
        return True

    def leased(self, n: int, left: int | None = None, at: float | None = None, held: int | None = None) -> None:
        """A batch of n groups leased (live, or replayed: `left` as journaled, the demand after it). held: the
        batches whose versions are not registered yet the trainer holds with it (1; 2 for one asked for while it
        trains the one before; Book.lease knows it from the version that trains it). Its step begins now if the
        trainer holds no other batch, else when the version before it is registered."""
        self.batch = n  # a lease is all the groups asked for: the trainer's batch
        if left is not None:
            self.demand = left
        elif self.demand is not None:
            self.demand = max(0, self.demand - n)
        before = self.held if held is None else max(0, held - 1)
        if at is not None and not before:
            self.leased_at = at
        self.held = before + 1

    def unleased(self, n: int) -> None:
        """The lease's journal write failed: as if it had not happened."""
        self.held = max(0, self.held - 1)
        if self.demand is not None:
            self.demand += n

    def registered(self, at: float | None = None) -> None:
        """A version registered: the step that made it is over (its time measured from its start), the next
        held batch's step (a prefetched one) begins."""
        self.held = max(0, self.held - 1)
        if at is not None and self.leased_at is not None:
            self.step_s = ewma(self.step_s, at - self.leased_at)
        self.leased_at = at if self.held and at is not None else None

    def left_after(self, n: int) -> int | None:
        """The demand to journal with a lease of n groups."""
        return None if self.demand is None else max(0, self.demand - n)

    # ---- the workers ------------------------------------------------------------------------------------
    def expected_round(self, key: str, fleet: tuple | None = None) -> tuple[float | None, float | None]:
        """The worker's measured round time and its mean deviation; for a new worker the fleet's medians
        (`fleet`: fleet_round() as a pass computed it once); (None, None) if none is known."""
        if key in self.round_s:
            return self.round_s[key]
        return self.fleet_round() if fleet is None else fleet

    def fleet_round(self) -> tuple[float | None, float | None]:
        """The medians of the workers' round times and deviations ((None, None): none measured yet)."""
        if self.round_s.medians is None:
            times = self.round_s.values()
            self.round_s.medians = ((None, None) if not times else
                                    (statistics.median(r for r, _ in times), statistics.median(d for _, d in times)))
        return self.round_s.medians

    def expected_at(self, now: float, r: float | None, d: float | None) -> tuple[float, float]:
        """(lo, hi): when the groups of a round of expected time r (mean deviation d) begun at `now` may come."""
        if r is None:
            return now, math.inf
        m = max(self.jitter * r, DEVIATIONS * (d or 0.0))
        return now + max(0.0, r - m), now + r + m

    def in_flight(self, now: float) -> list[tuple[float, float, int, int, str]]:
        """The open grants as (lo, hi, version, groups left, key), in the order they are expected (room's)."""
        out = [(*g.when(now), g.version, g.left, g.key) for g in self.grants.values()]
        return sorted(out, key=lambda x: (x[0] + min(x[1], x[0] + 3600)) / 2)

    def base(self, latest: int, pending_version: int = 0) -> int:
        """room()'s base: a version being registered, or one coming from the batch the trainer holds, comes before
        its next lease."""
        return max(latest + self.held, pending_version)

    def flight(self, latest: int, buffered: int, now: float, pending_version: int = 0) -> Flight | None:
        """The open grants indexed for one pass of requests (None while the trainer's batch is not known)."""
        if not self.batch:
            return None
        flight = Flight(self.in_flight(now), buffered, self.base(latest, pending_version), self.batch, self.max_staleness)
        flight.fleet, flight.demand = self.fleet_round(), self.open_demand(now=now)
        return flight

    def open_demand(self, key: str | None = None, now: float | None = None) -> int | None:
        """The demand to grant against: groups of a grant whose worker is gone, or that is late (past its expected
        arrival at `now`), do not cover it, except `key`'s own (its request closes that grant). A gone worker's
        groups will not come; a late grant's may, but the trainer should not wait on it for the run's last
        batches: they are granted to others as well (a backup round, as MapReduce reruns a job's last stragglers),
        and whichever comes second is left over. Only the end of a run is affected: before it the demand is no
        bound (the staleness window is), and there a late grant still holds its place as any grant does."""
        if self.demand is None:
            return None
        return self.demand + sum(g.left for g in self.grants.values()
                                 if g.key != key and (g.gone or (now is not None and now > g.hi)))

    def room(self, key: str, n: int, latest: int, buffered: int, now: float, flight: Flight | None = None,
             pending_version: int = 0, version: int | None = None) -> int:
        """How many of the n prompts `key` asks for it may have now (0: none, wait), for a round generated with
        `version` (None: the latest; older: a worker that cannot load the latest, counted at the version it
        holds). flight: this pass's self.flight(...) of the same state (faster); without it, room() (the rule as
        written, the reference)."""
        if self.demand == 0:
            return 0
        v = latest if version is None else version
        lo, hi = self.expected_at(now, *self.expected_round(key, None if flight is None else flight.fleet))
        if flight is not None and key not in flight.keys:
            return flight.room(n, v, lo, hi, flight.demand)
        others = [g for g in self.in_flight(now) if g[4] != key]  # its own open grant: closed by this one
        if flight is not None:  # the others indexed afresh: room()'s loop is O(grants^2), 37 ms at 1,000 grants
            flight = Flight(others, buffered, flight.base, flight.batch, self.max_staleness)
            return flight.room(n, v, lo, hi, self.open_demand(key, now))
        return room(n, v, lo, hi, buffered, [g[:4] for g in others], self.base(latest, pending_version),
                    self.batch or n, self.max_staleness, self.open_demand(key, now))

    def hopeless(self, version: int, latest: int, pending_version: int = 0) -> bool:
        """No round generated with `version` can be trained any more: the next batch is trained from a version
        more than max_staleness ahead of it (common.too_stale against room()'s base). A worker that cannot load
        a newer version is told so instead of waiting for a grant that cannot come."""
        return too_stale(version, self.base(latest, pending_version), self.max_staleness)

    def grant(self, key: str, n: int, version: int, now: float = 0.0, round_s: float | None = None,
              dev_s: float | None = None) -> Grant:
        """Record a grant (closing the worker's earlier one); returns it (its record() is what is journaled).
        round_s, dev_s: as journaled (replay); live, the worker's expected round time and its deviation."""
        self.close(key)
        r, d = (round_s, dev_s) if round_s is not None else self.expected_round(key)
        g = Grant(key, n, n, version, r, d)
        self._time(g, now)
        self.grants[key] = g
        self.counts["grants"] += 1
        self.counts["groups_granted"] += n
        return g

    def backed_up(self, g: Grant, buffered: int) -> None:
        """Count the groups of a grant just made that back up late grants (open_demand): those beyond what the
        buffer and the grants of live workers already cover. One of the two copies will be left over."""
        if self.demand is not None:
            covered = buffered + sum(h.left for h in self.grants.values() if not h.gone and h is not g)
            self.live["groups_backed_up"] += min(g.n, max(0, covered + g.n - self.demand))

    def ungrant(self, g: Grant) -> None:
        """The grant's journal write failed: it holds no place."""
        if self.grants.get(g.key) is g:
            del self.grants[g.key]
            self.counts["grants"] -= 1
            self.counts["groups_granted"] -= g.n

    def close(self, key: str) -> int:
        """Close `key`'s open grant, if it has one: its groups not arrived yet are abandoned (returned)."""
        if (old := self.grants.pop(key, None)) is None:
            return 0
        self.counts["groups_abandoned"] += old.left
        return old.left

    def arrived(self, key: str, now: float | None = None) -> None:
        """One group of `key` arrived (accepted, or refused as stale). The last of a grant measures the
        worker's round time (live: `now` on this process's clock)."""
        g = self.grants.get(key)
        if g is None:
            return
        g.left -= 1
        if g.left <= 0:
            del self.grants[key]
            if now is not None:
                x, old = now - g.granted, self.round_s.pop(key, None)
                if old is not None and old[0] > 0:
                    self.spread.add(abs(x - old[0]) / old[0])
                self.round_s[key] = measure(old, x, self.spread.first())
                while len(self.round_s) > self.max_workers:
                    self.round_s.popitem(last=False)

    def polling(self, key: str) -> None:
        """`key` opened a long-poll for new versions: it is alive (taken for gone before, its round may still
        come: its grant covers the trainer's demand again)."""
        self.polls[key] = self.polls.get(key, 0) + 1
        self.dropped.pop(key, None)
        if (g := self.grants.get(key)) is not None:
            g.gone = False

    def polled(self, key: str, now: float) -> None:
        """`key`'s long-poll ended: answered, or its connection closed first. A live worker polls again at once
        either way (rollout.py opens its next poll as soon as one is answered, before it downloads the version);
        one with no poll open again within poll_grace_s is taken for gone (expire): its process died, whether
        during a poll (the kernel closed the connection) or between two (downloading a version, say)."""
        if (left := self.polls.get(key, 0) - 1) > 0:
            self.polls[key] = left
            return
        self.polls.pop(key, None)
        if key in self.grants:  # (only a grant is affected: a client's worker ids cost no memory)
            self.dropped[key] = now

    def expire(self, now: float) -> list[Grant]:
        """Grants whose worker is gone (no poll open for poll_grace_s since its last one ended) no longer cover the
        trainer's demand; grants past their deadline hold no place any more (returned)."""
        for k in [k for k, at in self.dropped.items() if now - at >= self.poll_grace_s]:
            del self.dropped[k]  # (a worker that polled again within the grace: polling() forgot the end)
            if (g := self.grants.get(k)) is not None and not g.gone:
                g.gone = True
                self.live["groups_gone"] += g.left
        out = [g for g in self.grants.values() if g.deadline <= now]
        for g in out:
            del self.grants[g.key]
            self.live["groups_expired"] += g.left
        return out

    def retry_s(self, now: float) -> float:
        """What a worker refused a grant is told to wait: until the next version is expected (a batch's step
        time after the trainer leased it), else a second."""
        if self.held and self.step_s is not None and self.leased_at is not None:
            return round(min(30.0, max(0.5, self.leased_at + self.step_s - now)), 2)
        return 1.0

    def restart(self, now: float) -> None:
        """A start took this state over: every open grant as if made now (no clock of another process is compared)."""
        for g in self.grants.values():
            self._time(g, now)

    def _time(self, g: Grant, now: float) -> None:
        g.granted = now
        g.lo, g.hi = self.expected_at(now, g.round_s, g.dev_s)
        g.deadline = now + self.grant_s + (0.0 if g.round_s is None else max(3 * g.round_s, g.hi - now))

    # ---- state --------------------------------------------------------------------------------------------
    def book_state(self) -> dict:
        """The part of state() the live proxy and a replay of its journal agree on at any moment (Book.state):
        the batches the trainer holds and its batch size also follow its lease requests, not journaled."""
        d = self.state()
        return {k: d[k] for k in ("grants", "demand", "counts")}

    def state(self) -> dict:
        """What the journal implies, as plain JSON values (a snapshot's; the live clock's part is not in it)."""
        return {"grants": [[g.key, g.n, g.left, g.version, g.round_s, g.dev_s] for g in self.grants.values()],
                "round_s": [[k, r, d] for k, (r, d) in self.round_s.items()], "demand": self.demand,
                "held": self.held, "batch": self.batch, "counts": dict(self.counts)}

    @classmethod
    def from_state(cls, d: dict, max_staleness: int, max_workers: int = 4096) -> Pacer:
        p = cls(max_staleness, max_workers)
        p.grants = {g[0]: Grant(*g) for g in d["grants"]}
        p.round_s = RoundTimes((k, (r, dev)) for k, r, dev in d["round_s"])
        p.demand, p.held, p.batch = d["demand"], d["held"], d["batch"]
        p.counts.update(d["counts"])
        return p

    def stats(self) -> dict:
        return {"open_grants": len(self.grants), "groups_in_flight": sum(g.left for g in self.grants.values()),
                "demand": self.demand, "trainer_batches_held": self.held, "batch": self.batch,
                "step_s": None if self.step_s is None else round(self.step_s, 3),
                "round_s_median": None if not self.round_s else round(self.fleet_round()[0], 3),
                "first_round_spread": round(self.spread.first(), 3),
                **self.counts, **self.live}


def ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new


class Spread:
    """How far a round lands from its worker's expected time, as a share of it, over the whole fleet: the mean of
    |x - r| / r over the last SAMPLES rounds of workers measured before. A worker's first round says nothing of
    its own spread, but the fleet's rounds do (the same task, the same sampling; what differs most between
    workers, their speed, is in r). At 1,000 simulated workers most have had one round or none, and a fixed
    quarter (DEFAULT, what they got before) protected their grants for up to twice their round, holding the
    window shut behind a slow one; rounds there land a mean 20% from their expected time (docs/results/fleet.md).
    Until MIN rounds are measured: DEFAULT; at most twice it (a fleet whose rounds scatter that much)."""

    DEFAULT, MIN, SAMPLES = 0.25, 16, 256

    def __init__(self):
        self.samples: deque[float] = deque(maxlen=self.SAMPLES)

    def add(self, rel: float) -> None:
        self.samples.append(rel)

    def first(self) -> float:
        """The deviation to give a worker's first round, as a share of it."""
        if len(self.samples) < self.MIN:
            return self.DEFAULT
        return min(2 * self.DEFAULT, statistics.fmean(self.samples))


def measure(old: tuple[float, float] | None, x: float, first: float = Spread.DEFAULT) -> tuple[float, float]:
    """A worker's (round time, mean deviation) after a round of x seconds, as RFC 6298 smooths a round trip.
    The first round sets the deviation to `first` x the round (Spread.first(): what the fleet's rounds measured,
    a quarter until enough are), so the margin is 4 x that. RFC 6298's half (up to three rounds) protected a
    worker's first grants so long that one slow round held the window shut: at 1,000 simulated workers, most of
    which have had one round or none, a quarter cut the trainer's waits over 1.5 s from 11 to 5 in three seeds
    (docs/results/fleet.md)."""
    if old is None:
        return x, first * x
    r, d = old
    return ewma(r, x), (1 - EWMA_DEV) * d + EWMA_DEV * abs(r - x)


class Waiting:
    """The live proxy's paced prompt requests waiting for a grant (never journaled: a
    restart drops the connections, and the workers ask again)."""

    MISSES = 32  # requests that do not fit, tried per pass: one slow worker does not hold up those behind it

    def __init__(self):
        self.asking: dict[int, tuple[str, int, int | None, asyncio.Future]] = {}

    def __len__(self) -> int:
        return len(self.asking)

    async def wait(self, key: str, n: int, wait_s: float, pace: Callable[[], None],
                   version: int | None = None) -> Grant | None:
        """A grant of at most n prompts for worker `key`, waiting up to wait_s for room (None: none, or the run
        is over). version: the one the worker generates with if it cannot load the latest (Pacer.room). `pace`:
        the proxy's call of pace() with its state."""
        fut = asyncio.get_running_loop().create_future()
        self.asking[id(fut)] = (key, n, version, fut)
        pace()
        try:
            await asyncio.wait([fut], timeout=wait_s)  # does not cancel it: a grant made at the deadline stands
        finally:
            self.asking.pop(id(fut), None)
        if fut.done():
            return fut.result()
        fut.cancel()
        return None

    def dismiss(self, key: str) -> int:
        """Answer worker `key`'s waiting requests with no grant now (it was asked to leave: proxy fleet.py)."""
        waiting = [fut for k, _, _, fut in self.asking.values() if k == key and not fut.done()]
        for fut in waiting:
            fut.set_result(None)
        return len(waiting)

    def order(self, pacer: Pacer, flight: Flight | None) -> list[tuple[str, int, int | None, asyncio.Future]]:
        """The waiting requests: first those whose worker still holds an open grant (a worker that crashed
        mid-round and came back: granting it closes the old grant, so it can only make room, and it must not
        wait behind MISSES others while its abandoned grant holds the window shut until the deadline), then the
        worker with the shortest expected round first (a new one at the fleet's median; in the order they came
        where equal).

        Why fastest first: what may be in flight is bounded by the staleness window, in groups, so the groups
        trained per second are what is in flight over the round time of those holding it (Little's law). In
        the order they came, a slow worker's grant holds its share of the window through its whole long round;
        fastest first, the room goes where it comes back soonest (the fleet simulation's trainer: 0.88 -> 0.95
        busy, docs/results/fleet.md). Where there is room for every request, every one is granted, so only a worker that
        would have slowed the run waits; which prompts are trained does not change (they are drawn at the grant).
        The cost: a worker measured slow (even on one bad round) waits whenever the window is short, and is
        measured again only when there is room for it too. No aging: tried in that order, a pass stops after
        MISSES requests that do not fit, and fit follows speed (a slow round has more that may come before it);
        long-waiting slow workers at the head would hide the fast ones behind them."""
        fleet = pacer.fleet_round() if flight is None else flight.fleet

        def key(a: tuple[str, int, int | None, asyncio.Future]) -> tuple[bool, float]:
            return a[0] not in pacer.grants, pacer.expected_round(a[0], fleet)[0] or 0.0
        return sorted(self.asking.values(), key=key)

    def pace(self, pacer: Pacer, latest: int, buffered: int, done: bool, pending_version: int, now: float,
             share: Callable[[str, int], int | None] | None = None) -> None:
        """Give the waiting workers the grants there is room for, fastest first (order()); after MISSES that
        do not fit, the rest wait for the next pass. The run over (done): every one of them gets None. share(key,
        version): the most the worker's participant may have granted for a round of that version, its share of the
        batches that train it (the proxy's shares.py: a participant's groups past its share of a batch wait for the
        next one); None: no bound."""
        flight, misses = pacer.flight(latest, buffered, now, pending_version), 0
        for key, n, version, fut in self.order(pacer, flight):
            if fut.done():
                continue
            if done:
                fut.set_result(None)
                continue
            k = pacer.room(key, n, latest, buffered, now, flight, pending_version, version)
            if k > 0 and share is not None and (most := share(key, latest if version is None else version)) is not None:
                k = min(k, most)
            if k > 0:
                had = key in pacer.grants  # this grant closes it: the index is built afresh without it
                fut.set_result(g := pacer.grant(key, k, latest if version is None else version, now))
                pacer.backed_up(g, buffered)
                if flight is None or had:
                    flight = pacer.flight(latest, buffered, now, pending_version)
                else:
                    flight.add(*g.when(now), g.version, g.left, g.key)
            elif (misses := misses + 1) >= self.MISSES:
                break

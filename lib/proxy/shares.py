"""A participant's share of each batch (docs/trust.md#a-participants-share-of-each-batch): whatever one participant
sends, true groups or not, as fast as it likes, it takes at most its share of each batch the trainer leases, so that
it cannot crowd the others' groups out (their groups would wait behind its own, go stale and be dropped, and the
versions its groups pay for would come faster than the others' rounds).

Who. A participant is a token (its name): worker ids are the participant's own labels and prove nothing. The run's
own workers (the admin token) are one more party, `None` here: they count toward everyone's share, but their groups
are never held back (the run is its owner's; a participant cannot use the admin token).

Its share: its live workers over all live workers, the run's own included (as the issue asks: its share of the
fleet), and at most the proxy's --max-participant-share. A worker is live while it holds a version long-poll open
with its worker_id (rollout.py keeps one open all through its rounds: pacing's sign of life too), or for LIVE_S after
its last one ended or its last paced prompt lease; a party with groups in the buffer and no live worker counts one.
A participant's live workers count up to the number its token allows (`allowed`: access.Participant.workers, 1 unless
the run's owner granted more), never more: worker ids are its own labels, and one that opens polls under a hundred
made-up ids, or a new id each time, would otherwise take a hundred workers' share (measured: 133 ids, 98.5% of the
batches). What the cap or the ceiling takes from a participant goes to the others, by their live workers. The run's own
workers are not capped. Groups alone make no worker live: a flood that never polls counts as one worker, however many
worker ids its groups name.

A batch of n (select). Each participant may have q = ceil(share x n) of its groups in it (its quota), the run's own
groups any number; the batch takes the oldest groups within those bounds. Where that does not fill it, the groups
past their participant's quota fill it, oldest first, unless a party still under its quota has groups on their way:
an open pacing grant of one of its workers (not given up: pacing.py, its worker's polls stopped), or a live worker of
its that sent a group within LIVE_S (between two rounds: pacing may hold its next grant while the buffer holds the
others' groups). Then the batch waits for them, for a while (the proxy's stall_s: twice the fleet's round time, at
least --poll-grace-s, at most --grant-s): the versions a flood's groups would buy are what makes the others' rounds
stale. So a flood takes what the others leave while nobody else is generating (a run with one participant trains as
before), and its quota while they are; a party that keeps a round on its way and sends little (a slow honest worker,
or one that takes grants and never sends) holds each batch up at most that while, and the prompts it leased and
never answered count against it (below). With --no-pace nobody holds a grant: the batch waits only for workers
between two rounds.

Pacing (the proxy's share_room) grants a participant's worker only what its quota of the batches that may still
train the round leaves (less its groups buffered and granted, and what it owes), so its paced rounds fit its share.
A round granted while its share was larger (a flood came meanwhile) may not: its groups that this batch is the last
to be able to train are taken first, and a batch waits for such a round on its way whatever the quota (within
stall_s): pacing admitted it, and it is not left to go stale behind the flood.

Unanswered prompts count against the share: when a participant's prompt lease is let go (receipts.py: its groups
would be staler than the floor) the indices it never answered are owed (Receipts.owed), and each batch spends that
participant's quota on what it owes first (`paid`, journaled in the lease record, so replay pays the same): leasing a
dataset's every prompt to answer the few it likes costs it the batches' slots of all of them. Where the groups past
their quotas fill a batch, those of a participant that still owes come last.

The buffer (room). Beyond its share of --max-buffer a participant's groups get 429 with Retry-After, except those its
worker's open grant covers (pacing admitted them: they fit the staleness window): a flood holds at most its share of
the buffer, and the rest is room for the others, whose paced rounds pacing then admits.

Live only: the workers' liveness and the shares (a restart starts with none live: the workers' next polls say). What
must survive a restart, what each participant owes and what each batch paid, is in the journal (receipts.py, book.py).
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

LIVE_S = 60.0  # a worker whose last poll ended, or whose last paced prompt lease was, this long ago is no longer live


def party(key: str) -> str | None:
    """The participant of a worker key (participants.worker_key): 'alice/w1' -> 'alice', the run's own 'w1' -> None
    (worker ids cannot hold a '/')."""
    who, sep, _ = key.partition("/")
    return who if sep else None


class Live:
    """Which workers are live (module docstring), on this process's monotonic clock."""

    CACHE_S = 0.25

    def __init__(self, max_workers: int = 4096):
        self.max_workers = max_workers
        self.open: dict[str, int] = {}                  # key -> its version long-polls open now
        self.seen: OrderedDict[str, float] = OrderedDict()  # key -> when its last poll ended or paced lease came
        self.counted: tuple[float, Counter] | None = None

    def opened(self, key: str) -> None:
        self.open[key] = self.open.get(key, 0) + 1

    def closed(self, key: str, now: float) -> None:
        if (n := self.open.get(key, 0) - 1) > 0:
            self.open[key] = n
        else:
            self.open.pop(key, None)
        self.saw(key, now)

    def saw(self, key: str, now: float) -> None:
        self.seen.pop(key, None)
        self.seen[key] = now
        while len(self.seen) > self.max_workers:
            self.seen.popitem(last=False)

    def keys(self, now: float) -> set[str]:
        """The live workers' keys."""
        while self.seen and now - next(iter(self.seen.values())) >= LIVE_S:  # oldest first
            self.seen.popitem(last=False)
        return {*self.open, *self.seen}

    def workers(self, now: float) -> Counter:
        """Live workers per party (not to be changed: counted at most every CACHE_S, as a batch lease asks on every
        group's arrival, and a fleet has thousands of workers)."""
        if self.counted is None or not 0 <= now - self.counted[0] < self.CACHE_S:
            self.counted = (now, Counter(party(k) for k in self.keys(now)))
        return self.counted[1]


def shares(live: Counter, buffered: Iterable, ceiling: float = 1.0,
           allowed: Callable[[str], int] | None = None) -> dict:
    """party -> its share of each batch: its live workers over all live workers (a party with groups in the buffer
    and none live counts one), a participant's counted up to allowed(participant) (its token's workers: the proxy
    always says; None counts every one, for fleets given by hand); a participant's share at most `ceiling`
    (--max-participant-share), what that leaves over going to the others by their workers (water-filling). The run's
    own (None) are never capped nor held to theirs."""
    cap = (lambda p: math.inf) if allowed is None else allowed
    weight = {p: max(1, live.get(p, 0) if p is None else min(live.get(p, 0), cap(p)))
              for p in {*(p for p, n in live.items() if n > 0), *buffered}}
    share, free, budget = {}, set(weight), 1.0
    while free:
        total = sum(weight[p] for p in free)
        capped = {p for p in free if p is not None and budget * weight[p] / total > ceiling}
        if not capped:
            share.update({p: budget * weight[p] / total for p in free})
            break
        share.update(dict.fromkeys(capped, ceiling))
        budget, free = budget - ceiling * len(capped), free - capped
    return share


def quotas(share: dict, n: int) -> dict:
    """participant -> the most of its groups a batch of n takes: ceil(share x n), at least 1."""
    return {p: max(1, math.ceil(s * n - 1e-9)) for p, s in share.items() if p is not None}


def select(items: list, n: int, quota: dict, owed: dict, expected: dict,
           urgent: Callable[[Any], bool] = lambda it: False) -> tuple[list, dict] | None:
    """The batch of n from `items` (the fresh buffered groups, oldest first, each with .gid and .who), and what each
    participant paid of what it owes; None while it cannot be made (module docstring). quota: quotas(); owed:
    Receipts.owed; expected: the parties with a round on its way -> whether this batch is the last that can train it
    (a paced round of a version the next batch leaves stale: the batch waits for it, whatever the quota) or not (the
    batch waits for it only while its party is under its quota). urgent(group): a group pacing admitted that this batch
    is the last to be able to train: taken first (it counts toward its participant's quota)."""
    paid = {p: min(owed[p], q) for p, q in quota.items() if owed.get(p, 0) > 0}
    left = {p: q - paid.get(p, 0) for p, q in quota.items()}
    first = [it for it in items if it.who is not None and urgent(it)][:n]
    chosen = {it.gid for it in first}
    for it in first:
        left[it.who] = left.get(it.who, n) - 1
    over = []
    for it in items:
        if len(chosen) == n:
            break
        if it.gid in chosen:
            continue
        if it.who is None or left.get(it.who, n) > 0:
            chosen.add(it.gid)
            if it.who is not None:
                left[it.who] = left.get(it.who, n) - 1
        else:
            over.append(it)
    if any(expected.values()) and any(it.gid in chosen and it.who is not None and not urgent(it) for it in items):
        return None  # a round on its way whose last batch this is, and groups here it would take the place of
    if len(chosen) < n:
        if any(p is None or last or left.get(p, 0) > 0 for p, last in expected.items()):
            return None  # a round on its way that this batch would take: it waits for it
        if len(chosen) + len(over) < n:
            return None
        owing = {p for p in paid if owed[p] > paid[p]}  # still owing after this batch: its groups fill it last
        over.sort(key=lambda it: it.who in owing)  # (stable: oldest first within each)
        chosen.update(it.gid for it in over[:n - len(chosen)])
    return [it for it in items if it.gid in chosen], paid

"""Autoscaling the run's rollout jobs from the proxy's own signals, within bounds and a dollar cap (docs/jobs.md#autoscaling).

    bash launch_jobs.sh --run my-run --autoscale          # Jobs: start one worker, let the supervisor add or retire them
    python launch_hf.py --list-presets                    # `jobs-autoscale`: the same, with its bounds

The policy is the pure functions at the top: `signals` reads two /v1/stats answers of the same proxy incarnation,
`decide` turns them, the fleet and the bounds into a Decision (up, down or hold; how many; why; the signals behind
it). `Autoscaler` below them is the supervisor's hook (supervisor.py calls it at every look): it reads the stats,
decides, writes the decision to the bucket *before* acting on it, and turns the run's fleet into job specs that the
supervisor's own loop then keeps alive; scale-down asks the worker to leave through the proxy (proxy fleet.py).

The signals (the proxy's `fleet` and `live_workers` in /v1/stats):
  - trainer utilisation over the window: 1 - d trainer_idle_s / d clock_s (idle: a lease request open while the
    trainer has nothing to train), on the proxy's own clock;
  - the share of worker time spent waiting for grants (pacing): d grant_wait_s / (d clock_s x live workers);
  - live workers per participant: the run's own (admin) and those lent by participants, which count as free
    capacity (they are never launched, cancelled or paid for here).

A window holds at least min_window_s of proxy time and min_window_steps trainer steps (versions registered: train.py
acks its batches only with a checkpoint), starts once
the trainer holds its first batch (its wait for that one is start-up, not steady), and starts over at every change
of the fleet and while a worker starts (until the proxy has a group of its): each window measures one fleet at work.

The rules, in order: below min_workers: up; above max_workers or the $/hour cap: down; a worker still starting: hold;
an up (a put-back too) or a workers_wait down not yet judged: hold until the window since it holds judge_steps steps
(`judging`), then every rule reads that window; no window yet: hold; the window since an up leaves the trainer under
target and not min_gain busier than the window that led to the up: take the added workers back (`no_better`); the
window since a `workers_wait` down leaves the trainer under target and min_gain less busy: put them back (`needed`);
workers waiting for grants more than wait_share_down of their time, whatever the trainer does: down by one
(`workers_wait`, after down_cooldown_s, never below a size put back within retry_s); trainer utilisation under target,
the workers not waiting so: up, by as many as the shortfall says (at most max_step, within max_workers and the cap;
after up_cooldown_s, or down_cooldown_s after a scale-down), never to a size left by `workers_wait` within retry_s, nor
to one left by `no_better` while the trainer is about as busy as it was there (`tried`). Else hold. What the rules
remember is in the state apply() returns (written with the fleet), read back by memory_of().

Clocks: signal windows are differences of the proxy's own monotonic clock (`clock_s`), never compared with ours.
Cool-downs must outlive a supervisor restart, so they are wall-clock times written with each decision
(`launch/autoscale.json`); a successor on another host compares its wall clock with them: minutes of cool-down
tolerate the seconds NTP leaves between hosts.

Restart safety: a decision and the fleet it leads to are one conditional write to `launch/autoscale.json`, made
before any job is launched or asked to leave. The supervisor then makes the jobs match the fleet (a role with no
live job is launched, as any role is relaunched), so a supervisor restarted between the write and the launch
launches the role once, and one restarted after it sees the job and the cool-down.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from common import ConflictError
from costs import EXPOSE_PRICE, PRICES
from hf_jobs import STANDBY, TERMINAL, JobSpec, hub_errors, secret_values, stage
from proxy_client import read_proxy_endpoint

STATE = "launch/autoscale.json"   # the fleet and the decisions (up, down, and each new reason to hold)
KEEP = 1000                       # decisions kept in it (the newest): the fleet itself is kept apart, whole
ADMIN = "admin"                   # how /v1/stats names the run's own token (proxy access.ADMIN)


@dataclass(frozen=True)
class Bounds:
    """What the controller may do (a preset's `autoscale`, or launch_hf.py --autoscale's defaults)."""
    target_util: float = 0.85
    """trainer utilisation to reach: the share of its time it is not waiting for a batch"""
    min_workers: int = 1
    max_workers: int = 4
    budget_per_hour: float | None = None
    """$/hour cap for the whole run (every job, at costs.PRICES); None: no cap beyond max_workers"""
    wait_share_down: float = 0.5
    """workers waiting for grants more than this share of their time, the trainer at target: one worker too many"""
    up_cooldown_s: float = 300.0
    """after a change, no scale-up before this (a new job starts, loads its model and measures its rounds)"""
    down_cooldown_s: float = 600.0
    """after a change, no scale-down before this"""
    min_window_s: float = 60.0
    """the shortest window of proxy time a decision is made on"""
    min_window_steps: int = 3
    """the fewest trainer steps (versions registered) a window holds: a window shorter than a step reads 0 or 1 by where
    the step's wait falls"""
    judge_steps: int = 10
    """the fewest trainer steps of the window an up or a workers_wait down is judged on (no_better, needed): the fleet
    holds from the change until then, and every rule reads that window. Three steps read anything from 0.2 to 1.0 on one
    fleet (docs/results/fleet.md), and a change judged on one of them stays made or undone by chance"""
    min_gain: float = 0.03
    """a scale-up that leaves the trainer under target and raises its utilisation by less than this is taken back"""
    retry_s: float = 1800.0
    """a size left for being no better or for its workers waiting for grants is not grown to again for this long"""
    max_step: int = 2
    """most workers added at once"""

    def __post_init__(self):
        problems = [what for bad, what in [
            (not 0 < self.target_util <= 1, f"target_util {self.target_util}: in (0, 1]"),
            (self.min_workers < 0, f"min_workers {self.min_workers}: at least 0"),
            (self.max_workers < max(1, self.min_workers), f"max_workers {self.max_workers}: at least min_workers and 1"),
            (self.budget_per_hour is not None and self.budget_per_hour <= 0, "budget_per_hour: positive, or None"),
            (not 0 < self.wait_share_down <= 1, f"wait_share_down {self.wait_share_down}: in (0, 1]"),
            (self.max_step < 1, f"max_step {self.max_step}: at least 1"),
            (self.min_window_steps < 1, f"min_window_steps {self.min_window_steps}: at least 1"),
            (self.judge_steps < self.min_window_steps, f"judge_steps {self.judge_steps}: at least min_window_steps"),
            (not 0 <= self.min_gain < 1, f"min_gain {self.min_gain}: in [0, 1)"),
            (min(self.up_cooldown_s, self.down_cooldown_s, self.min_window_s, self.retry_s) < 0,
             "cool-downs, retry_s and window: >= 0")] if bad]
        if problems:
            raise ValueError("autoscale bounds: " + "; ".join(problems))


@dataclass(frozen=True)
class Signals:
    window_s: float          # proxy seconds between the two readings
    trainer_util: float      # share of the window the trainer was not idle
    wait_share: float        # share of live workers' time spent waiting for grants
    own_workers: int         # the run's own live workers (admin)
    lent_workers: int        # participants' live workers: free capacity
    buffer: int              # groups waiting in the buffer
    step_s: float | None     # the trainer's measured step (pacing)
    round_s: float | None    # the workers' median round (pacing)
    steps: int = 0           # trainer steps (versions registered) in the window


@dataclass(frozen=True)
class Memory:
    """What the policy remembers of its own past (memory_of() reads it from the state apply() keeps)."""
    last_change: str | None = None       # "up" or "down"; None: no change yet
    since_change_s: float = math.inf
    before: tuple[str, int, float] | None = None
    """("up", "needed" or "down", own workers, trainer utilisation) of the window that led to the last up, put-back
    (`needed`) or workers_wait down, until a window since that change is read (no_better and needed compare it with
    that window; a put-back's is only waited for: the size was judged once)"""
    left: tuple[tuple[int, float, str], ...] = ()
    """(size, the trainer's utilisation there, why) of each size left within retry_s: not grown to again; one left
    as no_better only while the trainer is about as busy as it was there (less by over min_gain: things changed;
    a workers_wait size is busier than the one below it by nature, and `needed` has judged that once)"""
    too_few: int | None = None
    """the largest size put back (`needed`) within retry_s: workers_wait does not go below it again"""


@dataclass(frozen=True)
class Decision:
    action: Literal["up", "down", "hold"]
    n: int
    why: str                 # which rule: below_min, over_bounds, starting, no_window, no_better, needed,
                             # workers_wait, at_bounds, tried, cooling_down, trainer_waits, steady
    reason: str              # the rule and its numbers, as the log says it
    fleet: int               # the run's own rollout jobs before it
    signals: dict = field(default_factory=dict)
    at: float = 0.0          # wall clock (cool-downs)

    def record(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


# ---- the policy: pure functions -----------------------------------------------------------------------------


def signals(prev: dict | None, now: dict, min_window_s: float, min_window_steps: int = 1) -> Signals | None:
    """The signals over the window between two /v1/stats answers; None where none can be read: no earlier reading,
    another incarnation, a window that starts before the trainer's first batch (its wait for it is start-up, not
    steady), or one shorter than min_window_s or than min_window_steps trainer steps."""
    if prev is None or prev.get("incarnation") != now.get("incarnation") or "fleet" not in now:
        return None
    a, b = prev["fleet"], now["fleet"]
    window = b["clock_s"] - a["clock_s"]
    steps = now.get("latest_version", 0) - prev.get("latest_version", 0)   # one per step (acks come per checkpoint)
    if window < max(min_window_s, 1e-9) or not prev.get("batches_leased") or steps < min_window_steps:
        return None
    live = now.get("live_workers", {})
    own = live.get(ADMIN, 0)
    lent = sum(n for p, n in live.items() if p != ADMIN)
    idle = min(window, b["trainer_idle_s"] - a["trainer_idle_s"])
    waited = b["grant_wait_s"] - a["grant_wait_s"]
    pacing = now.get("pacing", {})
    return Signals(window_s=window, trainer_util=max(0.0, 1 - idle / window),
                   wait_share=min(1.0, waited / (window * max(1, own + lent))), own_workers=own, lent_workers=lent,
                   buffer=now.get("buffer_size", 0), step_s=pacing.get("step_s"), round_s=pacing.get("round_s_median"),
                   steps=steps)


@dataclass
class Window:
    """The /v1/stats readings windows start from. `prev`, the next window's: it moves on once a window is read, while
    the trainer has no batch yet, when the proxy restarted, and at every change of the fleet (start_over): each window
    measures one fleet at work. `since`, the reading at the last change (or once its workers were all at work): the
    window a change is judged on (judge), which grows until it holds judge_steps steps."""
    min_window_s: float
    min_window_steps: int = 1
    judge_steps: int = 1
    prev: dict | None = None
    since: dict | None = None

    @classmethod
    def of(cls, bounds: Bounds) -> Window:
        return cls(bounds.min_window_s, bounds.min_window_steps, bounds.judge_steps)

    def read(self, stats: dict | None) -> Signals | None:
        """The signals since the reading kept (None: none yet, see signals())."""
        if stats is None:
            return None
        sig = signals(self.prev, stats, self.min_window_s, self.min_window_steps)
        if (sig is not None or self.prev is None or self.prev.get("incarnation") != stats.get("incarnation")
                or not self.prev.get("batches_leased")):
            self.prev = stats
        return sig

    def judge(self, stats: dict | None) -> Signals | None:
        """The signals since the last change, once they hold judge_steps steps (None: not yet; see signals())."""
        if stats is None:
            return None
        if (self.since is None or self.since.get("incarnation") != stats.get("incarnation")
                or not self.since.get("batches_leased")):
            self.since = stats
            return None
        return signals(self.since, stats, self.min_window_s, self.judge_steps)

    def start_over(self, stats: dict | None) -> None:
        """Both windows start at `stats` (after a change, or while a worker starts); None: kept as they are."""
        if stats is not None:
            self.prev = self.since = stats


def run_cost(fixed_per_hour: float, worker_price: float, workers: int) -> float:
    """$/hour of the run with `workers` rollout jobs (the proxy, trainer and supervisor are `fixed_per_hour`)."""
    return fixed_per_hour + worker_price * workers


def affordable(bounds: Bounds, fixed_per_hour: float, worker_price: float) -> int:
    """The most rollout jobs the bounds allow: max_workers, and what the $/hour cap leaves after the fixed jobs."""
    if bounds.budget_per_hour is None:
        return bounds.max_workers
    by_budget = math.floor((bounds.budget_per_hour - fixed_per_hour) / worker_price + 1e-9) if worker_price else bounds.max_workers
    return max(0, min(bounds.max_workers, by_budget))


def wanted(sig: Signals, target: float, fleet: int) -> int:
    """How many workers in all (the `fleet` of own ones + lent) would bring the trainer to target, if its utilisation
    grows in proportion to the workers (the rate of groups does, until the trainer is the bottleneck). The fleet, not
    the proxy's own live workers: one asked to leave stays live there until its last round is in."""
    return math.ceil((fleet + sig.lent_workers) * target / max(sig.trainer_util, 0.05))


def decide(sig: Signals | None, fleet: int, starting: int, bounds: Bounds, most: int, since_change_s: float = math.inf,
           last_change: str | None = None, memory: Memory | None = None, judge: Signals | None = None) -> Decision:
    """The decision for `fleet` own rollout jobs (`starting` of them not at work yet), `most` of them affordable
    (affordable()), `since_change_s` after the last up or down (`last_change`; inf, None: none yet), with what
    `memory` (memory_of()) holds of earlier decisions; where given, its own last change and time are used. While a
    change waits to be judged (memory.before), the rules read `judge`, the window since it (Window.judge), and hold
    until it is there; else `sig`, the last window. The rules: the module docstring."""
    if memory is None:
        memory = Memory(last_change, since_change_s)
    def d(action: str, n: int, why: str, reason: str) -> Decision:
        return Decision(action, n, why, reason, fleet, {} if sig is None else asdict(sig))
    floor = min(bounds.min_workers, most)
    if fleet < floor:
        return d("up", floor - fleet, "below_min", f"{fleet} worker(s): below min_workers {bounds.min_workers}")
    if fleet > most:
        return d("down", fleet - most, "over_bounds", f"{fleet} worker(s): max_workers {bounds.max_workers} and "
                                                      f"budget ${bounds.budget_per_hour}/h allow {most}")
    if starting:
        return d("hold", 0, "starting", f"{starting} worker(s) still starting")
    if memory.before is not None:   # judged on the window since the change; no signals recorded until then
        if judge is None:
            what = "put-back" if memory.before[0] == "needed" else memory.before[0]
            return Decision("hold", 0, "judging", f"judging the last {what} on a window of "
                            f"{bounds.judge_steps} trainer steps since it", fleet)
        sig = judge
    if sig is None:
        return d("hold", 0, "no_window", "no window of signals yet")
    return no_better(sig, fleet, bounds, memory) or needed(sig, fleet, bounds, memory) \
        or too_many(sig, fleet, bounds, memory) \
        or too_few(sig, fleet, bounds, most, memory) \
        or d("hold", 0, "steady", f"trainer busy {sig.trainer_util:.2f}, workers wait for grants "
                                  f"{sig.wait_share:.2f}: nothing to change")


def no_better(sig: Signals, fleet: int, bounds: Bounds, memory: Memory) -> Decision | None:
    """The window since an up (judge_steps) that left the trainer under target and its utilisation not min_gain above
    the window that led to it: the workers added are taken back (and their size, memory.left, not grown to again
    within retry_s). Where rounds are long against steps, staleness bounds what may be in flight and more workers
    only wait longer for smaller grants; a slow worker's share of a batch can make the trainer wait longer still."""
    if memory.before is None or memory.before[0] != "up" or sig.trainer_util >= bounds.target_util:
        return None
    _, size, util = memory.before
    if fleet <= size or sig.trainer_util >= util + bounds.min_gain:
        return None
    return Decision("down", fleet - size, "no_better", f"trainer busy {sig.trainer_util:.2f} at {fleet} worker(s), "
                    f"{util:.2f} at {size}: not {bounds.min_gain:g} better, taken back", fleet, asdict(sig))


def needed(sig: Signals, fleet: int, bounds: Bounds, memory: Memory) -> Decision | None:
    """The window since a workers_wait down (judge_steps) leaves the trainer under target and more than min_gain less
    busy than before it: the workers are put back, and workers_wait goes no lower than that size within retry_s (under
    pacing workers wait for grants by design: the proxy holds them back to what staleness lets be trained)."""
    if memory.before is None or memory.before[0] != "down" or sig.trainer_util >= bounds.target_util:
        return None
    _, size, util = memory.before
    if fleet >= size or sig.trainer_util > util - bounds.min_gain:
        return None
    return Decision("up", size - fleet, "needed", f"trainer busy {sig.trainer_util:.2f} at {fleet} worker(s), "
                    f"{util:.2f} at {size}: put back", fleet, asdict(sig))


def too_many(sig: Signals, fleet: int, bounds: Bounds, memory: Memory) -> Decision | None:
    """Workers waiting for grants more than wait_share_down of their time, whatever the trainer does: a busy trainer
    needs no more, and one that waits while the workers do is bounded by staleness, not by them. Down by one, never
    below min_workers, not within down_cooldown_s of the last change; None where the workers do not wait so."""
    if sig.wait_share <= bounds.wait_share_down or fleet <= max(bounds.min_workers, memory.too_few or 0):
        return None
    waits = f"workers wait for grants {sig.wait_share:.2f} > {bounds.wait_share_down} of their time"
    if memory.since_change_s < bounds.down_cooldown_s:
        return Decision("hold", 0, "cooling_down", f"{waits}: cooling down ({memory.since_change_s:.0f} of "
                        f"{bounds.down_cooldown_s:g} s)", fleet, asdict(sig))
    return Decision("down", 1, "workers_wait", f"{waits} (trainer busy {sig.trainer_util:.2f})", fleet, asdict(sig))


def too_few(sig: Signals, fleet: int, bounds: Bounds, most: int, memory: Memory) -> Decision | None:
    """The trainer under target while the workers do not wait for grants over wait_share_down: up by the shortfall
    (wanted()), at most max_step, below the bound and below a size left within retry_s (Memory.left); after a
    scale-down only once the longer down cool-down has passed. None where the trainer is at target or the workers wait (at min_workers:
    too_many did not take one away, and another would wait as well)."""
    if sig.trainer_util >= bounds.target_util or sig.wait_share > bounds.wait_share_down:
        return None
    busy = f"trainer busy {sig.trainer_util:.2f} < target {bounds.target_util}"
    d = lambda action, n, why, reason: Decision(action, n, why, reason, fleet, asdict(sig))  # noqa: E731
    if fleet >= most:
        return d("hold", 0, "at_bounds", f"{busy}, but {most} worker(s) is the bound")
    tried = min((size for size, util, why in memory.left if size > fleet and
                 (why == "workers_wait" or sig.trainer_util >= util - bounds.min_gain)), default=None)
    if tried is not None and fleet + 1 >= tried:
        return d("hold", 0, "tried", f"{busy}, but {tried} worker(s) was tried and left")
    cool = bounds.down_cooldown_s if memory.last_change == "down" else bounds.up_cooldown_s
    if memory.since_change_s < cool:
        return d("hold", 0, "cooling_down", f"{busy}: cooling down ({memory.since_change_s:.0f} of {cool:g} s since "
                                            f"the last {memory.last_change})")
    cap = min(most, tried - 1 if tried is not None else most)
    n = max(1, min(bounds.max_step, wanted(sig, bounds.target_util, fleet) - sig.lent_workers - fleet, cap - fleet))
    return d("up", n, "trainer_waits", f"{busy}, workers wait for grants {sig.wait_share:.2f} of their time")


def memory_of(state: dict, now: float, bounds: Bounds) -> Memory:
    """What `state` (apply()'s) remembers at `now`: the last change and how long ago, the window before a change not
    yet measured, the sizes left and the largest put back within retry_s."""
    at = state.get("last_change_at")
    before = state.get("before")
    left = tuple(sorted((int(size), x["util"], x["why"]) for size, x in state.get("left_sizes", {}).items()
                        if now - x["at"] < bounds.retry_s))
    kept = [int(size) for size, t in state.get("kept_sizes", {}).items() if now - t < bounds.retry_s]
    return Memory(state.get("last_change"), now - at if at is not None else math.inf,
                  None if before is None else (before["action"], before["size"], before["util"]), left,
                  max(kept, default=None))


# ---- the fleet's roles ----------------------------------------------------------------------------------------


def with_arg(args: list[str], flag: str, value: str) -> list[str]:
    """args with `flag`'s value replaced (or the pair appended)."""
    if flag in args[:-1]:
        i = args.index(flag)
        return [*args[:i + 1], value, *args[i + 2:]]
    return [*args, flag, value]


def index(role: str) -> int:
    """rollout-N's N."""
    return int(role.split("-")[1])


def worker_spec(template: JobSpec, run: str, n: int) -> JobSpec:
    """The spec of rollout-`n`: the launcher's rollout-1 with its own role, worker id and seed."""
    args = with_arg(with_arg(template.args, "--worker-id", f"{run}-w{n}"), "--seed", str(n))
    return replace(template, role=f"rollout-{n}", args=args)


def worker_id(spec: JobSpec) -> str:
    return spec.args[spec.args.index("--worker-id") + 1]


def fixed_cost(specs: list[JobSpec]) -> tuple[float, float]:
    """($/hour of every job but the rollout workers, $/hour of one worker) at costs.PRICES; a flavor not priced
    there is refused: a cap cannot be kept on an unknown price."""
    unknown = sorted({s.flavor for s in specs if s.flavor not in PRICES})
    if unknown:
        raise SystemExit(f"autoscale: no price for flavor(s) {', '.join(unknown)} (costs.PRICES): cannot keep a $/hour cap")
    fixed = sum(PRICES[s.flavor] for s in specs if not s.role.startswith("rollout-"))
    worker = next(PRICES[s.flavor] for s in specs if s.role.startswith("rollout-"))
    return fixed + EXPOSE_PRICE * sum(s.role in ("proxy", STANDBY) for s in specs), worker  # each proxy's exposed port


def check_budget(bounds: Bounds, specs: list[JobSpec]) -> None:
    """A cap that cannot pay for the run's other jobs and min_workers (at least one) workers is refused."""
    fixed, price = fixed_cost(specs)
    need = max(1, bounds.min_workers)
    if affordable(bounds, fixed, price) < need:
        raise SystemExit(f"autoscale: budget_per_hour ${bounds.budget_per_hour} does not pay for the run's other jobs "
                         f"(${fixed:.2f}/hour) and {need} worker(s) at ${price:.2f}/hour: raise it to at least "
                         f"${run_cost(fixed, price, need):.2f}")


def initial_state(roles: list[str]) -> dict:
    """The fleet before any decision: the rollout roles among `roles` (the launcher's jobs, or a local run's
    workers)."""
    roles = sorted((r for r in roles if r.startswith("rollout-")), key=index)
    return {"fleet": roles, "retired": {}, "next": 1 + index(roles[-1]), "last_change_at": None,
            "last_change": None, "before": None, "left_sizes": {}, "kept_sizes": {}, "decisions": []}


def apply(state: dict, decision: Decision) -> dict:
    """The state after `decision`: up adds roles rollout-next.., down retires the newest ones; what the policy
    remembers (memory_of()): the window before an up or a workers_wait down until a window since is read, each size
    left (no_better, workers_wait) and put back (needed) and when; the decision joins the record when
    worth_recording(). A pure function: the supervisor writes its result before acting on it."""
    fleet, retired, nxt = list(state["fleet"]), dict(state["retired"]), state["next"]
    left, kept = dict(state.get("left_sizes", {})), dict(state.get("kept_sizes", {}))
    before = None if decision.signals else state.get("before")   # a window since the change read: compared once
    util, at = decision.signals.get("trainer_util"), decision.at
    if decision.action == "up":
        fleet += [f"rollout-{i}" for i in range(nxt, nxt + decision.n)]
        nxt += decision.n
        if decision.why == "needed":
            size = str(decision.fleet + decision.n)
            left.pop(size, None)
            kept[size] = at
        if util is not None:   # a put-back is judged as well: on the window since it, not on a short one
            before = {"action": "needed" if decision.why == "needed" else "up", "size": decision.fleet, "util": util}
    elif decision.action == "down":
        for r in fleet[len(fleet) - decision.n:]:
            retired[r] = at
        fleet = fleet[:len(fleet) - decision.n]
        if decision.why in ("no_better", "workers_wait"):
            left[str(decision.fleet)] = {"at": at, "util": util, "why": decision.why}
        if decision.why == "workers_wait":
            before = {"action": "down", "size": decision.fleet, "util": util}
    changed = decision.action != "hold"
    return {**state, "fleet": fleet, "retired": retired, "next": nxt, "before": before, "left_sizes": left,
            "kept_sizes": kept, "last_change_at": at if changed else state["last_change_at"],
            "last_change": decision.action if changed else state.get("last_change"),
            "decisions": [*state["decisions"], decision.record()][-KEEP:] if worth_recording(state, decision)
            else state["decisions"]}


def worth_recording(state: dict, decision: Decision) -> bool:
    """Every up and down; a hold only when its rule differs from the last decision recorded's (a hold at every poll
    would bury the changes)."""
    return decision.action != "hold" or not state["decisions"] or state["decisions"][-1]["why"] != decision.why


def unseen(worker_ids: list[str], stats: dict | None) -> int:
    """The workers the proxy has no group from yet (`workers` in /v1/stats; none when it did not answer): a worker
    counts as starting until then, so that no window measures a model loading (and no added worker is judged on
    one)."""
    if stats is None:
        return 0
    seen = stats.get("workers", {})
    return sum(1 for w in worker_ids if w not in seen)


def starting_count(jobs: dict, fleet: list[str], worker_ids: list[str], stats: dict | None) -> int:
    """The fleet's roles whose job is not running yet (none listed, or scheduling), or whose worker (`worker_ids`, by
    role) has sent the proxy no group yet."""
    jobs_starting = [r for r in fleet if r not in jobs or stage(jobs[r]) not in ("RUNNING", *TERMINAL)]
    return len(jobs_starting) + unseen([w for r, w in zip(fleet, worker_ids) if r not in jobs_starting], stats)


def leaving_overdue(state: dict, role: str, now: float, leave_s: float) -> bool:
    """A retired role's job has had leave_s to finish its round and exit by itself."""
    return now - state["retired"].get(role, now) > leave_s


# ---- the supervisor's hook ------------------------------------------------------------------------------------


def look(window: Window, state: dict, stats: dict | None, starting: int, bounds: Bounds, most: int,
         now: float) -> tuple[dict, Decision]:
    """One look of a controller (the supervisor's Autoscaler, the local fleet, the fleet simulation) at the proxy's
    `stats`, `starting` of the fleet's workers not at work yet: the decision on the window's signals (decide), and
    the state after it (apply). The windows start over while a worker starts and at every change."""
    if starting:
        window.start_over(stats)
    sig, judge = (None, None) if starting else (window.read(stats), window.judge(stats))
    decision = replace(decide(sig, len(state["fleet"]), starting, bounds, most, memory=memory_of(state, now, bounds),
                              judge=judge), at=now)
    if decision.action != "hold":
        window.start_over(stats)
    return apply(state, decision), decision


@dataclass
class Autoscaler:
    """The fleet of a supervised run: decides at every look of the supervisor, writes the decision and the fleet it
    leads to (STATE) before acting, puts the fleet's roles into the supervisor's specs (its loop launches a role
    with no live job and leaves the rest alone), and asks retired workers to leave."""
    bucket: object
    run: str
    bounds: Bounds
    template: JobSpec         # the launcher's first rollout job: every added one is a copy with its own id and seed
    fixed_per_hour: float
    worker_price: float
    leave_s: float            # a retired worker has this long to finish its round and exit, then it is cancelled
    plan_specs: list[JobSpec] = field(default_factory=list)  # the launcher's jobs: the fleet before any decision
    window: Window | None = None

    def __post_init__(self):
        self.window = self.window or Window.of(self.bounds)

    @classmethod
    def for_plan(cls, bucket, run: str, plan: dict, specs: list[JobSpec], leave_s: float) -> Autoscaler:
        workers = sorted((s for s in specs if s.role.startswith("rollout-")), key=lambda s: index(s.role))
        if not workers:
            raise SystemExit("autoscale: the plan has no rollout job to copy")
        fixed, price = fixed_cost(specs)
        try:
            bounds = Bounds(**plan["autoscale"])
        except (TypeError, ValueError) as e:
            raise SystemExit(f"launch/plan.json's autoscale: {e}") from None
        check_budget(bounds, specs)
        return cls(bucket, run, bounds, workers[0], fixed, price, leave_s, list(specs))

    def load(self, specs: list[JobSpec]) -> tuple[dict, str | None]:
        got = self.bucket.get(STATE)
        return (initial_state([s.role for s in specs]), None) if got is None else (json.loads(got[0]), got[1])

    def step(self, state: dict, jobs: dict, stats: dict | None, now: float) -> tuple[dict, Decision]:
        """The state after this look's decision (pure but for the kept reading: the window starts over while a
        worker starts and at every change)."""
        fleet = state["fleet"]
        waiting = starting_count(jobs, fleet, [self.worker_id(r) for r in fleet], stats)
        return look(self.window, state, stats, waiting, self.bounds,
                    affordable(self.bounds, self.fixed_per_hour, self.worker_price), now)

    def worker_id(self, role: str) -> str:
        return worker_id(worker_spec(self.template, self.run, index(role)))

    def specs(self, state: dict) -> dict[str, JobSpec]:
        """The job specs of the fleet's roles."""
        return {r: worker_spec(self.template, self.run, index(r)) for r in state["fleet"]}

    def leaving(self, state: dict, jobs: dict, now: float) -> list[tuple[str, object, bool]]:
        """(worker id, job, overdue) of each retired role whose job still runs."""
        return [(self.worker_id(r), jobs[r], leaving_overdue(state, r, now, self.leave_s))
                for r in state["retired"] if r in jobs and stage(jobs[r]) not in TERMINAL]

    def look(self, sup, jobs: dict, log) -> None:
        """One look of the supervisor `sup` (its bucket, api, namespace, token and specs) at its run's newest jobs by
        role: decide; write the decision and the fleet (conditional: a supervisor that lost the race leaves it to the
        other); make the supervisor's rollout specs the fleet's; ask retired workers to leave, cancel overdue ones."""
        state, etag = self.load(self.plan_specs)
        now = time.time()
        new, decision = self.step(state, jobs, proxy_call(sup, "GET", "/v1/stats", log), now)
        recorded = worth_recording(state, decision)
        if new != state:   # a decision recorded, or what the policy remembers changed (apply())
            try:
                self.bucket.put_json(STATE, new, **({"if_match": etag} if etag else {"if_none_match": True}))
            except ConflictError:
                log("autoscale: launch/autoscale.json changed under us (another supervisor): not acting on this look")
                return
            state = new
        if recorded:
            log(f"autoscale: {decision.action}{f' {decision.n}' if decision.n else ''} ({len(state['fleet'])} "
                f"worker(s) now): {decision.reason}")
        for r in [r for r in sup.specs if r.startswith("rollout-")]:
            del sup.specs[r]
        sup.specs.update(self.specs(state))
        for wid, job, overdue in self.leaving(state, jobs, now):
            if overdue:
                with hub_errors(f"cancelling the retired worker {wid}"):
                    sup.api.cancel_job(job_id=job.id, namespace=sup.ns)
                log(f"autoscale: cancelled job {job.id} of worker {wid}: retired {self.leave_s:g} s ago and still running")
            else:
                proxy_call(sup, "POST", "/v1/workers/leave", log, {"worker_id": wid, "why": "scaled down by the supervisor"})


def proxy_call(sup, method: str, path: str, log, body: dict | None = None) -> dict | None:
    """The run's proxy (at proxy/endpoint.json) answering `method path` with the admin token; None (said) if it
    does not: the look decides without signals and the next one asks again."""
    from huggingface_hub.utils import get_session
    record = read_proxy_endpoint(sup.bucket)
    if record is None:
        return None
    try:
        r = get_session().request(method, f"{record['url']}{path}", json=body, timeout=10, headers={
            "Authorization": f"Bearer {sup.token}", "X-Proxy-Token": secret_values(sup.token)["PROXY_TOKEN"]})
        if r.status_code == 200:
            return r.json()
        log(f"autoscale: the proxy answered {method} {path} with {r.status_code}: {r.text[:200]}")
    except Exception as e:  # the proxy is down or moving: no signals this look
        log(f"autoscale: the proxy did not answer {method} {path} ({type(e).__name__})")
    return None

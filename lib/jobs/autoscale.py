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

The rules, in order: below min_workers: up; above max_workers or the $/hour cap: down; a launch still starting or a
cool-down since the last change: hold; no window yet (the first look, a new proxy incarnation, a window shorter than
min_window_s, or a trainer that has not leased): hold; trainer utilisation under target while workers do not
wait for grants: up, by as many as the shortfall says (at most max_step, within max_workers and the cap; after a
scale-down only once its longer cool-down has passed); trainer at target while workers wait for grants more than
wait_share_down of their time: down by one. Else hold.

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
            (min(self.up_cooldown_s, self.down_cooldown_s, self.min_window_s) < 0, "cool-downs and window: >= 0")] if bad]
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


@dataclass(frozen=True)
class Decision:
    action: Literal["up", "down", "hold"]
    n: int
    why: str                 # which rule: below_min, over_bounds, starting, no_window, at_bounds, cooling_down,
                             # trainer_waits, workers_wait, steady
    reason: str              # the rule and its numbers, as the log says it
    fleet: int               # the run's own rollout jobs before it
    signals: dict = field(default_factory=dict)
    at: float = 0.0          # wall clock (cool-downs)

    def record(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


# ---- the policy: pure functions -----------------------------------------------------------------------------


def signals(prev: dict | None, now: dict, min_window_s: float) -> Signals | None:
    """The signals over the window between two /v1/stats answers; None where none can be read (no earlier reading,
    another incarnation, a window shorter than min_window_s, or no batch leased yet)."""
    if prev is None or prev.get("incarnation") != now.get("incarnation") or "fleet" not in now:
        return None
    a, b = prev["fleet"], now["fleet"]
    window = b["clock_s"] - a["clock_s"]
    if window < max(min_window_s, 1e-9) or not now.get("batches_leased"):
        return None
    live = now.get("live_workers", {})
    own = live.get(ADMIN, 0)
    lent = sum(n for p, n in live.items() if p != ADMIN)
    idle = min(window, b["trainer_idle_s"] - a["trainer_idle_s"])
    waited = b["grant_wait_s"] - a["grant_wait_s"]
    pacing = now.get("pacing", {})
    return Signals(window_s=window, trainer_util=max(0.0, 1 - idle / window),
                   wait_share=min(1.0, waited / (window * max(1, own + lent))), own_workers=own, lent_workers=lent,
                   buffer=now.get("buffer_size", 0), step_s=pacing.get("step_s"), round_s=pacing.get("round_s_median"))


@dataclass
class Window:
    """The /v1/stats reading the next window starts from: it moves on once a window is read, or the proxy restarted."""
    min_window_s: float
    prev: dict | None = None

    def read(self, stats: dict | None) -> Signals | None:
        """The signals since the reading kept (None: none yet, see signals())."""
        if stats is None:
            return None
        sig = signals(self.prev, stats, self.min_window_s)
        if sig is not None or self.prev is None or self.prev.get("incarnation") != stats.get("incarnation"):
            self.prev = stats
        return sig

    def start_over(self, stats: dict) -> None:
        """The next window starts at `stats` (a driver that counts a worker as starting until it works)."""
        self.prev = stats


def run_cost(fixed_per_hour: float, worker_price: float, workers: int) -> float:
    """$/hour of the run with `workers` rollout jobs (the proxy, trainer and supervisor are `fixed_per_hour`)."""
    return fixed_per_hour + worker_price * workers


def affordable(bounds: Bounds, fixed_per_hour: float, worker_price: float) -> int:
    """The most rollout jobs the bounds allow: max_workers, and what the $/hour cap leaves after the fixed jobs."""
    if bounds.budget_per_hour is None:
        return bounds.max_workers
    by_budget = math.floor((bounds.budget_per_hour - fixed_per_hour) / worker_price + 1e-9) if worker_price else bounds.max_workers
    return max(0, min(bounds.max_workers, by_budget))


def wanted(sig: Signals, target: float) -> int:
    """How many workers in all (own + lent) would bring the trainer to target, if its utilisation grows in proportion
    to the workers (the rate of groups does, until the trainer is the bottleneck)."""
    return math.ceil((sig.own_workers + sig.lent_workers) * target / max(sig.trainer_util, 0.05))


def decide(sig: Signals | None, fleet: int, starting: int, bounds: Bounds, most: int, since_change_s: float,
           last_change: str | None = None) -> Decision:
    """The decision for `fleet` own rollout jobs (`starting` of them not running yet), `most` of them affordable
    (affordable()), `since_change_s` after the last up or down (`last_change`; inf, None: none yet). The rules: the
    module docstring. Scaling up again after a scale-down waits out the longer down cool-down: where rounds are long
    against steps, no fleet keeps the trainer busy (staleness bounds what may be in flight), and the trainer waits in
    one window while the workers wait for grants in the next (the fleet simulation flapped so)."""
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
    if sig is None:
        return d("hold", 0, "no_window", "no window of signals yet")
    busy, waits = f"trainer busy {sig.trainer_util:.2f}", f"workers wait for grants {sig.wait_share:.2f}"
    low, waiting = sig.trainer_util < bounds.target_util, sig.wait_share > bounds.wait_share_down
    if low and not waiting:
        if fleet >= most:
            return d("hold", 0, "at_bounds", f"{busy} < target {bounds.target_util}, but {most} worker(s) is the bound")
        cool = bounds.down_cooldown_s if last_change == "down" else bounds.up_cooldown_s
        if since_change_s < cool:
            return d("hold", 0, "cooling_down", f"{busy} < target: cooling down ({since_change_s:.0f} of {cool:g} s "
                                                f"since the last {last_change})")
        n = max(1, min(bounds.max_step, wanted(sig, bounds.target_util) - sig.lent_workers - fleet, most - fleet))
        return d("up", n, "trainer_waits", f"{busy} < target {bounds.target_util}, {waits} of their time")
    if waiting and not low and fleet > bounds.min_workers:
        if since_change_s < bounds.down_cooldown_s:
            return d("hold", 0, "cooling_down", f"{waits}: cooling down "
                                                f"({since_change_s:.0f} of {bounds.down_cooldown_s:g} s)")
        return d("down", 1, "workers_wait", f"{waits} > {bounds.wait_share_down} of their time, {busy} >= target "
                                            f"{bounds.target_util}")
    return d("hold", 0, "steady", f"{busy}, {waits}: nothing to change")


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
            "last_change": None, "decisions": []}


def apply(state: dict, decision: Decision) -> dict:
    """The state after `decision`: up adds roles rollout-next.., down retires the newest ones (a pure function: the
    supervisor writes its result before acting on it)."""
    fleet, retired, nxt = list(state["fleet"]), dict(state["retired"]), state["next"]
    if decision.action == "up":
        fleet += [f"rollout-{i}" for i in range(nxt, nxt + decision.n)]
        nxt += decision.n
    elif decision.action == "down":
        for r in fleet[len(fleet) - decision.n:]:
            retired[r] = decision.at
        fleet = fleet[:len(fleet) - decision.n]
    changed = decision.action != "hold"
    return {**state, "fleet": fleet, "retired": retired, "next": nxt,
            "last_change_at": decision.at if changed else state["last_change_at"],
            "last_change": decision.action if changed else state.get("last_change"),
            "decisions": [*state["decisions"], decision.record()][-KEEP:]}


def worth_recording(state: dict, decision: Decision) -> bool:
    """Every up and down; a hold only when its rule differs from the last decision recorded's (a hold at every poll
    would bury the changes)."""
    return decision.action != "hold" or not state["decisions"] or state["decisions"][-1]["why"] != decision.why


def starting_count(jobs: dict, fleet: list[str]) -> int:
    """The fleet's roles whose job is not running yet (none listed, or scheduling)."""
    return sum(1 for r in fleet if r not in jobs or stage(jobs[r]) not in ("RUNNING", *TERMINAL))


def leaving_overdue(state: dict, role: str, now: float, leave_s: float) -> bool:
    """A retired role's job has had leave_s to finish its round and exit by itself."""
    return now - state["retired"].get(role, now) > leave_s


# ---- the supervisor's hook ------------------------------------------------------------------------------------


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
        self.window = self.window or Window(self.bounds.min_window_s)

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
        """The state after this look's decision (pure but for the kept reading)."""
        sig = self.window.read(stats)
        most = affordable(self.bounds, self.fixed_per_hour, self.worker_price)
        since = now - state["last_change_at"] if state["last_change_at"] is not None else math.inf
        decision = replace(decide(sig, len(state["fleet"]), starting_count(jobs, state["fleet"]), self.bounds, most,
                                  since, state.get("last_change")), at=now)
        return (apply(state, decision) if worth_recording(state, decision) else state), decision

    def specs(self, state: dict) -> dict[str, JobSpec]:
        """The job specs of the fleet's roles."""
        return {r: worker_spec(self.template, self.run, index(r)) for r in state["fleet"]}

    def leaving(self, state: dict, jobs: dict, now: float) -> list[tuple[str, object, bool]]:
        """(worker id, job, overdue) of each retired role whose job still runs."""
        return [(worker_id(worker_spec(self.template, self.run, index(r))), jobs[r],
                 leaving_overdue(state, r, now, self.leave_s))
                for r in state["retired"] if r in jobs and stage(jobs[r]) not in TERMINAL]

    def look(self, sup, jobs: dict, log) -> None:
        """One look of the supervisor `sup` (its bucket, api, namespace, token and specs) at its run's newest jobs by
        role: decide; write the decision and the fleet (conditional: a supervisor that lost the race leaves it to the
        other); make the supervisor's rollout specs the fleet's; ask retired workers to leave, cancel overdue ones."""
        state, etag = self.load(self.plan_specs)
        now = time.time()
        new, decision = self.step(state, jobs, proxy_call(sup, "GET", "/v1/stats", log), now)
        if new is not state:
            try:
                self.bucket.put_json(STATE, new, **({"if_match": etag} if etag else {"if_none_match": True}))
            except ConflictError:
                log("autoscale: launch/autoscale.json changed under us (another supervisor): not acting on this look")
                return
            state = new
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

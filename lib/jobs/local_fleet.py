"""Autoscaling a local run's rollout workers (`bash launch_jobs.sh --local --autoscale`): worker processes on this
machine in place of rollout jobs, driven by the same policy as the supervisor's (autoscale.py: `Window`, `decide`,
`apply`), so a local run shows what the controller does without Hugging Face Jobs.

    bash launch_jobs.sh --local --autoscale                                  # start with one worker, at most 2
    bash launch_jobs.sh --local --autoscale --autoscale-arg max_workers=3    # any Bounds field, as name=value

The launcher starts this driver where it would start the workers (`--workers` is where the fleet starts). Every
`poll_s` it reads the proxy's /v1/stats with the admin token (PROXY_TOKEN), decides, and makes the processes match the
fleet: an added worker is `rollout.py --worker-id wN --seed N` (as `--workers N` starts them), its log
`runs/<run>/rollout-wN.log`; a retired one (the newest) is asked to leave through the proxy (POST /v1/workers/leave)
at every look until it exits, and stopped (SIGTERM) if it still runs `leave_s` after. Every up and down, and each new
reason to hold, goes to the console (`autoscale: up 1 (2 worker(s) now): trainer busy 0.41 < target 0.85, ...`), to
`runs/<run>/autoscale.jsonl` and, with the fleet, to the bucket's `launch/autoscale.json` (as the supervisor writes it).

Local choices, not the policy's: a worker counts as starting (the policy holds) until the proxy has a group of its
(`workers` in /v1/stats), and the signal window starts over while one starts, so a window measures the fleet at
work, not a model loading; LOCAL_BOUNDS (below) shortens the cool-downs and the window to the scale of a run of a few
minutes. Local processes cost $0 an hour (costs.LOCAL_PRICE), so no $/hour cap binds.

A worker that exits 0 unasked saw the trainer's final version: the run is over, the driver starts nothing more and
exits 0 once its workers have. A worker that fails is started again (as the supervisor relaunches a role), at most
MAX_FAILURES times in the run; then the driver stops the others and exits 1, naming the log.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from autoscale import STATE, Bounds, Decision, Window, affordable, index, initial_state, look, unseen, worth_recording
from common import Bucket
from costs import LOCAL_PRICE
from proxy_client import ProxyClient

# a run of a few minutes on a CPU machine: a window of at least 20 s of proxy time and one step, and a change judged
# on the first such window since it (20 s holds one to four local steps of 5-20 s; more steps would leave a short run
# little time after its first decision), a new worker is at work within a minute (its model loaded, its first round
# sent), and scaling down waits two minutes after a change; at most 2 workers: each worker and the trainer use one
# core (one torch thread), and past two workers a small machine mostly shares its cores out again
LOCAL_BOUNDS = {"max_workers": 2, "max_step": 1, "min_window_s": 20.0, "min_window_steps": 1, "judge_steps": 1,
                "up_cooldown_s": 60.0, "down_cooldown_s": 120.0}
MAX_FAILURES = 3   # worker processes that may fail in a run before the driver gives up


def worker_id(role: str) -> str:
    """rollout-N's --worker-id (as launch_jobs.sh --workers N names them)."""
    return f"w{index(role)}"


def starting(fleet: list[str], stats: dict | None) -> int:
    """The fleet's workers the proxy has no group from yet (all of them when it did not answer)."""
    return len(fleet) if stats is None else unseen([worker_id(r) for r in fleet], stats)


def bounds_from(overrides: list[str]) -> Bounds:
    """LOCAL_BOUNDS, then each `name=value` (a Bounds field; `--max-workers=3` is read the same) on top; SystemExit
    naming a bad one."""
    kinds = {f.name: f.type for f in fields(Bounds)}
    got: dict = dict(LOCAL_BOUNDS)
    for item in overrides:
        name, sep, value = item.removeprefix("--").partition("=")
        name = name.replace("-", "_")
        if not sep or name not in kinds:
            raise SystemExit(f"autoscale bound {item!r}: expected NAME=VALUE, NAME one of {', '.join(kinds)}")
        try:
            got[name] = None if value == "none" else (int(value) if "int" in str(kinds[name]) else float(value))
        except ValueError:
            raise SystemExit(f"autoscale bound {item!r}: {value!r} is not a number") from None
    try:
        return Bounds(**got)
    except ValueError as e:
        raise SystemExit(str(e)) from None


@dataclass
class LocalFleet:
    """The fleet's worker processes and the autoscaling state (autoscale.apply's) they follow."""
    out: Path                 # runs/<run>
    command: list[str]        # rollout.py and its options, less --worker-id and --seed
    bounds: Bounds
    client: object            # a ProxyClient on the admin token
    bucket: object | None     # the run's bucket (decisions recorded there too), None: only locally
    leave_s: float = 120.0
    state: dict = field(default_factory=dict)
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)   # role -> its running process
    failures: int = 0
    over: bool = False        # a worker saw the final version: start nothing more
    window: Window | None = None

    def __post_init__(self):
        self.window = self.window or Window.of(self.bounds)

    def start(self, role: str) -> None:
        n = index(role)
        log = open(self.out / f"rollout-{worker_id(role)}.log", "ab")
        proc = subprocess.Popen([*self.command, "--worker-id", worker_id(role), "--seed", str(n)],
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.workers[role] = proc
        say(f"autoscale: started worker {worker_id(role)} (pid {proc.pid}, log {self.out.name}/rollout-{worker_id(role)}.log)")

    def reap(self) -> None:
        """Forget the workers that exited: a retired one left; one that exits 0 unasked ends the run; a failure is
        counted (the next look starts it again)."""
        for role, w in list(self.workers.items()):
            code = w.poll()
            if code is None:
                continue
            del self.workers[role]
            if role in self.state["retired"]:
                say(f"autoscale: worker {worker_id(role)} left (status {code})")
            elif code == 0:
                self.over = True
            else:
                self.failures += 1
                say(f"autoscale: worker {worker_id(role)} failed (status {code}, {self.failures} of {MAX_FAILURES} "
                    f"failures allowed; see {self.out.name}/rollout-{worker_id(role)}.log)")

    def stats(self) -> dict | None:
        try:
            return self.client.get("/v1/stats")
        except Exception as e:  # the proxy is down or moving: no signals this look, the next one asks again
            say(f"autoscale: the proxy did not answer /v1/stats ({type(e).__name__})")
            return None

    def decide(self, stats: dict | None, now: float) -> Decision:
        """This look's decision (autoscale.look), recorded when worth it."""
        before = self.state
        self.state, decision = look(self.window, self.state, stats, starting(self.state["fleet"], stats), self.bounds,
                                    affordable(self.bounds, 0.0, LOCAL_PRICE), now)
        recorded = worth_recording(before, decision)
        if recorded:
            self.record(decision)
        return decision

    def record(self, decision: Decision) -> None:
        n = f" {decision.n}" if decision.n else ""
        say(f"autoscale: {decision.action}{n} ({len(self.state['fleet'])} worker(s) now): {decision.reason}")
        with open(self.out / "autoscale.jsonl", "a") as f:
            f.write(json.dumps({**decision.record(), "fleet_after": self.state["fleet"]}) + "\n")
        if self.bucket is not None:
            try:
                self.bucket.put_json(STATE, self.state)
            except Exception as e:  # the local record above has it; the bucket gets the next one
                say(f"autoscale: could not write {STATE} to the bucket ({type(e).__name__})")

    def retire(self, now: float) -> None:
        """Ask every retired worker still running to leave (the proxy keeps it live only); stop overdue ones."""
        for role, w in self.workers.items():
            if role not in self.state["retired"]:
                continue
            if now - self.state["retired"][role] > self.leave_s:
                say(f"autoscale: worker {worker_id(role)} still runs {self.leave_s:g} s after it was retired: stopping it")
                w.terminate()
                continue
            try:
                self.client.post("/v1/workers/leave", {"worker_id": worker_id(role), "why": "scaled down (local)"})
            except Exception as e:
                say(f"autoscale: the proxy did not take the leave of {worker_id(role)} ({type(e).__name__})")

    def look(self, now: float) -> None:
        """One look: forget exited workers, decide (unless the run is over), start the fleet's missing workers,
        ask the retired ones to leave."""
        self.reap()
        if self.over or self.failures >= MAX_FAILURES:
            return
        self.decide(self.stats(), now)
        for role in self.state["fleet"]:
            if role not in self.workers:
                self.start(role)
        self.retire(now)

    def stop(self, grace_s: float = 50.0) -> None:
        """SIGTERM every worker (each sends its round first), SIGKILL what is left after grace_s."""
        for w in self.workers.values():
            w.terminate()
        deadline = time.time() + grace_s
        for w in self.workers.values():
            try:
                w.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                w.kill()


def say(msg: str) -> None:
    print(msg, flush=True)


def stopped(signum, frame) -> None:
    """SIGTERM (the launcher stopping the run): stop the workers as Ctrl-C would."""
    raise KeyboardInterrupt


def run(fleet: LocalFleet, poll_s: float) -> int:
    """Look every poll_s until the run is over and every worker exited (0), or too many failed (1)."""
    signal.signal(signal.SIGTERM, stopped)
    try:
        while True:
            fleet.look(time.time())
            if fleet.failures >= MAX_FAILURES:
                say(f"autoscale: {fleet.failures} worker processes failed: giving up (see {fleet.out}/rollout-*.log)")
                fleet.stop()
                return 1
            if fleet.over and not fleet.workers:
                say("autoscale: the run is over and every worker exited")
                return 0
            time.sleep(poll_s)
    except KeyboardInterrupt:
        fleet.stop()
        return 130


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="local_fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="runs/<run>: the workers' logs and autoscale.jsonl go there")
    p.add_argument("--python", required=True, help="the Python that runs rollout.py")
    p.add_argument("--workers", type=int, default=1, help="workers to start with")
    p.add_argument("--poll-s", type=float, default=None,
                   help="seconds between looks (default: the bounds' min_window_s, so that each look reads a window)")
    p.add_argument("--leave-s", type=float, default=120.0, help="a retired worker still running this long is stopped")
    p.add_argument("--bound", action="append", default=[], help="NAME=VALUE over LOCAL_BOUNDS (a Bounds field: "
                                                                "max_workers=3, up_cooldown_s=30, ...; none for None)")
    p.add_argument("rollout_args", nargs=argparse.REMAINDER, help="-- then rollout.py's options")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    """python -c 'import common, local_fleet, sys; sys.exit(local_fleet.main(sys.argv[1:]))' --out runs/R \\
           --python .venv/bin/python [--bound=max_workers=3] -- --backend hf --task addition ...
    (launch_jobs.sh runs it so, in the run's environment: PROXY_TOKEN, PROXY_URL or the bucket's record)"""
    a = parse(argv)
    bounds = bounds_from(a.bound)
    if a.workers < 1:
        raise SystemExit("--workers: at least 1 to start from")
    rollout = a.rollout_args[1:] if a.rollout_args[:1] == ["--"] else a.rollout_args
    client = ProxyClient(os.environ.get("PROXY_URL", "http://127.0.0.1:8000"), os.environ["PROXY_TOKEN"], patience_s=10)
    bucket = Bucket() if os.environ.get("BUCKET") else None
    out = Path(a.out)
    fleet = LocalFleet(out, [a.python, "rollout.py", *rollout], bounds, client, bucket, a.leave_s,
                       initial_state([f"rollout-{i}" for i in range(1, a.workers + 1)]))
    say(f"autoscale: from {a.workers} worker(s), bounds {asdict(bounds)}; decisions in {out}/autoscale.jsonl")
    return run(fleet, a.poll_s if a.poll_s is not None else max(1.0, bounds.min_window_s))

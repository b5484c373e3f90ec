"""The same simulated run at fixed fleet sizes 1..K and with the autoscaling controller from one worker (issue 47's
acceptance): the trainer's utilisation, the workers' seconds, dollars and time to finish of each, the controller's
decisions, and whether the controller came within 10% of the cheapest fixed size that kept the target.

    .venv/bin/python bench/autoscale_compare.py                       # the configuration of docs/results/fleet.md
    .venv/bin/python bench/autoscale_compare.py --sim.autoscale-target 0.8    # a target some fixed size keeps here
    .venv/bin/python bench/autoscale_compare.py --seeds 1 2 3 --max-workers 4
    .venv/bin/python bench/autoscale_compare.py --controller-only --sim.crash 0.03 --sim.rounds-slow-at 0.3 \\
        --sim.rounds-slow-x 2 --sim.trainer-slow-at 0.65 --sim.trainer-slow-x 4 --sim.steps 40   # the scenario run

Every run is bench/fleet_sim.py's (the real proxy, a real S3 server, simulated workers and trainer; the controller
is lib/jobs/autoscale.py's pure policy over the proxy's /v1/stats, its window and cool-downs Bounds' defaults times
--sim.autoscale-time). Worker i and the trainer's step times are the same draws at every size (fleet_sim seeds them
by worker), the batch is fixed (--sim.batch), and joins, leaves and crashes are off unless asked. Dollars are
fleet_sim.run_dollars: the jobs-autoscale preset's flavors at costs.PRICES, over the durations drawn (simulated
seconds / --sim.time-scale). Per size, the median over the seeds; every other seed runs the configurations in the
reverse order (the machine's load drifts).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fleet_sim  # noqa: E402 - bench/ itself

# 40 steps: the controller's first windows (from one worker, three steps each) take a fixed share of the run; at 16
# steps that share was a third of it, more than a run of hours on Jobs gives them
SIM = fleet_sim.Args(workers=[1], pace="on", steps=40, batch=16, span=(0.5, 1.0), time_scale=0.75, round_scale=0.15,
                     max_staleness=2, join=0.0, leave=0.0, crash=0.0, timeout_s=1200.0, autoscale_time=1 / 20)


@dataclass
class Args:
    sim: fleet_sim.Args = field(default_factory=lambda: SIM)
    """the run (fleet_sim's options; --sim.workers and --sim.autoscale are set here for each configuration)"""
    max_workers: int = 4
    """K: fixed sizes 1..K, and the controller's max_workers"""
    seeds: list[int] = field(default_factory=lambda: [1])
    controller_only: bool = False
    """only the controller's run (a scenario: --sim.crash, --sim.rounds-slow-*, --sim.trainer-slow-*)"""
    out: str = "runs/autoscale_compare.json"


def configurations(a: Args) -> list[tuple[str, fleet_sim.Args, int]]:
    """(label, fleet_sim's args, starting size) of each configuration of one seed: fixed sizes, then the controller."""
    fixed = [] if a.controller_only else [(f"fixed {n}", replace(a.sim, autoscale=None, workers=[n]), n)
                                          for n in range(1, a.max_workers + 1)]
    return fixed + [("controller", replace(a.sim, autoscale=a.max_workers, workers=[1]), 1)]


def decisions(r: dict) -> str:
    """The controller's ups and downs: 'at s: +n -> size'."""
    return ", ".join(f"{t:.0f}s {'+' if act == 'up' else '-'}{n}->{size + (n if act == 'up' else -n)}"
                     for t, act, n, _, size, *_ in r["autoscale"] if act != "hold")


def phases(r: dict, sim: fleet_sim.Args) -> str:
    """The trainer's utilisation in each phase of a scenario: before the rounds slow, until the trainer slows, after."""
    cuts = sorted({0, *(round(at * sim.steps) for at in (sim.rounds_slow_at, sim.trainer_slow_at) if at < 1), sim.steps})
    busy, wait = r["trainer_busy_per_step_s"], r["trainer_wait_per_step_s"]
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        b, w = sum(busy[lo:hi]), sum(wait[lo:hi])
        out.append(f"steps {lo + 1}-{hi}: {b / (b + w):.3f}" if b + w else f"steps {lo + 1}-{hi}: -")
    return "utilisation by phase: " + ", ".join(out)


def table(rows: dict[str, list[dict]]) -> list[str]:
    """One line per configuration: medians over its seeds."""
    med = lambda xs: statistics.median(xs)  # noqa: E731
    out = ["| configuration | trainer utilisation | worker-seconds | $ workers | $ whole run | time to finish s | "
           "decisions (controller) |", "|---|---|---|---|---|---|---|"]
    for label, rs in rows.items():
        out.append(f"| {label} | {med([r['utilisation'] for r in rs]):.3f} | {med([r['worker_s'] for r in rs]):.0f} | "
                   f"{med([r['worker_dollars'] for r in rs]):.4f} | {med([r['run_dollars'] for r in rs]):.4f} | "
                   f"{med([r['finish_s'] for r in rs]):.0f} | "
                   + ("; ".join(decisions(r) for r in rs) if "autoscale" in rs[0] else "") + " |")
    return out


def verdict(rows: dict[str, list[dict]], target: float) -> str:
    """The controller against the cheapest fixed size whose median utilisation reached the target (the whole run's
    dollars, the trainer and proxy included: a smaller fleet pays for them longer)."""
    med = lambda label, k: statistics.median(r[k] for r in rows[label])  # noqa: E731
    keeping = [label for label in rows if label != "controller" and med(label, "utilisation") >= target]
    if not keeping:
        return f"no fixed size reached utilisation {target}: the comparison says nothing (choose a faster fleet)"
    best = min(keeping, key=lambda label: med(label, "run_dollars"))
    ratio = med("controller", "run_dollars") / med(best, "run_dollars")
    wratio = med("controller", "worker_dollars") / med(best, "worker_dollars")
    return (f"cheapest fixed size at utilisation >= {target}: {best} (${med(best, 'run_dollars'):.4f}, utilisation "
            f"{med(best, 'utilisation'):.3f}); the controller ${med('controller', 'run_dollars'):.4f} = {ratio:.3f}x "
            f"(workers alone {wratio:.3f}x), utilisation {med('controller', 'utilisation'):.3f}: "
            f"{'within' if ratio <= 1.10 else 'NOT within'} 10%")


def main(a: Args) -> None:
    if not a.sim.batch:
        raise SystemExit("--sim.batch: the same batch at every size (0 would size it by the fleet)")
    rows: dict[str, list[dict]] = {}
    try:
        with fleet_sim.s3_server() as (tmp, port, log, pid):
            for k, seed in enumerate(a.seeds):
                # every other seed in the reverse order: a machine whose load drifts favours no configuration
                for label, sim, n in configurations(a)[::(-1) ** k]:
                    sim = replace(sim, seed=seed)
                    r = fleet_sim.configuration(sim, n, True, tmp, port, log, pid)
                    rows.setdefault(label, []).append(r)
                    print(f"seed {seed} {label}: utilisation {r['utilisation']:.3f}, {r['worker_s']:.0f} worker-s, "
                          f"${r['run_dollars']:.4f}, finished at {r['finish_s']:.0f} s"
                          f"{'' if r['finished'] else ' (TIMED OUT)'}, errors {r['errors']}"
                          + (f"; decisions {decisions(r)}; {phases(r, sim)}" if "autoscale" in r else ""), flush=True)
    finally:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), "results": rows}, indent=1, default=str) + "\n")
    print("\n".join(table(rows)))
    if not a.controller_only:
        print("medians:", verdict(rows, a.sim.autoscale_target))
        for k, seed in enumerate(a.seeds):
            print(f"seed {seed}:", verdict({label: [rs[k]] for label, rs in rows.items()}, a.sim.autoscale_target))
    print(f"results: {a.out}")


if __name__ == "__main__":
    main(tyro.cli(Args))

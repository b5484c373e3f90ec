"""What a run's jobs cost: each Jobs flavor's price, and each job's seconds, GPU-seconds and dollars over the time
it ran. The launcher prices a layout before it starts (launch_hf.cost_line); report.py prices the run after.

    python -c "import common, costs; print(costs.job_costs({'train': (0, 3600)}, {'train': 'a10g-small'}))"

A job's span is read from the run's own records (report.py): from its role's first recorded start (config/ in the
bucket) to its role's last metrics row. The time a job spends before it records its start (the image pulled, Python
started) is not in it, so the figures are a lower bound of the bill by that much per job.

A local run (launch_jobs.sh --local) has no flavor: its roles are processes on your own machine, priced at
LOCAL_PRICE ($0/hour) with no GPU-seconds; the seconds each process ran are still told.
"""
from __future__ import annotations

from memory import flavor_gpus

# $/hour of the flavors at https://huggingface.co/docs/hub/jobs-pricing (Nov 2026), exposed port $0.01/h; a100x4/x8 and
# h200x2/x4/x8 are taken as the one-GPU price times the GPUs, not read from that page: check it before budgeting on them
PRICES = {"cpu-basic": 0.01, "cpu-upgrade": 0.03, "t4-small": 0.40, "t4-medium": 0.60, "l4x1": 0.80,
          "l4x4": 3.80, "l40sx1": 1.80, "a10g-small": 1.00, "a10g-large": 1.50, "a10g-largex2": 3.00,
          "a100-large": 2.50, "h200": 5.00, "a100x4": 10.00, "a100x8": 20.00, "h200x2": 10.00, "h200x4": 20.00,
          "h200x8": 40.00}
EXPOSE_PRICE = 0.01
LOCAL = "local"       # the flavor of a process of a local run
LOCAL_PRICE = 0.0     # $/hour of a local process: your own machine, not billed by the run


def gpus(flavor: str) -> int:
    """GPUs of a flavor: 0 for a CPU flavor or a local process."""
    return 0 if flavor == LOCAL or flavor.startswith("cpu-") else flavor_gpus(flavor)


def price(flavor: str) -> float:
    """$/hour of a flavor; ValueError naming it when no price is known (a bill is not guessed)."""
    if flavor == LOCAL:
        return LOCAL_PRICE
    if flavor not in PRICES:
        raise ValueError(f"flavor {flavor!r} has no price in costs.PRICES (known: {', '.join(sorted(PRICES))})")
    return PRICES[flavor]


def job_costs(spans: dict[str, tuple[float, float]], flavors: dict[str, str]) -> dict[str, dict]:
    """Per job (a role's name in the run's records: train, proxy, rollout-<worker id>): its flavor, span (unix
    seconds), seconds, GPU-seconds and dollars. A job `flavors` does not name is a local process. ValueError: a
    span that ends before it starts, or a flavor without a price."""
    out = {}
    for job, (t0, t1) in sorted(spans.items()):
        if t1 < t0:
            raise ValueError(f"job {job}: its span ends at {t1} before it starts at {t0}")
        flavor = flavors.get(job, LOCAL)
        secs = t1 - t0
        out[job] = {"flavor": flavor, "start": t0, "end": t1, "seconds": round(secs, 1),
                    "gpu_seconds": round(secs * gpus(flavor), 1), "usd": round(secs / 3600 * price(flavor), 4)}
    return out


def spent_by(costs: dict[str, dict], at: float) -> float:
    """Dollars the jobs had cost by unix time `at` (each job's price over the part of its span before `at`)."""
    return round(sum(max(0.0, min(at, c["end"]) - c["start"]) / 3600 * price(c["flavor"]) for c in costs.values()), 4)


def plan_flavors(plan: dict | None) -> dict[str, str]:
    """The flavor of each job of a Jobs run, by the name its records carry, from launch/plan.json (None: a local
    run, no flavor). The trainer's records are `train`, a worker's `rollout-<its --worker-id>`; the supervisor
    writes no metrics, so it has no span to price."""
    out = {}
    for job in (plan or {}).get("jobs", []):
        args = job.get("args", [])
        if job["role"] == "trainer":
            out["train"] = job["flavor"]
        elif job["role"] == "proxy":
            out["proxy"] = job["flavor"]
        elif job["role"].startswith("rollout") and "--worker-id" in args[:-1]:
            out[f"rollout-{args[args.index('--worker-id') + 1]}"] = job["flavor"]
    return out

"""A local run with two participants (issue #44's acceptance): the real proxy (moto for S3), the real trainer on
--task, participant `guest` running the real rollout.py and participant `mallory` running the real worker with a lie
(--mallory: bench/lying_rollout.py's rewards inflated to 1.0, behaviour logprobs made up, or a claimed temperature
other than the one sampled at) or with issue #44's hostile groups and leases (bench/hostile_rollout.py), both on their
own scoped worker tokens (POST /v1/tokens, no bucket keys). The proxy quarantines at its default --quarantine-after 3.

    .venv/bin/python bench/participants_run.py --task calculator --steps 10
    .venv-envs/bin/python bench/participants_run.py --task reasoning-gym:syllogism --steps 10   # reasoning_gym
    .venv/bin/python bench/participants_run.py --task calculator --no-liar                     # guest alone
    .venv/bin/python bench/participants_run.py --task addition --mallory hostile --steps 6     # the issue's table
    .venv/bin/python bench/participants_run.py --task addition --mallory logprobs --steps 6

Every role runs with the Python that runs this script (for reasoning-gym: .venv-envs, which has the package, so
that the trainer re-scores its episodes). Prints and writes to --out (JSON; each role's log beside it, in a folder
of its name): per participant the groups the proxy counts as checked and the failed checks by kind, who is
quarantined and after which failure, the honest participant's groups refused by the proxy (its worker's spool
`refused/`), dropped stale or left out by the trainer, whether its worker was still running at the end, the trainer's
exit status, whether every adapter the trainer published has only finite tensors, and (--mallory hostile) the proxy's
answer to each hostile send.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402 - first of ours: puts the lib/ folders on sys.path
from audit_cost import Owner, local_bucket, start, stop  # noqa: E402 - bench/ is on the path (this script's folder)
from proxy_load import free_port, wait_up  # noqa: E402

PY = sys.executable


@dataclass
class Args:
    """One local run with an honest participant and (unless --no-liar) a lying one; see the module docstring."""
    task: str = "calculator"
    """the run's --task: the trainer's and both workers'"""
    steps: int = 10
    """trainer steps"""
    liar: bool = True
    """start mallory's lying worker beside guest's honest one"""
    mallory: Literal["rewards", "logprobs", "temperature", "hostile"] = "rewards"
    """what mallory's worker does: one of bench/lying_rollout.py's --lie, or bench/hostile_rollout.py (issue #44's
    table: each hostile group once, then honest groups; the lease attacks beside them)"""
    seed: int = 1
    """the honest worker's --seed (the liar's is seed + 1; the trainer's is 0)"""
    no_serve: bool = True
    """start the workers with --no-serve (a participant's token is refused the routed requests' lease anyway: 403)"""
    worker_args: list[str] = field(default_factory=list)
    """more arguments for both workers (rollout.py)"""
    train_args: list[str] = field(default_factory=list)
    """more arguments for train.py (after --loss cispo)"""
    timeout_s: float = 2400
    """a trainer that has not finished by then is stopped (SIGTERM) and what it did so far reported"""
    out: str = ""
    """where the JSON goes (default runs/participants-<task>.json)"""


def finite_adapters(bucket) -> dict:
    """Every published version's adapter tensors checked for NaN/inf: {version: True/False}."""
    import torch
    from safetensors.torch import load
    seen = {}
    for key in bucket.list("adapters/"):
        if key.endswith("/adapter_model.safetensors"):
            got = bucket.get(key)
            tensors = load(got[0])
            seen[key.split("/")[-2]] = all(bool(torch.isfinite(t).all()) for t in tensors.values())
    return seen


def count(path: Path, *needles: str) -> int:
    text = path.read_text(errors="replace") if path.exists() else ""
    return sum(1 for line in text.splitlines() if all(n in line for n in needles))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def local_rows(spool: Path) -> list[dict]:
    """A participant's worker's own metrics (no bucket keys: metrics.jsonl beside its spool)."""
    return [r for f in spool.glob("*/*/metrics.jsonl") for r in read_jsonl(f)]


def last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return lines[-1][:600] if lines else ""


def main(a: Args) -> None:
    tag = a.task.replace(":", "-").replace("/", "-")
    out = Path(a.out or f"runs/participants-{tag}-{a.mallory if a.liar else 'alone'}.json")
    run = f"participants-{tag}-{uuid.uuid4().hex[:6]}"
    logs = out.with_suffix("") / run
    logs.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1"}
    s3_port, p_port = free_port(), free_port()
    procs, workers, said = [], {}, {}
    try:
        env, bucket = local_bucket(run, s3_port, base, logs, procs)
        url = f"http://127.0.0.1:{p_port}"
        # the local launcher's proxy settings (launch_jobs.sh --local), the default --quarantine-after (3)
        proxy = start([PY, "proxy.py", "--port", str(p_port), "--max-buffer", "8", "--max-staleness", "1", "--pace"],
                      env, logs / "proxy.log")
        procs.append(proxy)
        wait_up(f"{url}/health", proxy)
        owner = Owner(url, env["PROXY_TOKEN"])
        names = ["guest", "mallory"] if a.liar else ["guest"]
        tokens = {n: owner.http.post("/v1/tokens", json={"name": n, "role": "worker"}).json()["token"] for n in names}
        for n in names:  # a participant's machine: no bucket, no keys, its own token
            wenv = {k: v for k, v in env.items()
                    if k not in ("BUCKET", "S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "RUN_NAME")}
            wenv.update(PROXY_TOKEN=tokens[n], PROXY_URL=url, SPOOL_DIR=str(logs / f"spool-{n}"))
            script = (["rollout.py"] if n == "guest" else
                      ["bench/hostile_rollout.py", "--hostile-log", str(logs / "hostile.jsonl")] if a.mallory == "hostile"
                      else ["bench/lying_rollout.py", "--lie", a.mallory])
            workers[n] = start([PY, *script, "--backend", "hf", "--task", a.task, "--worker-id", f"{n}-1",
                                "--seed", str(a.seed + (n != "guest")), *(["--no-serve"] if a.no_serve else []),
                                *a.worker_args], wenv, logs / f"rollout-{n}.log")
            procs.append(workers[n])
        t0 = time.time()
        train = start([PY, "train.py", "--task", a.task, "--max-steps", str(a.steps), "--loss", "cispo", *a.train_args],
                      {**env, "PROXY_URL": url}, logs / "train.log")
        procs.append(train)
        while train.poll() is None and time.time() - t0 < a.timeout_s:
            time.sleep(1)
        if train.poll() is None:
            stop(train, 300)
        code, wall = train.returncode, time.time() - t0
        stats = owner.stats()
        got = bucket.get("metrics/train.jsonl")
        rows = [json.loads(x) for x in got[0].decode().splitlines()] if got else []
        (logs / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (logs / "stats.json").write_text(json.dumps(stats, indent=1))
        adapters = finite_adapters(bucket)
        for n, w in workers.items():
            said[n] = w.poll()
    finally:
        for p in reversed(procs):
            stop(p)
    parts = stats.get("participants", {})
    result = {
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip(),
        "args": vars(a), "run": run, "logs": str(logs), "wall_s": round(wall, 1), "trainer_exit": code,
        "steps": len(rows), "reward": [round(r["reward/mean"], 4) for r in rows],
        "audit_groups": sum(r.get("audit/groups", 0) for r in rows),
        "audit_failed": sum(r.get("audit/failed", 0) for r in rows),
        "audit_left_out": sum(r.get("audit/left_out", 0) for r in rows),
        "audit_logprob_groups": sum(r.get("audit/logprob_groups", 0) for r in rows),
        "checks": {n: parts.get(n, {}).get("checks") for n in names},
        "quarantined": stats.get("quarantined", {}),
        "guest_refused_by_proxy": len(list((logs / "spool-guest" / "refused").glob("*.json")))
        if (logs / "spool-guest" / "refused").exists() else 0,
        "guest_left_out_lines": count(logs / "train.log", "left out", "guest"),
        "guest_stale": sum(r.get("rollout/groups_stale", 0) for r in local_rows(logs / "spool-guest")),
        "worker_exit_at_end": said,
        "mallory_said": last_line(logs / "rollout-mallory.log") if a.liar else None,
        "hostile": read_jsonl(logs / "hostile.jsonl"),
        "adapters_finite": adapters, "all_adapters_finite": bool(adapters) and all(adapters.values()),
    }
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("args",)}, indent=1))
    print(f"written: {out}")


if __name__ == "__main__":
    main(tyro.cli(Args))

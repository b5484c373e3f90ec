"""What the trainer's audit of participants (docs/trust.md) costs, and whether a liar slows learning: the local
run of `bash launch_jobs.sh --local` (SmolLM2-135M, the same proxy and trainer settings, one torch thread per
process), but its rollout worker joins as a participant (a scoped worker token, no bucket keys), so every
group it sends is audited at the default --audit.* settings.

    .venv/bin/python bench/audit_cost.py                        # 20 steps, one honest participant
    .venv/bin/python bench/audit_cost.py --runs 3 --steps 20    # the audit's share over 3 runs, one after another
    .venv/bin/python bench/audit_cost.py --pair --steps 20      # honest alone, then honest + the liar (same seeds)
    .venv/bin/python bench/audit_cost.py --liar --steps 20      # only the run with the liar

Per run it prints the audit's time (`perf/audit_s`) against the trainer's own time per step (`perf/step_s`
minus `perf/rollout_wait_s`: the audit, forward/backward, publishing; not the wait for a batch), the median of
the per-step shares and the share of the sums, and the reward per step. --pair adds a run with the liar of
tests/support/liar.py beside the honest worker (reward inflation, tokens off the prompt, made-up logprobs,
an unleased lease, a reused prompt, the honest worker's group replayed; then one more lie, which quarantines
it at --quarantine-after 7): its failed checks, its quarantine, and the honest groups refused or left out
(must be 0). Writes everything as JSON to --out.
"""
from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "tests"))  # the liar's helpers import conftest's
import common  # noqa: E402 - first of ours: puts the lib/ folders on sys.path
import report  # noqa: E402
from proxy_load import free_port, wait_up  # noqa: E402 - bench/ is on the path: the load test's process helpers

PY = sys.executable


@dataclass
class Args:
    """One or more local runs with a participant worker; see the module docstring."""
    steps: int = 20
    """trainer steps per run"""
    runs: int = 1
    """runs of each kind, one after another"""
    pair: bool = False
    """also a run with the liar beside the honest worker, after each honest run"""
    liar: bool = False
    """only the runs with the liar"""
    seed: int = 1
    """the rollout worker's --seed (the trainer's is 0): the same in every run"""
    train_args: list[str] = field(default_factory=list)
    """more arguments for train.py (after the local defaults: --loss cispo)"""
    timeout_s: float = 2400
    """a trainer that has not finished by then is stopped (SIGTERM: it checkpoints) and its steps so far reported"""
    out: str = "runs/audit_cost.json"
    """where the JSON goes (each run's logs: beside it, in a folder of its name)"""


class Owner:
    """The run owner's view the liar waits on (the admin token's /v1/stats)."""

    def __init__(self, url: str, token: str):
        self.http = httpx.Client(base_url=url, headers={"x-proxy-token": token}, timeout=30)

    def stats(self) -> dict:
        return self.http.get("/v1/stats").json()


def start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)


def local_bucket(run: str, port: int, base: dict, logs: Path, procs: list) -> tuple[dict, common.Bucket]:
    """A moto S3 server on `port` (appended to procs, its log in logs/s3.log) and the run's bucket in it: the roles'
    environment (base with the endpoint, local keys, the run and a fresh proxy token), also set in this process."""
    s3 = start([PY, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], base, logs / "s3.log")
    procs.append(s3)
    env = {**base, "S3_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "local",
           "AWS_SECRET_ACCESS_KEY": "local", "AWS_REGION": "us-east-1", "BUCKET": "async-grpo", "RUN_NAME": run,
           "PROXY_TOKEN": secrets.token_urlsafe(24)}
    wait_up(env["S3_ENDPOINT_URL"], s3)
    os.environ.update({k: env[k] for k in ("S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                           "AWS_REGION", "BUCKET", "RUN_NAME")})
    bucket = common.Bucket()
    bucket.ensure_bucket()
    return env, bucket


def stop(proc: subprocess.Popen, wait_s: float = 30) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def liar_thread(url: str, token: str, owner: Owner, bucket, said: list, done: list) -> threading.Thread:
    from transformers import AutoTokenizer

    from liar import hostile
    from models import local_smollm2
    tok = AutoTokenizer.from_pretrained(local_smollm2())

    def run() -> None:
        try:
            hostile(url, token, tok, owner, bucket, said, done)
            # the seventh failed check, past --quarantine-after 7: quarantined (at the latest version: a stale group
            # is dropped as stale before its lease is looked at)
            me = httpx.Client(base_url=url, headers={"x-proxy-token": token}, timeout=30)
            latest = me.get("/v1/adapters/latest").json()["version"]
            r = me.post("/v1/groups", json={
                "group_id": uuid.uuid4().hex, "worker_id": "m1", "policy_version": latest, "lease_id": uuid.uuid4().hex,
                "prompt_index": 0, "prompt_ids": [1, 2], "meta": {},
                "completions": [{"token_ids": [3], "logprobs": [-1.0 - k], "reward": 0.0, "finish_reason": "stop"}
                                for k in range(owner.stats()["group_size"])]})
            said.append(("unleased", r.status_code, r.text))
            said.append(("after", me.get("/v1/whoami").status_code, me.get("/v1/whoami").text))
        except Exception as e:  # noqa: BLE001 - reported in the run's result
            said.append(("error", 0, f"{type(e).__name__}: {e}"))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def one_run(a: Args, liar: bool, tmp: Path) -> dict:
    run = f"audit-cost-{'liar' if liar else 'honest'}-{uuid.uuid4().hex[:6]}"
    logs = tmp / run
    logs.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1"}
    s3_port, p_port = free_port(), free_port()
    procs = []
    try:
        env, bucket = local_bucket(run, s3_port, base, logs, procs)
        url = f"http://127.0.0.1:{p_port}"
        # the local launcher's proxy settings; 7 failed checks quarantine (the liar lies 6 ways, then once more)
        proxy = start([PY, "proxy.py", "--port", str(p_port), "--max-buffer", "8", "--max-staleness", "1", "--pace",
                       "--quarantine-after", "7"], env, logs / "proxy.log")
        procs.append(proxy)
        wait_up(f"{url}/health", proxy)
        owner = Owner(url, env["PROXY_TOKEN"])
        tokens = {n: owner.http.post("/v1/tokens", json={"name": n, "role": "worker"}).json()["token"]
                  for n in (["guest", "mallory"] if liar else ["guest"])}
        guest_env = {k: v for k, v in env.items()  # a participant's machine: no bucket, no keys
                     if k not in ("BUCKET", "S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "RUN_NAME")}
        guest_env.update(PROXY_TOKEN=tokens["guest"], PROXY_URL=url, SPOOL_DIR=str(logs / "spool"))
        procs.append(start([PY, "rollout.py", "--backend", "hf", "--task", "addition", "--worker-id", "w1",
                            "--seed", str(a.seed)], guest_env, logs / "rollout.log"))
        said, done = [], []
        if liar:
            liar_thread(url, tokens["mallory"], owner, bucket, said, done)
        t0 = time.time()
        train = start([PY, "train.py", "--max-steps", str(a.steps), "--loss", "cispo", *a.train_args],
                      {**env, "PROXY_URL": url}, logs / "train.log")
        procs.append(train)
        while train.poll() is None and time.time() - t0 < a.timeout_s:
            time.sleep(1)
        finished = train.poll() == 0
        if train.poll() is None:  # out of time: SIGTERM checkpoints, so the steps taken are in the bucket
            stop(train, 300)
        stats = owner.stats()
        got = bucket.get("metrics/train.jsonl")
        rows = [json.loads(x) for x in got[0].decode().splitlines()] if got else []
        (logs / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    finally:
        for p in reversed(procs):
            stop(p)
    return summarize(run, liar, finished, rows, stats, said, done, logs)


def summarize(run: str, liar: bool, finished: bool, rows: list[dict], stats: dict, said: list, done: list, logs: Path) -> dict:
    own = [r["perf/step_s"] - r["perf/rollout_wait_s"] for r in rows]
    audit = [r.get("perf/audit_s", 0.0) for r in rows]
    parts = stats.get("participants", {})
    out = {"run": run, "liar": liar, "finished": finished, "logs": str(logs), "steps": len(rows),
           "reward": [round(r["reward/mean"], 4) for r in rows],
           "first_reaches_0.8": (report.first_reaching(rows, 0.8) or {}).get("step"),  # report.py's measure
           "audit_s_median": statistics.median(audit) if rows else None,
           "own_s_median": statistics.median(own) if rows else None,
           "fwd_bwd_s_median": statistics.median(r["perf/fwd_bwd_s"] for r in rows) if rows else None,
           "audit_share_median": statistics.median(x / y for x, y in zip(audit, own)) if rows else None,
           "audit_share_of_sums": sum(audit) / sum(own) if rows else None,
           "audit_groups": sum(r.get("audit/groups", 0) for r in rows),
           "audit_logprob_groups": sum(r.get("audit/logprob_groups", 0) for r in rows),
           "audit_onpolicy_groups": sum(r.get("audit/onpolicy_groups", 0) for r in rows),
           "audit_left_out": sum(r.get("audit/left_out", 0) for r in rows),
           "honest_dev_max": max((r.get("audit/logprob_dev_max", 0.0) for r in rows if not r.get("audit/failed")), default=None),
           "guest_checks": parts.get("guest", {}).get("checks"), "quarantined": stats.get("quarantined", {})}
    if liar:
        out.update(mallory_checks=parts.get("mallory", {}).get("checks"), liar_done=bool(done),
                   lies=[(k, c, t[:160]) for k, c, t in said])
    return out


def show(r: dict) -> None:
    if not r["steps"]:
        print(f"{r['run']}: no step logged (logs in {r['logs']})")
        return
    if not r["finished"]:
        print(f"{r['run']}: stopped after {r['steps']} steps, out of time")
    print(f"{r['run']}: {r['steps']} steps; audit median {r['audit_s_median']:.3f} s of the trainer's own "
          f"{r['own_s_median']:.3f} s per step (fwd/bwd {r['fwd_bwd_s_median']:.3f} s): median share "
          f"{100 * r['audit_share_median']:.1f}%, of the sums {100 * r['audit_share_of_sums']:.1f}%; groups audited "
          f"{r['audit_groups']}, logprobs recomputed {r['audit_logprob_groups']}, checked in the step's forward "
          f"{r['audit_onpolicy_groups']}, left out {r['audit_left_out']}; honest max |dev| {r['honest_dev_max']}")
    print(f"  reward per step: {' '.join(f'{x:.2f}' for x in r['reward'])}; mean {statistics.mean(r['reward']):.3f}; "
          f"5-step mean first >= 0.8 at step {r['first_reaches_0.8']}")
    g = r["guest_checks"] or {}
    print(f"  guest: checked {g.get('checked')}, failed {g.get('failed')}; quarantined: {r['quarantined']}")
    if r["liar"]:
        m = r["mallory_checks"] or {}
        print(f"  mallory: failed {m.get('failed')} by check {m.get('by_check')}; lies sent: "
              f"{[(k, c) for k, c, _ in r['lies']]}; finished lying: {r['liar_done']}")


def main(a: Args) -> None:
    results = []
    logs = Path(a.out).with_suffix("")  # each run's logs: runs/audit_cost/<run>/
    for _ in range(a.runs):
        for liar in ([True] if a.liar else [False, True] if a.pair else [False]):
            results.append(one_run(a, liar, logs))
            show(results[-1])
    ok = [r for r in results if r["steps"] and not r["liar"]]
    if len(ok) > 1:
        print(f"median over {len(ok)} honest runs: audit share per step "
              f"{100 * statistics.median(r['audit_share_median'] for r in ok):.1f}%")
    Path(a.out).write_text(json.dumps({"commit": commit(), "args": vars(a), "runs": results}, indent=1))
    print(f"written: {a.out}")


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main(tyro.cli(Args))

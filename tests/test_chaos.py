"""Chaos: a local run on the tiny model in which the trainer, a rollout worker, the proxy and the
S3 endpoint are each killed with -9 once, at a random moment, and restarted (the S3 endpoint kept
down for 20 s). The run must reach its target step with nothing lost, redone twice or overwritten.
"""
import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

import common
from conftest import PY, ROOT, free_port, stop, wait_http

MAX_STEPS, CKPT_EVERY, S3_DOWN_S = 36, 4, 20.0


class Role:
    """One restartable process with its own log file (appended across restarts)."""

    def __init__(self, name: str, cmd: list[str], env: dict, logdir: Path):
        self.name, self.cmd, self.env, self.log = name, cmd, env, logdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Role":
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=open(self.log, "a"), stderr=subprocess.STDOUT)
        return self

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def wait_for(pred, timeout: float, what: str) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return time.time()
        time.sleep(0.2)
    raise TimeoutError(what)


def steps(trainer: Role) -> list[int]:
    return [int(m) for m in re.findall(r"^step\s+(\d+) ", trainer.text().replace("\r", "\n"), re.M)]


def test_chaos(tiny_model, s3_env, tmp_path, run_name):
    rng = random.Random(int(os.environ.get("CHAOS_SEED", time.time())))
    moto_port = int(s3_env["S3_ENDPOINT_URL"].rsplit(":", 1)[1])
    s3_port, proxy_port = free_port(), free_port()
    token = "chaos-token"
    env = {**os.environ, "RUN_NAME": run_name, "S3_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}",
           "PROXY_URL": f"http://127.0.0.1:{proxy_port}", "PROXY_TOKEN": token, "OMP_NUM_THREADS": "1",
           "TRAINER_ID": "chaos-trainer", "SPOOL_DIR": str(tmp_path / "spool")}
    s3 = Role("s3", [PY, str(ROOT / "tests" / "tcp_forward.py"), str(s3_port), str(moto_port)], env, tmp_path).start()
    wait_http(env["S3_ENDPOINT_URL"], s3.proc)
    proxy = Role("proxy", [PY, str(ROOT / "proxy.py"), "--port", str(proxy_port), "--group-size", "4",
                           "--lease-s", "60", "--max-buffer", "32"], env, tmp_path).start()
    wait_http(env["PROXY_URL"] + "/health", proxy.proc)
    worker = Role("worker", [PY, str(ROOT / "rollout.py"), "--model", tiny_model, "--group-size", "4",
                             "--prompts-per-round", "2", "--max-new-tokens", "6", "--worker-id", "w1"],
                  env, tmp_path).start()
    trainer = Role("trainer", [PY, str(ROOT / "train.py"), "--model", tiny_model, "--max-steps", str(MAX_STEPS),
                               "--batch-groups", "2", "--lr", "1e-3", "--lease-wait-s", "5", "--no-skip-zero-std",
                               "--checkpoint-every", str(CKPT_EVERY)], env, tmp_path).start()
    direct = common.Bucket(run=run_name)  # the test reads the bucket behind the forwarder's back
    report = {}
    try:
        # 1. the trainer, after a few steps
        wait_for(lambda: len(steps(trainer)) >= 5 + rng.randint(0, 4), 300, "trainer steps")
        last = max(steps(trainer))
        trainer.kill9()
        t_kill = time.time()
        ckpt = direct.get_json("checkpoints/latest.json")["step"]
        before = steps(trainer).count(ckpt + 1)
        trainer.start()
        wait_for(lambda: f"resumed from checkpoint step {ckpt} " in trainer.text(), 120, "trainer resume")
        # the first step after the restart is the checkpoint's step + 1
        t_ok = wait_for(lambda: steps(trainer).count(ckpt + 1) > before, 120, "trainer step after resume")
        report["trainer"] = {"killed_after_step": last, "checkpoint_step": ckpt, "steps_redone": last - ckpt,
                             "kill_to_healthy_s": round(t_ok - t_kill, 1)}
        # 2. the rollout worker, a moment later
        time.sleep(rng.uniform(0.5, 3))
        rounds_before = worker.text().count("] round ")
        worker.kill9()
        t_kill = time.time()
        worker.start()
        t_ok = wait_for(lambda: worker.text().count("] round ") > rounds_before, 120, "worker round after restart")
        report["worker"] = {"kill_to_healthy_s": round(t_ok - t_kill, 1),
                            "resubmitted_from_spool": "resubmitting" in worker.text()}
        # 3. the proxy
        time.sleep(rng.uniform(0.5, 3))
        proxy.kill9()
        t_kill = time.time()
        proxy.start()
        t_ok = wait_for(lambda: _up(env["PROXY_URL"]), 60, "proxy health")
        report["proxy"] = {"kill_to_healthy_s": round(t_ok - t_kill, 1)}
        # 4. the S3 endpoint, down for S3_DOWN_S
        time.sleep(rng.uniform(0.5, 3))
        n = len(steps(trainer))
        s3.kill9()
        t_kill = time.time()
        time.sleep(S3_DOWN_S)
        s3.start()
        t_ok = wait_for(lambda: len(steps(trainer)) > n, 180, "trainer step after the S3 outage")
        report["s3"] = {"down_s": S3_DOWN_S, "kill_to_next_trainer_step_s": round(t_ok - t_kill, 1)}
        assert max(steps(trainer)) < MAX_STEPS, "the run ended before every role was killed: raise MAX_STEPS"

        assert trainer.proc.wait(timeout=600) == 0, trainer.text()[-3000:]
        assert worker.proc.wait(timeout=120) == 0, worker.text()[-3000:]   # exits after the final version
        proxy.proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises SIGTERM, so -15 with our last line is clean
        assert proxy.proc.wait(timeout=30) in (0, -signal.SIGTERM) and "proxy: stopped cleanly" in proxy.text()
    finally:
        for r in (trainer, worker, proxy, s3):
            if r.proc is not None:
                stop(r.proc)
    print("\nCHAOS", json.dumps(report))

    # the run reached its target step; after the resume it went on from the checkpoint
    rows = [json.loads(x) for x in direct.get("metrics/train.jsonl")[0].decode().splitlines()]
    assert rows[-1]["step"] == MAX_STEPS
    # adapter versions: contiguous from 1, each written once, in order (none overwritten later)
    metas = sorted((direct.get_json(k) for k in direct.list("adapters/") if k.endswith("meta.json")),
                   key=lambda m: m["version"])
    assert [m["version"] for m in metas] == list(range(1, len(metas) + 1))
    assert all(a["created_at"] < b["created_at"] for a, b in zip(metas, metas[1:]))
    assert direct.get_json("adapters/latest.json")["version"] == metas[-1]["version"]
    for m in metas:
        for name, digest in m["files"].items():
            assert common.hashlib.sha256(direct.get(f"adapters/v{m['version']:06d}/{name}")[0]).hexdigest() == digest
    # no accepted group in two acked batches (the proxy's durable ledger)
    journal = [json.loads(line) for k in sorted(direct.list("rollouts/")) for line in direct.get(k)[0].splitlines()]
    events = [e for e in journal if "t" in e]
    leases = {e["batch_id"]: e["group_ids"] for e in events if e["t"] == "lease"}
    acked = [g for e in events if e["t"] == "ack" for g in leases[e["batch_id"]]]
    assert len(acked) == len(set(acked)) and len(acked) >= 2 * MAX_STEPS - 2 * report["trainer"]["steps_redone"]
    # nothing a worker spooled was lost: the spool is empty, nothing refused, and every group the
    # worker reported generating is in the proxy's durable log
    spool = tmp_path / "spool" / run_name / "w1"
    assert [p.name for p in spool.iterdir() if p.suffix == ".json"] == [] and list((spool / "refused").iterdir()) == []
    accepted = {e["group_id"] for e in journal if "group_id" in e}
    answered = {g: st for x in direct.get("metrics/rollout-w1.jsonl")[0].decode().splitlines()
                for g, st in json.loads(x).get("group_status", {}).items()}
    held = {g for g, st in answered.items() if st in ("accepted", "duplicate")}  # the rest: "stale" on arrival
    assert held and held <= accepted and "refused" not in answered.values()


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False

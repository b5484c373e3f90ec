"""Helpers for the tests that run whole runs as processes (chaos, trainer lifecycle, the end-to-end
loops): restartable roles with their logs, one worker and the trainer on the tiny model, and the audit
of a finished run from what it left in the bucket."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import common
from conftest import ROOT, stop


class Role:
    """One restartable process with its own log file (appended across restarts)."""

    def __init__(self, name: str, cmd: list[str], env: dict, logdir: Path):
        self.name, self.cmd, self.env, self.log = name, cmd, env, logdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, *extra: str) -> "Role":
        with open(self.log, "a") as f:
            f.write(f"\n===== start {self.starts + 1} =====\n")
        self.proc = subprocess.Popen(self.cmd + list(extra), env=self.env, stdout=open(self.log, "a"),
                                     stderr=subprocess.STDOUT)
        self.starts += 1
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def last_run(self) -> str:
        """The log of the latest start only."""
        return self.text().rsplit(f"===== start {self.starts} =====", 1)[-1]


def tiny_loop(tiny_model: str, proxy, run_name: str, logdir: Path, steps: int, *rollout_extra: str,
              train_flags: tuple[str, ...] = ("--no-skip-zero-std",)) -> None:
    """One rollout worker (`rollout_extra` added to its flags) and the trainer (`train_flags` added to its) on the
    tiny model against `proxy`, `steps` steps of 2 groups of 4; both must exit 0, the worker by itself once the trainer
    registered its final version. Logs: logdir/rollout.log and logdir/train.log. The worker's temporary
    folder (logdir/tmp) is watched: it keeps at most 3 adapter versions on disk at any time (the one in use,
    one waiting, one downloading) and leaves none behind."""
    tmp = logdir / "tmp"
    tmp.mkdir()
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_URL": proxy.url, "PROXY_TOKEN": proxy.token,
           "OMP_NUM_THREADS": "1"}
    log = open(logdir / "rollout.log", "w")
    worker = subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), "--model", tiny_model, "--group-size", "4",
                               "--prompts-per-round", "2", "--max-new-tokens", "6", "--worker-id", "w1",
                               *rollout_extra], env={**env, "TMPDIR": str(tmp)}, stdout=log, stderr=log)
    on_disk, train = 0, None  # the most adapter versions the worker held on disk at once
    try:
        train = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--model", tiny_model, "--max-steps",
                                  str(steps), "--batch-groups", "2", "--lr", "1e-3", "--lease-wait-s", "5",
                                  *train_flags], env=env, stdout=open(logdir / "train.log", "w"),
                                 stderr=subprocess.STDOUT)
        t0 = time.time()
        while train.poll() is None:
            assert time.time() - t0 < 600, "the trainer did not finish in 600 s"
            on_disk = max([on_disk] + [len(list(d.glob("v*"))) for d in tmp.glob("adapters-*")])
            time.sleep(0.1)
        assert train.returncode == 0, (logdir / "train.log").read_text()[-3000:]
        worker.wait(timeout=120)  # exits by itself once the trainer registers its final version
    finally:
        stop(worker)
        if train is not None:
            stop(train)
    assert worker.returncode == 0, (logdir / "rollout.log").read_text()[-3000:]
    assert 1 <= on_disk <= 3, f"the worker held {on_disk} adapter versions on disk at once"
    assert not list(tmp.iterdir()), f"the worker left {sorted(p.name for p in tmp.iterdir())} behind"


@contextlib.contextmanager
def stand_in_trainer(proxy):
    """A trainer that leases whatever arrives, one group at a time, and acks it, registering no version: paced (the
    proxy's default), a worker's rounds are granted only while a trainer takes what arrives."""
    done = threading.Event()

    def lease() -> None:
        while not done.is_set():
            got = proxy.http.post("/v1/batches/lease", json={"num_groups": 1, "wait_s": 1.0}).json()
            if got.get("batch_id"):
                proxy.http.post(f"/v1/batches/{got['batch_id']}/ack")
    leasing = threading.Thread(target=lease, daemon=True)
    leasing.start()
    try:
        yield
    finally:
        done.set()
        leasing.join(10)


def worker_refuses_v2(tiny_model: str, proxy, run_name: str, tmp_path: Path, publish_v2, said: str,
                      rounds_after: int) -> tuple[str, list[str]]:
    """A real worker (hf backend) generating with version 1, already published; publish_v2() then publishes a
    version 2 it must not load. A stand-in trainer takes its groups (the proxy must keep version 1's rounds
    trainable meanwhile: a --max-staleness of 2 or more). Waits (bounded) until its log holds `said` twice and it
    did `rounds_after` rounds since its first with version 1; returns its log and the versions of its rounds since
    then."""
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_URL": proxy.url, "PROXY_TOKEN": proxy.token,
           "SPOOL_DIR": str(tmp_path / "spool"), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "worker.log"
    worker = subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), "--model", tiny_model, "--group-size", "4",
                               "--prompts-per-round", "1", "--max-new-tokens", "4", "--worker-id", "w1",
                               "--poll-s", "1"], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    rounds = lambda: re.findall(r"round \d+ v(\d+):", log.read_text())  # noqa: E731
    try:
        with stand_in_trainer(proxy):
            t0 = time.time()
            while "1" not in rounds():
                assert time.time() - t0 < 180 and worker.poll() is None, log.read_text()[-3000:]
                time.sleep(0.2)
            publish_v2()
            while log.read_text().count(said) < 2 or len(rounds()) < rounds().index("1") + rounds_after:
                assert time.time() - t0 < 240 and worker.poll() is None, log.read_text()[-3000:]
                time.sleep(0.2)
            assert worker.poll() is None, log.read_text()[-3000:]
    finally:
        stop(worker)
    return log.read_text(), rounds()[rounds().index("1"):]


def wait_for(pred, timeout: float, what: str, role: Role | None = None, alive: tuple[Role, ...] = ()) -> float:
    """Poll pred() until it holds (returns when); fails early, with its log, if a role in `alive` exits."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return time.time()
        for r in alive:
            assert r.alive(), f"{r.name} exited ({r.proc.returncode}) while waiting for {what}:\n{r.last_run()[-3000:]}"
        time.sleep(0.2)
    tail = f"\n--- {role.name} log ---\n{role.text()[-3000:]}" if role else ""
    raise TimeoutError(f"{what} (waited {timeout:.0f}s){tail}")


def steps(trainer: Role) -> list[int]:
    """The steps the trainer's log reports as done (each printed after its checkpoint, if any)."""
    return [int(m) for m in re.findall(r"^step\s+(\d+) ", trainer.text().replace("\r", "\n"), re.M)]


def journal(bucket: common.Bucket) -> tuple[list[dict], list[dict]]:
    """The proxy's durable log: (groups accepted, events), in log order. An event is a line with a "t" (its
    kind); some events name a group ("stale", "duplicate"), so a group is a line with a group_id and no "t"."""
    lines = [json.loads(x) for k in sorted(bucket.list("rollouts/")) for x in bucket.get(k)[0].splitlines()]
    return [x for x in lines if "group_id" in x and "t" not in x], [x for x in lines if "t" in x]


def audit(bucket: common.Bucket) -> dict:
    """What the run's final weights were trained on, from the trainer's metrics and the proxy's log.

    The weights descend from the last checkpoint; each step's metrics row names its batch and the
    groups it left out as already trained, and the rows of every step a checkpoint holds are in the
    bucket before it. A step redone after a crash logs again, so the last row of each step number
    is the one the weights hold. Asserts: no group trained twice, no group acked twice, every acked
    group trained, every group left out trained by an earlier step."""
    rows = [json.loads(x) for x in bucket.get("metrics/train.jsonl")[0].decode().splitlines()]
    lineage = {r["step"]: r for r in rows if "batch_id" in r}
    _, events = journal(bucket)
    leases = {e["batch_id"]: e["group_ids"] for e in events if e["t"] == "lease"}
    trained, skipped = [], []
    for step in sorted(lineage):
        left_out = set(lineage[step].get("groups/already_trained_ids", []))
        assert left_out <= set(trained), f"step {step} left out groups no earlier step trained: {left_out - set(trained)}"
        skipped += left_out
        trained += [g for g in leases[lineage[step]["batch_id"]] if g not in left_out]
    acked = [g for e in events if e["t"] == "ack" for g in leases[e["batch_id"]]]
    assert len(trained) == len(set(trained)), f"trained twice: {[g for g in set(trained) if trained.count(g) > 1]}"
    assert len(acked) == len(set(acked)), "a group in two acked batches"
    assert set(acked) <= set(trained), f"acked but never trained: {set(acked) - set(trained)}"
    versions = [e for e in events if e["t"] == "version"]
    return {"steps": sorted(lineage), "trained": trained, "skipped": skipped, "acked": acked, "versions": versions,
            "rows": rows, "events": events}


def check_adapters(bucket: common.Bucket) -> list[dict]:
    """Published versions: contiguous from 1, each written once in order, each file matching its sha256."""
    metas = sorted((bucket.get_json(k) for k in bucket.list("adapters/") if k.endswith("meta.json")),
                   key=lambda m: m["version"])
    assert [m["version"] for m in metas] == list(range(1, len(metas) + 1))
    assert all(a["created_at"] < b["created_at"] for a, b in zip(metas, metas[1:]))
    assert bucket.get_json("adapters/latest.json")["version"] == metas[-1]["version"]
    for m in metas:
        for name, digest in m["files"].items():
            data = bucket.get(f"adapters/v{m['version']:06d}/{name}")[0]
            assert common.hashlib.sha256(data).hexdigest() == digest, (m["version"], name)
    return metas


def spool_is_empty(spool_root: Path, run: str, worker: str) -> None:
    d = spool_root / run / worker
    assert [p.name for p in d.iterdir() if p.suffix == ".json"] == [], "groups left in the spool"
    assert not os.listdir(d / "refused") and not os.listdir(d / "unreadable")


def hf_adapter(tiny_model: str, path, version: int, r: int = 4, alpha: int | None = None) -> dict:
    """A saved LoRA of rank r on the tiny model (random B, so that it changes the output), as the worker's
    AdapterSync hands a verified version over to hf_engine.swap_in."""
    import torch
    from safetensors.torch import load_file

    import train
    model, _ = train.build_model(train.Args(model=tiny_model, lora_r=r, lora_alpha=alpha or 2 * r))
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_pretrained(path)
    return {"version": version, "dir": str(path), "tensors": load_file(f"{path}/adapter_model.safetensors"),
            "meta": {"lora": {"r": r}}}

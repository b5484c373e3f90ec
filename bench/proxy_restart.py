"""Restart time and memory of proxy.py against the length of its run: a run's journal of N accepted groups
(8 x 256-token groups, almost all leased and acked, a version registered per batch), then cycles of live
traffic through the real proxy, kill -9 at a random moment, and a restart timed to its first /health.

    .venv/bin/python bench/proxy_restart.py                          # 2k and 100k groups, 5 restarts each
    .venv/bin/python bench/proxy_restart.py --sizes 2000 --cycles 3 --proxy /path/to/other/proxy.py

How the N groups get there: written straight into the moto bucket, as the proxy writes them (journal.py's
commit objects; per batch of 8, one commit with the 8 groups as compact lines, then one with their lease,
the next version and the ack, each ending with the counters line), because 100k groups through HTTP
would take this 2-core machine about an hour. The first start then reads every commit (a full
replay: what any proxy does with a run that has no snapshot) and writes a snapshot. Everything after
that goes through the real proxy: each cycle sends --traffic groups from 8 clients while a trainer
leases 8 at a time, publishes and registers a version and acks (the snapshots of those commits are the
live proxy's own), then kill -9 at a random point of the cycle, then a restart: a process start to its
first 200 from /health, and the proxy's resident memory then (VmRSS, and its peak VmHWM). A start
reads the newest snapshot and the commits after it (at most about --snapshot-commits: how many,
the proxy's log says). Prints each restart and the medians per size.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import journal  # noqa: E402


@dataclass
class Args:
    sizes: list[int] = field(default_factory=lambda: [2000, 100_000])
    """accepted groups in the run's journal before the measured restarts (each size a fresh bucket)"""
    cycles: int = 5
    """restarts measured per size, each after a cycle of live traffic"""
    traffic: int = 400
    """groups sent through the live proxy per cycle; the kill comes after a random 50-100% of them"""
    group_size: int = 8
    tokens: int = 256
    """tokens per completion"""
    proxy: str = str(ROOT / "proxy.py")
    """the proxy script to restart (another checkout's, to compare)"""
    seed: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_mb(pid: int) -> dict:
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def group_line(gid: str, worker: str, version: int, G: int, T: int, rng: random.Random) -> bytes:
    """A compact group as a worker sends it (the proxy journals such a body as is)."""
    g = {"group_id": gid, "worker_id": worker, "policy_version": version,
         "prompt_ids": [rng.randrange(49152) for _ in range(40)],
         "completions": [{"token_ids": [rng.randrange(49152) for _ in range(T)],
                          "logprobs": [round(-rng.random() * 3, 6) for _ in range(T)],
                          "reward": float(i % 2), "finish_reason": "length"} for i in range(G)],
         "meta": {"task": "bench"}}
    return json.dumps(g, separators=(",", ":")).encode()


def write_journal(bucket: common.Bucket, n: int, a: Args) -> None:
    """n groups as incarnation 0 of a proxy would have journaled them: all leased and acked but the last batch."""
    rng = random.Random(a.seed)
    templates = [group_line("X" * 32, f"bench-{w}", 0, a.group_size, a.tokens, rng) for w in range(8)]
    counters = dict.fromkeys(["groups_accepted", "groups_duplicate", "groups_dropped_stale", "groups_rejected_full",
                              "groups_leased", "groups_acked", "batches_leased", "batches_acked", "leases_expired"], 0)
    t0 = time.time() - n  # one group a second, as a slow GPU run

    def commit(seq: int, records: list) -> tuple[str, bytes]:
        header = {"t": "commit", "protocol": common.PROTOCOL, "incarnation": 0, "seq": seq, "writer": "bench",
                  "time": round(t0 + seq * 4, 3)}
        trailer = {"t": "counters", "counters": dict(counters)}
        return journal.object_name(0, seq), journal.encode(header, records + [trailer])

    def objects():
        for step in range(n // 8):
            gids = [uuid.uuid4().hex for _ in range(8)]
            lines = [templates[i].replace(b"X" * 32, g.encode(), 1).replace(b'"policy_version":0,', b'"policy_version":%d,' % step, 1)
                     for i, g in enumerate(gids)]
            counters["groups_accepted"] += 8
            yield commit(2 * step, lines)
            if step == n // 8 - 1:
                break  # the last batch stays buffered
            bid = uuid.uuid4().hex
            counters.update({k: counters[k] + d for k, d in [("groups_leased", 8), ("batches_leased", 1), ("groups_acked", 8),
                                                              ("batches_acked", 1)]})
            yield commit(2 * step + 1, [
                {"t": "lease", "batch_id": bid, "group_ids": gids, "lease_s": 300.0, "expires_at": t0 + 300, "latest": step},
                {"t": "version", "version": step + 1, "step": step + 1, "published_at": t0 + 8 * step, "final": False},
                {"t": "ack", "batch_id": bid}])

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: bucket.put(*kv, if_none_match=True), objects()))


def start(a: Args, env: dict, port: int, log: Path) -> tuple[subprocess.Popen, float]:
    """The proxy process and the seconds from its start to its first 200 from /health."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, a.proxy, "--port", str(port), "--group-size", str(a.group_size)],
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the proxy exited with {proc.returncode}: see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.02)


async def traffic(url: str, token: str, bucket: common.Bucket, target: int, a: Args, adapter: str) -> None:
    """8 clients submit fresh groups until `target` are accepted; one trainer leases 8, publishes and registers
    the next version, acks."""
    rng = random.Random()
    template = group_line("X" * 32, "live", 0, a.group_size, a.tokens, rng)
    headers = {"X-Proxy-Token": token, "Content-Type": "application/json"}
    done, accepted = asyncio.Event(), [0]
    async with aiohttp.ClientSession(url, headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.get("/v1/adapters/latest") as r:
            latest = [(await r.json())["version"]]

        async def client(i: int) -> None:
            while not done.is_set():
                body = template.replace(b"X" * 32, uuid.uuid4().hex.encode(), 1).replace(
                    b'"live"', f'"live-{i}"'.encode(), 1).replace(b'"policy_version":0,', b'"policy_version":%d,' % latest[0], 1)
                async with http.post("/v1/groups", data=body) as r:
                    status, answer = r.status, await r.read()
                if status == 429:
                    await asyncio.sleep(1)
                elif status != 200:
                    raise SystemExit(f"submit {status}: {answer[:200]}")
                elif json.loads(answer)["status"] == "accepted":
                    accepted[0] += 1
                    if accepted[0] >= target:
                        done.set()

        async def trainer() -> None:
            while not done.is_set():
                async with http.post("/v1/batches/lease", json={"num_groups": 8, "wait_s": 0.5}) as r:
                    bid = (await r.json())["batch_id"]
                if bid:
                    v = latest[0] + 1
                    await asyncio.to_thread(common.publish_adapter, bucket, adapter, v, v, "bench")
                    async with http.post("/v1/adapters", json={"version": v, "step": v, "published_at": time.time()}) as r:
                        assert r.status == 200, await r.text()
                    latest[0] = v
                    async with http.post(f"/v1/batches/{bid}/ack") as r:
                        assert r.status == 200, await r.text()

        await asyncio.gather(*(client(i) for i in range(8)), trainer())


def wait_snapshot(bucket: common.Bucket, timeout: float = 900) -> None:
    """Until a snapshot covers the newest commit (a start that read many commits writes one at once)."""
    t0 = time.time()
    while (p := bucket.get_json(journal.POINTER)) is None or journal.log_keys(bucket, after=p["covers"]):
        if time.time() - t0 > timeout:
            raise SystemExit("no snapshot covers the journal")
        time.sleep(1)


def run_size(n: int, a: Args, rng: random.Random) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"proxy-restart-{n}-"))
    s3_port, port, token = free_port(), free_port(), secrets.token_urlsafe(16)
    env = {**os.environ, "S3_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1", "BUCKET": "bench",
           "RUN_NAME": f"restart-{secrets.token_hex(3)}", "PROXY_TOKEN": token}
    s3 = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)],
                          stdout=open(tmp / "s3.log", "w"), stderr=subprocess.STDOUT)
    proc = None
    try:
        time.sleep(2)
        httpx.put(f"{env['S3_ENDPOINT_URL']}/bench")
        os.environ.update({k: env[k] for k in ("S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")})
        bucket = common.Bucket(bucket="bench", run=env["RUN_NAME"])
        t0 = time.time()
        write_journal(bucket, n, a)
        print(f"{n} groups: journal written in {time.time() - t0:.0f} s ({len(journal.log_keys(bucket))} commits)", flush=True)
        adapter = tmp / "adapter"
        adapter.mkdir()
        (adapter / "adapter_model.safetensors").write_bytes(b"w" * 1000)
        (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
        proc, first = start(a, env, port, tmp / "proxy-0.log")
        rss = memory_mb(proc.pid)
        print(f"  first start (every commit read): {first:.1f} s to /health, RSS {rss['VmRSS']:.0f} MB "
              f"(peak {rss['VmHWM']:.0f} MB)", flush=True)
        if a.proxy == str(ROOT / "proxy.py"):
            wait_snapshot(bucket)
        rows = []
        for c in range(1, a.cycles + 1):
            asyncio.run(traffic(f"http://127.0.0.1:{port}", token, bucket, rng.randint(a.traffic // 2, a.traffic), a, str(adapter)))
            proc.kill()
            proc.wait()
            proc, seconds = start(a, env, port, tmp / f"proxy-{c}.log")
            rss = memory_mb(proc.pid)
            how = re.search(r"state from (.*?) and (\d+) commits", open(tmp / f"proxy-{c}.log").read())
            rows.append({"s": seconds, **rss, "tail": int(how[2]) if how else None})
            print(f"  restart {c}: {seconds:.2f} s to /health, RSS {rss['VmRSS']:.0f} MB (peak {rss['VmHWM']:.0f} MB), "
                  f"{how[2] + ' commits after the snapshot' if how else 'no snapshot line'}", flush=True)
        st = httpx.get(f"http://127.0.0.1:{port}/v1/stats", headers={"X-Proxy-Token": token}).json()
        return {"n": n, "accepted": st["groups_accepted"], "first": first, "rows": rows}
    finally:
        if proc is not None:
            proc.kill()
        s3.kill()


def main(a: Args) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stopped bench stops its servers too (finally:)
    rng = random.Random(a.seed)
    results = [run_size(n, a, random.Random(rng.random())) for n in a.sizes]
    print("\nsize (groups accepted at the end) | first start | restart to /health, median (all) | RSS after restart, median | peak RSS, median")
    for r in results:
        med = lambda k: statistics.median(x[k] for x in r["rows"])  # noqa: E731
        each = ", ".join(f"{x['s']:.2f}" for x in r["rows"])
        print(f"{r['n']} ({r['accepted']}) | {r['first']:.1f} s | {med('s'):.2f} s ({each}) | "
              f"{med('VmRSS'):.0f} MB | {med('VmHWM'):.0f} MB")
    if len(results) > 1:
        base = statistics.median(x["s"] for x in results[0]["rows"])
        for r in results[1:]:
            print(f"restart median {r['n']} / {results[0]['n']}: {statistics.median(x['s'] for x in r['rows']) / base:.2f}x")


if __name__ == "__main__":
    main(tyro.cli(Args))

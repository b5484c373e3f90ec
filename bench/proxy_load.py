"""Load test of proxy.py: N simulated rollout clients and one trainer against the real proxy process
with a real local S3 server (moto), for a fixed duration.

    .venv/bin/python bench/proxy_load.py --clients 64 --duration 60 --rate 300   # paced (the default)
    .venv/bin/python bench/proxy_load.py --clients 64 --duration 60 --rate 0     # flood
    .venv/bin/python bench/proxy_load.py --standby     # with a standby following the journal (proxy.py --standby)

Each client submits groups of G completions of `tokens` tokens (token ids + logprobs, 33 kB of JSON
at G=8, 256 tokens), at its share of `--rate` or, with --rate 0, as fast as the proxy answers,
honouring 429 + Retry-After; the trainer leases batches of `batch` groups and acks each one. Every
200 `accepted` answer means the group is in the bucket (the proxy journals before it answers), so
accepted groups/s is durable groups/s.
Prints accepted groups/s, p50/p99 submit and lease latency, failed requests and the proxy's peak RSS.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import tyro

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Args:
    clients: int = 64
    """concurrent simulated rollout clients"""
    duration: float = 60.0
    """seconds of load"""
    group_size: int = 8
    tokens: int = 256
    """tokens per completion"""
    batch: int = 8
    """groups per trainer lease"""
    prefetch: int = 8
    """leases the trainer keeps in flight (it leases the next batches while acking one, as an async
    trainer that prefetches does); 1 = strictly lease, ack, lease: then two journal round trips per
    8 groups cap the rate (~20 ms each against an idle local S3 server: ~200 groups/s at best)"""
    max_buffer: int = 512
    """the proxy's buffer cap"""
    rate: float = 300.0
    """groups/s offered by all clients together, each a Poisson process (a rollout worker submits when a
    group is generated, not when the last answer came); latency counts from the scheduled send, so a
    client running late is charged for it. 0 = flood: each client sends again as soon as it is
    answered, and then latency = busy clients / throughput (Little's law), whatever the proxy does"""
    standby: bool = False
    """a standby beside the proxy (both --term-s 2; proxy.py --standby follows the journal): its cost on the leader"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[:3]} exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


def peak_rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):  # the kernel's high-water mark of resident memory
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def group_template(G: int, T: int) -> bytes:
    rng = random.Random(0)
    g = {"group_id": "X" * 32, "worker_id": "bench", "policy_version": 0,
         "prompt_ids": [rng.randrange(49152) for _ in range(40)],
         "completions": [{"token_ids": [rng.randrange(49152) for _ in range(T)],
                          "logprobs": [round(-rng.random() * 3, 6) for _ in range(T)],
                          "reward": float(i % 2), "finish_reason": "length"} for i in range(G)],
         "meta": {"task": "bench"}}
    return json.dumps(g, separators=(",", ":")).encode()


async def load(a: Args, url: str, token: str, proxy_pid: int) -> dict:
    # aiohttp, not httpx, on this side: the clients share the proxy's two cores, and aiohttp spends
    # several times less CPU per request, so more of the machine measures the proxy
    template = group_template(a.group_size, a.tokens)
    out = {"submit": [], "lease": [], "accepted": 0, "duplicate": 0, "backpressure": 0, "failed": 0,
           "leased": 0, "acked": 0, "errors": [], "rss": 0.0}
    headers = {"X-Proxy-Token": token, "Content-Type": "application/json"}
    stop = time.monotonic() + a.duration

    def fail(what: str) -> None:
        out["failed"] += 1
        if len(out["errors"]) < 5:
            out["errors"].append(what)

    conn = aiohttp.TCPConnector(limit=a.clients + a.prefetch + 4)
    async with aiohttp.ClientSession(url, headers=headers, connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as http:
        async def client(i: int) -> None:
            gap = (lambda: random.expovariate(a.rate / a.clients)) if a.rate else (lambda: 0.0)
            t0 = time.perf_counter() + gap()
            while time.monotonic() < stop:
                body = template.replace(b"X" * 32, uuid.uuid4().hex.encode(), 1)
                body = body.replace(b'"bench"', f'"bench-{i}"'.encode(), 1)
                await asyncio.sleep(t0 - time.perf_counter())
                if time.monotonic() >= stop:
                    break
                try:
                    async with http.post("/v1/groups", data=body) as r:
                        status, text = r.status, await r.read()
                        retry_after = float(r.headers.get("Retry-After", "1"))
                except aiohttp.ClientError as e:
                    fail(f"submit: {e!r}")
                    continue
                if status == 429:  # backpressure is the protocol working, not a failure
                    out["backpressure"] += 1
                    await asyncio.sleep(retry_after)
                    t0 = time.perf_counter() + gap()
                    continue
                out["submit"].append(time.perf_counter() - t0)
                t0 = t0 + gap() if a.rate else time.perf_counter()  # a late client stays late: no forgiveness
                if status != 200:
                    fail(f"submit {status}: {text[:200]}")
                else:
                    out["accepted" if json.loads(text)["status"] == "accepted" else "duplicate"] += 1

        async def trainer() -> None:
            head = re.compile(rb'^\{"batch_id":\s*(?:null|"([0-9a-f]+)")')
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                try:
                    async with http.post("/v1/batches/lease", json={"num_groups": a.batch, "wait_s": 1.0}) as r:
                        status, text = r.status, await r.read()
                    if status != 200:
                        fail(f"lease {status}: {text[:200]}")
                        continue
                    bid = head.match(text)[1]  # no need to parse 400 kB of groups here
                    if bid is None:
                        continue
                    out["lease"].append(time.perf_counter() - t0)
                    out["leased"] += a.batch
                    async with http.post(f"/v1/batches/{bid.decode()}/ack") as r:
                        status, text = r.status, await r.read()
                    if status != 200:
                        fail(f"ack {status}: {text[:200]}")
                    else:
                        out["acked"] += json.loads(text)["acked"]
                except aiohttp.ClientError as e:
                    fail(f"lease/ack: {e!r}")

        async def rss() -> None:
            while time.monotonic() < stop + 1:
                out["rss"] = peak_rss_mb(proxy_pid)
                await asyncio.sleep(0.5)

        t0 = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(a.clients)), *(trainer() for _ in range(a.prefetch)), rss())
        out["elapsed"] = time.monotonic() - t0
        async with http.get("/v1/stats") as r:
            out["stats"] = await r.json()
        async with http.get("/metrics") as r:
            prom = await r.text()
        out["commits"] = {k: float(re.search(rf"^proxy_journal_commit_seconds_{k} (\S+)$", prom, re.M)[1])
                          for k in ("count", "sum")}
    return out


def main(a: Args) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="proxy-load-"))
    s3_port, port, token = free_port(), free_port(), secrets.token_urlsafe(16)
    env = {**os.environ, "S3_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1", "BUCKET": "bench",
           "RUN_NAME": f"load-{secrets.token_hex(3)}", "PROXY_TOKEN": token}
    s3 = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)],
                          stdout=open(tmp / "s3.log", "w"), stderr=subprocess.STDOUT)
    procs = [s3]
    try:
        wait_up(env["S3_ENDPOINT_URL"], s3)
        httpx.put(f"{env['S3_ENDPOINT_URL']}/bench")  # create the bucket
        cmd = [sys.executable, str(ROOT / "proxy.py"), "--group-size", str(a.group_size), "--max-buffer", str(a.max_buffer),
               *(["--term-s", "2"] if a.standby else [])]
        proxy = subprocess.Popen([*cmd, "--port", str(port)], env=env, stdout=open(tmp / "proxy.log", "w"), stderr=subprocess.STDOUT)
        procs.append(proxy)
        wait_up(f"http://127.0.0.1:{port}/health", proxy)
        if a.standby:
            procs.append(subprocess.Popen([*cmd, "--port", str(standby_port := free_port()), "--standby"], env=env,
                                          stdout=open(tmp / "standby.log", "w"), stderr=subprocess.STDOUT))
            wait_up(f"http://127.0.0.1:{standby_port}/health", procs[-1])
        print(f"load: {a.clients} clients x groups of {a.group_size}x{a.tokens} tokens, one trainer leasing "
              f"{a.batch} ({a.prefetch} leases in flight), {a.duration:.0f} s (logs in {tmp})", flush=True)
        r = asyncio.run(load(a, f"http://127.0.0.1:{port}", token, proxy.pid))
        r["cpu"] = {"proxy": cpu_s(proxy.pid), **({"standby": cpu_s(procs[-1].pid)} if a.standby else {}),
                    "s3": cpu_s(s3.pid), "bench": sum(os.times()[:2])}
    finally:
        for p in procs:
            p.kill()
            p.wait()
    st = r["stats"]
    print(f"accepted groups/s (durable): {r['accepted'] / r['elapsed']:.1f}   ({r['accepted']} in {r['elapsed']:.1f} s; "
          f"proxy counted {st['groups_accepted']})")
    print(f"submit latency p50/p99: {pct(r['submit'], .5):.1f} / {pct(r['submit'], .99):.1f} ms   "
          f"lease p50/p99: {pct(r['lease'], .5):.1f} / {pct(r['lease'], .99):.1f} ms")
    print(f"failed requests: {r['failed']}   429 backpressure answers: {r['backpressure']}   "
          f"leased/acked groups: {r['leased']}/{r['acked']}   buffer at end: {st['buffer_size']}/{a.max_buffer}")
    c = r["commits"]
    print(f"proxy peak RSS: {r['rss']:.0f} MB   journal commits: {c['count']:.0f}, mean {1000 * c['sum'] / max(c['count'], 1):.1f} ms, "
          f"{r['accepted'] / max(c['count'], 1):.1f} groups per commit")
    print("CPU seconds used: " + ", ".join(f"{k} {v:.1f}" for k, v in r["cpu"].items()))
    for e in r["errors"]:
        print("  error:", e)


if __name__ == "__main__":
    main(tyro.cli(Args))

"""Failover of proxy.py with a standby (proxy.py --standby): under load from rollout clients and a trainer leasing and
acking, kill -9 (and SIGSTOP) whichever proxy leads, at random moments, and measure how long until the other leads,
and whether anything was lost or handed out twice.

    .venv/bin/python bench/proxy_failover.py                              # 20 kills, 5 of them SIGSTOP hangs
    .venv/bin/python bench/proxy_failover.py --kills 6 --hangs 2 --term-s 2

A local S3 server (moto), a leader and a standby (the same token, each advertising its URL: the one that leads
writes proxy/endpoint.json), `--clients` threads posting groups through the real client (proxy_client.ProxyClient,
which finds the leader through proxy/endpoint.json and retries what was in flight), and one trainer thread that
leases `--batch` groups and acks each batch. Each round waits a random 2-6 s, then kills (or stops) the leader; the
failover time is from the signal to the first /health of the other proxy that says it leads. The killed proxy is
started again as a standby (a stopped one is continued first: it finds itself deposed and exits 3).

Before the rounds, the standby's cost is measured over --cost-s of load: its CPU seconds and RSS beside the
leader's, and its bucket requests per second (the standby reaches S3 through a counting forwarder then).

At the end the trainer drains the buffer and the final leader's state is read. Prints per round the failover time,
then: failover p50/max, groups accepted, acked, still buffered or leased, lost (accepted and none of those), in two
acked batches, and leased twice while the first lease was open (a group in two batches the trainer got, the first
not acked or expired).
"""
from __future__ import annotations

import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))
import common  # noqa: E402
from proxy_client import ProxyClient, endpoint_resolver  # noqa: E402
from tcp_forward import Forwarder  # noqa: E402


@dataclass
class Args:
    kills: int = 20
    """rounds in all; the last `hangs` of them stop the leader (SIGSTOP) instead of killing it"""
    hangs: int = 5
    clients: int = 4
    """threads posting groups, each as fast as the proxy answers"""
    batch: int = 8
    term_s: float = 2.0
    """the proxies' --term-s"""
    cost_s: float = 15.0
    """seconds of load over which the standby's CPU, memory and bucket requests are measured"""
    group_size: int = 8
    tokens: int = 64
    seed: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reachable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def proc_cpu_s(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Proxy:
    def __init__(self, a: Args, env: dict, out: Path, token: str, standby: bool, s3: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, str(ROOT / "proxy.py"), "--port", str(self.port), "--group-size", str(a.group_size),
               "--term-s", str(a.term_s), "--advertise-url", self.url, "--lease-s", "30", *(["--standby"] if standby else [])]
        self.log = out / f"proxy-{self.port}.log"
        self.proc = subprocess.Popen(cmd, env={**env, "PROXY_TOKEN": token, **({"S3_ENDPOINT_URL": s3} if s3 else {})},
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=2)
        t0 = time.monotonic()
        while self.role() is None:
            assert self.proc.poll() is None and time.monotonic() - t0 < 120, f"proxy did not start: {self.log}"
            time.sleep(0.1)

    def role(self) -> str | None:
        try:
            return self.http.get("/health").json().get("role")
        except (httpx.HTTPError, ValueError):
            return None


class Load:
    """Clients posting groups and a trainer leasing and acking, through ProxyClient (it follows the leader)."""

    def __init__(self, a: Args, bucket: common.Bucket, url: str, token: str):
        self.a, self.stop = a, threading.Event()
        self.lock = threading.Lock()
        self.accepted: set[str] = set()
        self.batches: list[tuple[str, list[str]]] = []  # (batch_id, group ids) as the trainer got them
        self.acked: list[str] = []                       # batch ids whose ack answered success
        self.make = lambda: ProxyClient(url, token, patience_s=None, resolve=endpoint_resolver(bucket))
        self.threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(a.clients)]
        self.threads.append(threading.Thread(target=self.trainer, daemon=True))
        self.rng = random.Random(a.seed)

    def group(self, worker: str) -> dict:
        T = self.a.tokens
        return {"group_id": uuid.uuid4().hex, "worker_id": worker, "policy_version": 0, "prompt_ids": [1, 2, 3],
                "completions": [{"token_ids": [7] * T, "logprobs": [-0.5] * T, "reward": float(i % 2),
                                 "finish_reason": "stop"} for i in range(self.a.group_size)], "meta": {"task": "bench"}}

    def client(self, i: int) -> None:
        c = self.make()
        c.should_stop = self.stop.is_set
        c.say = lambda msg: None
        while not self.stop.is_set():
            g = self.group(f"w{i}")
            try:
                r = c.post("/v1/groups", g)
            except Exception:  # noqa: BLE001 - stopping (should_stop), or the group refused
                continue
            if r["status"] in ("accepted", "duplicate"):  # duplicate: a retry of ours whose first attempt landed
                with self.lock:
                    self.accepted.add(g["group_id"])

    def trainer(self) -> None:
        c = self.make()
        c.should_stop = self.stop.is_set
        c.say = lambda msg: None
        while not self.stop.is_set():
            try:
                r = c.post("/v1/batches/lease", {"num_groups": self.a.batch, "wait_s": 1.0})
                if not r["batch_id"]:
                    continue
                with self.lock:
                    self.batches.append((r["batch_id"], [g["group_id"] for g in r["groups"]]))
                c.post(f"/v1/batches/{r['batch_id']}/ack")
                with self.lock:
                    self.acked.append(r["batch_id"])
            except Exception as e:  # noqa: BLE001 - a retried ack that finds its batch acked (409) counts as acked
                if getattr(e, "status", None) == 409 and "already acked" in str(e):
                    with self.lock:
                        self.acked.append(self.batches[-1][0])


def standby_cost(a: Args, env: dict, out: Path, token: str, leader: Proxy, moto_port: int) -> tuple[Proxy, dict]:
    """A standby started behind a counting forwarder: its bucket requests/s, CPU and RSS, and the leader's, over cost_s."""
    seen = Counter()
    fwd = Forwarder(moto_port, lambda kind, line: seen.update([kind]) and False)
    standby = Proxy(a, env, out, token, standby=True, s3=f"http://127.0.0.1:{fwd.port}")
    time.sleep(3)
    c0 = {p: proc_cpu_s(p.proc.pid) for p in (leader, standby)}
    r0, t0 = seen["request"], time.monotonic()
    time.sleep(a.cost_s)
    dt = time.monotonic() - t0
    cost = {"standby_bucket_rps": round((seen["request"] - r0) / dt, 1),
            **{f"{n}_cpu_share": round((proc_cpu_s(p.proc.pid) - c0[p]) / dt, 3) for n, p in (("leader", leader), ("standby", standby))},
            **{f"{n}_rss_mb": round(rss_mb(p.proc.pid), 1) for n, p in (("leader", leader), ("standby", standby))}}
    return standby, cost | {"forwarder": fwd}


def main(a: Args) -> None:
    rng = random.Random(a.seed)
    out = Path(tempfile.mkdtemp(prefix="failover-"))
    moto_port = free_port()
    s3 = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)],
                          stdout=open(out / "s3.log", "w"), stderr=subprocess.STDOUT)
    env = {**os.environ, "S3_ENDPOINT_URL": f"http://127.0.0.1:{moto_port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1", "BUCKET": "bench", "RUN_NAME": f"failover-{a.seed}",
           "OMP_NUM_THREADS": "1"}
    env.pop("PROXY_URL", None)
    os.environ.update({k: env[k] for k in ("S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")})
    token = uuid.uuid4().hex
    procs: list[Proxy] = []
    load = None
    try:
        t0 = time.monotonic()
        while not reachable(moto_port):
            assert s3.poll() is None and time.monotonic() - t0 < 60, "the S3 server did not start"
            time.sleep(0.2)
        bucket = common.Bucket(bucket="bench", run=env["RUN_NAME"])
        bucket.ensure_bucket()
        leader = Proxy(a, env, out, token, standby=False)
        procs.append(leader)
        load = Load(a, bucket, leader.url, token)
        [t.start() for t in load.threads]
        standby, cost = standby_cost(a, env, out, token, leader, moto_port)
        procs.append(standby)
        fwd = cost.pop("forwarder")
        print("standby cost:", cost, flush=True)
        times = []
        for k in range(a.kills):
            time.sleep(rng.uniform(2, 6))
            lead = next(p for p in procs if p.proc.poll() is None and p.role() == "leader")
            other = next(p for p in procs if p is not lead and p.proc.poll() is None)
            hang = k >= a.kills - a.hangs
            t0 = time.monotonic()
            os.kill(lead.proc.pid, signal.SIGSTOP if hang else signal.SIGKILL)
            while other.role() != "leader":
                assert time.monotonic() - t0 < 60 and other.proc.poll() is None, f"no takeover: {other.log}"
                time.sleep(0.02)
            took = time.monotonic() - t0
            times.append(took)
            if hang:
                os.kill(lead.proc.pid, signal.SIGCONT)
            code = lead.proc.wait(30)
            print(f"round {k + 1}: {'SIGSTOP' if hang else 'kill -9'} of the leader on :{lead.port}; the standby on "
                  f":{other.port} led {took:.2f}s later (old one exited {code}); {len(load.accepted)} groups accepted so far",
                  flush=True)
            procs = [other, Proxy(a, env, out, token, standby=True)]
        load.stop.set()
        [t.join(60) for t in load.threads]
        final = next(p for p in procs if p.role() == "leader")
        c = load.make()
        while (r := c.post("/v1/batches/lease", {"num_groups": a.batch}))["batch_id"]:  # drain what is left
            load.batches.append((r["batch_id"], [g["group_id"] for g in r["groups"]]))
            c.post(f"/v1/batches/{r['batch_id']}/ack")
            load.acked.append(r["batch_id"])
        state = final.http.get("/v1/state", headers={"Authorization": f"Bearer {token}"}).json()
        report(a, times, load, state)
        fwd.close()
    finally:
        if load is not None:
            load.stop.set()
        for p in procs:
            if p.proc.poll() is None:
                p.proc.terminate()
                p.proc.wait(20)
        s3.terminate()
        s3.wait(10)


def report(a: Args, times: list[float], load: Load, state: dict) -> None:
    acked_ids = set(load.acked)
    in_acked = Counter(g for b, gs in load.batches if b in acked_ids for g in gs)
    in_got = Counter(g for _, gs in load.batches for g in gs)
    held = set(state["buffer"]) | {g for gs in state["leases"].values() for g in gs}
    lost = load.accepted - set(in_acked) - held
    hangs = times[len(times) - a.hangs:] if a.hangs else []
    print(f"failover (signal to the other proxy's first /health as leader), {len(times)} rounds: "
          f"p50 {statistics.median(times):.2f}s  max {max(times):.2f}s"
          + (f"  (kill -9 p50 {statistics.median(times[:len(times) - a.hangs]):.2f}s, SIGSTOP p50 {statistics.median(hangs):.2f}s)" if hangs else ""))
    print(f"groups accepted {len(load.accepted)}  acked {len(in_acked)}  buffered or leased at the end {len(held)}  "
          f"lost {len(lost)}  in two acked batches {sum(n > 1 for n in in_acked.values())}  "
          f"handed to the trainer twice {sum(n > 1 for n in in_got.values())}  batches {len(load.batches)}")


if __name__ == "__main__":
    main(tyro.cli(Args))

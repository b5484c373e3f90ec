"""A fleet of simulated rollout workers and a simulated trainer against the real proxy (proxy.py) and a real
S3 server (moto), all on 127.0.0.1, pacing on and off (docs/fleet.md).

    .venv/bin/python bench/fleet_sim.py                                   # 10, 100, 1000 workers, pacing on and off
    .venv/bin/python bench/fleet_sim.py --workers 100 --pace on --steps 20
    .venv/bin/python bench/fleet_sim.py --workers 10 100 --round-scale 0.25 --max-staleness 3   # a faster fleet
    .venv/bin/python bench/fleet_sim.py --measure runs/<run>              # the time distributions, from a local run
    .venv/bin/python bench/fleet_sim.py --workers 1 --pace on --autoscale 4 --steps 20   # the controller from 1 worker

No model: a worker's round takes a time drawn from what the local run measured (bench/fleet_times.json:
rollout/gen_s of each round, the tokens per completion, the trainer's work per step, each at its point of the
run), times its own speed (lognormal: a fleet of different GPUs), times how hard its prompts are, times
--time-scale. Otherwise each worker does what rollout.py does over HTTP: long-polls /v1/adapters/latest
(with its worker_id: its sign of life, docs/proxy.md#pacing), asks for prompts (a paced lease: POST
/v1/prompts/lease with wait_s), fetches the adapter it is told to generate with (the proxy's listing, meta.json
in it, then from the bucket each file it does not hold yet: real GETs), "generates", and posts its round's groups
at once (8 completions each, real token ids and logprobs, the length drawn), honouring 429. Workers join late,
leave, crash mid-round (the round is lost and its poll's connection closes; the worker comes back with the same
id later, or has left by then) and some sit behind a slow network (every request delayed). The trainer does what
train.py does: leases a batch (with groups_left; from the first on, the next one as each step begins, with
after_version: train.py's prefetch), "trains" for the drawn step time, publishes a small real adapter version to
the bucket (files, meta.json, latest.json: the proxy verifies them at registration), registers it, acks; the last
version as final. A configuration ends at the trainer's last step, or after --timeout-s.

Per configuration it prints the trainer's utilisation (busy / (busy + waiting for a batch), from its first
batch on; `steady`: the same before the last max_staleness + 1 steps, where pacing's demand bound lets no
more be generated than the trainer will still lease, so the fleet may not run ahead of it; and the share of
the waiting that the proxy spent waiting for groups, the rest being each lease's journal write and transfer,
from the lease answers' waited_s), the staleness of what it leased, tokens generated but never leased
(stale, refused, left over, or generated after the last step; a crashed worker's lost round is counted
apart), how evenly prompts are served (the share of the prompts handed out that were trained: all, the
hardest quarter, the easiest) and workers (rounds per worker, the share that never got one, the p99 wait for
a grant), the proxy's CPU and the p99 of its answers (group submission, and /health probed every 100 ms: the
event loop's lag, asked both from inside the simulator and from bench/health_probe.py, a process apart whose
answer times do not include the simulator's own lag), bucket requests per second (from the S3 server's request log), and this simulator's own
CPU (its one process drives every worker and the trainer: near 100%, its own delays would count as the
proxy's). Writes everything as JSON to --out.

With --autoscale K the fleet starts at --workers and the supervisor's policy (lib/jobs/autoscale.py: the same pure
functions and state over the proxy's /v1/stats) looks every min_window_s (Bounds' defaults times
--autoscale-time): up starts the lowest workers not at work (a worker started again runs as a new id, with its
speed: at size k the fleet is a fixed fleet of k's), down asks the newest to leave through the proxy (POST
/v1/workers/leave; it leaves after sending its round). The trainer's batch is sized for K workers (or --batch). Printed: every decision. For every configuration:
the time to the trainer's last step, the workers' seconds until then, and what both would cost on Jobs
(run_dollars). bench/autoscale_compare.py runs the controller against fixed fleet sizes.
"""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import gc
import json
import math
import os
import random
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

import aiohttp
import httpx
import tyro
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from autoscale import Bounds, Window, initial_state, look, unseen  # noqa: E402 - lib/jobs, on the path through common
from costs import EXPOSE_PRICE, PRICES  # noqa: E402
from presets import PRESETS  # noqa: E402
from proxy_load import cpu_s, free_port, wait_up  # noqa: E402 - bench/ is on the path: the load test's process helpers

TIMES = Path(__file__).with_name("fleet_times.json")


@dataclass
class Args:
    workers: list[int] = field(default_factory=lambda: [10, 100, 1000])
    """fleet sizes, one configuration each (and each pacing mode)"""
    pace: Literal["on", "off", "both"] = "both"
    """the proxy's pacing (off: --no-pace, every prompt lease at once, as before pacing)"""
    steps: int = 30
    """trainer steps per configuration"""
    batch_per_worker: float = 0.8
    """the trainer's batch is this many groups per worker (at least 8): the fleet offers about ten times what
    the trainer takes at every size (a worker's round is 8 groups, about one trainer step long)"""
    batch: int = 0
    """the trainer's batch in groups, whatever the fleet's size (0: from --batch-per-worker): the same run at
    every fleet size (bench/autoscale_compare.py)"""
    span: tuple[float, float] = (0.0, 1.0)
    """the part of the measured run the simulated one draws its times from (0.5 1: its second half, where steps
    are 1.6-2 s and rounds 24-29 s, against 23-28 s steps before)"""
    group_size: int = 8
    prompts_per_round: int = 8
    max_staleness: int = 1
    """the proxy's --max-staleness (the local run's 1)"""
    time_scale: float = 0.5
    """every drawn duration (round, step, slow network) times this: shorter runs, and every rate that much higher"""
    round_scale: float = 1.0
    """a round's drawn time times this as well (0.25: a fleet generating four times as fast, relative to the
    trainer, as the local run's CPU worker). A round granted at version v is trainable only while the trainer
    has taken at most max_staleness steps since, so with rounds of R s and steps of S s no admission rule keeps
    the trainer busier than (max_staleness + 1) x S / R (docs/results/fleet.md); printed as `ceiling`"""
    speed_sigma: float = 0.5
    """workers' speeds are lognormal with this sigma (0.5: a quarter of them over 1.4x slower or faster)"""
    prompt_sigma: float = 0.3
    """prompts' difficulty (a round takes as long as its hardest prompt), lognormal"""
    join: float = 0.2
    """share of the workers that join late (at a random time in the first half of the run)"""
    leave: float = 0.1
    """share that leave for good at a random time (after sending their round)"""
    crash: float = 0.02
    """chance a round ends in a crash: the round is lost, the worker is back after two round times"""
    slow_net: float = 0.1
    """share of the workers behind a slow network: every request 0.2-1 s late (times --time-scale)"""
    timeout_s: float = 600.0
    """a configuration stops after this many seconds, done or not"""
    dataset: int = 7473
    """prompts in the simulated dataset (GSM8K's train split)"""
    prefetch: bool = True
    """the trainer asks for its next batch before its step ends (train.py's --prefetch), so that the lease's own
    cost (the proxy's wait in line, its journal write, the answer's transfer) overlaps the step"""
    prefetch_at: Literal["start", "publish"] = "publish"
    """when the trainer asks for its next batch: as a step begins (as train.py did before), or once its work is
    done, while it publishes and registers the version (train.py's)"""
    posts_together: bool = True
    """a worker posts its round's groups at once, as rollout.py does (False: one by one, each waiting for the
    journal commit of the one before, as rollout.py did before)"""
    commit_depth: int = 1
    """the proxy's --commit-depth: journal puts in flight at once"""
    trace: bool = False
    """keep the proxy's view twice a second in the results ("trace": rows of [s, latest version, buffer, open
    grants, groups in flight, workers waiting for a grant, the trainer's demand, batches it holds]), every round
    ("rounds": [worker, s granted, s its groups were all in (None: it crashed), generation s drawn, the worker's
    speed factor, its network delay s, prompts]) and every wait of the trainer ("waits": [from s, to s]), and
    what the trainer waited behind in each wait of a second or more ("stalls": the rounds out when it began)"""
    autoscale: int | None = None
    """the controller on, with at most this many workers (the fleet starts at --workers; the batch is sized for it)"""
    autoscale_time: float = 1 / 30
    """the controller's window, cool-downs and retry time: autoscale.Bounds' defaults (60, 300, 600 and 1800 s, for
    Jobs that take minutes to start) times this; it looks every min_window_s (a window also holds Bounds'
    min_window_steps trainer steps)"""
    autoscale_target: float = 0.85
    """the trainer utilisation it aims at"""
    rounds_slow_at: float = 1.0
    """from this share of the trainer's steps on, every round takes --rounds-slow-x times as long (a change of
    the workers' speeds)"""
    rounds_slow_x: float = 1.0
    trainer_slow_at: float = 1.0
    """from this share of the trainer's steps on, every step takes --trainer-slow-x times as long"""
    trainer_slow_x: float = 1.0
    seed: int = 0
    out: str = "runs/fleet_sim.json"
    measure: str | None = None
    """instead: read a local run's metrics (runs/<run>) and write the time distributions to bench/fleet_times.json"""


# ---- the time distributions measured here -----------------------------------------------------------------

def measure(run_dir: str) -> None:
    """Rounds (gen_s, tokens per completion) and steps (the trainer's work: step_s - rollout_wait_s), each with
    where in the run it was (0..1 by version), from a local run's saved metrics."""
    import report
    train, rollouts, _ = report.load_dir(run_dir)
    last = max(r["version"] for r in train)
    rounds = [[r["version"] / last, r["rollout/gen_s"], r["rollout/tokens_per_s"] * r["rollout/gen_s"] / r["rollout/samples"]]
              for rows in rollouts.values() for r in rows if "rollout/gen_s" in r]
    steps = [[r["step"] / len(train), r["perf/step_s"] - r["perf/rollout_wait_s"]] for r in train]
    sync = [r["perf/weight_sync_s"] for rows in rollouts.values() for r in rows if "perf/weight_sync_s" in r]
    TIMES.write_text(json.dumps({"from": os.path.basename(os.path.normpath(run_dir)), "rounds": sorted(rounds),
                                 "steps": sorted(steps), "weight_sync_s": sorted(sync)}, indent=1) + "\n")
    print(f"{TIMES}: {len(rounds)} rounds (gen_s median {statistics.median(r[1] for r in rounds):.1f} s), {len(steps)} "
          f"steps (work median {statistics.median(s[1] for s in steps):.1f} s), from {run_dir}")


class Draw:
    """Draws from the measured distributions near a point of the run (the answers shorten as it learns, and
    both rounds and steps get faster)."""

    def __init__(self, times: dict, rng: random.Random, step_rng: random.Random, span: tuple[float, float] = (0.0, 1.0)):
        """step_rng: the trainer's own, so that pacing on and off train the same sequence of step times (the
        workers' draws interleave differently in the two). span: the part of the measured run drawn from."""
        self.rounds, self.steps, self.rng, self.step_rng = times["rounds"], times["steps"], rng, step_rng
        self.sync = times["weight_sync_s"] or [0.1]
        if not 0 <= span[0] < span[1] <= 1:
            raise SystemExit(f"--span {span[0]} {span[1]}: two points of the run, 0 <= from < to <= 1")
        self.span = span

    def _near(self, rows: list, at: float) -> list:
        at = self.span[0] + (self.span[1] - self.span[0]) * at
        i = bisect.bisect_left(rows, [at])
        return rows[max(0, i - 4):i + 4] or rows

    def median_step(self) -> float:
        """The median step of the span drawn from."""
        return statistics.median(s[1] for s in self.steps if self.span[0] <= s[0] <= self.span[1])

    def round(self, at: float) -> tuple[float, float]:
        """(seconds for a round of 8 prompts, tokens per completion)"""
        _, s, tok = self.rng.choice(self._near(self.rounds, at))
        return s, tok

    def step(self, at: float) -> float:
        return self.step_rng.choice(self._near(self.steps, at))[1]


# ---- the processes ---------------------------------------------------------------------------------------------

def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


# ---- one configuration -----------------------------------------------------------------------------------------

class Fleet:
    def __init__(self, a: Args, n: int, pace: bool, url: str, token: str, s3: str, bucket: common.Bucket, adapter: Path):
        self.a, self.n, self.pace, self.url, self.s3, self.bucket, self.adapter = a, n, pace, url, s3, bucket, adapter
        # seeded by worker, not by fleet size: worker i and the trainer's steps are the same at every size and
        # pacing mode (the same run), and a worker the controller adds is the one a fixed fleet that large has
        self.rng = random.Random(f"{a.seed}")
        self.draw = Draw(json.loads(TIMES.read_text()), self.rng, random.Random(f"{a.seed}:steps"), a.span)
        self.batch = batch_size(a, n)
        self.alive: dict[str, list[float]] = {}  # worker id -> [started, ended] (monotonic): its job's billed time
        self.active = list(range(n))   # the workers the controller has not asked to leave (--autoscale)
        self.headers = {"X-Proxy-Token": token, "Content-Type": "application/json"}
        self.hard = {}  # prompt index -> difficulty (drawn when first handed out)
        self.latest, self.done = 0, asyncio.Event()
        self.m = {"generated": {}, "leased": {}, "lost_tokens": 0, "stale": 0, "refused": 0, "crashes": 0,
                  "rounds": {}, "round_s": [], "step_s": [], "step_waits": [], "step_busy": [], "grant_wait": [],
                  "fetch_s": [], "trace": [], "rounds_log": [], "waits": [], "listing_s": [], "post_s": [], "submit": [], "health": [], "trainer_wait": 0.0, "trainer_wait_groups": 0.0,
                  "staleness": {}, "handed": {}, "trained": {}, "errors": [], "bucket_gets": 0, "leave": 0, "join": 0,
                  "polls": 0, "transport_retries": 0, "finished_at": None}

    def fail(self, what: str) -> None:
        if len(self.m["errors"]) < 10:
            self.m["errors"].append(what)

    async def call(self, method: str, path: str, delay: float = 0.0, http: aiohttp.ClientSession | None = None,
                   **kw) -> tuple[int, bytes]:
        if delay:
            await asyncio.sleep(delay / 2)
        for attempt in range(5):  # a connection the proxy closed as it was reused: retried, as rollout.py's client does
            try:
                async with (http or self.http).request(method, path, **kw) as r:
                    status, body = r.status, await r.read()
                break
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                if attempt == 4:
                    raise
                self.m["transport_retries"] += 1
                await asyncio.sleep(0.1)
        if delay:
            await asyncio.sleep(delay / 2)
        return status, body

    # ---- a worker ----------------------------------------------------------------------------------------------
    async def worker(self, i: int, wid: str | None = None) -> None:
        """Worker i (its speed and draws), as `wid` (sim-i; the controller names a worker it starts again anew: the
        proxy may still be telling the one that left to leave)."""
        a = self.a
        rng = random.Random(f"{a.seed}:w{i}")
        wid, speed = wid or f"sim-{i}", math.exp(rng.gauss(0, a.speed_sigma))
        net = rng.uniform(0.2, 1.0) * a.time_scale if rng.random() < a.slow_net else 0.0
        joins = rng.random() < a.join
        leaves_at = time.monotonic() + rng.uniform(0.1, 1.0) * self.expected_s if rng.random() < a.leave else math.inf
        if joins:
            self.m["join"] += 1
            await asyncio.sleep(rng.uniform(0.0, 0.5) * self.expected_s)
        self.alive[wid] = [time.monotonic(), math.inf]
        held, seen = [0], [0]  # the version it generates with; the newest its long-poll has seen
        known: set[str] = set()  # sha256s of the adapter files it has fetched (rollout.py's KnownFiles)
        sync = asyncio.create_task(self.adapter_sync(wid, seen, net))
        try:
            while not self.done.is_set():
                if time.monotonic() > leaves_at:
                    self.m["leave"] += 1
                    return
                if sync.done():  # relaunched after a crash: a new process, a new poll
                    sync = asyncio.create_task(self.adapter_sync(wid, seen, net))
                t0 = time.monotonic()
                body = {"dataset": "sim", "size": a.dataset, "n": a.prompts_per_round, "worker_id": wid, "wait_s": 5.0}
                status, raw = await self.call("POST", "/v1/prompts/lease", net, json=body)
                if status != 200:
                    self.fail(f"prompt lease {status}: {raw[:200]}")
                    await asyncio.sleep(1)
                    continue
                got = json.loads(raw)
                if got.get("leave"):  # asked by the controller, after its round was sent (rollout.py does the same)
                    self.m["left_at_scale_down"] = self.m.get("left_at_scale_down", 0) + 1
                    return
                if got.get("done"):
                    return
                if not got["indices"]:
                    continue
                self.m["grant_wait"].append(time.monotonic() - t0)
                granted = time.monotonic() - self.t0
                idx = got["indices"]
                for p in idx:
                    self.hard.setdefault(p, math.exp(rng.gauss(0, a.prompt_sigma)))
                    self.m["handed"][p] = self.m["handed"].get(p, 0) + 1
                want = max(got.get("version", 0), seen[0])  # the newest, as rollout.py takes between rounds
                if want > held[0]:  # (a grant's version at least: the one it counts on) from the bucket
                    t_fetch = time.monotonic()
                    await self.fetch(want, held, net, known)
                    self.m["fetch_s"].append(time.monotonic() - t_fetch)
                version = held[0]
                at = self.latest / max(1, a.steps)
                round_s, tokens = self.draw.round(at)
                round_s *= (speed * max(self.hard[p] for p in idx) * (0.2 + 0.8 * len(idx) / 8)
                            * a.time_scale * a.round_scale * (a.rounds_slow_x if at >= a.rounds_slow_at else 1.0))
                if rng.random() < a.crash:  # dies mid-round: the round is lost; relaunched later, same id
                    await asyncio.sleep(rng.uniform(0, round_s))
                    self.m["crashes"] += 1
                    self.log_round(wid, granted, None, round_s, speed, net, len(idx))
                    self.m["lost_tokens"] += round(tokens * a.group_size * len(idx))
                    sync.cancel()  # a dead process's poll connection closes (the proxy's sign that it is gone)
                    await asyncio.sleep(2 * round_s)
                    continue
                self.m["round_s"].append(round_s)
                await asyncio.sleep(round_s)
                self.m["rounds"][wid] = self.m["rounds"].get(wid, 0) + 1
                t_post = time.monotonic()
                posts = [self.submit(wid, p, version, tokens, rng, net) for p in idx]
                if a.posts_together:  # rollout.py's spool.flush: the round's groups at once (one journal commit)
                    await asyncio.gather(*posts)
                else:
                    for post in posts:
                        await post
                self.m["post_s"].append(time.monotonic() - t_post)
                self.log_round(wid, granted, time.monotonic() - self.t0, round_s, speed, net, len(idx))
        finally:
            sync.cancel()
            if wid in self.alive:
                self.alive[wid][1] = time.monotonic()

    def log_round(self, wid: str, granted: float, arrived: float | None, gen_s: float, speed: float, net: float,
                  prompts: int) -> None:
        if self.a.trace:
            self.m["rounds_log"].append([wid, round(granted, 2), None if arrived is None else round(arrived, 2),
                                         round(gen_s, 2), round(speed, 2), round(net, 2), prompts])

    async def adapter_sync(self, wid: str, seen: list[int], net: float) -> None:
        """The worker's long-poll of the newest version (it downloads it before its next round)."""
        while not self.done.is_set():
            try:
                path = f"/v1/adapters/latest?after={seen[0]}&wait_s=30&worker_id={wid}"
                status, raw = await self.call("GET", path, net)
            except aiohttp.ClientError as e:
                self.fail(f"{wid} adapter poll: {e!r}")
                await asyncio.sleep(1)
                continue
            if status == 200:
                self.m["polls"] += 1
                seen[0] = max(seen[0], json.loads(raw)["version"])

    async def fetch(self, version: int, held: list[int], net: float, known: set[str]) -> None:
        """The adapter files of `version`, as rollout.py's sync thread gets them: the proxy's listing (GET
        /v1/adapters/{v}/files, with meta.json in it), then each file from the bucket by its presigned URL (real
        GETs), but for one whose sha256 the worker already holds (adapter_config.json, after its first fetch)."""
        t0 = time.monotonic()
        status, raw = await self.call("GET", f"/v1/adapters/{version}/files", net)
        self.m["listing_s"].append(time.monotonic() - t0)
        if status != 200:
            self.fail(f"files of v{version}: {status} {raw[:200]}")
            return
        listing = json.loads(raw)
        for name, sha in listing["meta"]["files"].items():
            if sha in known:
                continue
            f = listing["files"][name]
            async with (self.http_s3.get(f["url"]) if f["url"].startswith("http") else self.http.get(f["url"])) as r:
                await r.read()
                self.m["bucket_gets"] += 1
                if r.status != 200:
                    self.fail(f"GET {name} of v{version}: {r.status}")
                    return
            known.add(sha)
        held[0] = max(held[0], version)

    async def submit(self, wid: str, prompt: int, version: int, tokens: float, rng: random.Random, net: float) -> None:
        G, T = self.a.group_size, max(1, round(tokens * self.hard[prompt]))
        gid = uuid.uuid4().hex
        g = {"group_id": gid, "worker_id": wid, "policy_version": version, "prompt_ids": [rng.randrange(49152) for _ in range(40)],
             "completions": [{"token_ids": [rng.randrange(49152) for _ in range(T)],
                              "logprobs": [round(-rng.random() * 3, 4) for _ in range(T)],
                              "reward": float(rng.random() < 0.5), "finish_reason": "stop"} for _ in range(G)],
             "meta": {"task": "sim", "prompt_index": prompt}}
        body = json.dumps(g, separators=(",", ":"))
        self.m["generated"][gid] = (G * T, prompt)
        while True:
            t0 = time.monotonic()
            status, raw = await self.call("POST", "/v1/groups", net, data=body)
            self.m["submit"].append(time.monotonic() - t0 - net)
            if status == 429:
                self.m["refused"] += 1
                if self.done.is_set():
                    return
                await asyncio.sleep(1.0)
                continue
            if status != 200:
                self.fail(f"submit {status}: {raw[:200]}")
            elif json.loads(raw)["status"] == "stale":
                self.m["stale"] += 1
            return

    # ---- the trainer -------------------------------------------------------------------------------------------
    def train_apart(self, fleet_loop: asyncio.AbstractEventLoop, timeout: aiohttp.ClientTimeout) -> bool:
        """The trainer in a thread of its own, on its own event loop and connection, as a real trainer is its
        own process: its lease answers do not wait in line behind the 1,000 workers' version polls, answered
        together at each new version. (Measured at 1,000 workers with the proxy of 0e5caaa: utilisation 0.914
        and 0.968 for seeds 1 and 2, against 0.918 and 0.971 with the trainer in the fleet's loop.)
        True if it reached its last step within --timeout-s."""
        async def train() -> bool:
            async with aiohttp.ClientSession(self.url, headers=self.headers, timeout=timeout) as http:
                try:
                    await asyncio.wait_for(self.trainer(http), self.a.timeout_s)
                    return True
                except asyncio.TimeoutError:
                    return False
        try:
            return asyncio.run(train())
        finally:
            self.m["finished_at"] = time.monotonic()
            fleet_loop.call_soon_threadsafe(self.done.set)

    async def lease(self, http: aiohttp.ClientSession, step: int, after: int | None) -> tuple[dict, float]:
        """Batch `step`, as train.py leases it (after: the version it registers first, for a batch asked for while
        it trains the one before); with when its request went out (the last one, after empty answers)."""
        while True:
            body = {"num_groups": self.batch, "wait_s": 5.0, "groups_left": (self.a.steps - step + 1) * self.batch,
                    **({} if after is None else {"after_version": after})}
            asked = time.monotonic()
            status, raw = await self.call("POST", "/v1/batches/lease", http=http, json=body)
            if status != 200:
                self.fail(f"lease {status}: {raw[:200]}")
                await asyncio.sleep(1)
                continue
            got = json.loads(raw)
            if got["batch_id"]:
                return got, asked

    async def trainer(self, http: aiohttp.ClientSession) -> None:
        """The waiting counted is from the end of a step (its ack) to the next batch in hand; with --prefetch the
        next batch is asked for as the step begins, so only what is left of that request's time is waited."""
        a, first, pending, done_at = self.a, None, None, time.monotonic()
        for step in range(1, a.steps + 1):
            if pending is None:
                pending = asyncio.create_task(self.lease(http, step, None))
            try:
                got, asked = await pending
            except asyncio.CancelledError:  # --timeout-s: the wait so far counts
                if first is not None:
                    self.m["trainer_wait"] += time.monotonic() - done_at
                raise
            t1, waited = time.monotonic(), 0.0
            if self.a.trace:
                self.m["waits"].append([round(done_at - self.t0, 2), round(t1 - self.t0, 2)])
            if first is not None:  # from its first batch on
                waited = t1 - done_at
                self.m["trainer_wait"] += waited
                # of which the proxy waited for groups: its wait as far as it overlaps ours
                self.m["trainer_wait_groups"] += min(waited, max(0.0, asked + got["waited_s"] - done_at))
            self.m["step_waits"].append(round(waited, 2))
            first = first or t1
            trains_from = self.latest
            for g in got["groups"]:
                s = trains_from - g["policy_version"]
                self.m["staleness"][s] = self.m["staleness"].get(s, 0) + 1
                self.m["leased"][g["group_id"]] = True
                p = g["meta"]["prompt_index"]
                self.m["trained"][p] = self.m["trained"].get(p, 0) + 1
            v = self.latest + 1
            ahead = a.prefetch and step < a.steps
            # the next batch, asked for now (trained from the version this step makes) or once the step's work is done
            pending = asyncio.create_task(self.lease(http, step + 1, v)) if ahead and a.prefetch_at == "start" else None
            slower = a.trainer_slow_x if (step - 1) / a.steps >= a.trainer_slow_at else 1.0
            self.m["step_s"].append(self.draw.step(step / a.steps) * a.time_scale * slower)
            await asyncio.sleep(self.m["step_s"][-1])
            if ahead and a.prefetch_at == "publish":
                pending = asyncio.create_task(self.lease(http, step + 1, v))
            await asyncio.to_thread(common.publish_adapter, self.bucket, self.adapter, v, step, "sim")
            status, raw = await self.call("POST", "/v1/adapters", http=http, json={
                "version": v, "step": step, "published_at": time.time(), "final": step == a.steps})
            if status != 200:
                self.fail(f"register v{v}: {status} {raw[:200]}")
            self.latest = v
            status, raw = await self.call("POST", f"/v1/batches/{got['batch_id']}/ack", http=http)
            if status != 200:
                self.fail(f"ack: {status} {raw[:200]}")
            done_at = time.monotonic()
            self.m["step_busy"].append(done_at - t1)

    async def controller(self, tasks: list) -> None:
        """--autoscale: every look, the supervisor's policy on the proxy's stats (autoscale.look: decide over its
        Window, the state apply() keeps, a worker starting until the proxy has a group of its, as Autoscaler.step does
        on its wall clock; here the simulation's): up starts workers, down asks the newest to leave. Its bounds:
        sim_bounds()."""
        a = self.a
        bounds = sim_bounds(a)
        window, state = Window.of(bounds), initial_state([f"rollout-{i + 1}" for i in self.active])
        self.ids = {i: f"sim-{i}" for i in self.active}   # worker -> the id it runs under now
        self.m["autoscale"] = []
        while not self.done.is_set():
            await asyncio.sleep(bounds.min_window_s)
            now = time.monotonic()
            status, raw = await self.call("GET", "/v1/stats")
            stats = json.loads(raw) if status == 200 else None
            state, d = look(window, state, stats, unseen([self.ids[i] for i in self.active], stats), bounds,
                            bounds.max_workers, now)
            self.m["autoscale"].append([round(now - self.t0, 1), d.action, d.n, d.why, len(self.active),
                                        d.signals.get("trainer_util"), d.signals.get("wait_share"), d.signals.get("steps")])
            if d.action == "up":   # the lowest workers not at work: at size k the fleet is a fixed fleet of k's
                for i in [i for i in range(a.autoscale) if i not in self.active][:d.n]:
                    self.active.append(i)
                    self.ids[i] = f"sim-{i}" if i not in self.ids else f"{self.ids[i]}.r"
                    tasks.append(asyncio.create_task(self.worker(i, self.ids[i])))
            elif d.action == "down":
                for i in [self.active.pop() for _ in range(d.n)]:
                    await self.call("POST", "/v1/workers/leave", json={"worker_id": self.ids[i]})
            if d.action != "hold":
                print(f"  autoscale at {now - self.t0:.0f} s: {d.action} {d.n} -> {len(self.active)} worker(s): "
                      f"{d.reason}", flush=True)

    def worker_s(self, until: float) -> float:
        """Seconds the workers' jobs ran until `until` (the trainer's last step): from a worker's start (or late
        join) to its exit (left, asked to leave, or the run's end); a crashed worker's time away counts (its job
        is relaunched, as on Jobs)."""
        return sum(max(0.0, min(end, until) - start) for start, end in self.alive.values())

    async def probe(self) -> None:
        while not self.done.is_set():
            t0 = time.monotonic()
            await self.call("GET", "/health")
            self.m["health"].append(time.monotonic() - t0)
            await asyncio.sleep(0.1)

    async def trace(self) -> None:
        """--trace: the proxy's view twice a second (what a stall looks like from there)."""
        t_start = time.monotonic()
        while not self.done.is_set():
            status, raw = await self.call("GET", "/v1/stats")
            if status == 200:
                st = json.loads(raw)
                pc = st["pacing"]
                self.m["trace"].append([round(time.monotonic() - t_start, 2), st["latest_version"], st["buffer_size"],
                                        pc["open_grants"], pc["groups_in_flight"], st["waiting_for_grants"],
                                        pc["demand"], pc["trainer_batches_held"]])
            await asyncio.sleep(0.5)

    async def run(self) -> dict:
        # the expected length of the run (joins and leaves are spread over it): steps x the median step
        self.expected_s = self.a.steps * self.draw.median_step() * self.a.time_scale
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(self.url, headers=self.headers, connector=conn, timeout=timeout) as http:
            self.http = http
            # no cap on connections to the bucket either: each of 1,000 workers would have its own
            async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s3:
                self.http_s3 = s3
                t0 = self.t0 = time.monotonic()
                tasks = [asyncio.create_task(self.worker(i)) for i in range(self.n)]
                tasks += [asyncio.create_task(self.probe())] + ([asyncio.create_task(self.trace())] if self.a.trace else [])
                if self.a.autoscale:
                    tasks.append(asyncio.create_task(self.controller(tasks)))
                cpu0 = time.process_time()
                finished = await asyncio.to_thread(self.train_apart, asyncio.get_running_loop(), timeout)
                await asyncio.wait(tasks, timeout=30)
                for t in tasks:
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        self.fail(f"a task failed: {t.exception()!r}")  # a bug here, not the proxy's
                    t.cancel()
                elapsed = time.monotonic() - t0
                self.m["sim_cpu"] = (time.process_time() - cpu0) / elapsed
                async with http.get("/v1/stats") as r:
                    stats = await r.json()
        return {"finished": finished, "elapsed": elapsed, "stats": stats}


def summarize(f: Fleet, run: dict, cpu: float, s3_requests: dict, s3_cpu: float) -> dict:
    m = f.m
    gen = sum(t for t, _ in m["generated"].values())
    leased = sum(m["generated"][g][0] for g in m["leased"] if g in m["generated"])
    hist = {str(k): v for k, v in sorted(m["staleness"].items())}
    handed = m["handed"]
    by_hard = sorted(handed, key=lambda p: f.hard[p])
    q = max(1, len(by_hard) // 4)
    share = lambda ps: sum(min(1, m["trained"].get(p, 0)) for p in ps) / max(1, len(ps))  # noqa: E731
    rounds = list(m["rounds"].values()) + [0] * (f.n - len(m["rounds"]))
    busy, wait = sum(m["step_busy"]), m["trainer_wait"]  # (the wait includes a timed-out run's last, unfinished step)
    # before the drain: the steps whose batch could come from a fleet free to run ahead (Args docstring)
    head = max(0, min(len(m["step_busy"]), f.a.steps - (f.a.max_staleness + 1)))
    s_busy, s_wait = sum(m["step_busy"][:head]), sum(m["step_waits"][:head])
    # what no admission rule can beat (Args.round_scale), and how much faster the fleet offers rounds than the
    # trainer takes them (> 1: the fleet generates faster than the trainer consumes), from the medians drawn
    r_med, s_med = statistics.median(m["round_s"] or [math.nan]), statistics.median(m["step_s"] or [math.nan])
    ceiling = min(1.0, (f.a.max_staleness + 1) * s_med / r_med)
    supply = (f.n * f.a.prompts_per_round / r_med) / (f.batch / s_med)
    st = run["stats"]
    return {"workers": f.n, "pace": f.pace, "batch": f.batch, "finished": run["finished"], "elapsed_s": round(run["elapsed"], 1),
            "steps": f.latest, "utilisation": round(busy / (busy + wait), 3) if busy + wait else None,
            "utilisation_steady": round(s_busy / (s_busy + s_wait), 3) if s_busy + s_wait else None,
            "wait_for_groups_share": round(m["trainer_wait_groups"] / wait, 3) if wait else None,
            "round_s_median": round(r_med, 2), "step_s_median": round(s_med, 2), "ceiling": round(ceiling, 3),
            "supply_over_demand": round(supply, 2),
            "fetch_s_median": pct(m["fetch_s"], .5), "listing_s_median": pct(m["listing_s"], .5), "post_s_median": pct(m["post_s"], .5),
            "post_s_p90": pct(m["post_s"], .9),
            "staleness": hist, "staleness_max": max(m["staleness"], default=None),
            "tokens_generated": gen, "tokens_leased": leased,
            "never_leased": round(1 - leased / gen, 4) if gen else None, "lost_in_crashes_tokens": m["lost_tokens"],
            "groups_stale": m["stale"], "answers_429": m["refused"], "proxy_dropped_stale": st.get("groups_dropped_stale"),
            "prompts_trained": round(share(handed), 3), "hardest_quarter_trained": round(share(by_hard[-q:]), 3),
            "easiest_quarter_trained": round(share(by_hard[:q]), 3),
            "rounds_per_worker": {"min": min(rounds), "median": statistics.median(rounds), "max": max(rounds)},
            "workers_without_a_round": sum(r == 0 for r in rounds),
            "grant_wait_p50_s": pct(m["grant_wait"], .5), "grant_wait_p99_s": pct(m["grant_wait"], .99),
            "proxy_cpu": round(cpu / run["elapsed"], 3), "submit_p99_ms": round(1000 * (pct(m["submit"], .99) or 0), 1),
            "health_p99_ms": round(1000 * (pct(m["health"], .99) or 0), 1),
            "health_apart_p99_ms": round(1000 * (pct(m["health_apart"], .99) or 0), 1),
            "health_apart_p50_ms": round(1000 * (pct(m["health_apart"], .5) or 0), 1),
            "bucket_rps": round(s3_requests["all"] / run["elapsed"], 1), "bucket_cpu": round(s3_cpu / run["elapsed"], 3),
            "bucket_rps_put": round(s3_requests["PUT"] / run["elapsed"], 1),
            "bucket_rps_get": round(s3_requests["GET"] / run["elapsed"], 1),
            "version_polls_answered": m["polls"], "joined_late": m["join"], "left": m["leave"], "crashes": m["crashes"],
            "sim_cpu": round(m["sim_cpu"], 3), "gc": m.get("gc"), "transport_retries": m["transport_retries"],
            "trainer_wait_per_step_s": m["step_waits"], "trainer_busy_per_step_s": [round(b, 2) for b in m["step_busy"]], "pacing": st.get("pacing"), "errors": m["errors"],
            # time to finish and the cost: Fleet.worker_s and run_dollars()
            "finish_s": round(finish_s := (m["finished_at"] or f.t0) - f.t0, 1),
            "worker_s": round(worker_s := f.worker_s(m["finished_at"] or math.inf), 1),
            **run_dollars(f.a, worker_s, finish_s),
            **({"autoscale": m["autoscale"], "left_at_scale_down": m.get("left_at_scale_down", 0),
                "proxy_fleet": st.get("fleet")} if f.a.autoscale else {}),
            **({"trace": m["trace"], "rounds": m["rounds_log"], "waits": m["waits"],
                "stalls": stalls(m["rounds_log"], m["waits"]), "round_overhead_s": overhead(m["rounds_log"])}
               if f.a.trace else {})}


def batch_size(a: Args, n: int) -> int:
    """The trainer's batch in groups: --batch, else --batch-per-worker for the fleet (the controller's most)."""
    return a.batch or max(8, round(a.batch_per_worker * (a.autoscale or n)))


def sim_bounds(a: Args) -> Bounds:
    """The controller's bounds in the simulation: autoscale.Bounds' defaults with its window and cool-downs times
    --autoscale-time (the simulated fleet starts a worker at once, a Jobs worker in minutes)."""
    d = Bounds()
    return Bounds(target_util=a.autoscale_target, max_workers=a.autoscale, min_window_s=d.min_window_s * a.autoscale_time,
                  up_cooldown_s=d.up_cooldown_s * a.autoscale_time, down_cooldown_s=d.down_cooldown_s * a.autoscale_time,
                  retry_s=d.retry_s * a.autoscale_time)


def run_dollars(a: Args, worker_s: float, finish_s: float) -> dict:
    """What the run would cost on Jobs at the durations drawn (simulated seconds / --time-scale), priced as the
    jobs-autoscale preset's flavors (costs.PRICES): its workers, and the whole run (the trainer, proxy with its
    exposed port and supervisor for as long as the trainer ran, plus the workers)."""
    p = PRESETS["jobs-autoscale"]
    fixed = PRICES[p.trainer_flavor] + PRICES[p.proxy_flavor] + EXPOSE_PRICE + PRICES[p.supervisor_flavor]
    workers = worker_s / a.time_scale * PRICES[p.rollout_flavor] / 3600
    return {"worker_dollars": round(workers, 4), "run_dollars": round(workers + finish_s / a.time_scale * fixed / 3600, 4)}


def overhead(rounds: list[list]) -> dict:
    """What a round took beyond its generation (--trace): the grant's answer, the version's fetch, the posts."""
    xs = [round(r[2] - r[1] - r[3], 2) for r in rounds if r[2] is not None]
    return {"median": statistics.median(xs) if xs else None, "p90": pct(xs, .9)}


def stalls(rounds: list[list], waits: list[list[float]], at_least: float = 1.0) -> list[dict]:
    """For each wait of the trainer of `at_least` seconds or more (after its first batch): the rounds out when it
    began (granted before, not in yet; a crashed one for three of its generation times, its relaunch's), and of
    them how many were crashed, of slow workers (speed factor over 1.4), their worker's first round, or behind
    a slow network. What a stall waits behind, from the fleet's side (--trace)."""
    first: dict[str, float] = {}
    for r in sorted(rounds, key=lambda r: r[1]):
        first.setdefault(r[0], r[1])
    out = []
    for a, b in waits[1:]:
        if b - a < at_least:
            continue
        o = [r for r in rounds if r[1] < a and (a < r[2] if r[2] is not None else a < r[1] + 3 * r[3])]
        out.append({"from_s": a, "wait_s": round(b - a, 2), "rounds_out": len(o),
                    "granted_s_before": [round(a - max(r[1] for r in o), 2), round(a - min(r[1] for r in o), 2)] if o else None,
                    "crashed": sum(r[2] is None for r in o), "slow": sum(r[4] > 1.4 for r in o),
                    "first_round": sum(first[r[0]] == r[1] for r in o), "slow_net": sum(r[5] > 0 for r in o)})
    return out


def s3_counts(log: Path, start: int) -> dict:
    """Requests in the S3 server's log since byte `start` (werkzeug logs one line per request)."""
    with open(log, "rb") as fh:
        fh.seek(start)
        text = fh.read().decode(errors="replace")
    methods = re.findall(r'"(GET|PUT|POST|HEAD|DELETE) /', text)
    return {"all": len(methods), "PUT": methods.count("PUT"), "GET": methods.count("GET")}


def configuration(a: Args, n: int, pace: bool, tmp: Path, s3_port: int, s3_log: Path, s3_pid: int) -> dict:
    port, token = free_port(), secrets.token_urlsafe(16)
    run = f"fleet-{n}-{'on' if pace else 'off'}-{secrets.token_hex(3)}"
    env = {**os.environ, "RUN_NAME": run, "PROXY_TOKEN": token}
    bucket = common.Bucket(bucket="bench", run=run)
    adapter = tmp / "adapter"
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_model.safetensors").write_bytes(b"w" * 4096)
    (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    batch = batch_size(a, n)
    # the buffer holds what the staleness window lets be in flight (pacing admits up to max_staleness batches;
    # a smaller buffer turned admitted rounds away with 429 at 1,000 workers, docs/results/fleet.md)
    flags = ["--port", str(port), "--group-size", str(a.group_size), "--max-staleness", str(a.max_staleness),
             "--max-buffer", str(max(512, (a.max_staleness + 1) * batch)), "--max-connections", str(4 * n + 64),
             "--commit-depth", str(a.commit_depth),
             *([] if pace else ["--no-pace"])]
    proxy = subprocess.Popen([sys.executable, str(ROOT / "proxy.py"), *flags], env=env,
                             stdout=open(tmp / f"proxy-{n}-{pace}.log", "w"), stderr=subprocess.STDOUT)
    try:
        wait_up(f"http://127.0.0.1:{port}/health", proxy)
        f = Fleet(a, n, pace, f"http://127.0.0.1:{port}", token, f"http://127.0.0.1:{s3_port}", bucket, adapter)
        start, cpu0, s3_cpu0 = s3_log.stat().st_size, cpu_s(proxy.pid), cpu_s(s3_pid)
        print(f"== {n} workers, pacing {'on' if pace else 'off'}: batch {f.batch}, {a.steps} steps", flush=True)
        probed = tmp / f"health-{n}-{pace}.txt"
        probe = subprocess.Popen([sys.executable, str(ROOT / "bench" / "health_probe.py"), "--url",
                                  f"http://127.0.0.1:{port}", "--out", str(probed)])
        # this one process stands for n workers' processes and the trainer's: its own cyclic collections (a walk of
        # everything it holds) pause all of them at once, and its in-process /health probe with them, which is not
        # the proxy's lag; so the fleet's state is frozen out of every walk and the collector waits for the end
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            result = asyncio.run(f.run())
        finally:
            gc.enable()
            gc.unfreeze()
            probe.terminate()
            probe.wait()
        f.m["health_apart"] = [float(x) for x in probed.read_text().split()] if probed.exists() else []
        f.m["gc"] = garbage_collections(f"http://127.0.0.1:{port}", token)
        return summarize(f, result, cpu_s(proxy.pid) - cpu0, s3_counts(s3_log, start), cpu_s(s3_pid) - s3_cpu0)
    finally:
        proxy.kill()
        proxy.wait()


def garbage_collections(url: str, token: str) -> dict:
    """The proxy's own account of its cyclic garbage collections (GET /metrics, sweeper.py): how many, their pauses,
    the objects they found unreachable."""
    text = httpx.get(f"{url}/metrics", headers={"X-Proxy-Token": token}, timeout=30).text
    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
           if s.name.startswith(("proxy_gc_", "proxy_peak_rss")) and s.labels.get("le") in (None, "0.1")}
    n = got.get("proxy_gc_pause_seconds_count", 0)
    return {"collections": int(n), "pause_mean_ms": round(1000 * got.get("proxy_gc_pause_seconds_sum", 0) / max(1, n), 1),
            "pauses_over_100ms": int(n - got.get("proxy_gc_pause_seconds_bucket", n)),
            "unreachable": int(got.get("proxy_gc_unreachable", 0)), "peak_rss_mb": round(got.get("proxy_peak_rss_mb", 0))}


def line(r: dict) -> str:
    h = r["staleness"]
    return (f"{r['workers']:5d} {'on ' if r['pace'] else 'off'} batch {r['batch']:4d}  util {r['utilisation'] or 0:.3f} "
            f"(steady {r['utilisation_steady'] or 0:.3f}; "
            f"waiting for groups {100 * (r['wait_for_groups_share'] or 0):.0f}% of the wait) "
            f"(ceiling {r['ceiling']:.2f}; round {r['round_s_median']:.1f} s, step {r['step_s_median']:.1f} s, "
            f"supply/demand {r['supply_over_demand']:.1f}; a round's fetch {r['fetch_s_median'] or 0:.2f} s "
            f"(listing {r['listing_s_median'] or 0:.2f} s), "
            f"posts {r['post_s_median'] or 0:.2f} s (p90 {r['post_s_p90'] or 0:.2f} s))  "
            f"staleness {h} (max {r['staleness_max']})  never leased {100 * (r['never_leased'] or 0):.1f}%  "
            f"stale {r['groups_stale']} 429 {r['answers_429']}  backed up {(r['pacing'] or {}).get('groups_backed_up', 0)}  "
            f"prompts trained {r['prompts_trained']:.2f} "
            f"(hardest {r['hardest_quarter_trained']:.2f}, easiest {r['easiest_quarter_trained']:.2f})  "
            f"rounds/worker {r['rounds_per_worker']} none {r['workers_without_a_round']}  "
            f"grant wait p99 {r['grant_wait_p99_s'] or 0:.1f}s  "
            f"proxy cpu {100 * r['proxy_cpu']:.0f}% (sim {100 * r['sim_cpu']:.0f}%)  "
            f"submit p99 {r['submit_p99_ms']:.0f} ms  health p99 {r['health_p99_ms']:.0f} ms "
            f"(from a process apart: p99 {r['health_apart_p99_ms']:.0f} ms, p50 {r['health_apart_p50_ms']:.0f} ms)  "
            f"proxy gc {r['gc']}  "
            f"bucket {r['bucket_rps']:.0f} req/s (cpu {100 * r['bucket_cpu']:.0f}%)  {r['elapsed_s']:.0f} s{'' if r['finished'] else ' (timed out)'}")


@contextlib.contextmanager
def s3_server() -> Iterator[tuple[Path, int, Path, int]]:
    """A moto S3 server on 127.0.0.1 with the bucket `bench`, the environment pointing at it: (a temporary
    folder for logs, its port, its request log, its pid)."""
    tmp = Path(tempfile.mkdtemp(prefix="fleet-sim-"))
    s3_port = free_port()
    os.environ.update({"S3_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1", "BUCKET": "bench"})
    s3_log = tmp / "s3.log"
    s3 = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)],
                          stdout=open(s3_log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_up(os.environ["S3_ENDPOINT_URL"], s3)
        httpx.put(f"{os.environ['S3_ENDPOINT_URL']}/bench")
        yield tmp, s3_port, s3_log, s3.pid
    finally:
        s3.kill()
        s3.wait()


def fleet_line(r: dict, a: Args) -> str:
    return (f"  fleet: {r['worker_s']:.0f} worker-seconds, the trainer's last step at {r['finish_s']:.0f} s; at the "
            f"durations drawn (/ time scale {a.time_scale:g}) ${r['worker_dollars']:.4f} of workers, "
            f"${r['run_dollars']:.4f} the whole run (run_dollars)"
            + (f"; {len(r['autoscale'])} looks, {r['left_at_scale_down']} worker(s) left when asked" if a.autoscale else ""))


def main(a: Args) -> None:
    if a.measure:
        return measure(a.measure)
    if not TIMES.exists():
        raise SystemExit(f"{TIMES} is missing: make it from a local run with --measure runs/<run>")
    results, tmp = [], None
    try:
        with s3_server() as (tmp, s3_port, s3_log, s3_pid):
            for n in a.workers:
                for pace in {"on": [True], "off": [False], "both": [True, False]}[a.pace]:
                    results.append(configuration(a, n, pace, tmp, s3_port, s3_log, s3_pid))
                    print(line(results[-1]), flush=True)
                    print(fleet_line(results[-1], a), flush=True)
    finally:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), "times": json.loads(TIMES.read_text())["from"],
                                           "results": results}, indent=1, default=str) + "\n")
        print(f"results: {a.out} (logs in {tmp})")


if __name__ == "__main__":
    main(tyro.cli(Args))

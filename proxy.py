# /// script
# requires-python = ">=3.10"
# dependencies = [
#   "fastapi>=0.115", "uvicorn[standard]>=0.30", "pydantic>=2.7", "tyro>=0.9", "boto3>=1.36", "httpx>=0.27",
#   "tenacity>=8.2", "prometheus-client>=0.20",
# ]
# ///
"""The coordinator of an async GRPO run: trajectory buffer with a staleness filter, batch leases,
prompt dispatch and the registry of published adapter versions. Workers and the trainer only
make outbound HTTP calls to it; it never calls them.

    python proxy.py --port 8000                      # loopback, token from PROXY_TOKEN
    # a run's proxy on Hugging Face Jobs, by hand (README, "Run on Hugging Face Jobs"); then
    # `bash launch_jobs.sh --watch my-run` adopts it and records its URL for the workers and the trainer
    hf jobs uv run --flavor cpu-upgrade --expose 8000 --timeout 6h --label async-grpo-run=my-run \
        --label role=proxy --secrets PROXY_TOKEN --secrets AWS_ACCESS_KEY_ID --secrets AWS_SECRET_ACCESS_KEY \
        -e BUCKET=async-grpo -e RUN_NAME=my-run -e S3_ENDPOINT_URL=https://s3.hf.co/$HF_NAMESPACE \
        proxy.py common.py routing.py runconfig.py --host 0.0.0.0 --port 8000

Durability: the bucket is my only disk. Every change an answer depends on is in an append-only journal
in the bucket before the answer goes out: each group commit is one object rollouts/{incarnation:06d}-{seq:08d}.jsonl
with one JSON line per accepted group (canonical) or event (lease, ack, expiry, version, prompt cursor,
counters), in order. On start the proxy replays that log, so `kill -9` at any moment is fine.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import json
import os
import random
import re
import sys
import time
import uuid
from collections import OrderedDict, deque, namedtuple
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import lru_cache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py beside this file
from fastapi import FastAPI, HTTPException, Path, Query, Request  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.responses import JSONResponse, Response  # noqa: E402
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest  # noqa: E402
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field, ValidationError  # noqa: E402

from common import Bucket, ConflictError, Metrics, TrajectoryGroup, peak_rss_mb  # noqa: E402
from routing import router as inference_router  # noqa: E402
from runconfig import record_config  # noqa: E402

@dataclass
class Args:
    host: str = "127.0.0.1"
    """interface to listen on; a non-loopback address requires a token"""
    port: int = 8000
    token: str | None = field(default_factory=lambda: os.environ.get("PROXY_TOKEN"))
    """shared secret callers send as X-Proxy-Token or Authorization: Bearer (env PROXY_TOKEN)"""
    group_size: int = 8
    """G: completions per group; groups of another size are refused"""
    max_staleness: int = 3
    """groups more than this many versions behind the latest are dropped"""
    max_buffer: int = 512
    """buffered groups; beyond it stale groups go first, then submissions get 429"""
    lease_s: float = 300.0
    """a lease not acked within this many seconds returns its groups to the buffer"""
    max_prompt_tokens: int = 4096
    max_completion_tokens: int = 4096
    max_body_mb: float = 8.0
    """request bodies above this get 413"""
    commit_depth: int = 1
    """journal writes in flight; requests arriving meanwhile share the next (1: fewest puts; more: hides latency)"""
    seed: int = 0
    """seed of the per-epoch prompt shuffle"""
    use_bucket: bool = True
    """journal to the bucket and replay it on start, verify registered versions, write metrics (needs BUCKET)"""

ARGS = Args()  # replaced by the CLI in __main__; tests start the real script as a process
MAX_WORKERS, MAX_DATASETS = 4096, 64  # bounds on client-chosen names we keep state for

# ---- state ----------------------------------------------------------------------------------------
# a group is held as the JSON line we logged (cheap to keep, leased without re-encoding); expires_at is
# wall-clock time: it must mean the same thing after a restart
Entry = namedtuple("Entry", "gid version raw")
Lease = namedtuple("Lease", "batch_id entries expires_at")

@dataclass
class State:
    buffer: "OrderedDict[str, Entry]" = field(default_factory=OrderedDict)  # group_id -> entry (FIFO)
    seen: set = field(default_factory=set)          # every group_id ever accepted (idempotency)
    pending: dict = field(default_factory=dict)     # group_id -> future of its journal write
    leases: dict = field(default_factory=dict)      # batch_id -> Lease
    acked: set = field(default_factory=set)         # batch ids acked
    expired: set = field(default_factory=set)       # batch ids whose lease ran out
    versions: list = field(default_factory=lambda: [{"version": 0, "step": 0, "published_at": None}])
    done: bool = False                              # the trainer registered its final version
    cursors: dict = field(default_factory=dict)     # dataset -> {size, epoch, pos}
    workers: "OrderedDict[str, dict]" = field(default_factory=OrderedDict)  # worker_id -> {last_seen, groups, recent}
    counters: dict = field(default_factory=lambda: dict.fromkeys(
        ["groups_accepted", "groups_duplicate", "groups_dropped_stale", "groups_rejected_full",
         "groups_leased", "groups_acked", "batches_leased", "batches_acked", "leases_expired"], 0))
    staleness_hist: dict = field(default_factory=dict)  # staleness at lease -> groups
    incarnation: int = 0
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)

    @property
    def latest(self) -> int:
        return self.versions[-1]["version"]

S = State()
BUCKET: Bucket | None = None
METRICS: Metrics | None = None
REGISTER_LOCK = asyncio.Lock()  # one version registration at a time (rare; it awaits the bucket)

def drop_stale(count: bool = True) -> int:
    """Remove groups staler than max_staleness from the buffer; returns how many."""
    stale = [gid for gid, e in S.buffer.items() if S.latest - e.version > ARGS.max_staleness]
    for gid in stale:
        del S.buffer[gid]
    S.counters["groups_dropped_stale"] += len(stale) * count
    return len(stale)

def return_lease(bid: str) -> None:
    """A lease ran out: its groups go back to the front of the buffer (they are the oldest)."""
    lease = S.leases.pop(bid)
    S.expired.add(bid)
    S.counters["leases_expired"] += 1
    to_front(lease.entries)

def to_front(entries: list[Entry]) -> None:
    for e in reversed(entries):
        S.buffer[e.gid] = e
        S.buffer.move_to_end(e.gid, last=False)
    drop_stale()  # the buffer never holds a stale group: a full one has nothing stale to give up

def expire_leases(now: float) -> None:
    for bid in [b for b, lease in S.leases.items() if lease.expires_at <= now]:
        return_lease(bid)
        # not awaited: if this write is lost, replay still expires the lease (by time, or because a
        # later lease took its groups), so an expiry never needs to be durable before anything else
        JOURNAL.append({"t": "expire", "batch_id": bid})

async def wait_until(ready, wait_s: float) -> bool:
    """Under S.cond: wait up to wait_s for ready() (re-checked on every notify, at least once a second)."""
    deadline = time.monotonic() + wait_s
    while not ready():
        if (left := deadline - time.monotonic()) <= 0:
            return False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(S.cond.wait(), timeout=min(left, 1.0))
    return True

def stats() -> dict:
    return {"buffer_size": len(S.buffer), "latest_version": S.latest, "done": S.done, "open_leases": len(S.leases),
            "max_staleness": ARGS.max_staleness, "group_size": ARGS.group_size, "max_buffer": ARGS.max_buffer, **S.counters,
            "staleness_hist": {str(k): v for k, v in sorted(S.staleness_hist.items())},
            "workers": {w: {"last_seen_s_ago": round(time.time() - d["last_seen"], 1), "groups": d["groups"]} for w, d in S.workers.items()},
            "cursors": S.cursors, "incarnation": S.incarnation, "pending_writes": len(JOURNAL.queue),
            "peak_rss_mb": round(peak_rss_mb(), 1)}

# ---- journal: group commit to the bucket, and replay on start -------------------------------------
class Journal:
    """Callers append a record (group bytes or event dict) and await the future it returns. The writer puts
    all queued since its last put as one object; up to `depth` puts fly at once, but answers go out in
    log order: nothing answered depends on a lost write."""

    def __init__(self, bucket: Bucket | None, incarnation: int, depth: int = 1):
        self.bucket, self.inc, self.seq, self.slots = bucket, incarnation, 0, asyncio.Semaphore(depth)
        self.queue: list[tuple[bytes | dict, asyncio.Future]] = []
        self.wake = asyncio.Event()

    def append(self, rec: bytes | dict) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody may be waiting (expiry)
        self.queue.append((rec, fut))
        self.wake.set()
        return fut

    async def run(self) -> None:
        prev = None
        while True:
            await self.wake.wait()
            await self.slots.acquire()  # while all slots are busy, the next batch grows
            self.wake.clear()
            batch, self.queue = self.queue, []
            name, self.seq = f"{self.inc:06d}-{self.seq:08d}.jsonl", self.seq + 1
            prev = asyncio.create_task(self.commit(name, batch, prev))

    async def commit(self, name: str, batch: list, prev: asyncio.Task | None) -> None:
        lines = [r if isinstance(r, bytes) else json.dumps(r).encode() for r, _ in batch]
        if len(lines) > sum(isinstance(r, bytes) for r, _ in batch):  # counters the log does not imply
            lines.append(json.dumps({"t": "counters", "counters": S.counters, "staleness_hist": S.staleness_hist}).encode())
        t0, err = time.perf_counter(), None
        try:  # one object per commit, groups and events in the order they were appended
            if self.bucket:
                await asyncio.to_thread(self.bucket.put, f"rollouts/{name}", b"\n".join(lines) + b"\n", if_none_match=True)
        except Exception as e:  # noqa: BLE001 - every waiting answer gets it as a 503
            err = e
        COMMIT.observe(time.perf_counter() - t0)
        self.slots.release()
        if isinstance(err, ConflictError):  # someone else wrote our key: two proxies on one run
            print(f"FATAL: {err}. Another proxy is journaling to this run; stopping.", file=sys.stderr, flush=True)
            os._exit(3)
        if prev is not None:
            await prev
        for _, fut in batch:  # a failed write: each answer its own 503 (each is raised in its own task)
            if not fut.done():
                fut.set_exception(HTTPException(503, f"could not write to the bucket, nothing changed; retry: {err}",
                                                headers={"Retry-After": "2"})) if err else fut.set_result(None)

_HEAD = re.compile(rb'^\{"group_id":"([^"]+)","worker_id":"([^"]*)","policy_version":(\d+),')

def replay(bucket: Bucket) -> None:
    """Rebuild the state from the bucket's log (runs before the server accepts requests): one pass in log
    order; a group is always logged before any event that names it."""
    t0 = time.time()
    keys = sorted(bucket.list("rollouts/") + bucket.list("proxy/log/"),  # proxy/log/: events of runs before 2026-11-29
                  key=lambda k: (k.rsplit("/", 1)[1], k.startswith("proxy/")))
    S.incarnation = max((int(k.rsplit("/", 1)[1].split("-")[0]) for k in keys), default=-1) + 1
    holder: dict[str, str] = {}  # group_id -> the lease that last took it
    leased: dict[str, int] = {}  # batch_id -> number of groups
    counters = {}
    with ThreadPoolExecutor(16) as pool:
        for blob in pool.map(lambda k: (bucket.get(k) or (b"", ""))[0], keys):
            for line in blob.splitlines():
                if line.startswith(b'{"group_id"'):  # one we wrote: id and version lead, no full parse
                    m = _HEAD.match(line)
                    gid = m[1].decode()
                    S.seen.add(gid)
                    S.buffer[gid] = Entry(gid, int(m[3]), line)
                    continue
                e = json.loads(line)
                t = e["t"]
                if t == "lease":
                    # a later lease of the same group means the earlier one ran out (its expiry write was lost)
                    for b in {holder[g] for g in e["group_ids"] if g in holder and holder[g] in S.leases}:
                        return_lease(b)
                    entries = [S.buffer.pop(g) for g in e["group_ids"] if g in S.buffer]
                    S.leases[e["batch_id"]] = Lease(e["batch_id"], entries, e["expires_at"])
                    holder.update(dict.fromkeys(e["group_ids"], e["batch_id"]))
                    leased[e["batch_id"]] = len(e["group_ids"])
                elif t == "ack" and e["batch_id"] not in S.acked:  # its groups are consumed for good
                    S.leases.pop(e["batch_id"], None)
                    S.acked.add(e["batch_id"])
                elif t == "expire" and e["batch_id"] in S.leases:
                    return_lease(e["batch_id"])
                elif t == "version" and e["version"] > S.latest:
                    S.versions.append({k: e[k] for k in ("version", "step", "published_at")})
                    S.done = e["final"]
                elif t == "cursor":
                    S.cursors[e["dataset"]] = {k: e[k] for k in ("size", "epoch", "pos")}
                elif t == "counters":
                    counters = e["counters"]
                    S.staleness_hist = {int(k): v for k, v in e["staleness_hist"].items()}
    # what the log implies exactly is recounted; the rest comes from the last snapshot
    S.counters.update(counters)
    S.counters.update(groups_accepted=len(S.seen), batches_leased=len(leased), groups_leased=sum(leased.values()),
                      batches_acked=len(S.acked), groups_acked=sum(leased.get(b, 0) for b in S.acked), leases_expired=len(S.expired))
    drop_stale(count=False)  # dropped (and counted) before the crash already
    print(f"proxy: incarnation {S.incarnation}, replayed {len(keys)} objects in {time.time() - t0:.1f}s: "
          f"{len(S.seen)} groups, buffer {len(S.buffer)}, {len(S.leases)} leases, version {S.latest}", file=sys.stderr)

JOURNAL = Journal(None, 0)

# ---- metrics: request latency and staleness as histograms; the state's numbers read at scrape time ----
REGISTRY = CollectorRegistry()
LATENCY = Histogram("proxy_request_seconds", "request latency by route", ["method", "route"], registry=REGISTRY,
                    buckets=(.001, .0025, .005, .01, .025, .05, .1, .15, .25, .5, 1, 2.5, 5, 10, 30, 60))  # .15: the p99 target
COMMIT = Histogram("proxy_journal_commit_seconds", "one group-commit write to the bucket", registry=REGISTRY,
                   buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
STALENESS = Histogram("proxy_lease_staleness_versions", "staleness of leased groups (latest - policy_version)",
                      registry=REGISTRY, buckets=(0, 1, 2, 3, 4, 6, 8, 16))

class StateCollector:
    def collect(self):
        yield from (CounterMetricFamily(f"proxy_{k}", k.replace("_", " "), value=v) for k, v in S.counters.items())
        for k, v in (("buffer_size", len(S.buffer)), ("open_leases", len(S.leases)), ("latest_version", S.latest),
                     ("pending_writes", len(JOURNAL.queue)), ("peak_rss_mb", peak_rss_mb())):
            yield GaugeMetricFamily(f"proxy_{k}", k.replace("_", " "), value=v)
        seen = GaugeMetricFamily("proxy_worker_last_seen_timestamp", "unix time of a worker's last group", labels=["worker"])
        rate = GaugeMetricFamily("proxy_worker_groups_per_second", "a worker's groups over the last 60 s", labels=["worker"])
        for w, d in S.workers.items():
            while d["recent"] and d["recent"][0] < time.time() - 60:
                d["recent"].popleft()
            seen.add_metric([w], d["last_seen"])
            rate.add_metric([w], len(d["recent"]) / 60.0)
        yield from (seen, rate)

REGISTRY.register(StateCollector())

def touch_worker(worker: str) -> dict:
    d = S.workers.pop(worker, None) or {"last_seen": 0.0, "groups": 0, "recent": deque(maxlen=100_000)}
    S.workers[worker] = d  # most recent last, so the least recently seen is evicted first
    if len(S.workers) > MAX_WORKERS:
        S.workers.popitem(last=False)
    d["last_seen"] = time.time()
    return d

# ---- app ------------------------------------------------------------------------------------------
async def _housekeeping() -> None:
    while True:
        await asyncio.sleep(1.0)
        async with S.cond:
            expire_leases(time.time())
        if METRICS is not None:
            row = {"buffer/size": len(S.buffer), "version": S.latest, **{f"proxy/{k}": v for k, v in S.counters.items()}}
            await asyncio.to_thread(METRICS.log, row)  # its flush is a bucket put: not on the event loop

@asynccontextmanager
async def lifespan(app: FastAPI):
    global BUCKET, METRICS, JOURNAL
    if ARGS.use_bucket and os.environ.get("BUCKET"):
        BUCKET = Bucket()
        await asyncio.to_thread(record_config, BUCKET, "proxy", ARGS, __file__)
        await asyncio.to_thread(replay, BUCKET)
        METRICS = Metrics(BUCKET, "proxy", flush_s=10.0)
    JOURNAL = Journal(BUCKET, S.incarnation, ARGS.commit_depth)
    tasks = [asyncio.create_task(JOURNAL.run()), asyncio.create_task(_housekeeping())]
    # each group validated makes dozens of container objects: by default the cyclic GC ran every ~30 groups and
    # walked every module's objects (the p99 doubled). What is alive now is frozen out of the walk; runs are rarer
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    if BUCKET is not None:  # a version published while the proxy was down is only in adapters/latest.json
        latest = await asyncio.to_thread(BUCKET.get_json, "adapters/latest.json")
        if latest and latest["version"] > S.latest:
            await register_adapter(RegisterRequest(version=latest["version"], step=latest.get("step", 0),
                                                   published_at=latest.get("created_at", time.time())))
    yield
    [t.cancel() for t in tasks]
    if METRICS is not None:
        METRICS.flush()
    print("proxy: stopped cleanly", file=sys.stderr, flush=True)  # uvicorn then re-raises the signal

# FastAPI's OpenTelemetry hooks off: /metrics is our telemetry, and they cost a lookup per request
app = FastAPI(title="async-grpo proxy", version="1", lifespan=lifespan, telemetry={"tracing": False, "metrics": False, "logs": False})

@app.exception_handler(RequestValidationError)
async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # field path + message, without echoing the input (it may hold NaN, which JSON cannot carry)
    return JSONResponse({"detail": [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]},
                        status_code=422)

OPEN = ("/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")  # no token needed

def authorized(headers: dict) -> bool:
    auth = headers.get(b"authorization", b"")
    got = headers.get(b"x-proxy-token") or (auth[7:] if auth[:7].lower() == b"bearer " else None)
    return not ARGS.token or (got is not None and hmac.compare_digest(got, ARGS.token.encode()))

def guard(app):
    """Pure ASGI middleware: 401 for a missing or wrong token (every path but OPEN, unknown ones too), 413 for a
    body over the cap (declared, or chunked and read here) before any endpoint reads it; times requests by route."""
    async def asgi(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        t0, cap, headers = time.perf_counter(), int(ARGS.max_body_mb * 2**20), dict(scope["headers"])
        if scope["path"] not in OPEN and not authorized(headers):
            return await JSONResponse({"detail": "missing or wrong proxy token (X-Proxy-Token or Authorization: Bearer)"},
                                      status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        too_big = JSONResponse({"detail": f"request body over max_body_mb={ARGS.max_body_mb}"}, status_code=413)
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > cap):
            return await too_big(scope, receive, send)
        if declared is None and b"transfer-encoding" in headers:  # chunked: read it here, up to the cap
            body, more = bytearray(), True
            while more:
                msg = await receive()
                if msg["type"] == "http.disconnect":  # the client went away mid-body: nothing to answer
                    return
                body += msg.get("body", b"")  # in place: an 8 MB body is not copied once per chunk
                more = msg.get("more_body", False)
                if len(body) > cap:
                    return await too_big(scope, receive, send)
            msgs = [{"type": "http.request", "body": bytes(body), "more_body": False}]
            async def receive(orig=receive):  # noqa: F811 - hand the buffered body to the app once
                return msgs.pop() if msgs else await orig()
        try:
            await app(scope, receive, send)
        finally:
            LATENCY.labels(scope["method"], getattr(scope.get("route"), "path", "other")).observe(time.perf_counter() - t0)
    return asgi

app.add_middleware(guard)
app.include_router(inference_router)  # POST /v1/chat/completions answered by serving workers (routing.py)

@app.get("/health")
async def health() -> dict:
    return {"ok": True, "latest_version": S.latest}

class SubmitResponse(BaseModel):
    status: str  # accepted | duplicate | stale
    duplicate: bool
    buffer_size: int

# the body is parsed by pydantic-core straight from bytes (4x cheaper than json.loads + validate on a
# 33 kB group); its schema in /openapi.json is the one FastAPI registers for LeaseResponse.groups
_GROUP_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TrajectoryGroup"}}}}}

@app.post("/v1/groups", response_model=SubmitResponse, openapi_extra=_GROUP_BODY)
async def submit_group(request: Request) -> SubmitResponse:
    """Submit one scored group. Idempotent on group_id; 429 with Retry-After when the buffer is full.
    A 200 `accepted` means the group is in the bucket."""
    try:  # strict: a number sent as a string (or an id as 1.0) is a client bug, not something to coerce
        group = TrajectoryGroup.model_validate_json(body := await request.body(), strict=True)
    except ValidationError as e:
        raise RequestValidationError([{**x, "loc": ("body", *x["loc"])} for x in e.errors()]) from None
    if len(group.completions) != ARGS.group_size:
        raise HTTPException(422, f"completions: {len(group.completions)} given, this run's group_size is {ARGS.group_size}")
    for what, n, limit in [("prompt_ids", len(group.prompt_ids), "max_prompt_tokens")] + [
            (f"completions[{i}].token_ids", len(c.token_ids), "max_completion_tokens") for i, c in enumerate(group.completions)]:
        if n > getattr(ARGS, limit):
            raise HTTPException(422, f"{what}: {n} tokens > {limit} {getattr(ARGS, limit)}")
    gid = group.group_id
    if gid in S.pending:  # the same group is being written: answer once that write is done
        await asyncio.shield(S.pending[gid])
    if gid in S.seen:
        S.counters["groups_duplicate"] += 1
        return SubmitResponse(status="duplicate", duplicate=True, buffer_size=len(S.buffer))
    if group.policy_version > S.latest:
        raise HTTPException(409, f"policy_version {group.policy_version} is newer than the latest registered {S.latest}")
    w = touch_worker(group.worker_id)
    if S.latest - group.policy_version > ARGS.max_staleness:
        S.seen.add(gid)
        S.counters["groups_dropped_stale"] += 1
        return SubmitResponse(status="stale", duplicate=False, buffer_size=len(S.buffer))
    if len(S.buffer) + len(S.pending) >= ARGS.max_buffer:  # stale groups are gone already (to_front, register)
        S.counters["groups_rejected_full"] += 1
        raise HTTPException(429, f"buffer full ({ARGS.max_buffer} groups)", headers={"Retry-After": "1"})
    # the bytes as sent are what we log and lease out when they are one line that leads with the fields
    # as we would write them (replay reads those unparsed); otherwise the canonical re-encoding
    m = _HEAD.match(body) if b"\n" not in body and b"\r" not in body else None
    keep = m and (m[1].decode(), m[2].decode(), int(m[3])) == (gid, group.worker_id, group.policy_version)
    entry = Entry(gid, group.policy_version, body if keep else group.model_dump_json().encode())
    S.pending[gid] = fut = JOURNAL.append(entry.raw)
    try:
        await fut
        S.seen.add(gid)  # before anything else runs: a duplicate waiting on `fut` must see it
    finally:
        del S.pending[gid]
    async with S.cond:
        S.buffer[gid] = entry
        S.counters["groups_accepted"] += 1
        w["groups"] += 1
        w["recent"].append(time.time())
        S.cond.notify_all()
    return SubmitResponse(status="accepted", duplicate=False, buffer_size=len(S.buffer))

class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a mistake worth a 422

class LeaseRequest(Strict):
    num_groups: int = Field(ge=1, le=1024)
    wait_s: float = Field(default=0.0, ge=0.0, le=300.0)

class LeaseResponse(BaseModel):
    batch_id: str | None
    groups: list[TrajectoryGroup]
    latest_version: int
    buffer_size: int
    dropped_stale: int

def lease_answer(bid: str | None, entries: list[Entry], dropped: int) -> Response:
    # the groups go out as the bytes we logged: no parse, no re-serialisation of 33 kB per group
    head = json.dumps({"batch_id": bid, "latest_version": S.latest, "buffer_size": len(S.buffer), "dropped_stale": dropped})
    return Response(head[:-1].encode() + b', "groups": [' + b",".join(e.raw for e in entries) + b"]}", media_type="application/json")

@app.post("/v1/batches/lease", response_model=LeaseResponse)
async def lease_batch(req: LeaseRequest) -> Response:
    """The oldest `num_groups` fresh-enough groups, waiting up to `wait_s` for them to arrive;
    an empty answer (batch_id null) if they did not."""
    async with S.cond:
        before = S.counters["groups_dropped_stale"]
        if not await wait_until(lambda: expire_leases(time.time()) or len(S.buffer) >= req.num_groups, req.wait_s):
            return lease_answer(None, [], S.counters["groups_dropped_stale"] - before)
        entries = [S.buffer.popitem(last=False)[1] for _ in range(req.num_groups)]
        bid = uuid.uuid4().hex
        S.leases[bid] = Lease(bid, entries, time.time() + ARGS.lease_s)
        fut = JOURNAL.append({"t": "lease", "batch_id": bid, "group_ids": [e.gid for e in entries],
                              "expires_at": S.leases[bid].expires_at})
    try:
        await fut  # the trainer must be able to ack this batch after a restart
    except HTTPException:  # the write failed: undo, so that nothing changed
        async with S.cond:
            if S.leases.pop(bid, None) is not None:
                to_front(entries)
                S.cond.notify_all()
        raise
    S.counters["groups_leased"] += len(entries)
    S.counters["batches_leased"] += 1
    for e in entries:
        s = S.latest - e.version
        S.staleness_hist[s] = S.staleness_hist.get(s, 0) + 1
        STALENESS.observe(s)
    return lease_answer(bid, entries, S.counters["groups_dropped_stale"] - before)

@app.post("/v1/batches/{batch_id}/ack")
async def ack_batch(batch_id: str = Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")) -> dict:
    """The trainer took its optimizer step on this batch: its groups are consumed for good."""
    async with S.cond:
        if batch_id in S.acked:
            raise HTTPException(409, f"batch {batch_id} was already acked")
        if batch_id in S.expired:
            raise HTTPException(410, f"lease of batch {batch_id} expired; its groups went back to the buffer")
        lease = S.leases.pop(batch_id, None)
        if lease is None:
            raise HTTPException(404, f"no open lease with batch_id {batch_id}")
        S.acked.add(batch_id)
        fut = JOURNAL.append({"t": "ack", "batch_id": batch_id})
    try:
        await fut
    except HTTPException:
        S.acked.discard(batch_id)
        S.leases[batch_id] = lease
        raise
    S.counters["groups_acked"] += len(lease.entries)
    S.counters["batches_acked"] += 1
    return {"acked": len(lease.entries)}

class RegisterRequest(Strict):
    version: int = Field(ge=1, le=10**9)
    step: int = Field(ge=0, le=10**12)
    published_at: float = Field(ge=0, le=1e11)
    final: bool = False
    """the trainer is done: workers stop after this version"""

@app.post("/v1/adapters")
async def register_adapter(req: RegisterRequest) -> dict:
    """Register a version the trainer has published to the bucket (monotonic, else 409)."""
    async with REGISTER_LOCK:  # check, verify, journal, then apply: no one sees a version that may not stick
        if req.version <= S.latest:
            raise HTTPException(409, f"version {req.version} is not newer than the latest {S.latest}")
        if BUCKET is not None:
            meta = await asyncio.to_thread(BUCKET.get_json, f"adapters/v{req.version:06d}/meta.json")
            if meta is None:
                raise HTTPException(422, f"version {req.version} has no meta.json in the bucket: publish it first")
        v = {"version": req.version, "step": req.step, "published_at": req.published_at}
        await JOURNAL.append({"t": "version", **v, "final": req.final})
        async with S.cond:
            S.versions.append(v)
            S.done = req.final
            dropped = drop_stale()
            S.cond.notify_all()
            return {"latest_version": S.latest, "dropped_stale": dropped}

@app.get("/v1/adapters/latest")
async def latest_adapter(after: int = Query(-1, ge=-1, le=10**9), wait_s: float = Query(0.0, ge=0.0, le=300.0)) -> dict:
    """The newest version; long-polls up to `wait_s` for one newer than `after`."""
    async with S.cond:
        await wait_until(lambda: S.latest > after or S.done, wait_s)
        return {**S.versions[-1], "done": S.done, "max_staleness": ARGS.max_staleness}

class PromptLeaseRequest(Strict):
    dataset: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.:/-]+$")
    size: int = Field(ge=1, le=1 << 22)
    n: int = Field(ge=1, le=4096)

@lru_cache(maxsize=8)
def permutation(dataset: str, size: int, epoch: int) -> list[int]:
    perm = list(range(size))
    random.Random(f"{ARGS.seed}:{dataset}:{epoch}").shuffle(perm)
    return perm

@app.post("/v1/prompts/lease")
async def lease_prompts(req: PromptLeaseRequest) -> dict:
    """`n` prompt indices from a per-epoch seeded shuffle of range(size): no index twice per epoch,
    across restarts too (the cursor is journaled before the indices are handed out)."""
    async with S.cond:
        if req.dataset not in S.cursors and len(S.cursors) >= MAX_DATASETS:
            raise HTTPException(409, f"this run already has {MAX_DATASETS} datasets")
        cur = S.cursors.setdefault(req.dataset, {"size": req.size, "epoch": 0, "pos": 0})
        if cur["size"] != req.size:
            raise HTTPException(409, f"dataset {req.dataset!r} has size {cur['size']} in this run, not {req.size}")
        out, epochs = [], []
        while len(out) < req.n:
            take = permutation(req.dataset, req.size, cur["epoch"])[cur["pos"]:cur["pos"] + req.n - len(out)]
            out += take
            epochs += [cur["epoch"]] * len(take)
            cur["pos"] += len(take)
            if cur["pos"] >= req.size:
                cur["epoch"], cur["pos"] = cur["epoch"] + 1, 0
        # the cursor moves ahead even if this write fails: skipping indices is fine, repeating is not
        fut = JOURNAL.append({"t": "cursor", "dataset": req.dataset, **cur})
    await fut
    return {"indices": out, "epochs": epochs}

@app.get("/v1/stats")
async def get_stats() -> dict:
    return stats()

@app.get("/metrics", response_class=Response)
async def metrics() -> Response:
    """Prometheus text exposition (scrape with the proxy token as a bearer token)."""
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

if __name__ == "__main__":
    import tyro
    import uvicorn

    from common import script_args  # drops the common.py that HF Jobs ships in argv
    ARGS = tyro.cli(Args, args=script_args())
    if not ARGS.token and ARGS.host not in ("127.0.0.1", "::1", "localhost"):  # any other address may be reachable
        raise SystemExit(f"refusing to listen on {ARGS.host} without a token: set PROXY_TOKEN or --token")
    sys.setswitchinterval(0.001)  # the journal writes from a thread: hand it the GIL back sooner (p99 -15% in A/B runs)
    uvicorn.run(app, host=ARGS.host, port=ARGS.port, log_level="warning")

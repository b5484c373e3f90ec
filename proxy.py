# /// script
# requires-python = ">=3.10"
# dependencies = [
#   "fastapi>=0.115", "uvicorn>=0.30", "pydantic>=2.7", "tyro>=0.9", "boto3>=1.36", "httpx>=0.27",
#   "tenacity>=8.2", "torch>=2.4", "prometheus-client>=0.20",
# ]
# ///
"""The coordinator of an async GRPO run: trajectory buffer with a staleness filter, batch leases,
prompt dispatch and the registry of published adapter versions. Workers and the trainer only
make outbound HTTP calls to it; it never calls them.

    python proxy.py --port 8000                      # loopback, token from PROXY_TOKEN
    hf jobs uv run --flavor cpu-upgrade --expose 8000 --timeout 6h --secrets PROXY_TOKEN \
        proxy.py common.py --host 0.0.0.0            # on Hugging Face Jobs (README)

API (v1, see README and /openapi.json): GET /health, POST /v1/groups, POST /v1/batches/lease,
POST /v1/batches/{id}/ack, POST /v1/adapters, GET /v1/adapters/latest, POST /v1/prompts/lease,
GET /v1/stats. Every endpoint but /health needs the proxy token (X-Proxy-Token or Bearer).
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
import random
import sys
import time
import uuid
from collections import OrderedDict, deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py beside this file
from fastapi import Depends, FastAPI, HTTPException, Query, Request  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from common import Bucket, Metrics, TrajectoryGroup, peak_rss_mb  # noqa: E402


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
    seed: int = 0
    """seed of the per-epoch prompt shuffle"""
    use_bucket: bool = True
    """verify registered versions in the bucket and write metrics there (needs BUCKET in env)"""


ARGS = Args()  # replaced by the CLI in __main__; tests start the real script as a process


# ---------------------------------------------------------------------------------------------
# state


@dataclass
class Lease:
    batch_id: str
    groups: list[dict]
    expires_at: float


@dataclass
class State:
    buffer: "OrderedDict[str, dict]" = field(default_factory=OrderedDict)  # group_id -> group (FIFO)
    seen: set = field(default_factory=set)          # every group_id ever accepted (idempotency)
    leases: dict = field(default_factory=dict)      # batch_id -> Lease
    acked: set = field(default_factory=set)         # batch ids acked
    expired: set = field(default_factory=set)       # batch ids whose lease ran out
    versions: list = field(default_factory=lambda: [{"version": 0, "step": 0, "published_at": None}])
    done: bool = False                              # the trainer registered its final version
    cursors: dict = field(default_factory=dict)     # dataset -> {size, epoch, pos}
    workers: dict = field(default_factory=dict)     # worker_id -> {last_seen, groups}
    counters: dict = field(default_factory=lambda: dict.fromkeys(
        ["groups_accepted", "groups_duplicate", "groups_dropped_stale", "groups_rejected_full",
         "groups_leased", "groups_acked", "batches_leased", "batches_acked", "leases_expired"], 0))
    staleness_hist: dict = field(default_factory=dict)  # staleness at lease -> groups
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)

    @property
    def latest(self) -> int:
        return self.versions[-1]["version"]


S = State()
BUCKET: Bucket | None = None
METRICS: Metrics | None = None


def drop_stale() -> int:
    """Remove groups staler than max_staleness from the buffer; returns how many."""
    stale = [gid for gid, g in S.buffer.items() if S.latest - g["policy_version"] > ARGS.max_staleness]
    for gid in stale:
        del S.buffer[gid]
    S.counters["groups_dropped_stale"] += len(stale)
    return len(stale)


def expire_leases(now: float) -> None:
    """Leases not acked in time give their groups back (to the front: they are the oldest)."""
    for bid in [b for b, lease in S.leases.items() if lease.expires_at <= now]:
        lease = S.leases.pop(bid)
        S.expired.add(bid)
        S.counters["leases_expired"] += 1
        for g in reversed(lease.groups):
            S.buffer[g["group_id"]] = g
            S.buffer.move_to_end(g["group_id"], last=False)
    drop_stale()


def stats() -> dict:
    now = time.time()
    return {"buffer_size": len(S.buffer), "latest_version": S.latest, "done": S.done,
            "open_leases": len(S.leases), "max_staleness": ARGS.max_staleness,
            "group_size": ARGS.group_size, "max_buffer": ARGS.max_buffer, **S.counters,
            "staleness_hist": {str(k): v for k, v in sorted(S.staleness_hist.items())},
            "workers": {w: {"last_seen_s_ago": round(now - d["last_seen"], 1), "groups": d["groups"]}
                        for w, d in S.workers.items()},
            "cursors": S.cursors, "peak_rss_mb": round(peak_rss_mb(), 1)}


# ---------------------------------------------------------------------------------------------
# app


async def _housekeeping() -> None:
    while True:
        await asyncio.sleep(1.0)
        async with S.cond:
            expire_leases(time.time())
        if METRICS is not None:
            st = stats()
            METRICS.log({"buffer/size": st["buffer_size"], "version": st["latest_version"],
                         **{f"proxy/{k}": st[k] for k in S.counters}})


@asynccontextmanager
async def lifespan(app: FastAPI):
    global BUCKET, METRICS
    if ARGS.use_bucket and os.environ.get("BUCKET"):
        BUCKET = Bucket()
        METRICS = Metrics(BUCKET, "proxy", flush_s=10.0)
    task = asyncio.create_task(_housekeeping())
    yield
    task.cancel()
    if METRICS is not None:
        METRICS.flush()


app = FastAPI(title="async-grpo proxy", version="1", lifespan=lifespan)


@app.exception_handler(RequestValidationError)
async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # field path + message, without echoing the input (it may hold NaN, which JSON cannot carry)
    return JSONResponse({"detail": [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]},
                        status_code=422)


@app.middleware("http")
async def limit_body(request: Request, call_next):
    # refuse oversized bodies before reading them (a declared length) or while reading (chunked)
    cap = int(ARGS.max_body_mb * 1024 * 1024)
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > cap):
        return JSONResponse({"detail": f"request body over {ARGS.max_body_mb} MB"}, status_code=413)
    return await call_next(request)


def require_token(request: Request) -> None:
    if not ARGS.token:
        return
    got = request.headers.get("x-proxy-token")
    if got is None:
        auth = request.headers.get("authorization", "")
        got = auth[7:] if auth.lower().startswith("bearer ") else None
    if got is None or not hmac.compare_digest(got.encode(), ARGS.token.encode()):
        raise HTTPException(401, "missing or wrong proxy token (X-Proxy-Token or Authorization: Bearer)",
                            headers={"WWW-Authenticate": "Bearer"})


AUTH = [Depends(require_token)]


@app.get("/health")
async def health() -> dict:
    return {"ok": True, "latest_version": S.latest}


class SubmitResponse(BaseModel):
    status: str  # accepted | duplicate | stale
    duplicate: bool
    buffer_size: int


@app.post("/v1/groups", dependencies=AUTH, response_model=SubmitResponse)
async def submit_group(group: TrajectoryGroup) -> SubmitResponse:
    """Submit one scored group. Idempotent on group_id; 429 with Retry-After when the buffer is full."""
    if len(group.completions) != ARGS.group_size:
        raise HTTPException(422, f"completions: {len(group.completions)} given, this run's group_size is {ARGS.group_size}")
    if len(group.prompt_ids) > ARGS.max_prompt_tokens:
        raise HTTPException(422, f"prompt_ids: {len(group.prompt_ids)} tokens > max_prompt_tokens {ARGS.max_prompt_tokens}")
    for i, c in enumerate(group.completions):
        if len(c.token_ids) > ARGS.max_completion_tokens:
            raise HTTPException(422, f"completions[{i}].token_ids: {len(c.token_ids)} tokens > {ARGS.max_completion_tokens}")
    async with S.cond:
        if group.group_id in S.seen:
            S.counters["groups_duplicate"] += 1
            return SubmitResponse(status="duplicate", duplicate=True, buffer_size=len(S.buffer))
        if group.policy_version > S.latest:
            raise HTTPException(409, f"policy_version {group.policy_version} is newer than the latest "
                                     f"registered version {S.latest}")
        w = S.workers.setdefault(group.worker_id, {"last_seen": 0.0, "groups": 0})
        w["last_seen"] = time.time()
        if S.latest - group.policy_version > ARGS.max_staleness:
            S.seen.add(group.group_id)
            S.counters["groups_dropped_stale"] += 1
            return SubmitResponse(status="stale", duplicate=False, buffer_size=len(S.buffer))
        if len(S.buffer) >= ARGS.max_buffer and drop_stale() == 0:
            S.counters["groups_rejected_full"] += 1
            raise HTTPException(429, f"buffer full ({ARGS.max_buffer} groups)", headers={"Retry-After": "1"})
        S.seen.add(group.group_id)
        S.buffer[group.group_id] = group.model_dump()
        S.counters["groups_accepted"] += 1
        w["groups"] += 1
        S.cond.notify_all()
        return SubmitResponse(status="accepted", duplicate=False, buffer_size=len(S.buffer))


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_groups: int = Field(ge=1, le=1024)
    wait_s: float = Field(default=0.0, ge=0.0, le=300.0)


class LeaseResponse(BaseModel):
    batch_id: str | None
    groups: list[dict]
    latest_version: int
    buffer_size: int
    dropped_stale: int


@app.post("/v1/batches/lease", dependencies=AUTH, response_model=LeaseResponse)
async def lease_batch(req: LeaseRequest) -> LeaseResponse:
    """The oldest `num_groups` fresh-enough groups, waiting up to `wait_s` for them to arrive;
    an empty answer (batch_id null) if they did not."""
    deadline = time.monotonic() + req.wait_s
    async with S.cond:
        before = S.counters["groups_dropped_stale"]
        while True:
            expire_leases(time.time())
            if len(S.buffer) >= req.num_groups:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return LeaseResponse(batch_id=None, groups=[], latest_version=S.latest, buffer_size=len(S.buffer),
                                     dropped_stale=S.counters["groups_dropped_stale"] - before)
            try:
                await asyncio.wait_for(S.cond.wait(), timeout=min(left, 1.0))
            except asyncio.TimeoutError:
                pass
        groups = [S.buffer.popitem(last=False)[1] for _ in range(req.num_groups)]
        bid = uuid.uuid4().hex
        S.leases[bid] = Lease(bid, groups, time.time() + ARGS.lease_s)
        S.counters["groups_leased"] += len(groups)
        S.counters["batches_leased"] += 1
        for g in groups:
            s = S.latest - g["policy_version"]
            S.staleness_hist[s] = S.staleness_hist.get(s, 0) + 1
        return LeaseResponse(batch_id=bid, groups=groups, latest_version=S.latest, buffer_size=len(S.buffer),
                             dropped_stale=S.counters["groups_dropped_stale"] - before)


@app.post("/v1/batches/{batch_id}/ack", dependencies=AUTH)
async def ack_batch(batch_id: str) -> dict:
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
        S.counters["groups_acked"] += len(lease.groups)
        S.counters["batches_acked"] += 1
        return {"acked": len(lease.groups)}


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=1, le=10**9)
    step: int = Field(ge=0, le=10**12)
    published_at: float = Field(ge=0, le=1e11)
    final: bool = False
    """the trainer is done: workers stop after this version"""


@app.post("/v1/adapters", dependencies=AUTH)
async def register_adapter(req: RegisterRequest) -> dict:
    """Register a version the trainer has published to the bucket (monotonic, else 409)."""
    async with S.cond:
        if req.version <= S.latest:
            raise HTTPException(409, f"version {req.version} is not newer than the latest {S.latest}")
    if BUCKET is not None:
        meta = await asyncio.to_thread(BUCKET.get_json, f"adapters/v{req.version:06d}/meta.json")
        if meta is None:
            raise HTTPException(422, f"version {req.version} has no meta.json in the bucket: publish it first")
    async with S.cond:
        if req.version <= S.latest:  # re-check: another registration may have won meanwhile
            raise HTTPException(409, f"version {req.version} is not newer than the latest {S.latest}")
        S.versions.append({"version": req.version, "step": req.step, "published_at": req.published_at})
        S.done = req.final
        dropped = drop_stale()
        S.cond.notify_all()
        return {"latest_version": S.latest, "dropped_stale": dropped}


@app.get("/v1/adapters/latest", dependencies=AUTH)
async def latest_adapter(after: int = Query(-1, ge=-1, le=10**9), wait_s: float = Query(0.0, ge=0.0, le=300.0)) -> dict:
    """The newest version; long-polls up to `wait_s` for one newer than `after`."""
    deadline = time.monotonic() + wait_s
    async with S.cond:
        while S.latest <= after and not S.done:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(S.cond.wait(), timeout=left)
            except asyncio.TimeoutError:
                break
        return {**S.versions[-1], "done": S.done, "max_staleness": ARGS.max_staleness}


class PromptLeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dataset: str = Field(min_length=1, max_length=200)
    size: int = Field(ge=1, le=10**8)
    n: int = Field(ge=1, le=4096)


@app.post("/v1/prompts/lease", dependencies=AUTH)
async def lease_prompts(req: PromptLeaseRequest) -> dict:
    """`n` prompt indices from a per-epoch seeded shuffle of range(size): no index twice per epoch."""
    async with S.cond:
        cur = S.cursors.setdefault(req.dataset, {"size": req.size, "epoch": 0, "pos": 0})
        if cur["size"] != req.size:
            raise HTTPException(409, f"dataset {req.dataset!r} has size {cur['size']} in this run, not {req.size}")
        out, epochs = [], []
        while len(out) < req.n:
            perm = list(range(req.size))
            random.Random(f"{ARGS.seed}:{req.dataset}:{cur['epoch']}").shuffle(perm)
            take = perm[cur["pos"]:cur["pos"] + req.n - len(out)]
            out += take
            epochs += [cur["epoch"]] * len(take)
            cur["pos"] += len(take)
            if cur["pos"] >= req.size:
                cur["epoch"], cur["pos"] = cur["epoch"] + 1, 0
        return {"indices": out, "epochs": epochs}


@app.get("/v1/stats", dependencies=AUTH)
async def get_stats() -> dict:
    async with S.cond:
        return stats()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


if __name__ == "__main__":
    import tyro
    import uvicorn

    from common import script_args  # drops the common.py that HF Jobs ships in argv
    ARGS = tyro.cli(Args, args=script_args())
    if not ARGS.token and not _is_loopback(ARGS.host):
        raise SystemExit(f"refusing to listen on {ARGS.host} without a token: set PROXY_TOKEN or --token")
    uvicorn.run(app, host=ARGS.host, port=ARGS.port, log_level="warning")

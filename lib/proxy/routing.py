"""Inference routing on the proxy: anyone with a token can query the policy being trained, while the
rollout workers keep making only outbound calls. proxy.py calls `install(app)`; nothing here imports it.

    curl -H "Authorization: Bearer $PROXY_TOKEN" -H "Content-Type: application/json" \
         -d '{"messages": [{"role": "user", "content": "What is 3 + 4?"}], "max_tokens": 16, "temperature": 0}' \
         http://127.0.0.1:8000/v1/chat/completions

1. A client posts an OpenAI-shaped chat request to `POST /v1/chat/completions`; it waits in a FIFO queue.
2. A serving worker (rollout.py, `--serve`, the default) takes up to a few requests between its rounds with
   `POST /v1/inference/lease` (a long-poll, like its prompt leases), generates with the adapter it
   serves, and posts the answers to `POST /v1/inference/answers`, each with that adapter's version (one the
   run registered: another is refused, 422). Only the run's own workers serve (an admin token: the run's
   PROXY_TOKEN, its jobs'): a request is another user's prompt, which a participant's worker may neither read
   nor answer (docs/trust.md); a participant's worker is refused (403) and stops asking.
3. The client gets an OpenAI `chat.completion` plus `adapter_version` and `worker_id` (and the header
   `X-Adapter-Version`).

Errors: 503 when no worker has asked for requests lately, 429 + Retry-After when the queue is full,
504 when nobody answered in time, 502 when the worker could not answer. A worker that takes a
request and goes silent loses it after `lease_s`: it goes back to the front of the queue once.

State is in memory only: a routed request lives for seconds, so nothing is journaled; a proxy
restart or a standby's takeover drops the waiting clients (they see the connection close and may retry) and
the workers' late answers are ignored (request ids are this process's own). A proxy that stops answering (a
leader unsure of its term, leadership.py, or one told to stop) answers its waiting clients 503 + Retry-After
within a second: no worker could take or answer their requests there any more (docs/proxy.md#a-standby).
Bounds (Limits: the proxy's --route.* options, `python proxy.py --help`): requests waiting or being answered, seconds per request, tokens per answer, characters per request (the proxy's
--max-body-mb caps the body before any of this), how long a worker may hold a request.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Literal

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from access import ADMIN, scope



@dataclass
class Limits:
    max_queue: int = 64
    """requests waiting or being answered; beyond it 429"""
    timeout_s: float = 300.0
    """a client waits this long for an answer, then 504 (a CPU worker may be mid-round for a while)"""
    max_tokens: int = 1024
    """max_tokens a client may ask for"""
    max_prompt_chars: int = 32768
    """characters over all messages of one request"""
    lease_s: float = 120.0
    """a worker that took a request must answer within this, else it is queued again (once)"""
    worker_ttl_s: float = 300.0
    """a worker counts as serving this long after it last asked for requests"""


LIMITS = Limits()  # the proxy's --route.* options (proxy.py sets them at start)
# why an answer's adapter_version cannot be one a worker served with (None: it can); proxy.py's install() passes
# the rule (a version the run registered, or 0), which needs its book
VERSION_PROBLEM: Callable[[int], str | None] = lambda version: None
# why this proxy answers nobody now (None: it serves); install() takes proxy.py's (a standby, or a leader unsure of its
# term): its gate then refuses the workers' leases and answers too, so a request waiting here can only time out
REFUSAL: Callable[[], str | None] = lambda: None
SERVE_WHY = ("routed requests are other users' prompts: only the run's own workers serve them, on its token; "
             "start the worker with --no-serve")
MAX_WORKERS = 4096  # serving workers we remember (client-chosen names: bounded)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a mistake worth a 422


# ---- the client's request: the OpenAI chat body, minus what we cannot honour (refused by name) --------

class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=1 << 20)


class ChatRequest(Strict):
    messages: list[Message] = Field(min_length=1, max_length=64)
    model: str | None = Field(default=None, max_length=200)
    """ignored: the run's live policy answers, whatever the name"""
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    n: Literal[1] = 1
    """one answer per request"""
    stream: Literal[False] = False
    """no streaming: the answer comes whole"""
    user: str | None = Field(default=None, max_length=200)

    @model_validator(mode="after")
    def _bounds(self) -> "ChatRequest":
        chars = sum(len(m.content) for m in self.messages)
        if chars > LIMITS.max_prompt_chars:
            raise ValueError(f"messages hold {chars} characters, this proxy's limit is {LIMITS.max_prompt_chars}")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > 4 or any(not s or len(s) > 64 for s in stops):
            raise ValueError("stop: at most 4 sequences of 1 to 64 characters")
        return self

    def for_worker(self) -> dict:
        """What a worker needs, normalised: every field present, stop as a list."""
        wanted = self.max_completion_tokens or self.max_tokens or min(256, LIMITS.max_tokens)
        if wanted > LIMITS.max_tokens:
            raise HTTPException(422, f"max_tokens {wanted} is over this proxy's limit {LIMITS.max_tokens}")
        return {"messages": [m.model_dump() for m in self.messages], "max_tokens": wanted,
                "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or [])}


# ---- the worker's side ---------------------------------------------------------------------------------

WorkerId = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")


class LeaseRequest(Strict):
    worker_id: str = WorkerId
    max_requests: int = Field(default=1, ge=1, le=64)
    wait_s: float = Field(default=0.0, ge=0.0, le=60.0)


class Answer(Strict):
    request_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    adapter_version: int = Field(ge=0, le=10**9)
    """the adapter version that produced the answer (0: the base model)"""
    text: str | None = Field(default=None, max_length=1 << 20)
    finish_reason: Literal["stop", "length"] | None = None
    prompt_tokens: int | None = Field(default=None, ge=0, le=1 << 24)
    completion_tokens: int | None = Field(default=None, ge=0, le=1 << 24)
    error: str | None = Field(default=None, max_length=2000)
    """set instead of the rest when the worker could not answer"""

    @model_validator(mode="after")
    def _either(self) -> "Answer":
        fields = (self.text, self.finish_reason, self.prompt_tokens, self.completion_tokens)
        if not (None not in fields if self.error is None else fields == (None,) * 4):
            raise ValueError("an answer has either error, or text, finish_reason, prompt_tokens and completion_tokens")
        return self


class AnswersRequest(Strict):
    worker_id: str = WorkerId
    answers: list[Answer] = Field(min_length=1, max_length=64)


# ---- state ---------------------------------------------------------------------------------------------

@dataclass
class Routed:
    id: str
    body: dict
    deadline: float                       # time.monotonic() after which the client has its 504
    future: asyncio.Future
    leased_by: str | None = None
    lease_until: float = 0.0
    attempts: int = 0


@dataclass
class Queue:
    waiting: "OrderedDict[str, Routed]" = field(default_factory=OrderedDict)  # FIFO
    leased: dict = field(default_factory=dict)                                # request id -> Routed
    workers: "OrderedDict[str, float]" = field(default_factory=OrderedDict)   # worker -> last lease call (monotonic)
    counters: dict = field(default_factory=lambda: dict.fromkeys(
        ["requests", "answered", "worker_errors", "timed_out", "abandoned", "rejected_full", "rejected_no_worker",
         "requeued", "late_answers", "dropped_not_serving"], 0))
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)

    def size(self) -> int:
        return len(self.waiting) + len(self.leased)

    def serving(self, now: float) -> int:
        return sum(now - t < LIMITS.worker_ttl_s for t in self.workers.values())

    def seen(self, worker: str, now: float) -> None:
        self.workers.pop(worker, None)
        self.workers[worker] = now
        if len(self.workers) > MAX_WORKERS:
            self.workers.popitem(last=False)

    def forget(self, rid: str) -> None:
        self.waiting.pop(rid, None)
        self.leased.pop(rid, None)

    def expire(self, now: float) -> None:
        """Leases nobody answered in time: back to the front of the queue once, then an error."""
        for r in [r for r in self.leased.values() if r.lease_until <= now]:
            del self.leased[r.id]
            if r.future.done():
                continue
            if r.attempts < 2 and now < r.deadline:
                self.counters["requeued"] += 1
                self.waiting[r.id] = r
                self.waiting.move_to_end(r.id, last=False)
            else:
                r.future.set_result({"error": f"worker {r.leased_by} took the request and did not answer within "
                                              f"{LIMITS.lease_s:.0f} s", "worker_id": r.leased_by})


Q = Queue()


def stats() -> dict:
    now = time.monotonic()
    return {"waiting": len(Q.waiting), "being_answered": len(Q.leased), **Q.counters,
            "serving_workers": {w: round(now - t, 1) for w, t in Q.workers.items() if now - t < LIMITS.worker_ttl_s},
            "limits": vars(LIMITS)}


# ---- routes --------------------------------------------------------------------------------------------

async def chat_completions(req: ChatRequest, request: Request) -> JSONResponse:
    """Ask the live policy: answered by a serving worker with its current adapter; the answer says which version."""
    body, now = req.for_worker(), time.monotonic()
    if not Q.serving(now):
        Q.counters["rejected_no_worker"] += 1
        raise HTTPException(503, f"no worker is serving inference for this run (none asked for requests in the last "
                                 f"{LIMITS.worker_ttl_s:.0f} s); rollout workers serve unless started with --no-serve",
                            headers={"Retry-After": "10"})
    if Q.size() >= LIMITS.max_queue:
        Q.counters["rejected_full"] += 1
        raise HTTPException(429, f"inference queue full ({LIMITS.max_queue} requests)", headers={"Retry-After": "2"})
    r = Routed(uuid.uuid4().hex, body, now + LIMITS.timeout_s, asyncio.get_running_loop().create_future())
    Q.counters["requests"] += 1
    async with Q.cond:
        Q.waiting[r.id] = r
        Q.cond.notify_all()
    try:
        # in one-second slices: expire silent workers' leases, and notice a client that went away
        while not r.future.done():
            if time.monotonic() >= r.deadline:
                Q.counters["timed_out"] += 1
                raise HTTPException(504, f"no worker answered within {LIMITS.timeout_s:.0f} s "
                                         f"({len(Q.waiting)} request(s) waiting, {Q.serving(time.monotonic())} worker(s) serving)")
            if await request.is_disconnected():
                Q.counters["abandoned"] += 1
                return JSONResponse({"detail": "client went away"}, status_code=499)
            if (why := REFUSAL()) is not None:
                Q.counters["dropped_not_serving"] += 1
                raise HTTPException(503, f"{why}: this request was not answered, send it again",
                                    headers={"Retry-After": "1"})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(r.future), timeout=1.0)
            Q.expire(time.monotonic())
    finally:
        Q.forget(r.id)
    a = r.future.result()
    if a.get("error") is not None:
        Q.counters["worker_errors"] += 1
        raise HTTPException(502, f"worker {a.get('worker_id')} could not answer: {a['error']}")
    Q.counters["answered"] += 1
    out = {"id": f"chatcmpl-{r.id}", "object": "chat.completion", "created": int(time.time()),
           "model": req.model or "policy",
           "choices": [{"index": 0, "message": {"role": "assistant", "content": a["text"]}, "finish_reason": a["finish_reason"]}],
           "usage": {"prompt_tokens": a["prompt_tokens"], "completion_tokens": a["completion_tokens"],
                     "total_tokens": a["prompt_tokens"] + a["completion_tokens"]},
           "adapter_version": a["adapter_version"], "worker_id": a["worker_id"]}
    return JSONResponse(out, headers={"X-Adapter-Version": str(a["adapter_version"])})


def worker_key(request: Request, worker_id: str) -> str:
    """`participant/worker_id` (the run's own jobs, on the admin token: `worker_id`), as participants.py keys
    workers: a participant can neither answer nor take over requests leased to another's worker."""
    who = request.scope["principal"]
    return worker_id if who.name == ADMIN else f"{who.name}/{worker_id}"


async def lease_requests(req: LeaseRequest, request: Request) -> dict:
    """A serving worker takes up to `max_requests` queued requests, waiting up to `wait_s` for one."""
    deadline, worker = time.monotonic() + req.wait_s, worker_key(request, req.worker_id)
    async with Q.cond:
        Q.seen(worker, time.monotonic())
        while True:
            Q.expire(time.monotonic())
            if Q.waiting or (left := deadline - time.monotonic()) <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(Q.cond.wait(), timeout=min(left, 1.0))
        now, out = time.monotonic(), []
        Q.seen(worker, now)  # a worker that long-polled is serving until the poll ends
        while Q.waiting and len(out) < req.max_requests:
            _, r = Q.waiting.popitem(last=False)
            if r.future.done() or now >= r.deadline:
                continue
            r.leased_by, r.lease_until, r.attempts = worker, min(r.deadline, now + LIMITS.lease_s), r.attempts + 1
            Q.leased[r.id] = r
            out.append({"request_id": r.id, **r.body})
    return {"requests": out}


async def post_answers(req: AnswersRequest, request: Request) -> dict:
    """A worker's answers. One it no longer holds (timed out, or taken over) is counted and ignored, unless
    the request is still waiting for someone: then the late answer is as good as any."""
    accepted, unknown, worker = 0, [], worker_key(request, req.worker_id)
    if wrong := [f"answer {a.request_id}: {why}" for a in req.answers if (why := VERSION_PROBLEM(a.adapter_version))]:
        raise HTTPException(422, "; ".join(wrong[:4]) + ": nothing of this post was taken")
    for a in req.answers:
        r = Q.leased.get(a.request_id)
        if r is None or r.leased_by != worker:
            r = Q.waiting.get(a.request_id)
        if r is None or r.future.done():
            Q.counters["late_answers"] += 1
            unknown.append(a.request_id)
            continue
        Q.forget(r.id)
        r.future.set_result({**a.model_dump(), "worker_id": worker})
        accepted += 1
    return {"accepted": accepted, "unknown": unknown}


async def inference_stats() -> dict:
    return stats()


def install(app, version_problem: Callable[[int], str | None], refusal: Callable[[], str | None]) -> None:
    """Add the routes to `app`, each with the least token role that may call it (access.py): clients of the
    policy need `inference`, the workers that take and answer requests `admin` (the run's own). version_problem(v):
    why an answer's adapter_version is not one the run registered (None: it is); refusal(): why this proxy answers
    nobody now (None: it serves), which ends the clients' waits. On the app itself, not an included APIRouter:
    FastAPI matches those lazily, at a cost on every request (access.install)."""
    global VERSION_PROBLEM, REFUSAL
    VERSION_PROBLEM, REFUSAL = version_problem, refusal
    # a request's prompt (up to max_prompt_chars, 4 bytes each in UTF-8) and a batch of answers (max_tokens
    # each) can be well over the 64 KiB every other small route gets: these two take bodies up to
    # --max-body-mb, and their schemas bound what is in them
    for method, path, endpoint, role, large in [
            ("POST", "/v1/chat/completions", chat_completions, "inference", True),
            ("GET", "/v1/inference/stats", inference_stats, "inference", False),
            ("POST", "/v1/inference/lease", lease_requests, "admin", False),
            ("POST", "/v1/inference/answers", post_answers, "admin", True)]:
        why = SERVE_WHY if role == "admin" else None
        app.add_api_route(path, endpoint, methods=[method], openapi_extra=scope(role, large_body=large, why=why),
                          tags=["inference"])

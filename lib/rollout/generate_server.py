"""The worker's token-level generate endpoint on loopback: vLLM's `POST /inference/v1/generate` (token ids in,
sampled token ids and their logprobs out), served by the worker's own engine, so that an environment library
that runs its own episode loop (verifiers' train client, which renders prompts to token ids with its
`renderers`) generates with exactly the weights the worker serves, and the worker knows exactly what was
sampled. Every backend answers it through its engine's `generate_ids` (`server`: the server's own completions route,
as its episodes' later turns are).

Every call is recorded by the caller's `X-Session-ID` (verifiers sends its trace id): prompt ids, sampled
ids, behaviour logprobs, finish reason, the adapter version and the temperature, in order, so an episode is
rebuilt from what the engine did, not from what the library says it did (`episode_of`); the caller takes its
sessions' calls and drops the rest once its episodes are over (`Calls.drop_all`). The engine samples from the
model's whole distribution at the temperature, which is what the behaviour logprob is of: a call asking for
anything else (top_p, top_k, penalties, a temperature the trainer cannot score at) is refused with a 400 that
says so (`sampling_problem`); a seed, which leaves the distribution as it is, is served but not honoured, and the
worker's log says so once (`not_honoured`). Requests that arrive together are generated together (one batch of the engine);
the server binds 127.0.0.1 and wants a random key (Bearer), so no other process on the machine can drive the
engine.

    GET  /v1/models                 {"data": [{"id": MODEL, "max_model_len": N}]}
    POST /inference/v1/generate     {"model", "token_ids": [...], "sampling_params": {"max_tokens",
                                    "temperature", "stop_token_ids", "logprobs"}} ->
                                    {"request_id", "prompt_token_ids", "choices": [{"index": 0, "token_ids",
                                    "logprobs": {"content": [{"token": "token_id:N", "logprob"}]}, "finish_reason"}]}
"""
from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, HTTPException, Request  # at module level: the routes' annotations are resolved by name

from common import temperature_problem

log = logging.getLogger("rollout")  # the worker's log
NO_SESSION = "-"
# sampling parameters that change the distribution sampled from (or what is sampled), and the values that leave it
# as the engine samples it: the model's whole distribution at the temperature, no other stop than stop_token_ids
NEUTRAL = {"top_p": (1, None), "top_k": (-1, 0, None), "min_p": (0, None), "repetition_penalty": (1, None),
           "presence_penalty": (0, None), "frequency_penalty": (0, None), "n": (1, None), "best_of": (1, None),
           "min_tokens": (0, None), "ignore_eos": (False, None), "logit_bias": ({}, None), "stop": ([], "", None),
           "bad_words": ([], None), "allowed_token_ids": ([], None), "use_beam_search": (False, None)}


def neutral(v, values: tuple) -> bool:
    """v is one of `values` (None and booleans by identity: True is no top_k of 1)."""
    return any(v is o if o is None or isinstance(o, bool) else not isinstance(v, bool) and v == o for o in values)


def sampling_problem(sp: dict) -> str | None:
    """Why the engine cannot sample as `sp` (vLLM's sampling_params) asks (None: it can): a temperature the trainer
    cannot score a group at, or a parameter other than its neutral value, which the engine would not apply, so the
    tokens would come from another distribution than the one asked for (and their behaviour logprobs too)."""
    t = sp.get("temperature", 1.0)
    if why := temperature_problem(t):
        return f"temperature {why}: the trainer scores a group at the temperature it was sampled at"
    bad = [f"{k}={sp[k]!r}" for k, ok in NEUTRAL.items() if k in sp and not neutral(sp[k], ok)]
    if bad:
        return (f"{', '.join(bad)}: the worker samples from the model's whole distribution at the temperature only "
                f"(the behaviour logprob must be of the distribution sampled from); leave {'them' if len(bad) > 1 else 'it'} "
                f"unset")
    return None


def not_honoured(sp: dict) -> str | None:
    """What in `sp` the engine leaves undone without changing the distribution sampled from (None: nothing): a seed.
    The call is served (its tokens and behaviour logprobs are still of the distribution asked for); the caller is told
    once, since an environment that sets a seed expects samples it can reproduce."""
    if sp.get("seed") is None:
        return None
    return (f"seed={sp['seed']!r} is not honoured: the worker samples each batch of calls from one random stream, so a "
            f"call's seed does not make its sample reproducible (the distribution and the behaviour logprobs are "
            f"unchanged)")


@dataclass
class Call:
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    finish: str
    version: int
    temperature: float = 1.0


@dataclass
class Calls:
    """The calls of each session, in order (thread-safe)."""
    by_session: dict[str, list[Call]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, session: str, call: Call) -> None:
        with self.lock:
            self.by_session.setdefault(session, []).append(call)

    def take(self, session: str) -> list[Call]:
        with self.lock:
            return self.by_session.pop(session, [])

    def drop_all(self) -> tuple[int, int]:
        """Forget every session not taken (a trace the caller does not train: another agent's, one made outside an
        episode, a late call of one that is over), so the record holds one round's calls at most; (sessions, calls)
        dropped."""
        with self.lock:
            dropped, self.by_session = self.by_session, {}
        return len(dropped), sum(map(len, dropped.values()))


def episode_of(calls: list[Call], prompt: list[int]) -> tuple[list[int], list[int], list[float | None], list[list[int]], str | None]:
    """An episode after `prompt` from a session's calls: (tokens, mask, logprobs, versions, drift). Call k+1's prompt
    must extend call k's prompt and sampled tokens (what it adds is the environment's, mask 0); where it does not,
    the library re-rendered the history differently from what was sampled (drift) and the episode ends there."""
    tokens, mask, lps, versions = [], [], [], []
    seq = list(prompt)
    for k, c in enumerate(calls):
        if c.prompt_ids[:len(seq)] != seq:
            i = next((j for j, (a, b) in enumerate(zip(c.prompt_ids, seq)) if a != b), min(len(seq), len(c.prompt_ids)))
            return tokens, mask, lps, versions, (f"call {k + 1}'s prompt does not extend what was sampled before it: they "
                                                 f"part at token {i} of {len(seq)}")
        env = c.prompt_ids[len(seq):]
        tokens += env + c.ids
        mask += [0] * len(env) + [1] * len(c.ids)
        lps += [None] * len(env) + list(c.logprobs)
        if c.ids and (not versions or versions[-1][1] != c.version):
            versions.append([len(tokens) - len(c.ids), c.version])
        seq = c.prompt_ids + c.ids
    return tokens, mask, lps, versions, None


class GenerateServer:
    """`generate(seqs, max_new, temperature, stop_ids) -> [(ids, logprobs, finish)]` served on loopback."""

    def __init__(self, generate, model: str, max_model_len: int, version=lambda: 0, batch_wait_s: float = 0.02):
        self.generate, self.model, self.max_model_len, self.version = generate, model, max_model_len, version
        self.key = secrets.token_urlsafe(24)
        self.calls = Calls()
        self.queue: list[tuple[dict, str, threading.Event, dict]] = []
        self.cv = threading.Condition()
        self.batch_wait_s = batch_wait_s
        self.errors = 0
        self.told = False  # not_honoured said once: a seed per call would say it on every call

    # -- the engine's side: one thread takes what is queued and generates it as one batch --------------

    def serve_batches(self, should_stop) -> None:
        """Run in the thread that owns the engine (rollout.py's main thread, while a library's loop runs)."""
        while not should_stop():
            with self.cv:
                if not self.queue:
                    self.cv.wait(0.1)
                    continue
            time.sleep(self.batch_wait_s)  # let the rest of a burst arrive: one batch for the G episodes in flight
            with self.cv:
                batch, self.queue = self.queue, []
            by_t: dict[float, list] = {}
            for item in batch:
                by_t.setdefault(float(item[0]["temperature"]), []).append(item)
            for t, items in by_t.items():
                try:
                    got = self.generate([i[0]["token_ids"] for i in items], [i[0]["max_tokens"] for i in items], t,
                                        set().union(*[i[0]["stop"] for i in items]))
                except Exception as e:  # noqa: BLE001 - the caller gets a 500 naming it; the worker goes on
                    got = [e] * len(items)
                for (req, session, done, out), g in zip(items, got):
                    out["result"] = g
                    done.set()

    def _submit(self, req: dict, session: str):
        done, out = threading.Event(), {}
        with self.cv:
            self.queue.append((req, session, done, out))
            self.cv.notify()
        done.wait()
        return out["result"]

    # -- HTTP -------------------------------------------------------------------------------------------

    def app(self) -> FastAPI:
        app = FastAPI()

        def check(request: Request) -> None:
            if request.headers.get("authorization") != f"Bearer {self.key}":
                raise HTTPException(401, "this generate endpoint takes the worker's key only")

        @app.get("/health")
        def health():
            return {"ok": True}

        @app.get("/v1/models")
        def models(request: Request):
            check(request)
            return {"object": "list", "data": [{"id": self.model, "object": "model", "max_model_len": self.max_model_len}]}

        @app.post("/inference/v1/generate")
        async def generate(request: Request):
            import asyncio
            check(request)
            body = await request.json()
            ids, sp = body.get("token_ids"), body.get("sampling_params") or {}
            if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
                raise HTTPException(422, "token_ids: a non-empty list of token ids")
            room = self.max_model_len - len(ids)
            max_tokens = sp.get("max_tokens") or room
            if room < 1 or not isinstance(max_tokens, int) or max_tokens < 1:
                raise HTTPException(400, f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
            if why := sampling_problem(sp):
                self.errors += 1
                raise HTTPException(400, f"cannot sample as asked: {why}")
            if not self.told and (said := not_honoured(sp)):
                self.told = True
                log.warning(f"loopback generate: {said}")
            req = {"token_ids": ids, "max_tokens": min(max_tokens, room), "temperature": float(sp.get("temperature", 1.0)),
                   "stop": set(sp.get("stop_token_ids") or [])}
            session = request.headers.get("x-session-id") or NO_SESSION
            got = await asyncio.to_thread(self._submit, req, session)
            if isinstance(got, Exception):
                self.errors += 1
                raise HTTPException(500, f"generation failed: {type(got).__name__}: {got}")
            out, lps, fin = got
            self.calls.add(session, Call(list(ids), list(out), list(lps), fin, self.version(), req["temperature"]))
            return {"request_id": body.get("request_id") or uuid.uuid4().hex, "model": self.model,
                    "prompt_token_ids": ids, "output_mode": "tokens",
                    "choices": [{"index": 0, "token_ids": out, "finish_reason": fin,
                                 "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None,
                                                           "top_logprobs": []} for t, lp in zip(out, lps)]}}],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)}}

        return app

    def start(self) -> str:
        """Serve on a free loopback port in a thread; returns the base URL."""
        import uvicorn
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=self.uvicorn.run, daemon=True).start()
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    return url
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError(f"the loopback generate endpoint did not come up at {url}")

    def stop(self) -> None:
        self.uvicorn.should_exit = True

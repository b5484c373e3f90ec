"""Who may call the proxy, and what: scoped tokens per participant, their storage in the bucket, rate
limits, and the ASGI guard that checks all of it before a request body is read.

Roles, each allowed what the one before it may do, and more:

    inference  ask the policy being trained (POST /v1/chat/completions, routing.py), and nothing else
    worker   lease prompts, submit groups, read adapter versions and their files
    trainer  also lease, renew and ack batches, register versions, read /v1/stats and /metrics
    admin    everything, including creating, limiting and revoking tokens, and serving routed requests (the
             run's own workers, on its PROXY_TOKEN: a routed request is another user's prompt, not a participant's
             to read or answer)

The run's PROXY_TOKEN is the admin token (the launcher's own jobs use it). Participant tokens are
created through `POST /v1/tokens` (or `bash launch_jobs.sh --token-create NAME --role worker`); the
bucket keeps only their sha256, in `access/tokens.json` under the run, so they survive proxy restarts
and a leaked bucket listing leaks no token. A token is 256 random bits, so a plain sha256 is as good
as a slow hash here (there is nothing to brute-force).

Each route declares its role in one place, its decorator: `@app.post(path, openapi_extra=scope("worker"))`
(`large_body=True` for the routes that take big bodies: groups, chat requests, routed answers); a route without a declaration needs the
admin token. A module that adds routes declares them the same way and adds them to the app itself
(`install(app)`, as here): FastAPI 0.16x matches an included APIRouter's routes lazily, at a cost on
every request.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Annotated, Literal

from fastapi import HTTPException, Path
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from common import PROTOCOL, Bucket, ConflictError


class Role(IntEnum):
    inference = 1
    worker = 2
    trainer = 3
    admin = 4


OPEN_PATHS = ("/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")  # no token, no body
NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")  # participant names: they appear in logs, stats and the journal
ADMIN = "admin"  # the name the run's PROXY_TOKEN goes by
TOKEN_REFUSED = "X-Token-Refused"  # on a refusal of the token itself, whatever the route: "revoked" or "quarantined"


def scope(role: str, large_body: bool = False, why: str | None = None) -> dict:
    """A route's declaration, as its `openapi_extra`: the least role that may call it ("open": anyone,
    and no body), whether it takes bodies up to the proxy's --max-body-mb (else 64 KiB), and why a lesser role
    may not (said in the 403, where the role alone does not explain it)."""
    assert role == "open" or role in Role.__members__, role
    return {"x-role": role, **({"x-large-body": True} if large_body else {}), **({"x-why": why} if why else {})}


def token_hash(token: str | bytes) -> str:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).hexdigest()


@dataclass
class Participant:
    name: str
    role: Role
    sha256: str
    created_at: float
    max_rps: float = 0.0
    """requests per second across all routes (0: no limit); bursts up to twice that"""
    revoked_at: float | None = None
    workers: int = 1
    """the most live workers its share of each batch counts (shares.py): worker ids are its own labels, so the
    number of workers it runs is the owner's to grant, not the participant's to claim"""
    allowance: float = field(default=0.0, repr=False)   # the token bucket of the rate limit
    last: float = field(default=0.0, repr=False)

    def public(self) -> dict:
        return {"name": self.name, "role": self.role.name, "max_rps": self.max_rps, "workers": self.workers,
                "created_at": self.created_at, "revoked_at": self.revoked_at}

    def stored(self) -> dict:
        d = asdict(self)
        d["role"] = self.role.name
        del d["name"], d["allowance"], d["last"]
        return d


class TokenError(RuntimeError):
    """A token operation that cannot be done as asked (status: the HTTP answer it maps to)."""

    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


class Tokens:
    """The run's participants. Lookups are in memory; every change is written to the bucket first (a
    conditional put of the whole file) and applied after, so what answers saw is what a restart loads."""

    KEY = "access/tokens.json"

    def __init__(self, bucket: Bucket | None, admin_token: str | None):
        self.bucket = bucket
        self.admin = Participant(ADMIN, Role.admin, token_hash(admin_token or ""), 0.0)
        self.admin_token = (admin_token or "").encode()
        self.by_name: dict[str, Participant] = {}
        self.by_hash: dict[str, Participant] = {}
        self.etag: str | None = None
        self.lock = asyncio.Lock()

    def load(self) -> None:
        got = self.bucket.get(self.KEY) if self.bucket is not None else None
        if got is not None:
            self.etag = got[1]
            for name, d in json.loads(got[0])["tokens"].items():
                self._add(Participant(name, Role[d["role"]], d["sha256"], d["created_at"], d.get("max_rps", 0.0),
                                      d.get("revoked_at"), workers=d.get("workers", 1)))

    def _add(self, p: Participant) -> None:
        self.by_name[p.name] = p
        self.by_hash[p.sha256] = p

    def authenticate(self, presented: bytes | None) -> Participant | None:
        """The participant whose token this is (revoked ones too: the guard says so), or None. The admin
        token is compared in constant time; participants are looked up by the sha256 of what was sent, so
        a timing difference could only tell an attacker about a hash of their own guess."""
        if not presented:
            return None
        if not self.admin_token:  # no token configured: a loopback-only proxy (proxy.py refuses otherwise)
            return self.admin
        if hmac.compare_digest(presented, self.admin_token):
            return self.admin
        digest = token_hash(presented)
        p = self.by_hash.get(digest)
        return p if p is not None and hmac.compare_digest(p.sha256, digest) else None

    def throttle(self, p: Participant) -> float:
        """0 when `p` may make a request now (and count it), else the seconds until it may."""
        if not p.max_rps:
            return 0.0
        now, cap = time.monotonic(), max(1.0, 2 * p.max_rps)
        p.allowance = min(cap, p.allowance + (now - p.last) * p.max_rps) if p.last else cap
        p.last = now
        if p.allowance >= 1.0:
            p.allowance -= 1.0
            return 0.0
        return (1.0 - p.allowance) / p.max_rps

    # --- changes (admin only): written to the bucket, then applied -----------------------------------
    async def create(self, name: str, role: Role, max_rps: float, workers: int = 1) -> tuple[Participant, str]:
        if name == ADMIN or not NAME.match(name):
            raise TokenError(422, f"name {name!r}: 1-40 of a-z, 0-9, '-', '_', starting with a letter or digit; "
                                  f"not {ADMIN!r}")
        async with self.lock:
            if name in self.by_name:  # names are never reused: the journal's records stay unambiguous
                raise TokenError(409, f"participant {name!r} already exists (revoked or not); pick another name")
            token = "agrpo_" + secrets.token_urlsafe(32)
            p = Participant(name, role, token_hash(token), round(time.time(), 3), max_rps, workers=workers)
            await self._save({**self.by_name, name: p})
            self._add(p)
            return p, token

    async def update(self, name: str, max_rps: float | None = None, revoke: bool = False,
                     workers: int | None = None) -> Participant:
        async with self.lock:
            old = self.by_name.get(name)
            if old is None:
                raise TokenError(404, f"no participant {name!r}")
            if old.revoked_at is not None:
                if revoke:
                    return old  # revoking twice changes nothing
                raise TokenError(409, f"participant {name!r} was revoked")
            new = Participant(old.name, old.role, old.sha256, old.created_at,
                              old.max_rps if max_rps is None else max_rps,
                              round(time.time(), 3) if revoke else None, old.workers if workers is None else workers,
                              old.allowance, old.last)
            await self._save({**self.by_name, name: new})
            self._add(new)
            return new

    async def _save(self, table: dict[str, Participant]) -> None:
        if self.bucket is None:
            return
        data = json.dumps({"tokens": {n: p.stored() for n, p in table.items()}}, indent=1).encode()
        kw = {"if_match": self.etag} if self.etag else {"if_none_match": True}
        try:
            self.etag = await asyncio.to_thread(self.bucket.put, self.KEY, data, **kw)
        except ConflictError:
            raise TokenError(409, f"{self.KEY} changed in the bucket meanwhile (another proxy?); nothing was "
                                  "changed, restart this proxy to reload it") from None


# ---- the ASGI guard -------------------------------------------------------------------------------------
@dataclass
class Policy:
    """What the guard enforces; proxy.py fills it in at start (the guard reads it on every request)."""
    tokens: Tokens = field(default_factory=lambda: Tokens(None, None))
    max_body: int = 8 << 20
    """bytes, for routes declared with large_body"""
    small_body: int = 64 << 10
    observe: Callable[[dict, float], None] = lambda scope, seconds: None
    suspended: Callable[[str], str | None] = lambda name: None
    """why a participant is quarantined (quarantine.py), or None: its token is then refused like a revoked one"""


def presented_token(headers: dict) -> bytes | None:
    """X-Proxy-Token, else a bearer token in Authorization (behind the HF Jobs gateway Authorization
    carries the HF token, so X-Proxy-Token wins when both are sent)."""
    got = headers.get(b"x-proxy-token")
    if got is None:
        auth = headers.get(b"authorization", b"")
        got = auth[7:] if auth[:7].lower() == b"bearer " else None
    return got


def refusal(status: int, detail: str, close: bool, extra: dict | None = None):
    """A JSON answer; `close` when the request's body was not read (the connection is not reused)."""
    headers = {**(extra or {}), **({"Connection": "close"} if close else {})}
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


class Rules:
    """(method, path) -> (least role, large body, why), read once from the app's OpenAPI schema (it lists every
    route, included routers too, with its openapi_extra): exact paths in a dict, templated ones as regexes.
    A route without a declaration needs the admin token. Unknown paths and methods need a worker token
    (an inference token gets 403); FastAPI then answers 404 or 405."""

    def __init__(self, openapi: dict):
        self.exact: dict[str, dict] = {}
        self.patterns: list[tuple[re.Pattern, dict]] = []
        for path, ops in openapi.get("paths", {}).items():
            rules = {}
            for method, op in ops.items():
                role = op.get("x-role", "admin")
                rules[method.upper()] = (None if role == "open" else Role[role], bool(op.get("x-large-body")), op.get("x-why"))
            if "GET" in rules:
                rules.setdefault("HEAD", rules["GET"])
            if "{" in path:
                self.patterns.append((re.compile("^" + re.sub(r"\\{[^}]+\\}", "[^/]+", re.escape(path)) + "$"), rules))
            else:
                self.exact[path] = rules

    def find(self, method: str, path: str) -> tuple[Role | None, bool, str | None]:
        if path in OPEN_PATHS:  # any method: no token, and no body
            return None, False, None
        rules = self.exact.get(path)
        if rules is None:
            rules = next((r for rx, r in self.patterns if rx.match(path)), {})
        return rules.get(method, (Role.worker, False, None))


def guard(app, policy: Policy):
    """Pure ASGI middleware, in this order: open paths take no body; 401 without a valid token (unknown
    paths too), 401 for a revoked one, 403 for a quarantined one, 403 for a role below the route's, 429 over the
    participant's rate. The 401 of a revoked token and the 403 of a quarantined one carry X-Token-Refused (every route
    will refuse it: a client stops rather than retrying, proxy_client.TokenRefused);
    413 for a body over the route's cap (declared, or counted while reading). Only then does the app see the request, with its body read and the
    caller in scope["principal"]. Nothing of a refused request's body is read. (A body that does not arrive
    in time is serving.py's to cut off.)"""
    rules: list[Rules] = []

    async def asgi(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        t0 = time.perf_counter()
        if not rules:
            rules.append(Rules(scope["app"].openapi()))
        role, large, why_role = rules[0].find(scope["method"], scope["path"])
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        has_body = (declared not in (None, b"0")) or b"transfer-encoding" in headers
        refuse = None
        if role is None:
            if has_body:
                refuse = refusal(413, f"{scope['path']} takes no request body", True)
        else:
            who = policy.tokens.authenticate(presented_token(headers))
            if who is None:
                refuse = refusal(401, "missing or wrong proxy token (X-Proxy-Token or Authorization: Bearer)", has_body,
                                 {"WWW-Authenticate": "Bearer"})
            elif who.revoked_at is not None:
                refuse = refusal(401, f"the token of participant {who.name!r} was revoked", has_body,
                                 {TOKEN_REFUSED: "revoked"})
            elif (why := policy.suspended(who.name)) is not None:
                refuse = refusal(403, quarantined(who.name, why), has_body, {TOKEN_REFUSED: "quarantined"})
            elif who.role < role:
                refuse = refusal(403, f"participant {who.name!r} ({who.role.name}) may not call {scope['method']} "
                                      f"{scope['path']}: it needs a {role.name} token" + (f" ({why_role})" if why_role else ""),
                                 has_body)
            elif (spoken := headers.get(b"x-protocol")) is not None and spoken != str(PROTOCOL).encode():
                refuse = refusal(426, protocol_mismatch(spoken.decode(errors="replace")), has_body)
            elif wait := policy.tokens.throttle(who):
                refuse = refusal(429, f"participant {who.name!r} is limited to {who.max_rps:g} requests/s", has_body,
                                 {"Retry-After": str(math.ceil(wait))})
            else:
                scope["principal"] = who
        if refuse is None and role is not None and has_body:
            cap = policy.max_body if large else policy.small_body
            if declared is not None and (not declared.isdigit() or int(declared) > cap):
                refuse = refusal(413, f"request body over {cap} bytes", True)
            else:
                body = await read_body(receive, cap)
                if body is None:  # the client went away mid-body (or was cut off): nothing to answer
                    return
                if isinstance(body, int):
                    refuse = refusal(413, f"request body over {cap} bytes", True)
                else:
                    msgs = [{"type": "http.request", "body": body, "more_body": False}]

                    async def receive(orig=receive):  # noqa: F811 - hand the buffered body to the app once
                        return msgs.pop() if msgs else await orig()
        try:
            await (refuse or app)(scope, receive, send)
        finally:
            policy.observe(scope, time.perf_counter() - t0)
    return asgi


def quarantined(name: str, why: str) -> str:
    """What a quarantined participant's every request is told (quarantine.py): why, and how it ends."""
    return (f"participant {name!r} is quarantined: {why}. Its token is refused on every route until the run's owner "
            f"reinstates it: ask them to run `bash launch_jobs.sh --token-reinstate {name}` (or POST "
            f"/v1/participants/{name}/reinstate with the admin token)")


def protocol_mismatch(spoken: str | None) -> str:
    """What a client of another protocol (its X-Protocol header; None: it sent none) is told (common.PROTOCOL)."""
    said = "sent no X-Protocol: an older clone, protocol 1" if spoken is None else f"speaks protocol {spoken}"
    return (f"this proxy speaks protocol {PROTOCOL} and your client {said}: run the code the run was started with "
            "(git pull, or check out the run owner's commit)")


async def read_body(receive, cap: int) -> bytes | int | None:
    """The whole body, or 413 (over cap) / None (the client went away; serving.py also closes a connection
    whose body does not arrive in time)."""
    body, more = bytearray(), True
    while more:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        body += msg.get("body", b"")  # in place: an 8 MB body is not copied once per chunk
        more = msg.get("more_body", False)
        if len(body) > cap:
            return 413
    return bytes(body)


# ---- the admin endpoints that manage participants (proxy.py adds them with install(app)) ----------------
POLICY = Policy()


class TokenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=40, pattern=NAME.pattern)
    """who this token is for: shown in /v1/stats and recorded with every group it submits"""
    role: Literal["inference", "worker", "trainer", "admin"] = "worker"
    max_rps: float = Field(default=0.0, ge=0.0, le=10_000.0)
    """requests per second across all routes (0: no limit)"""
    workers: int = Field(default=1, ge=1, le=4096)
    """the most live workers its share of each batch counts (docs/trust.md#a-participants-share-of-each-batch)"""


class LimitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    max_rps: float | None = Field(default=None, ge=0.0, le=10_000.0)
    workers: int | None = Field(default=None, ge=1, le=4096)

    @model_validator(mode="after")
    def _something(self) -> "LimitRequest":
        if self.max_rps is None and self.workers is None:
            raise ValueError("nothing to change: give max_rps, workers or both")
        return self


NamePath = Annotated[str, Path(min_length=1, max_length=40, pattern=NAME.pattern)]


def _answer(e: TokenError) -> HTTPException:
    return HTTPException(e.status, str(e))


async def create_token(req: TokenRequest) -> dict:
    """A new participant and its token (shown in this answer only; the bucket keeps its sha256)."""
    try:
        p, token = await POLICY.tokens.create(req.name, Role[req.role], req.max_rps, req.workers)
    except TokenError as e:
        raise _answer(e) from None
    return {**p.public(), "token": token}


async def list_tokens() -> dict:
    return {"tokens": [{**p.public(), "quarantined": POLICY.suspended(p.name)} for p in POLICY.tokens.by_name.values()]}


async def limit_token(name: NamePath, req: LimitRequest) -> dict:
    """Change a participant's rate limit (from its next request) or the live workers its share counts at most (from the
    next batch); what is left out stays as it was."""
    try:
        return (await POLICY.tokens.update(name, max_rps=req.max_rps, workers=req.workers)).public()
    except TokenError as e:
        raise _answer(e) from None


async def revoke_token(name: NamePath) -> dict:
    """Revoke a participant's token: its next request gets 401. Its accepted groups stay in the run."""
    try:
        return (await POLICY.tokens.update(name, revoke=True)).public()
    except TokenError as e:
        raise _answer(e) from None


def install(app) -> None:
    """Add the token endpoints to `app`. Routes are added to the app itself rather than through an included
    APIRouter: FastAPI 0.16x matches an included router's routes lazily, which cost ~70 us a request here."""
    for method, path, endpoint in [("POST", "/v1/tokens", create_token), ("GET", "/v1/tokens", list_tokens),
                                   ("PATCH", "/v1/tokens/{name}", limit_token), ("DELETE", "/v1/tokens/{name}", revoke_token)]:
        app.add_api_route(path, endpoint, methods=[method], openapi_extra=scope("admin"))

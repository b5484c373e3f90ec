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
    # a run's proxy on Hugging Face Jobs by hand (docs/jobs.md): the launcher prints its exact command, every file
    # it ships included; then `bash launch_jobs.sh --watch my-run` adopts it and records its URL for the others
    bash launch_jobs.sh --print-command proxy --run my-run

Its routes, in the order a run uses them, as this file has them (least role; each answer: docs/proxy.md#the-api):

  start        GET  /health                             open     alive, and the latest version
               GET  /v1/whoami                          worker   who this token is; the protocol, run_id, group_size
  a worker     POST /v1/prompts/lease                   worker   prompt indices of an open dataset; paced (wait_s): once its round fits
               POST /v1/groups                          worker   a scored group, journaled: accepted, duplicate, stale
               GET  /v1/adapters/latest                 worker   the newest version; long-polls (a sign of life)
               GET  /v1/adapters/{version}/files        worker   where to download a version's files
               GET  /v1/adapters/{version}/files/{name} worker   one of them, streamed from the bucket
  the trainer  POST /v1/prompts/datasets                trainer  open its task's dataset at its size (participants lease only those)
               POST /v1/batches/lease                   trainer  the oldest fresh-enough groups; long-polls
               POST /v1/batches/{batch_id}/renew        trainer  the lease runs --lease-s from now
               POST /v1/batches/{batch_id}/ack          trainer  its groups are consumed for good
               POST /v1/batches/{batch_id}/release      trainer  its groups back to the buffer's front now
               POST /v1/batches/{batch_id}/audit        trainer  failed checks, counted against their senders
               POST /v1/adapters                        trainer  register a published version (final: the run ends)
  watching     GET  /v1/stats                           trainer  counters, workers, pacing, participants
               GET  /v1/state                           trainer  the book in full: what a restart rebuilds
               GET  /metrics                            trainer  Prometheus text (telemetry.py)
  the owner    POST /v1/participants/{name}/reinstate   admin    lift a participant's quarantine
               POST /v1/workers/leave                   admin    ask one of the run's workers to leave (scale-down)
  routing.py   POST /v1/chat/completions, GET /v1/inference/stats: inference; POST /v1/inference/lease, /answers: admin
  access.py    POST, GET /v1/tokens; PATCH, DELETE /v1/tokens/{name}: admin (participants' tokens)

Durability: the bucket is my only disk. Every change an answer depends on is in the journal (journal.py)
before the answer goes out: one object per group commit, one JSON line per accepted group (as sent) or
event (lease, renew, ack, expire, version, prompt cursor, grant, duplicate, stale arrival), in order, and
the counters. What those lines mean is ledger.py (the rules themselves: book.py); a snapshot of that state
is written every few seconds, and a start reads the newest one and the commits after it (snapshots.py), so
`kill -9` at any moment is fine and a restart takes as long after a day as after a minute. Every commit and
snapshot names the protocol that wrote it (common.PROTOCOL): a start refuses a run written in another.
Who may call what is access.py (scoped tokens, checked before a body is read); the HTTP server's limits
serving.py; version checks and adapter files for workers without bucket keys adapter_files.py; which
prompts a worker gets prompts.py, and when pacing.py; who sent the groups participants.py; what a
participant's group is checked for on arrival receipts.py, who failed checks and is quarantined for it
quarantine.py, each participant's share of a batch shares.py (docs/trust.md); the routes' bodies and answers
wire.py; /metrics telemetry.py; when the cyclic garbage is collected sweeper.py.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Literal, NoReturn

from fastapi import FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

# common first: importing it puts the lib/ folders on sys.path (in a job every file lands beside this one)
from common import (MAX_STALENESS, PROTOCOL, Bucket, BucketError, ConflictError, ProtocolError, TrajectoryGroup,
                    sampled_by_version, temperature_problem, token_id_problem)
import access
import journal
from access import ADMIN, NamePath, scope
from metrics import Metrics, peak_rss_mb
from adapter_files import FILES, Downloads, check_published
from book import Book, Entry, Held
from ledger import HEAD
from pacing import Waiting
from fleet import FleetClock, Leaving
from participants import Senders, worker_key
from prompts import Cursors, NotOpen, PromptError
from proxy_client import read_job_url, write_proxy_endpoint
from receipts import fingerprint
from serving import Limits, serve
import shares
from snapshots import Keeper
from sweeper import Sweeper
import leadership
from leadership import Follower, Term
import routing
import telemetry
from runconfig import record_config
from telemetry import COMMIT, STALENESS
from wire import (GROUP_BODY, AuditReport, BatchId, DatasetRequest, LeaseRequest, LeaseResponse, LeaveRequest,
                  PromptLeaseRequest, RegisterRequest, SubmitResponse)

@dataclass
class Args:
    host: str = "127.0.0.1"
    """interface to listen on; a non-loopback address requires a token"""
    port: int = 8000
    token: str | None = field(default_factory=lambda: os.environ.get("PROXY_TOKEN"))
    """the admin token, sent as X-Proxy-Token or Authorization: Bearer (env PROXY_TOKEN); participants get their own"""
    group_size: int = 8
    """G: completions per group; groups of another size are refused"""
    max_staleness: int = MAX_STALENESS
    """groups more than this many versions behind the latest are dropped (common.too_stale)"""
    max_buffer: int = 0
    """buffered groups; beyond it submissions get 429. 0: the staleness window, (max_staleness + 1) batches of the
    trainer's (at least 8 groups a batch until its first lease request says its size): all that pacing may admit"""
    lease_s: float = 300.0
    """a lease not acked or renewed within this many seconds returns its groups to the buffer"""
    max_prompt_tokens: int = 4096
    max_completion_tokens: int = 4096
    """per completion: an episode's tokens after the prompt, the environment's included"""
    vocab_size: int = 49152
    """the model's vocabulary (its embedding's rows): a group with a token id at or past it is refused (the trainer
    could not look it up). The default is the default model's, SmolLM2-135M's; the launchers pass the run's model's"""
    temperatures: tuple[float, ...] = (1.0,)
    """the sampling temperatures a participant's group may say it was sampled at (meta.temperature): the run's, its
    workers' --temperature (the launchers pass the one they start the workers with). The trainer scores a group at
    the temperature it names, which weighs its gradient (about 1/T: a group at 0.1 would count ~9 times one at 1),
    so any other is refused (422). The run's own groups (the admin token) are not held to it"""
    max_body_mb: float = 8.0
    """bodies of POST /v1/groups, /v1/chat/completions and /v1/inference/answers above this get 413 (every other route: 64 KiB)"""
    body_timeout_s: float = 60.0
    """a request body must arrive within this many seconds (else 408)"""
    head_timeout_s: float = 10.0
    """a request's line and headers must arrive within this many seconds of the connection or last answer"""
    max_head_kb: int = 64
    """request line + headers above this get 431"""
    max_connections: int = 4096
    """open connections; more get 503 (the file limit is raised to fit)"""
    commit_depth: int = 1
    """journal writes in flight; requests arriving meanwhile share the next (1: fewest puts; more: hides latency)"""
    seed: int = 0
    """seed of the per-epoch prompt shuffle"""
    adapter_urls: Literal["auto", "presigned", "proxy"] = "auto"
    """how workers without bucket keys get adapter files: presigned bucket URLs, the proxy streaming them,
    or auto (presigned if the bucket serves a presigned probe at start)"""
    url_ttl_s: float = 900.0
    """lifetime of a presigned adapter URL"""
    max_downloads: int = 8
    """adapter files the proxy streams at once (more get 503 + Retry-After)"""
    use_bucket: bool = True
    """journal to the bucket and replay it on start, verify registered versions, write metrics (needs BUCKET)"""
    bucket_patience_s: float = 20.0
    """while serving, a bucket call waits out an outage this long, then the request gets 503 (its caller
    retries); before serving, the start waits however long it takes"""
    snapshot_s: float = 10.0
    """write a snapshot of the state every this many seconds while commits come (a start reads it and the commits after)"""
    snapshot_commits: int = 200
    """... or every this many commits, if sooner: a start reads about this many commits at most"""
    pace: bool = True
    """grant a worker that asks with wait_s prompts only when its round can still be trained within max_staleness
    and what the trainer will still lease (pacing.py); it waits otherwise. --no-pace: every prompt lease at once
    (for comparison: docs/results/fleet.md)"""
    grant_s: float = 120.0
    """a grant holds its place for this long after 3 of its worker's round times (or its margin, if longer); then it is given up"""
    poll_grace_s: float = 5.0
    """a worker whose version long-poll (sent with its worker_id) ended, answered or not, and who opens no new
    one within this many seconds, is taken for gone: its open grant no longer covers the trainer's remaining demand
    (the last batches need not wait --grant-s for a crashed worker)"""
    pace_jitter: float = 0.3
    """pacing's least margin on the predicted arrival order, as a share of the worker's round time (4 mean deviations of its round time where wider)"""
    route: routing.Limits = field(default_factory=routing.Limits)
    """inference routing (POST /v1/chat/completions answered by serving workers, routing.py)"""
    max_participant_share: float = 1.0
    """the most of each batch one participant's groups may take, as a share: each takes at most its share of the live
    workers (shares.py: those polling for versions with their worker_id, counted up to the workers its token allows,
    `--token-workers`), and at most this; beyond it its groups wait in the buffer (and past that share of --max-buffer
    get 429). 1: its share of the live workers alone. The run's own groups are never held back"""
    quarantine_after: int = 3
    """a participant whose groups failed this many checks (here, or in the trainer's audit) is suspended until
    the run's owner reinstates it (docs/trust.md)"""

    standby: bool = False
    """stand by: follow the journal as it is written and take the lead when the leader's term lapses (leadership.py);
    until then answer /health and /metrics only (others: 503 + Retry-After). Without it, a start leads at once"""
    term_s: float = 0.0
    """leadership (leadership.py): the leader renews proxy/leader.json every term_s / 4 and stops answering when it could
    not for 0.7 x term_s; a standby takes over after term_s without a renewal. Give the leader and its standby the same
    (launch_jobs.sh --standby: 2). 0: no leader record, no renewals (a run without a standby)"""
    follow_s: float = 0.25
    """a standby lists new journal commits and reads the leader record every this many seconds"""
    advertise_url: str | None = field(default_factory=lambda: os.environ.get("PROXY_ADVERTISE_URL"))
    """the URL clients reach this proxy at (env PROXY_ADVERTISE_URL): written to proxy/endpoint.json when it takes the
    lead, where clients without PROXY_URL find it. Unset, in a Hugging Face job: the exposed URL the launcher or
    supervisor left for this job (proxy/urls/JOB_ID.json); else the launcher or supervisor writes that record"""

ARGS = Args()  # replaced by the CLI in __main__; tests start the real script as a process

MAX_WORKERS, MAX_DATASETS = 4096, 64  # bounds on client-chosen names we keep state for


def settings_problems(a: Args) -> list[str]:
    """What in the command line cannot work, each naming its option (a negative staleness or an empty buffer
    would start a proxy that refuses everything, or hands out what it should not)."""
    at_least = [("port", 0), ("group_size", 1), ("max_staleness", 0), ("max_buffer", 0), ("max_prompt_tokens", 1),
                ("max_completion_tokens", 1), ("vocab_size", 1), ("max_head_kb", 1), ("max_connections", 1), ("commit_depth", 1),
                ("max_downloads", 1), ("snapshot_commits", 1), ("quarantine_after", 1), ("bucket_patience_s", 0),
                ("grant_s", 0), ("pace_jitter", 0), ("term_s", 0)]
    above_zero = ["lease_s", "max_body_mb", "body_timeout_s", "head_timeout_s", "url_ttl_s", "snapshot_s", "poll_grace_s",
                  "follow_s"]
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    temps = (["--temperatures: at least one"] if not a.temperatures else
             [f"--temperatures {t}: {why}" for t in a.temperatures if (why := temperature_problem(t))])
    return (temps + [f"{flag(n)} {getattr(a, n)}: must be at least {low}" for n, low in at_least if not getattr(a, n) >= low]
            + [f"{flag(n)} {getattr(a, n)}: must be above 0" for n in above_zero if not getattr(a, n) > 0]
            + ([f"--port {a.port}: must be at most 65535"] if a.port > 65535 else [])
            + (["--standby: needs the bucket (BUCKET, and not --no-use-bucket): it follows the journal there"]
               if a.standby and not (a.use_bucket and os.environ.get("BUCKET")) else [])
            + (["--standby: needs --term-s above 0, the leader's (it takes over once a term passes without a renewal)"]
               if a.standby and not a.term_s > 0 else [])
            + ([] if 0 < a.max_participant_share <= 1 else
               [f"--max-participant-share {a.max_participant_share}: must be above 0 and at most 1"]))


# ---- state ----------------------------------------------------------------------------------------
# The buffer, the leases, the duplicate window and the versions are a Book (book.py: every rule that changes
# them, the same rules replay follows). A group is held as the JSON line we logged (book.Entry: cheap to keep,
# leased without re-encoding). A lease's deadline is on this process's monotonic clock: nothing compares clocks
# of two hosts, and a replayed lease gets a fresh lease_s from the moment of replay.

@dataclass
class State:
    book: Book = field(default_factory=lambda: Book(MAX_STALENESS, 300.0))
    deadlines: dict = field(default_factory=dict)   # batch_id -> monotonic deadline of its open lease
    pending: dict = field(default_factory=dict)     # group_id -> future of its journal write
    pending_by: Counter = field(default_factory=Counter)  # participant -> its groups being written (shares' room)
    pending_version: int = 0                        # a version whose journal write is in flight
    rejected_full: int = 0                          # 429s (not in the log: the commits' counters line carries it)
    rejected_share: int = 0                         # 429s of a participant past its share of the buffer (the same)
    cursors: Cursors = field(default_factory=lambda: Cursors(0, MAX_DATASETS))  # prompt dispatch
    senders: Senders = field(default_factory=lambda: Senders(MAX_WORKERS))  # groups per participant and worker
    incarnation: int = 0
    run_id: str = "local"                           # a hash of the bucket, endpoint and run: names none of them
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)
    # the version long-polls wait on their own condition, notified only when a version is registered: on S.cond,
    # every group accepted woke every poller (at 1,000 workers, hundreds of groups a second x 1,000 polls)
    versions: asyncio.Condition = field(default_factory=asyncio.Condition)

    @property
    def latest(self) -> int:
        return self.book.latest

    @property
    def counters(self) -> dict:
        return {**self.book.counts, "groups_rejected_full": self.rejected_full, "groups_rejected_share": self.rejected_share}

S = State()
BUCKET: Bucket | None = None
METRICS: Metrics | None = None
DOWNLOADS: Downloads | None = None
POLICY = access.POLICY
LIVE = shares.Live(MAX_WORKERS)  # which workers are live, for each participant's share of a batch (live only)
JOURNAL = journal.Writer(None, 0)  # replaced at start (lifespan): the writer of this incarnation

# the long-polls (a version, a batch) wait on a condition, and give up when their client goes away
async def wait_until(ready, wait_s: float, cond: asyncio.Condition | None = None, every_s: float = 1.0) -> bool:
    """Under `cond` (S.cond by default): wait up to wait_s for ready(), re-checked on every notify and at least
    every every_s (a ready() that changes with the clock; one that only a notify changes needs no re-check)."""
    cond = S.cond if cond is None else cond
    deadline = time.monotonic() + wait_s
    while not ready():
        if (left := deadline - time.monotonic()) <= 0:
            return False
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(cond.wait(), timeout=min(left, every_s))
    return True

async def _until_disconnect(receive, cond: asyncio.Condition | None = None) -> None:
    """Returns when the client goes away (its body was read already: receive() has nothing else to give); wakes
    those waiting on `cond` (S.cond by default)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    cond = S.cond if cond is None else cond
    async with cond:
        cond.notify_all()

# ---- start: the state read back from the bucket (snapshots.py), the app -------------------------------
KEEPER: Keeper | None = None  # the state after the last commit in the bucket, and its snapshots (None: no bucket)
TERM: Term | None = None       # the leader record this proxy writes once it leads (None: no bucket, or --term-s 0)
FOLLOWER: Follower | None = None  # while it stands by (--standby): the journal it follows
# set once the server is told to stop (SIGTERM): it still renews its term until the requests in progress end (then it
# releases the record), so a routed request waiting minutes for a worker must end now, or it holds the takeover up
STOPPING = threading.Event()
SWEEPER = Sweeper(observe=telemetry.GC_PAUSE.observe)  # the cyclic garbage's collections (sweeper.py)

def take_over(live: dict) -> None:
    """The state a start read back (ledger.Ledger.live) becomes the live state."""
    S.book = Book.adopt(live, ARGS.max_staleness, ARGS.lease_s)
    pacing_options(S.book)
    S.book.pacing.restart(time.monotonic())  # an open grant holds its place as if made now (as a lease does)
    S.cursors.table, S.senders, S.rejected_full = live["cursors"], live["senders"], live["counters"].get("groups_rejected_full", 0)
    S.rejected_share = live["counters"].get("groups_rejected_share", 0)
    # every open lease gets a full lease_s from now: no clock of another host (or of ours, earlier) is compared
    S.deadlines = {b: time.monotonic() + h.lease_s for b, h in S.book.leases.items()}

def pacing_options(book: Book) -> None:
    book.pacing.grant_s, book.pacing.jitter, book.pacing.poll_grace_s = ARGS.grant_s, ARGS.pace_jitter, ARGS.poll_grace_s

def fatal(msg: str, status: int) -> NoReturn:
    print(f"FATAL: {msg}", file=sys.stderr, flush=True)
    os._exit(status)

def fatal_foreign_writer(msg: str) -> None:
    fatal(f"{msg}. Another proxy is journaling to this run; stopping.", 3)

def counters_trailer() -> list[dict]:  # every commit ends with them: a restart loses no count an answer reported
    return [{"t": "counters", "counters": S.counters}]

async def _housekeeping() -> None:
    while True:
        await asyncio.sleep(1.0)
        async with S.cond:
            expire_leases(time.monotonic())
        S.book.pacing.expire(time.monotonic())
        pace()  # predicted arrivals move with the clock, and grants run out
        SWEEPER.sweep()
        if METRICS is not None:
            row = {"buffer/size": len(S.book.buffer), "version": S.latest, **{f"proxy/{k}": v for k, v in S.counters.items()}}
            await asyncio.to_thread(METRICS.log, row)  # its flush is a bucket put: not on the event loop

@asynccontextmanager
async def lifespan(app: FastAPI):
    global BUCKET, KEEPER, TERM, FOLLOWER
    POLICY.max_body, POLICY.observe = int(ARGS.max_body_mb * 2**20), telemetry.observe_request
    POLICY.tokens = access.Tokens(None, ARGS.token)
    POLICY.suspended = lambda name: S.book.quarantine.reason(name)  # a quarantined participant's token is refused
    S.cursors = Cursors(ARGS.seed, MAX_DATASETS)  # ARGS is the command line's only now
    S.book = Book(ARGS.max_staleness, ARGS.lease_s)
    pacing_options(S.book)
    tasks: list[asyncio.Task] = []
    if ARGS.use_bucket and os.environ.get("BUCKET"):
        BUCKET = Bucket(patience_s=ARGS.bucket_patience_s)  # while serving; then 503 (which the callers wait out)
        startup = BUCKET.with_patience(None)  # before serving, a bucket outage is waited out however long
        S.run_id = hashlib.sha256(f"{BUCKET.endpoint}|{BUCKET.bucket}|{BUCKET.run}".encode()).hexdigest()[:16]
        KEEPER = Keeper(startup, max_staleness=ARGS.max_staleness, lease_s=ARGS.lease_s, max_workers=MAX_WORKERS,
                        max_datasets=MAX_DATASETS)
        if ARGS.term_s > 0:  # a renewal is one call (no patience): the term is short
            TERM = Term(BUCKET.with_patience(0), ARGS.term_s, ARGS.advertise_url)
        if ARGS.standby:
            FOLLOWER = Follower(KEEPER, ARGS.term_s)
            try:
                how = await asyncio.to_thread(FOLLOWER.load)
                await asyncio.to_thread(KEEPER.check_store)  # now, not at the takeover: it would lengthen it
            except (ProtocolError, journal.UnfitStore) as e:
                fatal(f"not starting: {e}", 2)
            await prepare(startup)
            print(f"proxy: standing by, following the journal from {how}", file=sys.stderr, flush=True)
            tasks.append(asyncio.create_task(stand_by(startup, tasks)))
        else:
            if TERM is not None:
                await asyncio.to_thread(TERM.seize)
                tasks.append(asyncio.create_task(TERM.run(deposed)))  # renewed from now on: a long start keeps its term
            tasks += await lead(startup, KEEPER.start)
            await announce(startup)
    else:
        tasks += await lead(None, None)
    yield
    [t.cancel() for t in tasks]
    if KEEPER is not None and FOLLOWER is None:  # the next start (a relaunch after a timeout, say) then reads no commits
        with suppress(BucketError, ConflictError):
            await KEEPER.snapshot(S.incarnation, JOURNAL.writer_id)
    if TERM is not None and TERM.since is not None:
        await asyncio.to_thread(TERM.release)  # a standby takes over at its next poll
    if METRICS is not None:
        METRICS.flush()
    print("proxy: stopped cleanly", file=sys.stderr, flush=True)  # uvicorn then re-raises the signal

async def stand_by(startup: Bucket, tasks: list) -> None:
    """Follow the journal every --follow-s until the leader's term lapses and this proxy's claim wins; then lead:
    the commits not applied yet, the fence, the endpoint record, and serving (lead)."""
    global FOLLOWER
    while True:
        try:
            await asyncio.to_thread(FOLLOWER.follow)
            if await asyncio.to_thread(FOLLOWER.lapsed) and await asyncio.to_thread(TERM.claim, FOLLOWER.seen):
                break
        except BucketError as e:  # the bucket is down: the leader cannot renew either; try again
            print(f"proxy standby: {e}", file=sys.stderr, flush=True)
        except ProtocolError as e:
            fatal(f"standby stopping: {e}", 2)
        await asyncio.sleep(ARGS.follow_s)
    t0, leader = time.monotonic(), FOLLOWER.record
    renewing = asyncio.create_task(TERM.run(deposed))  # from the claim on: a takeover's reads run within the term

    def take() -> tuple[dict, int, str]:
        n = KEEPER.catch_up()
        live, incarnation = KEEPER.finish()
        return live, incarnation, f"state followed, and {n} commits read at the takeover"
    tasks += [renewing, *await lead(startup, take)]
    FOLLOWER = None  # serving from here on
    await announce(startup)
    print(f"proxy: took the lead from incarnation {leader.get('incarnation')} in {time.monotonic() - t0:.2f}s "
          f"after its term lapsed", file=sys.stderr, flush=True)

def deposed(why: str) -> None:
    fatal(f"{why}; this proxy stops (its journal writes would be refused: it was fenced off)", 3)

async def lead(startup: Bucket | None, start) -> list[asyncio.Task]:
    """Serve: the state read back by start() (snapshots.Keeper.start, or a standby's takeover) becomes the live state,
    the journal writer and snapshots run. Returns the tasks to cancel at the stop."""
    global JOURNAL
    if start is not None:
        try:  # first: a run of another protocol, or a store unfit for it, is refused before anything is written
            live, S.incarnation, how = await asyncio.to_thread(start)
        except (ProtocolError, journal.UnfitStore) as e:
            fatal(f"not starting: {e}", 2)
        KEEPER.bucket = BUCKET  # snapshots while serving: a failed one is tried again at the next turn
        POLICY.tokens = access.Tokens(startup, ARGS.token)
        await asyncio.to_thread(POLICY.tokens.load)
        POLICY.tokens.bucket = BUCKET
        if DOWNLOADS is None:  # (a standby prepared before it stood by)
            await prepare(startup)
        take_over(live)
        print(f"proxy: incarnation {S.incarnation}, {how}: {S.counters['groups_accepted']} groups accepted, buffer "
              f"{len(S.book.buffer)}, {len(S.book.leases)} leases, duplicate window {len(S.book.window)}, version {S.latest}",
              file=sys.stderr)
        if TERM is not None:
            TERM.incarnation = S.incarnation  # the next renewal names it
    JOURNAL = journal.Writer(BUCKET, S.incarnation, ARGS.commit_depth, trailer=counters_trailer,
                             on_foreign=fatal_foreign_writer, observe=COMMIT.observe,
                             **(dict(committed=KEEPER.ledger.commit, uncertain=KEEPER.uncertain.append) if KEEPER else {}))
    snapshots = [KEEPER.run(ARGS.snapshot_s, ARGS.snapshot_commits, S.incarnation, JOURNAL.writer_id)] if KEEPER else []
    tasks = [asyncio.create_task(f) for f in (JOURNAL.run(), _housekeeping(), *snapshots)]
    SWEEPER.start()  # the cyclic garbage is collected by the housekeeping from now on
    if BUCKET is not None and not S.book.done:  # a version published while the proxy was down is only in latest.json
        latest = await asyncio.to_thread(startup.get_json, "adapters/latest.json")
        if latest and latest["version"] > S.latest:
            try:
                await register(RegisterRequest(version=latest["version"], step=latest.get("step", 0),
                                               published_at=latest.get("created_at", time.time())), adopted=True)
            except HTTPException as e:
                print(f"proxy: not adopting version {latest['version']} from adapters/latest.json: {e.detail}", file=sys.stderr)
    return tasks

async def prepare(startup: Bucket) -> None:
    """What serving needs besides the state, done before a start reads it (a standby: before it stands by, so that a
    takeover does only what it must): the run's configuration recorded, metrics, the adapter files' URLs."""
    global METRICS, DOWNLOADS
    await asyncio.to_thread(record_config, startup, "proxy", ARGS, __file__)
    METRICS = Metrics(BUCKET, "proxy", flush_s=10.0)
    DOWNLOADS = await asyncio.to_thread(Downloads, startup, ARGS.adapter_urls, ARGS.url_ttl_s, ARGS.max_downloads)
    DOWNLOADS.bucket = BUCKET

async def announce(startup: Bucket) -> None:
    """Clients without PROXY_URL find the leader in proxy/endpoint.json (proxy_client.py): written once it serves, with
    this job's id (the supervisor then sees the record is this job's)."""
    job = os.environ.get("JOB_ID")
    url = ARGS.advertise_url or (job and await asyncio.to_thread(read_job_url, startup, job))
    if not url:
        return
    if TERM is not None:
        TERM.url = url  # the leader record's next renewal names it
    await asyncio.to_thread(write_proxy_endpoint, startup, url, incarnation=S.incarnation, job_id=job,
                            written_by=f"proxy incarnation {S.incarnation}")

def refusal() -> str | None:
    """Why this proxy answers nothing but /health and /metrics now (None: it serves): it stands by, it is stopping,
    or it leads but its last renewal of the leader record is too old for it to be sure it still does (leadership.py)."""
    if FOLLOWER is not None:
        return "this proxy is a standby: the leader answers (proxy/endpoint.json names it); retry"
    if STOPPING.is_set():
        return "this proxy is stopping; retry (proxy/endpoint.json names the next leader)"
    if TERM is not None and TERM.since is not None and not TERM.holds():
        return "this proxy could not renew its leadership in time; retry (a standby takes over if it does not recover)"
    return None

app = FastAPI(title="async-grpo proxy", version="1", lifespan=lifespan, telemetry={"tracing": False, "metrics": False, "logs": False})

@app.exception_handler(RequestValidationError)
async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # field path + message, without echoing the input (it may hold NaN, which JSON cannot carry)
    return JSONResponse({"detail": [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]},
                        status_code=422)

@app.exception_handler(journal.JournalWriteError)
@app.exception_handler(BucketError)
async def bucket_unavailable(request: Request, exc: Exception) -> JSONResponse:
    # the cause (endpoint, bucket, key) goes to our stderr; a client only learns that it may retry
    if isinstance(exc, BucketError):
        print(f"proxy: {request.method} {request.url.path}: {exc}", file=sys.stderr, flush=True)
    return JSONResponse({"detail": "the bucket is unavailable, nothing changed; retry"}, status_code=503,
                        headers={"Retry-After": "2"})

app.add_middleware(access.guard, policy=POLICY)
app.add_middleware(leadership.gate, refusal=lambda: refusal())  # outermost: a standby reads no body, checks no token

@app.get("/health", openapi_extra=scope("open"))
async def health() -> dict:
    """Alive. role: leader (it serves), standby (it follows the journal; the leader serves) or none (no bucket)."""
    return {"ok": True, "latest_version": S.latest, **leader_stats()}

def leader_stats() -> dict:
    """Who this proxy is in the run's leadership (leadership.py): a standby's lag behind the journal, a leader's term."""
    if FOLLOWER is not None:
        return FOLLOWER.stats()
    if TERM is not None and TERM.since is not None:
        return TERM.stats()
    return {"role": "alone"}  # (no --term-s: no leader record, no standby)

@app.get("/v1/whoami", openapi_extra=scope("worker"))
async def whoami(request: Request) -> dict:
    """Who this token is, and what a worker must agree on with the run: the protocol first (every role asks at its
    start, with its X-Protocol; one without, an older clone, is told to update: 426). run_id identifies the run
    (for a worker's spool) without naming its bucket or prefix."""
    if request.headers.get("x-protocol") is None:  # (a mismatching one never gets here: access.guard)
        raise HTTPException(426, access.protocol_mismatch(None))
    who = request.scope["principal"]
    return {"protocol": PROTOCOL, "participant": who.name, "role": who.role.name, "max_rps": who.max_rps,
            "run_id": S.run_id, "group_size": ARGS.group_size, "max_staleness": ARGS.max_staleness}

# ---- a worker: prompts, and the grants of pacing (pacing.py) ----------------------------------------
WAITING = Waiting()  # paced prompt requests waiting for their grant
FLEET = FleetClock(time.monotonic())  # the trainer's idle time and the workers' grant waits (fleet.py: an autoscaler's)
LEAVING = Leaving()  # workers the supervisor asked to leave (scale-down: fleet.py)

def release_grant(key: str, refused: str | None) -> int:
    """A worker asking for prompts has done with any grant it still holds (its round was sent, lost in a crash,
    or not generated: it refused the version the grant counted on), so that grant is closed now: its place in
    the staleness window goes to others at once. Journaled, not awaited (lost, a restart holds the grant until
    its deadline). Returns the groups it still held (0: none)."""
    if left := S.book.pacing.close(key):
        if refused:  # said once per grant given back, not on every request while the refusal lasts
            print(f"proxy: worker {key} gave back a grant of {left} group(s): it refused a version: {refused[:500]}",
                  file=sys.stderr, flush=True)
        JOURNAL.append({"t": "release", "key": key})
        pace()
    return left

def no_grant(released: int, why: str | None = None) -> dict:
    """The answer of a paced prompt lease that got no grant: when to ask again, and why when waiting cannot help."""
    S.book.pacing.live["waits"] += 1
    return {"indices": [], "epochs": [], "version": S.latest, "done": S.book.done,
            "retry_s": S.book.pacing.retry_s(time.monotonic()), **({"released": released} if released else {}),
            **({"why": why} if why else {})}

def arrived(participant: str | None, worker: str) -> None:
    """A group of this worker is in (accepted, or refused as stale): one less of its grant in flight."""
    S.book.pacing.arrived(worker_key(participant, worker), time.monotonic())
    pace()

_pace_soon = False
_pace_next = 0.0  # time.monotonic() before which no pass begins
PACE_SHARE = 0.1  # of the event loop's time, at most, for pacing passes

def pace() -> None:
    """Hand out the grants there is room for (called when something pacing depends on changes): once, at the
    event loop's next turn, however many changes asked for it meanwhile. A pass is O(waiting + grants) and
    O(grants) again per grant it makes, a few ms at 1,000 workers, whose groups arrive by hundreds a second;
    passes back to back would crowd every other request out (the fleet simulation's /health p99), so a pass
    begins no sooner than its predecessor's duration / PACE_SHARE after that one began: a grant waits a few ms
    more at 1,000 workers, ~0.1 ms at ten."""
    global _pace_soon
    if not _pace_soon:
        _pace_soon = True
        asyncio.get_running_loop().call_later(max(0.0, _pace_next - time.monotonic()), _pace_now)

def next_pass_in() -> float:
    """Seconds until the next pacing pass may begin, and a millisecond: the least a paced request waits, so that a
    pass answers it (with a wait_s of 0 just after a pass, its wait would end before the next pass began)."""
    return max(0.0, _pace_next - time.monotonic()) + 0.001

def _pace_now() -> None:
    global _pace_soon, _pace_next
    _pace_soon = False
    t0 = time.monotonic()
    WAITING.pace(S.book.pacing, S.latest, len(S.book.buffer), S.book.done, S.pending_version, t0, share_room)
    _pace_next = t0 + (time.monotonic() - t0) / PACE_SHARE

def share_room(key: str, version: int) -> int | None:
    """The most a participant's worker may be granted for a round of `version`: what its share of the batches that may
    still train that round (the staleness window's, pacing.window) leaves, less its groups buffered and granted to its
    other workers and what it owes (shares.py: past its quota, its groups wait for the next batch, and would go stale
    there). None for the run's own workers (never held back)."""
    if (who := shares.party(key)) is None:
        return None
    pacer, now = S.book.pacing, time.monotonic()
    n = pacer.batch or 8
    buffered = Counter(it.who for it in S.book.buffer.values())
    quota = shares.quotas(party_shares(now, {*buffered, who}), n)[who]
    batches = ARGS.max_staleness - pacer.base(S.latest, S.pending_version) + version + 1
    mine = buffered[who] + sum(g.left for k, g in pacer.grants.items() if k != key and shares.party(k) == who)
    slots = quota * max(0, batches)
    return max(0, slots - mine - min(S.book.receipts.owed.get(who, 0), slots))

def prompts_record(got: dict, dataset: str, name: str) -> dict:
    """(Trust, docs/trust.md) The journal record of a prompt lease: a lease_id for these indices and whom they went
    to. A group must name it, and only that participant may answer them, once each (receipts.py binds it once
    the record is written)."""
    who = None if name == ADMIN else name
    return {"t": "prompts", "lease_id": uuid.uuid4().hex, "dataset": dataset, "indices": got["indices"],
            "latest": S.latest, **({"participant": who} if who else {})}

def once_each(answer: dict) -> dict:
    """A participant's lease without repeats: where it runs past the end of an epoch into the next, the prompts it
    holds already are left out (it gets fewer than it asked for). Each index of a participant's lease is answered by
    one group at most (receipts.py), so a repeat would be a prompt its worker generates for and cannot send."""
    seen: set[int] = set()
    keep = [j for j, i in enumerate(answer["indices"]) if not (i in seen or seen.add(i))]
    return {"indices": [answer["indices"][j] for j in keep], "epochs": [answer["epochs"][j] for j in keep]}

@app.post("/v1/prompts/lease", openapi_extra=scope("worker"))
async def lease_prompts(req: PromptLeaseRequest, request: Request) -> dict:
    """`n` prompt indices from a per-epoch seeded shuffle of range(size): no index twice per epoch,
    across restarts too (the cursor is journaled before the indices are handed out). With wait_s, a grant:
    up to n of them once a round generated now can still be trained, with `version`, the version to
    generate with (or newer); none after wait_s (or the next pacing pass, if that is later: next_pass_in), or once
    the run is over (`done`). A participant's lease is of a
    dataset the run's owner opened (POST /v1/prompts/datasets; the admin token's first lease opens one too): before
    that it waits (paced: no grant, `not_open` says why; else 503 with Retry-After, which ProxyClient waits out)."""
    grant, n = None, req.n
    who = request.scope["principal"]
    owner = who.role >= access.Role.trainer
    not_open = None if owner or req.dataset in S.cursors.table else NotOpen(req.dataset)
    if req.wait_s is not None and ARGS.pace:
        if req.worker_id is None:
            raise HTTPException(422, "wait_s (a paced prompt lease) needs worker_id: the worker the grant is for")
        if req.version is not None and req.version > S.latest:
            raise HTTPException(422, f"version {req.version} is newer than the latest registered {S.latest}")
        key = worker_key(None if who.name == ADMIN else who.name, req.worker_id)
        LIVE.saw(key, time.monotonic())
        released = release_grant(key, req.refused)
        if (leave := LEAVING.told(key, released)) is not None:  # after its round was sent: nothing generated is lost
            return {**no_grant(released), "leave": leave}
        if not_open is not None:  # an honest worker started before the trainer: held up to wait_s, as for a grant
            async with S.cond:
                if not await wait_until(lambda: req.dataset in S.cursors.table, req.wait_s):
                    return {**no_grant(released), "not_open": str(not_open)}  # it asks again, as for any wait
            not_open = None
        if req.version is not None and S.book.pacing.hopeless(req.version, S.latest, S.pending_version):
            return no_grant(released, f"version {req.version} is more than max_staleness {ARGS.max_staleness} behind the "
                                      f"version the next batch trains from ({S.book.pacing.base(S.latest, S.pending_version)}): "
                                      "nothing generated with it can be trained; this worker must load a newer one")
        FLEET.wait_began(id(req), time.monotonic())
        try:
            grant = await WAITING.wait(key, req.n, max(req.wait_s, next_pass_in()), pace, req.version)
        finally:
            FLEET.wait_ended(id(req), time.monotonic())
        if grant is None:
            return no_grant(released)
        n = grant.n
    elif req.worker_id is not None and (leave := LEAVING.told(worker_key(None if who.name == ADMIN else who.name,
                                                                          req.worker_id), 0)) is not None:
        return {"indices": [], "epochs": [], "version": S.latest, "done": S.book.done, "leave": leave}  # (unpaced)
    if not_open is not None:
        raise HTTPException(503, str(not_open), headers={"Retry-After": "5"})
    async with S.cond:  # only the cursor moves under the lock; the indices are computed after
        try:
            spans, record = S.cursors.reserve(req.dataset, req.size, n, owner)
        except PromptError as e:
            if grant is not None:
                S.book.pacing.ungrant(grant)
                pace()
            raise HTTPException(503 if isinstance(e, NotOpen) else 409, str(e)) from None
        # the cursor moves ahead even if this write fails: skipping indices is fine, repeating is not
        writes = [JOURNAL.append(record)] + ([JOURNAL.append(grant.record())] if grant is not None else [])
    try:
        answer = (S.cursors.indices(req.dataset, req.size, spans) if n <= 64 else
                  await asyncio.to_thread(S.cursors.indices, req.dataset, req.size, spans))  # ~5 us an index: off the loop
        # trust: whom they went to. Appended in the same turn as the cursor (n <= 64), so the three records share
        # one commit: the answer waits for one bucket write, not two in a row (a grant's round starts sooner)
        if who.name != ADMIN:  # a participant's lease holds each prompt once: it may answer each once (receipts.py)
            answer = once_each(answer)
        bound = prompts_record(answer, req.dataset, request.scope["principal"].name)
        writes.append(JOURNAL.append(bound))
        for fut in writes:
            await fut
        S.book.receipts.bind(bound["lease_id"], bound.get("participant"), req.dataset, answer["indices"], bound["latest"])
        answer = {"lease_id": bound["lease_id"], **answer}
    except journal.JournalWriteError:
        if grant is not None:  # the grant holds no place: nobody got its prompts
            S.book.pacing.ungrant(grant)
            pace()
        raise
    return answer if grant is None else {**answer, "version": grant.version, "done": False,
                                         **({"released": released} if released else {})}

@app.post("/v1/prompts/datasets", openapi_extra=scope("trainer"))
async def open_dataset(req: DatasetRequest) -> dict:
    """The run's owner opens a dataset of `size` prompts (the trainer opens its task's when it starts): participants
    lease prompts of open datasets only, at that size (prompts.Cursors.open). The same again is a no-op; another size
    is refused (409), as it is to a lease."""
    async with S.cond:
        try:
            record = S.cursors.open(req.dataset, req.size)
        except PromptError as e:
            raise HTTPException(409, str(e)) from None
        fut = JOURNAL.append(record) if record else None
        S.cond.notify_all()  # the participants' leases waiting for it
    if fut is not None:  # (open even if this write fails, as a cursor moved by a lease is: any later lease journals it)
        await fut
    return {"dataset": req.dataset, "size": req.size, "opened": record is not None}

# ---- a worker: groups -----------------------------------------------------------------------------
def max_buffer() -> int:
    """--max-buffer, or (0) the staleness window: what pacing may admit, so that no admitted round meets a 429."""
    return ARGS.max_buffer or (ARGS.max_staleness + 1) * max(8, S.book.pacing.batch)

async def journaled(gid: str, rec: bytes | dict | list, then=lambda: None):
    """Write a record (or several, in one commit) about group `gid`, then return then() at once: before anything
    else runs, so that a second submission of the group, waiting for this write, finds what it did."""
    S.pending[gid] = fut = [JOURNAL.append(r) for r in (rec if isinstance(rec, list) else [rec])][-1]
    try:
        await fut
        return then()
    finally:
        del S.pending[gid]

def temperature_refused(meta: dict) -> str | None:
    """Why a participant's group may not say the temperature it names (None: it may, or it names none: the trainer
    then scores it at its own --temperature). The trainer divides the logits by it, so the temperature a group claims
    scales its gradient (~1/T): only the run's sampling temperatures (--temperatures) are taken."""
    t = meta.get("temperature")
    if t is None or t in ARGS.temperatures:
        return None
    return (f"meta.temperature: {t!r} is not this run's sampling temperature: it takes "
            f"{' or '.join(map(str, ARGS.temperatures))} (--temperatures; the trainer weighs a group's gradient by its temperature)")

def paced(participant: str | None, worker_id: str) -> bool:
    """Whether an open grant of this participant's worker covers a group of its arriving now: pacing admitted it, within
    the participant's share of the batches that may train it (share_room)."""
    g = S.book.pacing.grants.get(worker_key(participant, worker_id)) if participant else None
    return g is not None and g.left > 0

def past_share(participant: str) -> str | None:
    """Why a participant's group that no grant covers finds no room in the buffer (None: it does): the participant
    holds its share of --max-buffer already (shares.py)."""
    buffered = Counter(it.who for it in S.book.buffer.values())
    share = party_shares(time.monotonic(), {*buffered, participant})[participant]
    cap = max(1, math.ceil(share * max_buffer() - 1e-9))
    if (held := buffered[participant] + S.pending_by[participant]) < cap:
        return None
    return (f"participant {participant!r} holds {held} groups of the buffer, its share of it ({cap} of {max_buffer()}: "
            f"{share:.0%}, its live workers' share (at most {allowed_workers(participant)} counted: its token's), at most "
            f"--max-participant-share {ARGS.max_participant_share:g}); "
            "a batch takes at most its share of them: send again later (Retry-After)")

QUARANTINED = "this participant is now quarantined (its token refused, its groups held out) until the run's owner reinstates it"

async def record_checks(checked: dict[str, int], failures: list[tuple[str, str, str, str]]) -> set[str]:
    """Journal, in one commit, how many groups of each participant were audited and which failed a check
    ((participant, group_id, check, why)), then apply them (book.fail). Each failure carries this proxy's
    --quarantine-after, so replay suspends exactly where this did. Returns the participants now suspended."""
    at = round(time.time(), 3)
    recs = ([{"t": "checked", "counts": checked}] if checked else []) + [
        {"t": "failed", "participant": p, "group_id": g, "check": c, "detail": why[:1000], "limit": ARGS.quarantine_after,
         "at": at} for p, g, c, why in failures]
    if not recs:
        return set()
    await [JOURNAL.append(r) for r in recs][-1]  # one commit: the last resolves when they all are in
    S.book.quarantine.checked(checked)
    return {r["participant"] for r in recs[bool(checked):]
            if S.book.fail(r["participant"], r["group_id"], r["check"], r["detail"], r["limit"], r["at"])}

def shape_problem(group: TrajectoryGroup) -> str | None:
    """Why a group does not fit this run's settings (None: it does): its group size, its token counts, token ids
    within the model's vocabulary."""
    if len(group.completions) != ARGS.group_size:
        return f"completions: {len(group.completions)} given, this run's group_size is {ARGS.group_size}"
    for what, n, limit in [("prompt_ids", len(group.prompt_ids), "max_prompt_tokens")] + [
            (f"completions[{i}].token_ids", len(c.token_ids), "max_completion_tokens") for i, c in enumerate(group.completions)]:
        if n > getattr(ARGS, limit):
            return f"{what}: {n} tokens > {limit} {getattr(ARGS, limit)}"
    if why := token_id_problem(group.prompt_ids, [c.token_ids for c in group.completions], ARGS.vocab_size):
        return f"{why} (--vocab-size)"
    return None

@app.post("/v1/groups", response_model=SubmitResponse, openapi_extra={**GROUP_BODY, **scope("worker", large_body=True)})
async def submit_group(request: Request) -> SubmitResponse:
    """Submit one scored group. Idempotent on group_id; 429 with Retry-After when the buffer is full.
    A 200 `accepted` means the group is in the bucket, recorded with the participant whose token sent it."""
    try:  # strict: a number sent as a string (or an id as 1.0) is a client bug, not something to coerce
        group = TrajectoryGroup.model_validate_json(body := await request.body(), strict=True)
    except ValidationError as e:
        raise RequestValidationError([{**x, "loc": ("body", *x["loc"])} for x in e.errors()]) from None
    if why := shape_problem(group):
        raise HTTPException(422, why)
    gid, who = group.group_id, request.scope["principal"]
    participant = None if who.name == ADMIN else who.name
    # the run's own token may omit lease_id: it is trusted (never audited), and the run's tools and tests post groups
    # with it directly (rollout.py always names its lease)
    if participant and group.lease_id is None:
        raise HTTPException(422, "lease_id, prompt_index: a participant's group must name the prompt lease it answers "
                                 "(the lease_id of POST /v1/prompts/lease) and which of its prompt indices")
    if participant and (why := temperature_refused(group.meta)):
        raise HTTPException(422, why)
    if gid in S.pending:  # the same group is being written: answer once that write is done
        await asyncio.shield(S.pending[gid])
    book = S.book
    if gid in book.window:
        book.counts["groups_duplicate"] += 1  # counted before its record is formed: the commit's counters line holds it
        try:
            await JOURNAL.append({"t": "duplicate", "group_id": gid})
        except journal.JournalWriteError:
            book.counts["groups_duplicate"] -= 1
            raise
        return SubmitResponse(status="duplicate", duplicate=True, buffer_size=len(book.buffer))
    if (newest := group.newest_version()) > S.latest:
        raise HTTPException(409, f"{'policy_version' if newest == group.policy_version else 'a token of version'} "
                                 f"{newest} is newer than the latest registered {S.latest}")
    if book.too_stale(group.policy_version):
        book.counts["groups_dropped_stale"] += 1
        try:
            await journaled(gid, {"t": "stale", "group_id": gid, "worker_id": group.worker_id,
                                  **({"participant": participant} if participant else {}),
                                  # its size, for the run's token accounting (it has no line in the journal)
                                  "tokens": {str(v): n for v, n in sampled_by_version(
                                      group.model_dump(include={"policy_version", "completions"})).items()}})
        except journal.JournalWriteError:
            book.counts["groups_dropped_stale"] -= 1
            raise
        S.senders.touch(participant, group.worker_id, time.time())
        arrived(participant, group.worker_id)
        return SubmitResponse(status="stale", duplicate=False, buffer_size=len(book.buffer))
    # receipts.py: the prompt lease it answers is the sender's, and not used up; its completions are not another's
    lease_id, index, fp = group.lease_id, group.prompt_index, fingerprint(group)
    if verdict := book.receipts.judge(participant, lease_id, index, fp, gid):
        check, why = verdict
        counted = participant is not None and check != "forgotten"  # the admin token is not audited
        held = await record_checks({}, [(participant, gid, check, why)]) if counted else set()
        raise HTTPException(409, f"{check}: {why}" + ("; counted against this participant" if counted else "")
                                 + (f"; {QUARANTINED}" if held else ""))
    if len(book.buffer) + len(S.pending) >= (cap := max_buffer()):  # stale groups are gone already (return_lease, register)
        S.rejected_full += 1
        raise HTTPException(429, f"buffer full ({cap} groups)", headers={"Retry-After": "1"})
    if participant and not (covered := paced(participant, group.worker_id)) and (why := past_share(participant)):
        S.rejected_share += 1
        retry = max(1, math.ceil(book.pacing.retry_s(time.monotonic())))
        raise HTTPException(429, why, headers={"Retry-After": str(retry)})
    # the bytes as sent are what we log and lease out when they are one line that leads with the fields
    # as we would write them (replay reads those unparsed); otherwise the canonical re-encoding, without
    # the optional fields a sender left out (a single-turn group's line carries no mask or versions)
    m = HEAD.match(body) if b"\n" not in body and b"\r" not in body else None
    keep = m and (m[1].decode(), m[2].decode(), int(m[3])) == (gid, group.worker_id, group.policy_version)
    raw = body.rstrip() if keep else group.model_dump_json(exclude_none=True).encode()
    if participant:  # the lease's dataset (for the trainer's audit) and the sender, as its token says (a client
        # cannot send these fields: unknown fields are refused)
        raw = (raw[:-1] + b',"prompt_dataset":"' + book.receipts.dataset(lease_id).encode()
               + b'","participant":"' + participant.encode() + b'"}')
    entry = Entry(gid, group.policy_version, raw, participant, bool(participant) and covered)
    receipt = {"t": "receipt", "group_id": gid, "fp": fp, **({"lease_id": lease_id, "index": index} if lease_id else {})}
    book.receipts.take(gid, lease_id, index)  # now, so that a second answer to this prompt is refused meanwhile

    def buffer() -> bool:
        ok = book.accept(entry)
        book.remember(gid, fp)
        return ok
    S.pending_by[participant] += 1
    try:
        buffered = await journaled(gid, [raw, receipt], buffer)
    except journal.JournalWriteError:
        book.receipts.untake(gid, lease_id, index)
        raise
    finally:
        S.pending_by[participant] -= 1
        if S.pending_by[participant] <= 0:
            del S.pending_by[participant]
    S.senders.touch(participant, group.worker_id, time.time(), groups=1)
    arrived(participant, group.worker_id)
    if not buffered and book.quarantine.held(participant):  # suspended while its line was being written
        raise HTTPException(403, f"participant {participant!r} is quarantined: {book.quarantine.reason(participant)}")
    if not buffered:  # a version registered while this group was being written made it stale
        return SubmitResponse(status="stale", duplicate=False, buffer_size=len(book.buffer))
    async with S.cond:
        S.cond.notify_all()
    return SubmitResponse(status="accepted", duplicate=False, buffer_size=len(book.buffer))

# ---- a worker: adapter versions and their files ----------------------------------------------------
@app.get("/v1/adapters/latest", openapi_extra=scope("worker"))
async def latest_adapter(request: Request, after: int = Query(-1, ge=-1, le=10**9),
                         wait_s: float = Query(0.0, ge=0.0, le=300.0),
                         worker_id: str | None = Query(None, min_length=1, max_length=128,
                                                       pattern=r"^[A-Za-z0-9_.:-]+$")) -> dict:
    """The newest version; long-polls up to `wait_s` for one newer than `after`. age_s: seconds since this
    proxy registered it, on its own clock (null if it did not, e.g. before a restart). worker_id (as in its
    groups): the poll is the worker's sign of life for pacing; with no new poll within --poll-grace-s of this
    one's end (answered, or its connection closed), the worker is taken for gone (pacing.py)."""
    who = request.scope["principal"]
    key = None if worker_id is None or wait_s <= 0 else worker_key(None if who.name == ADMIN else who.name, worker_id)
    gone = None
    if key is not None:
        S.book.pacing.polling(key)
        LIVE.opened(key)
        gone = asyncio.create_task(_until_disconnect(request.receive, S.versions))
    try:
        async with S.versions:  # only register() (a new version, or the final one) and a disconnect notify it
            await wait_until(lambda: S.latest > after or S.book.done or (gone is not None and gone.done()), wait_s,
                             S.versions, every_s=wait_s)
    finally:
        if key is not None:
            S.book.pacing.polled(key, time.monotonic())
            LIVE.closed(key, time.monotonic())
            gone.cancel()
    v = S.book.versions.last
    return {"version": v["version"], "step": v["step"], "published_at": v["published_at"], "done": S.book.done,
            "max_staleness": ARGS.max_staleness,
            "age_s": None if v["registered"] is None else round(time.monotonic() - v["registered"], 3)}

def registered(version: int) -> None:
    if DOWNLOADS is None:
        raise HTTPException(404, "this proxy has no bucket: there are no adapter files to hand out")
    if version not in S.book.versions:
        raise HTTPException(404, f"version {version} is not registered (latest {S.latest})")

@app.get("/v1/adapters/{version}/files", openapi_extra=scope("worker"))
async def adapter_files(version: int = Path(ge=1, le=10**9)) -> dict:
    """Where a worker downloads meta.json and the adapter files of a registered version: `url` (a presigned
    bucket URL valid expires_in_s, or the proxy path) and `path` (the proxy streams it; the fallback); and
    `meta`, meta.json itself as checked at registration (null if it no longer reads from the bucket)."""
    registered(version)
    return DOWNLOADS.listing(version, await DOWNLOADS.meta(version))

@app.get("/v1/adapters/{version}/files/{name}", openapi_extra=scope("worker"), response_class=Response)
async def adapter_file(version: int = Path(ge=1, le=10**9), name: Literal[FILES] = Path()) -> Response:
    """One file of a registered version, streamed from the bucket by the proxy (503 when --max-downloads are under way)."""
    registered(version)
    return await DOWNLOADS.stream(version, name)

# ---- the trainer: batches -------------------------------------------------------------------------
def lease_answer(bid: str | None, entries: list[Entry], dropped: int, latest: int, waited_s: float) -> Response:
    # the groups go out as the bytes we logged: no parse, no re-serialisation of 33 kB per group
    head = json.dumps({"batch_id": bid, "latest_version": latest, "buffer_size": len(S.book.buffer), "dropped_stale": dropped,
                       "expires_in_s": ARGS.lease_s if bid else None, "waited_s": round(waited_s, 3)})
    return Response(head[:-1].encode() + b', "groups": [' + b",".join(e.raw for e in entries) + b"]}", media_type="application/json")

def end_lease(bid: str) -> bool:
    """An open lease's groups back to the buffer (it ran out, its answer went unread, or the trainer released
    it); False if it was not open. Under S.cond (the caller notifies). The journal's "expire" is not awaited: if
    this write is lost, replay gives the lease a fresh lease_s, or a later lease of its groups ends it; an end
    never needs to be durable before anything else."""
    if S.deadlines.pop(bid, None) is None:
        return False
    S.book.return_lease(bid)
    JOURNAL.append({"t": "expire", "batch_id": bid})
    return True

def expire_leases(now: float) -> None:
    for bid in [b for b, deadline in S.deadlines.items() if deadline <= now]:
        end_lease(bid)

def party_shares(now: float, buffered: Iterable | None = None) -> dict:
    """Each party's share of a batch now (shares.py): None, the run's own workers; else a participant, whose live
    workers count up to what its token allows (access.Participant.workers)."""
    if buffered is None:
        buffered = Counter(it.who for it in S.book.buffer.values())
    return shares.shares(LIVE.workers(now), buffered, ARGS.max_participant_share, allowed_workers)

def allowed_workers(name: str) -> int:
    """The most live workers participant `name`'s share counts: its token's (created with --token-workers N)."""
    p = POLICY.tokens.by_name.get(name)
    return 1 if p is None else p.workers

def expected(now: float, version: int) -> dict:
    """The parties with a round on its way -> whether a batch trained from `version` is the last that can train it: an
    open grant of one of their workers (not given up: its worker's polls did not stop; the last chance where the next
    batch leaves its version stale), or a live worker of theirs that sent a group within shares.LIVE_S (between two
    rounds: pacing may hold its next grant while the buffer holds the others' groups). A batch waits for them a while
    (shares.select, stall_s)."""
    wall, out = time.time(), {}
    for key in LIVE.keys(now):
        if (w := S.senders.workers.get(key)) is not None and w["groups"] and wall - w["last_seen"] < shares.LIVE_S:
            out[shares.party(key)] = False
    for g in S.book.pacing.grants.values():
        if g.left > 0 and not g.gone:
            p = shares.party(g.key)
            out[p] = out.get(p, False) or S.book.too_stale(g.version, version + 1)
    return out

STALL = {"since": None}  # when the batch asked for could first have been made but for the rounds on their way

def stall_s() -> float:
    """How long a batch waits for the rounds of parties under their share (expected) once it could be made without
    them: twice the fleet's median round time, at least --poll-grace-s, at most --grant-s (none measured yet: that). A
    party that keeps a round on its way and sends little holds each batch up at most this long."""
    r, _ = S.book.pacing.fleet_round()
    return ARGS.grant_s if r is None else min(ARGS.grant_s, max(ARGS.poll_grace_s, 2 * r))

def batch_of(n: int, version: int) -> tuple[list[Entry], dict] | None:
    """The batch of n the trainer gets now, trained from `version` (groups it leaves stale are passed over), and what
    its participants paid of the prompts they owe; None while it cannot be made. Each participant takes at most its
    share (shares.py); where no participant is live or buffered, the oldest n, as ever."""
    book = S.book
    if len(book.buffer) < n:  # (asked on every arrival while a lease waits: the cheap answer first)
        return None
    fresh, now = book.fresh(version), time.monotonic()
    buffered, live = Counter(it.who for it in fresh), LIVE.workers(now)
    if len(fresh) < n:
        return None
    if not any(p is not None for p in (*buffered, *live)):  # the run's own groups only
        return fresh[:n], {}
    quota, owed = shares.quotas(party_shares(now, buffered), n), book.receipts.owed
    urgent = lambda it: it.paced and book.too_stale(it.version, version + 1)  # noqa: E731 - its last batch
    if (got := shares.select(fresh, n, quota, owed, waits := expected(now, version), urgent)) is not None or not waits:
        STALL["since"] = None if got is None else STALL["since"]
        return got
    if (got := shares.select(fresh, n, quota, owed, {}, urgent)) is None:  # not for want of their rounds
        STALL["since"] = None
        return None
    if STALL["since"] is None:  # (reset by a lease, or once it is no longer their rounds that it waits for)
        STALL["since"] = now
    return got if now - STALL["since"] >= stall_s() else None

@app.post("/v1/batches/lease", response_model=LeaseResponse, openapi_extra=scope("trainer"))
async def lease_batch(req: LeaseRequest, request: Request) -> Response:
    """The oldest `num_groups` fresh-enough groups, waiting up to `wait_s` for them to arrive; an empty
    answer (batch_id null) if they did not. A client that gives up waiting takes nothing."""
    if req.after_version is not None and req.after_version > S.latest + 1:
        raise HTTPException(409, f"after_version {req.after_version} is more than one past the latest registered "
                                 f"version {S.latest}: register the versions before it first")
    gone = asyncio.create_task(_until_disconnect(request.receive))
    book = S.book

    def trains_from() -> int:
        """The version this batch will be trained from: the latest, or the one the trainer registers before it
        (a batch asked for while it trains the one before: after_version). The staleness filter counts from it."""
        return max(S.latest, req.after_version or 0)

    # no version on its way (a trainer restarted while holding a batch never registers it), or one (pacing.py)
    if book.pacing.requested(req.num_groups, req.groups_left, trains_from() - S.latest):
        JOURNAL.append({"t": "demand", "groups_left": req.groups_left})  # not awaited: the next lease carries it too
    pace()
    asked = time.monotonic()
    FLEET.asked(asked, holds_work=trains_from() > S.latest)
    try:
        async with S.cond:
            before = book.counts["groups_dropped_stale"]
            await wait_until(lambda: expire_leases(time.monotonic()) or gone.done() or
                             batch_of(req.num_groups, max(S.pending_version, trains_from())) is not None, req.wait_s)
            waited = time.monotonic() - asked
            picked = None if gone.done() else batch_of(req.num_groups, max(S.pending_version, trains_from()))
            if not picked:
                return lease_answer(None, [], book.counts["groups_dropped_stale"] - before, S.latest, waited)
            entries, paid = picked
            STALL["since"] = None
            bid, latest, left = uuid.uuid4().hex, trains_from(), book.pacing.left_after(len(entries))
            book.lease(bid, [e.gid for e in entries], ARGS.lease_s, latest, left, at=time.monotonic(), paid=paid)
            S.deadlines[bid] = time.monotonic() + ARGS.lease_s
            # "latest": the version that trains it (the staleness histogram; replay counts the batches held from it)
            fut = JOURNAL.append({"t": "lease", "batch_id": bid, "group_ids": [e.gid for e in entries], "lease_s": ARGS.lease_s,
                                  "expires_at": round(time.time() + ARGS.lease_s, 3), "latest": latest,
                                  **({} if left is None else {"left": left}), **({"paid": paid} if paid else {})})
        try:
            await fut  # the trainer must be able to ack this batch after a restart
        except journal.JournalWriteError:  # the write failed: undo, so that nothing changed
            async with S.cond:
                if S.deadlines.pop(bid, None) is not None:  # (unless it ran out during the write: then it is back)
                    book.unlease(bid, latest, paid)
                    S.cond.notify_all()
            raise
        for e in entries:
            STALENESS.observe(latest - e.version)
        if gone.done():  # nobody will read this answer: give the groups back now, not after lease_s
            async with S.cond:
                if end_lease(bid):
                    S.cond.notify_all()
        # latest_version: the one its groups were judged fresh against, not a version registered during the journal
        # write (that one would make them look a version staler than max_staleness; test_proxy_defects met it),
        # and never one not registered yet (after_version: the trainer knows that one)
        return lease_answer(bid, entries, book.counts["groups_dropped_stale"] - before, min(S.latest, latest), waited)
    finally:
        FLEET.answered(time.monotonic())
        gone.cancel()

def open_lease(batch_id: str) -> Held:
    """The open lease `batch_id`, or the 409/410/404 that says why there is none."""
    if batch_id in S.book.acked:
        raise HTTPException(409, f"batch {batch_id} was already acked")
    if batch_id in S.book.expired:
        raise HTTPException(410, f"lease of batch {batch_id} expired; its groups went back to the buffer")
    if batch_id not in S.book.leases:
        raise HTTPException(404, f"no open lease with batch_id {batch_id}")
    return S.book.leases[batch_id]

@app.post("/v1/batches/{batch_id}/renew", openapi_extra=scope("trainer"))
async def renew_batch(batch_id: str = BatchId) -> dict:
    """Extend an open lease to lease_s from now (the trainer holds it until the checkpoint with its update)."""
    async with S.cond:
        held, deadline = open_lease(batch_id), S.deadlines[batch_id]
        # extended before the write, so that it cannot run out while the write is under way
        S.deadlines[batch_id] = time.monotonic() + ARGS.lease_s
        S.book.renew(batch_id, ARGS.lease_s)
        fut = JOURNAL.append({"t": "renew", "batch_id": batch_id, "lease_s": ARGS.lease_s})
    try:
        await fut
    except journal.JournalWriteError:
        if batch_id in S.book.leases:
            S.deadlines[batch_id] = deadline
            S.book.renew(batch_id, held.lease_s)
        raise
    return {"batch_id": batch_id, "expires_in_s": ARGS.lease_s}

@app.post("/v1/batches/{batch_id}/ack", openapi_extra=scope("trainer"))
async def ack_batch(batch_id: str = BatchId) -> dict:
    """The trainer's update from this batch is safe: its groups are consumed for good."""
    async with S.cond:
        held, deadline = open_lease(batch_id), S.deadlines.pop(batch_id)
        groups = S.book.ack(batch_id)
        fut = JOURNAL.append({"t": "ack", "batch_id": batch_id})
    try:
        await fut
    except journal.JournalWriteError:
        S.book.unack(batch_id, held)
        S.deadlines[batch_id] = deadline
        raise
    return {"acked": groups}

@app.post("/v1/batches/{batch_id}/release", openapi_extra=scope("trainer"))
async def release_batch(batch_id: str = BatchId) -> dict:
    """The trainer will not train this batch (it stops with the next one asked for ahead, lib/train/batches.py):
    its groups go back to the front of the buffer now, not when the lease runs out."""
    async with S.cond:
        held = open_lease(batch_id)
        end_lease(batch_id)
        S.cond.notify_all()
    return {"released": len(held.ids)}

@app.post("/v1/batches/{batch_id}/audit", openapi_extra=scope("trainer"))
async def audit_batch(req: AuditReport, batch_id: str = BatchId) -> dict:
    """The trainer's audit of an open batch (lib/train/audit.py): the groups it checked, and those that failed
    (reward re-scored, prompt tokens, behaviour logprobs). Each failure counts against the participant that sent
    the group as this proxy recorded it; past --quarantine-after it is suspended. Answers each one's standing."""
    who = {it.gid: it.who for it in open_lease(batch_id).items}
    if missing := [g for g in [*req.checked, *(f.group_id for f in req.failures)] if g not in who]:
        raise HTTPException(422, f"not groups of batch {batch_id}: {missing[:4]}")
    if ours := [f.group_id for f in req.failures if who[f.group_id] is None]:
        raise HTTPException(422, f"groups {ours[:4]} came with the admin token: the run's own groups are not audited")
    checked = Counter(who[g] for g in dict.fromkeys(req.checked) if who[g] is not None)
    await record_checks(dict(checked), [(who[f.group_id], f.group_id, f.check, f.detail) for f in req.failures])
    named = {*checked, *(who[f.group_id] for f in req.failures)}
    return {"participants": {n: S.book.quarantine.public(n) for n in sorted(named)}}

# ---- the trainer: versions ------------------------------------------------------------------------
REGISTER_LOCK = asyncio.Lock()  # one version registration at a time (rare; it awaits the bucket)

@app.post("/v1/adapters", openapi_extra=scope("trainer"))
async def register_adapter(req: RegisterRequest) -> dict:
    """Register a version the trainer has published to the bucket (monotonic, complete, else 409/422)."""
    return await register(req)

async def register(req: RegisterRequest, adopted: bool = False) -> dict:
    async with REGISTER_LOCK:  # check, verify, journal, then apply: no one sees a version that may not stick
        if S.book.done:
            raise HTTPException(409, f"the run is over: version {S.latest} was registered as final")
        if req.version <= S.latest:
            raise HTTPException(409, f"version {req.version} is not newer than the latest {S.latest}")
        meta = await asyncio.to_thread(check_published, BUCKET, req.version) if BUCKET is not None else None
        v = {"version": req.version, "step": req.step, "published_at": req.published_at}
        S.pending_version = req.version  # leases decided from now on come after it in the log
        try:
            await JOURNAL.append({"t": "version", **v, "final": req.final})
        finally:
            S.pending_version = 0
        if DOWNLOADS is not None and meta is not None:
            DOWNLOADS.remember(req.version, meta)
        # applied as soon as its commit is in, before any await: the commits a live proxy applies in another order
        # than its journal's (a quarantine's hold-out resumed first) leave a state its replay does not reach
        dropped = S.book.register(**v, final=req.final, registered=None if adopted else time.monotonic())
        FLEET.registered(time.monotonic())
        async with S.cond:
            S.cond.notify_all()
        async with S.versions:
            S.versions.notify_all()
        pace()  # a new version: room for rounds generated with it (and after the final one, nothing)
        return {"latest_version": S.latest, "dropped_stale": dropped}

# ---- watching the run: stats, state, metrics ----------------------------------------------------------
@app.get("/v1/stats", openapi_extra=scope("trainer"))
async def get_stats() -> dict:
    tokens, trust = POLICY.tokens, S.book.quarantine
    roles = {n: {"role": p.role.name, "max_rps": p.max_rps, "revoked": p.revoked_at is not None,
                 **({"checks": trust.public(n), "workers": p.workers} if n != ADMIN else {})}
             for n, p in [(ADMIN, tokens.admin), *tokens.by_name.items()]}
    return {"buffer_size": len(S.book.buffer), "latest_version": S.latest, "done": S.book.done, "open_leases": len(S.book.leases),
            "max_staleness": ARGS.max_staleness, "group_size": ARGS.group_size, "max_buffer": max_buffer(), **S.counters,
            "staleness_hist": {str(k): v for k, v in sorted(S.book.staleness_hist.items())},
            **S.senders.stats(time.time(), roles),
            "duplicate_window": {"groups": len(S.book.window), "min_version": S.book.window.floor},
            "cursors": S.cursors.table, "pacing": S.book.pacing.stats(), "waiting_for_grants": len(WAITING),
            "incarnation": S.incarnation, "pending_writes": len(JOURNAL.queue),
            "quarantined": {n: trust.reason(n) for n in trust.people if trust.held(n)},
            "quarantine_after": ARGS.quarantine_after, "open_prompt_leases": len(S.book.receipts.leases),
            "shares": {(p or ADMIN): round(x, 4) for p, x in sorted(party_shares(time.monotonic()).items(), key=lambda kv: kv[0] or "")},
            "live_workers": {(p or ADMIN): n for p, n in sorted(LIVE.workers(time.monotonic()).items(), key=lambda kv: kv[0] or "")},
            "prompts_owed": dict(S.book.receipts.owed), "max_participant_share": ARGS.max_participant_share,
            "peak_rss_mb": round(peak_rss_mb(), 1), "leadership": leader_stats(),
            "fleet": {**FLEET.stats(time.monotonic()), **LEAVING.stats()}}

@app.get("/v1/state", openapi_extra=scope("trainer"))
async def get_state() -> dict:
    """The book in full (book.Book.state): group ids in buffer order, open leases, the duplicate window,
    acked and expired batches, versions, counts. A restart rebuilds exactly this from the journal."""
    return S.book.state()

# /metrics (telemetry.py): the histograms are observed as things happen, the state's numbers read at scrape time
telemetry.install(lambda: S.counters,
                  lambda: {"buffer_size": len(S.book.buffer), "open_leases": len(S.book.leases), "latest_version": S.latest,
                           "pending_writes": len(JOURNAL.queue), "peak_rss_mb": peak_rss_mb(), **SWEEPER.gauges(), **leader_gauges()},
                  lambda: [*S.senders.collect(), *S.book.quarantine.collect()])

def leader_gauges() -> dict:
    """/metrics' view of leader_stats: proxy_leader (1 leads, 0 stands by), proxy_leading_seconds, a standby's
    proxy_standby_lag_commits and proxy_standby_behind_seconds, and who leads since when on either side:
    proxy_leader_incarnation and proxy_leader_since_seconds (unix time; a standby reads both in the leader record)."""
    st = leader_stats()
    led = st.get("leader", {}) if st["role"] == "standby" else st
    who = {k: led[f] for k, f in (("leader_incarnation", "incarnation"), ("leader_since_seconds", "since"))
           if led.get(f) is not None}
    if st["role"] == "standby":
        return {"leader": 0, "standby_lag_commits": st["lag_commits"], "standby_behind_seconds": st["behind_s"], **who}
    return {"leader": 1, "leading_seconds": st.get("leading_s") or 0.0, **who}

@app.get("/metrics", response_class=Response, openapi_extra=scope("trainer"))
async def metrics() -> Response:
    """Prometheus text exposition (scrape with a trainer or admin token as a bearer token)."""
    return Response(telemetry.exposition(), media_type=telemetry.MEDIA_TYPE)

# ---- the run's owner; then the routes of routing.py and access.py ----------------------------------------
@app.post("/v1/workers/leave", openapi_extra=scope("admin"))
async def ask_to_leave(req: LeaveRequest) -> dict:
    """Ask one of the run's own workers to leave (the supervisor's scale-down, fleet.py): its next prompt request
    gets no grant and `leave`, and a request of its waiting for a grant is answered now, without one. Live only."""
    if not LEAVING.ask(req.worker_id, req.why):
        raise HTTPException(429, f"{Leaving.MAX} workers were asked to leave already: no more is kept")
    return {"worker_id": req.worker_id, "dismissed_requests": WAITING.dismiss(req.worker_id),
            "told": req.worker_id in LEAVING.left}

@app.post("/v1/participants/{name}/reinstate", openapi_extra=scope("admin"))
async def reinstate(name: NamePath) -> dict:
    """Lift a participant's quarantine (its token works again, its count of failed checks starts over)."""
    if not S.book.quarantine.held(name):
        known = name in POLICY.tokens.by_name
        raise HTTPException(409 if known else 404, f"participant {name!r} is not quarantined" if known else f"no participant {name!r}")
    rec = {"t": "reinstate", "participant": name, "at": round(time.time(), 3)}
    await JOURNAL.append(rec)
    S.book.reinstate(name, rec["at"])
    return {"participant": name, **S.book.quarantine.public(name)}

def served_version_problem(version: int) -> str | None:
    """Why `version` cannot be the adapter a worker answered a routed request with: neither the base model (0) nor a
    version this run registered (a client is told which version answered it)."""
    if version == 0 or version in S.book.versions:
        return None
    return f"adapter_version {version} is not a version this run registered (the latest is {S.latest})"

# POST /v1/chat/completions answered by the run's own workers (routing.py); a leader that stops answering ends its waits
routing.install(app, served_version_problem, lambda: refusal())
access.install(app)  # the token endpoints, last: routes are tried in order, and these are rare

if __name__ == "__main__":
    import tyro

    from common import script_args  # drops the shared modules that HF Jobs ships in argv
    ARGS = tyro.cli(Args, args=script_args())
    if problems := settings_problems(ARGS):
        raise SystemExit("proxy: " + "; ".join(problems))
    routing.LIMITS = ARGS.route
    if not ARGS.token and ARGS.host not in ("127.0.0.1", "::1", "localhost"):  # any other address may be reachable
        raise SystemExit(f"refusing to listen on {ARGS.host} without a token: set PROXY_TOKEN or --token")
    sys.setswitchinterval(0.001)  # the journal writes from a thread: hand it the GIL back sooner (p99 -15% in A/B runs)
    serve(app, ARGS.host, ARGS.port, Limits(ARGS.head_timeout_s, ARGS.body_timeout_s, ARGS.max_head_kb << 10, ARGS.max_connections),
          on_stop=STOPPING.set)

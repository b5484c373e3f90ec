# /// script
# requires-python = ">=3.11"
# dependencies = ["slatedb==0.17.0", "moto[server]>=5", "boto3", "tyro", "aiohttp", "httpx", "werkzeug"]
# ///
"""The proxy's journal (lib/proxy/journal.py) against SlateDB (PyPI `slatedb`) on the same load, in one run,
against one local S3 server (moto) that counts every request it serves (issue 46: "build on a well-kept engine").

    .venv/bin/pip install --target /tmp/slatedb-site -r bench/slatedb_requirements.txt
    PYTHONPATH=/tmp/slatedb-site .venv/bin/python bench/slatedb_vs_journal.py                # ~5 minutes
    PYTHONPATH=/tmp/slatedb-site .venv/bin/python bench/slatedb_vs_journal.py --repeats 1 --sizes 2000  # a quick look

slatedb is not in requirements.txt (evaluated, not adopted: docs/proxy.md, "SlateDB"); results and their reading:
docs/results/proxy.md.

What each side does per accepted group (proxy.py's POST /v1/groups: the group's line and its receipt):
- journal: journal.Writer, as proxy.py drives it (two appends, await the last; depth 1; every commit ends with a
  counters line): a group commit is one If-None-Match PUT of all records queued while the previous put flew.
- slatedb: one WriteBatch (the group's line and its receipt under the group's key), Db.write, then
  WriteHandle.await_durable(): SlateDB gathers the writes of a flush interval into one WAL object. With its
  default flush interval (100 ms) and with 10 ms.

Phases, each side in turn within a repeat (the order rotates), medians of the repeats:
1. latency: commit latency (from the group's scheduled arrival to its durable answer) p50/p99, paced (Poisson
   arrivals at --rate groups/s for --paced-s) and flood (--clients callers, each sending again when answered,
   --flood-groups in all); bucket requests (by kind, from the server's count) per group.
2. follow: during the paced phase a follower reads what the writer commits: the journal's standby
   (leadership.Follower, as proxy.py --standby drives it: follow() every 0.25 s) or a SlateDB DbReader (manifest
   poll 250 ms, get() of the tip key every 0.25 s); lag = when it first held a group minus its durable answer.
3. restart and catch-up, for each --sizes N groups already in the store (written once per size, the journal as
   bench/proxy_restart.py writes it: 8 groups per commit, then their lease, the next version and the ack; SlateDB:
   the 8 groups with a state key naming them buffered, then the state key with the buffer empty; the last 8 stay
   buffered): restart = open until the state and the buffered groups are read again (journal:
   snapshots.Keeper.start(), fencing included, with no snapshot (a full replay, once) and with one; SlateDB:
   DbBuilder.build(), the state key, the groups it names); catch-up = a follower started late until it holds the
   same (journal: Follower.load + follow until nothing is left unapplied; SlateDB: DbReaderBuilder.build(), the
   same reads); bucket requests of each.
4. fencing: a second writer opens; does the first writer's next commit fail, and how.
5. idle cost: bucket requests per second of a writer with nothing to write, and with a follower beside it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "lib" / "proxy"), str(ROOT / "bench")]
import common  # noqa: E402
import journal  # noqa: E402
from leadership import Follower  # noqa: E402
from proxy_restart import free_port, group_line, write_journal  # noqa: E402
from snapshots import Keeper  # noqa: E402

LIMITS = {"max_staleness": common.MAX_STALENESS, "lease_s": 300.0}  # proxy.py's defaults
ACCESS = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench", "aws_region": "us-east-1"}


@dataclass
class Args:
    repeats: int = 3
    """alternating repeats of the latency and restart phases (medians are reported)"""
    rate: float = 200.0
    """paced: groups/s offered (Poisson arrivals)"""
    paced_s: float = 3.0
    clients: int = 64
    """flood: concurrent callers"""
    flood_groups: int = 400
    sizes: list[int] = field(default_factory=lambda: [2000, 20_000])
    """groups already in the store for the restart and catch-up phase"""
    group_size: int = 8
    tokens: int = 256
    seed: int = 0
    latency: bool = True
    """run the latency phase (--no-latency: restart, catch-up, fencing and idle cost only)"""
    serve_s3: int = 0
    """(internal) serve the counting S3 server on this port"""


# ---- the S3 server: moto, counting what it serves -------------------------------------------------------
def request_kind(env: dict) -> str:
    """PUT (conditional or not), GET, HEAD, LIST (ListObjectsV2), DELETE...: what an S3 request is billed as."""
    method, query = env["REQUEST_METHOD"], env.get("QUERY_STRING", "")
    if method == "GET" and "list-type" in query:
        return "LIST"
    if method == "PUT":
        return "PUT if-none-match" if env.get("HTTP_IF_NONE_MATCH") else "PUT if-match" if env.get("HTTP_IF_MATCH") else "PUT"
    return method


class CountingS3:
    """moto's WSGI application, counting requests by kind (and refusals: 412, 409); GET /__counts answers them."""

    def __init__(self):
        from moto.server import DomainDispatcherApplication, create_backend_app
        self.inner = DomainDispatcherApplication(create_backend_app)
        self.counts, self.lock = Counter(), threading.Lock()

    def __call__(self, env, start_response):
        if env.get("PATH_INFO") == "/__counts":
            with self.lock:
                body = json.dumps(self.counts).encode()
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        kind = request_kind(env)
        with self.lock:
            self.counts[kind] += 1
        return self.inner(env, RefusalCounter(self, kind, start_response))


@dataclass
class RefusalCounter:
    server: CountingS3
    kind: str
    start_response: object

    def __call__(self, status: str, headers, exc_info=None):
        if status[:3] in ("409", "412"):
            with self.server.lock:
                self.server.counts[f"{self.kind} refused {status[:3]}"] += 1
        return self.start_response(status, headers, exc_info) if exc_info else self.start_response(status, headers)


def serve_s3(port: int) -> None:
    from moto.server import MotoRequestHandler
    from werkzeug.serving import make_server
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    make_server("127.0.0.1", port, CountingS3(), True, request_handler=MotoRequestHandler).serve_forever()


def counts(endpoint: str) -> Counter:
    return Counter(json.loads(urllib.request.urlopen(f"{endpoint}/__counts", timeout=10).read()))


def per_group(before: Counter, after: Counter, groups: int) -> dict:
    return {k: round((after[k] - before[k]) / groups, 3) for k in sorted(after) if after[k] - before[k]}


# ---- the two stores, one interface: open, submit one group durably, close --------------------------------
class JournalStore:
    """journal.Writer as proxy.py drives it; `committed` keeps when each commit landed (for the follower's lag)."""
    name = "journal"

    def __init__(self, endpoint: str, run: str):
        self.bucket = common.Bucket("bench", run, endpoint)
        self.counters = {"groups_accepted": 0}
        self.landed: dict[str, tuple[float, int]] = {}  # commit key -> (when, groups accepted by then)
        self.foreign: list[str] = []  # what the writer said when another process held its next key

    async def open(self) -> None:
        self.writer = journal.Writer(self.bucket, 0, 1, trailer=lambda: [{"t": "counters", "counters": dict(self.counters)}],
                                     committed=self.on_commit, on_foreign=self.foreign.append)
        self.task = asyncio.create_task(self.writer.run())

    def on_commit(self, key: str, at: float, records: list) -> None:
        self.landed[key] = (time.perf_counter(), records[-1]["counters"]["groups_accepted"])

    async def submit(self, gid: str, raw: bytes, receipt: dict) -> None:
        self.counters["groups_accepted"] += 1
        await [self.writer.append(r) for r in (raw, receipt)][-1]

    async def close(self) -> None:
        self.task.cancel()

    def commits(self) -> int:
        return self.writer.seq


def slate_store(endpoint: str):
    import slatedb.uniffi as sdb
    builder = sdb.ObjectStoreBuilder.from_url("s3://bench")
    for k, v in {"aws_endpoint": endpoint, "aws_allow_http": "true", **ACCESS}.items():
        builder.with_config(k, v)
    return builder.build()


def byte_copy(memmove: bool) -> None:
    """How the binding hands a bytes value to Rust. As shipped (uniffi's generated Python, slatedb 0.17.0):
    _UniffiRustBufferBuilder.write copies it one byte at a time in a Python loop (16 ms of CPU for a 33 kB group
    line on this machine, holding the GIL). memmove=True replaces that loop with one ctypes.memmove, to measure
    the engine without its binding's copy: a diagnostic, not something to ship."""
    from slatedb.uniffi._slatedb_uniffi import slatedb as generated
    builder = generated._UniffiRustBufferBuilder
    if not hasattr(builder, "shipped_write"):
        builder.shipped_write = builder.write
    builder.write = memmove_write if memmove else builder.shipped_write


def memmove_write(self, value) -> None:
    import ctypes
    with self._reserve(len(value)):  # (may reallocate self.rbuf before the copy)
        ctypes.memmove(ctypes.addressof(self.rbuf.data.contents) + self.rbuf.len, bytes(value), len(value))


class SlateStore:
    """One WriteBatch per group (its line and its receipt), Db.write, await_durable (SlateDB's group commit is its
    flush interval: every write of an interval goes into one WAL object)."""

    def __init__(self, endpoint: str, run: str, flush_interval: str = "100ms", memmove: bool = False):
        self.endpoint, self.path, self.flush_interval, self.memmove = endpoint, f"{run}/db", flush_interval, memmove
        self.name = f"slatedb {flush_interval}" + (" memmove" if memmove else "")
        self.tip = 0

    async def open(self) -> None:
        import slatedb.uniffi as sdb
        byte_copy(self.memmove)
        builder = sdb.DbBuilder(self.path, slate_store(self.endpoint))
        settings = sdb.Settings.default()
        settings.set("flush_interval", json.dumps(self.flush_interval))
        builder.with_settings(settings)
        self.db = await builder.build()

    async def submit(self, gid: str, raw: bytes, receipt: dict) -> None:
        import slatedb.uniffi as sdb
        self.tip += 1
        batch = sdb.WriteBatch()
        batch.put(b"group/" + gid.encode(), raw)
        batch.put(b"receipt/" + gid.encode(), json.dumps(receipt).encode())
        batch.put(b"tip", b"%d" % self.tip)  # what the follower reads (the newest accepted, by count)
        handle = await self.db.write(batch)
        await handle.await_durable()

    async def close(self) -> None:
        await self.db.shutdown()

    def commits(self) -> int:
        return -1  # (its WAL objects: counted by the server as PUT if-none-match)


# ---- phase 1 and 2: latency under load, with a follower ----------------------------------------------------
def quantiles(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return xs[len(xs) // 2] * 1000, xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1000


async def paced(store, template: bytes, rate: float, seconds: float, durable: list[float]) -> list[float]:
    """Poisson arrivals at `rate`; each group's latency counts from its scheduled arrival."""
    rng, lat, tasks = random.Random(1), [], []
    t0, at = time.perf_counter(), 0.0

    async def one(i: int, due: float) -> None:
        gid = uuid.uuid4().hex
        await store.submit(gid, template.replace(b"X" * 32, gid.encode(), 1), receipt(gid, i))
        now = time.perf_counter()
        lat.append(now - due)
        durable.append(now)
    i = 0
    while at < seconds:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        tasks.append(asyncio.create_task(one(i, t0 + at)))
        at, i = at + rng.expovariate(rate), i + 1
    await asyncio.gather(*tasks)
    return lat


async def flood(store, template: bytes, clients: int, groups: int) -> tuple[list[float], float]:
    lat, left = [], [groups]

    async def client(c: int) -> None:
        while left[0] > 0:
            left[0] -= 1
            gid, t = uuid.uuid4().hex, time.perf_counter()
            await store.submit(gid, template.replace(b"X" * 32, gid.encode(), 1), receipt(gid, left[0]))
            lat.append(time.perf_counter() - t)
    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return lat, time.perf_counter() - t0


def receipt(gid: str, index: int) -> dict:
    """The receipt proxy.py journals beside a group (its fingerprint; a group sent with the admin token: no lease)."""
    return {"t": "receipt", "group_id": gid, "fp": gid}


class JournalFollower:
    """The standby's follower (leadership.Follower over a snapshots.Keeper), stepped as proxy.py --standby steps it."""

    def __init__(self, store: JournalStore):
        self.store, self.follower = store, Follower(Keeper(store.bucket, **LIMITS), term_s=2.0)
        self.seen: list[float] = []  # when the follower first held the i-th accepted group

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.to_thread(self.follower.load)
        while not stop.is_set():
            await asyncio.to_thread(self.follower.follow)
            now, after = time.perf_counter(), self.follower.after
            held = self.store.landed.get(after, (0, 0))[1] if after else 0
            self.seen += [now] * (held - len(self.seen))
            await asyncio.sleep(0.25)


class SlateFollower:
    """A DbReader on the writer's path (manifest polled every 250 ms), reading the tip key every 0.25 s."""

    def __init__(self, store: SlateStore):
        self.store, self.seen = store, []

    async def run(self, stop: asyncio.Event) -> None:
        import slatedb.uniffi as sdb
        builder = sdb.DbReaderBuilder(self.store.path, slate_store(self.store.endpoint))
        builder.with_options(sdb.ReaderOptions(manifest_poll_interval_ms=250, checkpoint_lifetime_ms=60_000,
                                               max_memtable_bytes=64 << 20, skip_wal_replay=False))
        reader = await builder.build()
        while not stop.is_set():
            tip = int(await reader.get(b"tip") or 0)
            now = time.perf_counter()
            self.seen += [now] * (tip - len(self.seen))
            await asyncio.sleep(0.25)
        await reader.shutdown()


async def latency_round(store, follower_cls, a: Args, endpoint: str, template: bytes) -> dict:
    """One side: paced with a follower, then flood (no follower): latencies, requests per group, follower lag."""
    await store.open()
    out = {}
    c0, durable, stop = counts(endpoint), [], asyncio.Event()
    follower = follower_cls(store)
    following = asyncio.create_task(follower.run(stop))
    lat = await paced(store, template, a.rate, a.paced_s, durable)
    await asyncio.sleep(1.0)  # the follower's last steps
    stop.set()
    await following
    out["paced"] = (*quantiles(lat), per_group(c0, counts(endpoint), len(lat)))
    lag = [seen - done for seen, done in zip(follower.seen, durable)]
    out["follow_lag"] = quantiles(lag) if len(lag) == len(durable) else (float("nan"), float("nan"))
    c1, commits0 = counts(endpoint), store.commits()
    lat, took = await flood(store, template, a.clients, a.flood_groups)
    out["flood"] = (*quantiles(lat), per_group(c1, counts(endpoint), len(lat)), len(lat) / took)
    await store.close()
    return out


# ---- phase 3: restart and catch-up of a store holding N groups ------------------------------------------------
async def slate_fill(endpoint: str, path: str, n: int, a: Args) -> None:
    """N groups as a SlateDB-backed proxy would keep them: per 8, one batch with the groups and the state key naming
    them buffered; then (their lease acked) the state key again, buffer empty; durable every 32 groups (Db.flush).
    (The state in one key, as the journal's snapshot holds the ledger: a buffer index of one key per group, deleted
    at the ack, made a start scan the deletions of the whole run: 12-26 s at 20k groups.)"""
    import slatedb.uniffi as sdb
    byte_copy(memmove=True)  # (the layout does not depend on how the bytes reach Rust; as shipped it takes minutes)
    db = await sdb.DbBuilder(path, slate_store(endpoint)).build()
    rng = random.Random(a.seed)
    template = group_line("X" * 32, "bench", 0, a.group_size, a.tokens, rng)
    for step in range(n // 8):
        gids = [uuid.uuid4().hex for _ in range(8)]
        batch = sdb.WriteBatch()
        for g in gids:
            batch.put(b"group/" + g.encode(), template.replace(b"X" * 32, g.encode(), 1))
        batch.put(b"state", json.dumps({"version": step, "groups_acked": 8 * step, "buffer": gids}).encode())
        await db.write(batch)
        if step < n // 8 - 1:  # the last 8 stay buffered
            batch = sdb.WriteBatch()
            batch.put(b"state", json.dumps({"version": step + 1, "groups_acked": 8 * (step + 1), "buffer": []}).encode())
            await db.write(batch)
        if step % 4 == 3:
            await db.flush()
    await db.flush()
    await db.shutdown()
    byte_copy(memmove=False)


async def slate_state(db) -> int:
    """What a start needs: the state key and every group it names buffered. Returns how many groups it read."""
    state = json.loads(await db.get(b"state"))
    groups = [await db.get(b"group/" + g.encode()) for g in state["buffer"]]
    assert all(groups), "a buffered group is missing"
    return len(groups)


async def slate_restart(endpoint: str, path: str) -> float:
    import slatedb.uniffi as sdb
    t0 = time.perf_counter()
    db = await sdb.DbBuilder(path, slate_store(endpoint)).build()
    assert await slate_state(db) == 8
    took = time.perf_counter() - t0
    await db.shutdown()
    return took


async def slate_catch_up(endpoint: str, path: str) -> float:
    import slatedb.uniffi as sdb
    t0 = time.perf_counter()
    reader = await sdb.DbReaderBuilder(path, slate_store(endpoint)).build()
    assert await slate_state(reader) == 8
    took = time.perf_counter() - t0
    await reader.shutdown()
    return took


def journal_restart(bucket: common.Bucket) -> tuple[float, Keeper, int, int]:
    """proxy.py's start: snapshots.Keeper.start() (newest snapshot, the commits after it, the fence).
    Returns (seconds, the keeper, this start's incarnation, groups buffered)."""
    t0, keeper = time.perf_counter(), Keeper(bucket, **LIMITS)
    live, incarnation, _ = keeper.start()
    return time.perf_counter() - t0, keeper, incarnation, len(live["buffer"])


def journal_catch_up(bucket: common.Bucket) -> float:
    """A standby started late: Follower.load (the snapshot), then follow() until no commit is left unapplied."""
    t0, follower = time.perf_counter(), Follower(Keeper(bucket, **LIMITS), term_s=2.0)
    follower.load()
    while follower.follow() or follower.unapplied:
        pass
    return time.perf_counter() - t0


async def journal_restart_checked(bucket: common.Bucket) -> float:
    took, _, _, buffered = await asyncio.to_thread(journal_restart, bucket)
    assert buffered == 8, f"the journal's start buffered {buffered} groups, not the last 8"
    return took


async def restart_phase(a: Args, endpoint: str, n: int) -> dict:
    """{measure: (median seconds, bucket requests of its last run by kind)}"""
    run = f"restart-{n}-{uuid.uuid4().hex[:6]}"
    bucket, path = common.Bucket("bench", f"{run}-j", endpoint), f"{run}-s/db"
    t0 = time.perf_counter()
    await asyncio.to_thread(write_journal, bucket, n, a)
    t1 = time.perf_counter()
    await slate_fill(endpoint, path, n, a)
    t2 = time.perf_counter()
    print(f"  filled {n} groups: journal {t1 - t0:.1f}s, slatedb {t2 - t1:.1f}s", flush=True)
    c0 = counts(endpoint)
    full, keeper, inc, buffered = await asyncio.to_thread(journal_restart, bucket)  # no snapshot yet: every commit
    assert buffered == 8, f"the journal's start buffered {buffered} groups, not the last 8"
    out = {"journal full replay": ([full], per_group(c0, counts(endpoint), 1))}
    await asyncio.to_thread(journal.write_snapshot, bucket, keeper.ledger.covers, keeper.ledger.to_snapshot(), inc, "bench")
    measures = {"journal restart": lambda: journal_restart_checked(bucket),
                "journal catch-up": lambda: asyncio.to_thread(journal_catch_up, bucket),
                "slatedb restart": lambda: slate_restart(endpoint, path),
                "slatedb catch-up": lambda: slate_catch_up(endpoint, path)}
    names = list(measures)
    for r in range(a.repeats):
        for name in (names if r % 2 == 0 else names[2:] + names[:2]):
            c0 = counts(endpoint)
            took = await measures[name]()
            out.setdefault(name, ([], {}))[0].append(took)
            out[name] = (out[name][0], per_group(c0, counts(endpoint), 1))
    return {k: (statistics.median(v), reqs) for k, (v, reqs) in out.items()}


# ---- phase 4: fencing, and what each costs when idle ---------------------------------------------------------
def line(template: bytes, gid: str) -> bytes:
    return template.replace(b"X" * 32, gid.encode(), 1)


async def fencing(endpoint: str, template: bytes) -> dict:
    """A second writer opens on the first one's log; the first writer then tries to commit."""
    out = {}
    j = JournalStore(endpoint, f"fence-{uuid.uuid4().hex[:6]}")
    await j.open()
    await j.submit("a" * 32, line(template, "a" * 32), receipt("a" * 32, 0))
    await asyncio.to_thread(journal_restart, j.bucket)  # a second proxy starts: it fences incarnation 0 off
    try:
        await j.submit("b" * 32, line(template, "b" * 32), receipt("b" * 32, 1))
        out["journal"] = "the old writer's commit SUCCEEDED after the fence"
    except journal.JournalWriteError as e:
        out["journal"] = f"refused: {e}; the writer was told: {j.foreign}"
    await j.close()
    run = f"fence-{uuid.uuid4().hex[:6]}"
    first, second = SlateStore(endpoint, run), SlateStore(endpoint, run)
    await first.open()
    await first.submit("a" * 32, line(template, "a" * 32), receipt("a" * 32, 0))
    await second.open()
    try:
        await first.submit("b" * 32, line(template, "b" * 32), receipt("b" * 32, 1))
        out["slatedb"] = "the old writer's commit SUCCEEDED after the second writer opened"
    except Exception as e:  # noqa: BLE001 - what SlateDB raises is the finding
        out["slatedb"] = f"refused: {type(e).__name__}: {e}"
    await second.close()
    return out


async def idle_cost(endpoint: str, template: bytes, seconds: float = 4.0) -> dict:
    """Bucket requests per second of a writer with nothing to write, and of a follower of an idle log."""
    out = {}
    j, s = JournalStore(endpoint, f"idle-{uuid.uuid4().hex[:6]}"), SlateStore(endpoint, f"idle-{uuid.uuid4().hex[:6]}")
    for store, follower_cls in ((j, JournalFollower), (s, SlateFollower)):
        await store.open()
        await store.submit("a" * 32, line(template, "a" * 32), receipt("a" * 32, 0))
        c0 = counts(endpoint)
        await asyncio.sleep(seconds)
        out[f"{store.name.split()[0]} writer"] = per_group(c0, counts(endpoint), seconds)
        stop = asyncio.Event()
        follower = follower_cls(store)
        task = asyncio.create_task(follower.run(stop))
        await asyncio.sleep(1.0)
        c0 = counts(endpoint)
        await asyncio.sleep(seconds)
        both = per_group(c0, counts(endpoint), seconds)
        stop.set()
        await task
        out[f"{store.name.split()[0]} writer + follower"] = both
        await store.close()
    return out


# ---- the run ------------------------------------------------------------------------------------------------
def med(rows: list[dict], key: str, i: int) -> float:
    return statistics.median(r[key][i] for r in rows)


def med_requests(rows: list[dict], key: str) -> dict:
    kinds = sorted({k for r in rows for k in r[key][2]})
    return {k: statistics.median(r[key][2].get(k, 0.0) for r in rows) for k in kinds}


async def run_all(a: Args, endpoint: str) -> None:
    template = group_line("X" * 32, "bench", 0, a.group_size, a.tokens, random.Random(a.seed))
    print(f"group line {len(template)} bytes (G={a.group_size}, {a.tokens} tokens); paced {a.rate:g}/s for {a.paced_s:g}s, "
          f"flood {a.clients} callers x {a.flood_groups} groups; {a.repeats} repeats", flush=True)
    sides = [("journal", lambda run: JournalStore(endpoint, run), JournalFollower),
             ("slatedb 100ms", lambda run: SlateStore(endpoint, run, "100ms"), SlateFollower),
             ("slatedb 100ms memmove", lambda run: SlateStore(endpoint, run, "100ms", memmove=True), SlateFollower),
             ("slatedb 10ms memmove", lambda run: SlateStore(endpoint, run, "10ms", memmove=True), SlateFollower)]
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in sides}
    for r in range(a.repeats if a.latency else 0):
        for name, make, follower_cls in sides[r % len(sides):] + sides[:r % len(sides)]:
            got = await latency_round(make(f"lat-{r}-{uuid.uuid4().hex[:6]}"), follower_cls, a, endpoint, template)
            rows[name].append(got)
            print(f"  repeat {r} {name:21s} paced p50 {got['paced'][0]:6.1f} p99 {got['paced'][1]:6.1f} ms | flood p50 "
                  f"{got['flood'][0]:6.1f} p99 {got['flood'][1]:6.1f} ms {got['flood'][3]:5.0f}/s | follower lag p50 "
                  f"{got['follow_lag'][0]:.0f} p99 {got['follow_lag'][1]:.0f} ms", flush=True)
    print("\nmedians of the repeats (ms; requests per group by kind)")
    for name in rows if a.latency else []:
        rs = rows[name]
        print(f"{name:21s} paced p50 {med(rs, 'paced', 0):.1f} p99 {med(rs, 'paced', 1):.1f} {med_requests(rs, 'paced')}")
        print(f"{'':21s} flood p50 {med(rs, 'flood', 0):.1f} p99 {med(rs, 'flood', 1):.1f} "
              f"{statistics.median(x['flood'][3] for x in rs):.0f} groups/s {med_requests(rs, 'flood')}")
        print(f"{'':21s} follower lag p50 {med(rs, 'follow_lag', 0):.0f} p99 {med(rs, 'follow_lag', 1):.0f}")
    for n in a.sizes:
        got = await restart_phase(a, endpoint, n)
        print(f"N={n}: " + "; ".join(f"{k} {v:.2f}s {reqs}" for k, (v, reqs) in got.items()), flush=True)
    print("fencing:", json.dumps(await fencing(endpoint, template), indent=1))
    print("idle requests/s:", json.dumps(await idle_cost(endpoint, template), indent=1))


def main(a: Args) -> None:
    if a.serve_s3:
        return serve_s3(a.serve_s3)
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update({"AWS_ACCESS_KEY_ID": ACCESS["aws_access_key_id"], "AWS_SECRET_ACCESS_KEY": ACCESS["aws_secret_access_key"],
                       "AWS_REGION": ACCESS["aws_region"]})
    log = tempfile.NamedTemporaryFile(prefix="slatedb-vs-journal-s3-", suffix=".log", delete=False)
    s3 = subprocess.Popen([sys.executable, __file__, "--serve-s3", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(100):
            try:
                counts(endpoint)
                break
            except OSError:
                time.sleep(0.1)
        common.Bucket("bench", "x", endpoint).s3.create_bucket(Bucket="bench")
        t0 = time.perf_counter()
        asyncio.run(run_all(a, endpoint))
        print(f"took {time.perf_counter() - t0:.0f}s")
    finally:
        s3.terminate()
        s3.wait()


if __name__ == "__main__":
    main(tyro.cli(Args))

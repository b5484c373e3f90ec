"""The proxy's journal in the bucket: its object names, what one commit object holds, the group-commit
writer, and reading every line back in log order. It knows nothing of what the lines mean: proxy.py
decides what to write and applies what it reads.

    rollouts/{incarnation:06d}-{seq:08d}.jsonl     one object per group commit, written with If-None-Match

One commit object is JSON lines:

    {"t":"commit","protocol":2,"incarnation":3,"seq":17,"writer":"<random per process>","time":<unix s>}  header
    {"group_id":...} or {"t":...}                 the records appended since the last commit, in order
    ...the trailer lines the owner asks for (the proxy: a snapshot of its counters)

The header makes every commit's bytes unique to the process that wrote it, so a put whose answer was
lost (botocore retries it, the retry meets our own object and gets 412) is told apart from another
process writing the same key: read the object back; if it holds exactly our bytes, the write landed.

Each process start is a new incarnation, one more than the newest writer the log names, and first
fences that writer off: an object holding only {"t":"fence","protocol":2,"incarnation":P,"seq":S,"by":N}
at P's next key (put_fence), so P, should it still run, stops at its next put; readers skip any commit of
P after S (ledger.py). Every commit header and fence names the protocol (common.PROTOCOL) that wrote it: a
start refuses a log of another (ledger.py), it never guesses at an older layout.

Snapshots make a start read a bounded amount: a snapshot is the owner's state after one commit, which
it names; a start reads the newest complete one and then only the commits after it. The journal
itself is never shortened (it is the audit log of every trajectory).

    proxy/snapshots/{covered commit}.{writer incarnation:06d}.json     three JSON lines:
        {"t":"snapshot","covers":"rollouts/000003-00000017.jsonl","incarnation":4,"writer":...,"time":...}
        {...the owner's state, opaque here...}
        {"t":"end","sha256":"<of the two lines above>","bytes":N}
    proxy/snapshot.json     the pointer, written after the snapshot: {"key", "covers", "sha256", "time"}

The end line makes a torn or truncated snapshot recognisable; the pointer saves a listing. A process
killed between the snapshot and the pointer leaves the older pointer: the next start reads the older
snapshot and more commits, and loses nothing. A snapshot that does not verify is skipped for the
newest one that does (a listing), and with none the start replays every commit.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from common import PROTOCOL, Bucket, ConflictError

PREFIX = "rollouts/"
SNAPSHOTS = "proxy/snapshots/"
POINTER = "proxy/snapshot.json"
CHECKS = "proxy/checks/"  # one small object per proxy start: conditional_write_ignored's


def object_name(incarnation: int, seq: int) -> str:
    return f"{PREFIX}{incarnation:06d}-{seq:08d}.jsonl"


def log_keys(bucket: Bucket, after: str | None = None) -> list[str]:
    """Every journal object in log order (their names sort so: incarnation, then sequence), or only those after
    the commit `after`: then the listing starts there (ListObjectsV2 StartAfter), so a start lists the tail,
    not the run (a bucket that ignores StartAfter lists them all: the cut is made here too)."""
    return sorted(k for k in bucket.list(PREFIX, start_after=after) if after is None or k > after)


def put_fence(bucket: Bucket, incarnation: int, seq: int, by: int) -> tuple[str, bytes]:
    """Take the next journal key of incarnation `incarnation` (a proxy that may still be running) for
    incarnation `by`, the proxy starting now: an object holding only a fence line. The older proxy's next
    put meets it (412, not its bytes) and that proxy stops (journal.Writer's on_foreign), so two proxies
    never both write the run's log, whichever the supervisor, a person or a slow platform started. A put
    of the older proxy already in flight may land after the fence: its callers are never answered
    (futures resolve in log order), and a reader skips it (ledger.py). ConflictError: that key is taken
    (the older proxy wrote it meanwhile, or another start fenced it first): read it and fence again."""
    key = object_name(incarnation, seq)
    data = encode({"t": "fence", "protocol": PROTOCOL, "incarnation": incarnation, "seq": seq, "by": by,
                   "writer": uuid.uuid4().hex, "time": round(time.time(), 3)}, [])
    put_once(bucket, key, data)
    return key, data


def read_objects(bucket: Bucket, keys: list[str], threads: int = 16) -> Iterator[tuple[str, bytes]]:
    """(key, bytes) of the given objects in the given order (a missing one: b""), fetched in parallel, at most
    4 x threads ahead of the caller: memory stays flat however many there are."""
    with ThreadPoolExecutor(threads) as pool:
        ahead: deque = deque()
        for key in keys:
            ahead.append((key, pool.submit(lambda k: (bucket.get(k) or (b"", ""))[0], key)))
            if len(ahead) > 4 * threads:
                done, fut = ahead.popleft()
                yield done, fut.result()
        while ahead:
            done, fut = ahead.popleft()
            yield done, fut.result()


def put_once(bucket: Bucket, key: str, data: bytes) -> None:
    """A conditional put (If-None-Match); a 412 is ours when the object holds exactly our bytes (the answer to
    an earlier attempt was lost and botocore retried). Anything else in our key raises ConflictError."""
    try:
        bucket.put(key, data, if_none_match=True)
    except ConflictError:
        got = bucket.get(key)  # raises BucketError when unreadable: the caller fails and retries
        if got is None or got[0] != data:
            raise
        print(f"journal: {key} was already written by us (an answer was lost); carrying on", file=sys.stderr, flush=True)


class UnfitStore(RuntimeError):
    """The bucket does not honour the conditional writes that the fence and the leader record rest on."""


def require_conditional_writes(bucket: Bucket) -> None:
    """UnfitStore, saying what the store did, unless it honours conditional writes (conditional_write_ignored)."""
    if ignored := conditional_write_ignored(bucket):
        raise UnfitStore(f"the bucket does not honour conditional writes, and the journal's fence and the leader "
                         f"record rest on them (a fenced proxy, or two leaders, could both commit): {ignored}. Use an "
                         f"S3 store that answers such a put 412 Precondition Failed (docs/proxy.md#a-standby)")


def conditional_write_ignored(bucket: Bucket) -> str | None:
    """What the store did wrong, or None when it honours the conditional writes that the fence (If-None-Match) and
    the leader record (If-Match) rest on. A store that ignored them would let a fenced proxy, or two leaders,
    commit, and nothing would say so: a start asks it before its first journal write (snapshots.Keeper). An object
    of this start's own is created, then written again with If-None-Match and with an If-Match of an ETag it does
    not have; both must be refused (412). The object stays (the stores the journal runs on need not offer DELETE)."""
    key = f"{CHECKS}{uuid.uuid4().hex}"
    bucket.put(key, b"created", if_none_match=True)
    for what, kw in (("If-None-Match: * over an object that exists", {"if_none_match": True}),
                     ("If-Match with an ETag the object does not have", {"if_match": '"' + "0" * 32 + '"'})):
        try:
            bucket.put(key, b"written over", **kw)
        except ConflictError:
            continue
        return f"a put with {what} was accepted ({bucket.where(key)})"
    return None


# ---- snapshots ------------------------------------------------------------------------------------
def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def write_snapshot(bucket: Bucket, covers: str, state: dict, incarnation: int, writer: str) -> str:
    """Write a snapshot of `state` (the owner's state after commit `covers`), then the pointer to it.
    Runs in a thread: the encoding and both puts are off the event loop. Returns the snapshot's key."""
    key = f"{SNAPSHOTS}{covers.rsplit('/', 1)[1].rsplit('.', 1)[0]}.{incarnation:06d}.json"
    head = _dumps({"t": "snapshot", "covers": covers, "incarnation": incarnation, "writer": writer,
                   "time": round(time.time(), 3)}) + b"\n" + _dumps(state) + b"\n"
    digest = hashlib.sha256(head).hexdigest()
    put_once(bucket, key, head + _dumps({"t": "end", "sha256": digest, "bytes": len(head)}) + b"\n")
    bucket.put(POINTER, _dumps({"key": key, "covers": covers, "sha256": digest, "time": round(time.time(), 3)}))
    return key


def _verified(blob: bytes) -> tuple[str, dict]:
    """(covers, state) of a snapshot object; ValueError when it is torn, truncated or not one."""
    lines = blob.split(b"\n")
    if len(lines) != 4 or lines[3] != b"":
        raise ValueError(f"cut short or not a snapshot: {len(lines) - 1} whole lines, not 3")
    end = json.loads(lines[2])
    head = lines[0] + b"\n" + lines[1] + b"\n"
    if end.get("t") != "end" or end.get("bytes") != len(head) or end.get("sha256") != hashlib.sha256(head).hexdigest():
        raise ValueError("its checksum does not match its bytes")
    return json.loads(lines[0])["covers"], json.loads(lines[1])


def read_snapshot(bucket: Bucket) -> tuple[str, str, dict] | None:
    """The newest snapshot that verifies: (its key, the commit it covers, the state), or None. The pointer
    names the newest; if it is missing, or its snapshot does not verify, the newest listed one that does."""
    try:
        pointer = bucket.get_json(POINTER) or {}
    except ValueError:  # not JSON: as good as no pointer
        pointer = {}
    if "key" in pointer and (snap := snapshot_at(bucket, pointer["key"])):
        return snap
    for key in sorted(bucket.list(SNAPSHOTS), key=lambda k: k.rsplit("/", 1)[1], reverse=True):
        if key != pointer.get("key") and (snap := snapshot_at(bucket, key)):
            return snap
    return None


def snapshot_at(bucket: Bucket, key: str) -> tuple[str, str, dict] | None:
    """(key, covers, state) of the snapshot `key`, or None (and why on stderr) when it does not verify."""
    got = bucket.get(key)
    try:
        if got is None:
            raise ValueError("it is missing")
        return (key, *_verified(got[0]))
    except ValueError as e:  # json's decode errors are ValueErrors too
        print(f"journal: ignoring snapshot {key}: {e}", file=sys.stderr, flush=True)
        return None


def encode(header: dict, records: list[bytes | dict]) -> bytes:
    """One commit object: the header, then the records as given (bytes are already one JSON line)."""
    return b"\n".join([_dumps(header)] + [r if isinstance(r, bytes) else _dumps(r) for r in records]) + b"\n"


class JournalWriteError(RuntimeError):
    """A commit did not reach the bucket: nothing it held happened. Its message names no bucket, run or
    endpoint (it may reach a client); the writer logs the full cause on stderr."""


class Writer:
    """Callers append a record (bytes: one JSON line, or a dict) and await the future it returns. The writer
    puts all records queued since its last put as one object; up to `depth` puts fly at once, but futures
    resolve in log order, so nothing answered depends on a lost write.

    trailer(): lines added at the end of every commit (computed when the commit is formed).
    on_foreign(message): called when another process owns a key we tried to write (two writers on one
    log); the proxy stops there. Without a bucket, commits succeed at once (a proxy without durability).
    committed(key, time, records): each commit that reached the bucket, in log order, before its callers
    hear of it (records: as appended, then the trailer). uncertain(key): a commit that failed; its put
    may still have landed (every answer lost), which only a read of the key can tell."""

    def __init__(self, bucket: Bucket | None, incarnation: int, depth: int = 1,
                 trailer: Callable[[], list[dict]] = lambda: [],
                 on_foreign: Callable[[str], None] = lambda msg: None,
                 observe: Callable[[float], None] = lambda seconds: None,
                 committed: Callable[[str, float, list], None] = lambda key, at, records: None,
                 uncertain: Callable[[str], None] = lambda key: None):
        self.bucket, self.incarnation, self.seq = bucket, incarnation, 0
        self.writer_id = uuid.uuid4().hex
        self.trailer, self.on_foreign, self.observe = trailer, on_foreign, observe
        self.committed, self.uncertain = committed, uncertain
        self.slots = asyncio.Semaphore(depth)
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
            header = {"t": "commit", "protocol": PROTOCOL, "incarnation": self.incarnation, "seq": self.seq,
                      "writer": self.writer_id, "time": round(time.time(), 3)}
            records = [r for r, _ in batch] + self.trailer()
            data = encode(header, records)
            prev = asyncio.create_task(self.commit(object_name(self.incarnation, self.seq), data, batch, prev,
                                                   header["time"], records))
            self.seq += 1

    async def commit(self, key: str, data: bytes, batch: list, prev: asyncio.Task | None, at: float = 0.0,
                     records: list = ()) -> None:
        t0, err = time.perf_counter(), None
        try:
            if self.bucket is not None:
                await asyncio.to_thread(self.put, key, data)
        except Exception as e:  # noqa: BLE001 - every waiting caller gets it
            err = e
        self.observe(time.perf_counter() - t0)
        self.slots.release()
        if prev is not None:
            await prev
        if err is not None:
            print(f"journal: commit {key} failed: {err}", file=sys.stderr, flush=True)
            self.uncertain(key)
        else:
            self.committed(key, at, records)
        for _, fut in batch:
            if not fut.done():
                if err is None:
                    fut.set_result(None)
                else:  # each caller raises its own instance (each in its own task)
                    fut.set_exception(JournalWriteError("could not write to the bucket, nothing changed; retry"))

    def put(self, key: str, data: bytes) -> None:
        """put_once; anything but our own bytes in our key is another writer."""
        try:
            put_once(self.bucket, key, data)
        except ConflictError:
            self.on_foreign(f"journal object {key} was written by another process")
            raise

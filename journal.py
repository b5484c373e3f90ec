"""The proxy's journal in the bucket: its object names, what one commit object holds, the group-commit
writer, and reading every line back in log order. It knows nothing of what the lines mean: proxy.py
decides what to write and applies what it reads.

    rollouts/{incarnation:06d}-{seq:08d}.jsonl     one object per group commit, written with If-None-Match

One commit object is JSON lines:

    {"t":"commit","incarnation":3,"seq":17,"writer":"<random per process>","time":<unix s>}   the header
    {"group_id":...} or {"t":...}                 the records appended since the last commit, in order
    ...the trailer lines the owner asks for (the proxy: a snapshot of its counters)

The header makes every commit's bytes unique to the process that wrote it, so a put whose answer was
lost (botocore retries it, the retry meets our own object and gets 412) is told apart from another
process writing the same key: read the object back; if it holds exactly our bytes, the write landed.

Each process start is a new incarnation, one more than the highest in the bucket. Objects of runs
from before 2026-11-29 also live under proxy/log/ (same naming); they are read in the same order.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from common import Bucket, ConflictError

PREFIX = "rollouts/"
LEGACY_PREFIX = "proxy/log/"


def object_name(incarnation: int, seq: int) -> str:
    return f"{PREFIX}{incarnation:06d}-{seq:08d}.jsonl"


def log_keys(bucket: Bucket) -> list[str]:
    """Every journal object, in log order (incarnation, then sequence; legacy objects first on a tie)."""
    keys = bucket.list(PREFIX) + bucket.list(LEGACY_PREFIX)
    return sorted(keys, key=lambda k: (k.rsplit("/", 1)[1], k.startswith("proxy/")))


def next_incarnation(keys: list[str]) -> int:
    return max((int(k.rsplit("/", 1)[1].split("-")[0]) for k in keys), default=-1) + 1


def read_lines(bucket: Bucket, keys: list[str], threads: int = 16) -> Iterator[bytes]:
    """The lines of the given objects, object by object in the given order (fetched in parallel)."""
    with ThreadPoolExecutor(threads) as pool:
        for blob in pool.map(lambda k: (bucket.get(k) or (b"", ""))[0], keys):
            yield from blob.splitlines()


def encode(header: dict, records: list[bytes | dict], trailer: list[dict]) -> bytes:
    """One commit object: the header, the records as given (bytes are already one JSON line), the trailer."""
    lines = [json.dumps(header, separators=(",", ":")).encode()]
    lines += [r if isinstance(r, bytes) else json.dumps(r, separators=(",", ":")).encode() for r in records]
    lines += [json.dumps(t, separators=(",", ":")).encode() for t in trailer]
    return b"\n".join(lines) + b"\n"


class JournalWriteError(RuntimeError):
    """A commit did not reach the bucket: nothing it held happened. Its message names no bucket, run or
    endpoint (it may reach a client); the writer logs the full cause on stderr."""


class Writer:
    """Callers append a record (bytes: one JSON line, or a dict) and await the future it returns. The writer
    puts all records queued since its last put as one object; up to `depth` puts fly at once, but futures
    resolve in log order, so nothing answered depends on a lost write.

    trailer(): lines added at the end of every commit (computed when the commit is formed).
    on_foreign(message): called when another process owns a key we tried to write (two writers on one
    log); the proxy stops there. Without a bucket, commits succeed at once (a proxy without durability)."""

    def __init__(self, bucket: Bucket | None, incarnation: int, depth: int = 1,
                 trailer: Callable[[], list[dict]] = lambda: [],
                 on_foreign: Callable[[str], None] = lambda msg: None,
                 observe: Callable[[float], None] = lambda seconds: None):
        self.bucket, self.incarnation, self.seq = bucket, incarnation, 0
        self.writer_id = uuid.uuid4().hex
        self.trailer, self.on_foreign, self.observe = trailer, on_foreign, observe
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
            header = {"t": "commit", "incarnation": self.incarnation, "seq": self.seq, "writer": self.writer_id,
                      "time": round(time.time(), 3)}
            data = encode(header, [r for r, _ in batch], self.trailer())
            prev = asyncio.create_task(self.commit(object_name(self.incarnation, self.seq), data, batch, prev))
            self.seq += 1

    async def commit(self, key: str, data: bytes, batch: list, prev: asyncio.Task | None) -> None:
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
        for _, fut in batch:
            if not fut.done():
                if err is None:
                    fut.set_result(None)
                else:  # each caller raises its own instance (each in its own task)
                    fut.set_exception(JournalWriteError("could not write to the bucket, nothing changed; retry"))

    def put(self, key: str, data: bytes) -> None:
        """A conditional put; a 412 is ours when the object holds exactly our bytes (the answer to an
        earlier attempt was lost and botocore retried). Anything else in our key is another writer."""
        try:
            self.bucket.put(key, data, if_none_match=True)
        except ConflictError:
            got = self.bucket.get(key)  # raises BucketError when unreadable: the commit fails, callers retry
            if got is not None and got[0] == data:
                print(f"journal: {key} was already written by us (an answer was lost); carrying on",
                      file=sys.stderr, flush=True)
                return
            self.on_foreign(f"journal object {key} was written by another process")
            raise

"""The contract every role of the async GRPO run shares: bucket, adapter versions, group schema, GRPO math.

Every script (proxy.py, rollout.py, train.py, evaluate.py, report.py, launch_hf.py) imports this module
before any other of ours, and importing it puts the lib/ folders on sys.path: the modules each script
imports live in lib/<who uses them>/ (docs/DESIGN.md, section 2). On Hugging Face Jobs every file a job
ships lands flat beside its script (/data), so there is nothing to add there. Sections:

  0. protocol        the one version of what a run writes and says (PROTOCOL), checked by every reader
  1. bucket          S3 client from the environment, put/get that wait out outages, JSON helpers
  2. adapters        versioned publish (files -> meta.json -> conditional latest.json), the one meta.json
                     check, and the verified fetch from the bucket (through the proxy: proxy_client.py)
  3. schema          the trajectory group that travels rollout -> proxy -> trainer (pydantic)
  4. rules           staleness, sampled tokens, zero-std groups, bf16: each rule every role applies, once
  5. math            GRPO group advantages and the policy objectives (ppo, cispo, decoupled)
  6. command lines   CLI args without the files HF Jobs ships beside the script
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from tenacity import Retrying, retry_if_exception, wait_exponential_jitter

# the lib/ folders beside this file, after the script's own folder (sys.path[0]) and before site-packages
sys.path[1:1] = [str(d) for d in sorted((Path(__file__).resolve().parent / "lib").glob("*/")) if str(d) not in sys.path]


class _LazyTorch:
    """torch, imported on first use. The proxy needs none of it: without torch it starts in a
    second and stays far smaller (and its HF job need not install it); the other roles load it anyway."""

    def __getattr__(self, name: str):
        import torch as real
        globals()["torch"] = real  # from now on the module itself
        return getattr(real, name)


torch = _LazyTorch()

# ----------------------------------------------------------------------------------------------
# 0. protocol: one number for everything a run's roles write to the bucket or say to each other

PROTOCOL = 2
"""The version of the proxy's routes and answers, its journal and snapshots, and the trainer's checkpoints.
Bumped whenever any of them changes in a way an older reader would misread. Every reader checks it
(check_protocol) and refuses another, naming both: a participant on an older clone is told to update, and a
run is resumed only by code that reads what the run wrote. No reader guesses at an older layout."""


class ProtocolError(RuntimeError):
    """Something was written or said in another protocol than this code's; the message names both."""


def check_protocol(found: Any, what: str, fix: str) -> None:
    """Raise ProtocolError unless `found` (a record's "protocol" field; None: absent) is PROTOCOL.
    what: the thing read ("the journal of run X"); fix: what the person should do."""
    if found != PROTOCOL:
        theirs = "1 (from before protocols were numbered)" if found is None else repr(found)
        raise ProtocolError(f"{what} speaks protocol {theirs}; this code speaks protocol {PROTOCOL}: {fix}")


# ----------------------------------------------------------------------------------------------
# 1. bucket, and how every call waits out an outage of the bucket or the proxy

WAIT_LOG_S = 30.0  # a call that waits out an outage says so at its first failure, then this often


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def patiently(fn, what: str, transient, patience_s: float | None, say=log, should_stop=lambda: False):
    """fn(), retried with exponential backoff (0.5 s doubling to 10 s, with jitter) for as long as it
    fails with an error `transient` says may pass (unreachable, 5xx, throttling); `patience_s` bounds
    the wait (None: as long as it takes), `should_stop()` ends it early. Any other error is raised at
    once. While it waits it says what it waits for at the first failure and every WAIT_LOG_S seconds,
    and says so again when the outage is over."""
    t0, said = time.monotonic(), [None]

    def before_sleep(rs) -> None:
        waited = time.monotonic() - t0
        if said[0] is None or waited - said[0] >= WAIT_LOG_S:
            said[0] = waited
            e = rs.outcome.exception()
            limit = "as long as it takes" if patience_s is None else f"for up to {patience_s:.0f}s"
            say(f"waiting for {what}: failing for {waited:.0f}s ({type(e).__name__}: {str(e)[:200]}); retrying {limit}")

    def stop(rs) -> bool:
        return should_stop() or (patience_s is not None and time.monotonic() - t0 >= patience_s)

    def sleep(s: float) -> None:  # in slices, so that should_stop() ends a long wait within half a second
        end = time.monotonic() + s
        while not should_stop() and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.5))

    out = Retrying(retry=retry_if_exception(transient), stop=stop, sleep=sleep, before_sleep=before_sleep,
                   wait=wait_exponential_jitter(multiplier=0.5, max=10, jitter=1), reraise=True)(fn)
    if said[0] is not None:
        say(f"{what}: answering again after {time.monotonic() - t0:.0f}s")
    return out


def _s3_transient(e: BaseException) -> bool:
    """An S3 failure that may pass: the endpoint unreachable or cut off, 5xx, throttling. A 4xx
    (no such bucket, access denied, bad keys) is a mistake that no amount of waiting fixes."""
    if isinstance(e, ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = e.response.get("Error", {}).get("Code", "")
        return status >= 500 or status in (408, 429) or code in ("SlowDown", "Throttling", "RequestTimeout")
    from botocore.exceptions import ConnectionError as BotoConnectionError, HTTPClientError, IncompleteReadError
    return isinstance(e, (BotoConnectionError, HTTPClientError, IncompleteReadError))


class BucketError(RuntimeError):
    """A bucket call failed for good (a 4xx, or an outage longer than the Bucket's patience); the
    message names endpoint, bucket and key."""


class Bucket:
    """One run's prefix in an S3-compatible bucket: `s3://{bucket}/{run}/...`.

    Configured from the environment so every job sees the same run: `S3_ENDPOINT_URL` (unset = AWS),
    `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/`AWS_REGION`, `BUCKET`, `RUN_NAME`.

    Every call waits out an unreachable or failing endpoint (5xx, throttling) for `patience_s`
    seconds, saying what it waits for every 30 s, then raises BucketError; a 4xx raises at once.
    None waits as long as it takes (the trainer, the workers). The default, 20 s, is the proxy's: it
    rides out a blip at its start or in a journal commit, and a longer outage makes its commits
    answer 503, which its callers wait out. 0 makes one call, with botocore's own 3 attempts for a
    blip. botocore's retries alone cannot ride out an outage: in standard mode its retry quota (500
    tokens, 14 per retried connection error) is empty after 3-4 failing calls, after which a call
    fails at its first refused connection (measured with 10 attempts against a closed port: 30, 15,
    22, 1.3 s, then 0 s per call).
    """

    def __init__(self, bucket: str | None = None, run: str | None = None, endpoint: str | None = None,
                 patience_s: float | None = 20.0):
        self.endpoint = endpoint or os.environ.get("S3_ENDPOINT_URL") or None
        self.bucket = bucket or os.environ.get("BUCKET", "")
        self.run = (run or os.environ.get("RUN_NAME", "default")).strip("/")
        self.patience_s = patience_s
        self.say = log  # where waiting is reported (a role may prefix its name)
        if not self.bucket:
            raise SystemExit("no bucket: set BUCKET (and S3_ENDPOINT_URL for a non-AWS endpoint)")
        hf_gateway = bool(self.endpoint and "s3.hf.co" in self.endpoint)
        cfg = Config(
            # botocore's own retries only smooth over a blip within one call (a reset, one 503);
            # outages are waited out by `patiently` around each call
            retries={"mode": "standard", "max_attempts": int(os.environ.get("S3_MAX_ATTEMPTS", "3"))},
            connect_timeout=5, read_timeout=60, max_pool_connections=32,
            # the HF gateway wants path addressing and no default CRC checksums (docs/DESIGN.md, "The Hugging Face S3 gateway")
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required" if hf_gateway else "when_supported",
            response_checksum_validation="when_required" if hf_gateway else "when_supported",
        )
        self.s3 = boto3.client("s3", endpoint_url=self.endpoint, config=cfg,
                               region_name=os.environ.get("AWS_REGION", "us-east-1"))

    def with_patience(self, patience_s: float | None) -> "Bucket":
        """The same bucket (and client) with another patience, e.g. for best-effort metrics uploads."""
        other = copy.copy(self)
        other.patience_s = patience_s
        return other

    def key(self, rel: str) -> str:
        return f"{self.run}/{rel}"

    def where(self, rel: str) -> str:
        """The object `rel` as a message names it: s3://bucket/run/rel at endpoint."""
        return f"s3://{self.bucket}/{self.key(rel)} at {self.endpoint or 'AWS'}"

    def _where(self, what: str, rel: str) -> str:
        return f"{what} {self.where(rel)}"

    def _call(self, what: str, rel: str, fn):
        """fn(), waiting out outages; a failure for good becomes a BucketError naming what and where."""
        try:
            return patiently(fn, f"the bucket ({self._where(what, rel)})", _s3_transient, self.patience_s, self.say)
        except (ClientError, BotoCoreError) as e:
            raise BucketError(f"{self._where(what, rel)} failed: {e}") from e

    def put(self, rel: str, data: bytes, if_match: str | None = None, if_none_match: bool = False) -> str:
        """Put bytes; optional conditional write. Returns the new ETag. Raises ConflictError on 412."""
        kw: dict[str, Any] = {}
        if if_match:
            kw["IfMatch"] = if_match
        if if_none_match:
            kw["IfNoneMatch"] = "*"
        tries = 0

        def once() -> str:
            nonlocal tries
            tries += 1
            try:
                return self.s3.put_object(Bucket=self.bucket, Key=self.key(rel), Body=data, **kw)["ETag"]
            except ClientError as e:
                if kw and e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                    # a conditional write retried (by us or botocore) after its answer was lost meets
                    # its own write: the object holding exactly our bytes then means it was ours
                    if tries > 1 or e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0):
                        mine = self.get(rel)
                        if mine is not None and mine[0] == data:
                            self.say(f"{self._where('put', rel)}: already written by us (the answer to an earlier "
                                     f"attempt was lost); carrying on")
                            return mine[1]
                    raise ConflictError(f"conditional write of {self.key(rel)} lost: someone else wrote it") from e
                raise

        return self._call("put", rel, once)

    def get(self, rel: str) -> tuple[bytes, str] | None:
        """Bytes and ETag, or None when the key does not exist."""

        def once() -> tuple[bytes, str] | None:
            try:
                r = self.s3.get_object(Bucket=self.bucket, Key=self.key(rel))
                return r["Body"].read(), r["ETag"]  # the read is retried too: a cut-off body is transient
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise

        return self._call("get", rel, once)

    def put_json(self, rel: str, obj: Any, **kw) -> str:
        return self.put(rel, json.dumps(obj, separators=(",", ":")).encode(), **kw)

    def get_json(self, rel: str) -> Any | None:
        got = self.get(rel)
        return None if got is None else json.loads(got[0])

    def list(self, prefix: str, start_after: str | None = None) -> list[str]:
        """Relative keys under `prefix` (ListObjectsV2 only: the HF gateway has nothing else); with
        `start_after`, only the keys that sort after it (a server that ignores StartAfter returns them all:
        callers that need the cut make it themselves)."""
        out, token = [], None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": self.key(prefix)}
            if start_after:
                kw["StartAfter"] = self.key(start_after)
            if token:
                kw["ContinuationToken"] = token
            r = self._call("list", prefix, lambda: self.s3.list_objects_v2(**kw))
            out += [o["Key"][len(self.run) + 1:] for o in r.get("Contents", [])]
            if not r.get("IsTruncated"):
                return out
            token = r["NextContinuationToken"]

    def ensure_bucket(self) -> None:
        """Create the bucket if it is missing (local S3 server, tests)."""
        try:
            self.s3.head_bucket(Bucket=self.bucket)
        except ClientError:
            self.s3.create_bucket(Bucket=self.bucket)


class ConflictError(RuntimeError):
    """A conditional write lost the race (another writer owns that version)."""


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# 2. adapters: adapters/v{N:06d}/{files, meta.json}, then adapters/latest.json (written last)

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def adapter_prefix(version: int) -> str:
    return f"adapters/v{version:06d}"


def publish_adapter(bucket: Bucket, local_dir: str | Path, version: int, step: int, base_model: str) -> dict:
    """Upload one adapter version. Order matters: files, then meta.json with their sha256, then the
    pointer with a conditional write, so a reader that follows latest.json always finds a complete
    version, and two trainers can never both publish version N."""
    local_dir = Path(local_dir)
    latest = bucket.get("adapters/latest.json")
    if latest is not None and json.loads(latest[0])["version"] >= version:
        raise ConflictError(f"adapters/latest.json already at version {json.loads(latest[0])['version']} "
                            f">= {version}: is another trainer writing to run {bucket.run!r}?")
    files = {}
    for name in ADAPTER_FILES:
        data = (local_dir / name).read_bytes()
        files[name] = hashlib.sha256(data).hexdigest()
        bucket.put(f"{adapter_prefix(version)}/{name}", data)
    cfg = json.loads((local_dir / "adapter_config.json").read_text())
    meta = {"version": version, "step": step, "base_model": base_model, "created_at": time.time(),
            "files": files, "lora": {"r": cfg["r"], "alpha": cfg["lora_alpha"],
                                     "target_modules": sorted(cfg["target_modules"])}}
    bucket.put_json(f"{adapter_prefix(version)}/meta.json", meta)
    pointer = {"version": version, "step": step, "created_at": meta["created_at"]}
    if latest is None:
        bucket.put_json("adapters/latest.json", pointer, if_none_match=True)
    else:
        bucket.put_json("adapters/latest.json", pointer, if_match=latest[1])
    return meta


class AdapterError(RuntimeError):
    """A published adapter that must not be loaded (missing, partial, corrupt, or does not fit)."""


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def check_meta(data: bytes | None, version: int) -> dict:
    """The one check of a version's meta.json (the trainer's publish, a worker's fetch from the bucket or
    through the proxy, the proxy's registration): JSON describing this version, a sha256 for each adapter
    file, and the LoRA's rank and target modules. Returns it; raises AdapterError saying what is wrong."""
    if data is None:
        raise AdapterError(f"version {version}: no meta.json (not published, or upload incomplete)")
    try:
        meta = json.loads(data)
    except ValueError as e:
        raise AdapterError(f"version {version}: meta.json is not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("version") != version:
        raise AdapterError(f"version {version}: meta.json describes version "
                           f"{meta.get('version') if isinstance(meta, dict) else None}")
    files = meta.get("files")
    if not isinstance(files, dict) or set(files) != set(ADAPTER_FILES) or not all(_SHA256.match(str(v)) for v in files.values()):
        raise AdapterError(f"version {version}: meta.json must give a sha256 for each of {list(ADAPTER_FILES)}, "
                           f"not {sorted(files) if isinstance(files, dict) else files!r}")
    lora = meta.get("lora")
    targets = lora.get("target_modules") if isinstance(lora, dict) else None
    if not (isinstance(lora, dict) and type(lora.get("r")) is int and lora["r"] >= 1
            and (isinstance(targets, str) or isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        raise AdapterError(f"version {version}: meta.json's lora must give r (an integer >= 1) and target_modules")
    return meta


class KnownFiles:
    """Small adapter files a worker has already verified, by sha256. A version's adapter_config.json is
    the previous version's byte for byte (the LoRA's shape does not change within a run), so the worker
    writes it from here instead of fetching it again: one request fewer a version, per worker."""

    MAX_BYTES, MAX_FILES = 1 << 16, 16

    def __init__(self):
        self.by_sha: dict[str, bytes] = {}

    def get(self, sha256: str) -> bytes | None:
        return self.by_sha.get(sha256)

    def add(self, sha256: str, data: bytes) -> None:
        if len(data) <= self.MAX_BYTES:
            self.by_sha.pop(sha256, None)
            self.by_sha[sha256] = data
            while len(self.by_sha) > self.MAX_FILES:
                self.by_sha.pop(next(iter(self.by_sha)))


def fetch_adapter(bucket: Bucket, version: int, dest: str | Path, known: KnownFiles | None = None) -> dict:
    """Download version `version` into `dest` and verify every file against meta.json's sha256 (a file
    `known` already holds under that sha256 is written from there, not fetched)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    got = bucket.get(f"{adapter_prefix(version)}/meta.json")
    meta = check_meta(got and got[0], version)
    for name, want in meta["files"].items():
        if known is not None and (data := known.get(want)) is not None:
            (dest / name).write_bytes(data)
            continue
        got = bucket.get(f"{adapter_prefix(version)}/{name}")
        if got is None:
            raise AdapterError(f"version {version}: {name} is missing from the bucket")
        digest = hashlib.sha256(got[0]).hexdigest()
        if digest != want:
            raise AdapterError(f"version {version}: {name} sha256 {digest[:12]}... != meta.json {want[:12]}...")
        (dest / name).write_bytes(got[0])
        if known is not None:
            known.add(want, got[0])
    return meta


# ----------------------------------------------------------------------------------------------
# 3. schema of a trajectory group (docs/DESIGN.md section 4). Hard bounds here; the proxy adds its run's limits.

MAX_TOKENS = 32768  # per prompt or completion; the proxy narrows this with its own flags


# constraints pydantic-core checks natively while it parses: a Python validator per element costs
# more than the whole parse of a 2048-token group
TokenId = Annotated[int, Field(ge=0, lt=1 << 24)]  # below the run's vocabulary too: token_id_problem

LOGPROB_FLOOR = -50.0
"""The least behaviour logprob a group may carry. A token of probability below e^-50 is sampled with a chance below
vocabulary x e^-50 (3e-17 at 150,000 tokens) per token, at any temperature (the logprob is the tempered one): no
honest run meets one. A lower one only makes the importance ratio pi/mu overflow: exp(100) is inf in float32, and an
inf ratio under ppo made a NaN adapter; exp(50) is 5e21, finite."""
Logprob = Annotated[float, Field(ge=LOGPROB_FLOOR, le=1e-4, allow_inf_nan=False)]  # <= 0, with room for rounding
VersionRun = tuple[Annotated[int, Field(ge=0, lt=MAX_TOKENS)], Annotated[int, Field(ge=0, le=10**9)]]


class Completion(BaseModel):
    """One episode after the group's shared prompt (docs/DESIGN.md, "A trajectory group"). Single-turn: the
    tokens the policy sampled. Multi-turn: the policy's turns and, between them, the tokens an environment,
    a tool or the chat template put there, told apart by `mask`. Which adapter version sampled each token
    is `versions` (a worker may take a new version mid-episode); absent, the group's policy_version."""
    model_config = ConfigDict(extra="forbid")
    token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_TOKENS)
    logprobs: list[Logprob | None] = Field(min_length=1, max_length=MAX_TOKENS)
    """the behaviour logprob of each sampled token (mask 1); null where mask is 0"""
    mask: list[Literal[0, 1]] | None = Field(default=None, max_length=MAX_TOKENS)
    """1: sampled by the policy, 0: put there by the environment; absent: every token was sampled"""
    versions: list[VersionRun] | None = Field(default=None, min_length=1, max_length=MAX_TOKENS)
    """[[first token index, adapter version], ...] in increasing index order, the first at 0: the version
    that sampled each token from that index on; absent: the group's policy_version for every token"""
    reward: float = Field(ge=-1e6, le=1e6, allow_inf_nan=False)
    finish_reason: Literal["stop", "length", "turns"]
    """stop: the model (or the environment) ended it; length: the token budget; turns: the turn budget"""

    @model_validator(mode="after")
    def _consistent(self) -> "Completion":
        n = len(self.token_ids)
        if len(self.logprobs) != n:
            raise ValueError(f"{n} token_ids but {len(self.logprobs)} logprobs")
        if self.mask is None:
            if None in self.logprobs:
                raise ValueError("a logprob is null but there is no mask: every token counts as sampled")
        else:
            if len(self.mask) != n:
                raise ValueError(f"{n} token_ids but {len(self.mask)} mask entries")
            if self.mask != [0 if lp is None else 1 for lp in self.logprobs]:
                i = next(i for i, (m, lp) in enumerate(zip(self.mask, self.logprobs)) if m != (lp is not None))
                raise ValueError(f"token {i}: mask {self.mask[i]} but logprob {self.logprobs[i]}: a sampled token "
                                 "(mask 1) needs its behaviour logprob, an environment token (mask 0) has none")
            if 1 not in self.mask:
                raise ValueError("no token of this episode was sampled by the policy (mask all 0): nothing to train")
        if self.versions is not None:
            starts = [i for i, _ in self.versions]
            if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= n:
                raise ValueError(f"versions: first token indices {starts[:8]} must start at 0, increase, and stay "
                                 f"below the {n} tokens")
        return self


class TrajectoryGroup(BaseModel):
    """G episodes of one prompt (token ids, not text), sampled by one adapter version or, where a worker took
    a new one mid-episode, by several: then policy_version is the oldest of them (the staleness filter's)."""
    model_config = ConfigDict(extra="forbid")
    group_id: str = Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    worker_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    policy_version: int = Field(ge=0, le=10**9)
    """the adapter version that sampled the group's oldest token (all of them, for a single-version group)"""
    lease_id: str | None = Field(default=None, min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    """the prompt lease this group answers (POST /v1/prompts/lease's lease_id); a participant's group must name one"""
    prompt_index: int | None = Field(default=None, ge=0, lt=1 << 22)
    """which of that lease's prompt indices it answers (given with lease_id, and only with it)"""
    prompt_ids: list[TokenId] = Field(min_length=1, max_length=MAX_TOKENS)
    completions: list[Completion] = Field(min_length=1, max_length=1024)
    meta: dict[str, Any] = Field(default_factory=dict)

    @field_validator("meta")
    @classmethod
    def _small_meta(cls, v: dict) -> dict:
        try:
            s = json.dumps(v, allow_nan=False)
        except ValueError as e:
            raise ValueError(f"meta must be JSON without NaN/Inf: {e}") from e
        if len(s) > 16384:
            raise ValueError(f"meta is {len(s)} bytes, limit 16384")
        if why := meta_problem(v):
            raise ValueError(why)
        return v

    @model_validator(mode="after")
    def _lease_named_whole(self) -> "TrajectoryGroup":
        if (self.lease_id is None) != (self.prompt_index is None):
            raise ValueError("lease_id and prompt_index go together: the lease a group answers and which of its prompts")
        return self

    @model_validator(mode="after")
    def _oldest_version(self) -> "TrajectoryGroup":
        runs = [v for c in self.completions if c.versions for _, v in c.versions]
        if runs and min(runs) != self.policy_version:
            raise ValueError(f"policy_version {self.policy_version} is not the oldest version of its tokens "
                             f"({min(runs)}): it must be, for the staleness filter")
        return self

    def newest_version(self) -> int:
        return max([self.policy_version] + [v for c in self.completions if c.versions for _, v in c.versions])


MIN_TEMPERATURE, MAX_TEMPERATURE = 0.05, 10.0
"""The sampling temperatures a group may say it was sampled at (meta.temperature), the trainer's --temperature and
the workers' alike. The trainer divides the logits by it in float32: 1e-300 is 0 there (a division by zero), 1e-39
a subnormal that sends logits of a few units to inf (a NaN loss). Below 0.05 sampling is all but greedy (logit gaps
of a tenth become two nats), which GRPO cannot learn from: a group needs spread. Above 10 the tempered distribution
is all but uniform (logit gaps of 20 become 2 nats): no task samples there."""
MAX_META_KEYS, MAX_META_ENTRIES, MAX_META_NAME = 32, 32, 64
"""meta: at most this many keys, entries in each of its dicts of numbers, characters in a key"""
META_NUMBERS = ("reward_components", "timings")  # meta's dicts of numbers, which the trainer averages into its metrics
META_STRINGS = ("task", "backend")


def finite_number(x: Any) -> bool:
    """An int or a float (not a bool, which JSON's true would parse to) that is finite."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def temperature_problem(t: Any) -> str | None:
    """Why `t` is no sampling temperature the trainer can score at (None: it is one)."""
    if not finite_number(t) or not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
        return f"{t!r} is not a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] (common.MIN_TEMPERATURE)"
    return None


def meta_problem(meta: dict) -> str | None:
    """Why a group's meta breaks the rules its known keys follow (None: it does not). What rollout.py writes: task and
    backend (strings), prompt_index (an integer), temperature (temperature_problem), reward_components and timings
    (dicts of finite numbers, which the trainer averages). Other keys are the sender's, bounded in number and name."""
    if len(meta) > MAX_META_KEYS:
        return f"meta has {len(meta)} keys, limit {MAX_META_KEYS}"
    if long := [k for k in meta if len(k) > MAX_META_NAME]:
        return f"meta key {long[0][:MAX_META_NAME]!r}...: longer than {MAX_META_NAME} characters"
    if "temperature" in meta and (why := temperature_problem(meta["temperature"])):
        return f"meta.temperature: {why}"
    if "prompt_index" in meta and (type(meta["prompt_index"]) is not int or meta["prompt_index"] < 0):
        return f"meta.prompt_index: {meta['prompt_index']!r} is not an integer >= 0"
    for k in META_STRINGS:
        if k in meta and not (isinstance(meta[k], str) and len(meta[k]) <= 200):
            return f"meta.{k}: {meta[k]!r:.80} is not a string of at most 200 characters"
    for k in META_NUMBERS:
        d = meta.get(k, {})
        if not isinstance(d, dict) or len(d) > MAX_META_ENTRIES:
            return f"meta.{k}: must be an object of at most {MAX_META_ENTRIES} names to finite numbers, not {d!r:.80}"
        if bad := next((n for n, x in d.items() if len(n) > MAX_META_NAME or not finite_number(x)), None):
            return f"meta.{k}.{bad[:MAX_META_NAME]}: {d[bad]!r:.80} is not a finite number (or its name is too long)"
    return None


def token_id_problem(prompt_ids: list[int], completion_ids: list[list[int]], vocab_size: int) -> str | None:
    """Why a group's token ids do not fit a model of `vocab_size` tokens (None: they do): the trainer looks each
    one up in its embedding and its logits, and an id past them is an index out of bounds."""
    for what, ids in [("prompt_ids", prompt_ids), *((f"completions[{i}].token_ids", c) for i, c in enumerate(completion_ids))]:
        if ids and (top := max(ids)) >= vocab_size:
            return f"{what}: token id {top} is not below the model's vocabulary size {vocab_size}"
    return None


def token_versions(completion: dict, policy_version: int) -> list[int]:
    """The adapter version that sampled each token of a completion (its `versions` runs; absent: the group's
    policy_version). An environment token gets the version in force at its index; nothing trains on it."""
    runs = completion.get("versions")
    if not runs:
        return [policy_version] * len(completion["token_ids"])
    out = []
    for (start, v), (end, _) in zip(runs, [*runs[1:], (len(completion["token_ids"]), None)]):
        out += [v] * (end - start)
    return out


def new_group_id() -> str:
    return uuid.uuid4().hex


# ----------------------------------------------------------------------------------------------
# 4. the rules every role applies alike, each written once here

MAX_STALENESS = 1
"""Default of the proxy's --max-staleness (the run's rule; the proxy tells workers and trainer its own value):
a group is trained at most this many versions after the one that sampled its oldest token. 1 is what the local
measurements chose (docs/objectives.md#what-closes-the-gap)."""


MAX_DRIFT = 10.0
"""How far, in nats per version of staleness, an honest token's behaviour logprob can be from the trainer's own
logprob of it (the default of train.py --audit.max-drift): the policy's drift from the version that sampled the
token to the weights the trainer holds. Every token a step trains of a participant's group is judged against it in
that step's own forward, at no cost (audit.Auditor.judge); beyond it the group fails the `logprobs` check. Measured
(bench/drift.py, SmolLM2-135M, addition, the local run's settings, 14 versions): over the tokens 1 version stale
the mean is 0.052 nats, the 99th percentile 0.55, the largest 1.94; the largest per version over 1-4 versions stale
3.2 (6.48 nats at 2). 10 is three times that: made-up logprobs off by tenths pass it (the sampled recompute is for
them), a behaviour logprob near LOGPROB_FLOOR on a likely token does not (docs/trust.md#the-steps-own-forward)."""


def too_stale(version: int, latest: int, max_staleness: int) -> bool:
    """The staleness rule: a group (or a worker's adapter) of `version` can no longer be trained once the
    latest registered version is more than max_staleness ahead of it. The proxy drops such groups, a worker
    stops generating with such an adapter, the trainer forgets such groups' ids."""
    return latest - version > max_staleness


def sampled_mask(completion: dict) -> list[int]:
    """1 for each token of a completion the policy sampled, 0 for the tokens an environment, a tool or the chat
    template put there (its `mask`; absent: every token was sampled). Only sampled tokens are trained on, and
    only they count as generated."""
    return completion.get("mask") or [1] * len(completion["token_ids"])


def sampled_tokens(group: dict) -> int:
    """How many tokens of a group the policy sampled (sampled_mask over its completions)."""
    return sum(sum(sampled_mask(c)) for c in group["completions"])


def sampled_by_version(group: dict) -> dict[int, int]:
    """sampled_tokens split by the adapter version that sampled each token (token_versions): version -> tokens."""
    out: dict[int, int] = {}
    for c in group["completions"]:
        for m, v in zip(sampled_mask(c), token_versions(c, group["policy_version"])):
            if m:
                out[v] = out.get(v, 0) + 1
    return out


def zero_std(rewards: list[float]) -> bool:
    """A group whose G rewards are all equal: no signal (its advantages are exactly 0). Decided on the rewards as
    given (max == min), not on a rounded std compared with 0: eight rewards of 0.1 have a float32 std of 7.45e-9."""
    return max(rewards) == min(rewards)


def skips_zero_std(skip_zero_std: bool, beta: float) -> bool:
    """Whether the trainer leaves zero-std groups out: when asked to (--skip-zero-std) and only without a KL term
    (beta 0), for then such a group has no gradient; with beta > 0 its KL term still pulls."""
    return skip_zero_std and beta == 0


BF16_MIN_CAPABILITY = (8, 0)  # Ampere: below it (a T4) bf16 is emulated, so the sampler and trainer use float16/32


def computes_bf16(capability: tuple[int, int]) -> bool:
    """Whether a CUDA GPU of this compute capability (major, minor) computes in bf16: the one precision rule the
    trainer's --dtype auto, the engines' dtype and the launcher's memory check follow. Not
    torch.cuda.is_bf16_supported(), which also says yes on a T4."""
    return tuple(capability)[:2] >= BF16_MIN_CAPABILITY


# ----------------------------------------------------------------------------------------------
# 5. math (docs/DESIGN.md, "The math"). Shapes: B groups, G completions, N = B*G sequences, T
# completion tokens. mu: the behaviour policy, i.e. the logprobs the worker recorded while sampling;
# pi: the trainer's policy (with grad); pi_prox: pi's value before this optimizer step (detached).

Objective = Literal["ppo", "cispo", "decoupled"]
OBJECTIVES: tuple[str, ...] = ("ppo", "cispo", "decoupled")


def zero_std_groups(rewards) -> torch.Tensor:
    """[B] bool: zero_std() of each group's rewards ([B, G], a tensor or nested lists)."""
    return torch.tensor([zero_std(row) for row in torch.as_tensor(rewards, dtype=torch.float64).tolist()])


def group_advantages(rewards, eps: float = 1e-4, scale_std: bool = True) -> torch.Tensor:
    """rewards [B, G] (a tensor or nested lists of floats) -> advantages [B, G] in float32:
    (r - mean) / (std + eps), or r - mean (Dr. GRPO). Computed in float64; a group whose rewards
    are all equal gets exactly 0 (not a rounding residue divided by eps)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_std:
        adv = adv / (r.std(dim=1, keepdim=True, unbiased=False) + eps)
    return torch.where(zero_std_groups(r)[:, None], 0.0, adv).float()


class LossOut(NamedTuple):
    loss: torch.Tensor       # scalar, with grad
    stats: dict[str, float]  # clip/*, is/*, ratio/*, kl over the completion tokens
    ratio: torch.Tensor      # [N, T] pi / mu per token, detached; 1 on padding
    clipped: torch.Tensor    # [N, T] bool: tokens whose gradient the objective clipped or truncated


def _ppo_clip(ratio, a, eps_low, eps_high):
    """-min(ratio A, clip(ratio) A) per token, and where the clip took the gradient away."""
    loss_t = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
    low = (ratio.detach() < 1 - eps_low) & (a < 0)
    high = (ratio.detach() > 1 + eps_high) & (a > 0)
    return loss_t, low, high


def grpo_loss(logp: torch.Tensor, logp_behav: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              objective: Objective = "ppo", eps_low: float = 0.2, eps_high: float = 0.2, is_cap: float = 2.0,
              logp_prox: torch.Tensor | None = None, logp_ref: torch.Tensor | None = None, beta: float = 0.0,
              agg: Literal["token", "grpo"] = "token") -> LossOut:
    """Token-level policy loss against the behaviour policy mu. Per token of sequence i, A = adv[i]:

      ppo        -min(r A, clip(r, 1-eps_low, 1+eps_high) A)                  r = pi / mu
      cispo      -sg(min(r, C)) A log pi                                       (MiniMax-M1, CISPO)
      decoupled  -sg(min(pi_prox / mu, C)) min(u A, clip(u, 1-eps_low, 1+eps_high) A)
                                                                 u = pi / pi_prox  (AReaL)

    C = is_cap; sg = stop-gradient. Then + beta * k3(pi, ref) per token when logp_ref is given.
    logp_prox defaults to logp.detach(): the trainer's weights before this step, as computed in this
    very forward, so u = 1 in value and d u / d log pi = 1 (see docs/DESIGN.md for what that implies).

    logp, logp_behav, logp_prox, logp_ref, mask: [N, T]; adv: [N]. mask is 1 on completion tokens
    only (padded slots carry 0). agg="token": sum over all completion tokens / their count
    (DAPO-style); "grpo": mean per sequence, then mean over sequences.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}: expected one of {', '.join(OBJECTIVES)}")
    mask = mask.to(logp.dtype)
    on = mask.bool()
    a = adv[:, None].to(logp.dtype)
    ratio = torch.exp((logp - logp_behav) * mask)  # masked first: padding can never yield inf * 0
    no = torch.zeros_like(on)
    low = high = trunc = no
    weight = None
    if objective == "ppo":
        loss_t, low, high = _ppo_clip(ratio, a, eps_low, eps_high)
    elif objective == "cispo":
        raw = ratio.detach()
        weight = torch.clamp(raw, max=is_cap)
        trunc = (raw > is_cap) & (a != 0)
        loss_t = -weight * a * logp
    else:
        prox = logp.detach() if logp_prox is None else logp_prox.detach()
        raw = torch.exp((prox - logp_behav) * mask)
        weight = torch.clamp(raw, max=is_cap)
        trunc = (raw > is_cap) & (a != 0)
        loss_t, low, high = _ppo_clip(torch.exp((logp - prox) * mask), a, eps_low, eps_high)
        loss_t = weight * loss_t
    kl_t = torch.zeros_like(logp)
    if logp_ref is not None:
        # k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0
        d = (logp_ref - logp) * mask
        kl_t = torch.exp(d) - d - 1
        loss_t = loss_t + beta * kl_t
    if agg == "token":
        loss = (loss_t * mask).sum() / mask.sum().clamp(min=1)
    else:
        loss = ((loss_t * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        low, high, trunc = low & on, high & on, trunc & on
        clipped = low | high | trunc
        r_on = ratio[on]
        stats = {"clip/low_frac": float(low.sum() / n), "clip/high_frac": float(high.sum() / n),
                 "clip/frac": float(clipped.sum() / n), "is/trunc_frac": float(trunc.sum() / n),
                 "ratio/mean": float(r_on.mean()) if r_on.numel() else 1.0,
                 "ratio/min": float(r_on.min()) if r_on.numel() else 1.0,
                 "ratio/max": float(r_on.max()) if r_on.numel() else 1.0,
                 "kl": float((kl_t * mask).sum() / n)}
        if weight is not None:
            stats["is/weight_mean"] = float(weight[on].mean()) if r_on.numel() else 1.0
    return LossOut(loss, stats, ratio.detach(), clipped)


# ----------------------------------------------------------------------------------------------
# 6. command lines


def script_args(argv: list[str] | None = None) -> list[str]:
    """CLI args without the leading files that `hf jobs uv run SCRIPT common.py ...` ships beside
    the script (they arrive as /data/common.py in argv, see README); the rest goes to tyro."""
    argv = sys.argv[1:] if argv is None else argv
    here = os.path.dirname(os.path.abspath(sys.argv[0]))
    while argv and os.path.isfile(argv[0]) and os.path.dirname(os.path.abspath(argv[0])) == here:
        argv = argv[1:]
    return argv

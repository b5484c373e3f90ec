"""Small shared pieces of the async GRPO run: bucket, adapter versions, group schema, GRPO math, HTTP.

Every script of the run (proxy.py, rollout.py, train.py) imports this file; on Hugging Face Jobs it
travels beside the script (`hf jobs uv run rollout.py common.py ...`, see README). Sections:

  1. bucket          S3 client from the environment, put/get with botocore retries, JSON helpers
  2. adapters        versioned publish (files -> meta.json -> conditional latest.json) and verified fetch
  3. schema          the trajectory group that travels rollout -> proxy -> trainer (pydantic)
  4. math            GRPO group advantages, zero-std groups, the policy objectives (ppo, cispo, decoupled)
  5. command lines   CLI args without the files HF Jobs ships beside the script
  6. http + metrics  the proxy client with retries/backoff, JSONL metrics to the bucket

Models (loading, chat-template prompts, shared-prefix logprobs) are in models.py, tasks in tasks.py.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import boto3
import httpx
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential, wait_random


class _LazyTorch:
    """torch, imported on first use. The proxy needs none of it: without torch it starts in a
    second and stays far smaller (and its HF job need not install it); the other roles load it anyway."""

    def __getattr__(self, name: str):
        import torch as real
        globals()["torch"] = real  # from now on the module itself
        return getattr(real, name)


torch = _LazyTorch()

# ----------------------------------------------------------------------------------------------
# 1. bucket


class BucketError(RuntimeError):
    """A bucket call failed after botocore's retries; the message names endpoint, bucket and key."""


class Bucket:
    """One run's prefix in an S3-compatible bucket: `s3://{bucket}/{run}/...`.

    Configured from the environment so every job sees the same run: `S3_ENDPOINT_URL` (unset = AWS),
    `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/`AWS_REGION`, `BUCKET`, `RUN_NAME`.
    """

    def __init__(self, bucket: str | None = None, run: str | None = None, endpoint: str | None = None):
        self.endpoint = endpoint or os.environ.get("S3_ENDPOINT_URL") or None
        self.bucket = bucket or os.environ.get("BUCKET", "")
        self.run = (run or os.environ.get("RUN_NAME", "default")).strip("/")
        if not self.bucket:
            raise SystemExit("no bucket: set BUCKET (and S3_ENDPOINT_URL for a non-AWS endpoint)")
        hf_gateway = bool(self.endpoint and "s3.hf.co" in self.endpoint)
        cfg = Config(
            # botocore's own retry loop: exponential backoff with jitter (capped at 20 s) on throttling,
            # 5xx, resets, refused connections; 10 attempts ride out a ~1 minute outage
            retries={"mode": "standard", "max_attempts": int(os.environ.get("S3_MAX_ATTEMPTS", "10"))},
            connect_timeout=5, read_timeout=60, max_pool_connections=32,
            # the HF gateway wants path addressing and no default CRC checksums (DESIGN section 8)
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required" if hf_gateway else "when_supported",
            response_checksum_validation="when_required" if hf_gateway else "when_supported",
        )
        self.s3 = boto3.client("s3", endpoint_url=self.endpoint, config=cfg,
                               region_name=os.environ.get("AWS_REGION", "us-east-1"))

    def key(self, rel: str) -> str:
        return f"{self.run}/{rel}"

    def _fail(self, what: str, rel: str, e: Exception) -> BucketError:
        return BucketError(f"{what} s3://{self.bucket}/{self.key(rel)} at {self.endpoint or 'AWS'} failed: {e}")

    def put(self, rel: str, data: bytes, if_match: str | None = None, if_none_match: bool = False) -> str:
        """Put bytes; optional conditional write. Returns the new ETag. Raises ConflictError on 412."""
        kw: dict[str, Any] = {}
        if if_match:
            kw["IfMatch"] = if_match
        if if_none_match:
            kw["IfNoneMatch"] = "*"
        try:
            r = self.s3.put_object(Bucket=self.bucket, Key=self.key(rel), Body=data, **kw)
            return r["ETag"]
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise ConflictError(f"conditional write of {self.key(rel)} lost: someone else wrote it") from e
            raise self._fail("put", rel, e) from e
        except BotoCoreError as e:
            raise self._fail("put", rel, e) from e

    def get(self, rel: str) -> tuple[bytes, str] | None:
        """Bytes and ETag, or None when the key does not exist."""
        try:
            r = self.s3.get_object(Bucket=self.bucket, Key=self.key(rel))
            return r["Body"].read(), r["ETag"]
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._fail("get", rel, e) from e
        except BotoCoreError as e:
            raise self._fail("get", rel, e) from e

    def put_json(self, rel: str, obj: Any, **kw) -> str:
        return self.put(rel, json.dumps(obj, separators=(",", ":")).encode(), **kw)

    def get_json(self, rel: str) -> Any | None:
        got = self.get(rel)
        return None if got is None else json.loads(got[0])

    def list(self, prefix: str) -> list[str]:
        """Relative keys under `prefix` (ListObjectsV2 only: the HF gateway has nothing else)."""
        out, token = [], None
        try:
            while True:
                kw = {"Bucket": self.bucket, "Prefix": self.key(prefix)}
                if token:
                    kw["ContinuationToken"] = token
                r = self.s3.list_objects_v2(**kw)
                out += [o["Key"][len(self.run) + 1:] for o in r.get("Contents", [])]
                if not r.get("IsTruncated"):
                    return out
                token = r["NextContinuationToken"]
        except (ClientError, BotoCoreError) as e:
            raise self._fail("list", prefix, e) from e

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


def fetch_adapter(bucket: Bucket, version: int, dest: str | Path) -> dict:
    """Download version `version` into `dest` and verify every file against meta.json's sha256."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    meta = bucket.get_json(f"{adapter_prefix(version)}/meta.json")
    if meta is None:
        raise AdapterError(f"version {version}: no meta.json (not published, or upload incomplete)")
    if set(meta.get("files", {})) != set(ADAPTER_FILES):
        raise AdapterError(f"version {version}: meta.json lists {sorted(meta.get('files', {}))}, "
                           f"expected {list(ADAPTER_FILES)}")
    for name, want in meta["files"].items():
        got = bucket.get(f"{adapter_prefix(version)}/{name}")
        if got is None:
            raise AdapterError(f"version {version}: {name} is missing from the bucket")
        digest = hashlib.sha256(got[0]).hexdigest()
        if digest != want:
            raise AdapterError(f"version {version}: {name} sha256 {digest[:12]}... != meta.json {want[:12]}...")
        (dest / name).write_bytes(got[0])
    return meta


# ----------------------------------------------------------------------------------------------
# 3. schema of a trajectory group (DESIGN 3.3). Hard bounds here; the proxy adds its run's limits.

MAX_TOKENS = 32768  # per prompt or completion; the proxy narrows this with its own flags


# constraints pydantic-core checks natively while it parses: a Python validator per element costs
# more than the whole parse of a 2048-token group
TokenId = Annotated[int, Field(ge=0, lt=1 << 24)]
Logprob = Annotated[float, Field(le=1e-4, allow_inf_nan=False)]  # <= 0, with room for rounding


class Completion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_TOKENS)
    logprobs: list[Logprob] = Field(min_length=1, max_length=MAX_TOKENS)
    reward: float = Field(ge=-1e6, le=1e6, allow_inf_nan=False)
    finish_reason: Literal["stop", "length"]

    @model_validator(mode="after")
    def _same_length(self) -> "Completion":
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} token_ids but {len(self.logprobs)} logprobs")
        return self


class TrajectoryGroup(BaseModel):
    """G completions of one prompt, generated by one adapter version (token ids, not text)."""
    model_config = ConfigDict(extra="forbid")
    group_id: str = Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    worker_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    policy_version: int = Field(ge=0, le=10**9)
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
        return v


def new_group_id() -> str:
    return uuid.uuid4().hex


# ----------------------------------------------------------------------------------------------
# 4. math (docs/DESIGN.md, "The math"). Shapes: B groups, G completions, N = B*G sequences, T
# completion tokens. mu: the behaviour policy, i.e. the logprobs the worker recorded while sampling;
# pi: the trainer's policy (with grad); pi_prox: pi's value before this optimizer step (detached).

Objective = Literal["ppo", "cispo", "decoupled"]
OBJECTIVES: tuple[str, ...] = ("ppo", "cispo", "decoupled")


def zero_std_groups(rewards) -> torch.Tensor:
    """[B] bool: groups whose G rewards are all equal (no signal). Decided on the rewards as given:
    max == min in float64, which holds every Python float exactly. A float32 std compared with 0
    would miss some: eight rewards of 0.1 have a float32 std of 7.45e-9."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    return r.amax(dim=1) == r.amin(dim=1)


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
# 5. command lines


def script_args(argv: list[str] | None = None) -> list[str]:
    """CLI args without the leading files that `hf jobs uv run SCRIPT common.py ...` ships beside
    the script (they arrive as /data/common.py in argv, see README); the rest goes to tyro."""
    argv = sys.argv[1:] if argv is None else argv
    here = os.path.dirname(os.path.abspath(sys.argv[0]))
    while argv and os.path.isfile(argv[0]) and os.path.dirname(os.path.abspath(argv[0])) == here:
        argv = argv[1:]
    return argv


# ----------------------------------------------------------------------------------------------
# 6. proxy client (retries with backoff on connection errors, 5xx and 429) and metrics


class ProxyError(RuntimeError):
    """The proxy answered 4xx: our request was wrong; retrying will not help."""


class ProxyBusy(httpx.HTTPError):
    """Still 429 when the caller asked to stop waiting (not retried: the spool keeps the group)."""


def _retryable(e: BaseException) -> bool:
    if isinstance(e, httpx.TransportError):
        return True
    return isinstance(e, httpx.HTTPStatusError) and e.response.status_code >= 500


class ProxyClient:
    """Talks to proxy.py. The proxy token goes in `X-Proxy-Token`; `Authorization` carries the HF
    token when the proxy sits behind the HF Jobs `--expose` gateway, else the proxy token too."""

    def __init__(self, url: str, token: str | None, hf_token: str | None = None, attempts: int = 8):
        headers = {}
        if token:
            headers["X-Proxy-Token"] = token
        auth = hf_token or token
        if auth:
            headers["Authorization"] = f"Bearer {auth}"
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(10, read=120))
        self.backpressure_s = 0.0  # total time spent waiting on 429 answers
        self.should_stop = lambda: False  # checked while waiting on 429: a stopping worker gives up
        self._call = retry(retry=retry_if_exception(_retryable), stop=stop_after_attempt(attempts),
                           wait=wait_exponential(multiplier=0.2, max=10) + wait_random(0, 1), reraise=True)(self._once)

    def _once(self, method: str, path: str, **kw) -> Any:
        while True:
            r = self.http.request(method, path, **kw)
            if r.status_code != 429:
                break
            # backpressure: the proxy's buffer is full; wait as told and count the time
            if self.should_stop():
                raise ProxyBusy(f"{method} {path}: buffer full and we are stopping")
            wait = float(r.headers.get("Retry-After", "1"))
            self.backpressure_s += wait
            time.sleep(wait)
        if 400 <= r.status_code < 500:
            raise ProxyError(f"{method} {path} -> {r.status_code}: {r.text[:500]}")
        r.raise_for_status()
        return r.json()

    def get(self, path: str, **params) -> Any:
        return self._call("GET", path, params=params)

    def post(self, path: str, body: Any = None) -> Any:
        return self._call("POST", path, json=body)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Metrics:
    """One JSON object per line in `metrics/{name}.jsonl` in the bucket (and a local copy).
    S3 has no append, so the whole (small) file is re-uploaded at most every `flush_s`."""

    def __init__(self, bucket: Bucket | None, name: str, flush_s: float = 10.0):
        self.bucket, self.name, self.flush_s = bucket, name, flush_s
        # a restarted role continues its file instead of overwriting it
        got = bucket.get(f"metrics/{name}.jsonl") if bucket is not None else None
        self.lines: list[str] = got[0].decode().splitlines() if got else []
        self._last = 0.0

    def log(self, row: dict) -> None:
        row = {"time": time.time(), **row, "mem/peak_rss_mb": round(peak_rss_mb(), 1)}
        # a NaN (say, a diverged grad norm) is logged as null rather than killing the run
        row = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        self.lines.append(json.dumps(row, allow_nan=False, default=float))
        if time.time() - self._last > self.flush_s:
            self.flush()

    def flush(self) -> None:
        self._last = time.time()
        if self.bucket is not None and self.lines:
            try:
                self.bucket.put(f"metrics/{self.name}.jsonl", ("\n".join(self.lines) + "\n").encode())
            except BucketError as e:  # metrics must never kill a run
                print(f"metrics upload failed (will retry): {e}", file=sys.stderr)

"""The proxy's wire contract: the bodies its routes take and the answers they give, as pydantic models. FastAPI
validates every request against them (a 422 names the field) and publishes them in /openapi.json.

Requests are strict: an unknown field is a mistake worth a 422, and so is a number sent as a string, a float for
an int, or a bool. A scored group's own schema is common.TrajectoryGroup (workers and the trainer share it)."""
from __future__ import annotations

from typing import Literal

from fastapi import Path
from pydantic import BaseModel, ConfigDict, Field

from common import TrajectoryGroup


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ---- groups in, batches out ------------------------------------------------------------------------------------

class SubmitResponse(BaseModel):
    status: str  # accepted | duplicate | stale
    duplicate: bool
    buffer_size: int


# POST /v1/groups parses its body with pydantic-core straight from bytes (4x cheaper than json.loads + validate on
# a 33 kB group), so FastAPI does not see a body parameter; this is the schema /openapi.json shows for it, the one
# FastAPI registers for LeaseResponse.groups
GROUP_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TrajectoryGroup"}}}}}

BatchId = Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")


class LeaseRequest(Strict):
    num_groups: int = Field(ge=1, le=1024)
    wait_s: float = Field(default=0.0, ge=0.0, le=300.0)
    groups_left: int | None = Field(default=None, ge=0, le=10**9)
    """the groups the trainer will still lease, this batch's included (pacing grants no round beyond them)"""
    after_version: int | None = Field(default=None, ge=0)
    """the version the trainer registers before it trains this batch: set when it asks for its next batch while
    it trains one (train.py's prefetch); the staleness filter and pacing count from it. At most latest + 1."""


class LeasedGroup(TrajectoryGroup):
    prompt_dataset: str | None = None
    """the dataset of the prompt lease it answers, as this proxy leased it (a participant's groups)"""
    participant: str | None = None
    """who submitted it (absent: the run's own jobs, on the admin token)"""


class LeaseResponse(BaseModel):
    batch_id: str | None
    groups: list[LeasedGroup]
    latest_version: int
    buffer_size: int
    dropped_stale: int
    expires_in_s: float | None
    waited_s: float
    """how long this request waited for the groups (0: a batch was there); the rest of the answer's time is the
    lease's journal write and the transfer (the fleet simulation tells the two apart, docs/results/fleet.md)"""


class AuditFailure(Strict):
    group_id: str = Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    check: Literal["reward", "prompt", "logprobs", "invalid"]
    """invalid: the trainer cannot train on it at all (it breaks a rule of the schema, or processing it raised)"""
    detail: str = Field(min_length=1, max_length=2000)


class AuditReport(Strict):
    checked: list[str] = Field(default_factory=list, max_length=1024)
    """every group of the batch the trainer audited, passed or failed"""
    failures: list[AuditFailure] = Field(default_factory=list, max_length=1024)


# ---- versions and prompts --------------------------------------------------------------------------------------

class RegisterRequest(Strict):
    version: int = Field(ge=1, le=10**9)
    step: int = Field(ge=0, le=10**12)
    published_at: float = Field(ge=0, le=1e11)
    final: bool = False
    """the trainer is done: workers stop after this version; nothing registers after it"""


class DatasetRequest(Strict):
    dataset: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.:/-]+$")
    size: int = Field(ge=1, le=1 << 22)
    """its prompts: every lease of it must say this size"""


class LeaveRequest(Strict):
    worker_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    """one of the run's own workers (the admin token's), as its groups name it"""
    why: str = Field(default="asked to leave", min_length=1, max_length=500)
    """what the worker is told and logs (the supervisor's autoscaling decision)"""


class PromptLeaseRequest(Strict):
    dataset: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.:/-]+$")
    size: int = Field(ge=1, le=1 << 22)
    n: int = Field(ge=1, le=4096)
    # pacing (pacing.py): a worker that sends wait_s asks for a grant, and waits up to wait_s for one
    worker_id: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    """the worker asking (as in its groups); needed with wait_s"""
    wait_s: float | None = Field(default=None, ge=0.0, le=60.0)
    """ask for a grant: the answer comes once the round can still be trained (at most n prompts), or after
    wait_s with none (retry_s: when to ask again). Absent (or a proxy started with --no-pace): n prompts at once"""
    version: int | None = Field(default=None, ge=0, le=10**9)
    """with wait_s, from a worker that cannot load the latest version (it refused it: corrupt, another LoRA's
    shape): the version it generates with. The grant is counted at that version; none can come when nothing
    generated with it can be trained any more (then `why` says so at once)"""
    refused: str | None = Field(default=None, max_length=500)
    """with version: why the worker refused the newer one (the proxy logs it)"""

"""Hugging Face Jobs plumbing shared by the launcher (launch_hf.py) and the supervisor (supervisor.py):
the job spec of each role, its submission through huggingface_hub's own API (`HfApi.run_uv_job`, the
code behind `hf jobs uv run`), the run's jobs found by label, the proxy's public URL, and the run's
layout kept in the bucket so that any job can be relaunched from the bucket alone.

What a run keeps under `s3://BUCKET/RUN/launch/`:

    plan.json          the layout: every role's script, shipped files, args, flavor, env, timeout and the
                       *names* of its secrets (never values), plus the trainer's last step
    files/NAME         the code and data each job ships (scripts, shared modules, a jsonl task's file),
                       sha256 in plan.json: a relaunched job runs the code the run started with
    stop.json          written by `--cancel`: the supervisor stops relaunching
    supervisor.json    the supervisor's lease (one per run) and heartbeat

and `proxy/endpoint.json` (proxy_client.write_proxy_endpoint): where the proxy answers now.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import common
from common import Bucket
from proxy_client import write_proxy_endpoint

LABEL = "async-grpo-run"        # every job of a run carries {LABEL: run, "role": role}
PROXY_PORT = 8000
HF_S3_GATEWAY = "https://s3.hf.co"
TERMINAL = ("COMPLETED", "CANCELED", "ERROR", "DELETED")   # huggingface_hub's TERMINAL_JOB_STAGES
PLAN, STOP, LEASE, FILES = "launch/plan.json", "launch/stop.json", "launch/supervisor.json", "launch/files"
# $/hour of the flavors at https://huggingface.co/docs/hub/jobs-pricing (Nov 2026), exposed port $0.01/h; a100x4/x8 and
# h200x2/x4/x8 are taken as the one-GPU price times the GPUs, not read from that page: check it before budgeting on them
PRICES = {"cpu-basic": 0.01, "cpu-upgrade": 0.03, "t4-small": 0.40, "t4-medium": 0.60, "l4x1": 0.80,
          "l4x4": 3.80, "l40sx1": 1.80, "a10g-small": 1.00, "a10g-large": 1.50, "a10g-largex2": 3.00,
          "a100-large": 2.50, "h200": 5.00, "a100x4": 10.00, "a100x8": 20.00, "h200x2": 10.00, "h200x4": 20.00,
          "h200x8": 40.00}
EXPOSE_PRICE = 0.01
CALLER_SECRETS = ("HF_TOKEN", "PROXY_HF_TOKEN", "PROXY_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
ROOT = Path(common.__file__).resolve().parent  # the repository (in a job: /data, where every file lands)


def modules() -> dict[str, Path]:
    """Our importable modules by stem: the top-level scripts and common.py, and lib/*/*.py. Stems are unique
    (a test checks it): in a job every file lands flat beside the script, under its own name."""
    return {p.stem: p for p in [*ROOT.glob("*.py"), *ROOT.glob("lib/*/*.py")]}


@functools.cache
def shipped(script: str) -> tuple[str, ...]:
    """The repository's modules `script` imports, directly or through one another, lazily imported ones
    included: exactly the files that must travel beside it to a job (`hf jobs uv run SCRIPT FILE...`), by the
    names they have there (journal.py; modules() says where each is here). Read from the code, so a new
    module can never be forgotten in a job's file list."""
    ours = modules()
    found, todo = set(), [ours[Path(script).stem]]
    while todo:
        for node in ast.walk(ast.parse(todo.pop().read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for m in {n.split(".")[0] for n in names} & set(ours) - {Path(script).stem}:
                if m not in found:
                    found.add(m)
                    todo.append(ours[m])
    return tuple(sorted(f"{m}.py" for m in found))


@dataclass
class JobSpec:
    role: str                   # proxy, rollout-1..N, trainer, supervisor
    script: str
    files: list[str]            # names of the files shipped beside the script (launch/files/NAME)
    args: list[str]
    flavor: str
    secrets: list[str]          # names; values come from the submitter's environment
    env: dict[str, str]
    timeout: str = "6h"
    expose: list[int] = field(default_factory=list)
    dependencies: list[str] = field(default_factory=list)


def stage(job) -> str:
    return str(getattr(job.status.stage, "value", job.status.stage))


def role(job) -> str:
    return (job.labels or {}).get("role", "?")


# ---------------------------------------------------------------------------------------------
# the Hub: clear errors instead of tracebacks


@contextlib.contextmanager
def hub_errors(what: str):
    """Turn the Hub's errors into one clear line: not logged in / no access / unreachable."""
    from huggingface_hub.errors import HfHubHTTPError
    try:
        yield
    except HfHubHTTPError as e:
        code = getattr(e.response, "status_code", None)
        if code in (401, 403):
            raise SystemExit(f"{what}: Hugging Face refused the token ({code}): log in with `hf auth login` "
                             "(or export HF_TOKEN) with a token that may read and run jobs in that namespace") from None
        why = (getattr(e, "server_message", None) or str(e).splitlines()[0]).strip()
        raise SystemExit(f"{what}: the Hub answered {code}: {why}") from None
    except OSError as e:
        raise SystemExit(f"{what}: cannot reach the Hub: {e}") from None
    except Exception as e:  # httpx/httpx2 transport errors (connection refused, DNS, timeouts)
        if "httpx" in type(e).__module__:
            from huggingface_hub import constants
            raise SystemExit(f"{what}: cannot reach the Hub at {constants.ENDPOINT} "
                             f"({type(e).__name__}: {e})") from None
        raise


def local_token() -> str:
    from huggingface_hub import get_token
    token = get_token()
    if not token:
        raise SystemExit("not logged in to Hugging Face: run `hf auth login` (or export HF_TOKEN)")
    return token


def whoami(api, token: str) -> str:
    with hub_errors("asking the Hub who you are"):
        return api.whoami(token=token)["name"]


def secret_values(token: str) -> dict[str, str]:
    """The values of every secret a job may be given (from this process's environment)."""
    return {"HF_TOKEN": token, "PROXY_HF_TOKEN": token, **{k: os.environ.get(k, "") for k in CALLER_SECRETS[2:]}}


def run_jobs(api, run: str, namespace: str | None) -> list:
    return list(api.list_jobs(labels={LABEL: run}, namespace=namespace))


def newest_by_role(jobs: list) -> dict:
    """The newest job of each role (a relaunch is a new job; the old ones stay listed)."""
    out: dict = {}
    for j in sorted(jobs, key=lambda j: (j.created_at.timestamp() if j.created_at else 0.0, j.id)):
        out[role(j)] = j
    return out


def submit(api, spec: JobSpec, run: str, namespace: str, secrets: dict[str, str], workdir: Path):
    """Submit one job; its files are taken from `workdir` (the run's files, by their shipped names)."""
    missing = [k for k in spec.secrets if not secrets.get(k)]
    if missing:
        raise SystemExit(f"cannot submit the {spec.role} job: secret(s) {', '.join(missing)} not set here")
    local = [str(workdir / name) for name in [spec.script, *spec.files]]
    return api.run_uv_job(
        local[0], script_args=[*local[1:], *spec.args], dependencies=spec.dependencies or None,
        env=spec.env, secrets={k: secrets[k] for k in spec.secrets}, flavor=spec.flavor, timeout=spec.timeout,
        name=f"{run}-{spec.role}", labels={LABEL: run, "role": spec.role}, expose=spec.expose or None,
        namespace=namespace)


def wait_for_proxy(api, job_id: str, namespace: str, token: str, wait_s: float, poll_s: float, log=print) -> str:
    """Poll the proxy job until its exposed URL answers /health; return that URL. Raises RuntimeError
    (the job ended, or did not answer in time) with a message that says what to look at."""
    from huggingface_hub.utils import get_session
    t0, shown, why = time.time(), None, "not running yet"
    while True:
        with hub_errors(f"watching the proxy job {job_id}"):
            info = api.inspect_job(job_id=job_id, namespace=namespace)
        st = stage(info)
        if st in TERMINAL:
            raise RuntimeError(f"the proxy job {job_id} ended ({st}: {info.status.message or 'no message'}) before "
                               f"answering; see `hf jobs logs {job_id}`")
        urls = info.status.expose_urls or []
        if st == "RUNNING" and urls:
            try:
                r = get_session().get(f"{urls[0].rstrip('/')}/health", timeout=10,
                                      headers={"Authorization": f"Bearer {token}"})
                if r.status_code == 200:
                    return urls[0].rstrip("/")
                why = f"/health answered {r.status_code}"
            except Exception as e:  # the gateway may refuse connections until the server listens
                why = f"{type(e).__name__}: {e}"
        if st != shown:
            log(f"  proxy job {job_id}: {st}")
            shown = st
        if time.time() - t0 >= wait_s:
            raise RuntimeError(f"the proxy job {job_id} did not answer within {wait_s:.0f} s ({why}); "
                               f"see `hf jobs logs {job_id}`")
        time.sleep(poll_s)


def record_proxy(bucket: Bucket, url: str, job_id: str, token: str, written_by: str) -> dict:
    """Write the proxy's address record; its incarnation comes from /v1/stats when the proxy tells."""
    from huggingface_hub.utils import get_session
    incarnation = None
    try:
        r = get_session().get(f"{url}/v1/stats", timeout=10, headers={
            "Authorization": f"Bearer {token}", "X-Proxy-Token": os.environ.get("PROXY_TOKEN", "")})
        incarnation = r.json().get("incarnation") if r.status_code == 200 else None
    except Exception:  # informative only: the URL is what clients need
        pass
    return write_proxy_endpoint(bucket, url, job_id=job_id, incarnation=incarnation, written_by=written_by)


def identity() -> str:
    """Who is acting: the job's id inside a job, else host-pid."""
    return os.environ.get("JOB_ID") or f"{socket.gethostname()}-{os.getpid()}"


def timeout_seconds(timeout: str) -> int:
    """A job timeout as huggingface_hub reads it: whole seconds ("90"), or a number with s, m, h or d
    ("1.5h"). Anything else ("1.5", "6 h", "1e3s") it rejects with a ValueError at submission."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])|(\d+)", timeout)
    if not m:
        raise ValueError(f"timeout {timeout!r}: whole seconds (90) or a number with s, m, h or d (1.5h)")
    seconds = int(m[3]) if m[3] else int(float(m[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m[2]])
    if seconds < 1:
        raise ValueError(f"timeout {timeout!r}: at least one second")
    return seconds


# ---------------------------------------------------------------------------------------------
# the run's layout in the bucket


def run_bucket(bucket: str, run: str, endpoint: str) -> Bucket:
    return Bucket(bucket=bucket, run=run, endpoint=endpoint)


def save_launch(bucket: Bucket, meta: dict, specs: list[JobSpec], sources: dict[str, Path]) -> dict:
    """Upload every shipped file to launch/files/ and the plan (specs + sha256 of each file)."""
    digests = {}
    for name, path in sorted(sources.items()):
        data = Path(path).read_bytes()
        digests[name] = hashlib.sha256(data).hexdigest()
        bucket.put(f"{FILES}/{name}", data)
    plan = {**meta, "launched_at": time.time(), "launched_by": identity(), "files": digests,
            "jobs": [asdict(s) for s in specs]}
    bucket.put_json(PLAN, plan)
    return plan


def load_launch(bucket: Bucket, dest: Path) -> tuple[dict, list[JobSpec]] | None:
    """The run's plan and its files (written into `dest`, each checked against its sha256); None
    when the run was not started by the launcher."""
    plan = bucket.get_json(PLAN)
    if plan is None:
        return None
    dest.mkdir(parents=True, exist_ok=True)
    for name, want in plan["files"].items():
        if not re.fullmatch(r"[^/\\]+", name) or name in (".", ".."):
            raise SystemExit(f"launch/plan.json names a file {name!r}: refusing to write outside {dest}")
        got = bucket.get(f"{FILES}/{name}")
        if got is None or hashlib.sha256(got[0]).hexdigest() != want:
            raise SystemExit(f"launch/files/{name} is missing or does not match plan.json's sha256")
        (dest / name).write_bytes(got[0])
    return plan, [JobSpec(**j) for j in plan["jobs"]]


def stopped(bucket: Bucket, plan: dict | None) -> dict | None:
    """The stop marker of `--cancel`, if it is newer than the plan (a relaunch of the run clears it)."""
    stop = bucket.get_json(STOP)
    if stop and (plan is None or stop.get("at", 0) > plan.get("launched_at", 0)):
        return stop
    return None


def final_step(spec: JobSpec) -> int | None:
    """The trainer's last step from its args (tyro takes the last --max-steps)."""
    steps = None
    for i, a in enumerate(spec.args):
        if a == "--max-steps" and i + 1 < len(spec.args):
            steps = int(spec.args[i + 1])
        elif a.startswith("--max-steps="):
            steps = int(a.split("=", 1)[1])
    return steps

# /// script
# requires-python = ">=3.10"
# dependencies = ["huggingface_hub>=1.13", "boto3>=1.36", "tyro>=0.9"]
# ///
"""Start, watch and stop an async GRPO run on Hugging Face Jobs. `bash launch_jobs.sh` (without
--local) runs this file; it submits through huggingface_hub's own API (`HfApi.run_uv_job`), the
code behind `hf jobs uv run`, and `--dry-run` prints the equivalent `hf jobs uv run` commands.

    bash launch_jobs.sh --dry-run                   # the exact commands, nothing is called
    bash launch_jobs.sh --run my-run                # bucket, proxy (waits until it answers), 2 rollout jobs, trainer
    bash launch_jobs.sh --status my-run             # every job of the run (label async-grpo-run=my-run)
    bash launch_jobs.sh --cancel my-run             # cancel every job of the run that is still going
    bash launch_jobs.sh --run my-run --token-create alice --role worker   # a contributor's token (printed once)
    bash launch_jobs.sh --run my-run --token-revoke alice                 # their next request gets 401

Needs: `hf` (huggingface_hub >= 1.13) and a login (`hf auth login` or HF_TOKEN); PROXY_TOKEN (the
proxy's shared secret) and AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (bucket credentials: the HFAK...
keys of the Storage Buckets S3 gateway, or your S3 provider's) exported. Secrets travel to the jobs
as HF Jobs secrets; this file prints their names only.

Each job runs `uv run /data/SCRIPT /data/common.py /data/models.py /data/tasks.py ARGS`: huggingface_hub
uploads every script argument that is a local file to the private bucket <namespace>/jobs-artifacts and
mounts the job's folder at /data, so the shared modules land beside the script (which drops them from its argv).
"""
from __future__ import annotations

import os
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import tyro

ROOT = os.path.dirname(os.path.abspath(__file__))
LABEL = "async-grpo-run"       # every job of a run carries {LABEL: run}; --status/--cancel find them by it
PROXY_PORT = 8000
POLL_S = 5.0                    # seconds between looks at the proxy job while it starts
HF_S3_GATEWAY = "https://s3.hf.co"
# $/hour of the flavors at https://huggingface.co/docs/hub/jobs-pricing (Nov 2026), exposed port $0.01/h
PRICES = {"cpu-basic": 0.01, "cpu-upgrade": 0.03, "t4-small": 0.40, "t4-medium": 0.60, "l4x1": 0.80,
          "l4x4": 3.80, "l40sx1": 1.80, "a10g-small": 1.00, "a10g-large": 1.50, "a10g-largex2": 3.00,
          "a100-large": 2.50, "h200": 5.00}
EXPOSE_PRICE = 0.01


@dataclass
class Args:
    run: str = field(default_factory=lambda: time.strftime("grpo-%Y%m%d-%H%M%S"))
    """run name: the bucket prefix s3://BUCKET/RUN/ and the job label; reuse it to resume a run"""
    workers: int = 2
    """rollout jobs"""
    model: str = "Qwen/Qwen2.5-0.5B-Instruct"
    task: str = "gsm8k"
    """gsm8k, addition or jsonl:PATH (the file is shipped to the jobs beside the scripts)"""
    steps: int = 200
    """trainer optimizer steps"""
    group_size: int = 8
    max_new_tokens: int = 512
    proxy_flavor: str = "cpu-upgrade"
    rollout_flavor: str = "l4x1"
    trainer_flavor: str = "a10g-small"
    timeout: str = "6h"
    """per job (HF Jobs' default is 30 minutes)"""
    rollout_with: str = ""
    """extra packages for the rollout jobs, comma-separated (`uv run --with`); rollout.py's header has vllm"""
    bucket: str = field(default_factory=lambda: os.environ.get("BUCKET", "async-grpo"))
    """bucket name (env BUCKET); a Hugging Face Storage Bucket <namespace>/<bucket> unless S3_ENDPOINT_URL is set"""
    namespace: str | None = None
    """user or org that runs the jobs and owns the bucket (default: yours)"""
    proxy_wait_s: float = 900.0
    """how long to wait for the proxy job to answer /health"""
    train_arg: tyro.conf.UseAppendAction[list[str]] = field(default_factory=list)
    """one extra arg for train.py, repeatable: --train-arg=--lr --train-arg=1e-5"""
    rollout_arg: tyro.conf.UseAppendAction[list[str]] = field(default_factory=list)
    """one extra arg for rollout.py, repeatable"""
    dry_run: bool = False
    """print the exact commands; call nothing"""
    status: str | None = None
    """RUN: show every job of that run"""
    cancel: str | None = None
    """RUN: cancel every job of that run that has not ended"""
    token_create: str | None = None
    """NAME: create a participant token on the run's proxy (--role, --max-rps); printed once"""
    token_revoke: str | None = None
    """NAME: revoke a participant's token (its next request gets 401)"""
    token_limit: str | None = None
    """NAME: set a participant's rate limit to --max-rps"""
    token_list: bool = False
    """list the run's participants"""
    role: Literal["worker", "trainer", "admin"] = "worker"
    """with --token-create: worker (prompts, groups, adapters), trainer (also batches, registrations), admin"""
    max_rps: float = 0.0
    """with --token-create / --token-limit: requests per second for that participant (0: no limit)"""
    proxy_url: str | None = field(default_factory=lambda: os.environ.get("PROXY_URL"))
    """the proxy for the token commands (env PROXY_URL; default: the exposed URL of --run's proxy job)"""


@dataclass
class JobSpec:
    role: str                   # proxy, rollout-1..N, trainer
    script: str
    files: list[str]            # shipped beside the script (common.py, a jsonl task's file)
    args: list[str]
    flavor: str
    secrets: list[str]          # names; values come from the local environment at submission
    env: dict[str, str]
    expose: list[int] = field(default_factory=list)
    dependencies: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# the plan: what every job of a run gets (pure: used by --dry-run, the submission and the tests)


SHIPPED = ("common.py", "models.py", "tasks.py", "journal.py", "access.py", "serving.py", "adapter_files.py", "prompts.py",
           "participants.py")  # shared modules, uploaded beside every script


def bucket_env(args: Args, namespace: str) -> dict[str, str]:
    """Where the jobs find the run: an HF Storage Bucket through its S3 gateway, or any S3."""
    endpoint = os.environ.get("S3_ENDPOINT_URL") or f"{HF_S3_GATEWAY}/{namespace}"
    return {"BUCKET": args.bucket, "RUN_NAME": args.run, "S3_ENDPOINT_URL": endpoint,
            "AWS_REGION": os.environ.get("AWS_REGION", "us-east-1"), "PYTHONUNBUFFERED": "1"}


def plan(args: Args, namespace: str, proxy_url: str) -> list[JobSpec]:
    files, task = list(SHIPPED), args.task
    if task.startswith("jsonl:"):  # ship the user's file too; the jobs read it from /data
        files.append(task[len("jsonl:"):])
        task = f"jsonl:/data/{os.path.basename(files[-1])}"
    env = bucket_env(args, namespace)
    bucket_secrets = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
    # behind the --expose gateway: Authorization carries the HF token, X-Proxy-Token the proxy secret
    caller_secrets = ["HF_TOKEN", "PROXY_HF_TOKEN", "PROXY_TOKEN", *bucket_secrets]
    G = ["--group-size", str(args.group_size)]
    jobs = [JobSpec("proxy", "proxy.py", files, ["--host", "0.0.0.0", "--port", str(PROXY_PORT), *G],
                    args.proxy_flavor, ["PROXY_TOKEN", *bucket_secrets], env, expose=[PROXY_PORT])]
    for i in range(1, args.workers + 1):
        jobs.append(JobSpec(f"rollout-{i}", "rollout.py", files,
                            ["--model", args.model, "--task", task, *G, "--max-new-tokens", str(args.max_new_tokens),
                             "--worker-id", f"{args.run}-w{i}", "--seed", str(i), *args.rollout_arg],
                            args.rollout_flavor, caller_secrets, {**env, "PROXY_URL": proxy_url},
                            dependencies=[d for d in args.rollout_with.split(",") if d.strip()]))
    jobs.append(JobSpec("trainer", "train.py", list(SHIPPED), ["--model", args.model, "--max-steps", str(args.steps),
                                                              *args.train_arg],
                        args.trainer_flavor, caller_secrets,
                        # a relaunch of the run (same name) takes the trainer's claim over at once and resumes
                        {**env, "PROXY_URL": proxy_url, "TRAINER_ID": f"{args.run}-trainer"}))
    return jobs


def hf_command(job: JobSpec, args: Args, namespace: str | None) -> str:
    """The `hf jobs uv run` command equivalent to submitting `job` (secrets by name only)."""
    cmd = ["hf", "jobs", "uv", "run", "--detach", "--flavor", job.flavor, "--timeout", args.timeout,
           "--name", f"{args.run}-{job.role}", "--label", f"{LABEL}={args.run}", "--label", f"role={job.role}"]
    cmd += ["--namespace", namespace] if namespace else []
    for d in job.dependencies:
        cmd += ["--with", d]
    for p in job.expose:
        cmd += ["--expose", str(p)]
    for s in job.secrets:
        cmd += ["--secrets", s]
    for k, v in job.env.items():
        cmd += ["-e", f"{k}={v}"]
    return shlex.join(cmd + [job.script, *job.files, *job.args])


def cost_per_hour(args: Args) -> float:
    flavors = [args.proxy_flavor, *[args.rollout_flavor] * args.workers, args.trainer_flavor]
    unknown = [f for f in flavors if f not in PRICES]
    if unknown:
        return float("nan")
    return sum(PRICES[f] for f in flavors) + EXPOSE_PRICE


# ---------------------------------------------------------------------------------------------
# checks: fail early and clearly


def check_args(args: Args) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,60}", args.run):
        raise SystemExit(f"--run {args.run!r}: use 1-60 letters, digits, '-' or '_' (it is a job label and a bucket prefix)")
    if args.workers < 1 or args.steps < 1 or args.group_size < 2:
        raise SystemExit("--workers and --steps must be >= 1, --group-size >= 2")
    if not re.fullmatch(r"\d+(\.\d+)?[smhd]?", args.timeout):
        raise SystemExit(f"--timeout {args.timeout!r}: a number with s, m, h or d (e.g. 6h)")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,62}", args.bucket):
        raise SystemExit(f"bucket {args.bucket!r}: lowercase letters, digits, '-' and '.' (env BUCKET or --bucket)")
    if args.task.startswith("jsonl:") and not os.path.isfile(args.task[len("jsonl:"):]):
        raise SystemExit(f"--task {args.task}: no such file")


def missing_env() -> list[str]:
    need = {"PROXY_TOKEN": "the proxy's shared secret, e.g. export PROXY_TOKEN=$(openssl rand -hex 24)",
            "AWS_ACCESS_KEY_ID": "bucket access key (Storage Buckets S3 gateway: HFAK...; or your S3's)",
            "AWS_SECRET_ACCESS_KEY": "bucket secret key"}
    return [f"  {k}: {why}" for k, why in need.items() if not os.environ.get(k)]


def local_token() -> str:
    from huggingface_hub import get_token
    token = get_token()
    if not token:
        raise SystemExit("not logged in to Hugging Face: run `hf auth login` (or export HF_TOKEN)")
    return token


def whoami(api, token: str) -> str:
    from huggingface_hub.errors import HfHubHTTPError
    try:
        return api.whoami(token=token)["name"]
    except HfHubHTTPError as e:
        raise SystemExit(f"Hugging Face rejected the token: {e}") from e


# ---------------------------------------------------------------------------------------------
# launch


def ensure_bucket(api, args: Args, namespace: str, endpoint: str) -> str:
    if endpoint.startswith(HF_S3_GATEWAY):
        url = api.create_bucket(f"{namespace}/{args.bucket}", private=True, exist_ok=True)
        return str(getattr(url, "url", url))
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError
    s3 = boto3.client("s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"}),
                      region_name=os.environ.get("AWS_REGION", "us-east-1"))
    try:
        s3.head_bucket(Bucket=args.bucket)
    except ClientError:
        s3.create_bucket(Bucket=args.bucket)
    return f"s3://{args.bucket} at {endpoint}"


def submit(api, job: JobSpec, args: Args, namespace: str, secret_values: dict[str, str]):
    return api.run_uv_job(
        job.script, script_args=[*job.files, *job.args], dependencies=job.dependencies or None,
        env=job.env, secrets={k: secret_values[k] for k in job.secrets}, flavor=job.flavor, timeout=args.timeout,
        name=f"{args.run}-{job.role}", labels={LABEL: args.run, "role": job.role},
        expose=job.expose or None, namespace=namespace)


def wait_for_proxy(api, job, run: str, namespace: str, token: str, wait_s: float) -> str:
    """Poll the proxy job until its exposed URL answers /health; return that URL."""
    from huggingface_hub.utils import get_session
    t0, shown, why = time.time(), None, "not running yet"
    while time.time() - t0 < wait_s:
        info = api.inspect_job(job_id=job.id, namespace=namespace)
        stage = str(getattr(info.status.stage, "value", info.status.stage))
        if stage in ("COMPLETED", "CANCELED", "ERROR", "DELETED"):
            raise SystemExit(f"the proxy job {job.id} ended ({stage}: {info.status.message or 'no message'}) before "
                             f"answering; see `hf jobs logs {job.id}`")
        urls = info.status.expose_urls or []
        if stage == "RUNNING" and urls:
            try:
                r = get_session().get(f"{urls[0].rstrip('/')}/health", timeout=10,
                                      headers={"Authorization": f"Bearer {token}"})
                if r.status_code == 200:
                    return urls[0].rstrip("/")
                why = f"/health answered {r.status_code}"
            except Exception as e:  # the gateway may refuse connections until the server listens
                why = f"{type(e).__name__}: {e}"
        if stage != shown:
            print(f"  proxy job {job.id}: {stage}", flush=True)
            shown = stage
        time.sleep(POLL_S)
    raise SystemExit(f"the proxy job {job.id} did not answer within {wait_s:.0f} s ({why}); "
                     f"see `hf jobs logs {job.id}`, stop it with `bash launch_jobs.sh --cancel {run}`")


def launch(args: Args) -> None:
    from huggingface_hub import HfApi
    token = local_token()
    if missing := missing_env():  # before any network call
        raise SystemExit("set these environment variables first:\n" + "\n".join(missing))
    api = HfApi()
    namespace = args.namespace or whoami(api, token)
    endpoint = bucket_env(args, namespace)["S3_ENDPOINT_URL"]
    print(f"run {args.run}: bucket {ensure_bucket(api, args, namespace, endpoint)} (prefix {args.run}/)")
    secret_values = {"HF_TOKEN": token, "PROXY_HF_TOKEN": token, "PROXY_TOKEN": os.environ["PROXY_TOKEN"],
                     "AWS_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
                     "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"]}
    proxy_spec = plan(args, namespace, proxy_url="")[0]
    try:
        proxy = submit(api, proxy_spec, args, namespace, secret_values)
    except Exception as e:
        raise SystemExit(f"submitting the proxy job failed: {e}") from e
    print(f"proxy   {proxy.id}  {proxy_spec.flavor:12s} {proxy.url}\n  waiting for it to answer (up to "
          f"{args.proxy_wait_s:.0f} s)...", flush=True)
    proxy_url = wait_for_proxy(api, proxy, args.run, namespace, token, args.proxy_wait_s)
    print(f"  proxy answers at {proxy_url}")
    started = [(proxy_spec, proxy)]
    for spec in plan(args, namespace, proxy_url)[1:]:
        try:
            job = submit(api, spec, args, namespace, secret_values)
        except Exception as e:  # quota, credits, a bad flavor: say so, and what is already running
            raise SystemExit(f"submitting the {spec.role} job failed: {e}\n{len(started)} job(s) of run {args.run} "
                             f"already started; stop them with `bash launch_jobs.sh --cancel {args.run}`") from e
        started.append((spec, job))
        print(f"{spec.role:9s} {job.id}  {spec.flavor:12s} {job.url}", flush=True)
    print(f"\n{len(started)} jobs started (about ${cost_per_hour(args):.2f}/hour while they run). Follow them:")
    for spec, job in started:
        print(f"  hf jobs logs -f {job.id}    # {spec.role}")
    print(f"  bash launch_jobs.sh --status {args.run}     # every job of the run\n"
          f"  bash launch_jobs.sh --cancel {args.run}     # stop the run (the bucket keeps everything)")


def run_jobs(api, run: str, namespace: str | None):
    return list(api.list_jobs(labels={LABEL: run}, namespace=namespace))


def status(args: Args) -> None:
    from huggingface_hub import HfApi
    api = HfApi()
    namespace = args.namespace or whoami(api, local_token())
    jobs = run_jobs(api, args.status, namespace)
    if not jobs:
        raise SystemExit(f"no jobs labelled {LABEL}={args.status} in {namespace}")
    for j in sorted(jobs, key=lambda j: (j.labels or {}).get("role", "")):
        urls = " ".join(j.status.expose_urls or [])
        print(f"{(j.labels or {}).get('role', '?'):10s} {j.id}  {str(j.flavor):12s} "
              f"{getattr(j.status.stage, 'value', j.status.stage):10s} {j.url} {urls}".rstrip())


def cancel(args: Args) -> None:
    from huggingface_hub import HfApi
    api = HfApi()
    namespace = args.namespace or whoami(api, local_token())
    jobs = run_jobs(api, args.cancel, namespace)
    live = [j for j in jobs if str(getattr(j.status.stage, "value", j.status.stage)) in ("SCHEDULING", "RUNNING")]
    if not jobs:
        raise SystemExit(f"no jobs labelled {LABEL}={args.cancel} in {namespace}")
    for j in live:
        api.cancel_job(job_id=j.id, namespace=namespace)
        print(f"cancelled {(j.labels or {}).get('role', '?'):10s} {j.id}")
    print(f"{len(live)} of {len(jobs)} jobs of run {args.cancel} cancelled; the bucket keeps adapters, "
          f"checkpoints and metrics (resume: bash launch_jobs.sh --run {args.cancel})")


# ---------------------------------------------------------------------------------------------
# participants: the proxy's admin endpoints (/v1/tokens), called with PROXY_TOKEN


def run_proxy_url(args: Args, token: str) -> str:
    """The exposed URL of the run's proxy job (label async-grpo-run=RUN, role=proxy)."""
    from huggingface_hub import HfApi
    api = HfApi()
    namespace = args.namespace or whoami(api, token)
    for j in run_jobs(api, args.run, namespace):
        stage = str(getattr(j.status.stage, "value", j.status.stage))
        if (j.labels or {}).get("role") == "proxy" and stage == "RUNNING" and j.status.expose_urls:
            return j.status.expose_urls[0].rstrip("/")
    raise SystemExit(f"no running proxy job for run {args.run!r} in {namespace}: pass --proxy-url URL")


def tokens(args: Args) -> None:
    from huggingface_hub.utils import get_session
    admin = os.environ.get("PROXY_TOKEN")
    if not admin:
        raise SystemExit("set PROXY_TOKEN (the run's admin token) first")
    hf_token = None if args.proxy_url else local_token()
    url = (args.proxy_url or run_proxy_url(args, hf_token)).rstrip("/")
    if ".hf.jobs" in url:  # the --expose gateway checks an HF token in Authorization; the proxy, X-Proxy-Token
        hf_token = hf_token or local_token()
    headers = {"X-Proxy-Token": admin, "Authorization": f"Bearer {hf_token or admin}"}
    if args.token_create:
        method, path, body = "POST", "/v1/tokens", {"name": args.token_create, "role": args.role, "max_rps": args.max_rps}
    elif args.token_revoke:
        method, path, body = "DELETE", f"/v1/tokens/{args.token_revoke}", None
    elif args.token_limit:
        method, path, body = "PATCH", f"/v1/tokens/{args.token_limit}", {"max_rps": args.max_rps}
    else:
        method, path, body = "GET", "/v1/tokens", None
    try:
        r = get_session().request(method, url + path, json=body, headers=headers, timeout=30)
    except Exception as e:  # noqa: BLE001 - unreachable proxy: say where
        raise SystemExit(f"the proxy at {url} did not answer: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise SystemExit(f"{method} {path} -> {r.status_code}: {r.text[:500]}")
    got = r.json()
    limit = lambda p: f"{p['max_rps']:g} requests/s" if p["max_rps"] else "no rate limit"  # noqa: E731
    if args.token_create:
        print(f"participant {got['name']} ({got['role']}, {limit(got)}) on {url}\n"
              f"token (shown once; the proxy keeps only its sha256):\n  {got['token']}\n"
              f"give them:  PROXY_URL={url}  PROXY_TOKEN=<that token>  (README: Join a run from your own machine)")
    elif args.token_revoke:
        print(f"participant {got['name']} revoked: its next request gets 401; its accepted groups stay in the run")
    elif args.token_limit:
        print(f"participant {got['name']}: {limit(got)} from its next request on")
    else:
        for p in got["tokens"]:
            print(f"{p['name']:20s} {p['role']:8s} {limit(p):22s} {'revoked' if p['revoked_at'] else 'active'}")


def dry_run(args: Args) -> None:
    namespace = args.namespace
    ns = namespace or "<your-namespace>"
    print(f"# run {args.run}: {args.workers} rollout job(s) on {args.rollout_flavor}, trainer on {args.trainer_flavor}, "
          f"proxy on {args.proxy_flavor}; about ${cost_per_hour(args):.2f}/hour")
    if missing := missing_env():
        print("# not set yet (required for a real launch):\n" + "\n".join("#" + m for m in missing))
    if "S3_ENDPOINT_URL" not in os.environ:
        print(f"hf buckets create {ns}/{args.bucket} --private --exist-ok")
    print('export PROXY_HF_TOKEN="${HF_TOKEN:-$(hf auth token)}"  # the callers\' token for the --expose gateway')
    jobs = plan(args, ns, proxy_url="https://<proxy-job-id>--8000.hf.jobs")
    print(hf_command(jobs[0], args, namespace))
    print("# wait until the proxy job is RUNNING and its URL (hf jobs inspect <proxy-job-id>: status.expose_urls) "
          "answers /health, then:")
    for job in jobs[1:]:
        print(hf_command(job, args, namespace))


def main(argv: list[str] | None = None) -> None:
    import inspect

    import huggingface_hub
    if "expose" not in inspect.signature(huggingface_hub.HfApi.run_uv_job).parameters:
        raise SystemExit(f"huggingface_hub {huggingface_hub.__version__} cannot expose a job's port: "
                         "pip install -U 'huggingface_hub>=1.13'")
    args = tyro.cli(Args, args=argv, prog="launch_jobs.sh")
    os.chdir(ROOT)  # the scripts are shipped by their relative names
    if args.status:
        return status(args)
    if args.cancel:
        return cancel(args)
    if args.token_create or args.token_revoke or args.token_limit or args.token_list:
        return tokens(args)
    check_args(args)
    if args.dry_run:
        return dry_run(args)
    launch(args)


if __name__ == "__main__":
    main()

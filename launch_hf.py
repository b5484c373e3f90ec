# /// script
# requires-python = ">=3.10"
# dependencies = ["huggingface_hub>=1.24", "boto3>=1.36", "tyro>=0.9", "httpx>=0.27", "pydantic>=2.7", "tenacity>=8.2"]
# ///
"""Start, watch, supervise and stop an async GRPO run on Hugging Face Jobs. `bash launch_jobs.sh`
(without --local) runs this file; it submits through huggingface_hub's own API (`HfApi.run_uv_job`,
the code behind `hf jobs uv run`), and `--dry-run` prints the equivalent `hf jobs uv run` commands.

    bash launch_jobs.sh --dry-run                   # the exact commands; submits nothing
    bash launch_jobs.sh --run my-run                # bucket, proxy (waits until it answers), 2 rollout jobs, trainer, supervisor
    bash launch_jobs.sh --status my-run             # every job of the run (label async-grpo-run=my-run)
    bash launch_jobs.sh --watch my-run              # supervise here: relaunch any job that ends before the run is done
    bash launch_jobs.sh --cancel my-run             # stop the supervisor and every job of the run
    bash launch_jobs.sh --run my-run --token-create alice --role worker   # a contributor's token (printed once)
    bash launch_jobs.sh --run my-run --token-revoke alice                 # their next request gets 401
    bash launch_jobs.sh --run my-run --token-reinstate alice              # lift a quarantine (docs/trust.md)

Needs huggingface_hub >= 1.24 (`expose`, `name`, `list_jobs(labels=)`, `status.expose_urls`), tyro,
boto3, httpx, pydantic and tenacity (or uv, which reads this header), and a login (`hf auth login`
or HF_TOKEN); PROXY_TOKEN (the proxy's shared secret) and AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
(bucket credentials: the HFAK... keys of the Storage Buckets S3 gateway, or your S3 provider's)
exported. Secrets travel to the jobs as HF Jobs secrets; this file prints their names only.

Each job runs `uv run /data/SCRIPT /data/common.py ... ARGS` (hf_jobs.shipped: the modules SCRIPT imports): huggingface_hub
uploads every script argument that is a local file to the private bucket <namespace>/jobs-artifacts and
mounts the job's folder at /data, so the shared modules land beside the script (which drops them from
its argv). The launcher first stores the run's layout and those files under s3://BUCKET/RUN/launch/
(hf_jobs.py), and submits from that copy, exactly as the supervisor (supervisor.py) relaunches a job.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Literal

import tyro

# common first: importing it puts the lib/ folders on sys.path (in a job every file lands beside this one)
from common import script_args
import memory
from costs import EXPOSE_PRICE, PRICES
import presets
from tasks import token_budget
from hf_jobs import (FILES, HF_S3_GATEWAY, LABEL, PLAN, PROXY_PORT, STANDBY, STANDBY_TERM_S, STOP, TERMINAL, JobSpec,
                     hub_errors, identity, load_launch, local_token, newest_by_role, record_proxy, role, run_bucket, run_jobs, save_launch,
                     modules, secret_values, shipped, stage, submit, timeout_seconds, wait_for_proxy, whoami)
from proxy_client import write_job_url
from supervisor import Policy, Supervisor
import autoscale

ROOT = Path(__file__).resolve().parent
POLL_S = 5.0                    # seconds between looks at the proxy job while it starts
HUB_MIN = "1.24"                # the first huggingface_hub with everything below (see check_hub)
NS_VAR = "$HF_NAMESPACE"        # the dry run's stand-in for a namespace it could not resolve


@dataclass
class Args:
    run: str = field(default_factory=lambda: time.strftime("grpo-%Y%m%d-%H%M%S"))
    """run name: the bucket prefix s3://BUCKET/RUN/ and the job label; reuse it to resume a run"""
    preset: str | None = None
    """the run's configuration (lib/jobs/presets.py: --list-presets shows them): every role's options, the model,
    task, workers, steps and flavors; each option below that is left unset comes from it (default: jobs; with
    --local-plan, local)"""
    workers: int | None = None
    """rollout jobs (default: the preset's)"""
    model: str | None = None
    task: str | None = None
    """gsm8k, math, addition or jsonl:PATH (the file is uploaded to s3://BUCKET/RUN/prompts/, where the
    workers read it) or jsonl:s3://BUCKET/KEY (already in a bucket)"""
    steps: int | None = None
    """trainer optimizer steps"""
    group_size: int | None = None
    max_new_tokens: int | None = None
    proxy_flavor: str | None = None
    rollout_flavor: str | None = None
    trainer_flavor: str | None = None
    supervisor_flavor: str | None = None
    standby: bool = False
    """also a standby proxy job (proxy.py --standby on the proxy's flavor), which leads within seconds once the
    proxy stops renewing its term; on whenever the preset's `standby` is (docs/jobs.md#a-standby-proxy-job)"""
    timeout: str = "6h"
    """per job: whole seconds or a number with s, m, h or d (HF Jobs' default is 30 minutes)"""
    rollout_with: str = ""
    """extra packages for the rollout jobs, comma-separated (`uv run --with`); rollout.py's header has vllm"""
    bucket: str = field(default_factory=lambda: os.environ.get("BUCKET", "async-grpo"))
    """bucket name (env BUCKET); a Hugging Face Storage Bucket <namespace>/<bucket> unless S3_ENDPOINT_URL is set"""
    namespace: str | None = field(default_factory=lambda: os.environ.get("HF_NAMESPACE") or None)
    """user or org that runs the jobs and owns the bucket (env HF_NAMESPACE; default: yours)"""
    proxy_wait_s: float = 900.0
    """how long to wait for the proxy job to answer /health"""
    train_arg: tyro.conf.UseAppendAction[list[str]] = field(default_factory=list)
    """one extra arg for train.py, repeatable: --train-arg=--lr --train-arg=1e-5"""
    rollout_arg: tyro.conf.UseAppendAction[list[str]] = field(default_factory=list)
    """one extra arg for rollout.py, repeatable"""
    proxy_arg: tyro.conf.UseAppendAction[list[str]] = field(default_factory=list)
    """one extra arg for proxy.py, repeatable: --proxy-arg=--max-staleness --proxy-arg=2"""
    supervise: bool = True
    """also start the supervisor as a small CPU job (it relaunches any job that ends before the run is done)"""
    autoscale: bool = False
    """the supervisor scales the rollout jobs from the proxy's signals (docs/jobs.md#autoscaling), within the preset's
    bounds (`jobs-autoscale`), else lib/jobs/autoscale.Bounds' defaults; --workers is where it starts"""
    dry_run: bool = False
    """print the exact commands; submit nothing (asks the Hub only who you are, for the namespace)"""
    print_command: str | None = None
    """ROLE: print only the exact `hf jobs uv run` command of one job of the run (proxy, trainer, supervisor,
    rollout = rollout-1, or rollout-N), every file it ships included; submit nothing"""
    ignore_memory_check: bool = False
    """launch even if the memory model (memory.py) says the trainer or a worker will not fit its GPU"""
    status: str | None = None
    """RUN: show every job of that run"""
    cancel: str | None = None
    """RUN: stop the run's supervisor and cancel every job of that run that has not ended"""
    watch: str | None = None
    """RUN: supervise that run here until it is done (relaunch any job that ends, the proxy first)"""
    detach: bool = False
    """with --watch: start the supervisor as a small CPU job instead of here"""
    policy: Policy = field(default_factory=Policy)
    """the supervisor's relaunch policy"""
    token_create: str | None = None
    """NAME: create a participant token on the run's proxy (--role, --max-rps); printed once"""
    token_revoke: str | None = None
    """NAME: revoke a participant's token (its next request gets 401)"""
    token_limit: str | None = None
    """NAME: set a participant's rate limit to --max-rps, and/or the workers its share counts to --token-workers"""
    token_list: bool = False
    """list the run's participants"""
    token_reinstate: str | None = None
    """NAME: lift a participant's quarantine (docs/trust.md): its token works again, its failed checks start over"""
    role: Literal["inference", "worker", "trainer", "admin"] = "worker"
    """with --token-create: inference (ask the policy only), worker (prompts, groups, adapters), trainer (also
    batches, registrations), admin"""
    max_rps: float | None = None
    """with --token-create / --token-limit: requests per second for that participant (0, or unset at creation: no limit)"""
    token_workers: int | None = None
    """with --token-create / --token-limit: the most live workers the participant's share of each batch counts (unset at
    creation: 1); give a participant that runs N workers N (docs/trust.md#a-participants-share-of-each-batch)"""
    proxy_url: str | None = field(default_factory=lambda: os.environ.get("PROXY_URL"))
    """the proxy for the token commands (env PROXY_URL; default: the exposed URL of --run's proxy job)"""
    list_presets: bool = False
    """print every preset and the options it gives each role"""
    local_plan: bool = False
    """(for `bash launch_jobs.sh --local`) print the preset's layout and each role's options as bash assignments"""


LAYOUT = ("model", "task", "workers", "steps", "group_size", "proxy_flavor", "rollout_flavor", "trainer_flavor",
          "supervisor_flavor")


def with_preset(args: Args) -> Args:
    """args with every layout option left unset taken from its preset, and --max-new-tokens from the task's kind
    (tasks.token_budget: a preset of another task must not cut this one's answers). Idempotent."""
    p = presets.get(args.preset or ("local" if args.local_plan else "jobs"))
    got = {"preset": p.name, "standby": args.standby or p.standby,
           **{k: getattr(p, k) for k in LAYOUT if getattr(args, k) is None}}
    if args.max_new_tokens is None:
        got["max_new_tokens"] = token_budget(got.get("task", args.task))
    return replace(args, **got)


def role_options(args: Args, role: str) -> list[str]:
    """The preset's options for `role` (proxy, train, rollout) on the command line, the launcher's own layout
    options applied; the person's --X-arg come after them and win (tyro takes the last)."""
    opts = dict(presets.get(args.preset).options(role))
    if role == "rollout" and args.max_new_tokens is not None:
        opts["max_new_tokens"] = args.max_new_tokens
    return presets.flags(opts)


def vocab_options(model: str | None) -> list[str]:
    """The proxy's --vocab-size for the run's model (its config.json, found as the memory check finds it): none for
    the scripts' default model (the proxy's default is its vocabulary); where no config is found, the schema's own
    bound, 2^24 (the door then lets any id through, and the trainer leaves out a group that does not fit its model)."""
    if model is None:
        return []
    cfg, _ = memory.config_for(model)
    return ["--vocab-size", str(cfg["vocab_size"] if cfg and isinstance(cfg.get("vocab_size"), int) else 1 << 24)]


def sampling_options(args: Args) -> list[str]:
    """The proxy's --temperatures: the temperature the run's workers sample at, as the launcher starts them (the
    preset's rollout temperature, or the person's --rollout-arg --temperature, which wins as it does for the workers).
    One place: a participant's group that claims another is refused at the door (docs/trust.md)."""
    t, extra = presets.get(args.preset).options("rollout").get("temperature", 1.0), list(args.rollout_arg)
    for i, a in enumerate(extra):
        if a == "--temperature" and i + 1 < len(extra):
            t = extra[i + 1]
        elif a.startswith("--temperature="):
            t = a.split("=", 1)[1]
    return ["--temperatures", str(t)]


def local_plan(args: Args) -> str:
    """The local run as bash assignments (launch_jobs.sh evals them): the preset's name, layout and each role's
    options, the launcher's own options (--steps, --workers, --task) applied."""
    q = shlex.quote
    model = ["--model", args.model] if args.model else []  # None: the scripts' default, the local SmolLM2
    roles = {"PROXY_ARGS": ["--group-size", str(args.group_size), *vocab_options(args.model), *sampling_options(args),
                            *role_options(args, "proxy"),
                            *args.proxy_arg],
             "TRAIN_ARGS": [*model, "--task", args.task, "--max-steps", str(args.steps), *role_options(args, "train"),
                            *args.train_arg],
             "ROLLOUT_ARGS": [*model, "--task", args.task, "--group-size", str(args.group_size),
                              *role_options(args, "rollout"), *args.rollout_arg]}
    return "\n".join([f"RUN_PRESET={q(presets.get(args.preset).label)}", f"WORKERS={args.workers}",
                      *(f"{k}=({' '.join(q(a) for a in v)})" for k, v in roles.items())])



# ---------------------------------------------------------------------------------------------
# the plan: what every job of a run gets (pure: used by --dry-run, the submission and the tests)


ROLE_SCRIPTS = ("proxy.py", "rollout.py", "train.py", "launch_hf.py")  # launch_hf.py: the supervisor job


def bucket_env(args: Args, namespace: str) -> dict[str, str]:
    """Where the jobs find the run: an HF Storage Bucket through its S3 gateway, or any S3."""
    endpoint = os.environ.get("S3_ENDPOINT_URL") or f"{HF_S3_GATEWAY}/{namespace}"
    return {"BUCKET": args.bucket, "RUN_NAME": args.run, "S3_ENDPOINT_URL": endpoint,
            "AWS_REGION": os.environ.get("AWS_REGION", "us-east-1"), "PYTHONUNBUFFERED": "1"}


def prompts_key(args: Args) -> str | None:
    """Where a local jsonl: task's file goes in the bucket (relative to RUN/), or None."""
    args = with_preset(args)
    path = args.task[len("jsonl:"):] if args.task.startswith("jsonl:") else None
    return f"prompts/{os.path.basename(path)}" if path and not path.startswith("s3://") else None


def sources(args: Args) -> dict[str, Path]:
    """Every file a job of the run ships, by the name it has in the job's /data -> where it is here."""
    ours = modules()
    names = {n for script in ROLE_SCRIPTS for n in (script, *shipped(script))}
    return {n: ours[n[:-3]] for n in sorted(names)}


def trainer_ranks(args: Args, hub: bool = True) -> list[str]:
    """One trainer rank per GPU of the trainer's flavor: train.py starts itself under torchrun with that many
    (lib/train/ranks.py), and --shard base where a replica of the base does not fit one of its GPUs
    (memory.shard_options); none on a flavor of one GPU."""
    n = memory.flavor_gpus(args.trainer_flavor)
    if n == 1:
        return []
    return ["--nproc-per-node", str(n), *memory.shard_options(
        args.model, args.max_new_tokens, args.group_size, args.trainer_flavor, [*role_options(args, "train"), *args.train_arg],
        [*role_options(args, "rollout"), *args.rollout_arg], hub, args.task)]


def plan(args: Args, namespace: str) -> list[JobSpec]:
    """The run's layout. No job is told the proxy's URL: a relaunched proxy has a new one, so workers
    and trainer read it from the run's proxy/endpoint.json (written once the proxy answers)."""
    args = with_preset(args)
    task = args.task
    if key := prompts_key(args):  # the workers read the prompts from the bucket: one that joins later needs no file
        task = f"jsonl:s3://{args.bucket}/{args.run}/{key}"
    env = {**bucket_env(args, namespace), "RUN_PRESET": presets.get(args.preset).label}
    bucket_secrets = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
    # behind the --expose gateway: Authorization carries the HF token, X-Proxy-Token the proxy secret
    caller_secrets = ["HF_TOKEN", "PROXY_HF_TOKEN", "PROXY_TOKEN", *bucket_secrets]
    G = ["--group-size", str(args.group_size)]
    # with a standby: both renew or watch the leader record (--term-s); the supervisor relaunches either as a standby
    lead = ["--term-s", f"{STANDBY_TERM_S:g}"] if args.standby else []
    proxy = ["--host", "0.0.0.0", "--port", str(PROXY_PORT), *G, *vocab_options(args.model), *sampling_options(args),
             *role_options(args, "proxy"), *lead, *args.proxy_arg]
    jobs = [JobSpec(role, "proxy.py", list(shipped("proxy.py")), proxy + extra, args.proxy_flavor,
                    ["PROXY_TOKEN", *bucket_secrets], env, args.timeout, expose=[PROXY_PORT])
            for role, extra in [("proxy", []), *([(STANDBY, ["--standby"])] if args.standby else [])]]
    for i in range(1, args.workers + 1):
        jobs.append(JobSpec(f"rollout-{i}", "rollout.py", list(shipped("rollout.py")),
                            ["--model", args.model, "--task", task, *G, *role_options(args, "rollout"),
                             "--worker-id", f"{args.run}-w{i}", "--seed", str(i), *args.rollout_arg],
                            args.rollout_flavor, caller_secrets, env, args.timeout,
                            dependencies=[d for d in args.rollout_with.split(",") if d.strip()]))
    # --task: the trainer re-scores and checks participants' groups against the task (docs/trust.md)
    jobs.append(JobSpec("trainer", "train.py", list(shipped("train.py")), ["--model", args.model, "--task", task,
                                                              "--max-steps", str(args.steps), *trainer_ranks(args),
                                                              *role_options(args, "train"), *args.train_arg],
                        args.trainer_flavor, caller_secrets,
                        # a relaunch of the run (same name) takes the trainer's claim over at once and resumes
                        {**env, "TRAINER_ID": f"{args.run}-trainer"}, args.timeout))
    # the supervisor: lists, relaunches and cancels the run's jobs (HF token), reads the bucket (keys)
    policy = [a for f in fields(Policy) if getattr(args.policy, f.name) != getattr(Policy(), f.name)
              for a in (f"--policy.{f.name.replace('_', '-')}", str(getattr(args.policy, f.name)))]
    jobs.append(JobSpec("supervisor", "launch_hf.py", list(shipped("launch_hf.py")),
                        ["--watch", args.run, "--namespace", namespace, "--bucket", args.bucket, *policy],
                        args.supervisor_flavor, ["HF_TOKEN", "PROXY_TOKEN", *bucket_secrets], env, args.timeout))
    return jobs


def sh(word: str) -> str:
    """Shell-quote one word; a word holding $HF_NAMESPACE is double-quoted so the shell expands it."""
    if NS_VAR not in word:
        return shlex.quote(word)
    esc = [re.sub(r'([\\"$`])', r"\\\1", part) for part in word.split(NS_VAR)]
    return '"' + NS_VAR.join(esc) + '"'


def hf_command(job: JobSpec, args: Args, namespace: str | None, local: dict[str, Path]) -> str:
    """The `hf jobs uv run` command equivalent to submitting `job` (secrets by name only). `local`:
    shipped name -> the file here, for the one file whose name differs (a jsonl task's).

    `--` before the script: the hf CLI (Click) reads its own options anywhere on the line, after the
    script too, so a script argument named like a Jobs option (the supervisor's `--namespace`, or a
    `--timeout`, `-e`, `--with` passed through --rollout-arg) would be taken by the CLI and never reach
    the script; after `--` everything is the script and its arguments."""
    cmd = ["hf", "jobs", "uv", "run", "--detach", "--flavor", job.flavor, "--timeout", job.timeout,
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
    # a file of the repository by its path in it (the CLI uploads each by its basename: all land in /data)
    files = [str(local[f].relative_to(ROOT)) if f in local and local[f].is_relative_to(ROOT) and local[f].name == f
             else str(local[f]) if f in local else f for f in job.files]
    return " ".join(sh(w) for w in cmd + ["--", job.script, *files, *job.args])


def autoscale_bounds(args: Args) -> dict | None:
    """The plan's autoscaling bounds (the supervisor reads them from launch/plan.json), or None: a fixed fleet. A
    bad bound, or a supervisor that is not started, fails here, before any job starts."""
    preset = presets.get(with_preset(args).preset)
    if not args.autoscale and preset.autoscale is None:
        return None
    if not args.supervise:
        raise SystemExit("--autoscale needs the supervisor (it decides and launches): drop --no-supervise")
    try:
        return asdict(autoscale.Bounds(**(preset.autoscale or {})))
    except (TypeError, ValueError) as e:
        raise SystemExit(f"preset {preset.label}'s autoscale: {e}") from None


def cost_line(args: Args) -> str:
    """What the run's jobs cost while they run, as printed: 'about $X/hour', or which flavors have no price."""
    args = with_preset(args)
    flavors = [*[args.proxy_flavor] * (2 if args.standby else 1), *[args.rollout_flavor] * args.workers,
               args.trainer_flavor]
    flavors += [args.supervisor_flavor] if args.supervise else []
    unknown = sorted({f for f in flavors if f not in PRICES})
    if unknown:
        return f"cost unknown: no price for {', '.join(unknown)} in lib/jobs/costs.py PRICES"
    return f"about ${sum(PRICES[f] for f in flavors) + EXPOSE_PRICE * (2 if args.standby else 1):.2f}/hour"


# ---------------------------------------------------------------------------------------------
# checks: fail early and clearly


def check_args(args: Args) -> None:
    args = with_preset(args)
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,60}", args.run):
        raise SystemExit(f"--run {args.run!r}: use 1-60 letters, digits, '-' or '_' (it is a job label and a bucket prefix)")
    if args.workers < 1 or args.steps < 1 or args.group_size < 2:
        raise SystemExit("--workers and --steps must be >= 1, --group-size >= 2")
    try:
        timeout_seconds(args.timeout)
    except ValueError as e:
        raise SystemExit(f"--timeout: {e} (e.g. 6h)") from None
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,62}", args.bucket):
        raise SystemExit(f"bucket {args.bucket!r}: lowercase letters, digits, '-' and '.' (env BUCKET or --bucket)")
    autoscale_bounds(args)  # a bad bound fails here, not in the supervisor job
    if prompts_key(args):  # a bad file fails here, not in every worker after its GPU job started
        from tasks import parse_jsonl, read_jsonl_source
        path = args.task[len("jsonl:"):]
        parse_jsonl(read_jsonl_source(path), path)


def missing_env() -> list[str]:
    need = {"PROXY_TOKEN": "the proxy's shared secret, e.g. export PROXY_TOKEN=$(openssl rand -hex 24)",
            "AWS_ACCESS_KEY_ID": "bucket access key (Storage Buckets S3 gateway: HFAK...; or your S3's)",
            "AWS_SECRET_ACCESS_KEY": "bucket secret key"}
    return [f"  {k}: {why}" for k, why in need.items() if not os.environ.get(k)]


def check_hub() -> None:
    """Everything the launcher and the supervisor use exists from huggingface_hub 1.24 on: run_uv_job's
    `expose` (1.19) and `name` (1.24), list_jobs' `labels` (1.21), JobStatus.expose_urls (1.19)."""
    import inspect

    import huggingface_hub
    from huggingface_hub import HfApi
    have = {"run_uv_job(expose=)": "expose" in inspect.signature(HfApi.run_uv_job).parameters,
            "run_uv_job(name=)": "name" in inspect.signature(HfApi.run_uv_job).parameters,
            "list_jobs(labels=)": "labels" in inspect.signature(HfApi.list_jobs).parameters,
            "JobStatus.expose_urls": "expose_urls" in getattr(huggingface_hub, "JobStatus", object).__dict__.get(
                "__dataclass_fields__", {})}
    if lacking := [k for k, ok in have.items() if not ok]:
        raise SystemExit(f"huggingface_hub {huggingface_hub.__version__} has no {', '.join(lacking)}: "
                         f"pip install -U 'huggingface_hub>={HUB_MIN}'")


# ---------------------------------------------------------------------------------------------
# memory: will the trainer and the workers fit their GPUs? (memory.py, from the model's config.json)


def check_fit(args: Args, hub: bool = True) -> list[str]:
    """Refuse (SystemExit) a layout whose trainer or rollout workers cannot fit their GPU; return
    the notes to print (a worker that fits but cannot run a whole round at once, a model that
    cannot be judged). Runs before anything is created."""
    args = with_preset(args)
    notes, problems = memory.layout_check(args.model, args.max_new_tokens, args.group_size, args.trainer_flavor,
                                          [*role_options(args, "train"), *args.train_arg], args.rollout_flavor,
                                          [*role_options(args, "rollout"), *args.rollout_arg], hub, args.task)
    if problems and not args.ignore_memory_check:
        raise SystemExit("this layout does not fit its GPUs (memory.py; --ignore-memory-check to launch anyway):\n"
                         + "\n".join(f"- {p}" for p in problems))
    return notes + [f"memory check: IGNORED: {p}" for p in problems]


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


def upload_prompts(args: Args, endpoint: str) -> None:
    """A local jsonl: task's file -> s3://BUCKET/RUN/prompts/NAME (once: a relaunch with the same file
    is fine, one with other contents under that name is refused, so a run's prompts never change)."""
    if not (key := prompts_key(args)):
        return
    from common import Bucket, ConflictError
    path = args.task[len("jsonl:"):]
    data = open(path, "rb").read()
    bucket = Bucket(bucket=args.bucket, run=args.run, endpoint=endpoint)
    try:
        bucket.put(key, data, if_none_match=True)
    except ConflictError:
        if bucket.get(key)[0] != data:
            raise SystemExit(f"s3://{args.bucket}/{args.run}/{key} already holds other prompts: a run keeps its "
                             f"prompts; rename {path} or use another --run") from None
    print(f"prompts: {path} -> s3://{args.bucket}/{args.run}/{key}")


def launch(args: Args) -> None:
    from huggingface_hub import HfApi
    token = local_token()
    if missing := missing_env():  # before any network call
        raise SystemExit("set these environment variables first:\n" + "\n".join(missing))
    api = HfApi()
    namespace = args.namespace or whoami(api, token)
    with hub_errors(f"looking for jobs of run {args.run}"):
        live = [j for j in run_jobs(api, args.run, namespace) if stage(j) not in TERMINAL]
    if live:  # two proxies on one run would fight over its journal; two trainers over its claim
        raise SystemExit(f"run {args.run} still has {len(live)} job(s) going ({', '.join(role(j) for j in live)}): "
                         f"`bash launch_jobs.sh --status {args.run}`; stop them first with --cancel, or let "
                         f"`bash launch_jobs.sh --watch {args.run}` keep them alive")
    endpoint = bucket_env(args, namespace)["S3_ENDPOINT_URL"]
    with hub_errors("creating the bucket"):
        print(f"run {args.run}: bucket {ensure_bucket(api, args, namespace, endpoint)} (prefix {args.run}/)")
    bucket = run_bucket(args.bucket, args.run, endpoint)
    upload_prompts(args, endpoint)
    specs = plan(args, namespace)
    if bounds := autoscale_bounds(args):  # a cap that cannot pay for the run: refused before any job starts
        autoscale.check_budget(autoscale.Bounds(**bounds), specs)
    preset = presets.get(args.preset)
    save_launch(bucket, {"run": args.run, "namespace": namespace, "bucket": args.bucket, "preset": asdict(preset),
                         "autoscale": autoscale_bounds(args)}, specs, sources(args))
    workdir = Path(tempfile.mkdtemp(prefix=f"launch-{args.run}-"))
    try:
        load_launch(bucket, workdir)  # submit from the bucket's copy: what a relaunch will run, byte for byte
        start_jobs(api, args, namespace, token, bucket, specs, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def start_jobs(api, args: Args, namespace: str, token: str, bucket, specs: list[JobSpec], workdir: Path) -> None:
    """The proxy, then (once it answers and its URL is recorded) the workers, the trainer, the supervisor."""
    print(f"  layout and code in s3://{args.bucket}/{args.run}/{PLAN.rsplit('/', 1)[0]}/ ({PLAN}, {FILES}/)")
    secrets = secret_values(token)
    by_role = {s.role: s for s in specs}
    started = []

    def start(spec: JobSpec):
        try:
            with hub_errors(f"submitting the {spec.role} job"):
                job = submit(api, spec, args.run, namespace, secrets, workdir)
        except SystemExit as e:  # quota, credits, a bad flavor: say so, and what is already running
            raise SystemExit(f"{e}\n{len(started)} job(s) of run {args.run} already started; stop them with "
                             f"`bash launch_jobs.sh --cancel {args.run}`") from None
        started.append((spec, job))
        print(f"{spec.role:10s} {job.id}  {spec.flavor:12s} {job.url}", flush=True)
        return job

    proxy = start(by_role["proxy"])
    print(f"  waiting for the proxy to answer (up to {args.proxy_wait_s:.0f} s)...", flush=True)
    try:
        proxy_url = wait_for_proxy(api, proxy.id, namespace, token, args.proxy_wait_s, POLL_S)
    except RuntimeError as e:
        raise SystemExit(f"{e}; stop it with `bash launch_jobs.sh --cancel {args.run}`") from None
    record_proxy(bucket, proxy_url, proxy.id, token, written_by=f"launcher {identity()}")
    write_job_url(bucket, proxy.id, proxy_url, written_by=f"launcher {identity()}")  # (read if it leads again)
    print(f"  proxy answers at {proxy_url} (recorded in s3://{args.bucket}/{args.run}/proxy/endpoint.json)")
    for spec in specs[1:]:
        if spec.role != "supervisor" or args.supervise:
            start(spec)
    print(f"\n{len(started)} jobs started ({cost_line(args)} while they run). Follow them:")
    for spec, job in started:
        print(f"  hf jobs logs -f {job.id}    # {spec.role}")
    watch = ("" if args.supervise else f"  bash launch_jobs.sh --watch {args.run}      # relaunch any job that "
             "ends before the run is done (no supervisor job was started)\n")
    print(f"  bash launch_jobs.sh --status {args.run}     # every job of the run\n{watch}"
          f"  bash launch_jobs.sh --cancel {args.run}     # stop the run (the bucket keeps everything)")


def status(args: Args) -> None:
    from huggingface_hub import HfApi
    token = local_token()  # even with --namespace: listing jobs needs a login
    api = HfApi()
    namespace = args.namespace or whoami(api, token)
    with hub_errors(f"listing the jobs of run {args.status}"):
        jobs = run_jobs(api, args.status, namespace)
    if not jobs:
        raise SystemExit(f"no jobs labelled {LABEL}={args.status} in {namespace}")
    current = {j.id for j in newest_by_role(jobs).values()}
    for j in sorted(jobs, key=lambda j: (role(j), j.created_at.timestamp() if j.created_at else 0.0)):
        urls = " ".join(j.status.expose_urls or [])
        print(f"{role(j):10s} {j.id}  {str(j.flavor):12s} {stage(j):10s} {j.url} {urls}".rstrip()
              + ("" if j.id in current else "  (replaced)"))
    if missing_env():
        return  # no bucket keys here: the bucket's view of the run is skipped
    bucket = run_bucket(args.bucket, args.status, bucket_env(Args(run=args.status, bucket=args.bucket),
                                                              namespace)["S3_ENDPOINT_URL"])
    from proxy_client import read_proxy_endpoint
    if record := read_proxy_endpoint(bucket):
        print(f"proxy endpoint: {record['url']} (job {record.get('job_id')}, incarnation {record.get('incarnation')}, "
              f"written by {record.get('written_by')} {time.time() - record.get('written_at', 0):.0f} s ago)")
    if lease := bucket.get_json("launch/supervisor.json"):
        state = "released" if lease.get("released") else f"heartbeat {time.time() - lease.get('heartbeat_at', 0):.0f} s ago"
        print(f"supervisor: {lease.get('owner')} ({state})")
    if latest := bucket.get_json("adapters/latest.json"):
        print(f"latest adapter: version {latest['version']} (step {latest.get('step')})")


def write_stop(run: str, namespace: str, bucket_name: str) -> str:
    """Tell every supervisor of the run to stop relaunching (launch/stop.json); a note if we cannot."""
    if missing_env():
        return ("note: the stop was not recorded in the bucket (AWS keys not set here): a supervisor running "
                "outside Hugging Face Jobs (`--watch` on some machine) would relaunch the jobs; stop it with Ctrl-C")
    from common import BucketError
    bucket = run_bucket(bucket_name, run, bucket_env(Args(run=run, bucket=bucket_name), namespace)["S3_ENDPOINT_URL"])
    try:
        bucket.put_json(STOP, {"at": time.time(), "by": identity()})
    except BucketError as e:
        return f"note: the stop was not recorded in the bucket ({e}); a supervisor outside Jobs may relaunch the jobs"
    return f"recorded the stop in s3://{bucket_name}/{run}/{STOP}: supervisors stop relaunching"


def cancel(args: Args) -> None:
    from huggingface_hub import HfApi
    token = local_token()
    api = HfApi()
    namespace = args.namespace or whoami(api, token)
    with hub_errors(f"listing the jobs of run {args.cancel}"):
        jobs = run_jobs(api, args.cancel, namespace)
    if not jobs:
        raise SystemExit(f"no jobs labelled {LABEL}={args.cancel} in {namespace}")
    print(write_stop(args.cancel, namespace, args.bucket))  # before any cancel: nothing may be relaunched
    live = [j for j in jobs if stage(j) not in TERMINAL]
    for j in sorted(live, key=lambda j: role(j) != "supervisor"):  # the supervisor first
        with hub_errors(f"cancelling {role(j)} job {j.id}"):
            api.cancel_job(job_id=j.id, namespace=namespace)
        print(f"cancelled {role(j):10s} {j.id}")
    print(f"{len(live)} of {len(jobs)} jobs of run {args.cancel} cancelled; the bucket keeps adapters, "
          f"checkpoints and metrics (resume: bash launch_jobs.sh --run {args.cancel})")


def watch(args: Args) -> None:
    """Supervise run args.watch here (supervisor.py), or start that as a small CPU job (--detach)."""
    from huggingface_hub import HfApi
    token = local_token()
    if missing := missing_env():
        raise SystemExit("set these environment variables first:\n" + "\n".join(missing))
    api = HfApi()
    namespace = args.namespace or whoami(api, token)
    run = args.watch
    bucket = run_bucket(args.bucket, run, bucket_env(Args(run=run, bucket=args.bucket), namespace)["S3_ENDPOINT_URL"])
    workdir = Path(tempfile.mkdtemp(prefix=f"watch-{run}-"))
    if args.detach:
        loaded = load_launch(bucket, workdir)
        if loaded is None:
            raise SystemExit(f"run {run} has no {PLAN} in s3://{args.bucket}/{run}/: start it with `bash launch_jobs.sh --run {run}`")
        spec = {s.role: s for s in loaded[1]}["supervisor"]
        with hub_errors("submitting the supervisor job"):
            job = submit(api, spec, run, namespace, secret_values(token), workdir)
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"supervisor {job.id}  {spec.flavor:12s} {job.url}\n  hf jobs logs -f {job.id}")
        return
    if threading.current_thread() is threading.main_thread():  # a cancelled supervisor job releases its lease
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        code = Supervisor(api, bucket, run, namespace, token, args.policy, workdir).run_forever()
    except KeyboardInterrupt:
        print(f"\nstopped watching run {run}; its jobs keep running (`bash launch_jobs.sh --status {run}`)")
        return
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if code:
        raise SystemExit(code)


def dry_run_namespace(args: Args) -> str | None:
    """--namespace / HF_NAMESPACE, else who the local token belongs to; None when neither is known."""
    if args.namespace:
        return args.namespace
    from huggingface_hub import HfApi, get_token
    if token := get_token():
        try:
            return whoami(HfApi(), token)
        except SystemExit:  # offline or a bad token: the commands will say "$HF_NAMESPACE"
            return None
    return None


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
    given = {k: v for k, v in (("max_rps", args.max_rps), ("workers", args.token_workers)) if v is not None}
    if args.token_create:
        method, path, body = "POST", "/v1/tokens", {"name": args.token_create, "role": args.role, **given}
    elif args.token_revoke:
        method, path, body = "DELETE", f"/v1/tokens/{args.token_revoke}", None
    elif args.token_limit:
        if not given:
            raise SystemExit(f"--token-limit {args.token_limit}: say what to change, --max-rps R and/or --token-workers N")
        method, path, body = "PATCH", f"/v1/tokens/{args.token_limit}", given
    elif args.token_reinstate:
        method, path, body = "POST", f"/v1/participants/{args.token_reinstate}/reinstate", None
    else:
        method, path, body = "GET", "/v1/tokens", None
    try:
        r = get_session().request(method, url + path, json=body, headers=headers, timeout=30)
    except Exception as e:  # noqa: BLE001 - unreachable proxy: say where
        raise SystemExit(f"the proxy at {url} did not answer: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise SystemExit(f"{method} {path} -> {r.status_code}: {r.text[:500]}")
    got = r.json()
    limit = lambda p: (f"{p['max_rps']:g} requests/s" if p["max_rps"] else "no rate limit") + f", {p['workers']} worker(s)"  # noqa: E731
    if args.token_create:
        print(f"participant {got['name']} ({got['role']}, {limit(got)}) on {url}\n"
              f"token (shown once; the proxy keeps only its sha256):\n  {got['token']}\n"
              f"give them:  PROXY_URL={url}  PROXY_TOKEN=<that token>  (docs/jobs.md: Join a run from your own machine)")
    elif args.token_revoke:
        print(f"participant {got['name']} revoked: its next request gets 401; its accepted groups stay in the run")
    elif args.token_limit:
        print(f"participant {got['name']}: {limit(got)} from its next request on")
    elif args.token_reinstate:
        print(f"participant {got['participant']} reinstated: its token works again, its failed checks start over "
              f"({got['checked']} of its groups checked so far)")
    else:
        for p in got["tokens"]:
            state = ("revoked" if p["revoked_at"] else f"quarantined: {p['quarantined']}" if p.get("quarantined")
                     else "active")
            print(f"{p['name']:20s} {p['role']:8s} {limit(p):36s} {state}")


def print_command(args: Args) -> None:
    """One job's command, alone on stdout (to copy, or to change a flag of: e.g. a worker with another
    --worker-id); with the namespace unknown, it says "$HF_NAMESPACE" and stderr says how to set it."""
    namespace = dry_run_namespace(args)
    jobs = {j.role: j for j in plan(args, namespace or NS_VAR)}
    want = "rollout-1" if args.print_command == "rollout" else args.print_command
    if want not in jobs:
        raise SystemExit(f"--print-command {args.print_command!r}: one of {', '.join(jobs)} (or rollout)")
    if namespace is None:
        print('# the command names "$HF_NAMESPACE": export HF_NAMESPACE=the user or org that runs the jobs', file=sys.stderr)
    print(f"# preset {presets.get(args.preset).label} (lib/jobs/presets.py), the launcher's options applied", file=sys.stderr)
    print(hf_command(jobs[want], args, namespace or NS_VAR, sources(args)))


def dry_run(args: Args) -> None:
    namespace = dry_run_namespace(args)
    ns = namespace or NS_VAR
    supervisor = f", supervisor on {args.supervisor_flavor}" if args.supervise else ""
    print(f"# run {args.run}: {args.workers} rollout job(s) on {args.rollout_flavor}, trainer on {args.trainer_flavor}, "
          f"proxy{' and its standby' if args.standby else ''} on {args.proxy_flavor}{supervisor}; {cost_line(args)}")
    print("# " + presets.describe(presets.get(args.preset)).replace("\n", "\n# ")
          + "\n# (the launcher's own options and --X-arg come after the preset's in the commands below, and win)")
    if missing := missing_env():
        print("# not set yet (required for a real launch):\n" + "\n".join("#" + m for m in missing))
    if namespace is None:  # a placeholder pasted into a shell would be a redirect; a variable is safe
        print('export HF_NAMESPACE="${HF_NAMESPACE:-$(hf auth whoami --quiet)}"  # the user or org that runs '
              "the jobs (default: yours)")
        print(': "${HF_NAMESPACE:?not logged in: run hf auth login, or export HF_NAMESPACE=an-org}"')
    if "S3_ENDPOINT_URL" not in os.environ:
        print(f"hf buckets create {sh(f'{ns}/{args.bucket}')} --private --exist-ok")
    if key := prompts_key(args):
        path = args.task[len("jsonl:"):]
        if "S3_ENDPOINT_URL" not in os.environ:
            print(f"hf buckets cp {sh(path)} {sh(f'hf://buckets/{ns}/{args.bucket}/{args.run}/{key}')}")
        else:
            print(f"# upload {path} to s3://{args.bucket}/{args.run}/{key} (the launch does it with your S3 keys)")
    print('export PROXY_HF_TOKEN="${HF_TOKEN:-$(hf auth token)}"  # the callers\' token for the --expose gateway')
    jobs, local = plan(args, ns), sources(args)
    if bounds := autoscale_bounds(args):
        autoscale.check_budget(autoscale.Bounds(**bounds), jobs)
        print(f"# autoscaled (docs/jobs.md#autoscaling): the supervisor keeps {bounds['min_workers']} to "
              f"{bounds['max_workers']} rollout job(s), at most ${bounds['budget_per_hour']}/hour for the run "
              f"(None: no cap), aiming at the trainer busy {bounds['target_util']} of its time")
    print(f"# the launcher also stores the layout and these files in s3://{args.bucket}/{args.run}/launch/ "
          "(what the supervisor relaunches from)")
    print(hf_command(jobs[0], args, ns, local))
    print(f"# once that job is RUNNING and its URL (`hf jobs inspect PROXY_JOB_ID`: status.expose_urls) answers "
          f"/health, the launcher writes the URL to s3://{args.bucket}/{args.run}/proxy/endpoint.json, where "
          "workers and trainer find the proxy (by hand: the supervisor below records it), then:")
    for job in jobs[1:]:
        if job.role != "supervisor" or args.supervise:
            print(hf_command(job, args, ns, local))


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_DISABLE_EXPERIMENTAL_WARNING", "1")  # run_uv_job is "experimental": we know
    check_hub()
    args = tyro.cli(Args, args=script_args(argv), prog="launch_jobs.sh")
    os.chdir(ROOT)  # the scripts are shipped by their relative names
    if args.status:
        return status(args)
    if args.cancel:
        return cancel(args)
    if args.watch:
        return watch(args)
    if args.token_create or args.token_revoke or args.token_limit or args.token_list or args.token_reinstate:
        return tokens(args)
    if args.list_presets:
        return print("\n\n".join(presets.describe(p) for p in presets.PRESETS.values()))
    args = with_preset(args)
    check_args(args)
    if args.local_plan:
        return print(local_plan(args))
    if args.print_command:
        return print_command(args)
    for note in check_fit(args):  # offline (HF_HUB_OFFLINE=1, no network): carried configs and local folders
        print(("# " if args.dry_run else "") + note, flush=True)
    if args.dry_run:
        return dry_run(args)
    launch(args)


if __name__ == "__main__":
    main()

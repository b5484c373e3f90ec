"""The `hf jobs uv run` commands the launcher prints (`--dry-run`), read back by huggingface_hub's own CLI
parser: each job's script gets exactly its files and arguments, and the job exactly its options. The hf
CLI (Click) takes its own options anywhere on the line, after the script too, so a script argument that
shares a name with a Jobs option (the supervisor's `--namespace`, a `--timeout`, `-e`, `--with`...) would
be read as the CLI's: an org run's supervisor job would lose its `--namespace` and watch its user's jobs."""
import shlex
from pathlib import Path

import pytest

import launch_hf


def parse(line: str) -> dict:
    """What `hf jobs uv run` makes of a printed line: the parameters of huggingface_hub's own command."""
    from huggingface_hub.cli.jobs import uv_app
    argv = shlex.split(line)
    assert argv[:4] == ["hf", "jobs", "uv", "run"], line
    return uv_app.commands["run"].make_context("run", argv[4:]).params


@pytest.fixture
def org_run():
    args = launch_hf.Args(run="org-run", workers=1, namespace="an-org", bucket="b", standby=True,
                          rollout_arg=["--timeout-ish", "x"], train_arg=["--seed", "3"])
    jobs = launch_hf.plan(args, "an-org")   # with the standby proxy job: its --standby and --term-s read back too
    assert [j.role for j in jobs][:2] == ["proxy", "proxy-standby"] and jobs[1].args[-1] == "--standby"
    return args, jobs


def test_every_printed_command_gives_the_script_its_own_arguments(org_run):
    args, jobs = org_run
    local = launch_hf.sources(args)
    for job in jobs:
        got = parse(launch_hf.hf_command(job, args, "an-org", local))
        assert got["script"] == job.script, job.role
        n = len(job.files)  # the shipped files by their paths here; the CLI uploads each by its basename
        assert [Path(p).name for p in got["script_args"][:n]] == job.files, job.role
        assert all((launch_hf.ROOT / p).is_file() for p in got["script_args"][:n]), job.role
        assert list(got["script_args"][n:]) == job.args, job.role
        assert got["namespace"] == "an-org" and got["flavor"] == job.flavor and got["timeout"] == job.timeout
        assert sorted(got["secrets"]) == sorted(job.secrets), job.role
        assert list(got["env"]) == [f"{k}={v}" for k, v in job.env.items()], job.role


def test_the_supervisor_job_watches_the_runs_namespace(org_run):
    args, jobs = org_run
    sup = next(j for j in jobs if j.role == "supervisor")
    got = parse(launch_hf.hf_command(sup, args, "an-org", launch_hf.sources(args)))
    script_args = list(got["script_args"])
    assert script_args[script_args.index("--watch") + 1] == "org-run"
    assert "--namespace" in script_args, f"the supervisor gets no --namespace: {script_args}"
    assert script_args[script_args.index("--namespace") + 1] == "an-org"


def test_a_script_argument_named_like_a_jobs_option_stays_the_scripts(org_run):
    """Whatever a user passes through --rollout-arg / --train-arg, the CLI hands it to the script."""
    args, _ = org_run
    args = launch_hf.Args(run="org-run", workers=1, namespace="an-org", bucket="b",
                          rollout_arg=["--timeout", "5m", "-e", "X=1", "--with", "numpy", "--namespace", "other"])
    rollout = next(j for j in launch_hf.plan(args, "an-org") if j.role == "rollout-1")
    got = parse(launch_hf.hf_command(rollout, args, "an-org", launch_hf.sources(args)))
    assert list(got["script_args"])[-8:] == ["--timeout", "5m", "-e", "X=1", "--with", "numpy", "--namespace", "other"]
    assert got["timeout"] == "6h" and got["namespace"] == "an-org" and "X=1" not in got["env"]

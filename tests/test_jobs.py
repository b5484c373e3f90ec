"""What `launch_jobs.sh` submits to Hugging Face Jobs, checked at the HTTP boundary.

huggingface_hub's own code runs unchanged (`HfApi.run_uv_job` -> local-file upload -> `run_job`,
`inspect_job`, `list_jobs`, `cancel_job`, `create_bucket`, `whoami`); only its network layer is
replaced: every HTTP call goes through `huggingface_hub.set_client_factory` to an httpx2
MockTransport that plays the Hub (and the proxy's --expose gateway), and the bucket upload of the
shipped files, which hf_xet performs in Rust outside httpx, is recorded at `HfApi.batch_bucket_files`.
The run's bucket is a real moto S3 server (the launcher stores the run's layout and files there and
submits from that copy). The bash entry point itself is run as a process for --dry-run and the
early failures, and every `hf jobs uv run` command the README and the scripts' docstrings show is
checked (files shipped, secrets and bucket environment) and fed to the real `hf jobs uv run --dry-run`.
"""
import ast
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import HfApi, set_client_factory
from huggingface_hub.utils._http import default_client_factory

import common

import proxy_client
from conftest import ROOT

import launch_hf
import hf_jobs
import presets
from test_headers import local_modules

def here(name: str) -> Path:
    """Where a file a job ships by `name` is in this checkout (lib/<folder>/ for a module)."""
    return hf_jobs.modules().get(name.removesuffix(".py"), ROOT / name)


SECRETS = {"HF_TOKEN": "hf_FAKEtoken0123456789", "PROXY_TOKEN": "proxy-secret-0123456789",
           "AWS_ACCESS_KEY_ID": "HFAKfakeaccesskey01", "AWS_SECRET_ACCESS_KEY": "fake-secret-key-0123456789"}
OWNER = {"id": "u1", "name": "alice", "type": "user"}


class FakeHub:
    """Answers the Hub's job and bucket API the way huggingface.co does, and records every request."""

    def __init__(self, proxy_fails: bool = False, listed: list[dict] | None = None, refuse_role: str = "",
                 health_ok: bool = True):
        self.requests: list[httpx2.Request] = []
        self.jobs: dict[str, dict] = {}      # id -> submitted spec (the JSON body huggingface_hub sent)
        self.uploads: list[tuple[str, list]] = []
        self.polls: dict[str, int] = {}
        self.health_calls = 0
        self.proxy_fails = proxy_fails
        self.listed = listed or []
        self.refuse_role = refuse_role
        self.health_ok = health_ok

    def job_json(self, jid: str, stage: str, **status) -> dict:
        spec = self.jobs[jid]
        return {"id": jid, "createdAt": "2026-11-29T10:00:00.000Z", "dockerImage": spec["dockerImage"],
                "command": spec["command"], "arguments": [], "environment": spec["environment"],
                "secrets": sorted(spec.get("secrets", {})), "flavor": spec["flavor"], "labels": spec["labels"],
                "status": {"stage": stage, **status}, "owner": OWNER}

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        path, method = request.url.path, request.method
        if request.url.host.endswith(".hf.jobs"):            # the proxy behind the --expose gateway
            assert request.headers["authorization"] == f"Bearer {SECRETS['HF_TOKEN']}"
            if path == "/v1/stats":
                # the launcher's question for the record's incarnation, with the proxy token the proxy wants;
                # the value from a real proxy's state is checked in test_supervisor.py (the emulated run)
                assert request.headers["x-proxy-token"] == SECRETS["PROXY_TOKEN"]
                return httpx2.Response(200, json={"incarnation": 3, "buffer_size": 0})
            if path != "/health":
                return httpx2.Response(404, json={"detail": "Not Found"})
            self.health_calls += 1
            return httpx2.Response(200 if self.health_ok and self.health_calls > 1 else 502, json={"ok": True})
        if path == "/api/whoami-v2":
            return httpx2.Response(200, json={"name": "alice", "type": "user", "orgs": []})
        if m := re.fullmatch(r"/api/buckets/(\w+)/([\w.-]+)", path):
            assert method == "POST"
            return httpx2.Response(200, json={"url": f"https://huggingface.co/buckets/{m[1]}/{m[2]}"})
        if path == "/api/jobs/alice" and method == "POST":
            if json.loads(request.content)["labels"]["role"] == self.refuse_role:
                return httpx2.Response(402, json={"error": "Payment required: not enough credits"})
            jid = f"{len(self.jobs) + 1:024x}"
            self.jobs[jid] = json.loads(request.content)
            return httpx2.Response(200, json=self.job_json(jid, "SCHEDULING"))
        if path == "/api/jobs/alice" and method == "GET":
            labels = request.url.params.get_list("label")
            return httpx2.Response(200, json=[j for j in self.listed if f"async-grpo-run={j['labels']['async-grpo-run']}" in labels])
        if m := re.fullmatch(r"/api/jobs/alice/(\w+)/cancel", path):
            return httpx2.Response(200, json={})
        if m := re.fullmatch(r"/api/jobs/alice/(\w+)", path):
            jid = m[1]
            n = self.polls[jid] = self.polls.get(jid, 0) + 1
            if self.proxy_fails and n >= 2:
                return httpx2.Response(200, json=self.job_json(jid, "ERROR", message="exit code 1"))
            if n == 1:
                return httpx2.Response(200, json=self.job_json(jid, "SCHEDULING"))
            return httpx2.Response(200, json=self.job_json(jid, "RUNNING", exposeUrls=[f"https://{jid}--8000.hf.jobs"]))
        return httpx2.Response(404, json={"error": f"fake hub: no route for {method} {path}"})


@pytest.fixture
def hub(monkeypatch, s3_env):
    """Route huggingface_hub's HTTP to a FakeHub; record the xet bucket upload of the shipped files
    (their bytes). The run's bucket is the moto server of s3_env."""
    def make(**kw) -> FakeHub:
        fake = FakeHub(**kw)
        set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(fake.handle)))

        def record_upload(self, bucket_id, *, add=None, copy=None, delete=None, token=None):
            fake.uploads.append((bucket_id, [(Path(src).read_bytes(), dst) for src, dst in add or []]))
        monkeypatch.setattr(HfApi, "batch_bucket_files", record_upload)
        return fake

    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    for k in ("BUCKET", "AWS_REGION", "HF_ENDPOINT", "HF_NAMESPACE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(launch_hf, "POLL_S", 0.0)
    monkeypatch.chdir(ROOT)
    yield make
    set_client_factory(default_client_factory)


def uploaded(fake: FakeHub) -> dict[str, tuple[str, dict[str, bytes]]]:
    """The job's folder in jobs-artifacts -> (bucket, {name: bytes uploaded})."""
    out = {}
    for bucket, files in fake.uploads:
        out[files[0][1].split("/")[0]] = (bucket, {d.split("/", 1)[1]: data for data, d in files})
    return out


def test_launch_submits_proxy_then_workers_trainer_and_supervisor(hub, s3_env, capsys):
    fake = hub()
    launch_hf.main(["--run", "gsm-1", "--workers", "2", "--steps", "50", "--timeout", "3h",
                    "--train-arg=--lr", "--train-arg=1e-5"])
    out = capsys.readouterr()
    jobs = list(fake.jobs.items())
    assert [j["labels"]["role"] for _, j in jobs] == ["proxy", "rollout-1", "rollout-2", "trainer", "supervisor"]
    proxy_id, proxy = jobs[0]
    proxy_url = f"https://{proxy_id}--8000.hf.jobs"
    # the workers and the trainer were submitted only after the proxy answered /health through the gateway
    assert fake.health_calls == 2
    first_worker = next(i for i, r in enumerate(fake.requests) if r.method == "POST" and r.url.path == "/api/jobs/alice"
                        and json.loads(r.content)["labels"]["role"] == "rollout-1")
    assert any(r.url.host.endswith(".hf.jobs") for r in fake.requests[:first_worker])
    # ... and its URL is in the run's record, where they look for it (nobody is told PROXY_URL)
    bucket = common.Bucket(bucket="async-grpo", run="gsm-1")
    record = proxy_client.read_proxy_endpoint(bucket)
    # (its incarnation: what the proxy's /v1/stats said, here the fake's 3; a real proxy's in test_supervisor.py)
    assert record["url"] == proxy_url and record["job_id"] == proxy_id and record["incarnation"] == 3
    assert [r.url.path for r in fake.requests if r.url.host.endswith(".hf.jobs")][-1] == "/v1/stats"

    base_env = {"BUCKET": "async-grpo", "RUN_NAME": "gsm-1", "S3_ENDPOINT_URL": s3_env["S3_ENDPOINT_URL"],
                "AWS_REGION": "us-east-1", "PYTHONUNBUFFERED": "1", "RUN_PRESET": "jobs@1"}
    jobs_preset = presets.PRESETS["jobs"]  # every role gets its preset's options, then the person's --X-arg
    preset = {role: presets.flags(jobs_preset.options(role)) for role in ("proxy", "train", "rollout")}
    bucket_secrets = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    shipped = lambda script: [f"/data/{m}" for m in hf_jobs.shipped(script)]  # noqa: E731
    expected = {
        "proxy": (["/data/proxy.py", *shipped("proxy.py"), "--host", "0.0.0.0", "--port", "8000", "--group-size", "8",
                   "--vocab-size", "151936",  # Qwen2.5's, from its carried config.json
                   "--temperatures", "1.0", *preset["proxy"]],  # the workers' temperature (the preset's rollout one)
                  "cpu-upgrade", {"PROXY_TOKEN"} | bucket_secrets, base_env),
        "rollout-1": (["/data/rollout.py", *shipped("rollout.py"), "--model", "Qwen/Qwen2.5-0.5B-Instruct",
                       "--task", "gsm8k", "--group-size", "8", *preset["rollout"],
                       "--max-new-tokens", "512",  # gsm8k's budget (tasks.token_budget), not the preset's
                       "--worker-id", "gsm-1-w1",
                       "--seed", "1"], "l4x1", {"HF_TOKEN", "PROXY_HF_TOKEN", "PROXY_TOKEN"} | bucket_secrets, base_env),
        "trainer": (["/data/train.py", *shipped("train.py"), "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--task", "gsm8k", "--max-steps", "50",
                     *preset["train"], "--lr", "1e-5"], "a10g-small", {"HF_TOKEN", "PROXY_HF_TOKEN", "PROXY_TOKEN"} | bucket_secrets,
                    {**base_env, "TRAINER_ID": "gsm-1-trainer"}),
        "supervisor": (["/data/launch_hf.py", *shipped("launch_hf.py"), "--watch", "gsm-1", "--namespace", "alice", "--bucket", "async-grpo"], "cpu-basic",
                       {"HF_TOKEN", "PROXY_TOKEN"} | bucket_secrets, base_env),
    }
    uploads = uploaded(fake)
    for jid, spec in jobs:
        role = spec["labels"]["role"]
        cmd, flavor, secret_names, env = expected.get(role, expected["rollout-1"])
        if role == "rollout-2":
            cmd = [c.replace("gsm-1-w1", "gsm-1-w2") for c in cmd]
            cmd[cmd.index("--seed") + 1] = "2"
        assert spec["command"] == ["uv", "run", *cmd], role
        assert spec["dockerImage"] == "ghcr.io/astral-sh/uv:python3.12-bookworm"
        assert spec["flavor"] == flavor and spec["timeoutSeconds"] == 3 * 3600, role
        assert set(spec["secrets"]) == secret_names, role
        for name in secret_names:   # values reach the API as HF Jobs secrets, never as plain env
            want = SECRETS["HF_TOKEN"] if name == "PROXY_HF_TOKEN" else SECRETS[name]
            assert spec["secrets"][name] == want
        assert spec["environment"] == env, role
        assert not set(SECRETS.values()) & set(spec["environment"].values())
        assert spec["labels"] == {"async-grpo-run": "gsm-1", "role": role, "name": f"gsm-1-{role}"}
        assert ("expose" in spec) == (role == "proxy")
        if role == "proxy":
            assert spec["expose"]["ports"] == [8000]
        # the shared modules are uploaded beside the script into this job's folder, mounted at /data,
        # byte for byte the files of this checkout (they went through the run's bucket copy)
        (vol,) = spec["volumes"]
        assert vol["type"] == "bucket" and vol["source"] == "alice/jobs-artifacts" and vol["mountPath"] == "/data"
        bucket_id, files = uploads[vol["path"]]
        names = [c.removeprefix("/data/") for c in cmd if c.startswith("/data/")]
        assert bucket_id == "alice/jobs-artifacts" and files == {n: here(n).read_bytes() for n in names}, role

    # the run's layout is in the bucket: a supervisor can relaunch any role from it alone
    plan = bucket.get_json("launch/plan.json")
    assert [j["role"] for j in plan["jobs"]] == ["proxy", "rollout-1", "rollout-2", "trainer", "supervisor"]
    assert not [v for v in SECRETS.values() if v in json.dumps(plan)]   # secret names, never values
    assert {"proxy.py", "rollout.py", "train.py", "launch_hf.py", "common.py"} <= set(plan["files"])
    for name, digest in plan["files"].items():
        assert common.hashlib.sha256(bucket.get(f"launch/files/{name}")[0]).hexdigest() == digest
    # the console: ids, the proxy URL and how to follow the logs; no secret value anywhere
    for jid, _ in jobs:
        assert f"hf jobs logs -f {jid}" in out.out
    assert proxy_url in out.out and "bash launch_jobs.sh --cancel gsm-1" in out.out
    for v in SECRETS.values():
        assert v not in out.out + out.err

    # the same run again while its jobs still go: refused before anything is submitted
    fake.listed = [{**fake.job_json(jid, "RUNNING"), "labels": spec["labels"]} for jid, spec in jobs]
    with pytest.raises(SystemExit, match=r"run gsm-1 still has 5 job\(s\) going .*--cancel"):
        launch_hf.main(["--run", "gsm-1"])
    assert len(fake.jobs) == 5


def test_an_hf_storage_bucket_is_created_private(hub, monkeypatch):
    fake = hub()
    monkeypatch.delenv("S3_ENDPOINT_URL")
    args = launch_hf.Args(run="r1")
    endpoint = launch_hf.bucket_env(args, "alice")["S3_ENDPOINT_URL"]
    assert endpoint == "https://s3.hf.co/alice"
    assert launch_hf.ensure_bucket(HfApi(), args, "alice", endpoint) == "https://huggingface.co/buckets/alice/async-grpo"
    (create,) = [r for r in fake.requests if r.url.path == "/api/buckets/alice/async-grpo"]
    assert json.loads(create.content) == {"visibility": "private"}


@pytest.mark.parametrize("name", ["my_tasks.jsonl", "my tasks.jsonl"])
def test_jsonl_task_is_uploaded_to_the_bucket_and_read_from_there(hub, s3_env, monkeypatch, tmp_path, capsys, name):
    """The prompts go to s3://BUCKET/RUN/prompts/ before any job starts; the workers are told that
    path (no file travels with them, so a worker that joins later needs none)."""
    import common
    import tasks
    fake = hub()
    for k in ("S3_ENDPOINT_URL", "BUCKET"):    # this run's bucket: the local S3 server
        monkeypatch.setenv(k, s3_env[k])
    data = tmp_path / name  # a space in the name too: the worker is told the key the file has in the bucket
    data.write_text('{"prompt": "2+2?", "answer": 4}\n{"prompt": "3+3?", "answer": 6}\n')
    launch_hf.main(["--run", "mine", "--workers", "1", "--task", f"jsonl:{data}", "--rollout-with", "flash-attn,ninja"])
    roll = next(j for j in fake.jobs.values() if j["labels"]["role"] == "rollout-1")
    assert roll["command"][:7 + len(hf_jobs.shipped("rollout.py"))] == [
        "uv", "run", "--with", "flash-attn", "--with", "ninja", "/data/rollout.py",
        *(f"/data/{m}" for m in hf_jobs.shipped("rollout.py"))]
    url = f"s3://tests/mine/prompts/{name}"
    assert roll["command"][roll["command"].index("--task") + 1] == f"jsonl:{url}"
    assert all(name not in str(src) for _, files in fake.uploads for src, _ in files)
    assert common.Bucket(run="mine").get(f"prompts/{name}")[0] == data.read_bytes()
    assert tasks.load_task(f"jsonl:{url}").prompts == ["2+2?"]            # what a worker reads
    # a relaunch with the same file is fine; other contents under that name are refused, before any job
    launch_hf.main(["--run", "mine", "--workers", "1", "--task", f"jsonl:{data}"])
    data.write_text('{"prompt": "5+5?", "answer": 10}\n{"prompt": "3+3?", "answer": 6}\n')
    n = len(fake.jobs)
    with pytest.raises(SystemExit, match="already holds other prompts"):
        launch_hf.main(["--run", "mine", "--workers", "1", "--task", f"jsonl:{data}"])
    assert len(fake.jobs) == n
    # a task already in a bucket is passed through as it is
    launch_hf.main(["--run", "other", "--workers", "1", "--task", f"jsonl:{url}"])
    roll = [j for j in fake.jobs.values() if j["labels"]["role"] == "rollout-1"][-1]
    assert roll["command"][roll["command"].index("--task") + 1] == f"jsonl:{url}"


def test_a_bad_jsonl_fails_the_launch_before_any_job(hub, tmp_path):
    fake = hub()
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "2+2?", "answer": 4}\n{"prompt": "3+3?"}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: expected"):
        launch_hf.main(["--run", "bad", "--task", f"jsonl:{data}"])
    assert not fake.jobs and not fake.requests


def test_proxy_that_dies_stops_the_launch(hub, capsys):
    fake = hub(proxy_fails=True)
    with pytest.raises(SystemExit, match=r"proxy job \w+ ended \(ERROR: exit code 1\).*hf jobs logs"):
        launch_hf.main(["--run", "dies", "--workers", "2"])
    assert [j["labels"]["role"] for j in fake.jobs.values()] == ["proxy"]   # no worker was started


def test_a_proxy_that_never_answers_times_out_clearly(hub, capsys):
    fake = hub(health_ok=False)
    with pytest.raises(SystemExit, match=r"did not answer within 0 s \(/health answered 502\).*--cancel slow"):
        launch_hf.main(["--run", "slow", "--proxy-wait-s", "0.3"])
    assert fake.health_calls >= 1 and len(fake.jobs) == 1


def test_a_refused_submission_says_what_already_runs(hub, capsys):
    fake = hub(refuse_role="trainer")
    with pytest.raises(SystemExit, match=r"(?s)submitting the trainer job: the Hub answered 402: .*credits.*"
                                         r"3 job\(s\) of run pay already started.*bash launch_jobs.sh --cancel pay"):
        launch_hf.main(["--run", "pay", "--workers", "2"])
    assert [j["labels"]["role"] for j in fake.jobs.values()] == ["proxy", "rollout-1", "rollout-2"]


def listed_job(jid: str, run: str, role: str, stage: str) -> dict:
    return {"id": jid, "labels": {"async-grpo-run": run, "role": role}, "flavor": "l4x1",
            "status": {"stage": stage}, "owner": OWNER}


def test_status_and_cancel_act_on_every_job_of_the_run(hub, capsys):
    listed = [listed_job("a1", "r7", "proxy", "RUNNING"), listed_job("a2", "r7", "rollout-1", "RUNNING"),
              listed_job("a3", "r7", "rollout-2", "ERROR"), listed_job("a4", "r7", "trainer", "SCHEDULING"),
              listed_job("a5", "r7", "supervisor", "RUNNING"), listed_job("b1", "other", "proxy", "RUNNING")]
    fake = hub(listed=listed)
    bucket = common.Bucket(bucket="async-grpo", run="r7")
    bucket.ensure_bucket()
    proxy_client.write_proxy_endpoint(bucket, "https://a1--8000.hf.jobs", job_id="a1", incarnation=2, written_by="test")
    launch_hf.main(["--status", "r7"])
    out = capsys.readouterr().out
    assert all(j in out for j in ("a1", "a2", "a3", "a4", "a5")) and "b1" not in out and "ERROR" in out
    assert "proxy endpoint: https://a1--8000.hf.jobs (job a1, incarnation 2" in out
    lists = [r for r in fake.requests if r.method == "GET" and r.url.path == "/api/jobs/alice"]
    assert lists[-1].url.params.get_list("label") == ["async-grpo-run=r7"]

    launch_hf.main(["--cancel", "r7"])
    cancelled = [r.url.path.split("/")[-2] for r in fake.requests if r.url.path.endswith("/cancel")]
    assert cancelled == ["a5", "a1", "a2", "a4"]  # the supervisor first; the job that already ended is left alone
    assert "4 of 5 jobs of run r7 cancelled" in capsys.readouterr().out
    assert bucket.get_json("launch/stop.json")["at"] > 0   # a supervisor elsewhere stops relaunching
    with pytest.raises(SystemExit, match="no jobs labelled async-grpo-run=nope"):
        launch_hf.main(["--status", "nope"])


def test_an_old_huggingface_hub_is_refused_with_the_right_floor(monkeypatch):
    """1.23 has run_uv_job(expose=) but no name=: refused before anything is created, pointing at 1.24."""
    def run_uv_job(self, script, *, script_args=None, expose=None, labels=None, namespace=None):  # 1.23's shape
        raise AssertionError("must not be called")
    monkeypatch.setattr(HfApi, "run_uv_job", run_uv_job)
    with pytest.raises(SystemExit, match=r"has no run_uv_job\(name=\): pip install -U 'huggingface_hub>=1.24'"):
        launch_hf.main(["--run", "old"])
    assert launch_hf.HUB_MIN == "1.24"
    reqs = {ln.split(">=")[0]: ln.split(">=")[1] for ln in (ROOT / "requirements.txt").read_text().splitlines()
            if ln.startswith("huggingface_hub")}
    assert reqs == {"huggingface_hub": launch_hf.HUB_MIN}


@pytest.mark.parametrize("timeout,seconds", [("6h", 21600), ("1.5h", 5400), ("90", 90), ("45m", 2700), ("2d", 172800)])
def test_timeouts_are_read_as_huggingface_hub_reads_them(timeout, seconds):
    from huggingface_hub._jobs_api import _create_job_spec
    assert hf_jobs.timeout_seconds(timeout) == seconds
    spec = _create_job_spec(image="x", command=["x"], env=None, secrets=None, flavor=None, timeout=timeout)
    assert spec["timeoutSeconds"] == seconds


@pytest.mark.parametrize("timeout", ["1.5", "6 h", "1e3s", "0", "0s", "-1h", "h", ""])
def test_timeouts_huggingface_hub_would_refuse_are_refused_first(timeout):
    with pytest.raises(SystemExit, match="--timeout"):
        launch_hf.check_args(launch_hf.Args(timeout=timeout))


# --- the bash entry point as a process ---------------------------------------------------------


def run_launcher(*args, env_extra=None, path=None, cwd_script=None):
    env = {k: v for k, v in os.environ.items() if k not in SECRETS and k not in ("BUCKET", "S3_ENDPOINT_URL", "HF_NAMESPACE")}
    env.update({"PATH": path or f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "HF_HOME": env_extra.pop("HF_HOME")
                if env_extra and "HF_HOME" in env_extra else env.get("HF_HOME", ""),
                "HF_ENDPOINT": "http://127.0.0.1:9"})   # nothing listens there: any network call would fail
    env.update(env_extra or {})
    return subprocess.run(["bash", str(cwd_script or ROOT / "launch_jobs.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=180)


def hf_lines(stdout: str) -> list[str]:
    return [x for x in stdout.splitlines() if x.startswith("hf jobs uv run")]


def test_dry_run_prints_a_complete_run_and_no_secret(tmp_path):
    p = run_launcher("--dry-run", "--run", "dry1", "--workers", "3", "--namespace", "my-org",
                     env_extra={**SECRETS, "HF_HOME": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    cmds = [shlex.split(line) for line in hf_lines(p.stdout)]
    roles = [c[c.index("--label", c.index("--label") + 1) + 1] for c in cmds]
    assert roles == ["role=proxy", "role=rollout-1", "role=rollout-2", "role=rollout-3", "role=trainer",
                     "role=supervisor"]
    for c in cmds:
        script = next(a for a in c if a.endswith(".py"))
        # shipped beside it, by its path here (it lands in /data by its basename): every module it imports
        after = c[c.index(script) + 1:]
        assert all((ROOT / a).is_file() for a in after if a.endswith(".py")), script
        assert {f"{m}.py" for m in local_modules(script)} <= {Path(a).name for a in after}, script
        assert c[c.index("--timeout") + 1] == "6h" and "--detach" in c and "--namespace" in c
        assert "async-grpo-run=dry1" in c and "S3_ENDPOINT_URL=https://s3.hf.co/my-org" in c
        assert "PROXY_TOKEN" in c and "AWS_SECRET_ACCESS_KEY" in c       # secrets by name
        assert not [a for a in c if a.startswith("PROXY_URL=")]         # the proxy is found through the bucket
    assert cmds[0][cmds[0].index("--expose") + 1] == "8000" and "0.0.0.0" in cmds[0]
    assert all("--expose" not in c for c in cmds[1:])
    assert "hf buckets create my-org/async-grpo --private --exist-ok" in p.stdout
    assert "about $3.45/hour" in p.stdout     # 3 x l4x1 + a10g-small + cpu-upgrade + cpu-basic + the exposed port
    assert "<" not in p.stdout.replace("# ", "")   # no placeholder a shell would read as a redirect
    for v in SECRETS.values():
        assert v not in p.stdout + p.stderr


def test_a_flavor_without_a_price_is_named_not_priced_as_nan():
    """A flavor costs.PRICES does not list (l40sx4, a multi-GPU trainer) is named in the run's cost line, where
    a price would otherwise print as $nan/hour."""
    p = run_launcher("--dry-run", "--run", "dry3", "--workers", "1", "--trainer-flavor", "l40sx4")
    assert p.returncode == 0, p.stderr
    assert "cost unknown: no price for l40sx4 in lib/jobs/costs.py PRICES" in p.stdout and "nan" not in p.stdout


def test_dry_run_without_a_namespace_prints_shell_safe_commands(tmp_path):
    """Not logged in (and offline): "$HF_NAMESPACE" with the line that sets it, never a bare <...>; the
    lines, run by bash with HF_NAMESPACE set, reach `hf` with the namespace expanded everywhere."""
    p = run_launcher("--dry-run", "--run", "dry2", "--workers", "1", env_extra={"HF_HOME": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert 'export HF_NAMESPACE="${HF_NAMESPACE:-$(hf auth whoami --quiet)}"' in out
    assert 'hf buckets create "$HF_NAMESPACE/async-grpo" --private --exist-ok' in out
    assert not re.search(r"<[a-z-]+>", out)
    assert len(hf_lines(out)) == 4, out   # proxy, one worker, trainer, supervisor: the loop below checks them all
    for line in hf_lines(out):
        argv = subprocess.run(["bash", "-c", "printf '%s\\0' " + line.removeprefix("hf jobs uv run ")],
                              env={"HF_NAMESPACE": "my-org", "PATH": "/usr/bin:/bin"}, capture_output=True,
                              text=True, check=True).stdout.split("\0")[:-1]
        assert "S3_ENDPOINT_URL=https://s3.hf.co/my-org" in argv and argv[argv.index("--namespace") + 1] == "my-org"
    # with HF_NAMESPACE set there is nothing to resolve: the commands carry it
    p = run_launcher("--dry-run", "--run", "dry2", env_extra={"HF_HOME": str(tmp_path), "HF_NAMESPACE": "an-org"})
    assert "HF_NAMESPACE" not in p.stdout and "S3_ENDPOINT_URL=https://s3.hf.co/an-org" in p.stdout


def test_early_clear_failures(tmp_path):
    # no `hf` on PATH: a note (the launcher itself does not need it), then on to the next check
    p = run_launcher("--run", "x", path="/usr/bin:/bin", env_extra={"HF_HOME": str(tmp_path)})
    assert "the Hugging Face CLI 'hf' is not on PATH" in p.stderr
    assert p.returncode == 1 and "not logged in to Hugging Face: run `hf auth login`" in p.stderr
    # logged in, but the proxy secret and the bucket keys are not set: named, before any network call
    p = run_launcher("--run", "x", env_extra={"HF_TOKEN": SECRETS["HF_TOKEN"], "HF_HOME": str(tmp_path)})
    assert p.returncode == 1 and "PROXY_TOKEN" in p.stderr and "AWS_SECRET_ACCESS_KEY" in p.stderr
    assert "127.0.0.1:9" not in p.stderr
    # bad values
    p = run_launcher("--dry-run", "--run", "has space", env_extra={"HF_HOME": str(tmp_path)})
    assert p.returncode == 1 and "--run 'has space'" in p.stderr
    p = run_launcher("--dry-run", "--task", "jsonl:/nonexistent.jsonl", env_extra={"HF_HOME": str(tmp_path)})
    assert p.returncode == 1 and "no such file" in p.stderr
    p = run_launcher("--run", "x", "--timeout", "1.5", env_extra={**SECRETS, "HF_HOME": str(tmp_path)})
    assert p.returncode == 1 and "--timeout: timeout '1.5': whole seconds (90) or a number with s, m, h or d" in p.stderr
    assert "Traceback" not in p.stderr


def test_status_and_cancel_without_login_or_hub_say_so(tmp_path):
    for cmd in ("--status", "--cancel"):
        p = run_launcher(cmd, "r1", "--namespace", "my-org", env_extra={"HF_HOME": str(tmp_path)})
        assert p.returncode == 1 and "not logged in to Hugging Face: run `hf auth login`" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr
    # logged in, but the Hub does not answer (huggingface_hub retries ~20 s first)
    p = run_launcher("--status", "r1", "--namespace", "my-org", env_extra={"HF_TOKEN": SECRETS["HF_TOKEN"],
                                                                          "HF_HOME": str(tmp_path)})
    assert p.returncode == 1 and "listing the jobs of run r1: cannot reach the Hub at http://127.0.0.1:9" in p.stderr
    assert "Traceback" not in p.stderr


def test_the_setup_message_names_what_the_launcher_needs(tmp_path):
    """Without a Python that has the launcher's packages, and without uv: the one pip line it needs, no torch."""
    for f in ("launch_jobs.sh", "launch_hf.py"):
        (tmp_path / f).write_text((ROOT / f).read_text())
    probe = subprocess.run(["/usr/bin/env", "python3", "-c", "import huggingface_hub, tyro, boto3, httpx, pydantic, "
                            "tenacity"], env={"PATH": "/usr/bin:/bin"}, capture_output=True)
    if probe.returncode == 0:
        pytest.skip("this machine's python3 has every package of the launcher")
    p = run_launcher("--status", "r1", path="/usr/bin:/bin", cwd_script=tmp_path / "launch_jobs.sh",
                     env_extra={"HF_HOME": str(tmp_path)})
    assert p.returncode == 2
    assert "pip install -U 'huggingface_hub>=1.24' tyro boto3 httpx pydantic tenacity" in p.stderr
    assert "torch" not in p.stderr and "requirements.txt" not in p.stderr


def test_dry_run_commands_are_accepted_by_the_real_hf_cli(tmp_path):
    """Feed each printed line to `hf jobs uv run --dry-run` (the CLI's own parser and config summary,
    offline): it must accept every flag and see the same script, args, flavor, secrets and env."""
    env_extra = {**SECRETS, "PROXY_HF_TOKEN": SECRETS["HF_TOKEN"], "HF_HOME": str(tmp_path)}
    p = run_launcher("--dry-run", "--run", "cli1", "--workers", "1", "--namespace", "my-org", env_extra=dict(env_extra))
    lines = [shlex.split(x) for x in hf_lines(p.stdout)]
    assert len(lines) == 4
    env = {**os.environ, **env_extra, "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin",
           "HF_ENDPOINT": "http://127.0.0.1:9"}
    for cmd in lines:
        got = subprocess.run([cmd[0], *cmd[1:4], "--dry-run", *cmd[4:]], env=env, capture_output=True, text=True,
                             timeout=120)
        assert got.returncode == 0 and "(dry run) Job not submitted." in got.stdout, got.stdout + got.stderr
        script = next(a for a in cmd if a.endswith(".py"))
        summary = got.stdout
        assert re.search(rf"script\s+{script}\n\s+args\s+{cmd[cmd.index(script) + 1]} ", summary)
        assert re.search(r"flavor\s+" + cmd[cmd.index("--flavor") + 1], summary) and re.search(r"timeout\s+6h", summary)
        assert "namespace  my-org" in summary and "async-grpo-run=cli1" in summary
        for name in (c for i, c in enumerate(cmd) if i and cmd[i - 1] == "--secrets"):
            assert f"{name}=***" in summary                       # the CLI masks them too
        assert ("expose     8000" in summary) == (script == "proxy.py")
        for v in SECRETS.values():
            assert v not in summary + got.stderr


# --- every `hf jobs uv run` command the README and the docstrings show ---------------------------


DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
PRINTED = re.compile(r"^\s*(bash launch_jobs\.sh --print-command \S+ --run \S+)", re.M)


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for each `hf jobs uv run` line in the bash blocks of the README and the docs pages and
    in the scripts' docstrings (continuation lines joined), and for each `bash launch_jobs.sh --print-command
    ROLE --run RUN` they show: the command that prints, as it prints it."""
    found, printed = [], []
    for page in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", (ROOT / page).read_text(), re.S):  # abridged samples are plain ```
            found += [(page, cmd) for cmd in re.findall(r"^(hf jobs uv run .*?)(?<!\\)$", block.replace("\\\n", " "), re.M)]
            printed += [(page, cmd) for cmd in PRINTED.findall(block)]
    for script in ("proxy.py", "rollout.py", "train.py", "evaluate.py", "launch_hf.py"):
        doc = ast.get_docstring(ast.parse((ROOT / script).read_text()), clean=False) or ""
        found += [(script, cmd) for cmd in re.findall(r"^\s*(hf jobs uv run .*)$", doc, re.M)]  # "\\\n" already joined
        printed += [(script, cmd) for cmd in PRINTED.findall(doc)]
    for where, cmd in printed:
        p = run_launcher(*shlex.split(cmd)[2:], env_extra={"HF_HOME": "/nonexistent-hf-home"})  # no token: "$HF_NAMESPACE"
        assert p.returncode == 0 and len(hf_lines(p.stdout)) == 1, (where, cmd, p.stdout, p.stderr)
        found.append((f"{where}: {cmd}", hf_lines(p.stdout)[0]))
    return found


# what a job of each script needs to reach the run: (secrets, environment)
BUCKET_NEEDS = ({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}, {"BUCKET", "RUN_NAME", "S3_ENDPOINT_URL"})
NEEDS = {"proxy.py": ({"PROXY_TOKEN"}, set()),
         "rollout.py": ({"HF_TOKEN", "PROXY_HF_TOKEN", "PROXY_TOKEN"}, set()),
         "train.py": ({"HF_TOKEN", "PROXY_HF_TOKEN", "PROXY_TOKEN"}, set()),
         "evaluate.py": ({"HF_TOKEN"}, set()),
         "launch_hf.py": ({"HF_TOKEN", "PROXY_TOKEN"}, set())}


def test_documented_commands_ship_what_their_script_imports_and_pass_what_it_needs(tmp_path):
    cmds = documented_commands()
    scripts_seen = set()
    env = {**os.environ, **SECRETS, "PROXY_HF_TOKEN": SECRETS["HF_TOKEN"], "HF_HOME": str(tmp_path),
           "HF_ENDPOINT": "http://127.0.0.1:9", "HF_NAMESPACE": "my-org",
           "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin"}
    for where, line in cmds:
        # the words as bash passes them ($HF_NAMESPACE expanded), comments dropped
        argv = subprocess.run(["bash", "-c", "printf '%s\\0' " + line], env=env, capture_output=True, text=True,
                              check=True).stdout.split("\0")[:-1]
        script = next(a for a in argv if a.endswith(".py"))
        scripts_seen.add(script)
        after = argv[argv.index(script) + 1:]
        files = after[:next((i for i, a in enumerate(after) if a.startswith("-")), len(after))]
        assert all((ROOT / a).is_file() for a in files), (where, files)  # run from the checkout's root, as printed
        shipped = {Path(a).name for a in files}  # the CLI uploads each by its basename, beside the script
        imported = {f"{m}.py" for m in local_modules(script)}
        assert imported <= shipped, f"{where}: {script} imports {sorted(imported)} but ships only {sorted(shipped)}"
        secrets = {argv[i + 1] for i, a in enumerate(argv) if a == "--secrets"}
        envs = {argv[i + 1].split("=")[0] for i, a in enumerate(argv) if a == "-e"}
        need_secrets, need_env = NEEDS[script]
        assert need_secrets | BUCKET_NEEDS[0] <= secrets, f"{where}: {script} needs secrets {need_secrets | BUCKET_NEEDS[0]}"
        assert need_env | BUCKET_NEEDS[1] <= envs, f"{where}: {script} needs -e {BUCKET_NEEDS[1]}"
        assert "--timeout" in argv and not re.search(r"<[A-Za-z_-]+>", line), (where, line)
        got = subprocess.run(["hf", "jobs", "uv", "run", "--dry-run", *argv[4:]], env=env, capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
        assert got.returncode == 0 and "(dry run) Job not submitted." in got.stdout, (where, got.stdout + got.stderr)
    assert {"proxy.py", "rollout.py", "train.py", "evaluate.py"} <= scripts_seen, scripts_seen


BIG = ("--model", "Qwen/Qwen2.5-14B-Instruct", "--rollout-flavor", "l40sx1", "--rollout-arg=--vllm-gpu-memory-utilization",
       "--rollout-arg=0.9")  # a base a replica of which fits no L4: sharded over the ranks (memory.shard_base)


@pytest.mark.parametrize("flavor, gpus, more, shard", [("h200x2", 2, (), "replicate"), ("a100x4", 4, (), "replicate"),
                                                       ("a10g-small", 1, (), "replicate"), ("l4x4", 4, BIG, "base")])
def test_a_trainer_flavor_of_several_gpus_runs_one_rank_per_gpu(tmp_path, flavor, gpus, more, shard):
    """--trainer-flavor with N GPUs: the trainer's printed command (--dry-run and --print-command, the same line) runs
    train.py with --nproc-per-node N, which train.py's own parser reads and the real `hf jobs uv run` CLI passes to
    the script untouched (train.py then starts itself under torchrun: lib/train/ranks.py); one GPU: no option. A
    base too large for one of its GPUs gets --shard base."""
    import tyro

    import train
    env_extra = {**SECRETS, "PROXY_HF_TOKEN": SECRETS["HF_TOKEN"], "HF_HOME": str(tmp_path)}
    dry = run_launcher("--dry-run", "--run", "ranks1", "--namespace", "my-org", "--trainer-flavor", flavor, *more,
                       env_extra=dict(env_extra))
    printed = run_launcher("--print-command", "trainer", "--run", "ranks1", "--namespace", "my-org", "--trainer-flavor",
                           flavor, *more, env_extra=dict(env_extra))
    assert dry.returncode == 0 and printed.returncode == 0, dry.stderr + printed.stderr
    line = next(x for x in hf_lines(dry.stdout) if "role=trainer" in x)
    assert hf_lines(printed.stdout) == [line]
    cmd = shlex.split(line)
    after = cmd[cmd.index("train.py") + 1:]
    args = tyro.cli(train.Args, args=after[next(i for i, a in enumerate(after) if a.startswith("-")):])
    assert args.nproc_per_node == gpus and cmd[cmd.index("--flavor") + 1] == flavor and args.shard == shard
    assert ("--nproc-per-node" in after) == (gpus > 1)
    env = {**os.environ, **env_extra, "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin",
           "HF_ENDPOINT": "http://127.0.0.1:9"}
    got = subprocess.run([*cmd[:4], "--dry-run", *cmd[4:]], env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and "(dry run) Job not submitted." in got.stdout, got.stdout + got.stderr
    assert re.search(r"flavor\s+" + flavor, got.stdout)
    if gpus > 1:
        assert f" --nproc-per-node {gpus} " in got.stdout.replace("\n", " ")
    assert "$nan" not in dry.stdout


def test_an_autoscaled_launch_starts_its_first_worker_and_records_the_bounds_for_the_supervisor(hub, s3_env):
    """--preset jobs-autoscale: one rollout job to start from; the bounds in launch/plan.json, where every supervisor
    of the run (a relaunched one too) reads them (tests/test_autoscale.py: what it does with them)."""
    from dataclasses import asdict

    import autoscale
    fake = hub()
    launch_hf.main(["--run", "auto-1", "--preset", "jobs-autoscale", "--steps", "5"])
    assert [j["labels"]["role"] for j in fake.jobs.values()] == ["proxy", "rollout-1", "trainer", "supervisor"]
    plan = common.Bucket(bucket="async-grpo", run="auto-1").get_json("launch/plan.json")
    assert plan["autoscale"] == asdict(autoscale.Bounds(**presets.PRESETS["jobs-autoscale"].autoscale))
    assert "autoscale.py" in plan["files"]   # shipped with the supervisor job: it imports it

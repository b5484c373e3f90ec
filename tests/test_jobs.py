"""What `launch_jobs.sh` submits to Hugging Face Jobs, checked at the HTTP boundary.

huggingface_hub's own code runs unchanged (`HfApi.run_uv_job` -> local-file upload -> `run_job`,
`inspect_job`, `list_jobs`, `cancel_job`, `create_bucket`, `whoami`); only its network layer is
replaced: every HTTP call goes through `huggingface_hub.set_client_factory` to an httpx2
MockTransport that plays the Hub (and the proxy's --expose gateway), and the bucket upload of the
shipped files, which hf_xet performs in Rust outside httpx, is recorded at `HfApi.batch_bucket_files`.
The bash entry point itself is run as a process for --dry-run and the early failures.
"""
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

from conftest import ROOT

import launch_hf

SHIPPED = [f"/data/{m}" for m in launch_hf.SHIPPED]  # every shared module travels beside each job's script

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
def hub(monkeypatch):
    """Route huggingface_hub's HTTP to a FakeHub; record the xet bucket upload of the shipped files."""
    def make(**kw) -> FakeHub:
        fake = FakeHub(**kw)
        set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(fake.handle)))

        def record_upload(self, bucket_id, *, add=None, copy=None, delete=None, token=None):
            fake.uploads.append((bucket_id, [(Path(src).resolve(), dst) for src, dst in add or []]))
        monkeypatch.setattr(HfApi, "batch_bucket_files", record_upload)
        return fake

    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    for k in ("S3_ENDPOINT_URL", "BUCKET", "AWS_REGION", "HF_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(launch_hf, "POLL_S", 0.0)
    monkeypatch.chdir(ROOT)
    yield make
    set_client_factory(default_client_factory)


def test_launch_submits_proxy_then_workers_and_trainer(hub, capsys):
    fake = hub()
    launch_hf.main(["--run", "gsm-1", "--workers", "2", "--steps", "50", "--timeout", "3h",
                    "--train-arg=--lr", "--train-arg=1e-5"])
    out = capsys.readouterr()
    jobs = list(fake.jobs.items())
    assert [j["labels"]["role"] for _, j in jobs] == ["proxy", "rollout-1", "rollout-2", "trainer"]
    proxy_id, proxy = jobs[0]
    proxy_url = f"https://{proxy_id}--8000.hf.jobs"
    # the workers and the trainer were submitted only after the proxy answered /health through the gateway
    assert fake.health_calls == 2
    first_worker = next(i for i, r in enumerate(fake.requests) if r.method == "POST" and r.url.path == "/api/jobs/alice"
                        and json.loads(r.content)["labels"]["role"] == "rollout-1")
    assert any(r.url.host.endswith(".hf.jobs") for r in fake.requests[:first_worker])

    base_env = {"BUCKET": "async-grpo", "RUN_NAME": "gsm-1", "S3_ENDPOINT_URL": "https://s3.hf.co/alice",
                "AWS_REGION": "us-east-1", "PYTHONUNBUFFERED": "1"}
    bucket_secrets = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    expected = {
        "proxy": (["/data/proxy.py", *SHIPPED, "--host", "0.0.0.0", "--port", "8000", "--group-size", "8"],
                  "cpu-upgrade", {"PROXY_TOKEN"} | bucket_secrets, base_env, []),
        "rollout-1": (["/data/rollout.py", *SHIPPED, "--model", "Qwen/Qwen2.5-0.5B-Instruct",
                       "--task", "gsm8k", "--group-size", "8", "--max-new-tokens", "512", "--worker-id", "gsm-1-w1",
                       "--seed", "1"], "l4x1", {"HF_TOKEN", "PROXY_HF_TOKEN", "PROXY_TOKEN"} | bucket_secrets,
                      {**base_env, "PROXY_URL": proxy_url}, None),
        "trainer": (["/data/train.py", *SHIPPED, "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--max-steps", "50",
                     "--lr", "1e-5"], "a10g-small", {"HF_TOKEN", "PROXY_HF_TOKEN", "PROXY_TOKEN"} | bucket_secrets,
                    {**base_env, "PROXY_URL": proxy_url, "TRAINER_ID": "gsm-1-trainer"}, None),
    }
    uploads = {}  # the job's folder in jobs-artifacts -> (bucket, {name: local file uploaded})
    for bucket, files in fake.uploads:
        uploads[files[0][1].split("/")[0]] = (bucket, {d.split("/", 1)[1]: src for src, d in files})
    for jid, spec in jobs:
        role = spec["labels"]["role"]
        cmd, flavor, secret_names, env, expose_ports = expected.get(role, expected["rollout-1"])
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
        # common.py is uploaded beside the script into this job's folder, mounted at /data
        (vol,) = spec["volumes"]
        assert vol["type"] == "bucket" and vol["source"] == "alice/jobs-artifacts" and vol["mountPath"] == "/data"
        bucket, files = uploads[vol["path"]]
        script = cmd[cmd.index("/data/common.py") - 1].removeprefix("/data/")
        assert bucket == "alice/jobs-artifacts" and files == {script: ROOT / script, **{m: ROOT / m for m in launch_hf.SHIPPED}}

    # the run bucket was created (private) before anything ran
    create = [r for r in fake.requests if r.url.path == "/api/buckets/alice/async-grpo"]
    assert len(create) == 1 and json.loads(create[0].content) == {"visibility": "private"}
    # the console: ids, the proxy URL and how to follow the logs; no secret value anywhere
    for jid, _ in jobs:
        assert f"hf jobs logs -f {jid}" in out.out
    assert proxy_url in out.out and "bash launch_jobs.sh --cancel gsm-1" in out.out
    for v in SECRETS.values():
        assert v not in out.out + out.err


def test_jsonl_task_file_is_shipped_and_read_from_data(hub, tmp_path, capsys):
    fake = hub()
    data = tmp_path / "my_tasks.jsonl"
    data.write_text('{"prompt": "2+2?", "answer": 4}\n{"prompt": "3+3?", "answer": 6}\n')
    launch_hf.main(["--run", "mine", "--workers", "1", "--task", f"jsonl:{data}", "--rollout-with", "flash-attn,ninja"])
    roll = next(j for j in fake.jobs.values() if j["labels"]["role"] == "rollout-1")
    assert roll["command"][:8 + len(SHIPPED)] == ["uv", "run", "--with", "flash-attn", "--with", "ninja", "/data/rollout.py",
                                                  *SHIPPED, "/data/my_tasks.jsonl"]
    assert roll["command"][roll["command"].index("--task") + 1] == "jsonl:/data/my_tasks.jsonl"
    shipped = [dict((d.split("/")[1], s) for s, d in files) for _, files in fake.uploads]
    assert {"rollout.py": ROOT / "rollout.py", **{m: ROOT / m for m in launch_hf.SHIPPED}, "my_tasks.jsonl": data} in shipped


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
    with pytest.raises(SystemExit, match=r"(?s)submitting the trainer job failed: .*credits.*3 job\(s\) of run "
                                         r"pay already started.*bash launch_jobs.sh --cancel pay"):
        launch_hf.main(["--run", "pay", "--workers", "2"])
    assert [j["labels"]["role"] for j in fake.jobs.values()] == ["proxy", "rollout-1", "rollout-2"]


def listed_job(jid: str, run: str, role: str, stage: str) -> dict:
    return {"id": jid, "labels": {"async-grpo-run": run, "role": role}, "flavor": "l4x1",
            "status": {"stage": stage}, "owner": OWNER}


def test_status_and_cancel_act_on_every_job_of_the_run(hub, capsys):
    listed = [listed_job("a1", "r7", "proxy", "RUNNING"), listed_job("a2", "r7", "rollout-1", "RUNNING"),
              listed_job("a3", "r7", "rollout-2", "ERROR"), listed_job("a4", "r7", "trainer", "SCHEDULING"),
              listed_job("b1", "other", "proxy", "RUNNING")]
    fake = hub(listed=listed)
    launch_hf.main(["--status", "r7"])
    out = capsys.readouterr().out
    assert all(j in out for j in ("a1", "a2", "a3", "a4")) and "b1" not in out and "ERROR" in out
    lists = [r for r in fake.requests if r.method == "GET" and r.url.path == "/api/jobs/alice"]
    assert lists[-1].url.params.get_list("label") == ["async-grpo-run=r7"]

    launch_hf.main(["--cancel", "r7"])
    cancelled = [r.url.path.split("/")[-2] for r in fake.requests if r.url.path.endswith("/cancel")]
    assert cancelled == ["a1", "a2", "a4"]       # the job that already ended is left alone
    assert "3 of 4 jobs of run r7 cancelled" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no jobs labelled async-grpo-run=nope"):
        launch_hf.main(["--status", "nope"])


# --- the bash entry point as a process ---------------------------------------------------------


def run_launcher(*args, env_extra=None, path=None):
    env = {k: v for k, v in os.environ.items() if k not in SECRETS and k not in ("BUCKET", "S3_ENDPOINT_URL")}
    env.update({"PATH": path or f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "HF_HOME": env_extra.pop("HF_HOME")
                if env_extra and "HF_HOME" in env_extra else env.get("HF_HOME", ""),
                "HF_ENDPOINT": "http://127.0.0.1:9"})   # nothing listens there: any network call would fail
    env.update(env_extra or {})
    return subprocess.run(["bash", str(ROOT / "launch_jobs.sh"), *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_dry_run_prints_a_complete_run_and_no_secret(tmp_path):
    p = run_launcher("--dry-run", "--run", "dry1", "--workers", "3", "--namespace", "my-org",
                     env_extra={**SECRETS, "HF_HOME": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    cmds = [shlex.split(line) for line in p.stdout.splitlines() if line.startswith("hf jobs uv run")]
    roles = [c[c.index("--label", c.index("--label") + 1) + 1] for c in cmds]
    assert roles == ["role=proxy", "role=rollout-1", "role=rollout-2", "role=rollout-3", "role=trainer"]
    for c in cmds:
        script = next(a for a in c if a.endswith(".py"))
        assert c[c.index(script) + 1:c.index(script) + 3] == ["common.py", "models.py"]  # shipped beside it
        assert c[c.index("--timeout") + 1] == "6h" and "--detach" in c and "--namespace" in c
        assert "async-grpo-run=dry1" in c and "S3_ENDPOINT_URL=https://s3.hf.co/my-org" in c
        assert "PROXY_TOKEN" in c and "AWS_SECRET_ACCESS_KEY" in c       # secrets by name
    assert cmds[0][cmds[0].index("--expose") + 1] == "8000" and "0.0.0.0" in cmds[0]
    assert all("--expose" not in c and "PROXY_URL=https://<proxy-job-id>--8000.hf.jobs" in c for c in cmds[1:])
    assert "hf buckets create my-org/async-grpo --private --exist-ok" in p.stdout
    assert "about $3.44/hour" in p.stdout     # 3 x l4x1 + a10g-small + cpu-upgrade + the exposed port
    for v in SECRETS.values():
        assert v not in p.stdout + p.stderr


def test_early_clear_failures(tmp_path):
    # no `hf` on PATH
    p = run_launcher("--run", "x", path="/usr/bin:/bin")
    assert p.returncode == 2 and "the Hugging Face CLI 'hf' is not installed" in p.stderr
    # not logged in (no HF_TOKEN, an empty HF_HOME)
    p = run_launcher("--run", "x", env_extra={"HF_HOME": str(tmp_path)})
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


def test_dry_run_commands_are_accepted_by_the_real_hf_cli(tmp_path):
    """Feed each printed line to `hf jobs uv run --dry-run` (the CLI's own parser and config summary,
    offline): it must accept every flag and see the same script, args, flavor, secrets and env."""
    env_extra = {**SECRETS, "PROXY_HF_TOKEN": SECRETS["HF_TOKEN"], "HF_HOME": str(tmp_path)}
    p = run_launcher("--dry-run", "--run", "cli1", "--workers", "1", "--namespace", "my-org", env_extra=dict(env_extra))
    lines = [shlex.split(x) for x in p.stdout.splitlines() if x.startswith("hf jobs uv run")]
    assert len(lines) == 3
    env = {**os.environ, **env_extra, "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin",
           "HF_ENDPOINT": "http://127.0.0.1:9"}
    for cmd in lines:
        got = subprocess.run([cmd[0], *cmd[1:4], "--dry-run", *cmd[4:]], env=env, capture_output=True, text=True,
                             timeout=120)
        assert got.returncode == 0 and "(dry run) Job not submitted." in got.stdout, got.stdout + got.stderr
        script = next(a for a in cmd if a.endswith(".py"))
        summary = got.stdout
        assert re.search(rf"script\s+{script}\n\s+args\s+common.py ", summary)
        assert re.search(r"flavor\s+" + cmd[cmd.index("--flavor") + 1], summary) and re.search(r"timeout\s+6h", summary)
        assert "namespace  my-org" in summary and "async-grpo-run=cli1" in summary
        for name in (c for i, c in enumerate(cmd) if i and cmd[i - 1] == "--secrets"):
            assert f"{name}=***" in summary                       # the CLI masks them too
        assert ("expose     8000" in summary) == (script == "proxy.py")
        for v in SECRETS.values():
            assert v not in summary + got.stderr

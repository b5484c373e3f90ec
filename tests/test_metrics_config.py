"""Metrics to trackio (read back from trackio's own storage) and the configuration every role records
in the bucket at start (no secret in it; report.py prints it)."""
import json
import os
import subprocess
import sys

import common
import runconfig
import report
import train
from conftest import ROOT

ROWS = [{"step": s, "version": s, "reward/mean": r, "reward/correct": r, "perf/step_s": 2.0 + s, "grad_norm": 0.5,
         "sample/policy_versions": [s - 1, s], "ratio/onpolicy_mean": 1.0} for s, r in ((1, 0.25), (2, 0.5), (3, 0.875))]

LOG = """
import json, sys
sys.path.insert(0, {root!r})
import common, metrics
rows = json.loads(sys.argv[1])
m = metrics.Metrics(common.Bucket(run={run!r}), "train", report_to="trackio", trackio_project="grpo-test",
                   config={{"lr": 3e-4}})
for r in rows:
    m.log(r)
m.close()
w = metrics.Metrics(common.Bucket(run={run!r}), "rollout-w1")   # REPORT_TO, TRACKIO_PROJECT from the environment
w.log({{"version": 0, "rollout/reward_mean": 0.125}})
w.close()
"""

READ = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage
print(json.dumps({{name: SQLiteStorage.get_logs("grpo-test", name) for name in sys.argv[1:]}}, default=str))
"""


def test_trackio_gets_the_same_metric_names_offline(s3_env, bucket, run_name, tmp_path):
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "REPORT_TO": "trackio", "TRACKIO_PROJECT": "grpo-test",
           "HF_HUB_OFFLINE": "1",
           "HF_ENDPOINT": "http://127.0.0.1:9"}   # nothing listens there: trackio must not need the network
    p = subprocess.run([sys.executable, "-c", LOG.format(root=str(ROOT), run=run_name), json.dumps(ROWS)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "trackio disabled" not in p.stderr
    p = subprocess.run([sys.executable, "-c", READ.format(), f"{run_name}-train", f"{run_name}-rollout-w1"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    logs = json.loads(p.stdout.strip().splitlines()[-1])
    got = logs[f"{run_name}-train"]
    assert [r["step"] for r in got] == [1, 2, 3]
    for want, row in zip(ROWS, got):
        for k in ("reward/mean", "reward/correct", "perf/step_s", "grad_norm", "ratio/onpolicy_mean", "version"):
            assert row[k] == want[k], k
        assert "sample/policy_versions" not in row      # lists stay in the JSONL only
    assert logs[f"{run_name}-rollout-w1"][0]["rollout/reward_mean"] == 0.125
    # the JSONL in the bucket is written as before, same names
    jsonl = [json.loads(x) for x in bucket.get("metrics/train.jsonl")[0].decode().splitlines()]
    assert [r["reward/mean"] for r in jsonl] == [0.25, 0.5, 0.875] and jsonl[0]["sample/policy_versions"] == [0, 1]


SPACE = """
import sys
sys.path.insert(0, {root!r})
import common, metrics
m = metrics.Metrics(common.Bucket(run={run!r}), "train", report_to="trackio", trackio_space="alice/dashboard")
for s in range(1, 4):
    m.log({{"step": s, "reward/mean": 0.5}})
m.close()
"""


def test_a_trackio_failure_never_stops_the_metrics(s3_env, bucket, run_name, tmp_path):
    """A Space that cannot be reached (the Hub is down): trackio is switched off with one message,
    the run goes on and the rows still reach the bucket."""
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_TOKEN": "hf_fake0123456789",
           "HF_ENDPOINT": "http://127.0.0.1:9"}
    p = subprocess.run([sys.executable, "-c", SPACE.format(root=str(ROOT), run=run_name)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("trackio disabled") == 1, p.stderr
    assert len(bucket.get("metrics/train.jsonl")[0].decode().splitlines()) == 3


SECRETS = {"PROXY_TOKEN": "proxy-secret-value-0001", "PROXY_HF_TOKEN": "hf_secretvalue0002",
           "AWS_SECRET_ACCESS_KEY_EXTRA": "aws-secret-value-0003"}


def test_config_records_every_start_without_secrets(bucket, monkeypatch, capsys, tmp_path):
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("JOB_ID", "job-123")
    monkeypatch.setattr(sys, "argv", [str(ROOT / "train.py"), "--proxy-token", "argv-secret-0004", "--lr", "1e-4",
                                      "--hf-token=argv-secret-0005", "--no-scale-std"])
    args = train.Args(lr=1e-4, scale_std=False, proxy_token="argv-secret-0004", hf_token="argv-secret-0005",
                      proxy_url="https://user:url-secret-0006@proxy.example:8000", push_to_hub="alice/x")
    a = runconfig.record_config(bucket, "train", args, str(ROOT / "train.py"))
    b = runconfig.record_config(bucket, "train", args, str(ROOT / "train.py"))   # a restart: a second object
    keys = [k for k in bucket.list("config/")]
    assert len(keys) == 2 and all(k.startswith("config/train-") for k in keys)
    stored = [bucket.get(k)[0].decode() for k in keys]
    for text in stored:
        for secret in [*SECRETS.values(), "argv-secret-0004", "argv-secret-0005", "url-secret-0006"]:
            assert secret not in text, secret
    cfg = json.loads(stored[0])
    assert cfg["args"]["proxy_token"] == runconfig.REDACTED and cfg["args"]["lr"] == 1e-4
    assert cfg["argv"] == ["train.py", "--proxy-token", runconfig.REDACTED, "--lr", "1e-4", f"--hf-token={runconfig.REDACTED}",
                           "--no-scale-std"]
    assert cfg["command"].startswith("python train.py ") and "--lr 0.0001" in cfg["command"]
    assert "--no-scale-std" in cfg["command"] and "--push-to-hub alice/x" in cfg["command"]
    assert "token" not in cfg["command"].replace("--push-to-hub", "")
    assert cfg["sha256"]["train.py"] == common.sha256_file(ROOT / "train.py")
    assert cfg["sha256"]["common.py"] == common.sha256_file(ROOT / "common.py")
    for pkg in ("torch", "transformers", "peft", "huggingface_hub"):
        assert cfg["versions"][pkg], pkg
    assert "vllm" in cfg["versions"]                   # None here: not installed in this environment
    assert cfg["env"]["JOB_ID"] == "job-123" and "PROXY_TOKEN" not in cfg["env"]
    assert a["started_at"] <= b["started_at"] and cfg["host"] and cfg["device"] == "cpu"

    monkeypatch.setenv("RUN_NAME", bucket.run)
    report.main(report.Args(out=str(tmp_path)))
    out = capsys.readouterr().out
    assert "configuration of each role start (2;" in out and out.count("command:  python train.py") == 2
    assert "torch " in out and "sha256:   train.py " in out
    assert json.loads((tmp_path / "configs.json").read_text())[0]["role"] == "train"


def test_config_keeps_settings_whose_names_only_contain_token(bucket, monkeypatch):
    """max_new_tokens is a setting, not a secret: it and its value stay in the record (a name matching
    "tokens" once hid them), while --proxy-token's value and --api-key's are still hidden."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "rollout.py"), "--max-new-tokens", "48", "--proxy-token", "s3cret-0007",
                                      "--api-key=s3cret-0008"])
    import rollout
    args = rollout.Args(max_new_tokens=48, proxy_token="s3cret-0007")
    cfg = runconfig.record_config(bucket, "rollout", args, str(ROOT / "rollout.py"))
    assert cfg["argv"] == ["rollout.py", "--max-new-tokens", "48", "--proxy-token", runconfig.REDACTED,
                           f"--api-key={runconfig.REDACTED}"]
    assert cfg["args"]["max_new_tokens"] == 48 and cfg["args"]["proxy_token"] == runconfig.REDACTED
    assert "--max-new-tokens 48" in cfg["command"] and "s3cret" not in json.dumps(cfg)

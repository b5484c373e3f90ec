"""`bash launch_jobs.sh --local` as a user runs it: the whole run on this machine (S3 server, proxy, worker, trainer,
the default model), and how it ends when a role dies. Nothing is emulated: the worker is killed as a crash would."""
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from conftest import ROOT


def pid_of(script: str, run: str) -> int | None:
    """The process running `script` of run `run` (by its command line and its RUN_NAME), if any."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(script.encode()) for a in argv) and f"RUN_NAME={run}".encode() in env:
            return int(d)
    return None


def last_words(log: str) -> str:
    """A log's last line as a terminal shows it (tqdm's progress bar redraws with \\r)."""
    return [x.strip() for x in re.split(r"[\r\n]", log) if x.strip() and not x.strip().startswith("train:")][-1]


@pytest.mark.timeout(420)
def test_when_the_worker_dies_the_trainer_checkpoints_before_the_bucket_stops(run_name):
    """Its only worker killed once the trainer has taken a step: the launcher says so and exits 1, having stopped the
    trainer first (SIGTERM: it checkpoints into the bucket, its last words its own), then the proxy, and the S3
    server last: no role's final lines are about a bucket that went away (issue 43)."""
    out = ROOT / "runs" / run_name
    env = {k: v for k, v in os.environ.items() if k not in ("BUCKET", "S3_ENDPOINT_URL", "PROXY_URL", "PROXY_TOKEN",
                                                            "RUN_NAME", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    launcher = subprocess.Popen(["bash", str(ROOT / "launch_jobs.sh"), "--local", "--workers", "1", "--steps", "50",
                                 "--run", run_name], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        t0 = time.time()
        while not (out / "train.log").is_file() or not re.search(r"step\s+1\s+reward", (out / "train.log").read_text()):
            assert launcher.poll() is None and time.time() - t0 < 300, launcher.communicate(timeout=60)[0][-3000:]
            time.sleep(1)
        worker = pid_of("rollout.py", run_name)
        assert worker is not None
        os.kill(worker, signal.SIGKILL)
        said, _ = launcher.communicate(timeout=180)
        train, proxy = (out / "train.log").read_text(), (out / "proxy.log").read_text()
    finally:
        if launcher.poll() is None:
            launcher.terminate()   # its trap stops every process it started
            launcher.wait(120)
        shutil.rmtree(out, ignore_errors=True)
    assert launcher.returncode == 1 and "every rollout worker died" in said, said[-3000:]
    assert re.fullmatch(r"SIGTERM: checkpoint at step \d+, exiting", last_words(train)), train[-3000:]
    for log in (train, proxy):
        assert "waiting for the bucket" not in log and "Could not connect to the endpoint URL" not in log, log[-3000:]
    assert last_words(proxy) == "proxy: stopped cleanly", proxy[-3000:]

"""`bash launch_jobs.sh --local --autoscale` as a user runs it (lib/jobs/local_fleet.py driving autoscale.decide): the
run starts one worker and adds a second when the trainer waits. Nothing is emulated; the model is the tiny random
one (a step of a few seconds here, its rounds as long): the trainer waits for the first rounds, the run takes a
minute or two."""
import json
import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT


def test_bad_bounds_are_refused_by_name():
    import common  # noqa: F401  (lib/ on sys.path)
    import local_fleet
    assert local_fleet.bounds_from(["max_workers=3", "--up-cooldown-s=5"]).max_workers == 3
    for bad, said in [("workers=2", "NAME one of"), ("max_workers=two", "'two' is not a number"),
                      ("max_workers=0", "max_workers 0: at least min_workers and 1"), ("max_workers", "NAME=VALUE")]:
        with pytest.raises(SystemExit, match=said):
            local_fleet.bounds_from([bad])


@pytest.mark.timeout(300)
def test_the_local_run_adds_a_worker_when_the_trainer_waits(tiny_model, run_name):
    """From one worker: once the proxy has its groups and a window of signals shows the trainer waiting (busy under
    the target 0.85) while the worker does not wait for grants, the driver decides up 1, says so, starts w2 (whose
    groups the run's records hold), and the summary prints the ledger with every cross-check equal."""
    out = ROOT / "runs" / run_name
    env = {k: v for k, v in os.environ.items() if k not in ("BUCKET", "S3_ENDPOINT_URL", "PROXY_URL", "PROXY_TOKEN",
                                                            "RUN_NAME", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    try:
        done = subprocess.run(
            ["bash", str(ROOT / "launch_jobs.sh"), "--local", "--autoscale", "--steps", "10", "--run", run_name,
             "--train-arg", f"--model={tiny_model}", "--train-arg", "--no-skip-zero-std",  # its rewards are all equal
             "--rollout-arg", f"--model={tiny_model}", "--autoscale-arg", "min_window_s=5"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
        said = done.stdout + done.stderr
        decisions = [json.loads(x) for x in (out / "autoscale.jsonl").read_text().splitlines()]
        w2 = (out / "rollout-w2.log").read_text()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    assert done.returncode == 0, said[-4000:]
    ups = [d for d in decisions if d["action"] == "up"]
    assert decisions[0]["fleet"] == 1 and ups, decisions
    up = ups[0]
    assert up["why"] == "trainer_waits" and up["fleet"] == 1 and up["fleet_after"] == ["rollout-1", "rollout-2"], up
    assert up["signals"]["trainer_util"] < 0.85 and up["signals"]["wait_share"] <= 0.5, up
    lines = said.splitlines()
    first = next(i for i, x in enumerate(lines) if "autoscale: started worker w1" in x)
    decided = next(i for i, x in enumerate(lines) if re.search(r"autoscale: up 1 \(2 worker\(s\) now\): trainer busy", x))
    second = next(i for i, x in enumerate(lines) if "autoscale: started worker w2" in x)
    assert first < decided < second, said[-4000:]
    assert "== where the" in said and "MISMATCH" not in said, said[-4000:]
    assert "[w2] round 1 " in w2, w2[-3000:]                             # the added worker generated and sent
    assert re.search(r"^\s+rollout-w2\s+local\s", said, re.M), said[-4000:]  # and the summary prices its process

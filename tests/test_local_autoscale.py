"""`bash launch_jobs.sh --local --autoscale` as a user runs it (lib/jobs/local_fleet.py driving autoscale.decide): the
run starts one worker and adds a second when the trainer waits, and retires it without loss when workers wait for
grants. Nothing is emulated; the model is the tiny random one (a step of a few seconds here, its rounds as long):
the trainer waits for the first rounds, each run takes about a minute."""
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


def local_run(run_name: str, tiny_model: str, steps: int, *bounds: str, workers: int = 1) -> tuple[int, str, list[dict], str]:
    """`launch_jobs.sh --local --autoscale` on the tiny model from `workers` workers (`bounds`: its --autoscale-arg
    values): its exit status, what it printed, the decisions of runs/<run>/autoscale.jsonl and w2's log (the run's
    folder removed)."""
    out = ROOT / "runs" / run_name
    env = {k: v for k, v in os.environ.items() if k not in ("BUCKET", "S3_ENDPOINT_URL", "PROXY_URL", "PROXY_TOKEN",
                                                            "RUN_NAME", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    try:
        done = subprocess.run(
            ["bash", str(ROOT / "launch_jobs.sh"), "--local", "--autoscale", "--workers", str(workers), "--steps",
             str(steps), "--run", run_name,
             "--train-arg", f"--model={tiny_model}", "--train-arg", "--no-skip-zero-std",  # its rewards are all equal
             "--rollout-arg", f"--model={tiny_model}", *(a for b in bounds for a in ("--autoscale-arg", b))],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
        said = (done.stdout + done.stderr).replace("\r", "\n")  # tqdm's bar redraws with \r
        decisions = [json.loads(x) for x in (out / "autoscale.jsonl").read_text().splitlines()]
        w2 = (out / "rollout-w2.log").read_text() if (out / "rollout-w2.log").is_file() else ""
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return done.returncode, said, decisions, w2


def line_of(said: str, pattern: str) -> int:
    """The index of the first printed line `pattern` matches."""
    return next(i for i, x in enumerate(said.splitlines()) if re.search(pattern, x))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_local_run_adds_a_worker_when_the_trainer_waits(tiny_model, run_name):
    """From one worker: once the proxy has its groups and a window of signals shows the trainer waiting (busy under
    the target 0.85) while the worker does not wait for grants, the driver decides up 1, says so, starts w2 (whose
    groups the run's records hold), and the summary prints the ledger with every cross-check equal."""
    code, said, decisions, w2 = local_run(run_name, tiny_model, 10, "min_window_s=5")
    assert code == 0, said[-4000:]
    ups = [d for d in decisions if d["action"] == "up"]
    assert decisions[0]["fleet"] == 1 and ups, decisions
    up = ups[0]
    assert up["why"] == "trainer_waits" and up["fleet"] == 1 and up["fleet_after"] == ["rollout-1", "rollout-2"], up
    assert up["signals"]["trainer_util"] < 0.85 and up["signals"]["wait_share"] <= 0.5, up
    assert line_of(said, "autoscale: started worker w1") < line_of(
        said, r"autoscale: up 1 \(2 worker\(s\) now\): trainer busy") < line_of(said, "autoscale: started worker w2")
    assert "== where the" in said and "MISMATCH" not in said, said[-4000:]
    assert "[w2] round 1 " in w2, w2[-3000:]                             # the added worker generated and sent
    assert re.search(r"^\s+rollout-w2\s+local\s", said, re.M), said[-4000:]  # and the summary prices its process


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_local_run_retires_a_worker_without_loss_when_workers_wait(tiny_model, run_name):
    """From two workers, with bounds that make two too many (target 0.5, workers waiting over 0.3 of their time is
    too much, 10 s cool-downs): the driver decides down 1, the newest worker (w2) is told through the proxy, sends
    its round and exits 0, and the ledger counts nothing released or lost. (From one worker, no window shows the
    trainer under 0.5: its wait for the first batch is start-up, not counted, and it is what added the second.)"""
    code, said, decisions, w2 = local_run(run_name, tiny_model, 16, "min_window_s=5", "target_util=0.5",
                                          "wait_share_down=0.3", "up_cooldown_s=10", "down_cooldown_s=10", workers=2)
    assert code == 0, said[-4000:]
    downs = [d for d in decisions if d["action"] == "down"]
    assert downs and downs[0]["why"] == "workers_wait" and downs[0]["fleet_after"] == ["rollout-1"], decisions
    assert downs[0]["signals"]["wait_share"] > 0.3, downs[0]   # whatever the trainer does (autoscale.too_many)
    assert line_of(said, r"autoscale: down 1 \(1 worker\(s\) now\)") < line_of(said, r"autoscale: worker w2 left \(status 0\)")
    assert "[w2] leaving: the proxy asks this worker to (scaled down (local))" in w2, w2[-3000:]
    assert re.search(r"^\s+released_scale_down\s+0 tokens", said, re.M), said[-4000:]
    assert re.search(r"^\s+not_sent\s+0 tokens", said, re.M) and "MISMATCH" not in said, said[-4000:]

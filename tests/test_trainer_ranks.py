"""The trainer under torchrun: two CPU ranks (gloo) take the one-process step, the base replicated or sharded (FSDP2,
--shard base). tests/support/ranks_step.py runs one update (train.learn) on the same batch for every objective, once as
one process and as two ranks in each mode (and once with a KL term to the base, beta > 0, under activation
checkpointing, and once replicated on a 4-bit NF4 base); the gradients, the gradient norm, the step's metrics and the
adapter it would publish must agree within float tolerance. So must an update whose batch has a group with a NaN
reward (the ranks hold 3 and 2 micro-batches, and learn's per-group culprit search runs) and the audit's recompute
under the versions that sampled each group, falling back group by group past a group whose forward raises."""
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from common import OBJECTIVES
from conftest import ROOT, free_port, stop

SCRIPT = str(ROOT / "tests" / "support" / "ranks_step.py")


def run(cmd: list[str], tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    got = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-5000:]


@pytest.fixture(scope="module")
def steps(tiny_model, tmp_path_factory):
    """The folder every run wrote to: NAME-1 (one process), NAME-2 (two ranks, replicated), NAME-2-base (two ranks, the
    base sharded), each .pt and adapter; NAME an objective, poisoned or audit."""
    out = tmp_path_factory.mktemp("ranks")
    run([sys.executable, SCRIPT, tiny_model, str(out)], out)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port())]
    run([*torchrun, SCRIPT, tiny_model, str(out), "replicate", "base"], out)
    return out


# (a 4-bit base is replicated only: train.py refuses --shard base with --load-in-4bit)
@pytest.mark.parametrize("objective,ranks", [(o, r) for r in ("2", "2-base")
                                             for o in (*OBJECTIVES, "kl-ckpt", "poisoned")] + [("4bit", "2")])
def test_two_ranks_take_the_one_process_step(steps, objective, ranks):
    one, two = torch.load(steps / f"{objective}-1.pt"), torch.load(steps / f"{objective}-{ranks}.pt")
    assert one["grads"].keys() == two["grads"].keys() and one["grads"]
    for name, g in one["grads"].items():
        assert g.abs().sum() > 0, name  # every LoRA weight has a gradient: the comparison below means something
        assert torch.allclose(two["grads"][name], g, atol=1e-7, rtol=1e-4), name
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert one["stats"].keys() == two["stats"].keys()
    for k, v in one["stats"].items():  # loss, tokens, on-policy ratio, per-staleness diagnostics...
        assert two["stats"][k] == pytest.approx(v, rel=1e-5, abs=1e-5), k
    assert one["stats"]["tokens"] > 0 and "ratio/onpolicy_mean" in one["stats"] and "stale/1/ratio_dev_mean" in one["stats"]
    assert ("groups/unfit" in one["stats"]) == (objective == "poisoned")  # the culprit search ran where it should
    assert (one["stats"].get("kl", 0) > 0) == (objective == "kl-ckpt")  # the KL term counted only where asked
    assert (one["quantized"] > 0) == (two["quantized"] > 0) == (objective == "4bit")  # a 4-bit base on every rank
    a, b = (load_file(steps / f"{objective}-{n}" / "adapter_model.safetensors") for n in (1, ranks))
    assert a.keys() == b.keys() and a
    for name, w in a.items():
        assert torch.allclose(b[name], w, atol=1e-6, rtol=1e-5), name


@pytest.mark.parametrize("ranks", ["2", "2-base"])
def test_the_audits_recompute_on_two_ranks_is_the_one_process_one(steps, ranks):
    one, two = torch.load(steps / "audit-1.pt"), torch.load(steps / f"audit-{ranks}.pt")
    assert one["failed"].keys() == two["failed"].keys() == {"g00000007"}  # its own forward raised: the fallback ran
    assert one["devs"].keys() == two["devs"].keys() and any(n for _, _, n in one["devs"].values())
    for gid, (s, mx, n) in one["devs"].items():
        assert two["devs"][gid][2] == n and two["devs"][gid][:2] == pytest.approx([s, mx], rel=1e-5, abs=1e-6), gid


def rank_pid(trainer, local_rank: int) -> int | None:
    """The process of rank `local_rank` of a trainer started with --nproc-per-node (torchrun's children)."""
    pid = trainer.proc.pid
    for child in open(f"/proc/{pid}/task/{pid}/children").read().split():
        try:
            env = open(f"/proc/{child}/environ", "rb").read().split(b"\0")
        except FileNotFoundError:
            continue
        if f"LOCAL_RANK={local_rank}".encode() in env:
            return int(child)
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ranks_stop_together_die_clearly_and_resume_on_another_count(tiny_model, start_proxy, run_name, tmp_path):
    """A real run on the tiny model (proxy, worker, trainer): two ranks, the base sharded (--shard base), stopped by
    SIGTERM checkpoint and resume as one process; one process's checkpoint resumes on two sharded ranks; a rank killed
    with SIGKILL ends the trainer naming it; the relaunch on two replicated ranks resumes and finishes the run, its
    final version registered."""
    import re
    import signal

    from runlib import Role, steps, wait_for
    proxy = start_proxy("--group-size", "4")
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_URL": proxy.url, "PROXY_TOKEN": proxy.token,
           "OMP_NUM_THREADS": "1", "TRAINER_ID": "the-trainer", "SPOOL_DIR": str(tmp_path / "spool")}
    worker = Role("worker", [sys.executable, str(ROOT / "rollout.py"), "--model", tiny_model, "--group-size", "4",
                             "--prompts-per-round", "2", "--max-new-tokens", "6", "--worker-id", "w1"], env, tmp_path).start()
    trainer = Role("trainer", [sys.executable, str(ROOT / "train.py"), "--model", tiny_model, "--batch-groups", "2",
                               "--lr", "1e-3", "--lease-wait-s", "2", "--no-skip-zero-std", "--max-steps", "8",
                               "--checkpoint-every", "1"], env, tmp_path)
    two, sharded = ("--nproc-per-node", "2"), ("--nproc-per-node", "2", "--shard", "base")
    try:
        trainer.start(*sharded)
        wait_for(lambda: len(steps(trainer)) >= 1, 300, "a first step on two ranks", trainer, (trainer, worker))
        trainer.proc.send_signal(signal.SIGTERM)
        assert trainer.proc.wait(timeout=300) != 0
        first = trainer.last_run()
        assert "SIGTERM: checkpoint at step" in first and "trainer stopped by SIGTERM" in first, first[-3000:]

        trainer.start()  # one process: the two ranks' checkpoint
        wait_for(lambda: "resumed from checkpoint" in trainer.last_run() and len(steps(trainer)) >= 2, 300,
                 "a step on one process after two ranks", trainer, (trainer, worker))
        trainer.proc.send_signal(signal.SIGTERM)
        assert trainer.proc.wait(timeout=300) == 0 and "SIGTERM: checkpoint at step" in trainer.last_run()
        done = len(steps(trainer))

        trainer.start(*sharded)  # two ranks: one process's checkpoint; then rank 1 dies
        wait_for(lambda: "resumed from checkpoint" in trainer.last_run() and len(steps(trainer)) > done, 300,
                 "a step on two ranks after one process", trainer, (trainer, worker))
        os.kill(rank_pid(trainer, 1), signal.SIGKILL)
        assert trainer.proc.wait(timeout=300) != 0
        assert "trainer rank 1 of 2 ended with signal SIGKILL" in trainer.last_run(), trainer.last_run()[-3000:]
        # no traceback, and no group blamed by the audit for what a dead rank made its training raise (rank 0 in a
        # collective then says in one line that a rank is gone; waiting for a batch instead, torchrun's SIGTERM stops it)
        died = trainer.last_run()
        assert "Traceback" not in died and "failed the" not in died, died[-4000:]
        assert "another rank is gone" not in died or re.search(
            r"trainer rank 0 of 2: .* across the ranks failed, another rank is gone \(.*\): stopping; a relaunch", died)

        trainer.start(*two)  # the relaunch finishes the run
        assert trainer.proc.wait(timeout=600) == 0, trainer.last_run()[-3000:]
        assert "resumed from checkpoint" in trainer.last_run() and max(steps(trainer)) == 8
        latest = proxy.http.get("/v1/adapters/latest").json()
        assert latest["done"] and latest["step"] == 8, latest
    finally:
        for role in (trainer, worker):
            if role.alive():
                stop(role.proc)

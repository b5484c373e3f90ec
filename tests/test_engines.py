"""The server backend's pure pieces, without a server (the real vLLM server is in the vLLM lane,
tests/test_vllm_server.py; SGLang in bench/sglang_check.sh): the start commands carry what the
backend relies on, and a server's answer is checked before it can become a trajectory group."""
import math

import pytest

import engines


def test_server_commands_ask_for_runtime_lora_and_processed_logprobs():
    cmd, env = engines.server_command("vllm", "Qwen/Qwen2.5-0.5B-Instruct", 8123, lora_rank=24, python="py")
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd, cmd[1:]))
    assert flags["--model"] == "Qwen/Qwen2.5-0.5B-Instruct" and flags["--port"] == "8123" and flags["--host"] == "127.0.0.1"
    assert flags["--max-lora-rank"] == "32"          # the smallest size vLLM accepts that holds rank 24
    assert flags["--logprobs-mode"] == "processed_logprobs" and "--enable-lora" in cmd
    assert flags["--dtype"] == "float32"             # on CPU: logprobs must match the trainer's float32
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "--api-key" not in cmd                    # the key goes through the environment (ManagedServer)
    cmd, env = engines.server_command("sglang", "Qwen/Qwen2.5-0.5B-Instruct", 8123, lora_rank=24, python="py")
    flags = dict(zip(cmd, cmd[1:]))
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"] and flags["--model-path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert flags["--max-lora-rank"] == "24" and flags["--lora-target-modules"] == "all" and "--enable-lora" in cmd
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in env
    with pytest.raises(ValueError, match="unknown server kind 'tgi'"):
        engines.server_command("tgi", "m", 1)


def test_a_server_answer_is_checked_before_it_becomes_a_group():
    good = [([5, 6, 2], [-0.5, -1e-7, -2.0], "stop"), ([7], [0.0], "length")]
    assert engines.checked(good, 2) == good
    bad = [
        (good[:1], "1 completions, expected 2"),
        ([([5, 6], [-0.5], "stop"), good[1]], "2 token ids, 1 logprobs"),
        ([([5], [-0.5], "abort"), good[1]], "finish_reason 'abort'"),
        ([([], [], "stop"), good[1]], "0 token ids"),
        ([([5], [math.nan], "stop"), good[1]], "missing, not finite or > 0"),
        ([([5], [None], "stop"), good[1]], "missing, not finite or > 0"),
        ([([5], [0.3], "stop"), good[1]], "missing, not finite or > 0"),
    ]
    for samples, says in bad:
        with pytest.raises(RuntimeError, match=r"the inference server returned .*" + says):
            engines.checked(samples, 2)

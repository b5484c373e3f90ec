"""The hf worker and the adapter versions it is handed. A version whose LoRA has another shape than the one it
serves (the trainer restarted with another --lora-r, say): it refuses that version, says which and why, and keeps
generating with the adapter it has; it does not die, and asks for its grants at the version it holds. A version
that arrives during a round (a decode step, the prefill): every token it sends names the version that sampled
it. The real proxy (--max-staleness 3: version 1's rounds stay trainable while runlib's stand-in trainer leases
without registering versions), the moto bucket, the tiny model."""
import re
import time

import pytest

import common
import train
from runlib import worker_refuses_v2


def test_worker_refuses_an_adapter_of_another_rank_and_keeps_its_own(tiny_model, start_proxy, bucket, run_name,
                                                                      tmp_path):
    proxy = start_proxy("--group-size", "4", "--max-staleness", "3")

    def publish(v: int, r: int) -> None:
        model, _ = train.build_model(train.Args(model=tiny_model, lora_r=r, lora_alpha=2 * r))
        model.save_pretrained(tmp_path / f"v{v}")
        common.publish_adapter(bucket, tmp_path / f"v{v}", v, v, tiny_model)
        assert proxy.http.post("/v1/adapters", json={"version": v, "step": v, "published_at": time.time()}).is_success

    publish(1, r=4)
    text, after = worker_refuses_v2(tiny_model, proxy, run_name, tmp_path, lambda: publish(2, r=8), "version 2",
                                    rounds_after=4)
    assert re.search(r"refused version 2, keeping version 1: .*rank 8.*rank 4", text), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert len(after) >= 4 and set(after) == {"1"}  # it kept generating, with v1 only


@pytest.mark.parametrize("arrive", ["decode", "prefill"])
def test_every_token_a_worker_sends_names_the_version_that_sampled_it(tiny_model, start_proxy, bucket, run_name,
                                                                      tmp_path, monkeypatch, arrive):
    """A real worker (rollout.start_worker, hf engine, its own adapter sync thread) holding version 1 when the
    trainer's version 2 arrives during its round: at a decode step, or during the prefill. Each token's recorded
    version (common.token_versions of the group the trainer leases) is checked against the adapters themselves: the
    behaviour logprob is what the trainer's forward computes under that version (within the engine's floor), and,
    for the tokens version 2 sampled, not what version 1 would have given. What the worker recorded is read from the
    worker (rollout.Worker.swaps), not written by the test."""
    import torch

    from common import token_versions
    from swapping import logprobs_under, swap_round, versions
    monkeypatch.setenv("RUN_NAME", run_name)
    proxy = start_proxy("--group-size", "4", "--max-staleness", "3")
    models = versions(tiny_model, tmp_path, bucket, proxy)
    groups, swaps = swap_round(tiny_model, proxy, proxy.token, tmp_path, models, arrive)
    floor = 1e-4  # float32 on CPU: the engine's incremental decode against one full forward (measured ~1e-6)
    if arrive == "prefill":  # version 2 restarted the prefill: it sampled every token, the round is its
        assert swaps == [] and all(g["policy_version"] == 2 for g in groups), (swaps, [g["policy_version"] for g in groups])
    else:
        assert len(swaps) == 1 and swaps[0][1] == 2 and swaps[0][0] >= 1, swaps
        assert all(g["policy_version"] == 1 for g in groups)
    by_version = {1: 0, 2: 0}
    for g in groups:
        under = {v: logprobs_under(m, g) for v, m in models.items()}
        for k, c in enumerate(g["completions"]):
            behaviour = torch.tensor(c["logprobs"])
            for t, v in enumerate(token_versions(c, g["policy_version"])):
                by_version[v] += 1
                assert abs(behaviour[t] - under[v][k, t]) < floor, (g["group_id"], k, t, v, behaviour[t], under[v][k, t])
                if v == 2:  # the label discriminates: labelled version 1, this token would fail the check above
                    assert abs(behaviour[t] - under[1][k, t]) > floor, (k, t, behaviour[t], under[1][k, t])
    assert by_version[2] > 0 and (by_version[1] > 0) == (arrive == "decode"), by_version

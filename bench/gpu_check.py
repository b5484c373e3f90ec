"""The GPU check (run by bench/gpu_check.sh): one run of at most ~10 minutes on one GPU, no network.
Models are built from the configs the project carries (lib/jobs/configs/), with random weights;
the tokenizer is a word-level one built here. With the repository's own code (train.build_model /
train_step, vllm_engine.VLLMSampler / hf_engine.sample, models.completion_logprobs) it measures:

  1. trainer: step time and peak GPU memory in bf16 (checkpointing on, the GPU default) for
     Qwen2.5-0.5B and 1.5B at the Jobs layout (8 groups a step, 2 per micro-batch, G=8, prompts of
     256 tokens, completions of 512), against memory.py's prediction; last, Qwen2.5-7B in 4-bit
     (LoRA r=64) if the time budget allows (it writes 15 GB of random bf16 weights to disk first)
  2. vLLM (bf16, Qwen2.5-0.5B architecture): tokens/s without and with a LoRA, hot-swap latency
     (swap_in + the first token with the new version), engine start; the hf backend's tokens/s
  3. precision: the logprobs vLLM recorded while sampling (bf16) against the trainer's recompute of
     the same tokens with the same adapter, in bf16 and in float32: mean and max |diff| per token, and
     the on-policy ratio exp(trainer - vLLM) (mean, max |ratio - 1|) that ratio/onpolicy_mean shows

    python bench/gpu_check.py --out runs/gpu_check_results.json
    python bench/gpu_check.py --cpu-smoke    # here, without a GPU: part 1 on a 2-layer model, tiny shapes; parts 2-3 only with vllm
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402,F401 - first of ours: puts the lib/ folders on sys.path
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import memory  # noqa: E402

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def random_model_dir(name: str, work: str, dtype: torch.dtype, device: str, shrink_layers: int = 0) -> str:
    """A model folder from a carried config: random weights (initialised on `device`) and a
    word-level tokenizer over the whole vocabulary, so every token id round-trips."""
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
    cfg, _ = memory.config_for(name, hub=False)
    if shrink_layers:
        cfg = {**cfg, "num_hidden_layers": shrink_layers, "max_window_layers": shrink_layers}
    out = os.path.join(work, name.split("/")[-1] + ("-small" if shrink_layers else ""))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    del model
    eos = cfg["eos_token_id"][0] if isinstance(cfg["eos_token_id"], list) else cfg["eos_token_id"]
    vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  eos_token=f"t{eos}", pad_token=f"t{cfg.get('bos_token_id', 0)}")
    tok.save_pretrained(out)
    return out


def synthetic_groups(n: int, G: int, Lp: int, T: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_ids": torch.randint(3, vocab - 1, (Lp,), generator=g).tolist(), "policy_version": 0,
             "meta": {"temperature": 1.0},
             "completions": [{"token_ids": torch.randint(3, vocab - 1, (T,), generator=g).tolist(),
                              "logprobs": [-12.0] * T, "reward": float(i % 2)} for i in range(G)]}
            for _ in range(n)]


def trainer_check(model_dir: str, name: str, dtype: str, four_bit: bool, lay: memory.Layout, steps: int,
                  batch_groups: int, lora_r: int, device: str) -> dict:
    """train.build_model + train_step + clip + AdamW, as train.main does; step time and peak memory."""
    import train
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    args = train.Args(model=model_dir, dtype=dtype, load_in_4bit=four_bit, gradient_checkpointing="on",
                      batch_groups=batch_groups, micro_groups=lay.micro_groups, lora_r=lora_r, lora_alpha=2 * lora_r)
    model, _ = train.build_model(args)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    vocab = model.get_input_embeddings().num_embeddings
    times = []
    for s in range(steps + 1):  # the first step warms up (kernels, allocator) and is not timed
        groups = synthetic_groups(batch_groups, lay.group_size, lay.prompt_tokens, lay.new_tokens, vocab, s)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        st = train.train_step(model, groups, args, version=0, fresh_weights=False)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if s:
            times.append(time.time() - t0)
    arch = memory.Arch.from_config(json.load(open(os.path.join(model_dir, "config.json"))))
    pred = memory.trainer_memory(arch, memory.Trainer("bfloat16" if dtype == "auto" else dtype, four_bit, True, lora_r),
                                 lay, cuda=cuda)
    res = {"model": name, "dtype": dtype, "four_bit": four_bit, "lora_r": lora_r, "checkpointing": True,
           "batch_groups": batch_groups, "micro_groups": lay.micro_groups, "G": lay.group_size,
           "prompt_tokens": lay.prompt_tokens, "new_tokens": lay.new_tokens,
           "step_s_median": round(statistics.median(times), 3), "step_s": [round(t, 3) for t in times],
           "tokens_per_s": round(st["tokens"] / statistics.median(times), 1), "loss_finite": bool(st["loss"] == st["loss"]),
           "predicted_gib": round(pred["total"] / memory.GiB, 2)}
    if cuda:
        peak = torch.cuda.max_memory_reserved() / memory.GiB
        res.update({"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / memory.GiB, 2),
                    "peak_reserved_gib": round(peak, 2),
                    # the prediction includes the CUDA context, which torch's counters do not see
                    "predicted_over_reserved": round(pred["total"] / memory.GiB / (peak + memory.CUDA_OVERHEAD / memory.GiB), 2)})
    del model, opt, params
    return res


def vllm_checks(model_dir: str, work: str, P: int, G: int, NEW: int, swaps: int, res: dict) -> None:
    import hf_engine
    import vllm_engine
    import train
    from models import completion_logprobs
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg["vocab_size"] - 200, (int(n),), generator=g).tolist()
               for n in torch.randint(40, 120, (P,), generator=g)]
    # adapters: LoRA r=16 on all linear layers, B non-zero (as a trained adapter would be)
    adirs = []
    for v in range(1, swaps + 2):
        torch.manual_seed(v)
        m = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False))
        adirs.append(os.path.join(work, f"v{v:06d}"))
        m.save_pretrained(adirs[-1])
        del m
    t0 = time.time()
    eng = vllm_engine.VLLMSampler(model_dir, lora_rank=16, max_model_len=1024)
    res["vllm_engine_start_s"] = round(time.time() - t0, 1)
    eng.sample(prompts[:2], G, 8, 1.0)  # warm-up
    samples = {}
    for name in ("base", "lora"):
        if name == "lora":
            eng.swap_in({"version": 1, "dir": adirs[0]})
        torch.cuda.synchronize()
        t0 = time.time()
        samples[name] = out = eng.sample(prompts, G, NEW, 1.0)
        dt = time.time() - t0
        res[f"vllm_{name}_tokens_per_s"] = round(sum(len(o[0]) for o in out) / dt, 1)
        res[f"vllm_{name}_round_s"] = round(dt, 2)
    log(f"vLLM: {res['vllm_base_tokens_per_s']} tokens/s base, {res['vllm_lora_tokens_per_s']} with a LoRA")
    lat, add = [], []
    for v, d in enumerate(adirs[1:], start=2):
        t0 = time.time()
        eng.swap_in({"version": v, "dir": d})
        t1 = time.time()
        eng.sample(prompts[:1], 1, 1, 1.0)
        add.append(t1 - t0)
        lat.append(time.time() - t0)
        assert eng.loaded() == {eng.lora.lora_int_id}, eng.loaded()
    res["hot_swap_add_lora_s_p50"] = round(statistics.median(add), 4)
    res["hot_swap_to_first_token_s_p50"] = round(statistics.median(lat), 4)
    res["hot_swap_to_first_token_s_max"] = round(max(lat), 4)
    del eng
    torch.cuda.empty_cache()

    # 3. precision: version 1's samples, scored by the trainer's model with version 1's adapter
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    sub = samples["lora"][: 8 * G]  # the first 8 groups
    comps = [s[0] for s in sub]
    behav = [s[1] for s in sub]
    for dtype in ("bfloat16", "float32"):
        model, _ = train.build_model(train.Args(model=model_dir, dtype=dtype, lora_r=16, lora_alpha=32,
                                                gradient_checkpointing="off"))
        set_peft_model_state_dict(model, load_file(os.path.join(adirs[0], "adapter_model.safetensors")))
        with torch.no_grad():
            logp, mask = completion_logprobs(model, prompts[:8], comps, 1.0, pad=0)
        from models import pad_right
        b = pad_right(behav, 0.0, dtype=torch.float32)[0].to(logp.device)
        d = (logp - b)[mask.bool()]
        r = torch.exp(d)
        res[f"logprob_vllm_bf16_vs_trainer_{dtype}"] = {
            "tokens": int(mask.sum()), "mean_abs_diff": round(d.abs().mean().item(), 6),
            "max_abs_diff": round(d.abs().max().item(), 6), "onpolicy_ratio_mean": round(r.mean().item(), 6),
            "onpolicy_ratio_max_dev": round((r - 1).abs().max().item(), 6)}
        log(f"vLLM bf16 vs trainer {dtype}: {res[f'logprob_vllm_bf16_vs_trainer_{dtype}']}")
        del model
        torch.cuda.empty_cache()

    # the hf backend (hf_engine.sample builds its tensors on the default device)
    from models import load_base
    base, tok = load_base(model_dir, "bfloat16")
    torch.set_default_device("cuda")
    try:
        eos = {cfg["eos_token_id"]} if isinstance(cfg["eos_token_id"], int) else set(cfg["eos_token_id"])
        hf_engine.sample(base, prompts[:2], G, 8, 1.0, eos, tok.pad_token_id)  # warm-up
        torch.cuda.synchronize()
        t0 = time.time()
        out = hf_engine.sample(base, prompts, G, NEW, 1.0, eos, tok.pad_token_id)
        torch.cuda.synchronize()
        dt = time.time() - t0
        res["hf_bf16_tokens_per_s"] = round(sum(len(o[0]) for o in out) / dt, 1)
        res["vllm_over_hf"] = round(res["vllm_base_tokens_per_s"] / res["hf_bf16_tokens_per_s"], 2)
    except Exception as e:  # record it: the numbers above stay useful
        res["hf_error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        torch.set_default_device("cpu")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu_check_results.json"))
    p.add_argument("--budget-s", type=float, default=560, help="skip the 7B 4-bit step when less than 4 min are left")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128, help="vLLM rounds (part 2)")
    p.add_argument("--swaps", type=int, default=5)
    p.add_argument("--cpu-smoke", action="store_true", help="no GPU: part 1 on 2-layer models with tiny shapes")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not a.cpu_smoke:
        sys.exit("gpu_check: no CUDA device visible to torch (--cpu-smoke runs the trainer part here, tiny)")
    device = "cuda" if cuda else "cpu"
    res = {"gpu": torch.cuda.get_device_name(0) if cuda else "none (--cpu-smoke)", "torch": torch.__version__,
           "gpu_gib": round(torch.cuda.get_device_properties(0).total_memory / memory.GiB, 1) if cuda else None,
           "trainer": []}
    work = tempfile.mkdtemp(prefix="gpu-check-")
    log(f"work dir {work}; {res['gpu']}")
    if a.cpu_smoke:
        lay, shrink, steps, bg = memory.Layout(prompt_tokens=16, new_tokens=16, group_size=2, micro_groups=1), 2, 1, 2
    else:
        lay, shrink, steps, bg = memory.Layout(), 0, a.steps, 8

    def save() -> None:  # after every part: a run cut short by the 10-minute limit keeps what it measured
        res["wall_s"] = round(time.time() - T0, 1)
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(json.dumps(res, indent=1) + "\n")

    # 1. trainer, bf16
    for name in ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct"):
        d = random_model_dir(name, work, torch.bfloat16, device, shrink)
        r = trainer_check(d, name, "bfloat16", False, lay, steps, bg, 16, device)
        res["trainer"].append(r)
        log(f"trainer {json.dumps(r)}")
        save()

    # 2-3. vLLM, precision, hf backend
    try:
        import vllm
        res["vllm_version"] = vllm.__version__
    except Exception as e:
        res["vllm_error"] = f"vllm does not import: {e}"[:300]
    if cuda and "vllm_version" in res:
        gc.collect()
        torch.cuda.empty_cache()  # vLLM checks that its share of the GPU is free when it starts
        d = random_model_dir("Qwen/Qwen2.5-0.5B-Instruct", work, torch.bfloat16, device)
        try:
            vllm_checks(d, work, a.prompts, a.group_size, a.new_tokens, a.swaps, res)
        except Exception as e:  # record it: the 4-bit step below still runs
            res["vllm_checks_error"] = f"{type(e).__name__}: {e}"[:500]
        save()

    # 1b. trainer, 7B in 4-bit, if the time budget allows (15 GB of random bf16 weights go to disk first)
    left = a.budget_s - (time.time() - T0)
    if a.cpu_smoke:  # the 4-bit path (bitsandbytes' CPU backend) on the small 2-layer model
        d = random_model_dir("Qwen/Qwen2.5-0.5B-Instruct", work, torch.float32, device, shrink)
        res["trainer"].append(trainer_check(d, "Qwen/Qwen2.5-0.5B-Instruct", "float32", True, lay, steps, bg, 64, device))
    elif left > 240:
        gc.collect()
        torch.cuda.empty_cache()
        d = random_model_dir("Qwen/Qwen2.5-7B-Instruct", work, torch.bfloat16, device)
        try:
            r = trainer_check(d, "Qwen/Qwen2.5-7B-Instruct", "bfloat16", True, lay, steps, bg, 64, device)
            res["trainer"].append(r)
            log(f"trainer {json.dumps(r)}")
        except Exception as e:
            res["trainer_7b_4bit_error"] = f"{type(e).__name__}: {e}"[:500]
    else:
        res["trainer_7b_4bit_skipped"] = f"{left:.0f} s left of the budget"
    save()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

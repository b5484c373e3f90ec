"""One trainer update (train.learn) on a fixed batch, for every objective (and one with a KL term under
activation checkpointing, one on a 4-bit base), as one process or as N ranks under torchrun
(the base replicated, or sharded with --shard base); rank 0 writes what the update made: the gradients (after the
all-reduce and the clip), the gradient norm, the step's metrics and the adapter it would publish (what train.publish
saves). Then, once: the update on a batch with a group whose NaN reward makes the step fail (the ranks then hold
different numbers of micro-batches, and learn's per-group culprit search runs), and the audit's recompute under the
versions that sampled each group, with a group whose forward raises (so it recomputes group by group).
tests/test_trainer_ranks.py runs it every way.

    python tests/support/ranks_step.py TINY_MODEL OUT                                   # one process
    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 tests/support/ranks_step.py TINY_MODEL OUT replicate base
"""
from __future__ import annotations

import math
import sys
from dataclasses import replace
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


def poisoned(model) -> list[dict]:
    """batch() and a sixth group whose NaN reward makes the step's loss NaN: five trainable groups, three on rank 0."""
    return [*batch(model), group(model, 6, [1.0, math.nan, 0.0, 0.0], version=1)]


def audited(model) -> list[dict]:
    """batch() as participants' groups, and one carrying a token id past the vocabulary: its forward raises."""
    bad = group(model, 7, [1.0, 0.0, 1.0, 0.0])
    bad["completions"][0]["token_ids"][-1] = 10 ** 6
    return [{**g, "participant": "p"} for g in (*batch(model), bad)]


def trainer(args: train.Args, ranks) -> train.Trainer:
    """Rank 0's trainer with what learn() uses: the model, AdamW, the audit's judge; no proxy, no bucket."""
    torch.manual_seed(args.seed)
    model, tok = train.build_model(args, ranks)
    perturbed(model)
    params = [p for p in model.parameters() if p.requires_grad]
    # eps well above the gradients' float noise across ranks (~1e-8): AdamW's first step, lr * g / (|g| + eps), would
    # otherwise turn that noise in a near-zero gradient into up to a whole lr step, and the adapters compared below
    # would measure Adam's sensitivity rather than what the ranks publish
    opt = torch.optim.AdamW(params, lr=args.lr, eps=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    auditor = Auditor(args.audit, args.task, tok, None, None, args.micro_groups,
                      partial(train.group_temperature, default=args.temperature), partial(train.trainable, args=args),
                      dtype=resolve_dtype(args.dtype))
    auditor.lockstep = ranks if train.lockstep_model(model) else None  # (as train.start)
    return train.Trainer(args, None, None, None, None, model, params, opt, sched, auditor, 0, None, None, None,
                         step=0, version=2, since_publish=0, checkpointed=0, ranks=ranks)


def batches(args: train.Args) -> dict[str, list[dict]]:
    """The groups of every update and of the audit, their behaviour logprobs those of the trainer's starting weights,
    computed by a model of rank 0's own (a sharded model's forwards take every rank)."""
    torch.manual_seed(args.seed)
    model, _ = train.build_model(replace(args, shard="replicate"))
    perturbed(model)
    return {"batch": batch(model), "poisoned": poisoned(model), "audited": audited(model)}


def update(t: train.Trainer, groups: list[dict], out: Path, name: str) -> None:
    """learn() on `groups`; writes name.pt (gradients, norm, metrics) and the adapter under name/."""
    train.same_weights(t)
    st, norm = train.learn(t, {"fresh": groups, "batch_id": "b", "audit": {}})
    # four trainable groups; with a KL term (beta > 0) the zero-std group is trained too
    assert math.isfinite(norm) and st["groups/trained"] == (5 if t.args.beta > 0 else 4), (norm, st)
    grads = {n: p.grad.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}
    t.model.save_pretrained(out / name)
    quantized = sum(type(m).__name__ == "Linear4bit" for m in t.model.modules())  # bitsandbytes' NF4 projections
    torch.save({"grads": grads, "grad_norm": norm, "stats": st, "quantized": quantized}, out / f"{name}.pt")


def recomputed(t: train.Trainer, groups: list[dict], out: Path, name: str) -> None:
    """The audit's recompute of `groups` (audited()'s) under the versions that sampled them (0: the base; 1: the weights
    held, remembered as version 1; 2, held, for the groups the step does not train); writes name.pt."""
    t.auditor.weights.remember(1, t.model)
    failed: dict = {}
    devs, lost = t.auditor.recompute_each(t.model, groups, 2, True, failed)
    assert set(failed) == {"g00000007"} and len(devs) == 5 and not lost, (failed, devs, lost)
    torch.save({"devs": devs, "failed": failed}, out / f"{name}.pt")


def main(model_path: str, out: Path, shards: list[str]) -> None:
    ranks = train.join()
    for shard in shards:
        steps(ranks, model_path, out, shard)
    ranks.close()


def configurations(model_path: str, shard: str) -> dict[str, train.Args]:
    """Every objective, the first with a KL term to the base (beta > 0: a reference forward with the adapter off)
    under activation checkpointing (kl-ckpt), and, replicated only (train.py refuses to shard a 4-bit base), the first
    on a 4-bit NF4 base (4bit: each rank quantizes its own replica, bitsandbytes' CPU backend)."""
    base = train.Args(model=model_path, proxy_token="x", micro_groups=2, threads=1, max_grad_norm=0.5, shard=shard)
    named = {**{o: replace(base, loss=o) for o in OBJECTIVES},
             "kl-ckpt": replace(base, loss=OBJECTIVES[0], beta=0.04, gradient_checkpointing="on")}
    if shard != "base":
        named["4bit"] = replace(base, loss=OBJECTIVES[0], dtype="float32", load_in_4bit=True)
    return named


def steps(ranks, model_path: str, out: Path, shard: str) -> None:
    """Every update and the audit's recompute with --shard `shard`, written as NAME-WORLD[-base].pt."""
    tag = f"{ranks.world}" + ("-base" if shard == "base" else "")
    for name, args in configurations(model_path, shard).items():
        if not ranks.leader:
            train.follow(ranks, args)
            continue
        groups, t = batches(args), trainer(args, ranks)
        update(t, groups["batch"], out, f"{name}-{tag}")
        if name == OBJECTIVES[0]:
            update(t, groups["poisoned"], out, f"poisoned-{tag}")
            recomputed(t, groups["audited"], out, f"audit-{tag}")
        ranks.broadcast(None)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:] or ["replicate"])

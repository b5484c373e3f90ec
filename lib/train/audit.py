"""The trainer's audit of what participants send (docs/trust.md). The proxy checks what it can on arrival (a
group answers a prompt lease of its sender's, once, and is no replay: lib/proxy/receipts.py); what needs the
task, the tokenizer and the model is checked here, on every batch, before the step trains on it:

  prompt    the group's prompt_ids are the chat-formatted prompt the proxy leased it (its dataset, as the proxy
            recorded it, is this run's task; its index one of the task's);
  reward    each completion's reward is the task's own reward of its decoded text, or for an environment the
            score of its episode replayed (a --audit.reward-share of groups; by default all: decoding and the
            task's check cost milliseconds). What each kind of task allows (a library environment's episodes
            are not replayed: neither check is made) is lib/train/audit_tasks.py;
  logprobs  the behaviour logprobs are those of the version that sampled each token, recomputed with that
            version's LoRA weights (kept here for the last max_staleness + 1 versions, read from the bucket
            otherwise): a --audit.logprob-share of the groups the step trains, one forward each. Groups on-policy
            to the weights the trainer holds are checked in the step's own forward instead, every one of them
            (train.train_step asks `judge` before it forms their loss); a participant that failed any check (as the
            proxy counts them: `recall` after a restart) has every group checked. And every token the step trains,
            of every participant's group, is judged in that forward too (`judge`): off the trainer's logprob by
            more than the policy moves per version of staleness (--audit.max-drift, common.MAX_DRIFT), its group
            fails, whatever was drawn.

Only groups of participants (a `participant` in the leased group: a token other than the run's admin token)
are audited. A group that fails is left out of the step and reported (`POST /v1/batches/{id}/audit`): the
proxy counts it against its participant and past --quarantine-after suspends it; the groups of a suspended
participant still in the batch are left out too. Every limit is compared as `not (deviation <= limit)`: a NaN
deviation fails. What the audit costs is `perf/audit_s` in the trainer's
metrics; what it cannot check (that tokens were *sampled*, not chosen) is in docs/trust.md.
"""
from __future__ import annotations

import math
import random
import sys
import tempfile
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, replace

import httpx
import torch

from pydantic import ValidationError

from common import (MAX_DRIFT, AdapterError, BucketError, TrajectoryGroup, fetch_adapter, sampled_mask, token_id_problem,
                    token_versions)
from audit_tasks import Unreplayed, audited
from models import completion_logprobs, lora_views, pad_right
from proxy_client import ProxyClient, ProxyError


@dataclass
class Options:
    """The audit of participants' groups (train.py --audit.*)."""
    enabled: bool = True
    """audit the groups of participants (tokens other than the run's admin token; the run's own are never audited)"""
    reward_share: float = 1.0
    """share of their groups whose rewards are re-scored with the task's reward function"""
    logprob_share: float = 0.2
    """share of their groups the step trains on whose behaviour logprobs are recomputed under the version that
    sampled them (a forward each; groups on-policy to the trainer's weights are all checked in its own forward, at
    no cost; a group the step leaves out has no gradient to steer; a participant that failed a check: every group)"""
    max_dev_mean: float | None = None
    """a group fails when its mean |sent - recomputed logprob| over its sampled tokens is above this (None: by the
    dtype the trainer computes in, LIMITS: 1e-3 in float32, 2.5e-2 in bfloat16 or float16)"""
    max_dev_token: float | None = None
    """... or when one token's is above this (None: 0.05 in float32, 0.1 in bfloat16 or float16)"""
    max_drift: float = MAX_DRIFT
    """a group the step trains fails when one of its tokens' |behaviour logprob - the trainer's logprob| in the
    step's own forward is above this many nats per version of staleness (the version that sampled the token to the
    weights the trainer holds; at least 1): an honest token's is the policy's drift, measured in docs/trust.md.
    Every token of every participant's group is judged, at no cost; raise it for a policy that moves faster (a
    larger --lr)"""
    reward_tol: float = 1e-6
    """a re-scored reward may differ from the one sent by this much"""


def nan_max(a: float, b: float) -> float:
    """max(a, b) where a NaN wins (Python's max keeps its first argument when compared with a NaN)."""
    return a if math.isnan(a) or b <= a else b


def versions_sampled(g: dict) -> set[int]:
    """The adapter versions that sampled a group's tokens (its policy_version, or its completions' runs)."""
    return {v for c in g["completions"] for v, m in zip(token_versions(c, g["policy_version"]), sampled_mask(c)) if m}


LEASE_FIELDS = ("prompt_dataset", "participant")  # what the proxy adds to a group it leases out (wire.LeasedGroup)


def group_problem(g: dict, vocab_size: int) -> str | None:
    """Why the trainer cannot train on a leased group (None: it can): the schema it was sent in (common.TrajectoryGroup,
    checked again on what the proxy hands out, so that no group its journal holds from before a rule was added, or
    that the rule missed, reaches the step), and token ids the model has (token_id_problem)."""
    try:
        TrajectoryGroup.model_validate({k: v for k, v in g.items() if k not in LEASE_FIELDS})
    except ValidationError as e:
        first = e.errors()[0]
        return f"{'.'.join(map(str, first['loc'])) or 'group'}: {first['msg']}"
    return token_id_problem(g["prompt_ids"], [c["token_ids"] for c in g["completions"]], vocab_size)


def sender(g: dict) -> str:
    """Who sent a group, for the log: its participant (or the run's own token) and its worker."""
    who = f"participant {g['participant']!r}" if g.get("participant") else "the run's own token"
    return f"{who}, worker {str(g.get('worker_id'))[:128]!r}"


class Weights:
    """The LoRA tensors of recent versions, to recompute logprobs under the very version that sampled them:
    those this trainer published (the last `keep`, a few MB each), others read from the bucket and checked
    against their meta.json (a restarted trainer, a version of a trainer before it). Version 0 is the base
    model: every LoRA tensor zero."""

    def __init__(self, bucket, keep: int = 4):
        self.bucket, self.keep, self.kept = bucket, keep, OrderedDict()

    def remember(self, version: int, model) -> None:
        """The weights `model` holds are version `version`'s (just published)."""
        self._keep(version, {k: t.detach().to("cpu", copy=True) for k, t in lora_views(model).items()})

    def _keep(self, version: int, tensors: dict) -> dict:
        self.kept[version] = tensors
        self.kept.move_to_end(version)
        while len(self.kept) > self.keep:
            self.kept.popitem(last=False)
        return tensors

    def get(self, version: int, model) -> dict | None:
        """Version `version`'s tensors, or None when the bucket has no such version that verifies."""
        if version in self.kept:
            return self.kept[version]
        if version == 0:
            return self._keep(0, {k: torch.zeros_like(t, device="cpu") for k, t in lora_views(model).items()})
        from safetensors.torch import load_file
        try:
            with tempfile.TemporaryDirectory() as d:
                fetch_adapter(self.bucket, version, d)
                return self._keep(version, load_file(f"{d}/adapter_model.safetensors"))
        except (AdapterError, BucketError) as e:
            print(f"audit: version {version} cannot be read back ({e}): its groups' logprobs go unchecked", file=sys.stderr)
            return None

    @contextmanager
    def swapped(self, model, tensors: dict):
        """`model` computing with `tensors` inside the block, its own weights restored bit for bit after."""
        live = lora_views(model)
        if set(tensors) != set(live):
            raise AdapterError(f"another LoRA layout ({len(tensors)} tensors, this model has {len(live)})")
        mine = {k: t.detach().clone() for k, t in live.items()}
        try:
            with torch.no_grad():
                for k, t in live.items():
                    t.copy_(tensors[k])
            yield model
        finally:
            with torch.no_grad():
                for k, t in live.items():
                    t.copy_(mine[k])


# --audit.max-dev-mean and --audit.max-dev-token where not given, by the dtype the trainer computes in: each well
# above the hf engine's floor in that dtype (bench/audit_floor.py, docs/trust.md). float32: 2.3e-6 mean, 1.6e-5
# a token on CPU (4.3e-7 and 1.9e-6 on an H200). bfloat16 on an H200: 4.6e-3 mean (worst group 5.1e-3), 0.025 a
# token; the float32 limits would fail every honest group of a bf16 worker. Made-up logprobs are off by tenths
LIMITS = {torch.float32: (1e-3, 0.05), torch.bfloat16: (2.5e-2, 0.1), torch.float16: (2.5e-2, 0.1)}


def with_limits(opts: Options, dtype: torch.dtype) -> Options:
    """opts with the logprob limits it leaves open (None) set for `dtype` (LIMITS)."""
    mean, token = LIMITS.get(dtype, LIMITS[torch.bfloat16])
    return replace(opts, max_dev_mean=mean if opts.max_dev_mean is None else opts.max_dev_mean,
                   max_dev_token=token if opts.max_dev_token is None else opts.max_dev_token)


class Auditor:
    def __init__(self, opts: Options, task: str, tok, bucket, client: ProxyClient, micro_groups: int,
                 temperature_of, trains, say=print, dtype: torch.dtype = torch.float32):
        """temperature_of(group): the temperature train_step scores it at (None: it cannot); trains(group): whether
        train_step trains on it (its on-policy tokens are then checked in that forward). dtype: the one the trainer
        computes in (the logprob limits opts leaves open follow it)."""
        opts = with_limits(opts, dtype)
        self.opts, self.task_name, self.tok, self.client, self.say = opts, task, tok, client, say
        self.micro, self.temperature_of, self.trains = max(1, micro_groups), temperature_of, trains
        self.weights = Weights(bucket)
        self.rng = random.SystemRandom()  # which groups are audited: nothing a participant can predict
        self.suspects: set[str] = set()    # participants with a failed check: every group of theirs is audited
        self._task = None
        # rank 0's ranks (lib/train/ranks.py) when the base is sharded over them: each recompute's forwards are then
        # run by every rank (broadcast here, run by the others' follow_recompute), rank 0 alone using the result
        self.lockstep = None

    def recall(self) -> None:
        """The participants the proxy counts a failed check against (since the owner last reinstated them) are
        suspects again: a restarted trainer audits every group of theirs, as the trainer before it did. The
        proxy's journal holds the failures, so the suspicion survives any restart of either role."""
        if not self.opts.enabled:
            return
        try:
            people = self.client.get("/v1/stats").get("participants", {})
        except (ProxyError, httpx.HTTPError) as e:  # a token that may not read /v1/stats (or SIGTERM): the audit
            # responses bring them back, each with its next group
            self.say(f"audit: the participants' standing cannot be read ({e}): suspects are learnt again as they fail")
            return
        again = {who for who, p in people.items() if (p.get("checks") or {}).get("failed")}
        if again - self.suspects:
            self.say(f"audit: every group of {', '.join(sorted(again - self.suspects))} is audited (failed checks before)")
        self.suspects |= again

    @property
    def task(self):
        """The run's task as the audit checks it (audit_tasks.audited). Loaded at the trainer's start (train.open_dataset)
        or else at the first participant's group."""
        if self._task is None:
            self._task = audited(self.task_name, self.tok)
            if isinstance(self._task, Unreplayed):
                self.say(f"audit: {self._task.why}")
        return self._task

    # ---- the checks ----------------------------------------------------------------------------------
    def prompt_problem(self, g: dict) -> str | None:
        task, ds, i = self.task, g.get("prompt_dataset"), g.get("prompt_index")
        if task.name is None:  # a library environment's: the proxy's checks on arrival only (audit_tasks)
            return None
        if ds != task.name or not isinstance(i, int):
            return f"it answers a prompt of dataset {ds!r} (lease {g.get('lease_id')}), this run's task is {task.name!r}"
        if not 0 <= i < task.size:
            return f"prompt index {i} is not one of task {task.name}'s {task.size}"
        if g["prompt_ids"] != (want := task.prompt_ids(i)):
            return (f"its prompt_ids ({len(g['prompt_ids'])} tokens) are not the chat-formatted prompt {i} it was leased "
                    f"({len(want)} tokens)")
        return None

    def reward_problem(self, g: dict) -> str | None:
        for k, c in enumerate(g["completions"]):
            r, why = self.task.rescore(c, g["prompt_index"])
            if why is not None:
                return f"completion {k}: {why}"
            if r is not None and not (abs(r - c["reward"]) <= self.opts.reward_tol):  # (NaN: not within)
                return f"completion {k} claims reward {c['reward']:g}; the task's reward of it is {r:g}"
        return None

    def deviation(self, dev_sum: float, dev_max: float, n: int) -> str | None:
        mean = dev_sum / max(n, 1)
        # written as "not within": a NaN deviation (logprobs that overflow) fails, where "NaN > limit" would pass it
        if not (mean <= self.opts.max_dev_mean and dev_max <= self.opts.max_dev_token):
            return (f"its behaviour logprobs differ from those recomputed under the version that sampled them by "
                    f"{mean:.2e} on average over {n} sampled tokens, {dev_max:.2e} at most (limits "
                    f"{self.opts.max_dev_mean:g}, {self.opts.max_dev_token:g})")
        return None

    def swapped_versions(self, groups: list[dict], version: int, fresh: bool) -> set[int]:
        """The versions whose weights recompute() swaps in for `groups`: every one that sampled a token of theirs but
        the one the model holds (`version`, when `fresh`)."""
        return {v for g in groups for v in versions_sampled(g)} - ({version} if fresh else set())

    def follow_recompute(self, model, order: dict) -> None:
        """A rank other than 0 runs rank 0's recompute with it, on a sharded base (the order recompute_each
        broadcasts: the groups and the weights of every version it swaps in); rank 0 alone uses the result."""
        self.weights.kept = OrderedDict(order["weights"])  # (None: a version rank 0 could not read back)
        self.weights.keep = len(self.weights.kept) + 1
        self.recompute_each(model, order["recompute"], order["version"], order["fresh"], {})

    def recompute(self, model, groups: list[dict], version: int, fresh: bool) -> tuple[dict[str, list], int]:
        """{group_id: [sum |dev|, max |dev|, tokens]} over each group's sampled tokens, each under the version that
        sampled it; and how many groups had a version whose weights are gone."""
        acc = {g["group_id"]: [0.0, 0.0, 0] for g in groups}
        need: dict[int, list[dict]] = {}
        for g in groups:
            for v in versions_sampled(g):
                need.setdefault(v, []).append(g)
        lost = set()
        for v in sorted(need, key=lambda v: (not (fresh and v == version), v)):  # the weights we hold first: no swap
            if fresh and v == version:
                # a group the step trains has these tokens judged by its own forward (onpolicy): a group begun with
                # an older version and finished with ours (a mid-round swap) is recomputed for the older one only
                if rest := [g for g in need[v] if not self.trains(g)]:
                    self._compare(model, rest, v, acc)
                continue
            tensors = self.weights.get(v, model)
            if tensors is None:
                lost |= {g["group_id"] for g in need[v]}
                continue
            with self.weights.swapped(model, tensors):
                self._compare(model, need[v], v, acc)
        return acc, len(lost)

    def _compare(self, model, groups: list[dict], v: int, acc: dict) -> None:
        for s in range(0, len(groups), self.micro):
            mb = [g for g in groups[s:s + self.micro] if self.temperature_of(g) is not None]
            if not mb:
                continue
            comps = [c for g in mb for c in g["completions"]]
            temps = [self.temperature_of(g) for g in mb for _ in g["completions"]]
            ours = [[int(m and t == v) for t, m in zip(token_versions(c, g["policy_version"]), sampled_mask(c))]
                    for g in mb for c in g["completions"]]
            # each completion up to its last token of version v: what a newer version sampled after a mid-round
            # swap is judged under that version (or by the step's own forward), so it need not be computed here
            cut = [max(1, max((i + 1 for i, x in enumerate(row) if x), default=0)) for row in ours]
            with torch.no_grad():
                logp, mask = completion_logprobs(model, [g["prompt_ids"] for g in mb],
                                                 [c["token_ids"][:k] for c, k in zip(comps, cut)], temps, pad=0)
            sent = pad_right([[0.0 if x is None else x for x in c["logprobs"][:k]] for c, k in zip(comps, cut)], 0.0,
                             dtype=torch.float32)[0]
            mine = pad_right([row[:k] for row, k in zip(ours, cut)], 0)[0].bool()
            dev = torch.where(mask.cpu().bool() & mine, (logp.float().cpu() - sent).abs(), 0.0)  # a NaN stays one
            G = len(mb[0]["completions"])
            for j, g in enumerate(mb):
                rows, a = slice(j * G, (j + 1) * G), acc[g["group_id"]]
                a[0] += dev[rows].sum().item()
                a[1] = nan_max(a[1], dev[rows].max().item())
                a[2] += int((mask.cpu().bool() & mine)[rows].sum())

    # ---- a batch -------------------------------------------------------------------------------------
    def screen(self, got: dict, groups: list[dict], vocab_size: int) -> list[dict]:
        """The groups of a leased batch the trainer can train on at all (group_problem), whoever sent them; each
        other one is left out, logged with its sender, and counted against its participant (check `invalid`)."""
        bad = {g["group_id"]: ("invalid", why) for g in groups if (why := group_problem(g, vocab_size))}
        return self.report(got["batch_id"], [], bad, groups) if bad else groups

    def _first_checks(self, g: dict) -> tuple[str, str] | None:
        """The prompt check, then (drawn, or every group of a suspect) the reward check: the failed one and why."""
        if why := self.prompt_problem(g):
            return "prompt", why
        if (g["participant"] in self.suspects or self.rng.random() < self.opts.reward_share) and (why := self.reward_problem(g)):
            return "reward", why
        return None

    def recompute_each(self, model, groups: list[dict], version: int, fresh: bool, failed: dict) -> tuple[dict, int]:
        """recompute(), and where the batch's forward raises, group by group: a group whose own forward raises fails
        (check `invalid`) and the others are judged as ever. On a sharded base every rank runs the same forwards on
        the same groups (follow_recompute), so a group's forward raises on every rank alike and they fall back together;
        after each such error the ranks meet once (peers_alive), so that a rank gone is not blamed on a group."""
        if self.lockstep is not None and self.lockstep.leader and groups:
            weights = {v: self.weights.get(v, model) for v in sorted(self.swapped_versions(groups, version, fresh))}
            self.lockstep.broadcast({"recompute": groups, "version": version, "fresh": fresh, "weights": weights})
        try:
            return self.recompute(model, groups, version, fresh)
        except Exception:  # noqa: BLE001 - one of them; which is found below
            self.peers_alive()
            devs, lost = {}, 0
            for g in groups:
                try:
                    d, n = self.recompute(model, [g], version, fresh)
                    devs.update(d)
                    lost += n
                except Exception as e:  # noqa: BLE001 - what the group carries made its forward raise
                    self.peers_alive()
                    failed[g["group_id"]] = ("invalid", f"recomputing its logprobs raised {type(e).__name__}: {e}")
            return devs, lost

    def peers_alive(self) -> None:
        """On a sharded base: every rank meets here after a recompute raised (ranks.RanksLost when one is gone: the
        error was its, not a group's)."""
        if self.lockstep is not None:
            self.lockstep.gather(None)

    def check(self, got: dict, groups: list[dict], model, version: int, fresh: bool) -> tuple[list[dict], dict]:
        """The groups of a leased batch to train on, and the audit's metrics. `fresh`: the model holds exactly
        version `version`'s weights (nothing trained since it was published)."""
        theirs = [g for g in groups if g.get("participant")] if self.opts.enabled else []
        if not theirs:
            return groups, {}
        t0, failed = time.perf_counter(), {}
        for g in theirs:
            try:
                if verdict := self._first_checks(g):
                    failed[g["group_id"]] = verdict
            except Exception as e:  # noqa: BLE001 - decoding or the task's reward of what it carries raised
                failed[g["group_id"]] = ("invalid", f"checking its prompt and rewards raised {type(e).__name__}: {e}")
        # the step's own forward checks, for free, the groups it trains whose every token the weights we hold sampled;
        # of the others a share is drawn among those it trains: the logprobs of a group it leaves out (rewards all
        # equal: advantage 0, no gradient whatever they say) cannot steer the update. A suspect's are all audited.
        free = lambda g: fresh and self.trains(g) and versions_sampled(g) == {version}  # noqa: E731
        audit = [g for g in theirs if g["group_id"] not in failed and not free(g)
                 and (g["participant"] in self.suspects or (self.trains(g) and self.rng.random() < self.opts.logprob_share))]
        devs, lost = self.recompute_each(model, audit, version, fresh, failed)
        worst = [0.0, 0.0]
        for gid, (s, mx, n) in devs.items():
            worst = [nan_max(worst[0], s / max(n, 1)), nan_max(worst[1], mx)]
            if why := self.deviation(s, mx, n):
                failed[gid] = ("logprobs", why)
        kept = self.report(got["batch_id"], [g["group_id"] for g in theirs], failed, groups)
        row = {"audit/groups": len(theirs), "audit/failed": len(failed), "audit/logprob_groups": len(devs),
               "audit/onpolicy_groups": sum(map(free, theirs)), "audit/logprob_unavailable": lost,
               "audit/logprob_dev_mean_max": worst[0], "audit/logprob_dev_max": worst[1],
               "audit/left_out": len(groups) - len(kept), "perf/audit_s": time.perf_counter() - t0,
               **{f"audit/failed_{c}": [x for x, _ in failed.values()].count(c) for c in ("prompt", "reward", "logprobs")}}
        return kept, row

    def judge(self, g: dict, onpolicy: tuple[float, float, int] | None, drift: float) -> str | None:
        """The step's own forward's verdict on a group it is about to train on (train.train_step asks before it forms
        the loss; train.learn reports a failure as the `logprobs` check): why it fails, or None. onpolicy: (sum, max,
        count) of |logprob - behaviour logprob| over its tokens the weights the trainer holds sampled (None: none, or
        the weights moved since they were published), judged at the audit's limits; drift: the largest over every
        token the step trains of it of that |difference| per version of staleness, judged at --audit.max-drift (what
        the policy moves a token's logprob per version; NaN fails). Only participants' groups are judged, as only
        theirs are audited."""
        if not (self.opts.enabled and g.get("participant")):
            return None
        if onpolicy is not None and (why := self.deviation(*onpolicy)):
            return why
        if not (drift <= self.opts.max_drift):
            return (f"one of its behaviour logprobs differs from the trainer's by {drift:.3g} nats per version of "
                    f"staleness, more than the policy moves (--audit.max-drift {self.opts.max_drift:g})")
        return None

    def report(self, batch_id: str, checked: list[str], failed: dict[str, tuple], groups: list[dict]) -> list[dict]:
        """Tell the proxy; returns the groups left to train on (not failed, not of a participant now quarantined)."""
        held, by_id = set(), {g["group_id"]: g for g in groups}
        for gid, (check, why) in failed.items():
            if who := by_id[gid].get("participant"):
                self.suspects.add(who)
            self.say(f"audit: group {gid} of {sender(by_id[gid])} failed the {check} check: {why[:2000]}; left out")
        # the run's own groups (the admin token) are logged, not reported: the proxy counts failures of participants only
        theirs = [(g, c, w) for g, (c, w) in failed.items() if by_id[g].get("participant")]
        body = {"checked": checked, "failures": [{"group_id": g, "check": c, "detail": w[:2000]} for g, c, w in theirs]}
        try:
            answer = self.client.post(f"/v1/batches/{batch_id}/audit", body) if checked or theirs else {"participants": {}}
            for who, p in answer["participants"].items():
                if p["quarantined"]:
                    held.add(who)
                if p["failed"]:
                    self.suspects.add(who)
        except ProxyError as e:
            self.say(f"audit: report on batch {batch_id} refused: {e}")
        except httpx.HTTPError as e:  # stopping: the groups are left out all the same
            self.say(f"audit: report on batch {batch_id} not delivered ({type(e).__name__})")
        for who in held:
            self.say(f"audit: participant {who!r} is quarantined now: its groups in this batch are left out")
        return [g for g in groups if g["group_id"] not in failed and g.get("participant") not in held]

"""Each limit the trainer's audit compares, just inside and just outside (docs/trust.md), in each dtype the trainer may
compute in: the recompute's mean and token limits (lib/train/audit.py LIMITS, by dtype), the same limits on the
tokens the step's own forward judges on-policy, the drift bound on every token it trains (--audit.max-drift,
common.MAX_DRIFT, per version of staleness), the reward tolerance in both directions (a reward lowered to 0 too),
and a NaN, which fails every one. The limits are read from the code under test; the groups carry the tiny model's
own logprobs, computed by the trainer's forward in that dtype, so each deviation is exactly the one made here. And
the draws: a participant that failed a check has every group re-scored and recomputed, whatever the shares."""
import math

import pytest
import torch

import train
from audit import Auditor, Options
from models import completion_logprobs, encode_prompt, resolve_dtype
from tasks import load_task

DTYPES = ["float32", "bfloat16", "float16"]
TASK = load_task("addition")


class AuditReports:
    """The proxy as the audit reports to it, in process: each report recorded, no participant quarantined (the proxy's
    own answers: tests/test_trust.py)."""

    def __init__(self):
        self.sent: list[tuple[str, dict]] = []

    def post(self, path: str, body: dict) -> dict:
        self.sent.append((path, body))
        return {"participants": {}}


def judged_by_the_step(model, groups: list[dict], args, version: int, auditor, devs: dict | None = None,
                       fresh: bool = True) -> dict:
    """train.train_step with the audit's judge, as train.learn asks it: {group_id: why} of the groups its forward
    leaves out."""
    verdicts = train.Verdicts(auditor.judge)
    model.zero_grad(set_to_none=True)
    train.train_step(model, groups, args, version, fresh, devs, verdicts)
    return {gid: why for gid, (_, why) in verdicts.failed.items()}


@pytest.fixture(scope="module", params=DTYPES)
def trainer(request, tiny_model):
    """The trainer's model in one dtype, its Auditor (the limits that dtype gets), and train.Args."""
    args = train.Args(model=tiny_model, dtype=request.param, skip_zero_std=False)
    torch.manual_seed(0)
    model, tok = train.build_model(args)
    auditor = Auditor(Options(), "addition", tok, None, AuditReports(), 2, lambda g: 1.0, lambda g: True,
                      say=lambda s: None, dtype=resolve_dtype(request.param))
    return model, tok, auditor, args


def honest(model, tok, n_tok: int = 40, version: int = 0, gid: str = "g") -> dict:
    """A participant's group of 4 completions of n_tok tokens whose behaviour logprobs are the trainer's own forward
    under the weights the model holds (version 0's: the LoRA's B is still 0), in the model's dtype."""
    gen = torch.Generator().manual_seed(7)
    prompt = encode_prompt(tok, TASK.prompts[3])
    comps = [torch.randint(10, 2000, (n_tok,), generator=gen).tolist() for _ in range(4)]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, [prompt], comps, 1.0, pad=0)
    return {"group_id": gid, "worker_id": "w", "policy_version": version, "prompt_ids": prompt, "participant": "p",
            "prompt_dataset": "addition", "prompt_index": 3, "lease_id": "l" * 8, "meta": {"temperature": 1.0},
            "completions": [{"token_ids": c, "logprobs": lp[:n_tok].tolist(), "reward": float(k % 2), "finish_reason": "length"}
                            for k, (c, lp) in enumerate(zip(comps, logp))]}


def off(g: dict, by: float, every: bool = False) -> dict:
    """g with its behaviour logprobs lowered by `by`: every token's, or one token's (completion 1, token 5)."""
    comps = []
    for k, c in enumerate(g["completions"]):
        lps = [x - by if every or (k, t) == (1, 5) else x for t, x in enumerate(c["logprobs"])]
        comps.append({**c, "logprobs": lps})
    return {**g, "completions": comps}


def test_the_recompute_holds_each_limit_just_inside_and_fails_just_outside(trainer):
    """The audit's recompute (a stale group, under the version that sampled it): mean |difference| 0.9 and 1.1 of
    --audit.max-dev-mean, one token 0.9 and 1.1 of --audit.max-dev-token, one token NaN."""
    model, tok, auditor, _ = trainer
    mean, token = auditor.opts.max_dev_mean, auditor.opts.max_dev_token
    g = honest(model, tok)
    n = sum(len(c["token_ids"]) for c in g["completions"])
    assert 1.1 * token / n < 0.5 * mean  # one token off by 1.1 of the token limit leaves the mean well inside its own

    def verdict(group: dict) -> str | None:
        devs, lost = auditor.recompute(model, [group], 1, fresh=False)  # version 0's weights: swapped in, the same
        assert lost == 0
        return auditor.deviation(*devs[group["group_id"]])
    assert verdict(g) is None
    assert verdict(off(g, 0.9 * mean, every=True)) is None
    why = verdict(off(g, 1.1 * mean, every=True))
    assert why and "on average" in why, why
    assert verdict(off(g, 0.9 * token)) is None
    why = verdict(off(g, 1.1 * token))
    assert why and f"{1.1 * token:.2e} at most" in why, why
    assert verdict(off(g, math.nan)) is not None  # "NaN > limit" is False: the comparison is "not within"


def test_the_steps_forward_holds_the_on_policy_limits_just_inside_and_fails_just_outside(trainer):
    """A group the weights the trainer holds sampled (staleness 0, nothing trained since): judged by the step's own
    forward at the audit's limits, before its loss is formed; the same four cases and a NaN."""
    model, tok, auditor, args = trainer
    mean, token = auditor.opts.max_dev_mean, auditor.opts.max_dev_token
    g = honest(model, tok)
    cases = {"honest": (g, False), "mean 0.9": (off(g, 0.9 * mean, every=True), False),
             "mean 1.1": (off(g, 1.1 * mean, every=True), True), "token 0.9": (off(g, 0.9 * token), False),
             "token 1.1": (off(g, 1.1 * token), True), "NaN": (off(g, math.nan), True)}
    for name, (group, fails) in cases.items():
        out = judged_by_the_step(model, [{**group, "group_id": name}], args, 0, auditor)
        assert (name in out) == fails, (name, out)


def test_the_drift_bound_holds_just_inside_and_fails_just_outside_per_version_of_staleness(trainer):
    """Every token the step trains, of a group 1 or 2 versions stale (the on-policy limits do not apply): one token off
    by 0.9 and 1.1 of --audit.max-drift per version of staleness; a NaN. The honest group passes at both."""
    model, tok, auditor, args = trainer
    bound = auditor.opts.max_drift
    for lag in (1, 2):
        g = honest(model, tok)
        assert not judged_by_the_step(model, [g], args, lag, auditor)
        assert not judged_by_the_step(model, [off(g, 0.9 * bound * lag)], args, lag, auditor)
        out = judged_by_the_step(model, [off(g, 1.1 * bound * lag)], args, lag, auditor)
        assert "per version of staleness" in out.get("g", ""), (lag, out)
        assert judged_by_the_step(model, [off(g, math.nan)], args, lag, auditor)
    # a token of the version the trainer holds, its weights moved since (publish_every > 1): a step behind at most
    g = honest(model, tok)
    assert not judged_by_the_step(model, [off(g, 0.9 * bound)], args, 0, auditor, fresh=False)
    assert judged_by_the_step(model, [off(g, 1.1 * bound)], args, 0, auditor, fresh=False)


@pytest.mark.parametrize("lie_by", ["drift", "NaN"])
def test_the_step_trains_the_rest_as_if_the_judged_group_had_never_been_there(tiny_model, lie_by):
    """A group the forward leaves out takes no part in the gradient, and the others' weights are those of a batch
    without it: the gradient equals the one of the batch without it (micro-batches of 1 and of 3, both losses; and
    every group over --micro-tokens, so run a row at a time and judged after its backward: its gradient taken back,
    a NaN one too)."""
    for agg in ("token", "grpo"):
        for micro, tokens in ((1, None), (3, None), (3, 1)):
            args = train.Args(model=tiny_model, skip_zero_std=False, micro_groups=micro, loss_agg=agg,
                              micro_tokens=tokens)
            torch.manual_seed(0)
            model, tok = train.build_model(args)
            auditor = Auditor(Options(), "addition", tok, None, AuditReports(), 2, lambda g: 1.0, lambda g: True,
                              say=lambda s: None)
            a, b = honest(model, tok, 6, gid="a"), honest(model, tok, 9, gid="b")
            b["completions"] = [{**c, "reward": float(k == 0)} for k, c in enumerate(b["completions"])]
            lie = off(honest(model, tok, 8), 3 * auditor.opts.max_drift if lie_by == "drift" else math.nan)
            out = judged_by_the_step(model, [a, {**lie, "group_id": "lie"}, b], args, 1, auditor)
            assert set(out) == {"lie"}
            with_lie = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
            assert not judged_by_the_step(model, [a, b], args, 1, auditor)
            without = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
            assert torch.isfinite(without).all() and without.abs().max() > 0
            assert torch.allclose(with_lie, without, atol=1e-7, rtol=1e-5), (agg, micro, tokens)


def answered(tok, i: int, texts: list[str], rewards: list[float], gid: str, participant: str = "p") -> dict:
    """A participant's group answering addition prompt i with `texts`, claiming `rewards` (logprobs made up)."""
    comps = []
    for k, (text, r) in enumerate(zip(texts, rewards)):
        ids = tok.encode(text, add_special_tokens=False)
        comps.append({"token_ids": ids, "logprobs": [-0.05 - 0.01 * k] * len(ids), "reward": r, "finish_reason": "stop"})
    return {"group_id": gid, "worker_id": "w", "policy_version": 0, "prompt_ids": encode_prompt(tok, TASK.prompts[i]),
            "participant": participant, "prompt_dataset": "addition", "prompt_index": i, "lease_id": "l" * 8,
            "meta": {"temperature": 1.0}, "completions": comps}


def test_every_reward_is_rescored_a_lowered_one_too_within_the_tolerance_either_way(tiny_model):
    """The audit's own decision (Auditor.check) at the default --audit.reward-share (1: every group): a right answer
    claimed as 0 fails as an inflated one does; a claim off by 0.9 of --audit.reward-tol either way passes, 1.1 fails."""
    model, tok = train.build_model(train.Args(model=tiny_model))
    i = 5
    right, wrong = TASK.answers[i], str(int(TASK.answers[i]) + 1)
    texts = [right, wrong, f"It is {right}.", wrong]
    truth = [TASK.reward(t, i)[0] for t in texts]
    assert truth == [1.0, 0.0, 1.0, 0.0]
    tol = Options().reward_tol

    def fails(claims: list[float]) -> bool:
        auditor = Auditor(Options(logprob_share=0.0), "addition", tok, None, AuditReports(), 2, lambda g: 1.0,
                          lambda g: True, say=lambda s: None)
        kept, row = auditor.check({"batch_id": "b"}, [answered(tok, i, texts, claims, "g")], model, 1, fresh=False)
        assert row["audit/failed"] == row["audit/failed_reward"] == (not kept), row
        return not kept
    assert not fails(truth)
    assert fails([0.0, 0.0, 1.0, 0.0])                      # a right answer's reward lowered to 0
    assert fails([1.0, 1.0, 1.0, 0.0])                      # a wrong one's raised to 1
    for k in range(4):
        for sign in (1, -1):
            near = [r + sign * 0.9 * tol if j == k else r for j, r in enumerate(truth)]
            far = [r + sign * 1.1 * tol if j == k else r for j, r in enumerate(truth)]
            assert not fails(near) and fails(far), (k, sign)
    assert fails([math.nan, 0.0, 1.0, 0.0])


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_a_suspect_is_rescored_and_recomputed_every_time_whatever_the_shares(tiny_model, share):
    """--audit.reward-share and --audit.logprob-share below 1: a participant that failed a check (a suspect) has every
    group's rewards re-scored and logprobs recomputed, its groups the step does not train too; another participant's
    are drawn (at 0, none). Sixteen groups each way."""
    model, tok = train.build_model(train.Args(model=tiny_model))
    auditor = Auditor(Options(reward_share=share, logprob_share=share), "addition", tok, None, AuditReports(), 2,
                      lambda g: 1.0, lambda g: False, say=lambda s: None)  # (trains nothing: a suspect's all the same)
    auditor.suspects.add("mallory")
    inflated = lambda k, who: answered(tok, k, ["7", "8", "9", "10"], [1.0] * 4, f"{who}{k}", who)  # noqa: E731
    made_up = lambda k, who: answered(tok, k, ["7", "8", "9", "10"],  # noqa: E731 - honest rewards, logprobs made up
                                      [TASK.reward(t, k)[0] for t in ["7", "8", "9", "10"]], f"{who}-lp{k}", who)
    for k in range(16):
        kept, row = auditor.check({"batch_id": f"b{k}"}, [inflated(k, "mallory"), made_up(k, "mallory")], model, 1,
                                  fresh=False)
        assert not kept and row["audit/failed_reward"] == 1 and row["audit/failed_logprobs"] == 1, (k, row)
    if share == 0.0:  # another participant's are not drawn at all
        kept, row = auditor.check({"batch_id": "c"}, [inflated(0, "guest"), made_up(0, "guest")], model, 1, fresh=False)
        assert len(kept) == 2 and row["audit/failed"] == 0 and row["audit/logprob_groups"] == 0, row

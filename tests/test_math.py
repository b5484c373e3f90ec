"""GRPO advantages, zero-std groups and the three policy objectives against numbers computed by hand
(values and gradients), and the shared-prefix logprobs against a plain forward."""
import math

import pytest
import torch

from common import OBJECTIVES, group_advantages, grpo_loss, zero_std_groups
from models import completion_logprobs

LN4 = math.log(4.0)


def test_advantages_std_scaled():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), eps=0.0)
    s = math.sqrt(0.25 * 0.75)  # population std of (1,0,0,0)
    assert adv[0].tolist() == pytest.approx([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s], rel=1e-6)
    assert adv.dtype == torch.float32


def test_advantages_dr_grpo_and_zero_std():
    assert group_advantages(torch.tensor([[2.0, 0.0]]), scale_std=False)[0].tolist() == [1.0, -1.0]
    # all rewards equal: no signal, advantage exactly 0 (no division blow-up)
    assert group_advantages(torch.tensor([[1.0, 1.0, 1.0]]))[0].tolist() == [0.0, 0.0, 0.0]
    assert group_advantages(torch.tensor([[0.0, 0.0]]))[0].tolist() == [0.0, 0.0]


def test_eight_rewards_of_a_tenth_are_a_zero_std_group():
    """GSM8K's 'all wrong but formatted' group: eight rewards of 0.1. Its float32 std is 7.45e-9,
    not 0; decided on the rewards themselves it has no signal, and its advantages are exactly 0."""
    rewards = [[0.1] * 8, [0.1] * 7 + [1.1], [0.1] * 7 + [0.1 + 1e-12]]
    assert zero_std_groups(rewards).tolist() == [True, False, False]
    for r in (rewards, torch.tensor(rewards)):  # lists of Python floats, or a float32 tensor
        adv = group_advantages(r)
        assert adv[0].tolist() == [0.0] * 8
        assert adv[1, 7].item() > 2.0  # the one right answer stands out
    assert group_advantages([[0.1] * 8], scale_std=False)[0].tolist() == [0.0] * 8


# Two sequences, ratios far outside the clip range on both sides (4 and 1/4), both signs of A, and a
# padded slot whose logprob would overflow exp() if it were not masked first.
#   seq0: A = +1, r = pi/mu = 4, 1, 1/4        seq1: A = -2, r = 4, 1/4, (padding)
def _case():
    behav = torch.zeros(2, 3)
    logp = torch.tensor([[LN4, 0.0, -LN4], [LN4, -LN4, 100.0]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logp, behav, adv, mask


def _grad(out, logp):
    out.loss.backward()
    return logp.grad.flatten().tolist()


def test_ppo_value_and_gradient_by_hand():
    logp, behav, adv, mask = _case()
    out = grpo_loss(logp, behav, adv, mask)  # ppo, eps 0.2 / 0.2
    # token losses -min(rA, clip(r)A): -1.2 (r=4, A>0: clipped high), -1, -0.25 (r=1/4, A>0: not
    # clipped), 8 (r=4, A<0: not clipped), 1.6 (r=1/4, A<0: clipped low); padding is out
    assert out.loss.item() == pytest.approx((-1.2 - 1 - 0.25 + 8 + 1.6) / 5)
    # clipped tokens get no gradient; elsewhere d/dlogp = -A r / n_tokens; padding gets none
    assert _grad(out, logp) == pytest.approx([0.0, -0.2, -0.05, 1.6, 0.0, 0.0], abs=1e-6)
    st = out.stats
    assert st["clip/high_frac"] == pytest.approx(0.2) and st["clip/low_frac"] == pytest.approx(0.2)
    assert st["clip/frac"] == pytest.approx(0.4) and st["is/trunc_frac"] == 0.0
    assert st["ratio/max"] == pytest.approx(4.0) and st["ratio/min"] == pytest.approx(0.25)  # padding is out
    assert out.clipped.tolist() == [[True, False, False], [False, True, False]]
    assert out.ratio[1, 2].item() == 1.0  # padding: exp(0), never exp(100)


def test_ppo_sequence_aggregation_and_asymmetric_clip():
    logp, behav, adv, mask = _case()
    out = grpo_loss(logp, behav, adv, mask, agg="grpo")
    assert out.loss.item() == pytest.approx(((-1.2 - 1 - 0.25) / 3 + (8 + 1.6) / 2) / 2)
    # eps_high = 4: r = 4 with A > 0 is no longer clipped: -4 instead of -1.2, gradient -4/5
    out = grpo_loss(logp, behav, adv, mask, eps_low=0.2, eps_high=4.0)
    assert out.loss.item() == pytest.approx((-4 - 1 - 0.25 + 8 + 1.6) / 5)
    assert _grad(out, logp)[0] == pytest.approx(-0.8)
    assert out.stats["clip/high_frac"] == 0.0


def test_cispo_value_and_gradient_by_hand():
    logp, behav, adv, mask = _case()
    out = grpo_loss(logp, behav, adv, mask, objective="cispo", is_cap=2.0)
    # w = sg(min(r, 2)) = 2, 1, 1/4 | 2, 1/4; token loss -w A log pi
    want = (-2 * 1 * LN4 + 0 + -0.25 * 1 * -LN4 + -2 * -2 * LN4 + -0.25 * -2 * -LN4) / 5
    assert out.loss.item() == pytest.approx(want)
    # every token keeps a gradient: -w A / n_tokens, no matter how far r is from 1
    assert _grad(out, logp) == pytest.approx([-0.4, -0.2, -0.05, 0.8, 0.1, 0.0], abs=1e-6)
    assert out.stats["is/trunc_frac"] == pytest.approx(0.4) and out.stats["clip/frac"] == pytest.approx(0.4)
    assert out.stats["clip/low_frac"] == 0.0 and out.stats["clip/high_frac"] == 0.0
    assert out.stats["is/weight_mean"] == pytest.approx((2 + 1 + 0.25 + 2 + 0.25) / 5)
    assert out.clipped.tolist() == [[True, False, False], [True, False, False]]


def test_decoupled_value_and_gradient_by_hand():
    logp, behav, adv, mask = _case()
    # a proximal policy of its own: pi_prox / mu = 1, 4, 1 | 1/2, 1, so u = pi / pi_prox = 4, 1/4, 1/4 | 8, 1/4
    prox = torch.log(torch.tensor([[1.0, 4.0, 1.0], [0.5, 1.0, 1.0]]))
    out = grpo_loss(logp, behav, adv, mask, objective="decoupled", is_cap=2.0, logp_prox=prox)
    # w = min(pi_prox/mu, 2) = 1, 2 (truncated), 1 | 1/2, 1; token loss -w min(u A, clip(u) A):
    # -1.2 (u=4, A>0: clipped high), -2 * 0.25, -0.25, 0.5 * 16, 1.6 (u=1/4, A<0: clipped low)
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 - 0.25 + 8 + 1.6) / 5)
    # gradient -w A u / n where not clipped
    assert _grad(out, logp) == pytest.approx([0.0, -0.1, -0.05, 1.6, 0.0, 0.0], abs=1e-6)
    st = out.stats
    assert st["clip/high_frac"] == pytest.approx(0.2) and st["clip/low_frac"] == pytest.approx(0.2)
    assert st["is/trunc_frac"] == pytest.approx(0.2) and st["clip/frac"] == pytest.approx(0.6)
    assert st["ratio/max"] == pytest.approx(4.0)  # ratio/* stays pi / mu whatever the objective
    assert out.clipped.tolist() == [[True, True, False], [False, True, False]]


def test_decoupled_with_the_pre_step_weights_has_cispos_gradient():
    """The trainer's proximal policy is its weights before this step, i.e. logp.detach(): u = 1,
    the clip never binds, and the gradient is -min(pi/mu, C) A / n, the same as CISPO's."""
    logp, behav, adv, mask = _case()
    out = grpo_loss(logp, behav, adv, mask, objective="decoupled", is_cap=2.0)
    assert out.loss.item() == pytest.approx((-2 - 1 - 0.25 + 4 + 0.5) / 5)  # -w A per token
    assert _grad(out, logp) == pytest.approx([-0.4, -0.2, -0.05, 0.8, 0.1, 0.0], abs=1e-6)
    assert out.stats["clip/high_frac"] == 0.0 and out.stats["is/trunc_frac"] == pytest.approx(0.4)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_k3_kl_adds_value_and_gradient(objective):
    logp, behav, adv, mask = _case()
    base = grpo_loss(logp, behav, adv, mask, objective=objective)
    g0 = torch.autograd.grad(base.loss, logp)[0]
    # ref - logp = log 2 on every token: k3 = 2 - log 2 - 1 per token; d k3 / d logp = 1 - exp(d) = -1
    ref = logp.detach() + math.log(2.0)
    out = grpo_loss(logp, behav, adv, mask, objective=objective, logp_ref=ref, beta=0.5)
    assert out.stats["kl"] == pytest.approx(1 - math.log(2.0))
    assert out.loss.item() - base.loss.item() == pytest.approx(0.5 * (1 - math.log(2.0)))
    g = torch.autograd.grad(out.loss, logp)[0]
    want = mask * (0.5 * -1 / 5)
    assert (g - g0).flatten().tolist() == pytest.approx(want.flatten().tolist(), abs=1e-6)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_on_policy_zero_advantage_has_no_gradient(objective):
    logp = torch.tensor([[-0.3, -2.0]], requires_grad=True)
    out = grpo_loss(logp, logp.detach(), torch.tensor([0.0]), torch.ones(1, 2), objective=objective)
    out.loss.backward()
    assert out.stats["ratio/mean"] == 1.0 and out.loss.item() == 0.0 and logp.grad.abs().sum() == 0
    assert out.stats["clip/frac"] == 0.0


def test_unknown_objective_is_refused():
    logp, behav, adv, mask = _case()
    with pytest.raises(ValueError, match="unknown objective 'tis'"):
        grpo_loss(logp, behav, adv, mask, objective="tis")


def _plain_logprobs(model, prompt, comp, T):
    ids = torch.tensor([prompt + comp])
    ref = torch.log_softmax(model(ids).logits[0, :-1] / T, -1)
    return ref[len(prompt) - 1:].gather(1, torch.tensor(comp)[:, None]).squeeze(1)


def test_shared_prefix_logprobs_match_a_plain_forward(tiny_model):
    """completion_logprobs (prompt computed once per group, cache shared) equals scoring every
    prompt+completion row on its own, for prompts of different lengths and ragged completions."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    comps = [[20, 21, 22], [23], [24, 25], [26, 27, 28, 29]]  # G=2
    with torch.no_grad():
        logp, mask = completion_logprobs(model, prompts, comps, 0.7, pad=0)
        for n, c in enumerate(comps):
            assert mask[n].sum().item() == len(c)
            assert torch.allclose(logp[n, :len(c)], _plain_logprobs(model, prompts[n // 2], c, 0.7), atol=1e-5)
            assert (logp[n, len(c):] == 0).all()


def test_one_temperature_per_row(tiny_model):
    """Groups sampled at T=0.7 and T=1.3 in one call: each row on its own tempered distribution."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    comps = [[20, 21, 22], [23], [24, 25], [26, 27, 28, 29]]
    temps = [0.7, 0.7, 1.3, 1.3]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, prompts, comps, temps, pad=0)
        for n, c in enumerate(comps):
            assert torch.allclose(logp[n, :len(c)], _plain_logprobs(model, prompts[n // 2], c, temps[n]), atol=1e-5)
    with pytest.raises(ValueError, match="3 temperatures for 4 sequences"):
        completion_logprobs(model, prompts, comps, [0.7, 0.7, 1.3], pad=0)
    with pytest.raises(ValueError, match="finite and > 0"):
        completion_logprobs(model, prompts, comps, [0.7, 0.0, 1.3, 1.3], pad=0)

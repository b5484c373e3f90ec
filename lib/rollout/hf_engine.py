"""backend hf: rollouts on transformers, in this process, CPU or GPU (engines.py: what every engine offers).
`sample` is its own loop: the shared prompt prefix is computed once per group (models.prefill) and its KV cache
shared by the group's G completions, and every sampled token's logprob is that of logits / temperature. A new
adapter version is copied into the loaded LoRA's tensors in place (`swap_in`), between two decode steps if need
be (`sample`'s swap). `HFSampler` is this backend as an engine like the others; evaluate.py and the tests use
the functions themselves."""
from __future__ import annotations

import json
import os
from typing import Callable

import torch

from common import AdapterError
from engines import chat_ids, eos_ids
from models import _causal_lm, cache_kw, load_base, lora_views, peft_calls, prefill


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
# routed chat requests (rollout.py answers them between rounds; engines.chat_ids: their shape)


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


class HFSampler:
    """The hf backend as an engine (engines.py): the model, which the first adapter wraps with peft (so `model` is
    rebound by that swap), its tokenizer, and the functions above on them."""

    def __init__(self, model: str, dtype: str = "auto"):
        self.model, self.tok = load_base(model, dtype)
        self.eos, self.pad = eos_ids(self.tok, self.model), self.tok.pad_token_id

    @property
    def lora_loaded(self) -> bool:
        """A LoRA is loaded: a new version is copied into it in place, so it may come mid-round (the first adapter
        wraps the base model instead, which waits for the round's end)."""
        return hasattr(self.model, "peft_config")

    def swap_in(self, new: dict) -> None:
        self.model = swap_in(self.model, new)

    def sample(self, prompts: list[list[int]], G: int, max_new: int, temperature: float,
               swap: Callable[[int], bool] | None = None):
        return sample(self.model, prompts, G, max_new, temperature, self.eos, self.pad, swap)

    def generate_ids(self, seqs: list[list[int]], max_new: list[int], temperature: float, stop: set[int] = frozenset()):
        return hf_generate(self.model, self.eos | stop, self.pad, seqs, max_new, temperature)

    def turns(self, temperature: float) -> HFTurns:
        return HFTurns(self.model, self.eos, self.pad, temperature)

    def chat(self, reqs: list[dict]) -> list[dict]:
        return [hf_chat(self.model, self.tok, r) for r in reqs]

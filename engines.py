"""Rollout engines: what turns prompt token ids into G sampled completions per prompt, each token with
the logprob of the distribution it was actually sampled from (logits / temperature, no top-k/top-p),
and how each engine hot-loads a new LoRA adapter version. rollout.py drives them; they take plain
parameters, never the worker's Args, and know nothing of the proxy or the bucket's layout beyond
the adapter directory they are handed. On Hugging Face Jobs this file travels beside the script.

  hf       `sample` (own loop on transformers, prompt KV cache shared by its G completions) and
           `swap_in` (peft; LoRA tensors copied in place)
  vllm     `VLLMSampler`: one in-process vLLM engine, a LoRARequest per version

Every engine's sample() returns [(token_ids, logprobs, finish_reason)], group-major: the G
completions of prompt 0, then those of prompt 1, ...
"""
from __future__ import annotations

import os
import sys

import torch

from common import AdapterError, Bucket
from models import LOCAL_MODEL, _causal_lm, cache_kw, local_smollm2, prefill

# ---------------------------------------------------------------------------------------------
# backend hf: sampling (own loop: the shared prompt prefix is computed once per group, see models.prefill)


@torch.no_grad()
def sample(model, prompts: list[list[int]], G: int, max_new: int, temperature: float, eos: set[int], pad: int):
    """G completions per prompt; returns [(token_ids, logprobs, finish_reason)] group-major."""
    lm = _causal_lm(model)
    head, body = lm.get_output_embeddings(), lm.get_decoder()
    cache, h, mask, pos = prefill(model, prompts, G, pad)
    N = h.shape[0]
    eos_t = torch.tensor(sorted(eos))
    logits = head(h).float() / temperature
    toks, lps = [], []
    done = torch.zeros(N, dtype=torch.bool)
    for t in range(max_new):
        logp = torch.log_softmax(logits, -1)
        nxt = torch.multinomial(logp.exp(), 1).squeeze(1)
        toks.append(nxt)
        lps.append(logp.gather(1, nxt[:, None]).squeeze(1))
        done |= torch.isin(nxt, eos_t)
        if done.all() or t == max_new - 1:
            break
        mask = torch.cat([mask, torch.ones(N, 1, dtype=mask.dtype)], 1)
        out = body(input_ids=nxt[:, None], attention_mask=mask, position_ids=(pos + t)[:, None],
                   use_cache=True, **cache_kw(body, cache))
        logits = head(out.last_hidden_state[:, -1]).float() / temperature
    toks_t, lps_t = torch.stack(toks, 1).tolist(), torch.stack(lps, 1).tolist()
    out = []
    for ids, lp in zip(toks_t, lps_t):
        stop = next((i for i, x in enumerate(ids) if x in eos), None)
        n = len(ids) if stop is None else stop + 1  # keep the EOS token: it was sampled too
        out.append((ids[:n], lp[:n], "length" if stop is None else "stop"))
    return out


def swap_in(model, new: dict):
    """Hot-load a verified adapter. Same LoRA config as the loaded one: copy the tensors in place
    (milliseconds). First adapter, or a changed config: wrap/replace the peft adapter."""
    from peft import PeftModel, set_peft_model_state_dict
    if not isinstance(model, PeftModel):
        model = PeftModel.from_pretrained(model, new["dir"], adapter_name="default", is_trainable=False)
    else:
        res = set_peft_model_state_dict(model, new["tensors"], adapter_name="default")
        if getattr(res, "unexpected_keys", None):
            raise AdapterError(f"adapter tensors do not fit the loaded LoRA layout: {res.unexpected_keys[:3]}")
    model.eval()
    return model


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


def default_backend() -> str:
    import importlib.util
    if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
        return "hf"
    try:
        import vllm  # noqa: F401
        return "vllm"
    except Exception as e:  # a broken install: say so, run on transformers
        print(f"vllm does not import ({e}); using the hf backend", file=sys.stderr)
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
        # float32 on CPU: the trainer recomputes logprobs in float32, and bf16 sampling would put
        # its rounding noise into every importance ratio
        dtype = "float32" if dtype == "auto" and cpu else dtype
        # models.local_smollm2's config.json keeps the GGUF's quantization_config though the saved
        # weights are plain float32; vLLM would refuse "gguf" without the file: drop it
        quirk = {"quantization_config": None} if model == LOCAL_MODEL else {}
        self.llm = LLM(model=path, tokenizer=path, dtype=dtype, hf_overrides=quirk, seed=seed,
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

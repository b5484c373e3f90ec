"""backend vllm: one in-process vLLM engine for the worker's life (engines.py: what every engine offers); vllm is
imported only here, so the hf backend runs without it. Each adapter version becomes a LoRARequest with a name
and an integer id never used before in this engine: vLLM does not reload an id it already holds even if the
path changed, and keys its prefix cache by adapter, so a reused name/id could serve old weights or old KV
blocks. The superseded version is removed as soon as the new one is loaded."""
from __future__ import annotations

import os

import torch

from common import AdapterError
from engines import TokenTurns, chat_ids, engine_dtype, eos_ids, vllm_rank
from models import model_path


class VLLMSampler:
    """The vLLM engine and the adapter it serves; sample() returns what the hf sample() returns."""

    def __init__(self, model: str, lora_rank: int = 16, dtype: str = "auto", max_model_len: int = 2048,
                 gpu_memory_utilization: float = 0.5, seed: int = 0):
        from transformers import AutoTokenizer
        from vllm import LLM
        path = model_path(model)
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
        self.eos = eos_ids(self.tok)
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

    def turns(self, temperature: float) -> TokenTurns:
        return TokenTurns(self, temperature)

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

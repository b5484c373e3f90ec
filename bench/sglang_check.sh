#!/usr/bin/env bash
# GPU check of the server backend (server_engine.ServerSampler) against a real SGLang server, and the same
# against vLLM's OpenAI server, for a machine with a GPU and no network. SGLang has no CPU build on
# PyPI (see docs/engines.md, "SGLang"), so this is where its code path is exercised.
#
#   SGLANG_PYTHON=/path/sglang-venv/bin/python PYTHON=.venv/bin/python bash bench/sglang_check.sh [results.json]
#   KINDS=vllm VLLM_PYTHON=/path/vllm-venv/bin/python bash bench/sglang_check.sh   # vLLM's server only
#
# PYTHON runs this repository's side (torch, transformers, peft, httpx: requirements.txt);
# SGLANG_PYTHON / VLLM_PYTHON run the servers (default: PYTHON). Nothing is downloaded: the model is
# Qwen2.5-0.5B's architecture (config written in) with random weights and a word-level tokenizer
# with a one-line chat template. For each server kind in KINDS (default "sglang vllm"), with the
# code rollout.py --backend server runs:
#   - start the server (ServerSampler.start: LoRA enabled, float32 so logprobs compare with the trainer's);
#   - the processed-logprob probe (check_processed_logprobs at T=0.7);
#   - sample PROMPTS x G completions x NEW tokens at T=0.7 with the base model and after each of two
#     hot-swaps (load under a fresh name, old one unloaded), and compare every token's logprob with
#     the trainer's recompute (models.completion_logprobs): the lane's tolerances, mean < 1e-3, max < 1e-2;
#   - hot-swap latency (load_lora_adapter + the first 1-token generation);
#   - kill -9 of the server's process group, then the next sample(): restart, reload, answer;
#   - one routed chat request (chat()) on the adapter served.
# Writes one JSON object per kind to results.json (default bench/sglang_check_results.json) and prints it;
# exits 1 if a tolerance or step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-bench/sglang_check_results.json}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1
export KINDS=${KINDS:-sglang vllm} SGLANG_PYTHON=${SGLANG_PYTHON:-$PY} VLLM_PYTHON=${VLLM_PYTHON:-$PY}
export PROMPTS=${PROMPTS:-16} G=${G:-8} NEW=${NEW:-32} OUT
unset SGLANG_RETURN_ORIGINAL_LOGPROB  # it would make SGLang report pre-temperature logprobs
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$PY" - <<'EOF'
import json, os, signal, sys, tempfile, time
import torch
if not torch.cuda.is_available():
    sys.exit("sglang_check.sh: no CUDA device visible to torch; this check is for a GPU machine")
sys.path.insert(0, os.getcwd())
import server_engine, models
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import Tokenizer, models as tok_models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

P, G, NEW, T = int(os.environ["PROMPTS"]), int(os.environ["G"]), int(os.environ["NEW"]), 0.7
work = tempfile.mkdtemp(prefix="server-check-")
model_dir = os.path.join(work, "qwen2.5-0.5b-random")
cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768,
                  max_window_layers=21, rms_norm_eps=1e-6, rope_theta=1000000.0, sliding_window=None,
                  use_sliding_window=False, tie_word_embeddings=True, attention_dropout=0.0,
                  bos_token_id=151643, eos_token_id=151645, torch_dtype="float32")
torch.manual_seed(0)
Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tok_models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0")),
                              eos_token="t151645", pad_token="t151643")
tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
tok.save_pretrained(model_dir)
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(0, 150000, (int(n),), generator=g).tolist() for n in torch.randint(40, 120, (P,), generator=g)]
adirs = {}
for v in (1, 2):  # LoRA r=16 on all linear layers, B non-zero (as a trained adapter would be)
    torch.manual_seed(v)
    m = get_peft_model(Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                       LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False))
    adirs[v] = os.path.join(work, f"v{v:06d}")
    m.save_pretrained(adirs[v])
base = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()


def agreement(samples, v):
    global base
    model = base if v == 0 else PeftModel.from_pretrained(base, adirs[v]).eval()
    with torch.no_grad():
        logp, mask = models.completion_logprobs(model, prompts, [s[0] for s in samples], T, tok.pad_token_id)
    base = base if v == 0 else model.unload()
    behav, _ = models.pad_right([s[1] for s in samples], 0.0, dtype=torch.float32)
    d = (logp.cpu() - behav).abs()[mask.cpu().bool()]
    return round(d.mean().item(), 8), round(d.max().item(), 8)


results, ok = [], True
for kind in os.environ["KINDS"].split():
    res = {"kind": kind, "gpu": torch.cuda.get_device_name(0), "prompts": P, "G": G, "max_new_tokens": NEW, "T": T}
    python = os.environ["SGLANG_PYTHON" if kind == "sglang" else "VLLM_PYTHON"]
    t0 = time.time()
    try:
        eng = server_engine.ServerSampler.start(kind, model=model_dir, lora_rank=16, log_path=os.path.join(work, f"{kind}.log"),
                                          python=python, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3)
        res["start_s"] = round(time.time() - t0, 1)
        eng.check_processed_logprobs(prompts[0], T)
        res["probe"] = "processed logprobs"
        eng.sample(prompts[:2], G, 4, T)  # warm-up
        t0 = time.time(); s = eng.sample(prompts, G, NEW, T); dt = time.time() - t0
        res["tokens_per_s"] = round(sum(len(x[0]) for x in s) / dt, 1)
        res["absdiff_v0"] = agreement(s, 0)
        for v in (1, 2):
            t0 = time.time(); eng.swap_in({"version": v, "dir": adirs[v]}); t1 = time.time()
            eng.sample(prompts[:1], 1, 1, T)
            res[f"swap_v{v}_s"] = {"load": round(t1 - t0, 3), "to_first_token": round(time.time() - t0, 3)}
            res[f"absdiff_v{v}"] = agreement(eng.sample(prompts, G, NEW, T), v)
        res["adapters_listed"] = sorted(eng.loaded()) if kind == "vllm" else None
        os.killpg(eng.managed.proc.pid, signal.SIGKILL)
        t0 = time.time(); s = eng.sample(prompts, G, NEW, T)
        res["kill9_to_answer_s"] = round(time.time() - t0, 1)
        res["absdiff_v2_after_restart"] = agreement(s, 2)
        res["chat"] = eng.chat([{"messages": [{"role": "user", "content": "t5 t6 t7"}], "max_tokens": 4,
                                 "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []}])[0]
        eng.close()
        for k in [k for k in res if k.startswith("absdiff")]:
            res[k + "_ok"] = res[k][0] < 1e-3 and res[k][1] < 1e-2
            ok &= res[k + "_ok"]
    except Exception as e:  # say which step failed and keep going with the next kind
        res["error"] = f"{type(e).__name__}: {e}"
        ok = False
    results.append(res)
    print(json.dumps(res), flush=True)
json.dump(results, open(os.environ["OUT"], "w"), indent=1)
sys.exit(0 if ok else 1)
EOF

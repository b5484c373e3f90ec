#!/usr/bin/env bash
# GPU check: one run of at most ~10 minutes on one GPU, without network (bench/gpu_check.py says
# what it measures: trainer step time and peak memory in bf16 for Qwen2.5-0.5B/1.5B and 7B in 4-bit,
# vLLM tokens/s with and without a LoRA, hot-swap latency, vLLM's bf16 logprobs against the
# trainer's recompute). Models are built from lib/jobs/configs/ with random weights; nothing is downloaded.
# For a GPU machine that cannot install vLLM (its own Python and torch, no network, 64 MiB carried:
# this workplace's nvidia-h200), use bench/gpu_hf_check.sh instead (docs/gpu.md).
#
#   bash bench/gpu_check.sh --download-wheels wheels/     # once, on a machine with PyPI (Linux x86_64 wheels, CPython 3.11)
#   bash bench/gpu_check.sh --install-wheels wheels/      # on the GPU machine, offline: .venv-gpu from those wheels only
#   bash bench/gpu_check.sh [results.json]                # the check (default runs/gpu_check_results.json)
#   bash bench/gpu_check.sh --cpu-smoke                   # no GPU: the trainer part on 2-layer models, tiny shapes (~5 min here)
#
# The wheels: bench/gpu_requirements.txt pins vllm (the CUDA build, which pins its torch), peft,
# transformers, bitsandbytes and the trainer's other imports; --download-wheels fetches exactly
# those and their dependencies for manylinux x86_64 / CPython 3.11 (about 3 GB: torch with its
# CUDA libraries is most of it) into one folder, and --install-wheels installs from that folder with
# --no-index. Carry the folder with the repository to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=bench/gpu_requirements.txt
PLATFORMS=$(for v in $(seq 39 -1 17); do printf -- '--platform manylinux_2_%s_x86_64 ' "$v"; done)
case "${1:-}" in
  --download-wheels)
    dir=${2:?usage: --download-wheels DIR}
    # shellcheck disable=SC2086  # PLATFORMS is a list of flags
    python3 -m pip download --only-binary=:all: $PLATFORMS --platform manylinux2014_x86_64 --platform linux_x86_64 \
      --python-version 3.11 --implementation cp -r "$REQ" -d "$dir"
    echo "wheels in $dir ($(du -sh "$dir" | cut -f1)); carry it to the GPU machine and run: bash bench/gpu_check.sh --install-wheels $dir"
    exit 0 ;;
  --install-wheels)
    dir=${2:?usage: --install-wheels DIR}
    python3.11 -m venv .venv-gpu
    .venv-gpu/bin/pip install --no-index --find-links "$dir" -r "$REQ"
    echo "ready: PYTHON=.venv-gpu/bin/python bash bench/gpu_check.sh"
    exit 0 ;;
esac
PY=${PYTHON:-$(for p in .venv-gpu/bin/python .venv/bin/python; do [ -x "$p" ] && echo "$p" && break; done)}
PY=${PY:-python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1
if [ "${1:-}" = "--cpu-smoke" ]; then
  exec "$PY" bench/gpu_check.py --cpu-smoke --out "${2:-bench/gpu_check_smoke.json}"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
exec timeout 600 "$PY" bench/gpu_check.py --out "${1:-runs/gpu_check_results.json}"

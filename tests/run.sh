#!/usr/bin/env bash
# The test command of the README: sets up .venv on first use (same as the launcher), then runs
# every test tier (math, proxy through uvicorn, bucket, end-to-end processes) against a local S3
# server that the tests start themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch_jobs.sh --setup-only
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q --durations=15 tests "$@"

#!/usr/bin/env bash
# The test command of the README: sets up .venv on first use (same as the launcher), then runs
# every test tier (math, proxy through uvicorn, bucket, end-to-end processes) against a local S3
# server that the tests start themselves.
#   bash tests/run.sh                        # everything: tests/test_chaos.py runs beside the rest (below)
#   bash tests/run.sh tests/test_proxy.py    # arguments go to one pytest, as given
#   bash tests/run.sh -m "not slow"          # without the runs with kills and outages (minutes each)
# The chaos run takes ~5 minutes, most of them waiting out the outages it makes (the bucket and the proxy
# down for 2 minutes each) with one tiny worker and trainer: run beside the rest of the suite, in a pytest
# of its own, it costs the suite little CPU and ~5 minutes less wall time; its output follows the suite's.
# The other slow tests (trainer lifecycle, relaunches, local autoscaling) keep the machine busy and some of
# them time what they wait for: beside the rest they failed under the load (CI on 8904ac9), so they stay in it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch_jobs.sh --setup-only
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
pytest=(.venv/bin/python -m pytest -q --durations=15)
[ $# -gt 0 ] && exec "${pytest[@]}" tests "$@"
chaos_log=$(mktemp) chaos=
# its own process group (setsid), so that an interrupted suite stops it and every process it started
trap '[ -n "$chaos" ] && kill -TERM -- "-$chaos" 2>/dev/null; rm -f "$chaos_log"' EXIT
setsid "${pytest[@]}" -p no:cacheprovider tests/test_chaos.py >"$chaos_log" 2>&1 &
chaos=$!
rc=0
"${pytest[@]}" tests --ignore=tests/test_chaos.py || rc=$?
rc_chaos=0
wait "$chaos" || rc_chaos=$?
chaos=
echo "---- tests/test_chaos.py, run beside the rest (exit status $rc_chaos)"
cat "$chaos_log"
[ "$rc" = 0 ] && [ "$rc_chaos" = 0 ]

#!/usr/bin/env bash
# The test command of the README: sets up .venv on first use (same as the launcher), then runs
# every test tier (math, proxy through uvicorn, bucket, end-to-end processes) against a local S3
# server that the tests start themselves.
#   bash tests/run.sh                        # everything: the slow tests run beside the rest (below)
#   bash tests/run.sh tests/test_proxy.py    # arguments go to one pytest, as given
#   bash tests/run.sh -m "not slow"          # without the runs with kills and outages (minutes each)
# The tests marked slow (pytest.ini: whole runs with kills and outages, ~8 minutes) run in a pytest of their
# own beside the rest, their output after the suite's: most of their time is waiting (the chaos run's
# outages, the bucket and the proxy down for 2 minutes each; relaunches) with one tiny worker and trainer,
# so beside the rest they cost the suite's wall time little.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch_jobs.sh --setup-only
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
pytest=(.venv/bin/python -m pytest -q --durations=15)
[ $# -gt 0 ] && exec "${pytest[@]}" tests "$@"
slow_log=$(mktemp) slow=
# its own process group (setsid), so that an interrupted suite stops it and every process it started
trap '[ -n "$slow" ] && kill -TERM -- "-$slow" 2>/dev/null; rm -f "$slow_log"' EXIT
setsid "${pytest[@]}" -p no:cacheprovider -m slow tests >"$slow_log" 2>&1 &
slow=$!
rc=0
"${pytest[@]}" -m "not slow" tests || rc=$?
rc_slow=0
wait "$slow" || rc_slow=$?
slow=
echo "---- the slow tests (-m slow), run beside the rest (exit status $rc_slow)"
cat "$slow_log"
[ "$rc" = 0 ] && [ "$rc_slow" = 0 ]

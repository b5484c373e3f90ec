#!/usr/bin/env bash
# Async vs strictly synchronous GRPO on the local task: same task, model, seeds and settings.
#
#   bash bench/async_vs_sync.sh                          # one pair: sync, then async, 40 steps each
#   bash bench/async_vs_sync.sh --pairs 2 --steps 30     # two pairs, alternating sync / async
#   bash bench/async_vs_sync.sh --train-arg --loss --train-arg cispo   # options go to both runs
#   .venv/bin/python bench/async_vs_sync.py runs/avs-*   # the comparison again, from saved runs
#
# Each run is `bash launch_jobs.sh --local` with its defaults (see that script); the synchronous one
# adds `--rollout-arg --sync`: the worker generates one round (8 prompts x 8 = one trainer batch)
# with the newest adapter, then waits for the version trained on it; the trainer waits for its
# batch; nothing generated goes unused. The async one is the default local run. Then
# bench/async_vs_sync.py prints, per run and as medians per mode, when the 5-step mean reward first
# reaches 0.8 (step and seconds into training), steps per minute, the trainer's idle share, tokens
# generated / leased / trained, and writes runs/avs-<stamp>.png: reward per step and per second.
# A run takes 10-40 min on 2 cores shared with other jobs; the script notes the load before each.
set -euo pipefail
cd "$(dirname "$0")/.."
PAIRS=1; STEPS=40; PASS=(); STAMP=$(date +%Y%m%d-%H%M%S)
while [ $# -gt 0 ]; do
  case "$1" in
    --pairs) PAIRS="$2"; shift ;;
    --steps) STEPS="$2"; shift ;;
    --train-arg|--rollout-arg|--proxy-arg) PASS+=("$1" "$2"); shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "async_vs_sync.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
bash launch_jobs.sh --setup-only
mkdir -p runs  # (a fresh clone has none yet)
RUNS=()
for p in $(seq 1 "$PAIRS"); do
  for mode in sync async; do
    run="avs-$STAMP-$mode-$p"
    extra=(); [ "$mode" = sync ] && extra=(--rollout-arg --sync)
    echo "== $run  (load: $(cut -d' ' -f1-3 /proc/loadavg))"
    bash launch_jobs.sh --local --run "$run" --steps "$STEPS" ${PASS[@]+"${PASS[@]}"} "${extra[@]}" \
      > "runs/$run.log" 2>&1 || { echo "run $run failed: see runs/$run.log" >&2; tail -n 20 "runs/$run.log" >&2; exit 1; }
    grep -a "first reaches\|never reached" "runs/$run.log" || true
    RUNS+=("runs/$run")
  done
done
.venv/bin/python bench/async_vs_sync.py --png "runs/avs-$STAMP.png" "${RUNS[@]}"

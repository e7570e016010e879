#!/usr/bin/env bash
# Tessera GPU check: one script, < 10 minutes (TESSERA_GPU_BUDGET_S, default 540 s), read-only on MIG.
#   1. lists devices and MIG state through the agent's code (read-only MigManager);
#   2. starts a private MPS control daemon for GPU 0 (own pipe/log dirs; quit on exit);
#   3. runs the 2-executor MPS quota check (bench/gpu/mps_quota.py), then the estimator's
#      accuracy benchmark under MPS quotas 10-100 % (bench.estimator_accuracy --device cuda);
#   4. runs the runtime benchmarks that exist (bench.peft_mux, bench.mm_colocate — under the
#      MPS daemon when it runs, for its two-process plans —
#      bench.mm_reshard) with --device cuda, each under a timeout.
# Everything goes to one folder: $OUT if set, else bench/out/gpu. summary.json says what ran;
# it is rewritten after every step, and every benchmark rewrites its JSON after every
# row/phase ("complete": false until its end), so an outer kill loses at most one row.
# Every external command is bounded (timeout); INT/TERM stop the running step's process
# group at once and still quit the private MPS daemon.
# It NEVER changes MIG mode, creates/destroys MIG instances, or resets a GPU.
# Without a CUDA GPU it writes summary.json {"gpu": false, ...} and exits 0.
set -u
cd "$(dirname "$0")/../.."
DIR="${OUT:-bench/out/gpu}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
BUDGET_S=${TESSERA_GPU_BUDGET_S:-540}   # 9 minutes: device_run.sh bounds it at 565 s in a 590 s call
KILL_AFTER=5                            # seconds between a step's TERM and its KILL (inside its budget)
# The interpreter that holds torch: the repo's venv if any, else python3 (the device
# image's torch lives there), else python.
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python
elif ! python3 -c "import torch" >/dev/null 2>&1 && command -v python >/dev/null 2>&1; then PY=python
fi
STEPS="$DIR/steps.jsonl"
: > "$STEPS"

clip_limit() {  # clip_limit LIMIT ELAPSED -> the limit a step may have now (TERM at it, KILL KILL_AFTER later:
  # both inside BUDGET_S); prints 0 when less than 20 s of budget are left (the step is skipped)
  local limit=$1 left=$((BUDGET_S - $2 - KILL_AFTER))
  if [ "$left" -lt 20 ]; then echo 0; elif [ "$limit" -gt "$left" ]; then echo "$left"; else echo "$limit"; fi
}
is_timeout() {  # is_timeout RC: timeout(1) gives 124 at TERM, 137 (128+KILL) when it had to KILL
  if [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; then echo true; else echo false; fi
}

STEP_PID=""; STEP_NAME=""
step() {  # step NAME TIMEOUT_S CMD... : run with a timeout, log, record rc and duration, rewrite summary.json
  local name=$1 limit; shift
  limit=$(clip_limit "$1" "$SECONDS"); shift
  if [ "$limit" -eq 0 ]; then
    echo "{\"step\":\"$name\",\"skipped\":\"time budget spent\"}" >> "$STEPS"; summary true "$RUNNING"; return 0
  fi
  local t0=$SECONDS
  echo "== $name (timeout ${limit}s)"
  # In the background + wait: a trapped INT/TERM interrupts `wait` at once (a foreground
  # child would delay the trap until it ends). timeout(1) leads its own process group,
  # which the trap kills. <&0: the step keeps this function's stdin (a here-document).
  timeout --kill-after=$KILL_AFTER "$limit" "$@" <&0 > "$DIR/$name.log" 2>&1 &
  STEP_PID=$!; STEP_NAME=$name
  wait "$STEP_PID"
  local rc=$?
  STEP_PID=""; STEP_NAME=""
  echo "{\"step\":\"$name\",\"rc\":$rc,\"seconds\":$((SECONDS - t0)),\"limit_s\":$limit,\"timed_out\":$(is_timeout $rc)}" >> "$STEPS"
  echo "   rc=$rc in $((SECONDS - t0))s (log: $DIR/$name.log)"
  summary true "$RUNNING"
  return 0
}

summary() {  # summary GPU_BOOL REASON [FINISHED]: summary.json from steps.jsonl and the results so far
  timeout 30 "$PY" - "$DIR" "$1" "$2" "${3:-false}" <<'PYEOF'
import json, pathlib, sys, time
d, gpu, reason, finished = pathlib.Path(sys.argv[1]), sys.argv[2] == "true", sys.argv[3], sys.argv[4] == "true"
steps = []
for l in (d / "steps.jsonl").read_text().splitlines():
    try:
        steps.append(json.loads(l))
    except ValueError:
        steps.append({"unreadable": l})
out = {"gpu": gpu, "reason": reason, "finished": finished,
       "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": steps}
for name in ("devices", "mps_quota"):
    p = d / f"{name}.json"
    if p.exists():
        try:
            out[name] = json.loads(p.read_text())
        except ValueError:
            out[name] = {"error": "unreadable"}
res = {}  # per benchmark: its JSON exists, and whether it is complete or partial
for name in ("mps_quota", "estimator_accuracy", "peft_mux", "mm_colocate", "mm_reshard"):
    p = d / f"{name}.json"
    if p.exists():
        try:
            res[name] = {"complete": json.loads(p.read_text()).get("complete")}
        except ValueError:
            res[name] = {"complete": None, "error": "unreadable"}
out["results"] = res
tmp = d / "summary.json.tmp"
tmp.write_text(json.dumps(out, indent=1))
tmp.replace(d / "summary.json")
print(json.dumps({"gpu": gpu, "reason": reason, "steps": len(steps), "finished": finished}))
PYEOF
}

# The private MPS daemon (started in 2+3 below) is quit on any exit; INT/TERM also stop the step.
RUNNING="starting"
MPS_ROOT=""
mps_quit() {
  if [ -n "$MPS_ROOT" ] && [ -e "$MPS_ROOT/pipe/control" ]; then
    echo quit | CUDA_MPS_PIPE_DIRECTORY="$MPS_ROOT/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_ROOT/log" \
      timeout 20 nvidia-cuda-mps-control >/dev/null 2>&1
    sleep 1
    cp -r "$MPS_ROOT/log" "$DIR/mps-log" 2>/dev/null
  fi
  [ -n "$MPS_ROOT" ] && rm -rf "$MPS_ROOT"
  MPS_ROOT=""
}
on_signal() {  # INT/TERM: stop the running step's process group (TERM, then KILL), quit MPS, summary
  trap '' INT TERM
  if [ -n "$STEP_PID" ]; then
    kill -TERM -- "-$STEP_PID" 2>/dev/null || kill -TERM "$STEP_PID" 2>/dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$STEP_PID" 2>/dev/null || break; sleep 0.3; done
    kill -KILL -- "-$STEP_PID" 2>/dev/null
    echo "{\"step\":\"$STEP_NAME\",\"rc\":130,\"interrupted\":true,\"timed_out\":false}" >> "$STEPS"
  fi
  mps_quit
  summary true "interrupted (INT/TERM) while $RUNNING" false
  exit 130
}
trap mps_quit EXIT
trap on_signal INT TERM

# -- 0. is there a CUDA GPU at all? (each probe bounded: a wedged driver must not hang us) ---
if ! command -v nvidia-smi >/dev/null 2>&1 || ! timeout 30 nvidia-smi -L >/dev/null 2>&1 \
   || ! timeout 60 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  echo "no CUDA GPU on this machine (nvidia-smi or torch.cuda unavailable): nothing to check"
  summary false "no CUDA GPU: nvidia-smi or torch.cuda.is_available() failed (or timed out)" true
  exit 0
fi

# -- 0b. pure-Python dependencies the device image lacks (structlog), from bench/gpu/wheels --
# The image has torch, grpcio, protobuf, peft, nvidia-ml-py but not structlog (the logging
# library every daemon and executor imports); nothing can be fetched there.
if ! "$PY" -c "import structlog" >/dev/null 2>&1; then
  SITE=/tmp/tessera-site
  if timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
       bench/gpu/wheels/*.whl > "$DIR/wheels.log" 2>&1; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo '{"step":"wheels","rc":0,"installed":"bench/gpu/wheels"}' >> "$STEPS"
  else
    echo '{"step":"wheels","rc":1,"note":"structlog missing and bench/gpu/wheels did not install; see wheels.log"}' >> "$STEPS"
  fi
fi

# -- 1. devices and MIG state, read-only, through the agent ------------------------------
timeout 30 nvidia-smi -L > "$DIR/nvidia-smi-L.txt" 2>&1
RUNNING="running on $(head -n1 "$DIR/nvidia-smi-L.txt")"
step devices 20 "$PY" - "$DIR/devices.json" <<'PYEOF'
import dataclasses, json, sys
import pynvml
from agent.devices import discover
from agent.partitions import MigManager
devs = discover(1)
mig = MigManager(pynvml)  # allow_changes=False: reads only
out = {"devices": [dataclasses.asdict(d) for d in devs], "mig": []}
for d in devs:
    if d.kind == "gpu":
        try:
            out["mig"].append(mig.state(d.index).to_dict())
        except Exception as e:
            out["mig"].append({"gpu_index": d.index, "error": str(e)})
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps({"gpus": [d.id for d in devs], "mig_enabled": [m.get("current_mode") == 1 for m in out["mig"]]}))
PYEOF
cat "$DIR/devices.log"
GPU0_UUID=$("$PY" -c "import json,sys; d=json.load(open(sys.argv[1]))['devices']; print(d[0]['uuid'] if d else '')" "$DIR/devices.json" 2>/dev/null)
# MIG mode of GPU 0 from nvidia-smi's MIG mode query alone (read only). MPS runs only on
# a known "Disabled" (or "[N/A]": a GPU without MIG); Enabled, an error, a timeout or
# anything else skips MPS: a daemon is never started on a GPU whose MIG mode is unknown.
MIG_MODE=$(timeout 20 nvidia-smi -i "${GPU0_UUID:-0}" --query-gpu=mig.mode.current --format=csv,noheader 2>/dev/null \
           | head -n1 | tr -d '\r' | sed 's/^ *//; s/ *$//')
echo "{\"step\":\"mig_mode\",\"gpu\":\"${GPU0_UUID:-0}\",\"current\":\"$(printf %s "$MIG_MODE" | tr -d '"\\')\"}" >> "$STEPS"
case "$MIG_MODE" in
  Disabled|"[N/A]"|N/A) MIG0=0 ;;
  Enabled) MIG0=1 ;;
  *) MIG0=unknown ;;
esac

# -- 2+3. MPS daemon (private dirs, quit on exit) and the quota check --------------------
if [ "$MIG0" = "1" ]; then
  echo '{"step":"mps_quota","skipped":"MIG is enabled on GPU 0; MPS quotas apply per MIG instance and MIG is left as is"}' >> "$STEPS"
  echo '{"step":"estimator_accuracy","skipped":"needs MPS quotas; MIG is enabled on GPU 0"}' >> "$STEPS"
elif [ "$MIG0" != "0" ]; then
  echo "{\"step\":\"mps_quota\",\"skipped\":\"MIG mode of GPU 0 unknown (query gave '$(printf %s "$MIG_MODE" | tr -d '"\\')'): no MPS daemon on it\"}" >> "$STEPS"
  echo '{"step":"estimator_accuracy","skipped":"needs MPS quotas; MIG mode of GPU 0 unknown"}' >> "$STEPS"
elif ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  echo '{"step":"mps_quota","skipped":"nvidia-cuda-mps-control not installed"}' >> "$STEPS"
  echo '{"step":"estimator_accuracy","skipped":"needs MPS quotas; nvidia-cuda-mps-control not installed"}' >> "$STEPS"
else
  # Short path under /tmp: the pipe is a unix socket (108-byte path limit).
  MPS_ROOT=$(mktemp -d /tmp/tessera-mps.XXXXXX)
  mkdir -p "$MPS_ROOT/pipe" "$MPS_ROOT/log"; chmod 700 "$MPS_ROOT/pipe" "$MPS_ROOT/log"
  if CUDA_MPS_PIPE_DIRECTORY="$MPS_ROOT/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_ROOT/log" \
       CUDA_VISIBLE_DEVICES="${GPU0_UUID:-0}" timeout 30 nvidia-cuda-mps-control -d; then
    for _ in $(seq 50); do [ -e "$MPS_ROOT/pipe/control" ] && break; sleep 0.1; done
    # 3 phases (each quota alone, then together) of ~10 s start-up + 8 s measured: ~60 s
    step mps_quota 75 "$PY" bench/gpu/mps_quota.py --mps-root "$MPS_ROOT" --gpu-uuid "$GPU0_UUID" \
      --quotas 30,70 --warmup-s 10 --json "$DIR/mps_quota.json"
    tail -n 3 "$DIR/mps_quota.log"
    # The estimator's GPU variant needs the daemon too: MPS quotas 10-100 % on GPU 0. Its
    # clients get the same environment as the quota check's (the agent's MpsBackend
    # client env: pipe and log directories, no CUDA_VISIBLE_DEVICES: the daemon serves
    # GPU 0 alone). Run only when at least one MPS client of the quota check ran: with a
    # broken daemon every phase would wait out its 90 s timeout.
    if "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if any(r.get('exit_code') == 0 for r in d.get('solo', [])) else 1)" \
         "$DIR/mps_quota.json" 2>/dev/null; then
      step estimator_accuracy 150 env CUDA_MPS_PIPE_DIRECTORY="$MPS_ROOT/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_ROOT/log" \
        "$PY" -m bench.estimator_accuracy --device cuda --json "$DIR/estimator_accuracy.json"
      tail -n 12 "$DIR/estimator_accuracy.log"
      # mm_colocate under the daemon too: its two-process plans (encoder | LLM) take MPS
      # SM shares (Mosaic's colocation); its stream plans run as one client.
      step mm_colocate 75 env CUDA_MPS_PIPE_DIRECTORY="$MPS_ROOT/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_ROOT/log" \
        "$PY" -m bench.mm_colocate --device cuda --json "$DIR/mm_colocate.json"
      MM_COLOCATE_DONE=1
    else
      echo '{"step":"estimator_accuracy","skipped":"no MPS client of the quota check ran (see mps_quota.log): MPS quotas unusable"}' >> "$STEPS"
    fi
  else
    echo '{"step":"mps_quota","skipped":"nvidia-cuda-mps-control -d failed or timed out"}' >> "$STEPS"
  fi
  mps_quit   # the benchmarks below run without MPS
fi

# -- 4. the runtime benchmarks that exist, each bounded ------------------------------------
for mod in peft_mux mm_colocate mm_reshard; do  # estimator_accuracy ran above, under MPS
  [ "$mod" = mm_colocate ] && [ -n "${MM_COLOCATE_DONE:-}" ] && continue  # ran above, under MPS
  limit=60; extra=""
  # peft_mux starts 16 HF processes per round: one round on the GPU (device time is scarce)
  [ "$mod" = peft_mux ] && limit=150 && extra="--rounds 1"
  if "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('bench.$mod') else 1)" 2>/dev/null; then
    step "$mod" "$limit" "$PY" -m "bench.$mod" --device cuda --json "$DIR/$mod.json" $extra
  else
    echo "{\"step\":\"$mod\",\"skipped\":\"module bench.$mod not present\"}" >> "$STEPS"
  fi
done

summary true "ran on $(head -n1 "$DIR/nvidia-smi-L.txt")" true
echo "results in $DIR (total ${SECONDS}s)"

#!/usr/bin/env bash
# Tessera GPU check: one script, < 9 minutes (TESSERA_GPU_BUDGET_S), read-only on MIG.
#   1. lists devices and MIG state through the agent's code (read-only MigManager);
#   2. starts a private MPS control daemon for GPU 0 (own pipe/log dirs; quit on exit);
#   3. runs the 2-executor MPS quota check (bench/gpu/mps_quota.py), then the estimator's
#      accuracy benchmark under MPS quotas 10-100 % (bench.estimator_accuracy --device cuda);
#   4. runs the runtime benchmarks that exist (bench.peft_mux, bench.mm_colocate,
#      bench.mm_reshard) with --device cuda, each under a timeout.
# Everything goes to one folder: $OUT if set, else bench/out/gpu. summary.json says what ran.
# It NEVER changes MIG mode, creates/destroys MIG instances, or resets a GPU.
# Without a CUDA GPU it writes summary.json {"gpu": false, ...} and exits 0.
set -u
cd "$(dirname "$0")/../.."
DIR="${OUT:-bench/out/gpu}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
BUDGET_S=${TESSERA_GPU_BUDGET_S:-540}   # stay under the 10-minute command limit with margin
# The interpreter that holds torch: the repo's venv if any, else python3 (the device
# image's torch lives there), else python.
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python
elif ! python3 -c "import torch" >/dev/null 2>&1 && command -v python >/dev/null 2>&1; then PY=python
fi
STEPS="$DIR/steps.jsonl"
: > "$STEPS"

step() {  # step NAME TIMEOUT_S CMD... : run with a timeout, log, record rc and duration
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "{\"step\":\"$name\",\"skipped\":\"time budget spent\"}" >> "$STEPS"; return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  echo "== $name (timeout ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$DIR/$name.log" 2>&1
  local rc=$?
  echo "{\"step\":\"$name\",\"rc\":$rc,\"seconds\":$((SECONDS - t0)),\"timed_out\":$([ $rc -eq 124 ] && echo true || echo false)}" >> "$STEPS"
  echo "   rc=$rc in $((SECONDS - t0))s (log: $DIR/$name.log)"
  return 0
}

summary() {  # summary GPU_BOOL REASON
  "$PY" - "$DIR" "$1" "$2" <<'PYEOF'
import json, pathlib, sys, time
d, gpu, reason = pathlib.Path(sys.argv[1]), sys.argv[2] == "true", sys.argv[3]
steps = [json.loads(l) for l in (d / "steps.jsonl").read_text().splitlines() if l.strip()]
out = {"gpu": gpu, "reason": reason, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": steps}
for name in ("devices", "mps_quota"):
    p = d / f"{name}.json"
    if p.exists():
        try:
            out[name] = json.loads(p.read_text())
        except ValueError:
            out[name] = {"error": "unreadable"}
(d / "summary.json").write_text(json.dumps(out, indent=1))
print(json.dumps({"gpu": gpu, "reason": reason, "steps": len(steps)}))
PYEOF
}

# -- 0. is there a CUDA GPU at all? -------------------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1 \
   || ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  echo "no CUDA GPU on this machine (nvidia-smi or torch.cuda unavailable): nothing to check"
  summary false "no CUDA GPU: nvidia-smi or torch.cuda.is_available() failed"
  exit 0
fi

# -- 0b. pure-Python dependencies the device image lacks (structlog), from bench/gpu/wheels --
# The image has torch, grpcio, protobuf, peft, nvidia-ml-py but not structlog (the logging
# library every daemon and executor imports); nothing can be fetched there.
if ! "$PY" -c "import structlog" >/dev/null 2>&1; then
  SITE=/tmp/tessera-site
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
       bench/gpu/wheels/*.whl > "$DIR/wheels.log" 2>&1; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo '{"step":"wheels","rc":0,"installed":"bench/gpu/wheels"}' >> "$STEPS"
  else
    echo '{"step":"wheels","rc":1,"note":"structlog missing and bench/gpu/wheels did not install; see wheels.log"}' >> "$STEPS"
  fi
fi

# -- 1. devices and MIG state, read-only, through the agent ------------------------------
nvidia-smi -L > "$DIR/nvidia-smi-L.txt" 2>&1
step devices 60 "$PY" - "$DIR/devices.json" <<'PYEOF'
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
MIG0=$("$PY" -c "import json,sys; m=json.load(open(sys.argv[1]))['mig']; print(int(bool(m) and m[0].get('current_mode')==1))" "$DIR/devices.json" 2>/dev/null || echo 0)

# -- 2+3. MPS daemon (private dirs, quit on exit) and the quota check --------------------
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
trap mps_quit EXIT
trap 'mps_quit; exit 130' INT TERM
if [ "$MIG0" = "1" ]; then
  echo '{"step":"mps_quota","skipped":"MIG is enabled on GPU 0; MPS quotas apply per MIG instance and MIG is left as is"}' >> "$STEPS"
  echo '{"step":"estimator_accuracy","skipped":"needs MPS quotas; MIG is enabled on GPU 0"}' >> "$STEPS"
elif ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  echo '{"step":"mps_quota","skipped":"nvidia-cuda-mps-control not installed"}' >> "$STEPS"
  echo '{"step":"estimator_accuracy","skipped":"needs MPS quotas; nvidia-cuda-mps-control not installed"}' >> "$STEPS"
else
  # Short path under /tmp: the pipe is a unix socket (108-byte path limit).
  MPS_ROOT=$(mktemp -d /tmp/tessera-mps.XXXXXX)
  mkdir -p "$MPS_ROOT/pipe" "$MPS_ROOT/log"; chmod 700 "$MPS_ROOT/pipe" "$MPS_ROOT/log"
  if CUDA_MPS_PIPE_DIRECTORY="$MPS_ROOT/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_ROOT/log" \
       CUDA_VISIBLE_DEVICES="${GPU0_UUID:-0}" nvidia-cuda-mps-control -d; then
    for _ in $(seq 50); do [ -e "$MPS_ROOT/pipe/control" ] && break; sleep 0.1; done
    step mps_quota 180 "$PY" bench/gpu/mps_quota.py --mps-root "$MPS_ROOT" --gpu-uuid "$GPU0_UUID" \
      --quotas 30,70 --json "$DIR/mps_quota.json"
    tail -n 3 "$DIR/mps_quota.log"
    # The estimator's GPU variant needs the daemon too: MPS quotas 10-100 % on GPU 0.
    step estimator_accuracy 200 env CUDA_MPS_PIPE_DIRECTORY="$MPS_ROOT/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_ROOT/log" \
      CUDA_VISIBLE_DEVICES="${GPU0_UUID:-0}" "$PY" -m bench.estimator_accuracy --device cuda --json "$DIR/estimator_accuracy.json"
    tail -n 12 "$DIR/estimator_accuracy.log"
  else
    echo '{"step":"mps_quota","skipped":"nvidia-cuda-mps-control -d failed"}' >> "$STEPS"
  fi
  mps_quit   # the benchmarks below run without MPS
fi

# -- 4. the runtime benchmarks that exist, each bounded ------------------------------------
for mod in peft_mux mm_colocate mm_reshard; do  # estimator_accuracy ran above, under MPS
  limit=60; extra=""
  # peft_mux starts 16 HF processes per round: one round on the GPU (device time is scarce)
  [ "$mod" = peft_mux ] && limit=120 && extra="--rounds 1"
  if "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('bench.$mod') else 1)" 2>/dev/null; then
    step "$mod" "$limit" "$PY" -m "bench.$mod" --device cuda --json "$DIR/$mod.json" $extra
  else
    echo "{\"step\":\"$mod\",\"skipped\":\"module bench.$mod not present\"}" >> "$STEPS"
  fi
done

summary true "ran on $(head -n1 "$DIR/nvidia-smi-L.txt")"
echo "results in $DIR (total ${SECONDS}s)"

#!/usr/bin/env bash
# The workplace device tool's one call: bench/gpu/run.sh into a scratch folder, then what
# comes back from $OUT (at most 8 files, no deep folders): gpu.tgz with every file
# (logs, mps-log/, steps.jsonl, ...) and, beside it, the JSON documents read first.
#   run(command="bash bench/gpu/device_run.sh", timeout_s=590)
# The run is bounded at 565 s (run.sh's own budget is 540 s), so the bundle is always
# written inside the call's 590 s. Without $OUT (elsewhere) everything stays in
# bench/out/gpu and no bundle is made.
set -u
cd "$(dirname "$0")/../.."
if [ -z "${OUT:-}" ]; then
  exec bash bench/gpu/run.sh
fi
WORK=$(mktemp -d /tmp/tessera-gpu.XXXXXX)
timeout 30 nvidia-smi --query-gpu=name,compute_mode,persistence_mode,mig.mode.current,driver_version \
  --format=csv > "$WORK/gpu-modes.txt" 2>&1
cat "$WORK/gpu-modes.txt"
PYTHONUNBUFFERED=1 OUT="$WORK" timeout -k 5 565 bash bench/gpu/run.sh
rc=$?
tar czf "$OUT/gpu.tgz" -C "$WORK" .
for f in summary estimator_accuracy peft_mux mm_colocate mm_reshard mps_quota; do
  [ -f "$WORK/$f.json" ] && cp "$WORK/$f.json" "$OUT/"
done
ls -la "$WORK"
exit $rc

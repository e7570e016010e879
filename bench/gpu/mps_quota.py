"""MPS quota check: two executors run the same fp16 matmul loop at once on one GPU under
an MPS daemon, with different SM quotas; each one's measured speed should follow its quota.

Contract: the MPS control daemon is already running with pipe/log directories
``<mps-root>/pipe`` and ``<mps-root>/log`` (bench/gpu/run.sh starts and quits it). The
client environments come from the agent's own MpsBackend grants (so this also checks
the env Tessera gives executors). Phases: each quota alone, then all together, each
measured for ``--seconds`` after warm-up, started on a shared wall-clock mark so the
concurrent runs really overlap. Writes one JSON object to ``--json``.

The SM percentage is a limit, not a reservation: alone, a 30% client is capped at 30%
of the SMs; together, 30% + 70% do not contend for SMs, so their speed ratio should be
near 70/30 for a compute-bound loop (memory bandwidth stays shared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def worker(args) -> None:
    import torch

    dev = torch.device("cuda")
    a = torch.randn(args.size, args.size, device=dev, dtype=torch.float16)
    b = torch.randn(args.size, args.size, device=dev, dtype=torch.float16)
    for _ in range(5):  # warm-up: context, cuBLAS handles, clocks
        a @ b
    torch.cuda.synchronize()
    time.sleep(max(0.0, args.start_at - time.time()))
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < args.seconds:
        for _ in range(5):
            a @ b
        torch.cuda.synchronize()
        n += 5
    dt = time.perf_counter() - t0
    flops = 2 * args.size ** 3 * n
    print(json.dumps({"iters": n, "seconds": dt, "iters_per_s": n / dt, "tflops": flops / dt / 1e12,
                      "quota": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
                      "mem_limit": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")}))


def run_phase(quotas: list[int], backend, args) -> list[dict]:
    """Run one client per quota concurrently; their results in quota order."""
    start_at = time.time() + args.warmup_s
    procs = []
    for i, q in enumerate(quotas):
        g = backend.grant(f"q{q}-{i}-{start_at}", backend.device_id, q, args.mem_gib * 1024 ** 3)
        env = g.apply_env(dict(os.environ))
        procs.append((q, g, subprocess.Popen(
            [sys.executable, __file__, "--worker", "--size", str(args.size), "--seconds", str(args.seconds),
             "--start-at", str(start_at)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    out = []
    deadline = time.monotonic() + args.warmup_s + args.seconds + 120
    try:
        for q, g, p in procs:
            try:
                so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                so, se = p.communicate()
                se = f"timed out after {args.warmup_s + args.seconds + 120:.0f} s; killed\n" + (se or "")
            row = {"quota": q, "exit_code": p.returncode}
            if p.returncode == 0:
                try:
                    row.update(json.loads(so.strip().splitlines()[-1]))
                except (ValueError, IndexError):
                    row.update(exit_code=-1, error=f"unreadable output: {so[-300:]!r}")
            else:
                row["error"] = (se or "")[-800:]
            out.append(row)
    finally:  # on any error or timeout: no client outlives the phase, every grant is released
        for _, g, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            try:
                backend.release(g.grant_id)
            except Exception:  # noqa: BLE001 - already released
                pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--mps-root", help="directory holding the running daemon's pipe/ and log/")
    ap.add_argument("--gpu-uuid", default="", help="the GPU the daemon serves")
    ap.add_argument("--quotas", default="30,70")
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup-s", type=float, default=15.0, help="time allowed for CUDA start-up before the mark")
    ap.add_argument("--mem-gib", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0

    from agent.devices import LocalDevice
    from agent.partitions import MpsBackend, MpsDaemon

    dev = LocalDevice(id="gpu0", kind="gpu", model="", memory_bytes=0, capacity=100, uuid=args.gpu_uuid, index=0)
    daemon = MpsDaemon(args.gpu_uuid or "0", Path(args.mps_root))
    daemon.running = True  # started by run.sh, which also quits it
    backend = MpsBackend(dev, Path(args.mps_root), daemon=daemon)
    quotas = [int(q) for q in args.quotas.split(",")]
    from bench._partial import write_json

    result = {"size": args.size, "seconds": args.seconds, "quotas": quotas, "solo": [], "concurrent": []}
    for q in quotas:  # the JSON after every phase: a step timeout keeps the phases done
        result["solo"].append(run_phase([q], backend, args)[0])
        write_json(args.json, result, complete=False)
    result["concurrent"] = run_phase(quotas, backend, args)
    ok = len(result["concurrent"]) == len(quotas) and all(r["exit_code"] == 0 for r in result["solo"] + result["concurrent"])
    if ok:
        conc = result["concurrent"]
        lo, hi = conc[0], conc[-1]
        ratio = hi["iters_per_s"] / lo["iters_per_s"]
        expected = hi["quota"] / lo["quota"]
        result.update(speed_ratio=ratio, quota_ratio=expected,
                      # "follows its quota": the bigger quota is faster, within a factor
                      # of 1.6 of the quota ratio (bandwidth and tail effects blur it).
                      follows_quota=bool(ratio > 1.0 and expected / 1.6 <= ratio <= expected * 1.6))
    result["ok"] = ok and result.get("follows_quota", False)
    (write_json(args.json, result, complete=True) if args.json else print(json.dumps(result, indent=1)))
    print(json.dumps({k: result.get(k) for k in ("ok", "speed_ratio", "quota_ratio")}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Page faults per training step, with the executors' heap kept and released.

``python -m bench.page_faults [--rounds N] [--bias RUN.json ...] [--json PATH]`` runs
every single-device, one-core ``gpt`` configuration of the accuracy benchmark's grid
(``bench.estimator_accuracy.grid``) as the grid runs it — a fresh process, WARMUP +
MEASURED steps (``bench._measure.run_jobs``) — and its one-core profile points as the
profiling job runs them (one process, in turn: ``bench._measure.profile_points``), under
``TESSERA_HEAP=release`` (glibc's defaults) and ``keep`` (``agent.runtime.heap``),
alternating the two per configuration and round. It prints per configuration the minor
page faults per measured step and the median step time under each, their ratio, and
the medians over the grid and over the profile points.

With ``--bias`` it also re-fits the stored accuracy runs given (``bench.estimator_refit``)
and correlates each grid configuration's mean signed estimation error over those runs
with its fault rate under ``release`` (faults per ms of step) — the heap those runs were
measured with, when their JSON has no ``heap`` or says ``release``: do configurations
that fault more read slower than the fitted model expects?

Measures; fits nothing. About 4 minutes with the default 2 rounds on 2 vCPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

from agent.runtime.heap import ENV, MODES
from bench import estimator_accuracy as ea

Key = tuple  # (model, batch, seq, micro_batches)


def configs() -> tuple[list[Key], list[Key]]:
    """(grid configurations, profile points): single-device, one core, gpt only."""
    grid = sorted({(j["model"], j["batch"], j["seq"], j["m"]) for p in ea.grid(False) for j in p["jobs"]
                   if len(p["jobs"]) == 1 and not j.get("shape") and not j["plan"] and j["q"] == 1})
    prof = [(n, b, s, m) for (n, b, s, q, m) in ea.PROFILE_POINTS if q == 1]
    return grid, prof


def _with_heap(mode: str, fn, *args, **kw):
    # The forked executors read TESSERA_HEAP when their runner starts (agent.runtime.heap).
    old = os.environ.get(ENV)
    os.environ[ENV] = mode
    try:
        return fn(*args, **kw)
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def measure(rounds: int) -> dict:
    """Per mode: per grid configuration and per profile point, lists (one entry per
    round) of ``(faults per measured step, median step seconds)``."""
    from bench._measure import profile_points, run_jobs

    grid, prof = configs()
    steps = ea.WARMUP + ea.MEASURED
    out = {m: {"grid": {k: [] for k in grid}, "profile": {k: [] for k in prof}} for m in MODES}
    for r in range(rounds):
        for i, k in enumerate(grid):
            order = MODES if (i + r) % 2 == 0 else MODES[::-1]
            for mode in order:
                res = _with_heap(mode, run_jobs, [{"workload": ea.workload(k[0], k[1], k[2], k[3], steps),
                                                   "cores": [[0]]}], ea.WARMUP)[0]
                out[mode]["grid"][k].append((res["faults"], res["step_s"]))
            print(f"round {r + 1}/{rounds}: {k[0]} {k[1]}x{k[2]} m={k[3]} done", file=sys.stderr, flush=True)
        warm = [ea.WARMUP] + [ea.WARM_WARMUP] * (len(prof) - 1)
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            pts, _ = _with_heap(mode, profile_points, [(ea.workload(n, b, s, m, w + ea.MEASURED), [0])
                                                       for (n, b, s, m), w in zip(prof, warm)], warm)
            for k, x in zip(prof, pts):
                out[mode]["profile"][k].append((x["faults"], x["step_s"]))
    return out


def summary(data: dict) -> dict:
    """Per configuration medians over rounds (faults per step, step seconds per mode and
    the keep / release step-time ratio of each round, median), and per kind (grid,
    profile) the median faults per step of each mode. Pure."""
    rows = []
    for kind in ("grid", "profile"):
        for k in data["release"][kind]:
            rel, kep = data["release"][kind][k], data["keep"][kind][k]
            f = {m: ea.faults_median([x[0] for x in data[m][kind][k]]) for m in MODES}
            rows.append({"kind": kind, "model": k[0], "batch": k[1], "seq": k[2], "micro_batches": k[3],
                         "faults_release": f["release"], "faults_keep": f["keep"],
                         "step_s_release": statistics.median(x[1] for x in rel),
                         "step_s_keep": statistics.median(x[1] for x in kep),
                         "keep_over_release": statistics.median(b[1] / a[1] for a, b in zip(rel, kep))})
    kinds = {}
    for kind in ("grid", "profile"):
        sel = [r for r in rows if r["kind"] == kind]
        kinds[kind] = {m: ea.faults_median([r[f"faults_{m}"] for r in sel]) for m in MODES}
        kinds[kind]["keep_over_release"] = statistics.median(r["keep_over_release"] for r in sel)
    return {"rows": rows, "kinds": kinds}


def bias(rows: list[dict], runs: list[str]) -> dict | None:
    """Correlation over grid configurations between the fault rate under ``release``
    (faults per ms of step) and the mean signed error (estimate / measured - 1, %) of
    the stored runs re-fitted with this code; None without a matching row."""
    from bench import estimator_refit as er

    err: dict[Key, list[float]] = {}
    used = 0
    for path in runs:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
        if run.get("heap", "release") != "release":
            continue
        used += 1
        for r in er.rows(run, er.refit(run)):
            if (r.get("ape") is None or r["quota"] != 1 or r["colocated"] != 1 or r["dp"] * r["tp"] * r["pp"] != 1
                    or not r["category"].startswith("single")):
                continue
            err.setdefault((r["module"], r["batch"], r["seq"], r["micro_batches"]), []).append(
                (r["estimated_s"] / r["measured_s"] - 1.0) * 100.0)
    pairs = [(r["faults_release"] / (r["step_s_release"] * 1e3), statistics.fmean(err[k]))
             for r in rows if r["kind"] == "grid" and r["faults_release"] is not None
             and (k := (r["model"], r["batch"], r["seq"], r["micro_batches"])) in err]
    if len(pairs) < 3:
        return None
    x, y = np.array(pairs).T
    slope, icpt = np.polyfit(x, y, 1)
    return {"n": len(pairs), "runs": used, "corr": float(np.corrcoef(x, y)[0, 1]),
            "slope_pct_per_fault_per_ms": float(slope), "intercept_pct": float(icpt),
            # slope % per (fault / ms) -> seconds per fault: -slope / 100 * 1e-3
            "implied_s_per_fault": float(-slope * 1e-5)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds per mode (default 2)")
    ap.add_argument("--bias", nargs="*", default=[], metavar="RUN.json",
                    help="stored accuracy runs to correlate with the fault rate")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    s = summary(measure(args.rounds))
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    print(f"{'kind':<8} {'config':<16} {'faults release':>14} {'faults keep':>11} {'ms release':>10} "
          f"{'ms keep':>8} {'keep/release':>12}")
    for r in s["rows"]:
        print(f"{r['kind']:<8} {r['model']} {r['batch']}x{r['seq']} m={r['micro_batches']:<6} "
              f"{fmt(r['faults_release']):>14} {fmt(r['faults_keep']):>11} {r['step_s_release'] * 1e3:>10.2f} "
              f"{r['step_s_keep'] * 1e3:>8.2f} {r['keep_over_release']:>12.3f}")
    for kind, v in s["kinds"].items():
        print(f"{kind}: median faults per measured step release {fmt(v['release'])}, keep {fmt(v['keep'])}; "
              f"median step time keep / release {v['keep_over_release']:.3f}")
    if args.bias:
        b = bias(s["rows"], args.bias)
        s["bias"] = b
        if b:
            print(f"stored runs ({b['runs']}, re-fitted): signed error vs faults per ms under release over "
                  f"{b['n']} grid configurations: correlation {b['corr']:.2f}, slope "
                  f"{b['slope_pct_per_fault_per_ms']:.3f} % per fault/ms (~{b['implied_s_per_fault'] * 1e6:.1f} us "
                  f"per fault)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Re-fit stored accuracy runs with this code's performance model.

``python -m bench.estimator_refit RUN.json [RUN.json ...]`` takes JSONs written by
``python -m bench.estimator_accuracy --json`` (each holds every profile sample,
colocation pair, comm row and peft/multimodal profile of its run, and the measured grid)
and re-fits the model from those profiles with the code checked out now, then compares
it with the same measured grid. It measures nothing: it answers "what would this model
have estimated on those measurements", so that a change to the model is judged on many
stored runs of one protocol rather than on one new run of a drifting host. Prints, per
run, the single-device and multi-rank MAPE as stored and as re-fitted and the grid's own
truth noise (``estimator_accuracy.truth_noise``: what a perfect model would score on
that run's host) and how well the re-fitted estimates' confidence matched their errors
(``estimator_accuracy.calibration``), the executors' heap policy and page faults it
recorded (:func:`heap_line`), and the mean per category over the runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

from bench import estimator_accuracy as ea
from tessera.perfmodel import ComputeSample, PerfModel, fit_compute, fit_interference


def refit(run: dict) -> PerfModel:
    """The model this code fits from a stored run's profiles (its comm fit, interference
    reference and peft/multimodal profiles as the run stored them)."""
    stored = PerfModel.from_dict(run["model"])
    samples = [ComputeSample(**s) for s in run["profile_samples"]]
    # Runs stored before the samples carried their spread: the same figure from their rounds.
    rounds = run.get("profile_rounds") or {}
    keys = [ea.point_key((s.module, s.rows, s.seq, s.q, s.micro_batches)) for s in samples]
    samples = [s if s.spread or not rounds.get(k) else replace(s, spread=ea.measurement_spread(rounds[k]))
               for s, k in zip(samples, keys)]
    return PerfModel(version=1, compute={ea.DEVICE: fit_compute(ea.DEVICE, samples)}, comm=stored.comm,
                     interference={ea.DEVICE: fit_interference(run["colocation_pairs"])},
                     interference_ref=stored.interference_ref, profiles=stored.profiles)


def rows(run: dict, model: PerfModel) -> list[dict]:
    """The run's grid rows as ``estimator_accuracy.evaluate`` makes them with ``model``
    (the benchmark's own candidates and statistics, against the stored measurements)."""
    stored = iter(run["rows"])
    measured = []
    for g in run["grid_rounds"]:
        got = [next(stored, None) for _ in g["jobs"]]
        if None in got:
            raise ValueError(f"fewer stored rows than the {len(run['grid_rounds'])} grid points' jobs: another grid")
        measured.append({**g, "measured": [r["measured_s"] for r in got], "raw": [r["measured_raw_s"] for r in got]})
    if next(stored, None) is not None:
        raise ValueError("more stored rows than the grid points' jobs: another grid")
    return ea.evaluate(model, measured)["rows"]


def summary(rs: list[dict]) -> tuple[float | None, float | None, dict[str, float | None]]:
    """(single-device MAPE, multi-rank MAPE, per-category MAPE) over rows with an estimate."""
    cats = sorted({r["category"] for r in rs})
    return (ea.mape([r for r in rs if not r["category"].startswith("multi_")]),
            ea.mape([r for r in rs if r["category"].startswith("multi_")]),
            {c: ea.mape([r for r in rs if r["category"] == c]) for c in cats})


def heap_line(run: dict) -> str:
    """How a stored run's executors held their heap (``agent.runtime.heap``; runs before
    the benchmark recorded it: glibc's defaults) and the page faults per measured step it
    recorded, if any."""
    fmt = lambda v: "not recorded" if v is None else f"{v:.0f}"  # noqa: E731
    return (f"heap {run.get('heap', 'release (not recorded)')}; page faults per measured step: grid "
            f"{fmt(run.get('faults_per_step_grid'))}, profile points {fmt(run.get('faults_per_step_profiles'))}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", metavar="RUN.json")
    args = ap.parse_args(argv)
    per_cat: dict[str, list[float]] = {}
    singles, multis, cals = [], [], []
    print(f"{'run':<40} {'single stored':>13} {'re-fit':>7} {'multi stored':>12} {'re-fit':>7} {'noise s/m':>11}")
    for path in args.runs:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
        rs = rows(run, refit(run))
        s, mu, cats = summary(rs)
        noise = [ea.mape([r for r in rs if r["category"].startswith("multi_") == multi], "truth_noise")
                 for multi in (False, True)]
        cal = [ea.calibration([r for r in rs if r["category"].startswith("multi_") == multi])
               for multi in (False, True)]
        singles.append(s)
        multis.append(mu)
        cals.append(cal)
        for c, v in cats.items():
            if v is not None:
                per_cat.setdefault(c, []).append(v)
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"{path[-40:]:<40} {fmt(run.get('mape_single')):>13} {fmt(s):>7} {fmt(run.get('mape_multi')):>12} "
              f"{fmt(mu):>7} {fmt(noise[0]) + '/' + fmt(noise[1]):>11}")
        print(f"{'':<40} {ea.calibration_line(*cal)}")
        print(f"{'':<40} {heap_line(run)}")
    ok_s = [v for v in singles if v is not None]
    ok_m = [v for v in multis if v is not None]
    if ok_s and ok_m:
        print(f"mean re-fit: single-device {statistics.fmean(ok_s):.2f} % ({sum(v <= 4 for v in ok_s)} of {len(ok_s)} "
              f"runs <= 4 %), multi-rank {statistics.fmean(ok_m):.2f} % ({sum(v <= 6 for v in ok_m)} <= 6 %)")
    mean_cal = [{k: statistics.fmean(c[i][k] for c in cals if c[i]) for k in ("within_tolerance", "mean_confidence",
                                                                                "rms_z")}
                if any(c[i] for c in cals) else None for i in (0, 1)]
    print("mean over runs, " + ea.calibration_line(*mean_cal))
    print("per category (mean over runs): " + ", ".join(f"{c} {statistics.fmean(v):.2f}" for c, v in per_cat.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

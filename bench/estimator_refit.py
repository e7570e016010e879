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

``--rounds K`` answers "what would fewer rounds have scored": each run as if it had
measured only K of its rounds — its profiles, comm rows, colocation pairs, peft /
multimodal profiles *and* its grid's truth from those rounds alone (:func:`subset`) —
averaged over K-subsets of its rounds, beside the same from all of them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
from dataclasses import replace

from bench import estimator_accuracy as ea
from tessera.perfmodel import ComputeSample, PerfModel


def refit(run: dict, rank_profiles: bool = True) -> PerfModel:
    """The model this code fits from a stored run's profiles: compute, comm (from its comm
    rows, ``estimator_accuracy.comm_kept``), interference and the peft / multimodal
    profile points (from their per-round steps, ``estimator_accuracy.workload_points``);
    a run that did not keep the rows or steps, its stored comm fit and points. Its
    interference reference as stored; then the rank modes' interference from its rank
    profiles (runs stored before them have none; ``rank_profiles`` False: left out, its
    multi-rank plans priced as before them), against that model's comm fit."""
    stored = PerfModel.from_dict(run["model"])
    samples = [ComputeSample(**s) for s in run["profile_samples"]]
    # Runs stored before the samples carried their spread: the same figure from their rounds.
    rounds = run.get("profile_rounds") or {}
    keys = [ea.point_key((s.module, s.rows, s.seq, s.q, s.micro_batches)) for s in samples]
    samples = [s if s.spread or not rounds.get(k) else replace(s, spread=ea.measurement_spread(rounds[k]))
               for s, k in zip(samples, keys)]
    wrounds = run.get("workload_profile_rounds") or {}
    wp = [p for name, rr in wrounds.items() for p in ea.workload_points(name, rr)]
    model = ea.fit_model(samples, run.get("comm_rows") or [], run["colocation_pairs"], wp, stored.interference_ref)
    model = replace(model, comm=model.comm if run.get("comm_rows") else stored.comm,
                    profiles=model.profiles if wp else stored.profiles)
    return ea.with_rank_profiles(model, run.get("rank_profiles") if rank_profiles else None)


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


def _per_round(items: list, rounds: int, what: str) -> list[list]:
    """``items`` (appended round by round, the same count each round) cut into rounds."""
    if rounds < 1 or len(items) % rounds:
        raise ValueError(f"{len(items)} stored {what} do not split into {rounds} rounds")
    per = len(items) // rounds
    return [items[i * per:(i + 1) * per] for i in range(rounds)]


def subset(run: dict, keep: tuple[int, ...], rank_profiles: bool = True) -> tuple[PerfModel, list[dict]]:
    """(model, measured grid) of a stored run as if it had measured only its rounds
    ``keep`` (indices): every profile point's fields from those rounds
    (``estimator_accuracy.point_stats``), the comm rows, colocation pairs and peft /
    multimodal profiles and rank profiles (unless ``rank_profiles`` is False) of those
    rounds, and each grid point's value from its rounds ``keep``
    (``estimator_accuracy.grid_values``). ``keep`` = every round gives the
    re-fit of :func:`refit` and the stored grid. ValueError for a run that did not keep
    its per-round data (before 2026-12-05) or an index out of range."""
    n = int(run["rounds"])
    if not keep or any(not 0 <= i < n for i in keep):
        raise ValueError(f"rounds {list(keep)}: the run measured rounds 0..{n - 1}")
    if not run.get("profile_rounds") or not all(g.get("job_rounds") for g in run["grid_rounds"]):
        raise ValueError("the run kept no per-round profiles or grid rounds")
    fb = run.get("profile_mb_frac_rounds") or {}
    samples = []
    for s in run["profile_samples"]:
        k = ea.point_key((s["module"], s["rows"], s["seq"], s["q"], s["micro_batches"]))
        rounds = run["profile_rounds"][k]
        if len(rounds) != n:
            raise ValueError(f"profile point {k}: {len(rounds)} rounds stored, the run measured {n}")
        fracs = fb.get(k) or [None] * n
        samples.append(ComputeSample(**{**s, **ea.point_stats([rounds[i] for i in keep], [fracs[i] for i in keep])}))
    stored = run["colocation_pairs"]
    if stored and all("round" in p for p in stored):  # kept with their round (a failed one skipped)
        pairs = [[p for p in stored if p["round"] == i] for i in range(n)]
    else:
        pairs = _per_round(stored, n, "colocation pairs")
    comm = _per_round(run["comm_rows"], n, "comm rows")
    wp = [p for name, rr in (run.get("workload_profile_rounds") or {}).items()
          for p in ea.workload_points(name, [rr[i] for i in keep])]
    ranks = [{**r, "rounds": [r["rounds"][i] for i in keep]} for r in run.get("rank_profiles") or []
             if rank_profiles]
    model = ea.fit_model(samples, [r for i in keep for r in comm[i]], [p for i in keep for p in pairs[i]], wp,
                         PerfModel.from_dict(run["model"]).interference_ref, ranks)
    measured = []
    for g in run["grid_rounds"]:
        jr = [g["job_rounds"][i] for i in keep]
        measured.append({**g, **ea.grid_values(jr), "job_rounds": jr})
    return model, measured


def subsets(n: int, k: int, most: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Every k-subset of range(n) in order, or ``most`` of them drawn without repeats
    (deterministic for ``seed``) when there are more."""
    every = list(itertools.combinations(range(n), k))
    return every if len(every) <= most else sorted(random.Random(seed).sample(every, most))


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
    ap.add_argument("--rounds", type=int, default=None, metavar="K",
                    help="re-fit each run as if it had measured only K of its rounds (profiles and grid alike; "
                         "the mean over K-subsets of its rounds) — what fewer rounds would have scored")
    ap.add_argument("--subsets", type=int, default=40, metavar="N",
                    help="with --rounds: at most N subsets per run (drawn at random, seed 0; default 40)")
    ap.add_argument("--no-rank-profiles", action="store_true",
                    help="leave the runs' rank profiles out: their multi-rank plans priced with the split pair's g, "
                         "as before the rank profiles (2026-12-07)")
    args = ap.parse_args(argv)
    ranks = not args.no_rank_profiles
    if args.rounds is not None:
        if args.rounds < 1 or args.subsets < 1:
            ap.error("--rounds and --subsets must be at least 1")
        return main_rounds(args.runs, args.rounds, args.subsets, ranks)
    per_cat: dict[str, list[float]] = {}
    singles, multis, cals = [], [], []
    print(f"{'run':<40} {'single stored':>13} {'re-fit':>7} {'multi stored':>12} {'re-fit':>7} {'noise s/m':>11}")
    for path in args.runs:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
        rs = rows(run, refit(run, ranks))
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


def main_rounds(paths: list[str], k: int, most: int, rank_profiles: bool = True) -> int:
    """``--rounds K``: per run, the mean single-device and multi-rank MAPE over (at most
    ``most``) K-subsets of its rounds (:func:`subset`), beside the same over all its
    rounds; then the means over the runs that measured at least K rounds."""
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"{'run':<40} {'rounds':>6} {'subsets':>7} {'single K':>8} {'all':>6} {'multi K':>7} {'all':>6}")
    got: list[tuple[float, float, float, float]] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
        n = int(run["rounds"])
        if k > n:
            print(f"{path[-40:]:<40} {n:>6} skipped: fewer than {k} rounds")
            continue
        try:
            full = summary(ea.evaluate(*subset(run, tuple(range(n)), rank_profiles))["rows"])[:2]
            picks = subsets(n, k, most)
            per = [summary(ea.evaluate(*subset(run, keep, rank_profiles))["rows"])[:2] for keep in picks]
        except ValueError as e:
            print(f"{path[-40:]:<40} {n:>6} skipped: {e}")
            continue
        sk = statistics.fmean(v[0] for v in per)
        mk = statistics.fmean(v[1] for v in per)
        got.append((sk, full[0], mk, full[1]))
        print(f"{path[-40:]:<40} {n:>6} {len(picks):>7} {sk:>8.2f} {fmt(full[0]):>6} {mk:>7.2f} {fmt(full[1]):>6}")
    if got:
        m = [statistics.fmean(g[i] for g in got) for i in range(4)]
        print(f"mean over {len(got)} runs: single-device {m[0]:.2f} % from {k} rounds ({m[1]:.2f} from all), "
              f"multi-rank {m[2]:.2f} % ({m[3]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

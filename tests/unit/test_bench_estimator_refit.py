"""bench.estimator_refit: a stored accuracy run re-fitted with this code's model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import estimator_refit as er

RUN = Path(__file__).resolve().parents[2] / "docs" / "figures" / "estimator_accuracy_s15a.json"


def test_a_stored_run_is_refitted_and_every_grid_row_estimated():
    run = json.loads(RUN.read_text())
    model = er.refit(run)
    assert model.compute["cpu"].status == "ok"
    rs = er.rows(run, model)
    assert len(rs) == len(run["rows"]) and all(r["estimated_s"] is not None for r in rs)
    single, multi, cats = er.summary(rs)
    assert set(cats) == set(run["categories"])
    assert all(math.isfinite(v) and 0 <= v < 50 for v in (single, multi, *cats.values()))


def test_a_run_with_a_rank_profile_refits_its_g_and_can_leave_it_out():
    """Run s27c kept its rank profile's rounds (a pp = 2 pipeline, stored as mode "ranks"):
    the re-fit gives it this code's mode, "pipeline", which prices the run's pp = 2 rows
    (above what they read without it) and leaves its dp / tp rows to the split pair's g;
    ``--no-rank-profiles`` (``rank_profiles=False``) leaves it out."""
    run = json.loads((RUN.parent / "estimator_accuracy_s27c.json").read_text())
    assert [r["mode"] for r in run["rank_profiles"]] == ["ranks"] and run["rank_profiles"][0]["job"]["plan"]["pp"] == 2
    model = er.refit(run)
    assert model.interference["cpu"]["pipeline"] > 0 and "ranks" not in model.interference["cpu"]
    without = er.refit(run, rank_profiles=False)
    assert "pipeline" not in without.interference["cpu"] and "ranks" not in without.interference["cpu"]
    multi = [r for r in er.rows(run, model) if r["category"].startswith("multi_")]
    bare = [r for r in er.rows(run, without) if r["category"].startswith("multi_")]
    assert len(multi) == len(bare) == 29
    for a, b in zip(multi, bare):
        if a["pp"] > 1:
            assert a["estimated_s"] > b["estimated_s"]
        else:
            assert a["estimated_s"] == pytest.approx(b["estimated_s"], rel=1e-12)
    sub, _ = er.subset(run, tuple(range(run["rounds"])), rank_profiles=False)
    assert "pipeline" not in sub.interference["cpu"]


def test_a_run_of_another_grid_is_refused():
    run = json.loads(RUN.read_text())
    run["rows"] = run["rows"][:-1]
    with pytest.raises(ValueError, match="another grid"):
        er.rows(run, er.refit(run))


def test_the_estimates_come_from_the_refitted_profiles():
    """Scaling every stored profile time by 2 doubles every single-rank gpt estimate."""
    run = json.loads(RUN.read_text())
    base = er.rows(run, er.refit(run))
    slow = dict(run, profile_samples=[dict(s, seconds=2 * s["seconds"], mb_seconds=2 * s["mb_seconds"])
                                      for s in run["profile_samples"]])
    doubled = er.rows(slow, er.refit(slow))
    pairs = [(a["estimated_s"], b["estimated_s"]) for a, b in zip(base, doubled)
             if a["category"].startswith("single_")]
    assert pairs and all(b == pytest.approx(2 * a, rel=1e-6) for a, b in pairs)


def test_the_heap_line_says_what_a_run_recorded():
    from bench.estimator_refit import heap_line

    assert heap_line({}) == ("heap release (not recorded); page faults per measured step: grid not recorded, "
                             "profile points not recorded")
    line = heap_line({"heap": "keep", "faults_per_step_grid": 28.4, "faults_per_step_profiles": 1.7})
    assert line == "heap keep; page faults per measured step: grid 28, profile points 2"


# A run that kept every round's data (profiles, comm rows, pairs, peft / multimodal profiles, grid).
ROUNDS_RUN = RUN.with_name("estimator_accuracy_s21c.json")


def test_a_subset_of_every_round_is_the_refit():
    run = json.loads(ROUNDS_RUN.read_text())
    model, measured = er.subset(run, tuple(range(run["rounds"])))
    got = er.summary(er.ea.evaluate(model, measured)["rows"])[:2]
    want = er.summary(er.rows(run, er.refit(run)))[:2]
    assert got == pytest.approx(want, rel=1e-9)


def test_a_subset_measures_profiles_and_truth_from_its_rounds_only():
    run = json.loads(ROUNDS_RUN.read_text())
    keep = (0, 2, 4)
    model, measured = er.subset(run, keep)
    g = run["grid_rounds"][0]
    want = er.ea.grid_values([g["job_rounds"][i] for i in keep])["measured"]
    assert measured[0]["measured"] == want and len(measured[0]["job_rounds"]) == 3
    assert want != er.ea.grid_values(g["job_rounds"])["measured"]
    # The fit sees the subset's profile times: scaling those rounds' times scales every gpt estimate.
    slow = dict(run, profile_rounds={k: [2 * v if i in keep else v for i, v in enumerate(r)]
                                     for k, r in run["profile_rounds"].items()})
    base = er.ea.evaluate(model, measured)["rows"]
    doubled = er.ea.evaluate(*er.subset(slow, keep))["rows"]
    pairs = [(a["estimated_s"], b["estimated_s"]) for a, b in zip(base, doubled) if a["category"].startswith("single_")]
    assert pairs and all(b == pytest.approx(2 * a, rel=1e-6) for a, b in pairs)


def test_a_subset_refuses_rounds_the_run_did_not_measure_or_keep():
    run = json.loads(ROUNDS_RUN.read_text())
    with pytest.raises(ValueError, match="rounds 0..4"):
        er.subset(run, (0, 5))
    with pytest.raises(ValueError, match="rounds 0..4"):
        er.subset(run, ())
    with pytest.raises(ValueError, match="per-round"):
        er.subset(dict(run, profile_rounds={}), (0, 1))
    with pytest.raises(ValueError, match="comm rows do not split into 5 rounds"):
        er.subset(dict(run, comm_rows=run["comm_rows"][:-1]), (0, 1))


def test_subsets_are_every_combination_or_a_fixed_draw():
    assert er.subsets(5, 4, 10) == [(0, 1, 2, 3), (0, 1, 2, 4), (0, 1, 3, 4), (0, 2, 3, 4), (1, 2, 3, 4)]
    drawn = er.subsets(9, 5, 7)
    assert len(drawn) == len(set(drawn)) == 7 and drawn == er.subsets(9, 5, 7)
    assert all(len(s) == 5 and list(s) == sorted(s) for s in drawn)


def test_rounds_option_prints_each_run_and_the_mean(capsys):
    assert er.main(["--rounds", "4", "--subsets", "2", str(ROUNDS_RUN), str(RUN)]) == 0
    out = capsys.readouterr().out
    assert "estimator_accuracy_s21c.json" in out and "skipped" in out  # s15a kept no per-round data
    assert "mean over 1 runs: single-device" in out


def test_a_subset_takes_the_pairs_of_its_rounds_by_their_round_when_one_was_skipped():
    """Pairs kept with their ``round`` (a run whose colocation profile failed in a round
    has none for it): a subset takes those of its rounds, not a count per round."""
    run = json.loads(ROUNDS_RUN.read_text())
    n = run["rounds"]
    per = len(run["colocation_pairs"]) // n
    tagged = [{**p, "round": i // per} for i, p in enumerate(run["colocation_pairs"])]
    full = er.subset({**run, "colocation_pairs": tagged}, tuple(range(n)))[0]
    assert full.interference == er.subset(run, tuple(range(n)))[0].interference
    skipped = [p for p in tagged if p["round"] != 1]  # round 1's pairs failed
    a = er.subset({**run, "colocation_pairs": skipped}, (0, 2))[0]
    b = er.subset({**run, "colocation_pairs": tagged}, (0, 2))[0]
    assert a.interference == b.interference  # rounds 0 and 2 are whole either way
    c = er.subset({**run, "colocation_pairs": skipped}, (1,))[0]
    assert c.interference != b.interference  # round 1 alone: no pair measured

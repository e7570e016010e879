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

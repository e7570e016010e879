"""The accuracy benchmark with rows the model cannot estimate (a run whose split
colocation profile failed in every round: every multi-rank and colocate_split row is
insufficient_data): the JSON is written, the failed rows are counted per category and in
all, the table says it is not a full result — it used to crash printing None after a
9-minute run and write nothing. And the cost ratio at one protocol (the grid's pairs and
peft / multimodal runs costed at the profiles' measured steps). A stored run (s26b)
stands in for the measurements (``measure`` replaced); nothing is run."""

from __future__ import annotations

import json
from pathlib import Path

from bench import estimator_accuracy as ea
from bench import estimator_refit as er

RUN = Path(__file__).resolve().parents[2] / "docs" / "figures" / "estimator_accuracy_s26b.json"
PROF_KEYS = ("profile_samples", "comm_rows", "colocation_steps", "colocation_skipped", "profile_rounds",
             "profile_mb_frac_rounds", "profile_faults_rounds", "workload_profiles", "workload_profile_rounds",
             "workload_wall_s")


def _measured(run: dict) -> list[dict]:
    rows, out = iter(run["rows"]), []
    for g in run["grid_rounds"]:
        got = [next(rows) for _ in g["jobs"]]
        out.append({**g, "measured": [r["measured_s"] for r in got], "raw": [r["measured_raw_s"] for r in got],
                    "cpu_util": None, "faults_per_step": None})
    return out


def test_failed_estimates_are_counted_and_the_json_written(tmp_path, monkeypatch, capsys):
    run = json.loads(RUN.read_text())
    run["colocation_pairs"] = [p for p in run["colocation_pairs"] if p["mode"] != "split"]
    model, measured = er.refit(run), _measured(run)
    prof = {k: run[k] for k in PROF_KEYS}
    prof.update(cost=run["profile_cost"], samples=12, pairs=run["colocation_pairs"])
    monkeypatch.setattr(ea, "measure", lambda points, rounds: (model, prof, measured, run["grid_device_s"]))
    monkeypatch.setattr(ea, "grid", lambda quick: [])
    out = tmp_path / "run.json"
    assert ea.main(["--json", str(out)]) == 0
    doc = json.loads(out.read_text())  # strict JSON: no NaN for a failed row's rel_std
    assert doc["failed_multi"] == 29 and doc["failed_single"] == 10
    assert doc["categories"]["colocate_split"]["failed"] == 10 and doc["categories"]["colocate_split"]["mape"] is None
    assert doc["categories"]["single_batch_seq"]["failed"] == 0 and doc["mape_multi"] is None
    failed = [r for r in doc["rows"] if r["estimated_s"] is None]
    assert len(failed) == 39 and all(r["reason"] and r["rel_std"] is None for r in failed)
    text = capsys.readouterr().out
    assert "NOT A FULL RESULT" in text and "29 multi-rank rows" in text


def test_the_cost_ratio_at_the_profiles_step_counts():
    run = json.loads(RUN.read_text())
    measured = _measured(run)
    extra = ea.extra_step_device_s(measured, run["rounds"])
    # pairs: 5 extra steps of the slower job on 1 or 2 cores; peft / multimodal runs: 19
    pairs = sum(5 * max(p["raw"]) * len({c for j in p["jobs"] for rc in j["cores"] for c in rc}) * run["rounds"]
                for p in measured if len(p["jobs"]) == 2)
    assert 0 < pairs < extra < run["grid_device_s"] / 5
    ratio = (run["grid_device_s"] - extra) / run["profile_device_s"]
    assert 9.0 < ratio < run["profiling_cost_ratio"]


def test_a_json_path_that_cannot_be_written_is_refused_before_measuring(tmp_path, monkeypatch, capsys):
    import pytest

    def never(points, rounds):
        raise AssertionError("measured")

    monkeypatch.setattr(ea, "measure", never)
    for bad in (tmp_path / "missing" / "run.json", tmp_path):
        with pytest.raises(SystemExit) as e:
            ea.main(["--json", str(bad)])
        assert e.value.code == 2
        assert "--json" in capsys.readouterr().err

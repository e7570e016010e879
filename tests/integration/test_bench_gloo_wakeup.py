"""bench.gloo_wakeup runs end to end (tiny settings) and writes its JSON contract."""

from __future__ import annotations

import json
import os

import pytest

from bench import gloo_wakeup

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not hasattr(os, "SCHED_BATCH"),
                                reason="two cores and Linux scheduling policies")


def test_bench_writes_its_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(gloo_wakeup, "CONFIGS", gloo_wakeup.CONFIGS[:1])
    out = tmp_path / "gw.json"
    assert gloo_wakeup.main(["--reps", "4", "--rounds", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["allreduce"]) == {str(n) for n in gloo_wakeup.SIZES}
    for per_mode in doc["allreduce"].values():
        assert set(per_mode) == {"normal", "batch"}
        assert all(m["n"] == 4 and m["mean_ms"] > 0 for m in per_mode.values())
    (label,) = doc["steps_ms"]
    assert doc["steps_ms"][label]["normal"] > 0 and doc["steps_ms"][label]["batch"] > 0
    assert set(doc["allreduce_mean_speedup"]) == set(doc["allreduce"]) and label in doc["step_speedup"]
    assert os.environ.get("TESSERA_GLOO_BATCH_LOOP") is None  # the bench restores the environment


def test_bench_leaves_logging_alone(monkeypatch):
    """main() in-process must not reconfigure structlog (later tests capture info logs)."""
    import structlog

    monkeypatch.setattr(gloo_wakeup, "collectives", lambda mode, reps: {n: [0.1] for n in gloo_wakeup.SIZES})
    monkeypatch.setattr(gloo_wakeup, "step_ms", lambda *a, **k: 1.0)
    before = structlog.get_config()
    assert gloo_wakeup.main(["--reps", "1", "--rounds", "1"]) == 0
    assert structlog.get_config() == before


@pytest.mark.parametrize("flag", ["--reps", "--rounds"])
def test_bench_rejects_nonpositive_counts(flag, capsys):
    with pytest.raises(SystemExit) as e:
        gloo_wakeup.main([flag, "0"])
    assert e.value.code == 2 and flag in capsys.readouterr().err

"""A profiled run's forward + backward phases reach its profile point and the compute
fit: reported by every measured step they give the point its ``mb_s``; a step without
them, or with a bad value, leaves it 0 (the fit then uses the step time alone)."""

from __future__ import annotations

import math
import statistics

import pytest

from estimator.models import WARMUP_STEPS, build_model, fb_seconds, profiles
from estimator.store import MeasurementStore, Retention
from tests.unit.test_estimator_retention import step


def phased(seq: int, i: int, t: float, fwd: float | None, bwd: float | None, **labels):
    m = step("a", seq, t=t, i=i, world_size="1", **labels)
    m.phases.clear()
    if fwd is not None:
        m.phases["forward"] = fwd
    if bwd is not None:
        m.phases["backward"] = bwd
    return m


def test_fb_seconds_is_total():
    assert fb_seconds({"forward": 0.01, "backward": 0.02, "optimizer": 0.5}) == pytest.approx(0.03)
    for bad in ({}, {"forward": 0.01}, {"backward": 0.01}, {"forward": math.nan, "backward": 0.01},
                {"forward": -0.01, "backward": 0.02}, {"forward": math.inf, "backward": 0.0}):
        assert fb_seconds(bad) == 0.0, bad


async def test_phases_give_the_profile_its_forward_backward_and_survive_a_restart(tmp_path):
    s = MeasurementStore(tmp_path, Retention(step_window=10, run_steps=8), compact_bytes=0)
    fbs = [0.006, 0.0062, 0.0058, 0.0061, 0.0063, 0.006]
    ms = [phased(n, n, 0.01, fb * 0.4, fb * 0.6) for n, fb in enumerate([0.05] * WARMUP_STEPS + fbs, 1)]
    await s.append(ms)
    (p,) = profiles(s.runs, s.run_fb)
    assert p.mb_s == pytest.approx(statistics.median(fbs))
    assert p.sample().mb_seconds == pytest.approx(p.mb_s)
    assert profiles(s.runs)[0].mb_s == 0.0  # no phases given: not measured
    before = {k: dict(v) for k, v in s.run_fb.items()}
    s.close()
    s2 = MeasurementStore(tmp_path, Retention(step_window=10, run_steps=8), compact_bytes=0)  # replays the log
    assert {k: dict(v) for k, v in s2.run_fb.items()} == before
    s2.close()


async def test_a_measured_step_without_phases_leaves_the_point_unsplit(tmp_path):
    s = MeasurementStore(tmp_path, Retention(step_window=10, run_steps=8), compact_bytes=0)
    ms = [phased(n, n, 0.01, 0.003, 0.003) for n in range(1, WARMUP_STEPS + 6)]
    ms[-1] = phased(len(ms), len(ms), 0.01, 0.003, None)  # the last measured step lost its backward
    await s.append(ms)
    (p,) = profiles(s.runs, s.run_fb)
    assert p.mb_s == 0.0 and p.median_s == pytest.approx(0.01)
    rev = s.model_revision
    await s.append([phased(len(ms) + 1, len(ms), 0.01, 0.003, 0.003)])  # that step resent, now whole
    assert s.model_revision == rev + 1  # its phases changed: a model input changed
    (p,) = profiles(s.runs, s.run_fb)
    assert p.mb_s == pytest.approx(0.006)
    s.close()


def test_build_model_fits_with_the_split():
    """Twelve profiled configurations whose steps carry forward + backward: the fit is
    ok and takes the split (its per-step part matches what the steps left outside it)."""
    from tests.unit.test_perfmodel_fit import TRUE, synth_time
    from tessera.perfmodel import ComputeSample

    runs, fb = {}, {}
    zero_mb = {**TRUE, "c_flops": 0.0, "c_elems": 0.0, "c_ops": 0.0, "c_mb": 0.0}
    for j, ((layers, hidden), (rows, seq), q) in enumerate(
            [(lh, rs, q) for lh in ((2, 64), (4, 128)) for rs in ((4, 32), (16, 64), (8, 16)) for q in (1, 2)]):
        cs = ComputeSample(module="m", rows=rows, seq=seq, layers=layers, hidden=hidden, heads=4, vocab=256, q=q,
                           seconds=1.0, seq_len=seq)
        # Two quota levels (1, 2): the fit's form has q_mem = 1 there; so has the truth.
        total, per_step = synth_time(cs, q_mem=1.0), synth_time(cs, coef=zero_mb, q_mem=1.0)
        key = (f"j{j}", "cpu", f"gpt:l{layers}-h{hidden}-a4-s{seq}-v256", layers, hidden, 4, 256, seq, rows, 1,
               float(q))
        n = WARMUP_STEPS + 5
        runs[key] = {i: total for i in range(1, n + 1)}
        fb[key] = {i: total - per_step for i in range(1, n + 1)}
    m = build_model(runs, [], [], 1, fb)
    fit = m.compute["cpu"]
    assert fit.status == "ok", fit.reason
    for k in ("c_params", "c_tensors", "c_seq", "c_cold"):
        assert fit.coef[k] == pytest.approx(TRUE[k], rel=1e-3), k

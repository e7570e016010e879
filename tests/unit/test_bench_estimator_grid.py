"""The estimator benchmark's held-out grid (bench/estimator_accuracy.py): no grid point
is a profile point, none is repeated, every category has several points (pure)."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from bench import estimator_accuracy as ea


def _key(pt: dict) -> tuple:
    return pt["category"], tuple((j.get("model"), j.get("shape"), j["batch"], j["seq"], j["q"], j["m"],
                                  tuple(sorted(j["plan"].items())), tuple(map(tuple, j["cores"])))
                                 for j in pt["jobs"])


def test_no_grid_point_is_a_profile_point_or_a_repeat():
    g = ea.grid(False)
    profiled = set(ea.PROFILE_POINTS)
    for pt in g:
        if len(pt["jobs"]) == 1 and not pt["jobs"][0]["plan"] and not pt["jobs"][0].get("shape"):
            j = pt["jobs"][0]
            assert (j["model"], j["batch"], j["seq"], j["q"], j["m"]) not in profiled, pt
    keys = [_key(pt) for pt in g]
    assert len(keys) == len(set(keys))
    # The rank profiles (fitted) are not grid points (held out) either: compared as the
    # configurations the model sees (a grid plan names dp, tp and pp; a rank profile's
    # only what it sets) and the cores they run on.
    def config(j: dict) -> tuple:
        return ea.candidate(j), tuple(map(tuple, j["cores"]))

    held_out = {config(j) for pt in g for j in pt["jobs"] if not j.get("shape")}
    ranks = {config(j) for _, j in ea.rank_profile_jobs()}
    assert ranks and not ranks & held_out
    # (the comparison sees a grid point of the same configuration written the grid's way)
    mode, j = ea.rank_profile_jobs()[0]
    same = {**j, "plan": {"dp": 1, "tp": 1, "pp": 1, **j["plan"]}}
    assert config(same) in ranks
    # Of a profiled module, estimated as ranks sharing the CPU; a "pipeline" one is a pipeline.
    for mode, j in ea.rank_profile_jobs():
        assert j["model"] in ea.PROFILED and mode in ("ranks", "pipeline")
        assert ea.candidate(j).colocated == 2 and (mode == "ranks" or j["plan"].get("pp", 1) > 1)
    # Models the profiles never ran are in the grid (the model-size category needs them).
    assert {j["model"] for pt in g for j in pt["jobs"] if j.get("model") in ea.MODELS} - set(ea.PROFILED)


def test_every_category_has_points_and_quick_keeps_two():
    full = Counter(pt["category"] for pt in ea.grid(False))
    quick = Counter(pt["category"] for pt in ea.grid(True))
    assert set(full) == set(quick)
    assert all(n >= 2 for n in full.values()) and all(n == 2 for n in quick.values())
    multi = sum(n for c, n in full.items() if c.startswith("multi_"))
    assert multi >= 15, "enough multi-rank points for a per-category MAPE"


def test_multi_rank_points_are_estimated_as_ranks_sharing_the_cpu():
    """A dp / tp / pp point's two ranks run on cores 0 and 1 of one CPU: its candidate
    counts them as colocated on disjoint cores (priced by the rank profile's mode, else
    "split"); a single-rank point is alone."""
    for pt in ea.grid(False):
        job = pt["jobs"][0]
        if job.get("shape") or len(pt["jobs"]) > 1:
            continue
        c = ea.candidate(job)
        world = c.dp * c.tp * c.pp
        assert c.colocated == world and c.oversubscription == 1.0, pt
        assert (world > 1) == pt["category"].startswith("multi"), pt


def test_a_failed_colocation_profile_is_tried_again_and_its_time_counted():
    calls = []

    def flaky(wl, cores, warmup, measured):
        calls.append(cores)
        if len(calls) == 1:
            raise RuntimeError("colocation profile: 13 alone and 1 together steps of X (need 2 each)")
        return {"alone_s": 0.01, "together_s": 0.011, "device_s": 0.5}

    pcost = {"colocation": 0.0}
    res = ea.colocation_with_retry(flaky, {}, [[0], [1]], pcost)
    assert res["together_s"] == 0.011 and len(calls) == 2
    assert pcost["colocation"] >= 0.5  # the retry's, plus the failed attempt's wall time x 2 cores

    def broken(wl, cores, warmup, measured):
        raise RuntimeError("never enough steps")

    with pytest.raises(RuntimeError, match="never enough"):
        ea.colocation_with_retry(broken, {}, [[0], [0]], {"colocation": 0.0})


def test_a_failed_grid_point_or_profile_run_is_tried_again_with_its_own_device_time():
    """Grid points, profile points, workload profiles and the comm table go through the
    same retry as the colocation pairs (before, one failed run ended the benchmark): a
    result of another shape names its device time by ``device_s``; a failed attempt's
    wall time x the cores it held is counted too."""
    calls = []

    def flaky_grid():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("bench run failed: exit codes [0, -9]")
        return [{"step_s": 0.02, "device_s": 0.4}, {"step_s": 0.03, "device_s": 0.5}]

    gcost = {"grid": 0.0}
    res = ea.profile_with_retry(flaky_grid, 2, gcost, "grid", "grid point 3",
                                device_s=lambda rs: sum(x["device_s"] for x in rs))
    assert [x["step_s"] for x in res] == [0.02, 0.03] and len(calls) == 2
    assert gcost["grid"] >= 0.9  # both ranks' device time, plus the failed attempt's
    pcost = {"compute": 0.0}
    meds, dev = ea.profile_with_retry(lambda: ([{"step_s": 0.01}], 1.5), 2, pcost, "compute", "profile points",
                                      device_s=lambda r: r[1])
    assert dev == 1.5 and pcost["compute"] == 1.5

    def broken():
        raise RuntimeError("comm micro-benchmark failed: exit codes [1, 0]")

    pcost = {"comm": 0.0}
    with pytest.raises(RuntimeError, match="comm micro-benchmark failed"):
        ea.profile_with_retry(broken, 2, pcost, "comm", "comm table", device_s=lambda r: r[1])
    assert pcost["comm"] > 0.0  # both failed tries' wall time x 2 cores


def test_a_colocation_profile_that_fails_every_try_skips_its_round_not_the_run():
    def broken(wl, cores, warmup, measured):
        raise RuntimeError("colocation profile: 11 alone and 1 together steps of X (need 2 each)")

    pcost, skipped = {"colocation": 0.0}, []
    assert ea.colocation_or_skip(broken, {}, [[0], [1]], pcost, skipped, "split", 4) is None
    assert skipped == [{"mode": "split", "round": 4,
                        "error": "colocation profile: 11 alone and 1 together steps of X (need 2 each)"}]
    assert pcost["colocation"] > 0.0  # both failed tries' wall time x 2 cores

    def ok(wl, cores, warmup, measured):
        return {"alone_s": 0.01, "together_s": 0.011, "device_s": 0.5}

    assert ea.colocation_or_skip(ok, {}, [[0], [1]], pcost, skipped, "split", 5)["together_s"] == 0.011
    assert len(skipped) == 1


def test_a_rank_profile_that_fails_is_tried_again_and_one_that_fails_every_try_skips_its_round():
    mode, job = ea.rank_profile_jobs()[0]
    calls = []

    def flaky(jobs, warmup):
        calls.append(jobs[0]["cores"])
        if len(calls) == 1:
            raise RuntimeError("bench run failed: exit codes [1, -9]")
        return [{"step_s": 0.02, "device_s": 0.4}]

    pcost, skipped = {"ranks": 0.0}, []
    assert ea.rank_profile_or_skip(flaky, job, {}, pcost, skipped, 3) == 0.02
    assert len(calls) == 2 and calls[0] == job["cores"] and not skipped
    assert pcost["ranks"] >= 0.4  # the retry's, plus the failed attempt's wall time x 2 cores

    def broken(jobs, warmup):
        raise RuntimeError("bench run failed: exit codes [1, 0]")

    assert ea.rank_profile_or_skip(broken, job, {}, pcost, skipped, 4) is None
    assert skipped == [{"plan": job["plan"], "round": 4, "error": "bench run failed: exit codes [1, 0]"}]


def test_the_rank_g_leaves_out_a_skipped_round_and_needs_one_measured():
    """A round without a value (None: its rank profile failed twice) is left out of the
    reference's time; with no round measured there is no rank mode (the split pair's g
    prices multi-rank plans, as before rank profiles)."""
    from tessera.perfmodel import PerfModel
    from tests.unit.test_perfmodel_compose import comm_rows
    from tests.unit.test_perfmodel_fit import samples

    model = PerfModel(version=1, compute={"cpu": ea.fit_compute("cpu", samples(noise=0.01))},
                      comm={ea.LINK: ea.fit_comm(ea.LINK, comm_rows())}, interference={"cpu": {"split": 0.0}})
    mode, job = ea.rank_profile_jobs()[0]
    t0 = model.estimate(ea.candidate(job)).seconds
    got = ea.with_rank_profiles(model, [{"mode": mode, "job": job, "rounds": [1.2 * t0, None, 1.2 * t0]}])
    same = ea.with_rank_profiles(model, [{"mode": mode, "job": job, "rounds": [1.2 * t0, 1.2 * t0]}])
    assert got.interference["cpu"][mode] > 0 and got.interference == same.interference
    assert ea.with_rank_profiles(model, [{"mode": mode, "job": job, "rounds": [None, None]}]) is model


def test_a_point_keeps_the_mean_of_its_least_disturbed_half_of_rounds():
    """bench step_time: the host only ever slows a run down, so a point's value is the
    mean of the least disturbed half of its rounds (rounded up), profiles and grid alike."""
    assert ea.kept_rounds([5.0, 1.0, 4.0, 2.0, 3.0]) == [1, 3, 4]
    assert ea.step_time([5.0, 1.0, 4.0, 2.0, 3.0]) == pytest.approx(2.0)
    assert ea.step_time([2.0, 1.0]) == pytest.approx(1.0)  # one of two
    assert ea.step_time([7.0]) == pytest.approx(7.0)  # --quick: one round


def test_a_colocated_pair_keeps_or_drops_its_rounds_as_a_whole():
    """A pair's rounds are ranked by its jobs' summed step times and each job's value is
    its mean over the kept rounds; raw (wall) times follow the same rounds."""
    rounds = [([1.0, 9.0], [1.1, 9.1]), ([2.0, 2.0], [2.1, 2.1]), ([3.0, 3.0], [3.1, 3.1])]
    got = ea.grid_values(rounds)  # summed 10, 4, 6: keep rounds 1 and 2
    assert got["measured"] == pytest.approx([2.5, 2.5]) and got["raw"] == pytest.approx([2.6, 2.6])
    assert got["rounds"] == pytest.approx([10.0, 4.0, 6.0])


def test_host_info_names_the_cpus_and_caches(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU @ 2.0GHz\nprocessor\t: 1\nmodel name\t: Other\n")
    for idx, (level, kind, size) in enumerate([("1", "Data", "48K"), ("1", "Instruction", "64K"),
                                               ("2", "Unified", "2048K"), ("3", "Unified", None)]):
        d = tmp_path / "cache" / f"index{idx}"
        d.mkdir(parents=True)
        (d / "level").write_text(level + "\n")
        (d / "type").write_text(kind + "\n")
        if size:  # index3 lacks its size: skipped, not a crash
            (d / "size").write_text(size + "\n")
    info = ea.host_info(str(cpuinfo), str(tmp_path / "cache"))
    assert info["cpu_model"] == "Test CPU @ 2.0GHz"
    assert info["caches"] == {"L1d": "48K", "L1i": "64K", "L2": "2048K"}
    assert info["cpus"] == len(os.sched_getaffinity(0))
    # Nothing there at all: no model, no caches, still the CPU count.
    bare = ea.host_info(str(tmp_path / "none"), str(tmp_path / "none"))
    assert "cpu_model" not in bare and bare["caches"] == {} and bare["cpus"] >= 1


def test_truth_noise_is_zero_for_a_steady_point_and_grows_with_its_scatter():
    """bench truth_noise: the bootstrap of a point's rounds — 0 when every round agrees,
    larger for a point whose rounds scatter more, the same for a scaled copy (relative),
    per job of a pair, and None with one round (nothing to resample)."""
    steady = [([2.0], [2.0])] * 5
    assert ea.truth_noise(steady) == [0.0]
    calm = [([x], [x]) for x in (1.0, 1.02, 1.04, 1.01, 1.03)]
    wild = [([x], [x]) for x in (1.0, 1.4, 1.8, 1.1, 1.6)]
    n_calm, n_wild = ea.truth_noise(calm)[0], ea.truth_noise(wild)[0]
    assert 0.0 < n_calm < 4.0  # the rounds span 4 %: a resample's mean moves by less
    assert n_wild > 5 * n_calm
    scaled = [([10 * x], [10 * x]) for x in (1.0, 1.4, 1.8, 1.1, 1.6)]
    assert ea.truth_noise(scaled)[0] == pytest.approx(n_wild)
    pair = [([x, 3.0], [x, 3.0]) for x in (1.0, 1.4, 1.8, 1.1, 1.6)]
    got = ea.truth_noise(pair)
    assert len(got) == 2 and got[0] > 0.0
    assert ea.truth_noise([([1.0], [1.0])]) is None


def test_calibration_compares_the_claimed_confidence_with_the_errors():
    """bench calibration: the share of rows within the confidence's 10 % tolerance, the
    mean claimed confidence and the RMS of error / rel_std; rows without an estimate
    are left out, and no rows give None."""
    rows = [{"ape": 5.0, "rel_std": 0.05, "confidence": 0.9}, {"ape": 20.0, "rel_std": 0.1, "confidence": 0.6},
            {"ape": None, "rel_std": 0.1, "confidence": 0.0}]
    c = ea.calibration(rows)
    assert c["within_tolerance"] == pytest.approx(0.5)
    assert c["mean_confidence"] == pytest.approx(0.75)
    assert c["rms_z"] == pytest.approx(((1.0 ** 2 + 2.0 ** 2) / 2) ** 0.5)
    assert ea.calibration([]) is None and ea.calibration(rows[2:]) is None
    line = ea.calibration_line(c, None)
    assert "single-device 50 % of rows within 10 %" in line and "multi-rank -" in line


def test_comm_kept_fits_the_least_disturbed_half_of_each_size_and_every_sync_row():
    from tessera.perfmodel import fit_comm

    rows, sync = [], [{"op": "sync", "bytes": 8, "world": 2, "seconds": 4e-4, "compute_s": c} for c in (1e-4, 1e-2)]
    for nbytes in (64 << 10, 512 << 10, 4 << 20):
        base = 2 * 2e-4 + nbytes / 1e9
        # 9 rounds; two ran during a burst of other work on the host (5x slower).
        rows += [{"op": "all_reduce", "bytes": nbytes, "world": 2, "seconds": base * (5.0 if r in (4, 5) else 1.0)}
                 for r in range(9)]
    kept = ea.comm_kept(rows + sync + [{"op": "resume", "bytes": 0, "world": 2, "seconds": 5e-5}])
    ar = [r for r in kept if r["op"] == "all_reduce"]
    assert len(ar) == 3 * 5 and all(r["seconds"] < 0.01 for r in ar if r["bytes"] == 64 << 10)
    assert sum(r["op"] == "sync" for r in kept) == 2 and sum(r["op"] == "resume" for r in kept) == 1
    fit = fit_comm("lo", kept)
    assert fit.ops["all_reduce"]["alpha"] == pytest.approx(2e-4, rel=0.02)
    assert fit_comm("lo", rows).ops["all_reduce"]["alpha"] > 3e-4  # every round's rows: the burst sets the latency


def test_round_progress_says_rounds_done_time_left_and_the_rounds_device_time():
    line = ea.round_progress(2, 9, 90.0, {"compute": 1.5, "colocation": 1.0, "comm": 0.5, "grid": 41.8})
    # 3 of 9 rounds in 90 s: 6 more at 30 s each = 3 minutes; profiles 1.5 + 1.0 + 0.5.
    assert line == "round 3/9 done: 90 s so far, ~3.0 min left; this round 3.0 device-s of profiles, 41.8 of grid"
    assert "~0.0 min left" in ea.round_progress(8, 9, 300.0, {"grid": 40.0})


def test_main_leaves_the_callers_logging_as_it_found_it(monkeypatch):
    """main() called in-process (as tests do) must not leave the WARNING filter behind: it
    silenced every later test's structlog.testing.capture_logs of info events (a CI run of
    2026-12-08)."""
    import structlog

    monkeypatch.delenv("TESSERA_LOG_LEVEL", raising=False)
    before = structlog.get_config()
    monkeypatch.setattr(ea, "run_benchmark", lambda args: 7)
    assert ea.main([]) == 7
    assert structlog.get_config() == before
    with structlog.testing.capture_logs() as logs:
        structlog.get_logger().info("still here")
    assert [e["event"] for e in logs] == ["still here"]

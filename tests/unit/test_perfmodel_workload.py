"""Estimates of peft / multimodal workloads from their own step-shape profiles
(tessera/perfmodel/workload.py) and the shape key they are filed under (tessera/modelkey.py)."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest

from tessera import manifest
from tessera.modelkey import arch_key, profile_labels, shape_key
from tessera.perfmodel import Candidate, PerfModel, ProfilePoint
from tessera.perfmodel import features as F
from tessera.perfmodel.compute import COEFS, ComputeFit, mem_scale, quota_scale
from tessera.perfmodel.workload import profiled, quota_curve, workload_of
from tessera.spec.multimodal import mean_mix, mix_at

MODEL = {"vocab": 64, "seq_len": 32, "layers": 2, "hidden": 32, "heads": 2}


def peft_workload(**over) -> dict:
    w = {"type": "peft", "model": MODEL, "steps": 50, "batch_size": 4, "learning_rate": 0.01, "seed": 0,
         "peft": {"chunk_size": 32, "tasks": [{"name": "a", "rank": 4, "steps": 30},
                                             {"name": "b", "rank": 8, "dataset": {"distribution": "longtail"}}]}}
    w.update(over)
    return manifest.validate({"apiVersion": "tessera/v1", "name": "x", "tenant": "t", "workload": w,
                              "resources": {"devices": 1, "device_kind": "cpu"}})["workload"]


def mm_workload(mix=None, steps=20) -> dict:
    w = {"type": "multimodal", "model": {**MODEL, "seq_len": 48}, "steps": steps, "batch_size": 4,
         "multimodal": {"mode": "colocated", "image": {"size": 16, "patch": 8, "pool": 2},
                        "encoder": {"layers": 1, "hidden": 32, "heads": 2}, "data": {"max_images": 2, "max_text": 24},
                        "mix": mix or [{"step": 0, "image_prob": 0.2}, {"step": 10, "image_prob": 0.8}]}}
    return manifest.validate({"apiVersion": "tessera/v1", "name": "x", "tenant": "t", "workload": w,
                              "resources": {"devices": 1, "device_kind": "cpu"}})["workload"]


# ---------------------------------------------------------------------------- shape key
def test_shape_key_of_gpt_is_its_arch_key():
    w = {"type": "gpt", "model": MODEL, "batch_size": 8}
    assert shape_key(w) == shape_key(w, 4) == arch_key(w)
    assert workload_of(shape_key(w)) == "gpt" and not profiled(shape_key(w))


def test_shape_key_ignores_run_length_rates_seeds_names_and_order():
    base = peft_workload()
    k = shape_key(base)
    assert k.startswith(arch_key(base) + ":w") and workload_of(k) == "peft" and profiled(k)
    same = copy.deepcopy(base)
    same.update(steps=7, learning_rate=0.5, seed=3, checkpoint_every=1)
    tasks = same["peft"]["tasks"]
    tasks[0].update(name="renamed", steps=2, learning_rate=0.3, alpha=99.0)
    tasks[1]["dataset"]["seed"] = 11
    same["peft"]["tasks"] = tasks[::-1]
    assert shape_key(same) == k
    # an inherited batch size / max length resolved: explicit equal values are the same shape
    explicit = copy.deepcopy(base)
    for t in explicit["peft"]["tasks"]:
        t["batch_size"], t["dataset"]["max_len"] = 4, 32
    assert shape_key(explicit) == k


@pytest.mark.parametrize("change", [
    lambda w: w["peft"]["tasks"][0].update(rank=2),
    lambda w: w["peft"]["tasks"][0].update(target_modules=["fc"]),
    lambda w: w["peft"]["tasks"][1].update(batch_size=8),
    lambda w: w["peft"]["tasks"][1]["dataset"].update(distribution="uniform"),
    lambda w: w["peft"].update(chunk_size=16),
    lambda w: w["peft"].update(mode="temporal"),
    lambda w: w["peft"]["tasks"].append({**w["peft"]["tasks"][0], "name": "c"}),
    lambda w: w.update(batch_size=2),
], ids=["rank", "targets", "task-batch", "distribution", "chunk", "mode", "more-tasks", "batch"])
def test_shape_key_changes_with_what_sets_the_step_cost(change):
    base = peft_workload()
    other = copy.deepcopy(base)
    change(other)
    assert shape_key(other) != shape_key(base)


def test_shape_key_depends_on_world_size():
    w = mm_workload()
    assert shape_key(w, 1) != shape_key(w, 2)


def test_multimodal_shape_key_uses_the_mean_mix_over_the_run():
    w = mm_workload()
    img, aud = mean_mix(w["multimodal"]["mix"], 20)
    assert img == pytest.approx(sum(mix_at(w["multimodal"]["mix"], s)[0] for s in range(20)) / 20) and aud == 0
    const = mm_workload(mix=[{"step": 0, "image_prob": round(img, 4), "audio_prob": 0.0}], steps=6)
    assert shape_key(const) == shape_key(w)                      # a short run at the mean mix: same shape
    assert shape_key(mm_workload(steps=100)) != shape_key(w)     # a longer run spends more steps image-heavy


def test_profile_labels_carry_the_shape_key_over_the_world_size_in_a_profiling_run_only():
    w = peft_workload()
    lb = profile_labels({"workload": w, "threads": 2, "dist": {"world_size": 1}, "profiling": True}, "cpu")
    assert lb["module"] == shape_key(w, 1) and lb["workload_type"] == "peft" and lb["threads"] == "2"
    lb2 = profile_labels({"workload": w, "dist": {"world_size": 2}, "profiling": True}, "cpu")
    assert lb2["module"] == shape_key(w, 2)
    # the job's own run: its tasks end at different steps, so its steps are not its shape's step
    assert profile_labels({"workload": w, "dist": {"world_size": 1}}, "cpu")["module"] == ""
    g = {"type": "gpt", "model": MODEL, "batch_size": 8}
    assert profile_labels({"workload": g, "dist": {"world_size": 1}}, "cpu")["module"] == arch_key(g)
    # an input-bound gpt job: its steps wait for their input, not the model's compute
    assert profile_labels({"workload": {**g, "step_delay_s": 0.5}, "dist": {"world_size": 1}}, "cpu")["module"] == ""
    assert profile_labels({"workload": {**g, "step_delay_s": 0.0}, "dist": {"world_size": 1}}, "cpu")["module"] \
        == arch_key(g)


def test_mean_mix_is_exact_and_cheap_for_any_schedule_and_run_length():
    import random
    import time

    rnd = random.Random(7)
    for _ in range(500):
        pts = [{"step": 0, "image_prob": rnd.random(), "audio_prob": rnd.random()}]
        pts += [{"step": s, "image_prob": rnd.random()} for s in sorted(rnd.sample(range(1, 40), rnd.randint(0, 5)))]
        n = rnd.randint(0, 60)
        brute = [mix_at(pts, s) for s in range(max(1, n))]
        got = mean_mix(pts, n)
        assert got[0] == pytest.approx(sum(b[0] for b in brute) / len(brute), abs=1e-12)
        assert got[1] == pytest.approx(sum(b[1] for b in brute) / len(brute), abs=1e-12)
    # 300 one-step spikes: a sampled mean aliased onto them (a review measured 0.003 for 3e-7)
    spikes = [{"step": 0, "image_prob": 0.0}]
    for k in range(1, 301):
        spikes += [{"step": 10_000 * k - 1, "image_prob": 0.0}, {"step": 10_000 * k, "image_prob": 1.0},
                   {"step": 10_000 * k + 1, "image_prob": 0.0}]
    t0 = time.perf_counter()
    assert mean_mix(spikes, 10**9)[0] == pytest.approx(300 / 10**9, rel=1e-9)
    assert time.perf_counter() - t0 < 0.05   # O(len(mix)): the controller computes it every cycle


# ---------------------------------------------------------------------------- estimates
MOD = "peft:l2-h32-a2-s32-v64:w0123456789ab"


def cand(q=1.0, module=MOD, batch=4, **kw) -> Candidate:
    return Candidate(device_type="cpu", layers=2, hidden=32, heads=2, vocab=64, seq_len=32, batch=batch, quota=q,
                     module=module, **kw)


def pt(q, seconds, module=MOD, rows=4, steps=6, spread=0.0) -> ProfilePoint:
    return ProfilePoint(module=module, rows=rows, seq=32, micro_batches=1, q=q, seconds=seconds, steps=steps,
                        spread=spread)


def fit(p=0.8, q_sat=math.inf, q_mem=1.0) -> ComputeFit:
    return ComputeFit(device_type="cpu", coef={k: 1e-9 for k in COEFS}, p=p, q_sat=q_sat, q_mem=q_mem,
                      rel_sigma=0.02, n=12, status="ok")


def test_quota_curve_recovers_known_serial_and_parallel_parts():
    a, b = 0.004, 0.012
    qs = [1.0, 2.0, 4.0, 8.0]
    got = quota_curve(qs, [a + b / q for q in qs])
    assert got is not None
    assert got[0] == pytest.approx(a, rel=1e-6) and got[1] == pytest.approx(b, rel=1e-6) and got[2] < 1e-9
    assert math.isnan(quota_curve([1.0, 2.0], [0.016, 0.010])[2])   # two quotas: no residual left
    assert quota_curve([1.0, 1.0], [0.01, 0.02]) is None               # one quota says nothing about b
    assert quota_curve([1.0, 2.0], [0.01, math.nan]) is None


def test_same_quota_is_the_median_of_the_profiles_and_their_scatter():
    m = PerfModel(version=1, profiles={"cpu": [pt(1.0, 0.010), pt(1.0, 0.012), pt(1.0, 0.020), pt(2.0, 0.007)]})
    e = m.estimate(cand(1.0))
    assert e.ok and e.seconds == pytest.approx(0.012) and "measured profile" in e.reason
    sd = (sum((x - 0.014) ** 2 for x in (0.010, 0.012, 0.020)) / 2) ** 0.5 / 0.014
    assert e.rel_std == pytest.approx(sd) and 0 < e.confidence < 1 and math.isnan(e.memory_bytes)
    one = PerfModel(version=1, profiles={"cpu": [pt(1.0, 0.010, steps=4, spread=0.1)]}).estimate(cand(1.0))
    assert one.seconds == 0.010 and one.rel_std == pytest.approx(pt(1.0, 0.010, steps=4, spread=0.1).rel_std())


def test_other_quota_from_the_modules_own_curve():
    a, b = 0.003, 0.012
    m = PerfModel(version=1, profiles={"cpu": [pt(q, a + b / q) for q in (1.0, 2.0, 4.0)]})
    e = m.estimate(cand(3.0))
    assert e.ok and e.seconds == pytest.approx(a + b / 3.0, rel=1e-6) and "own quota curve" in e.reason
    far = m.estimate(cand(16.0))    # outside the profiled quotas: less confident
    assert far.ok and far.seconds == pytest.approx(a + b / 16, rel=1e-6) and far.confidence < e.confidence


def _step(f: ComputeFit, c: Candidate, q: float) -> float:
    """A single-rank gpt step of c's backbone by hand (one stage: embeds and head)."""
    mbf = F.mb_features(c.batch, c.seq_len, c.layers, c.hidden, c.heads, c.vocab, 1, 1)
    stf = F.step_features(c.seq_len, c.layers, c.hidden, c.vocab, c.seq_len, 1, 1)
    k = f.coef
    return (k["c_flops"] * mbf["flops"] * float(quota_scale(q, f.p, f.q_sat))
            + k["c_elems"] * mbf["elems"] * float(mem_scale(q, f.q_mem)) + k["c_ops"] * mbf["ops"] + k["c_mb"]
            + k["c_params"] * (stf["params"] - stf["par_params"] * (1 - 1 / max(q, 1.0)))
            + k["c_tensors"] * stf["tensors"] + k["c_seq"] * stf["seq"] + k["c_cold"] * mbf["elems"])


def test_one_profiled_quota_is_scaled_by_the_devices_fitted_curve_or_refused():
    f = fit(p=0.8, q_sat=3.0)
    m = PerfModel(version=1, compute={"cpu": f}, profiles={"cpu": [pt(1.0, 0.020)]})
    e = m.estimate(cand(2.0))
    # The ratio of a gpt step of the candidate's backbone at the two quotas: the serial
    # parts (dispatch, optimizer; element-wise traffic at q_mem = 1) stay, so it lies
    # between the parallel part's s(2)/s(1) and 1.
    ratio = _step(f, cand(2.0), 2.0) / _step(f, cand(2.0), 1.0)
    par = float(quota_scale(2.0, 0.8, 3.0) / quota_scale(1.0, 0.8, 3.0))
    assert par < ratio < 1.0
    assert e.ok and e.seconds == pytest.approx(0.020 * ratio) and e.breakdown["quota_scale"] == pytest.approx(ratio)
    # A backbone whose step is all FLOPs scales by s(q)/s(q0); one that is all overhead not at all.
    flops = ComputeFit(device_type="cpu", coef={k: (1e-9 if k == "c_flops" else 0.0) for k in COEFS}, p=0.8,
                       q_sat=3.0, rel_sigma=0.02, n=12, status="ok")
    fixed = ComputeFit(device_type="cpu", coef={k: (1e-3 if k == "c_tensors" else 0.0) for k in COEFS}, p=0.8,
                       q_sat=3.0, rel_sigma=0.02, n=12, status="ok")
    for g, want in ((flops, 0.020 * par), (fixed, 0.020)):
        got = PerfModel(version=1, compute={"cpu": g}, profiles={"cpu": [pt(1.0, 0.020)]}).estimate(cand(2.0))
        assert got.ok and got.seconds == pytest.approx(want)
    # A curve that gives no time for the backbone (all coefficients 0): no number, no crash.
    zero = ComputeFit(device_type="cpu", coef={k: 0.0 for k in COEFS}, p=0.8, q_sat=3.0, rel_sigma=0.02, n=12,
                      status="ok")
    none = PerfModel(version=1, compute={"cpu": zero}, profiles={"cpu": [pt(1.0, 0.020)]}).estimate(cand(2.0))
    assert none.status == "insufficient_data" and "gives no time" in none.reason
    assert e.rel_std > m.estimate(cand(1.0)).rel_std
    assert e.confidence < 0.5   # the device's gpt curve says little about how this runtime uses a quota
    bare = PerfModel(version=1, profiles={"cpu": [pt(1.0, 0.020)]}).estimate(cand(2.0))
    assert bare.status == "insufficient_data" and "no fitted compute curve" in bare.reason


def test_no_profile_of_the_shape_batch_or_device_is_insufficient():
    m = PerfModel(version=1, compute={"cpu": fit()}, profiles={"cpu": [pt(1.0, 0.02)]})
    gpu = Candidate(**{**cand().__dict__, "device_type": "gpu"})
    for c in (cand(module=MOD[:-1] + "c"), cand(batch=8), gpu):
        e = m.estimate(c)
        assert e.status == "insufficient_data" and "no profile" in e.reason and math.isnan(e.seconds)
    # a corrupt point answers nothing
    bad = PerfModel(version=1, profiles={"cpu": [pt(1.0, math.inf)]}).estimate(cand(1.0))
    assert bad.status == "insufficient_data"


def test_a_gpt_plan_does_not_make_a_profiled_workload_invalid():
    """peft / multimodal runtimes take no plan: dp, tp, pp (and batch % micro-batches) are
    not theirs to break; the profile of the same shape answers."""
    m = PerfModel(version=1, profiles={"cpu": [pt(1.0, 0.02)]})
    for c in (cand(dp=2), cand(tp=3), cand(pp=4)):
        e = m.estimate(c)
        assert e.ok and e.seconds == 0.02, (c, e.reason)


def test_a_two_quota_curve_that_misses_its_points_says_so():
    """A step slower at more quota: t = a + b/q can only stay flat (b clipped at 0) and
    misses both points by ~11%; its error must show that, not the 3% prior."""
    m = PerfModel(version=1, profiles={"cpu": [pt(1.0, 0.0228), pt(2.0, 0.0286)]})
    e = m.estimate(cand(1.5))
    assert e.ok and e.rel_std > 0.09 and e.confidence < 0.75
    exact = PerfModel(version=1, profiles={"cpu": [pt(1.0, 0.020), pt(2.0, 0.012)]}).estimate(cand(1.5))
    assert exact.ok and exact.rel_std < 0.05


def test_invalid_candidate_is_refused_before_any_profile():
    m = PerfModel(version=1, profiles={"cpu": [pt(1.0, 0.02)]})
    assert m.estimate(cand(q=math.nan)).status == "insufficient_data"
    assert m.estimate(cand(q=0.0)).status == "insufficient_data"
    # what holds for every candidate (the estimator service refuses them alike): a context
    # past the model's, hidden not divisible by heads, micro-batches beyond the bound
    assert m.estimate(cand(seq=33)).status == "insufficient_data"
    assert m.estimate(replace(cand(), hidden=33)).status == "insufficient_data"
    assert m.estimate(cand(seq=32)).ok
    many = PerfModel(version=1, profiles={"cpu": [ProfilePoint(module=MOD, rows=4096, seq=32, micro_batches=4096,
                                                                q=1.0, seconds=0.02, steps=6)]})
    assert many.estimate(cand(batch=4096, micro_batches=4096)).status == "insufficient_data"


def test_colocated_needs_the_devices_interference_and_stretches_by_it():
    pts = {"cpu": [pt(1.0, 0.02)]}
    e = PerfModel(version=1, profiles=pts).estimate(cand(1.0, colocated=2))
    assert e.status == "insufficient_data" and "colocation (split)" in e.reason
    m = PerfModel(version=1, profiles=pts, interference={"cpu": {"split": 0.1, "shared": 0.3}})
    assert m.estimate(cand(1.0, colocated=2)).seconds == pytest.approx(0.02 * 1.1)
    assert m.estimate(cand(1.0, colocated=3, oversubscription=1.5)).seconds == pytest.approx(0.02 * 1.5 * 1.6)


def test_workload_estimates_survive_the_snapshot_round_trip_and_batch_equals_single():
    m = PerfModel(version=3, compute={"cpu": fit()}, profiles={"cpu": [pt(1.0, 0.02), pt(2.0, 0.012)]})
    back = PerfModel.from_dict(m.to_dict())
    cs = [cand(1.0), cand(1.5), cand(batch=8), cand(module="gpt:l2-h32-a2-s32-v64")]
    assert [e.seconds for e in back.estimate_batch(cs)][:2] == [m.estimate(c).seconds for c in cs[:2]]
    assert [e.status for e in back.estimate_batch(cs)][2] == "insufficient_data"
    # a gpt candidate still goes through the composed compute curve, never a workload profile
    g = back.estimate(cs[3])
    assert g.ok and "this workload" not in g.reason and "pipeline" in g.breakdown

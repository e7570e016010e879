"""Composition, confidence, snapshots and batch evaluation of the performance model."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np
import pytest

from tessera.perfmodel import Candidate, PerfModel, fit_comm, fit_compute, fit_interference, fit_rank_interference
from tessera.perfmodel.comm import steps_and_volume, sync_groups
from tessera.perfmodel.compute import nnls
from tests.unit.test_perfmodel_fit import samples

LINK = "lo"


def comm_rows(alpha=50e-6, beta=1 / 2e9):
    rows = []
    for op in ("all_reduce", "send_recv"):
        for nbytes in (4 << 10, 256 << 10, 4 << 20):
            st, vol = steps_and_volume(op, 2, nbytes)
            rows.append({"op": op, "bytes": nbytes, "world": 2, "seconds": float(alpha * st + beta * vol)})
    return rows


@pytest.fixture(scope="module")
def model() -> PerfModel:
    pairs = [{"mode": "split", "colocated": 2, "oversubscription": 1.0, "alone_s": 1.0, "together_s": 1.1},
             {"mode": "shared", "colocated": 2, "oversubscription": 2.0, "alone_s": 1.0, "together_s": 2.3}]
    return PerfModel(version=3, compute={"cpu": fit_compute("cpu", samples(noise=0.01))},
                     comm={LINK: fit_comm(LINK, comm_rows())}, interference={"cpu": fit_interference(pairs)})


def cand(**kw) -> Candidate:
    base = dict(device_type="cpu", layers=4, hidden=128, heads=4, vocab=256, seq_len=64, batch=16, link=LINK,
                module="m4x128")
    base.update(kw)
    return Candidate(**base)


def test_single_device_matches_fitted_curve(model):
    e = model.estimate(cand())
    assert e.ok and e.seconds > 0 and e.memory_bytes > 0
    assert 0 < e.confidence <= 1 and e.rel_std > 0


def test_bubble_fraction_shrinks_with_micro_batches(model):
    fracs = []
    for m in (1, 2, 4, 8):
        e = model.estimate(cand(pp=2, micro_batches=m))
        assert e.ok, e.reason
        fracs.append(e.breakdown["bubble"] / e.breakdown["pipeline"])
    assert fracs == sorted(fracs, reverse=True) and fracs[0] > fracs[-1]
    # Balanced stages: bubble = (pp-1)/(m+pp-1) of the pipeline, up to stage imbalance.
    e = model.estimate(cand(layers=8, pp=2, micro_batches=4))
    assert e.breakdown["bubble"] / e.breakdown["pipeline"] == pytest.approx(1 / 5, rel=0.35)


def test_pipeline_pays_each_critical_transfer_its_latency_and_a_woken_rank_one_more():
    """The schedule is replayed (tessera.perfmodel.pipeline): every blocking transfer
    costs the link latency (alpha, the handshake) and a rank that waited in it one alpha
    more (it is woken). With alpha small against the stages, the critical path holds the
    fill and the drain — pp - 1 links each way, each to a waiting rank: 2 alpha — and the
    bottleneck's m - 1 steady-state exchanges, whose neighbour is ready: one alpha each."""
    def at(alpha):
        rows = comm_rows(alpha=0.0, beta=1 / 2e9)
        rows = [{**r, "seconds": r["seconds"] + (alpha if r["op"] == "send_recv" else 0.0)} for r in rows]
        return PerfModel(version=1, compute={"cpu": fit_compute("cpu", samples(noise=0.0))},
                         comm={LINK: fit_comm(LINK, rows)})

    alpha = 1e-4
    lo, hi = at(0.0), at(alpha)
    for pp, m in ((2, 1), (2, 4), (2, 8), (4, 1), (4, 8)):
        a, b = lo.estimate(cand(pp=pp, micro_batches=m)), hi.estimate(cand(pp=pp, micro_batches=m))
        assert a.ok and b.ok
        assert b.seconds - a.seconds == pytest.approx((4 * (pp - 1) + (m - 1)) * alpha, rel=1e-6), (pp, m)


def test_pipeline_replay_runs_the_first_stage_s_next_forward_during_the_next_stage():
    """Where the first stage is the bottleneck, 1F1B runs its second forward while the
    last stage computes the first micro-batch: the step is shorter than the closed form
    sum_s t_s + (m - 1) max_s t_s by about one forward of the first stage (free links)."""
    model = PerfModel(version=1, compute={"cpu": fit_compute("cpu", samples(noise=0.0))},
                      comm={LINK: fit_comm(LINK, comm_rows(alpha=1e-12, beta=1e-18))})
    c = cand(layers=5, pp=2, micro_batches=4)  # stage 0: embedding + 3 blocks; stage 1: 2 + head
    e = model.estimate(c)
    gp = model.estimate(replace(c, schedule="gpipe"))  # GPipe: all forwards, then all backwards
    closed = gp.breakdown["pipeline"]  # no such overlap: ~ the closed form
    assert e.breakdown["pipeline"] < closed * 0.97
    assert e.breakdown["pipeline"] > closed * 0.7


def test_data_parallel_pays_the_gradient_buckets_element_wise_passes():
    """dp > 1: flatten, average and copy back every gradient element (3 passes at the
    fitted element-wise rate) on top of the all-reduces — here free links."""
    from tessera.perfmodel import features as F
    from tessera.perfmodel.model import DP_BUCKET_PASSES

    m = PerfModel(version=1, compute={"cpu": fit_compute("cpu", samples(noise=0.0))},
                  comm={LINK: fit_comm(LINK, comm_rows(alpha=1e-12, beta=1e-18))})
    one, two = m.estimate(cand(batch=16)), m.estimate(cand(batch=32, dp=2))
    assert one.ok and two.ok
    fit = m.compute["cpu"]
    params = F.stage_params(4, 128, 256, 64, 1, 1)
    want = DP_BUCKET_PASSES * params * fit.coef["c_elems"]
    assert want > 0
    assert two.seconds - one.seconds == pytest.approx(want, rel=1e-3)


def test_micro_batches_pay_the_gradient_accumulation_once_per_extra_micro_batch():
    """m micro-batches of the same rows: the same per-token work, m - 1 more per-micro-batch
    overheads, m - 1 accumulations of every weight gradient (GRAD_ACCUM_ELEMS units
    per parameter at the fitted element-wise rate), and the per-step refill after the
    step's micro-batches (``cold``: their element-wise units, m times one's)."""
    from tessera.perfmodel import features as F

    m = PerfModel(version=1, compute={"cpu": fit_compute("cpu", samples(noise=0.0))},
                  comm={LINK: fit_comm(LINK, comm_rows(alpha=1e-12, beta=1e-18))})
    fit = m.compute["cpu"]
    params = F.stage_params(4, 128, 256, 64, 1, 1)
    for mb in (2, 4):
        one, many = m.estimate(cand(batch=16, seq=32)), m.estimate(cand(batch=16, seq=32, micro_batches=mb))
        assert one.ok and many.ok
        mbf1 = F.mb_features(16, 32, 4, 128, 4, 256, 1, 1)
        mbfm = F.mb_features(16 / mb, 32, 4, 128, 4, 256, 1, 1)
        per_mb = mb * fit.mb_time(mbfm, 1.0) - fit.mb_time(mbf1, 1.0)
        accum = fit.coef["c_elems"] * F.GRAD_ACCUM_ELEMS * params * (mb - 1)
        cold = fit.coef["c_cold"] * (mb * mbfm["elems"] - mbf1["elems"])
        assert accum > 1e-3 * abs(per_mb)  # well above the tolerance below: leaving it out fails
        assert many.seconds - one.seconds == pytest.approx(per_mb + accum + cold, rel=1e-6)
    assert F.grad_accum_elems(1000.0, 1) == 0.0 and F.grad_accum_elems(1000.0, 3) == 2000.0 * F.GRAD_ACCUM_ELEMS


def test_more_dp_cuts_compute_but_adds_allreduce(model):
    one = model.estimate(cand(batch=32))
    two = model.estimate(cand(batch=32, dp=2))
    assert two.breakdown["pipeline"] < one.breakdown["pipeline"]
    assert two.breakdown["per_step"] > one.breakdown["per_step"]  # the gradient all-reduce
    slow = PerfModel(compute=model.compute, comm={LINK: fit_comm(LINK, comm_rows(beta=1 / 1e6))},
                     interference=model.interference)
    assert slow.estimate(cand(batch=32, dp=2)).seconds > two.seconds


def test_tp_adds_per_layer_allreduces(model):
    e1 = model.estimate(cand(tp=2))
    slow = PerfModel(compute=model.compute, comm={LINK: fit_comm(LINK, comm_rows(alpha=1e-2))})
    e2 = slow.estimate(cand(tp=2))
    # 4 layers x 4 all-reduces x 2 ring steps at n=2, + the loss all-reduce's 2 steps.
    assert e2.seconds - e1.seconds == pytest.approx((4 * 4 * 2 + 2) * (1e-2 - 50e-6), rel=0.02)


def test_colocation_shared_stretches_split_interferes(model):
    alone = model.estimate(cand()).seconds
    split = model.estimate(cand(colocated=2, oversubscription=1.0)).seconds
    shared = model.estimate(cand(colocated=2, oversubscription=2.0)).seconds
    assert split == pytest.approx(alone * 1.1)
    assert shared == pytest.approx(alone * 2 * 1.15)


def test_memory_grows_with_batch_and_shrinks_with_pp(model):
    m1 = model.estimate(cand(batch=8)).memory_bytes
    m2 = model.estimate(cand(batch=32)).memory_bytes
    m3 = model.estimate(cand(batch=32, pp=2, micro_batches=4)).memory_bytes
    assert m1 < m2 and m3 < m2


def test_insufficient_data_says_so(model):
    for c, words in [(cand(device_type="cuda:H100"), "no compute profile"),
                     (cand(dp=2, link="ib"), "no communication table"),
                     (cand(batch=15, dp=2), "divide"),
                     (cand(layers=1, pp=2), "invalid plan")]:
        e = model.estimate(c)
        assert e.status == "insufficient_data" and words in e.reason and e.seconds != e.seconds  # NaN
    bare = PerfModel(compute={"cpu": fit_compute("cpu", samples()[:4])})
    e = bare.estimate(cand())
    assert not e.ok and "at least" in e.reason
    nocolo = PerfModel(compute=model.compute)
    assert "colocation" in nocolo.estimate(cand(colocated=2)).reason


def test_confidence_falls_with_extrapolation_and_unseen_module(model):
    near = model.estimate(cand())
    far = model.estimate(cand(layers=48, hidden=1024, batch=512, seq_len=2048))
    unseen = model.estimate(cand(module="never-profiled"))
    assert far.confidence < near.confidence and far.breakdown["extrapolation"] > 0
    assert unseen.confidence < near.confidence


def test_snapshot_round_trip_gives_identical_estimates(model):
    snap = json.loads(json.dumps(model.to_dict()))
    again = PerfModel.from_dict(snap)
    assert again.version == 3
    cs = [cand(), cand(dp=2, batch=32), cand(pp=2, micro_batches=4), cand(colocated=2, oversubscription=2.0),
          cand(device_type="nope")]
    assert model.estimate_batch(cs) == again.estimate_batch(cs)
    with pytest.raises(ValueError):
        PerfModel.from_dict({**snap, "format": "other/9"})


def test_batch_evaluation_matches_single_and_is_fast(model):
    cs = []
    for layers in (2, 4, 8):
        for dp in (1, 2, 4):
            for pp in (1, 2):
                for m in (1, 2, 4):
                    for q in (0.5, 1, 2):
                        cs.append(cand(layers=layers, dp=dp, pp=pp, micro_batches=m, quota=q, batch=64))
    cs.append(cand(device_type="gpu?"))
    batch = model.estimate_batch(cs)
    for c, e in zip(cs, batch):
        assert model.estimate(c) == e
    many = [replace(c, batch=64 * (1 + i % 4)) for i, c in enumerate(cs * 30)]
    t0 = time.perf_counter()
    out = model.estimate_batch(many)
    assert len(out) == len(many) >= 4000
    assert time.perf_counter() - t0 < 2.0


def sync_rows(a=2e-4, kappa=0.08):
    return [{"op": "sync", "bytes": 8, "world": 2, "seconds": a + kappa * c, "compute_s": c} for c in (5e-4, 8e-3)]


def test_sync_rows_recover_kappa_and_old_snapshots_load():
    f = fit_comm(LINK, comm_rows() + sync_rows())
    assert f.sync["kappa"] == pytest.approx(0.08, rel=1e-6) and f.sync["a"] == pytest.approx(2e-4, rel=1e-6)
    assert f.straggle(1, 0.1) == 0.0
    assert f.straggle(2, 0.1) == pytest.approx(0.008)
    assert f.straggle(4, 0.1) > f.straggle(2, 0.1)  # the slowest of more ranks
    # A table without sync rows (profilerd's default, older snapshots): no straggler term.
    old = fit_comm(LINK, comm_rows())
    assert old.sync == {} and old.straggle(2, 0.1) == 0.0
    assert "sync" not in old.to_dict()
    assert type(old).from_dict(f.to_dict()).sync == f.sync


def test_sync_fit_goes_through_each_chunk_lengths_medians():
    """Scattered sync rows of two chunk lengths, unlabelled (the service's rows carry only
    their measured compute_s): the line goes through each group's medians, so one slow
    row of either group does not move it and the long chunk's scatter does not pull it
    under its rows (a relative fit of the rows themselves reads kappa well below it)."""
    short = [(4.0e-4, 3.0e-4), (5.0e-4, 3.5e-4), (6.0e-4, 4.0e-4), (4.5e-4, 9.0e-3)]  # (compute_s, seconds)
    long = [(9e-3, 0.6e-3), (10e-3, 1.0e-3), (12e-3, 1.4e-3), (25e-3, 2.6e-3), (11e-3, 30e-3)]
    rows = [{"op": "sync", "bytes": 8, "world": 2, "seconds": y, "compute_s": x} for x, y in short + long]
    f = fit_comm(LINK, comm_rows() + rows)
    kappa = (1.4e-3 - 3.75e-4) / (11e-3 - 4.75e-4)  # through (median x, median y) of each group
    assert f.sync["kappa"] == pytest.approx(kappa, rel=1e-6)
    assert f.sync["a"] == pytest.approx(3.75e-4 - kappa * 4.75e-4, rel=1e-6)
    assert f.sync["n"] == len(rows) and f.sync["rel_sigma"] > 0.5  # the rows' own scatter about it
    # The old fit (relative residuals over the rows) lands well below the groups' line.
    y = np.array([r["seconds"] for r in rows])
    x = np.column_stack([np.ones(len(rows)), [r["compute_s"] for r in rows]]) / y[:, None]
    sc = np.abs(x).max(axis=0)
    assert (nnls(x / sc, np.ones(len(rows))) / sc)[1] < 0.7 * kappa
    # Grouped by the gap between chunk lengths, not by a label; one length is no slope.
    groups = sync_groups(rows)
    assert [len(g) for g in groups] == [len(short), len(long)]
    assert fit_comm(LINK, comm_rows() + rows[:len(short)]).sync == {}


def test_handoff_is_the_rendezvous_latency_plus_the_bytes():
    """A pipeline transfer between two computing ranks: the sync rows' latency a, else
    (no sync rows) send_recv's own alpha; the bytes at send_recv's rate either way."""
    with_sync = fit_comm(LINK, comm_rows(alpha=50e-6, beta=1 / 2e9) + sync_rows(a=3e-4))
    without = fit_comm(LINK, comm_rows(alpha=50e-6, beta=1 / 2e9))
    nbytes = np.array([0.0, 1 << 20])
    np.testing.assert_allclose(with_sync.handoff(nbytes), 3e-4 + nbytes / 2e9, rtol=1e-6)
    np.testing.assert_allclose(without.handoff(nbytes), 50e-6 + nbytes / 2e9, rtol=1e-6)


def test_straggler_wait_adds_to_multi_rank_plans_only(model):
    with_sync = replace(model, comm={LINK: fit_comm(LINK, comm_rows() + sync_rows())})
    one = cand(batch=16)
    dp = cand(batch=32, dp=2)
    assert with_sync.estimate(one).seconds == pytest.approx(model.estimate(one).seconds)
    a, b = model.estimate(dp), with_sync.estimate(dp)
    assert b.breakdown["straggle"] > 0 and a.breakdown["straggle"] == 0
    assert b.seconds == pytest.approx(a.seconds + b.breakdown["straggle"])
    # The snapshot keeps the sync fit and gives the same numbers.
    again = PerfModel.from_dict(json.loads(json.dumps(with_sync.to_dict())))
    assert again.estimate(dp).seconds == pytest.approx(b.seconds)
    # Pipeline stages do not run the same work in lock step: their waits are the
    # schedule's (fill, drain, bubbles), already priced; only data / tensor replicas
    # wait for the slowest of them.
    pp, tp = cand(pp=2, micro_batches=4), cand(tp=2)
    assert with_sync.estimate(pp).breakdown["straggle"] == 0.0
    assert with_sync.estimate(tp).breakdown["straggle"] > 0
    # A pipeline's transfers are priced at the sync rows' rendezvous latency (CommFit.handoff):
    # sync rows whose latency equals send_recv's leave the pipeline as it was.
    same = replace(model, comm={LINK: fit_comm(LINK, comm_rows() + sync_rows(a=50e-6))})
    assert same.estimate(pp).seconds == pytest.approx(model.estimate(pp).seconds, rel=1e-9)
    assert with_sync.estimate(pp).seconds > model.estimate(pp).seconds  # a = 200 us > alpha = 50 us


def test_resume_rows_add_a_refill_to_every_blocking_op_of_a_step(model):
    """Resume rows (a compute chunk after a blocking op minus the same chunk after a chunk)
    fit their mean; a plan pays it once per blocking op: tp = 2 four all-reduces per
    layer and micro-batch, dp = 2 its gradient bucket, pp = 2 each in-step transfer, and
    every multi-rank step its loss all-reduce; one rank pays nothing."""
    r = 1e-4
    rows = comm_rows() + [{"op": "resume", "bytes": 0, "world": 2, "seconds": s} for s in (0.5 * r, 1.5 * r)]
    f = fit_comm(LINK, rows)
    assert f.resume_time() == pytest.approx(r) and f.resume["n"] == 2
    old = fit_comm(LINK, comm_rows())  # older tables and snapshots: no refill
    assert old.resume == {} and old.resume_time() == 0.0 and "resume" not in old.to_dict()
    assert type(f).from_dict(json.loads(json.dumps(f.to_dict()))).resume == f.resume
    base = replace(model, comm={LINK: old})
    with_r = replace(model, comm={LINK: f})
    layers = 4  # cand(): 4 layers
    for c, ops in ((cand(batch=16), 0), (cand(tp=2), 4 * layers + 1), (cand(tp=2, micro_batches=2), 8 * layers + 1),
                   (cand(batch=32, dp=2), 2), (cand(pp=2), 2 + 1)):
        a, b = base.estimate(c), with_r.estimate(c)
        assert a.ok and b.ok
        assert b.seconds - a.seconds == pytest.approx(ops * r, rel=1e-6, abs=1e-12), (c, ops)


def test_refill_rows_fit_r_max_and_slow_only_pipelines(model):
    """Refill rows (a working-set chunk after idling ``idle_s`` in recv minus the same chunk
    after a chunk) fit r_max from the saturating form; the refill after idling grows with
    the wait and levels off at r_max; only the pipeline replay charges it (dp and tp
    ranks wait only their straggle), and a pipeline whose stages wait pays more."""
    from tessera.perfmodel.comm import REFILL_TAU0

    r_max = 6e-4
    rows = comm_rows() + [{"op": "refill", "bytes": 0, "world": 2, "idle_s": idle,
                           "seconds": r_max * -np.expm1(-idle / REFILL_TAU0)} for idle in (0.004, 0.012)]
    f = fit_comm(LINK, rows)
    assert f.refill["r_max"] == pytest.approx(r_max) and f.refill["n"] == 2
    assert f.refill_time(0.0) == 0.0 and f.refill_time(-1.0) == 0.0
    assert f.refill_time(REFILL_TAU0) == pytest.approx(r_max * (1 - np.exp(-1)))
    assert f.refill_time(1.0) == pytest.approx(r_max)
    np.testing.assert_allclose(f.refill_time(np.array([0.0, 1.0])), [0.0, r_max])
    old = fit_comm(LINK, comm_rows())
    assert old.refill == {} and old.refill_time(0.01) == 0.0 and "refill" not in old.to_dict()
    assert type(f).from_dict(json.loads(json.dumps(f.to_dict()))).refill == f.refill
    # A row without its wait, or a non-positive one, is not a refill measurement.
    assert fit_comm(LINK, comm_rows() + [{"op": "refill", "bytes": 0, "world": 2, "seconds": 1e-4}]).refill == {}
    base, with_r = replace(model, comm={LINK: old}), replace(model, comm={LINK: f})
    for c in (cand(batch=16), cand(tp=2), cand(batch=32, dp=2)):
        assert with_r.estimate(c).seconds == pytest.approx(base.estimate(c).seconds, rel=1e-12)
    for c in (cand(pp=2), cand(pp=2, micro_batches=4)):
        a, b = base.estimate(c), with_r.estimate(c)
        assert a.ok and b.ok and b.seconds > a.seconds
        # Each micro-batch's transfer has one waiting side at most (2 per micro-batch).
        assert b.seconds - a.seconds <= 2 * c.micro_batches * r_max + 1e-12


def test_batch_uses_each_candidates_schedule(model):
    g, o = cand(pp=2, micro_batches=4, schedule="gpipe"), cand(pp=2, micro_batches=4, schedule="1f1b")
    eg, eo = model.estimate(g), model.estimate(o)
    assert eg.memory_bytes > eo.memory_bytes
    assert model.estimate_batch([o, g]) == [eo, eg] and model.estimate_batch([g, o]) == [eg, eo]


@pytest.mark.parametrize("kw", [dict(quota=float("nan")), dict(quota=float("inf")),
                                dict(colocated=2, oversubscription=float("nan")), dict(schedule="bogus"),
                                dict(seq_len=-64), dict(vocab=-256), dict(hidden=-128), dict(heads=0),
                                dict(seq=-1), dict(seq=65), dict(seq=4096), dict(hidden=126), dict(heads=3)])
def test_invalid_candidates_are_insufficient_data_not_nan(model, kw):
    e = model.estimate(cand(**kw))
    assert not e.ok and e.confidence == 0.0 and e.reason


def test_plans_beyond_max_pp_or_micro_batches_are_invalid_not_replayed(model):
    """Replayed op by op, pp = 8 with m = 4096 micro-batches took 1.6 s of Python and
    pp = m = 1024-scale plans minutes: beyond MAX_PP / MAX_MICRO_BATCHES a plan is
    invalid (insufficient_data naming the bound), never evaluated; the bounds themselves
    are valid plans."""
    from tessera.perfmodel import MAX_MICRO_BATCHES, MAX_PP

    assert MAX_PP == MAX_MICRO_BATCHES == 1024
    for c in (cand(layers=8, pp=8, micro_batches=4096, batch=4096), cand(layers=2048, pp=MAX_PP + 1),
              cand(micro_batches=MAX_MICRO_BATCHES + 1, batch=2 * (MAX_MICRO_BATCHES + 1))):
        e = model.estimate(c)
        assert e.status == "insufficient_data" and f"pp <= {MAX_PP}" in e.reason, (c, e)
    assert model.estimate(cand(micro_batches=MAX_MICRO_BATCHES, batch=MAX_MICRO_BATCHES)).ok
    assert model.estimate(cand(layers=64, pp=64, micro_batches=2)).ok
    # Each bound alone let pp = m = 1024 through (over a minute): their product is bounded too.
    from tessera.perfmodel import MAX_PIPELINE_SLOTS

    e = model.estimate(cand(layers=1024, pp=1024, micro_batches=1024, batch=1024))
    assert e.status == "insufficient_data" and f"pp*micro_batches <= {MAX_PIPELINE_SLOTS}" in e.reason, e
    assert model.estimate(cand(layers=64, pp=64, micro_batches=128, batch=128)).ok  # 8192 slots: the bound


def test_noiseless_fit_confidence_is_floored_at_run_to_run(model):
    from tessera.perfmodel.model import RUN_TO_RUN
    exact = PerfModel(compute={"cpu": fit_compute("cpu", samples())})
    assert exact.compute["cpu"].rel_sigma < 1e-6
    e = exact.estimate(cand())
    assert e.rel_std >= RUN_TO_RUN and e.confidence < 1.0


def test_comm_uncertainty_counts_tp_allreduces_and_pipeline_sends():
    import numpy as np
    rng = np.random.default_rng(1)
    rows = [{"op": op, "bytes": b, "world": 2, "seconds": (5e-3 + b * 1e-8) * float(np.exp(0.6 * rng.standard_normal()))}
            for op in ("all_reduce", "send_recv") for b in (1e3, 1e4, 1e5, 1e6) for _ in range(3)]
    noisy = PerfModel(compute={"cpu": fit_compute("cpu", samples(noise=0.01))}, comm={LINK: fit_comm(LINK, rows)})
    one = noisy.estimate(cand())
    for kw in (dict(tp=2), dict(pp=2, micro_batches=4)):
        e = noisy.estimate(cand(**kw))
        assert e.ok and e.rel_std > one.rel_std + 0.005, kw


def _profiled(point, fitted=None):
    """A model whose cpu device type answers from ``point`` (no fitted curve unless ``fitted``)."""
    from tessera.perfmodel.compute import ComputeFit
    return PerfModel(version=1, compute={"cpu": fitted or ComputeFit(device_type="cpu")}, profiles={"cpu": [point]})


def _point(**kw):
    from tessera.perfmodel.model import ProfilePoint
    base = dict(module="m4x128", rows=16, seq=64, micro_batches=1, q=1.0, seconds=0.5, steps=20, spread=0.1)
    base.update(kw)
    return ProfilePoint(**base)


@pytest.mark.parametrize("kw", [dict(hidden=0), dict(vocab=-5), dict(heads=0), dict(schedule="bogus"),
                                dict(oversubscription=float("nan")), dict(oversubscription=-3.0),
                                dict(quota=float("nan")), dict(seq_len=0)])
def test_invalid_candidate_is_not_answered_from_a_profile(model, kw):
    # The candidate matches the profile's per-rank shape: only its validity can refuse it.
    for m in (_profiled(_point()), _profiled(_point(), fitted=model.compute["cpu"])):
        assert m.estimate(cand()).ok
        e = m.estimate(cand(**kw))
        assert not e.ok and e.confidence == 0.0 and e.seconds != e.seconds and e.reason


@pytest.mark.parametrize("kw", [dict(spread=float("nan")), dict(spread=float("inf")), dict(spread=-0.5),
                                dict(seconds=0.0), dict(seconds=-1.0), dict(seconds=float("nan")),
                                dict(seconds=float("inf")), dict(steps=0)])
def test_corrupt_profile_point_gives_no_estimate(kw):
    e = _profiled(_point(**kw)).estimate(cand())
    assert not e.ok and e.confidence == 0.0 and e.seconds != e.seconds


@pytest.mark.parametrize("spread", [0.0, 1e-12, 0.1, 5.0, 1e6])
def test_profile_confidence_is_a_probability(spread):
    e = _profiled(_point(spread=spread)).estimate(cand())
    assert e.ok and 0.0 <= e.confidence <= 1.0 and e.seconds == 0.5


def test_comm_uncertainty_counts_only_the_ops_a_plan_uses(model):
    # A send/recv table that no alpha-beta line fits (its middle size 3x slow) makes
    # pipelines less certain, not data- or tensor-parallel plans (they never send point
    # to point).
    noisy = [{**r, "seconds": 3 * r["seconds"]} if r["op"] == "send_recv" and r["bytes"] == 256 << 10 else r
             for r in comm_rows()]
    m2 = replace(model, comm={LINK: fit_comm(LINK, noisy)})
    assert m2.comm[LINK].ops["send_recv"]["rel_sigma"] > 10 * max(m2.comm[LINK].ops["all_reduce"]["rel_sigma"], 1e-6)
    for c in (cand(batch=32, dp=2), cand(tp=2)):
        assert m2.estimate(c).rel_std == pytest.approx(model.estimate(c).rel_std)
    pp = cand(pp=2, micro_batches=4)
    assert m2.estimate(pp).rel_std > model.estimate(pp).rel_std


def test_ranks_sharing_a_device_interfere_in_compute_not_in_communication(model):
    """A dp=2 plan whose ranks share one device ("split": each on its own cores) pays the
    split interference on its compute only: the same extra time whether its collectives
    are cheap or 200x dearer (the communication tables were measured with both ranks busy)."""
    dear = PerfModel(compute=model.compute, comm={LINK: fit_comm(LINK, comm_rows(alpha=1e-2))},
                     interference=model.interference)
    extra = []
    for m in (model, dear):
        own = m.estimate(cand(dp=2, batch=32)).seconds
        shared = m.estimate(cand(dp=2, batch=32, colocated=2, oversubscription=1.0)).seconds
        extra.append(shared - own)
    assert extra[0] > 0
    assert extra[1] == pytest.approx(extra[0], rel=1e-9)
    # One rank on its own: all of its time is compute, stretched by 1 + g as before.
    alone = model.estimate(cand(batch=16)).seconds
    assert model.estimate(cand(batch=16, colocated=2, oversubscription=1.0)).seconds == pytest.approx(alone * 1.1)


def test_rank_profiles_recover_each_rank_modes_interference_and_only_ranks_take_it(model):
    """Rank profiles (a dp=2 and a pp=2 plan whose ranks share the device, measured)
    give each rank mode its own g — recovered exactly from times the model made with
    known g — which then prices only multi-rank plans of that mode sharing the device:
    two independent jobs on split cores keep the split pair's g, a plan whose ranks
    also share the device with another job too, a pp plan takes "pipeline", a dp or tp
    plan "ranks"; the snapshot keeps both; rows that are no such plan are skipped, and a
    row fits its plan's mode whatever its label."""
    dp = cand(dp=2, batch=32, colocated=2)
    pp = cand(pp=2, micro_batches=4, colocated=2)
    truth = replace(model, interference={"cpu": {**model.interference["cpu"], "ranks": 0.07, "pipeline": 0.18}})
    rows = [{"mode": "ranks", "candidate": dp.__dict__, "seconds": truth.estimate(dp).seconds},
            {"mode": "pipeline", "candidate": pp.__dict__, "seconds": truth.estimate(pp).seconds},
            # skipped: not a shared-device multi-rank plan, its mode's name wrong, no time
            {"mode": "ranks", "candidate": cand(colocated=2).__dict__, "seconds": 9.0},
            {"mode": "pipeline", "candidate": dp.__dict__, "seconds": 9.0},
            {"mode": "ranks", "candidate": dp.__dict__, "seconds": float("nan")}]
    got = fit_rank_interference(model, rows)
    assert got == {"cpu": {"ranks": pytest.approx(0.07), "pipeline": pytest.approx(0.18)}}
    assert "ranks" not in model.interference["cpu"]  # pure: the model is not changed
    # A rank that ran faster than the model prices is floored at no interference.
    assert fit_rank_interference(model, [{**rows[0], "seconds": 0.5 * rows[0]["seconds"]}]) == {"cpu": {"ranks": 0.0}}
    fitted = replace(model, interference={"cpu": {**model.interference["cpu"], **got["cpu"]}})
    for c in (dp, pp, cand(tp=2, colocated=2)):
        assert fitted.estimate(c).seconds == pytest.approx(truth.estimate(c).seconds)
    # A split pair, a plan sharing its device with another job too, a time-sliced plan
    # (quotas oversubscribe the device: "shared"): not priced by the rank modes.
    for c in (cand(colocated=2), cand(dp=2, batch=32, colocated=3), cand(dp=2, batch=32, colocated=2,
                                                                         oversubscription=2.0)):
        assert fitted.estimate(c).seconds == pytest.approx(model.estimate(c).seconds)
    over = cand(dp=2, batch=32, colocated=2, oversubscription=2.0)
    assert fit_rank_interference(model, [{"mode": "ranks", "candidate": over.__dict__, "seconds": 9.0}]) == {}
    assert fitted.estimate(dp).seconds < model.estimate(dp).seconds  # g 0.07, not the split pair's 0.10
    back = PerfModel.from_dict(json.loads(json.dumps(fitted.to_dict())))
    assert back.estimate(pp).seconds == pytest.approx(fitted.estimate(pp).seconds)
    # A row fits the mode of its plan: a pipeline's profile filed as "ranks" (profilerd's
    # colobench row, runs stored before 2026-12-07's twenty-second session) fits
    # "pipeline" and prices pipelines only — a dp or tp plan keeps the split pair's g.
    one = fit_rank_interference(model, [{**rows[1], "mode": "ranks"}])
    assert one == {"cpu": {"pipeline": pytest.approx(0.18)}}
    only = replace(model, interference={"cpu": {**model.interference["cpu"], **one["cpu"]}})
    assert only.estimate(pp).seconds == pytest.approx(truth.estimate(pp).seconds)
    for c in (dp, cand(tp=2, colocated=2)):
        assert only.estimate(c).seconds == pytest.approx(model.estimate(c).seconds)
        assert only.estimate(c).seconds != pytest.approx(truth.estimate(c).seconds)


def test_interference_scales_with_the_element_wise_share_of_compute(model):
    """With the profiled pair's module shape on record, a candidate of that shape gets
    the fitted g exactly, a wider module (more of its time in matmuls) less, and the
    snapshot keeps the shape; without it (older snapshots) every candidate gets g."""
    ref = {"layers": 4, "hidden": 128, "heads": 4, "vocab": 256, "rows": 16, "seq": 64}
    scaled = PerfModel(compute=model.compute, comm=model.comm, interference=model.interference,
                       interference_ref={"cpu": ref})

    def stretch(m, **kw):
        return m.estimate(cand(colocated=2, oversubscription=1.0, **kw)).seconds / m.estimate(cand(**kw)).seconds - 1

    g = model.interference["cpu"]["split"]
    assert stretch(scaled) == pytest.approx(g)
    assert stretch(model, hidden=512) == pytest.approx(g)
    wide = stretch(scaled, hidden=512)
    assert 0 < wide < 0.8 * g
    back = PerfModel.from_dict(json.loads(json.dumps(scaled.to_dict())))
    assert back.interference_ref == {"cpu": {k: float(v) for k, v in ref.items()}}
    assert stretch(back, hidden=512) == pytest.approx(wide)
    assert "interference_ref" not in model.to_dict()


def test_time_sliced_interference_is_not_scaled_by_the_element_wise_share(model):
    """Mode "shared" (oversubscribed quotas: time slicing) takes the fitted g for every
    module, the reference shape on record or not; split and rank modes keep the scale."""
    ref = {"layers": 4, "hidden": 128, "heads": 4, "vocab": 256, "rows": 16, "seq": 64}
    scaled = replace(model, interference_ref={"cpu": ref})
    g = model.interference["cpu"]["shared"]
    assert g > 0

    def stretch(m, **kw):
        return m.estimate(cand(colocated=2, oversubscription=2.0, **kw)).seconds \
            / (2 * m.estimate(cand(**kw)).seconds) - 1

    for hidden in (64, 128, 512):
        assert stretch(scaled, hidden=hidden) == pytest.approx(g)
        assert stretch(model, hidden=hidden) == pytest.approx(g)
    split = scaled.estimate(cand(colocated=2, oversubscription=1.0, hidden=512)).seconds
    assert split != pytest.approx(model.estimate(cand(colocated=2, oversubscription=1.0, hidden=512)).seconds)


def test_per_step_work_over_tensors_above_the_grain_divides_over_the_quota():
    """``par_params`` counts the parameters in tensors of > PAR_GRAIN elements (tp-sharded;
    one of exactly PAR_GRAIN runs on one thread: ``at::parallel_for``);
    their per-step passes run on q >= 1 threads, the rest — and a quota below one core —
    stays whole; the per-step ``cold`` term is the step's element-wise units (m x one micro-batch's)."""
    import numpy as np

    from tessera.perfmodel import features as F
    from tessera.perfmodel.compute import COEFS, ComputeFit, step_params

    h = 128  # qkv 3h^2 = 49152 and fc / out 4h^2 = 65536 are above 32768; proj h^2 is not
    # The 256 x 128 embedding and head tables hold exactly PAR_GRAIN elements: serial.
    assert F.par_params(4, h, 256, 64, 1, 1) == 4 * (3 * h * h + 2 * 4 * h * h)
    assert F.par_params(4, h, 512, 64, 1, 1) == 4 * (3 * h * h + 2 * 4 * h * h) + 512 * h + h * 512
    assert F.par_params(4, h, 256, 64, 0, 0, tp=2) == 0  # 3h^2/2 = 24576 below, 4h^2/2 = 32768 at the grain
    w = 192
    assert F.par_params(4, w, 256, 64, 0, 0, tp=2) == 4 * (3 * w * w / 2 + 2 * 4 * w * w / 2)  # proj w^2/2 below
    assert F.par_params(2, 64, 256, 64, 1, 1) == 0  # model A: every tensor below the grain
    stf = F.step_features(64, 4, h, 256, 64, 1, 1, mb_elems=2.5e5, micro_batches=4)
    assert stf["cold"] == 1e6 and 0 < stf["par_params"] < stf["params"]
    assert step_params(stf, 2.0) == pytest.approx(stf["params"] - stf["par_params"] / 2)
    assert step_params(stf, 0.5) == step_params(stf, 1.0) == stf["params"]
    fit = ComputeFit(device_type="cpu", coef={k: (1e-9 if k == "c_params" else 0.0) for k in COEFS}, status="ok")
    assert fit.step_time(stf, np.array([1.0, 2.0, 4.0])) == pytest.approx(
        [1e-9 * stf["params"], 1e-9 * (stf["params"] - stf["par_params"] / 2),
         1e-9 * (stf["params"] - 3 * stf["par_params"] / 4)])


def test_a_noisy_hosts_profiles_lower_the_confidence_and_the_snapshot_keeps_it(model):
    """Profiles that scatter more than the run-to-run prior (ComputeFit.noise) widen
    every estimate's uncertainty (a new run and the estimate each carry that noise);
    quiet ones leave it at the prior. Snapshots carry the noise; older ones load as 0."""
    from tessera.perfmodel.priors import NOISE_TO_ERROR, RUN_TO_RUN

    quiet_fit = fit_compute("cpu", [replace(s, spread=0.01) for s in samples(noise=0.01)])
    noisy_fit = fit_compute("cpu", [replace(s, spread=0.08) for s in samples(noise=0.01)])
    assert NOISE_TO_ERROR * quiet_fit.noise < RUN_TO_RUN < NOISE_TO_ERROR * noisy_fit.noise
    quiet = PerfModel(version=1, compute={"cpu": quiet_fit}, comm=model.comm, interference=model.interference)
    noisy = PerfModel(version=1, compute={"cpu": noisy_fit}, comm=model.comm, interference=model.interference)
    for c in (cand(), cand(dp=2, batch=32), cand(colocated=2, oversubscription=2.0)):
        q, n = quiet.estimate(c), noisy.estimate(c)
        assert n.seconds == pytest.approx(q.seconds)  # the curve is the same
        assert n.rel_std > q.rel_std and n.confidence < q.confidence
    assert model.estimate(cand()).rel_std == pytest.approx(quiet.estimate(cand()).rel_std)
    assert noisy.estimate(cand()).rel_std >= NOISE_TO_ERROR * 0.08
    snap = json.loads(json.dumps(noisy.to_dict()))
    assert PerfModel.from_dict(snap).compute["cpu"].noise == pytest.approx(0.08)
    del snap["compute"]["cpu"]["noise"]
    assert PerfModel.from_dict(snap).compute["cpu"].noise == 0.0

"""Pure parts of controller/profiling.py: the profiling job of a job, its candidate,
and the CLI's step-time line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tessera import manifest
from tessera.api.v1 import types_pb2
from tessera.cli import _step_time
from tessera.modelkey import arch_key, shape_key

from controller.profiling import PROFILE_TENANT, candidate, is_profile_job, link_for, module_of, profile_doc

MODEL = {"vocab": 64, "seq_len": 16, "layers": 4, "hidden": 32, "heads": 2}


def doc(name="j", steps=100, batch=16, devices=4, **plan):
    p = {"dp": 2, "tp": 1, "pp": 2, "micro_batches": 2, **plan}
    return manifest.validate({"apiVersion": "tessera/v1", "name": name, "tenant": "t",
                              "workload": {"type": "gpt", "model": MODEL, "steps": steps, "batch_size": batch, "plan": p},
                              "resources": {"devices": devices, "device_kind": "cpu"}})


def test_profile_job_is_one_device_at_the_per_rank_batch_and_valid():
    pd, idem = profile_doc(doc(), steps=8)
    v = manifest.validate(pd)  # the controller submits it through the same validation
    assert v["resources"]["devices"] == 1 and v["workload"]["batch_size"] == 8 and v["workload"]["steps"] == 8
    assert v["workload"]["plan"] == {"dp": 1, "tp": 1, "pp": 1, "micro_batches": 2}
    assert v["tenant"] == PROFILE_TENANT and v["name"] == idem and len(idem) <= 63
    job = types_pb2.Job(spec=manifest.to_proto(v))
    assert is_profile_job(job)


def test_profile_key_depends_on_module_and_per_rank_shape_only():
    a = profile_doc(doc(name="a", steps=10), 8)[1]
    assert a == profile_doc(doc(name="b", steps=99, pp=1, devices=2), 8)[1]      # name, steps, pp: same profile
    assert a != profile_doc(doc(batch=32), 8)[1]                                  # another per-rank batch
    assert a != profile_doc(doc(micro_batches=1), 8)[1]


def test_candidate_of_a_job():
    c = candidate(doc(), "cpu", 1.0, nodes=2)
    assert (c.dp, c.tp, c.pp, c.micro_batches, c.batch, c.layers) == (2, 1, 2, 2, 16, 4)
    assert c.module == arch_key(doc()["workload"]) and c.link == link_for("cpu", 2) == "tcp-gloo"


def test_step_time_line_shows_estimate_next_to_measured():
    assert _step_time(types_pb2.JobStatus()) == "- measured"
    s = types_pb2.JobStatus(step_time_s=0.0123)
    assert _step_time(s) == "12.3 ms measured (last step)"
    s.step_time_median_s = 0.0101   # the executors' window: shown first, the last step beside it
    assert _step_time(s) == "10.1 ms measured (median of recent steps; last 12.3 ms)"
    s.estimate.CopyFrom(types_pb2.JobEstimate(status="ok", step_time_s=0.0119, rel_std=0.04, confidence=0.98,
                                              model_version=3))
    assert _step_time(s) == ("10.1 ms measured (median of recent steps; last 12.3 ms), "
                             "11.9 ms estimated ±4% (confidence 98%, model v3)")
    s.estimate.CopyFrom(types_pb2.JobEstimate(status="profiling", profile_job_id="j-abc"))
    assert "profiling job j-abc" in _step_time(s)
    s.estimate.CopyFrom(types_pb2.JobEstimate(status="insufficient_data", reason="no communication table"))
    assert "no communication table" in _step_time(s)


def test_estimate_rewritten_only_when_it_moved():
    from controller.profiling import _same

    a = types_pb2.JobEstimate(status="ok", step_time_s=0.100, rel_std=0.05, model_version=3)
    assert _same(a, types_pb2.JobEstimate(status="ok", step_time_s=0.1005, rel_std=0.051, model_version=9))
    assert not _same(a, types_pb2.JobEstimate(status="ok", step_time_s=0.103, rel_std=0.05, model_version=9))
    assert not _same(a, types_pb2.JobEstimate(status="ok", step_time_s=0.100, rel_std=0.07, model_version=3))
    p = types_pb2.JobEstimate(status="profiling", profile_job_id="j-1", reason="x")
    assert _same(p, types_pb2.JobEstimate(status="profiling", profile_job_id="j-1", reason="x", time=5))
    assert not _same(p, types_pb2.JobEstimate(status="insufficient_data", profile_job_id="j-1", reason="x"))


PEFT_W = {"type": "peft", "model": MODEL, "steps": 40, "batch_size": 4, "learning_rate": 0.01,
          "peft": {"tasks": [{"name": "a", "rank": 4, "steps": 10}, {"name": "b", "rank": 2}]}}
MM_W = {"type": "multimodal", "model": {**MODEL, "seq_len": 48}, "steps": 30, "batch_size": 4,
        "multimodal": {"mode": "disaggregated", "image": {"size": 16, "patch": 8, "pool": 2},
                       "encoder": {"layers": 1, "hidden": 32, "heads": 2}, "data": {"max_images": 2, "max_text": 24},
                       "mix": [{"step": 0, "image_prob": 0.0}, {"step": 30, "image_prob": 0.6}]}}


def wdoc(workload, name="w", devices=1):
    return manifest.validate({"apiVersion": "tessera/v1", "name": name, "tenant": "t", "workload": workload,
                              "resources": {"devices": devices, "device_kind": "cpu"}})


def test_profile_job_of_peft_runs_the_jobs_own_tasks_every_one_for_the_profile_steps():
    d = wdoc(PEFT_W)
    pd, idem = profile_doc(d, steps=6)
    v = manifest.validate(pd)
    w = v["workload"]
    assert v["tenant"] == PROFILE_TENANT and v["name"] == idem and v["resources"]["devices"] == 1
    assert w["steps"] == 6 and [t["steps"] for t in w["peft"]["tasks"]] == [6, 6]
    assert [t["rank"] for t in w["peft"]["tasks"]] == [4, 2] and w["batch_size"] == 4
    assert shape_key(w, 1) == module_of(d) == candidate(d, "cpu", 1.0, 1).module
    assert d["workload"]["peft"]["tasks"][0]["steps"] == 10          # the job's own doc untouched
    # another job of the same step shape (other name, run length, rates) shares the profile
    other = wdoc({**PEFT_W, "steps": 99, "learning_rate": 0.5}, name="other")
    assert profile_doc(other, 6)[1] == idem
    assert profile_doc(wdoc({**PEFT_W, "batch_size": 8}), 6)[1] != idem


def test_profile_job_of_multimodal_keeps_its_devices_and_runs_the_mean_mix():
    d = wdoc(MM_W, devices=2)
    pd, idem = profile_doc(d, steps=6)
    v = manifest.validate(pd)
    assert v["resources"]["devices"] == 2 and v["workload"]["steps"] == 6
    assert v["workload"]["multimodal"]["mix"] == [{"step": 0, "image_prob": 0.29, "audio_prob": 0.0}]  # 0.6*14.5/30
    assert shape_key(v["workload"], 2) == module_of(d) != shape_key(d["workload"], 1)
    assert profile_doc(wdoc(MM_W, devices=1), 6)[1] != idem


def test_candidate_of_a_peft_job_takes_no_gpt_plan():
    d = wdoc({**PEFT_W, "plan": {"dp": 2, "tp": 1, "pp": 1, "micro_batches": 1}})
    c = candidate(d, "cpu", 1.0, 1)
    assert (c.dp, c.tp, c.pp) == (1, 1, 1) and c.module == module_of(d)


def test_profile_steps_must_allow_a_profile_point():
    import pytest

    from controller.config import ControllerConfig
    from tessera.errors import SpecError

    assert ControllerConfig(profile_steps=5).profile_steps == 5
    for bad in (4, 0, True, 6.5):
        with pytest.raises(SpecError) as e:
            ControllerConfig(profile_steps=bad)
        assert e.value.field == "profile_steps"


def test_candidate_takes_the_plan_the_job_runs_when_the_policy_chose_another():
    d = doc()  # spec: dp 2, pp 2, m 2
    c = candidate(d, "cpu", 1.0, 1, types_pb2.ParallelPlan(dp=4, tp=1, pp=1, micro_batches=1))
    assert (c.dp, c.tp, c.pp, c.micro_batches, c.batch) == (4, 1, 1, 1, 16)
    c = candidate(d, "cpu", 1.0, 1, types_pb2.ParallelPlan())  # unset (all 0): the spec's
    assert (c.dp, c.tp, c.pp, c.micro_batches) == (2, 1, 2, 2)


def _node(partitions, devices):
    n = types_pb2.Node(name="n1")
    n.devices.extend(devices)
    n.partitions.extend(partitions)
    return {"n1": n}


def _placed(pid, dev_id, units):
    j = types_pb2.Job()
    j.status.placement.add(node="n1", device_ids=[dev_id], partition_ids=[pid], units=units)
    return j


def test_the_estimates_quota_is_the_jobs_grant_not_the_whole_device():
    from controller.profiling import Profiling

    cpu = types_pb2.Device(id="cpu0", kind="cpu", capacity=4)
    cpuset = types_pb2.Partition(id="cpu0", kind="cpuset", device_id="cpu0", capacity_units=8, unit="cores",
                                 attributes={"cores": "0,1,2,3", "units_per_core": "2"})
    nodes = _node([cpuset], [cpu])
    assert Profiling._quota(_placed("cpu0", "cpu0", 2), nodes, []) == (1.0, 1)   # 2 units of 2 per core
    assert Profiling._quota(_placed("cpu0", "cpu0", 1), nodes, []) == (0.5, 1)   # half a core (time-sliced)
    assert Profiling._quota(_placed("cpu0", "cpu0", 0), nodes, []) == (4.0, 1)   # no units: the partition
    gpu = types_pb2.Device(id="gpu0", kind="gpu", capacity=100)
    mps = types_pb2.Partition(id="gpu0-mps", kind="mps", device_id="gpu0", capacity_units=100, unit="sm_percent")
    assert Profiling._quota(_placed("gpu0-mps", "gpu0", 30), _node([mps], [gpu]), []) == (0.3, 1)
    other = types_pb2.Partition(id="gpu0", kind="device", device_id="gpu0", capacity_units=4, unit="slices")
    assert Profiling._quota(_placed("gpu0", "gpu0", 2), _node([other], [gpu]), []) == (0.5, 1)
    # Not placed: the profiled quota.
    from types import SimpleNamespace

    assert Profiling._quota(types_pb2.Job(), nodes, [SimpleNamespace(quota=2.0)]) == (2.0, 1)


def test_a_job_naming_no_device_kind_is_estimated_on_the_kind_it_runs_on_or_was_profiled_at():
    from types import SimpleNamespace

    from controller.profiling import Profiling

    any_kind = manifest.validate({"apiVersion": "tessera/v1", "name": "k", "tenant": "t",
                                  "workload": {"type": "gpt", "model": MODEL, "steps": 10, "batch_size": 8},
                                  "resources": {"devices": 1}})
    cpu_other = SimpleNamespace(device_type="cpu", rows=4, micro_batches=1)
    gpu_mine = SimpleNamespace(device_type="gpu", rows=8, micro_batches=1)
    profs = [cpu_other, gpu_mine]  # a cpu profile at another batch first
    nodes = _node([], [types_pb2.Device(id="cpu0", kind="cpu", capacity=4)])
    # Not placed: the kind of the profile at its own shape (its profiling job's), not the first.
    assert Profiling._device_kind(types_pb2.Job(), any_kind, nodes, profs, 8, 1) == "gpu"
    # Placed: the kind of its device.
    assert Profiling._device_kind(_placed("cpu0", "cpu0", 0), any_kind, nodes, profs, 8, 1) == "cpu"
    # Asked for a kind: that one.
    assert Profiling._device_kind(types_pb2.Job(), doc(), nodes, profs, 8, 1) == "cpu"
    # No profile at its shape: the first.
    assert Profiling._device_kind(types_pb2.Job(), any_kind, nodes, profs, 16, 2) == "cpu"


# --- jobs sharing a device: the estimate counts them (sharing_of, estimate_placed) --------

def _running(job_id, node, parts, units=0, phase=types_pb2.RUNNING, fused_into=""):
    """A job placed with one rank on each partition of ``parts`` (a list of (device, partition))."""
    j = types_pb2.Job(id=job_id)
    j.status.phase = phase
    j.status.fused_into = fused_into
    j.status.placement.add(node=node, device_ids=[d for d, _ in parts], partition_ids=[p for _, p in parts],
                           units=units)
    return j


def _cpu_nodes(kind="cpuset", unit="cores", cap=4):
    cpu = types_pb2.Device(id="cpu0", kind="cpu", capacity=4)
    part = types_pb2.Partition(id="cpu0", kind=kind, device_id="cpu0", capacity_units=cap, unit=unit)
    return _node([part], [cpu])


def test_sharing_counts_every_executor_on_the_jobs_partition_its_own_ranks_included():
    from controller.profiling import ALONE, partition_load, sharing_of

    nodes = _cpu_nodes()
    a = _running("j-a", "n1", [("cpu0", "cpu0")], units=2)
    b = _running("j-b", "n1", [("cpu0", "cpu0")], units=1)
    c = _running("j-c", "n1", [("cpu0", "cpu0"), ("cpu0", "cpu0")], units=1)   # two ranks on it
    pending = _running("j-p", "n1", [("cpu0", "cpu0")], units=1, phase=types_pb2.PENDING)
    ended = _running("j-e", "n1", [("cpu0", "cpu0")], units=1, phase=types_pb2.SUCCEEDED)
    fused = _running("j-f", "n1", [("cpu0", "cpu0")], units=1, fused_into="j-a")
    jobs = [a, b, c, pending, ended, fused]
    load = partition_load(jobs, nodes)
    s = sharing_of(a, load, nodes)
    # a, b and c's two ranks: 4 executors, 2 + 1 + 1 + 1 = 5 of 4 cores' units granted.
    assert (s.colocated, s.oversubscription, s.where, s.others) == (4, 5 / 4, "n1/cpu0", ("j-b", "j-c"))
    assert s.mode == "shared"
    alone = [_running("j-x", "n1", [("cpu0", "cpu0")], units=1)]
    assert sharing_of(alone[0], partition_load(alone, nodes), nodes) == ALONE
    assert sharing_of(pending, load, nodes) == ALONE          # not placed yet: nothing shared
    two_ranks = [_running("j-r", "n1", [("cpu0", "cpu0"), ("cpu0", "cpu0")], units=2)]
    s = sharing_of(two_ranks[0], partition_load(two_ranks, nodes), nodes)
    assert (s.colocated, s.oversubscription, s.others, s.mode) == (2, 1.0, (), "split")


def test_sharing_on_a_time_sliced_device_oversubscribes_it_by_the_executors_and_isolated_partitions_do_not_share():
    from controller.profiling import Profiling, partition_load, sharing_of

    nodes = _cpu_nodes(kind="timeslice", unit="slots", cap=4)
    jobs = [_running(f"j-{i}", "n1", [("cpu0", "cpu0")], units=1) for i in range(3)]
    s = sharing_of(jobs[0], partition_load(jobs, nodes), nodes)
    assert (s.colocated, s.oversubscription, s.mode) == (3, 3.0, "shared")
    # Each time-sliced executor runs on the whole device (not 1 slot of 4 of it).
    assert Profiling._quota(jobs[0], nodes, []) == (4.0, 1)
    # Two MIG instances of one GPU are two partitions: nobody shares either.
    gpu = types_pb2.Device(id="gpu0", kind="gpu", capacity=100)
    migs = [types_pb2.Partition(id=f"gpu0-mig{i}", kind="mig", device_id="gpu0", capacity_units=1, unit="instance")
            for i in range(2)]
    gnodes = _node(migs, [gpu])
    g = [_running(f"j-g{i}", "n1", [("gpu0", f"gpu0-mig{i}")]) for i in range(2)]
    assert sharing_of(g[0], partition_load(g, gnodes), gnodes).colocated == 1
    # MPS: 30 + 50 % of one GPU's partition: split, not oversubscribed.
    mps = types_pb2.Partition(id="gpu0-mps", kind="mps", device_id="gpu0", capacity_units=100, unit="sm_percent")
    mnodes = _node([mps], [gpu])
    m = [_running("j-m1", "n1", [("gpu0", "gpu0-mps")], units=30), _running("j-m2", "n1", [("gpu0", "gpu0-mps")], units=50)]
    s = sharing_of(m[0], partition_load(m, mnodes), mnodes)
    assert (s.colocated, s.oversubscription, s.mode, s.others) == (2, 0.8, "split", ("j-m2",))


def test_a_shared_device_is_estimated_with_its_fitted_interference_or_says_it_is_not_counted():
    from tests.unit.test_perfmodel_compose import cand, comm_rows
    from tests.unit.test_perfmodel_fit import samples

    from controller.profiling import ALONE, Sharing, estimate_placed, to_status
    from tessera.perfmodel import PerfModel, fit_comm, fit_compute, fit_interference

    pairs = [{"mode": "split", "colocated": 2, "oversubscription": 1.0, "alone_s": 1.0, "together_s": 1.1}]
    fit = fit_compute("cpu", samples(noise=0.01))
    with_split = PerfModel(version=1, compute={"cpu": fit}, comm={"lo": fit_comm("lo", comm_rows())},
                           interference={"cpu": fit_interference(pairs)})
    c = cand()
    alone = estimate_placed(with_split, c, ALONE)
    assert alone == with_split.estimate(c)
    split = estimate_placed(with_split, c, Sharing(2, 0.75, "n1/cpu0", ("j-b",)))
    assert split.ok and split.seconds == pytest.approx(alone.seconds * 1.1)
    assert "shares n1/cpu0 with 1 other job (j-b)" in split.reason and "split interference counted" in split.reason
    # Time slicing with no shared-mode profile: the estimate alone, stretched by the
    # oversubscription, wider, and saying what it leaves out.
    shared = estimate_placed(with_split, c, Sharing(2, 2.0, "n1/cpu0", ("j-b",)))
    assert shared.ok and shared.seconds == pytest.approx(alone.seconds * 2)
    assert shared.rel_std > alone.rel_std and shared.confidence < alone.confidence
    assert "interference not counted (no colocation (shared) profile for device type 'cpu')" in shared.reason
    assert "time slicing x2 counted" in shared.reason
    # No interference at all: split neighbours leave the time as it is, and say so.
    bare = replace(with_split, interference={})
    s = estimate_placed(bare, c, Sharing(3, 1.0, "n1/cpu0", ("j-b", "j-c")))
    assert s.seconds == pytest.approx(alone.seconds) and "interference not counted" in s.reason
    assert "2 other jobs (j-b, j-c)" in s.reason
    # An estimate that fails for another reason still fails.
    bad = estimate_placed(with_split, cand(layers=0), Sharing(2, 1.0, "n1/cpu0", ("j-b",)))
    assert not bad.ok and "invalid plan" in bad.reason
    # The job's status carries the reason; `tessera get` shows it beside the estimate.
    st = types_pb2.JobStatus(step_time_median_s=0.02)
    st.estimate.CopyFrom(to_status(split, 1, 0.0))
    assert "(j-b)" in _step_time(st) and "split interference counted" in _step_time(st)


def test_a_job_answered_from_its_measured_profile_counts_its_neighbours_where_the_mode_is_fitted():
    """No fitted curve yet (a fresh testbed: a few profiles): the measured profile answers,
    stretched by the fitted interference of the mode; without that mode, or with its own
    ranks sharing, the estimate alone and a reason that says what is not counted."""
    from tests.unit.test_perfmodel_compose import _point, _profiled, cand

    from controller.profiling import Sharing, estimate_placed

    model = replace(_profiled(_point()), interference={"cpu": {"split": 0.2}})
    c = cand()
    alone = model.estimate(c)
    assert alone.ok and alone.seconds == pytest.approx(0.5)
    split = estimate_placed(model, c, Sharing(3, 0.9, "n1/cpu0", ("j-b", "j-c")))
    assert split.ok and split.seconds == pytest.approx(0.5 * 1.4) and split.breakdown["colocation"] == pytest.approx(1.4)
    assert split.rel_std > alone.rel_std and "split interference counted" in split.reason
    assert "measured profile of the per-rank configuration" in split.reason
    shared = estimate_placed(model, c, Sharing(2, 2.0, "n1/cpu0", ("j-b",)))
    assert shared.ok and shared.seconds == pytest.approx(0.5 * 2)
    assert "interference not counted (no colocation (shared) profile for device type 'cpu')" in shared.reason
    ranks = estimate_placed(model, cand(dp=2, batch=32, link="lo"), Sharing(2, 1.0, "n1/cpu0", ()))
    assert not ranks.ok  # no communication table: not even alone

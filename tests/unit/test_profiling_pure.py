"""Pure parts of controller/profiling.py: the profiling job of a job, its candidate,
and the CLI's step-time line."""

from __future__ import annotations

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

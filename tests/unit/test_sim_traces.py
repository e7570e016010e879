"""Trace readers and converters: Arena's format (any file with its columns), Philly
(Pollux's table) and Alibaba openb with fractional GPU requests."""

from __future__ import annotations

import json

import pytest

from controller.policy import TableEstimator
from controller.sim import (cluster_nodes, convert_openb, convert_philly, load_arena_trace, load_cluster,
                            load_iter_times, synthetic_trace)
from controller.sim.traces import model_key

TABLE = {"bert_760M_128": {"a40:1x1": 2.0, "a40:1x2": 1.1, "a100:1x4": 0.4},
         "moe_10B_256": {"a100:2x4": 3.0, "v100:1x16": 4.0}}


def test_model_key():
    assert model_key("bert__2.6B", 256) == "bert_2.6B_256"


def test_arena_trace_with_extra_and_optional_columns(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("job_id,submission_time,num_iteration,model_name,deadline,batch_size,num_gpu,gpu_type,gpu_fraction,backbone,extra\n"
                 "b,20,100,bert__760M,0,128,2,a40,,,x\n"
                 "a,10,50,moe__10B,0,256,8,a100,0.5,llama,y\n")
    jobs = load_arena_trace(str(p))
    assert [j.job_id for j in jobs] == ["a", "b"]
    assert jobs[0].model == "moe_10B_256" and jobs[0].gpu_fraction == 0.5 and jobs[0].backbone == "llama"
    assert jobs[1].num_gpu == 2 and jobs[1].gpu_type == "a40" and jobs[1].iterations == 100


def test_cluster_json(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"a100": {"nodes": 2, "gpus_per_node": 4}, "a10": {"nodes": 1, "gpus_per_node": 2}}))
    nodes = load_cluster(str(p))
    assert len(nodes) == 3 and sum(len(n.devices) for n in nodes) == 10
    assert {d.model for n in nodes for d in n.devices} == {"a100", "a10"}


def test_philly_converter_keeps_duration_on_requested_shape(tmp_path):
    p = tmp_path / "philly.csv"
    p.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n"
                 "2017-10-09 07:01:55,3600.0,1,3600.0,vc1\n"
                 "2017-10-09 08:01:55,7200.0,8,57600.0,vc2\n")
    jobs = convert_philly(str(p), TABLE, limit=None)
    assert [j.submit for j in jobs] == [0.0, 3600.0]
    est = TableEstimator(TABLE)
    for j, dur in zip(jobs, (3600.0, 7200.0)):
        cfg = [k for k in TABLE[j.model] if k.startswith(j.gpu_type + ":")]
        times = [TABLE[j.model][k] * j.iterations for k in cfg]
        assert any(abs(t - dur) / dur < 0.01 for t in times)
        assert est.iter_time(j.model, j.gpu_type, 1, 1) is not None or j.num_gpu > 1
    assert jobs[1].tenant == "vc2"


def test_openb_converter_fractional_requests(tmp_path):
    p = tmp_path / "openb.csv"
    p.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
                 "p0,1000,100,1,300,,LS,Running,0,1000,10\n"
                 "p1,1000,100,0,0,,LS,Running,0,1000,0\n"
                 "p2,1000,100,8,1000,,LS,Running,5,3605,5\n"
                 "p3,1000,100,1,1000,,LS,Failed,7,7,7\n")
    jobs = convert_openb(str(p), TABLE)
    assert [j.job_id for j in jobs] == ["p0", "p2"]  # CPU-only and zero-length pods dropped
    assert jobs[0].gpu_fraction == pytest.approx(0.3) and jobs[0].iterations == 990
    assert jobs[0].model.startswith("fixed:")
    assert jobs[1].num_gpu == 8 and jobs[1].gpu_fraction == 1.0


def test_shared_files_load_when_present():
    import os
    base = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "arena")
    if not os.path.exists(os.path.join(base, "philly_trace.csv")):
        pytest.skip("shared Arena data not present")
    table = load_iter_times(os.path.join(base, "iter_time_optimal.json"))
    jobs = load_arena_trace(os.path.join(base, "philly_trace.csv"))
    assert len(jobs) == 1938 and all(j.model in table for j in jobs)
    assert sum(len(n.devices) for n in load_cluster(os.path.join(base, "cluster_1280.json"))) == 1280


def test_synthetic_trace_is_deterministic():
    a = synthetic_trace(50, TABLE, ["a40", "a100"], seed=3, fractional_share=0.3)
    b = synthetic_trace(50, TABLE, ["a40", "a100"], seed=3, fractional_share=0.3)
    assert a == b and any(j.gpu_fraction < 1 for j in a)
    assert cluster_nodes({"a40": (1, 2)})[0].devices[1].device_id == "g1"

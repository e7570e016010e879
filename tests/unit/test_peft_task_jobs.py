"""Each peft task is its own job to its tenant: pure views over the parent's record
(controller/tasks.py) and the agent's side (task events -> TASK reports, control file)."""

from __future__ import annotations

import asyncio
import json

from agent.executors import Executor, ExecutorManager
from controller import tasks
from tessera import manifest
from tessera.api.v1 import types_pb2 as tpb

P = tpb.JobPhase


def peft_job(phase=P.RUNNING) -> tpb.Job:
    doc = manifest.validate({"apiVersion": "tessera/v1", "name": "lora", "tenant": "alice", "workload": {
        "type": "peft", "model": {"vocab": 64, "seq_len": 16, "layers": 1, "hidden": 16, "heads": 2}, "steps": 5,
        "peft": {"tasks": [{"name": "t0"}, {"name": "t1", "rank": 4}]}}})
    job = tpb.Job(id="j-000000000001", spec=manifest.to_proto(doc), created=1.0, revision=7)
    job.status.phase = phase
    job.status.reason = "executors started on n1"
    job.status.allocation_id = "a-1"
    job.status.placement.add(node="n1", device_ids=["cpu0"])
    return job


def test_split_id():
    assert tasks.split_id("j-1/t3") == ("j-1", "t3")
    assert tasks.split_id("j-1") == ("j-1", None)


def test_task_names_from_spec_and_none_for_gpt():
    assert tasks.task_names(peft_job()) == ["t0", "t1"]
    gpt = tpb.Job(id="j-2")
    gpt.spec.workload.type = "gpt"
    assert tasks.task_names(gpt) == [] and tasks.views(gpt) == []


def test_reports_fold_into_task_and_view_is_a_job_of_the_tenant():
    job = peft_job()
    assert tasks.apply_report(job, "t0", "running", 0, 5, 0.0, 0.0)
    assert tasks.apply_report(job, "t0", "running", 3, 5, 4.0, 900.0)
    assert tasks.apply_report(job, "t0", "running", 5, 5, 3.5, 1000.0)
    v = tasks.view(job, "t0")
    assert v.id == "j-000000000001/t0" and v.parent_id == job.id
    assert v.spec.tenant == "alice" and v.spec.name == "lora/t0"
    assert v.status.phase == P.RUNNING and v.status.step == 5 and v.status.total_steps == 5
    assert v.status.first_loss == 4.0 and v.status.loss == 3.5
    assert [s.node for s in v.status.placement] == ["n1"]  # the shared executor
    assert v.status.tasks[0].tokens_per_s == 1000.0
    # t1 never reported: not started yet while the parent runs.
    assert tasks.view(job, "t1").status.phase == P.SCHEDULED
    assert tasks.view(job, "nope") is None
    assert [x.id for x in tasks.views(job)] == [f"{job.id}/t0", f"{job.id}/t1"]


def test_terminal_task_is_never_revived_or_relabelled():
    job = peft_job()
    tasks.apply_report(job, "t0", "cancelled", 2, 5, 4.0, 10.0)
    assert not tasks.apply_report(job, "t0", "running", 3, 5, 3.0, 10.0)
    assert not tasks.apply_report(job, "t0", "succeeded", 5, 5, 3.0, 10.0)  # a requeued executor re-announcing
    assert tasks.view(job, "t0").status.phase == P.CANCELLED
    assert not tasks.apply_report(job, "t1", "bogus", 1, 5, 1.0, 1.0)
    assert tasks.find(job, "t1") is None


def test_unchanged_report_writes_nothing_and_run_time_tasks_are_listed():
    job = peft_job()
    assert tasks.apply_report(job, "t9", "running", 1, 8, 2.0, 5.0)  # added through the control file
    assert not tasks.apply_report(job, "t9", "running", 1, 8, 2.0, 5.0)
    assert [x.id.split("/")[1] for x in tasks.views(job)] == ["t0", "t1", "t9"]


def test_running_task_of_an_ended_job_takes_the_job_phase():
    job = peft_job()
    tasks.apply_report(job, "t0", "succeeded", 5, 5, 3.0, 10.0)
    tasks.apply_report(job, "t1", "running", 2, 5, 3.0, 10.0)
    job.status.phase = P.FAILED
    assert tasks.view(job, "t0").status.phase == P.SUCCEEDED
    v1 = tasks.view(job, "t1")
    assert v1.status.phase == P.FAILED and job.id in v1.status.reason


def _manager(tmp_path, reports):
    async def on_report(ex, r):
        reports.append(r)
    return ExecutorManager(tmp_path, [], on_report)


def test_agent_turns_task_events_into_unthrottled_task_reports(tmp_path):
    reports: list = []
    mgr = _manager(tmp_path, reports)
    ex = Executor("a-1", "j-1", 0, ["cpu0"], tmp_path / "l.log")
    ev = {"event": "task", "task": "t0", "phase": "running", "step": 0, "steps": 5, "loss": None, "tokens_per_s": 0.0}
    for i in range(3):
        asyncio.run(mgr._event(ex, {**ev, "step": i}))
    assert [r["kind"] for r in reports] == ["TASK"] * 3
    assert reports[-1] == {"kind": "TASK", "task": "t0", "task_phase": "running", "step": 2, "total_steps": 5,
                           "loss": 0.0, "tokens_per_s": 0.0}


def test_append_control_writes_one_line_to_the_executor_control_file(tmp_path):
    mgr = _manager(tmp_path, [])
    ckpt = tmp_path / "ckpt"
    (tmp_path / "specs" / "a-1-r0.json").write_text(json.dumps({"checkpoint_dir": str(ckpt)}))
    mgr.executors[("a-1", 0)] = Executor("a-1", "j-1", 0, ["cpu0"], tmp_path / "l.log",
                                         labels={"module": "peft:l1-h32-a4-s32-v64:w0123456789ab", "rank": "0"})
    path = mgr.append_control("a-1", {"op": "cancel", "task": "t1"})
    assert path == str(ckpt / "peft-control.jsonl")
    # its steps no longer run the spec's tasks: not a profile of the spec's step shape any more
    assert "module" not in mgr.executors[("a-1", 0)].labels and mgr.executors[("a-1", 0)].labels["rank"] == "0"
    mgr.append_control("a-1", {"op": "cancel", "task": "t0"})
    lines = (ckpt / "peft-control.jsonl").read_text().splitlines()
    assert [json.loads(x)["task"] for x in lines] == ["t1", "t0"]
    try:
        mgr.append_control("a-2", {"op": "cancel", "task": "t0"})
    except KeyError as e:
        assert "a-2" in str(e)
    else:
        raise AssertionError("append_control to an unknown allocation must fail")


def test_a_relaunched_peft_executor_with_control_lines_is_no_profile_of_its_spec(tmp_path):
    from agent.executors import _has_control

    spec = {"workload": {"type": "peft"}, "checkpoint_dir": str(tmp_path)}
    assert not _has_control(spec)                                   # no control file yet
    (tmp_path / "peft-control.jsonl").write_text("")
    assert not _has_control(spec)
    (tmp_path / "peft-control.jsonl").write_text('{"op": "cancel", "task": "t0"}\n')
    assert _has_control(spec)
    assert not _has_control({**spec, "workload": {"type": "gpt"}})
    other = tmp_path / "c.jsonl"
    assert not _has_control({**spec, "control_file": str(other)})   # the spec's own control file counts

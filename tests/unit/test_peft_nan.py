"""peft: a task whose loss or gradients become non-finite ends "failed" before its update
(its last finite state kept, no adapter.pt), the others train on; the executor exits 1 only
when no task succeeded."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch

from agent.runtime.peft.workload import run
from agent.runtime.report import Reporter
from controller import tasks as peft_tasks
from tessera.api.v1 import types_pb2
# One tiny model, event parsing and one intra-op thread (autouse), as there.
from tests.unit.test_peft_workload import _one_thread, events, workload  # noqa: F401

BOOM = {"name": "boom", "learning_rate": 1e30}  # step 1 finite, its update makes step 2's loss NaN


def spec(tmp_path, tasks, mode="spatial"):
    return {"job_id": "j", "workload": workload(tasks, mode, steps=6, checkpoint_every=1), "dist": {},
            "checkpoint_dir": str(tmp_path), "threads": 1}


def finite(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return not obj.is_floating_point() or bool(torch.isfinite(obj).all())
    if isinstance(obj, dict):
        return all(finite(v) for v in obj.values())
    return True


@pytest.mark.parametrize("mode", ["spatial", "temporal"])
def test_a_diverging_task_fails_alone_and_keeps_its_last_finite_state(tmp_path, mode):
    buf = io.StringIO()
    assert run(spec(tmp_path, [{"name": "ok"}, BOOM], mode), Reporter(buf)) == 0
    ev = events(buf)
    ends = {e["task"]: e for e in ev if e["event"] == "task" and e["phase"] != "running"}
    assert ends["ok"]["phase"] == "succeeded" and ends["boom"]["phase"] == "failed"
    assert ends["boom"]["step"] == 1  # step 2 diverged: never applied
    errs = [e for e in ev if e["event"] == "error"]
    assert len(errs) == 1 and errs[0]["task"] == "boom" and errs[0]["fatal"] is False
    assert "boom" in errs[0]["message"] and "at step 2" in errs[0]["message"]
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in ev if e["event"] == "progress")
    boom = tmp_path / "peft" / "boom"
    assert not (boom / "adapter.pt").exists()
    st = torch.load(boom / "state.pt", weights_only=True)
    assert finite(st) and st["adapter"]["step"] == 1
    assert json.loads((boom / "outcome.json").read_text())["phase"] == "failed"
    assert ev[-1]["event"] == "done" and os.path.exists(tmp_path / "peft" / "ok" / "adapter.pt")
    ok = ev[-1]["tasks"]["ok"]
    assert ok["step"] == 6 and ok["loss"] < ok["first_loss"]  # the other task trained on
    # A relaunch reports it failed at its step and does not retrain it.
    buf2 = io.StringIO()
    assert run(spec(tmp_path, [{"name": "ok"}, BOOM], mode), Reporter(buf2)) == 0
    again = [e for e in events(buf2) if e["event"] == "task" and e["task"] == "boom"]
    assert [(e["phase"], e["step"], e.get("resumed")) for e in again] == [("failed", 1, True)]


def test_every_task_failing_exits_1_with_an_error(tmp_path):
    buf = io.StringIO()
    assert run(spec(tmp_path, [BOOM]), Reporter(buf)) == 1
    ev = events(buf)
    assert ev[-1]["event"] == "error" and "boom" in ev[-1]["message"]
    assert not any(e["event"] == "done" for e in ev)


def test_controller_keeps_a_failed_task_failed():
    job = types_pb2.Job(id="j-1")
    assert peft_tasks.apply_report(job, "t", "failed", 3, 6, 2.0, 0.0)
    t = peft_tasks.find(job, "t")
    assert t.phase == types_pb2.JobPhase.FAILED and "non-finite" in t.reason
    assert not peft_tasks.apply_report(job, "t", "running", 4, 6, 2.0, 0.0)  # terminal stays

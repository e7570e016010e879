"""The peft control file: a bad line is rejected once, never kills the executor, and is
never applied again by a relaunched executor."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch

from agent.runtime.peft import lora
from agent.runtime.peft.workload import REJECTED_FILE, PeftRunner, parse, run
from agent.runtime.report import Reporter
# One tiny model, spatial workload, event parsing and one intra-op thread (autouse), as there.
from tests.unit.test_peft_workload import MODEL, _one_thread, events, workload  # noqa: F401


def spec(tmp_path, tasks, **kw):
    return {"job_id": "j", "workload": workload(tasks, **kw), "dist": {}, "checkpoint_dir": str(tmp_path),
            "threads": 1}


def control(tmp_path, *lines):
    with open(os.path.join(tmp_path, "peft-control.jsonl"), "a") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")


@pytest.mark.parametrize("line,field", [
    ({"op": "cancel", "task": ["a"]}, "control[0].task"),
    ({"op": "cancel", "task": {"x": 1}}, "control[0].task"),
    ({"op": "add", "task": {"name": "x", "dataset": {"kind": "text", "path": "/nonexistent/data.txt"}}},
     "control[0].task.dataset.path"),
    ({"op": "add", "task": {"name": "y", "dataset": {"kind": "jsonl", "path": "/"}}},
     "control[0].task.dataset.path"),
    ("{not json", "control[0]"),
    ({"op": "add", "task": {"name": "z", "rank": 4}, "dir": "relative/dir"}, "control[0].dir"),
    ({"op": "add", "task": {"name": "big", "rank": 2**31 - 1}}, "control[0].task.rank"),  # > model hidden (32)
    ({"op": "add", "task": {"name": "big", "batch_size": 2**31 - 1}}, "control[0].task.batch_size"),
])
def test_bad_line_is_a_non_fatal_error_and_the_others_train_on(tmp_path, line, field):
    control(tmp_path, line)
    buf = io.StringIO()
    assert run(spec(tmp_path, [{"name": "a", "steps": 3}]), Reporter(buf)) == 0
    ev = events(buf)
    errs = [e for e in ev if e["event"] == "error"]
    assert [(e["field"], e["line"], e["fatal"]) for e in errs] == [(field, 0, False)]
    assert [e["phase"] for e in ev if e["event"] == "task" and e["task"] == "a"] == ["running", "succeeded"]
    assert ev[-1]["event"] == "done"


def test_rejected_line_is_never_applied_by_a_relaunch(tmp_path):
    data = tmp_path / "late.txt"
    tasks = [{"name": "a", "steps": 3}]
    cfg, sec, p = parse(workload(tasks, checkpoint_every=1))
    buf = io.StringIO()
    r = PeftRunner(cfg, sec, p, Reporter(buf), str(tmp_path))
    r.add_task(sec["tasks"][0])
    assert r.step()
    control(tmp_path, {"op": "add", "task": {"name": "c", "steps": 2, "dataset": {"kind": "text", "path": str(data)}}},
            {"op": "cancel", "task": 7})
    assert r.step()  # the executor survives both lines
    assert [(e["field"], e["line"]) for e in events(buf) if e["event"] == "error"] == [
        ("control[0].task.dataset.path", 0), ("control[1].task", 1)]
    assert set(r.engine.tasks) == {"a"} and r.engine.tasks["a"].step == 2
    with open(tmp_path / REJECTED_FILE) as f:
        assert [json.loads(x)["line"] for x in f] == [0, 1]
    # The file appears later: the relaunch (re-reading the control file from its start)
    # still does not add c, and reports nothing again.
    data.write_text("some text long enough for a sample\n" * 4)
    buf2 = io.StringIO()
    again = PeftRunner(cfg, sec, p, Reporter(buf2), str(tmp_path))
    again.add_task(sec["tasks"][0])
    assert again.engine.tasks["a"].step == 2  # resumed from its state.pt
    while again.step():
        pass
    assert set(again.engine.tasks) == {"a"} and again.engine.tasks["a"].status == "succeeded"
    assert not [e for e in events(buf2) if e["event"] == "error"]
    # An edited line at the same index is a different line: it is applied.
    with open(tmp_path / "peft-control.jsonl", "w") as f:
        f.write(json.dumps({"op": "add", "task": {"name": "c", "steps": 1,
                                                   "dataset": {"kind": "text", "path": str(data)}}}) + "\n")
    third = PeftRunner(cfg, sec, p, Reporter(io.StringIO()), str(tmp_path))
    third.poll_control()
    assert third.engine.tasks["c"].status == "running"


def test_bad_dataset_path_in_the_spec_is_a_spec_error(tmp_path):
    buf = io.StringIO()
    rc = run(spec(tmp_path, [{"name": "a"}, {"name": "b", "dataset": {"kind": "text", "path": str(tmp_path)}}]),
             Reporter(buf))
    errs = [e for e in events(buf) if e["event"] == "error"]
    assert rc == 2 and [e["field"] for e in errs] == ["workload.peft.tasks[1].dataset.path"]


def test_engine_failure_is_fatal_once_then_the_line_is_skipped(tmp_path, monkeypatch):
    # The one hardware boundary: memory runs out while the adapter banks grow.
    real = lora.LoRABank.resize

    def oom(self, slots, rank):
        if rank > 8:  # the added task's rank 16, not a's 8
            raise torch.OutOfMemoryError("simulated: cannot allocate the grown bank")
        real(self, slots, rank)

    tasks = [{"name": "a", "steps": 5}]
    control(tmp_path, {"op": "add", "task": {"name": "big", "rank": 16, "steps": 2}})
    with monkeypatch.context() as m:
        m.setattr(lora.LoRABank, "resize", oom)
        buf = io.StringIO()
        assert run(spec(tmp_path, tasks, checkpoint_every=100), Reporter(buf)) == 1
    errs = [e for e in events(buf) if e["event"] == "error"]
    assert errs[0]["fatal"] is True and errs[0]["line"] == 0 and errs[0]["field"] == "control[0].task"
    assert "OutOfMemoryError" in errs[0]["message"] and len(errs) == 2  # then run()'s exit event
    assert os.path.exists(tmp_path / "peft" / "a" / "state.pt")  # a checkpointed before the exit
    buf2 = io.StringIO()
    assert run(spec(tmp_path, tasks, checkpoint_every=100), Reporter(buf2)) == 0  # no crash loop
    ev = events(buf2)
    assert not [e for e in ev if e["event"] == "error"]
    assert set(ev[-1]["tasks"]) == {"a"} and ev[-1]["tasks"]["a"]["phase"] == "succeeded"


def test_rank_above_the_model_hidden_size_is_a_spec_error(tmp_path):
    buf = io.StringIO()
    assert run(spec(tmp_path, [{"name": "a", "rank": 33}]), Reporter(buf)) == 2
    assert [e["field"] for e in events(buf) if e["event"] == "error"] == ["workload.peft.tasks[0].rank"]
    cfg, sec, _ = parse(workload([{"name": "a", "rank": 32}]))
    assert sec["tasks"][0]["rank"] == cfg.hidden == 32


def test_rejected_duplicate_add_does_not_move_the_running_task_files(tmp_path):
    other = tmp_path / "other-job" / "peft" / "a"
    cfg, sec, p = parse(workload([{"name": "a", "steps": 3}], checkpoint_every=1))
    buf = io.StringIO()
    r = PeftRunner(cfg, sec, p, Reporter(buf), str(tmp_path))
    r.add_task(sec["tasks"][0])
    assert r.step()
    control(tmp_path, {"op": "add", "task": {"name": "a"}, "dir": str(other)})
    while r.step():
        pass
    assert [e["field"] for e in events(buf) if e["event"] == "error"] == ["control[0].task.name"]
    assert r.task_dir("a") == str(tmp_path / "peft" / "a")
    assert sorted(os.listdir(tmp_path / "peft" / "a")) == ["adapter.pt", "state.pt"]
    assert not os.path.exists(other)


def resumed(tmp_path, steps_first, steps_again, at):
    """A task trained ``at`` steps and checkpointed (SIGTERM), then relaunched with ``steps_again``."""
    cfg, sec, p = parse(workload([{"name": "a", "steps": steps_first}]))
    first = PeftRunner(cfg, sec, p, Reporter(io.StringIO()), str(tmp_path))
    first.add_task(sec["tasks"][0])
    for _ in range(at):
        assert first.step()
    first.checkpoint_running()
    saved = first.engine.tasks["a"].tokens
    cfg, sec, p = parse(workload([{"name": "a", "steps": steps_again}]))
    buf = io.StringIO()
    again = PeftRunner(cfg, sec, p, Reporter(buf), str(tmp_path))
    again.add_task(sec["tasks"][0])
    return again, buf, saved


def test_tokens_per_s_after_a_resume_counts_only_this_executors_tokens(tmp_path):
    again, buf, saved = resumed(tmp_path, 8, 8, 4)
    t = again.engine.tasks["a"]
    assert t.step == 4 and t.tokens == saved > 0  # the total carries over ...
    first = [e for e in events(buf) if e["event"] == "task"][0]
    assert first["step"] == 4 and first["tokens_per_s"] == 0.0  # ... the rate does not
    assert again.step()
    now = t.added_at + 2.0
    assert t.tokens_per_s(now) == pytest.approx((t.tokens - saved) / 2.0)


def test_resumed_task_already_at_its_steps_ends_without_training(tmp_path):
    again, buf, _ = resumed(tmp_path, 8, 3, 4)
    t = again.engine.tasks["a"]
    assert t.status == "succeeded" and t.step == 4 and again.engine.running() == []
    assert not again.step()  # no extra step
    assert [(e["phase"], e["step"]) for e in events(buf) if e["event"] == "task"] == [("succeeded", 4)]
    ad = torch.load(tmp_path / "peft" / "a" / "adapter.pt", weights_only=True)
    assert ad["step"] == 4


@pytest.mark.parametrize("allocation", ["alloc-1", "alloc-2"])
def test_an_added_tasks_data_seed_does_not_depend_on_which_lines_this_executor_applied(tmp_path, allocation):
    # Line 0 belongs to allocation alloc-1 (a fused guest task); a relaunch under alloc-2 skips
    # it. Task "e" (line 1, no dataset seed) must draw the same data either way: its seed is
    # workload seed + spec tasks + its line index, not + the adds applied so far.
    guest = tmp_path / "guest"
    control(tmp_path,
            {"op": "add", "allocation": "alloc-1", "dir": str(guest),
             "task": {"name": "j-0123456789ab_g", "rank": 2, "steps": 3, "dataset": {"seed": 7}}},
            {"op": "add", "task": {"name": "e", "rank": 3, "steps": 3}})
    cfg, sec, p = parse(workload([{"name": "a", "steps": 3}], seed=5))
    r = PeftRunner(cfg, sec, p, Reporter(io.StringIO()), str(tmp_path), allocation_id=allocation)
    r.add_task(sec["tasks"][0])
    r.poll_control()
    assert ("j-0123456789ab_g" in r.engine.tasks) == (allocation == "alloc-1")
    assert r.engine.tasks["a"].spec["dataset"]["seed"] == 5
    assert r.engine.tasks["e"].spec["dataset"]["seed"] == 5 + 1 + 1

"""The peft runner: events, adapter-only checkpoints, control file, resume, bad specs."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch

from agent.runtime.model import GPT, GPTConfig
from agent.runtime.peft.engine import merge_adapter
from agent.runtime.peft.workload import PeftRunner, load_adapter, parse, run
from agent.runtime.report import Reporter, parse_line
from tessera.errors import SpecError


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls: intra-op threads only add contention (badly so on a busy machine).
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)

MODEL = {"vocab": 64, "seq_len": 32, "layers": 1, "hidden": 32, "heads": 4}


def workload(tasks, mode="spatial", **kw):
    return {"type": "peft", "model": MODEL, "steps": 4, "batch_size": 3, "learning_rate": 0.01, "seed": 0,
            "peft": {"mode": mode, "chunk_size": 32, "tasks": tasks}, **kw}


def events(buf):
    return [e for e in (parse_line(l) for l in buf.getvalue().splitlines()) if e]


def runner(tmp_path, tasks, mode="spatial", **kw):
    cfg, sec, p = parse(workload(tasks, mode, **kw))
    buf = io.StringIO()
    r = PeftRunner(cfg, sec, p, Reporter(buf), str(tmp_path))
    for t in sec["tasks"]:
        r.add_task(t)
    return r, buf


@pytest.mark.parametrize("mode", ["spatial", "temporal"])
def test_run_reports_tasks_and_writes_adapters(tmp_path, mode):
    buf = io.StringIO()
    spec = {"job_id": "j", "workload": workload([{"name": "a", "steps": 3}, {"name": "b", "rank": 2,
                                                  "target_modules": ["fc"]}], mode, report_every=1),
            "dist": {}, "checkpoint_dir": str(tmp_path), "threads": 1}
    assert run(spec, Reporter(buf)) == 0
    ev = events(buf)
    assert ev[0]["event"] == "start" and ev[-1]["event"] == "done"
    task_ev = [e for e in ev if e["event"] == "task"]
    for name, steps in (("a", 3), ("b", 4)):
        mine = [e for e in task_ev if e["task"] == name]
        assert mine[0]["phase"] == "running" and mine[0]["step"] == 0
        assert mine[-1]["phase"] == "succeeded" and mine[-1]["step"] == steps
        assert all(e["tokens_per_s"] > 0 for e in mine[1:]) and all(e["loss"] > 0 for e in mine[1:])
        ad = load_adapter(os.path.join(tmp_path, "peft", name, "adapter.pt"))
        assert ad["name"] == name and ad["step"] == steps
        assert all(k.startswith("blocks.") for k in ad["weights"])  # adapter only, no backbone
    assert set(load_adapter(os.path.join(tmp_path, "peft", "b", "adapter.pt"))["weights"]) == {"blocks.0.mlp.fc"}
    prog = [e for e in ev if e["event"] == "progress"]
    assert len(prog) == (4 if mode == "spatial" else 7) and prog[-1]["step"] == prog[-1]["total"]
    pk = ev[-1]["pack"]
    assert ev[-1]["tasks"]["a"]["phase"] == "succeeded" and pk["pad_removed"] == pk["pad_longest"] - pk["pad_chunked"]
    assert pk["real_tokens"] == sum(t["tokens"] for t in ev[-1]["tasks"].values())
    assert not [e for e in ev if e["event"] == "error"]


def test_control_file_adds_and_cancels_mid_run(tmp_path):
    r, buf = runner(tmp_path, [{"name": "a", "steps": 6}, {"name": "b", "steps": 6}])
    assert r.step() and r.step()
    with open(r.control_file, "a") as f:
        f.write(json.dumps({"op": "add", "task": {"name": "c", "steps": 2, "rank": 16}}) + "\n")
        f.write(json.dumps({"op": "cancel", "task": "b"}) + "\n")
        f.write(json.dumps({"op": "cancel", "task": "zzz"}) + "\n")
        f.write(json.dumps({"op": "add", "task": {"name": "d", "rank": 0}}) + "\n")
        f.write('{"op": "add", "task": {"name": "e"')  # incomplete line: applied later
    assert r.step()
    e = r.engine.tasks
    assert e["b"].status == "cancelled" and e["b"].step == 2
    assert e["c"].step == 1 and e["a"].step == 3 and "e" not in e and "d" not in e
    errs = [x for x in events(buf) if x["event"] == "error"]
    assert [x["field"] for x in errs] == ["control[2].task", "control[3].task.rank"]
    # Cancelled: its state so far and its outcome, no adapter.pt (that one means "succeeded").
    assert not os.path.exists(os.path.join(tmp_path, "peft", "b", "adapter.pt"))
    assert load_adapter(os.path.join(tmp_path, "peft", "b", "state.pt"))["adapter"]["step"] == 2
    with open(os.path.join(tmp_path, "peft", "b", "outcome.json")) as f:
        assert json.load(f) == {"phase": "cancelled", "step": 2, "steps": 6}
    with open(r.control_file, "a") as f:
        f.write(', "steps": 1}}\n')
    while r.step():
        pass
    assert e["e"].status == "succeeded" and e["c"].status == "succeeded" and e["a"].step == 6
    phases = [(x["task"], x["phase"]) for x in events(buf) if x["event"] == "task" and x["phase"] != "running"]
    assert ("b", "cancelled") in phases and ("c", "succeeded") in phases


def test_adapter_file_loads_back_to_training_outputs(tmp_path):
    r, _ = runner(tmp_path, [{"name": "a", "steps": 10, "target_modules": ["qkv", "proj", "fc", "out"]},
                             {"name": "b", "steps": 10}])
    for _ in range(3):
        r.step()
    x = torch.randint(0, 64, (2, 20))
    during = r.engine.forward_task("a", x)
    r.cancel_task("a")
    ad = load_adapter(os.path.join(tmp_path, "peft", "a", "state.pt"))["adapter"]  # cancelled: the adapter so far
    torch.manual_seed(0)  # workload.seed: the same frozen backbone
    merged = merge_adapter(GPT(GPTConfig(**MODEL)), ad)
    with torch.no_grad():
        torch.testing.assert_close(merged(x), during, rtol=1e-4, atol=1e-5)


def test_resume_from_task_state_continues_the_same_trajectory(tmp_path):
    tasks = [{"name": "a", "steps": 5}, {"name": "b", "steps": 5, "learning_rate": 0.02}]
    ref, _ = runner(tmp_path / "ref", tasks)
    ref_losses = []
    while ref.step():
        ref_losses.append(ref.engine.tasks["a"].loss)
    first, buf = runner(tmp_path / "run", tasks, checkpoint_every=1)
    for _ in range(3):
        first.step()
    first.checkpoint_running()
    again, _ = runner(tmp_path / "run", tasks)
    assert again.engine.tasks["a"].step == 3
    got = []
    while again.step():
        got.append(again.engine.tasks["a"].loss)
    assert got == pytest.approx(ref_losses[3:], rel=1e-4)
    # A task whose adapter exists finished in an earlier run: not restarted.
    third, buf3 = runner(tmp_path / "run", tasks)
    assert third.engine.running() == []
    assert [e["phase"] for e in events(buf3) if e["event"] == "task"] == ["succeeded", "succeeded"]


def test_cancelled_task_stays_cancelled_after_a_relaunch(tmp_path):
    tasks = [{"name": "a", "steps": 6}, {"name": "b", "steps": 6}]
    first, _ = runner(tmp_path, tasks)
    assert first.step() and first.step()
    with open(first.control_file, "a") as f:
        f.write(json.dumps({"op": "cancel", "task": "b"}) + "\n")
    assert first.step()
    assert first.engine.tasks["b"].status == "cancelled" and first.engine.tasks["b"].step == 2
    first.checkpoint_running()  # preempted: SIGTERM
    # The relaunched executor reads the same checkpoint dir and replays the control file.
    again, buf = runner(tmp_path, tasks)
    assert [t.name for t in again.engine.running()] == ["a"] and again.engine.tasks["a"].step == 3
    while again.step():
        pass
    ev = events(buf)
    b = [(e["phase"], e["step"], e["steps"], e.get("resumed")) for e in ev if e["event"] == "task" and e["task"] == "b"]
    assert b == [("cancelled", 2, 6, True)]
    assert not [e for e in ev if e["event"] == "error"]  # the replayed cancel of b is a no-op
    assert again.engine.tasks["a"].status == "succeeded" and again.engine.tasks["a"].step == 6
    assert not os.path.exists(os.path.join(tmp_path, "peft", "b", "adapter.pt"))
    # A third executor: a succeeded, b still cancelled at step 2, nothing retrained.
    third, buf3 = runner(tmp_path, tasks)
    assert third.engine.running() == [] and not third.step()
    assert [(e["task"], e["phase"], e["step"]) for e in events(buf3) if e["event"] == "task"] == [
        ("a", "succeeded", 6), ("b", "cancelled", 2)]
    assert not [e for e in events(buf3) if e["event"] == "error"]


def test_cancel_of_an_ended_task_changes_nothing(tmp_path):
    r, buf = runner(tmp_path, [{"name": "a", "steps": 1}, {"name": "b", "steps": 3}])
    assert r.step()
    assert r.engine.tasks["a"].status == "succeeded"
    r.cancel_task("a")
    r.cancel_task("b")
    r.cancel_task("b")
    ends = [(e["task"], e["phase"]) for e in events(buf) if e["event"] == "task" and e["phase"] != "running"]
    assert ends == [("a", "succeeded"), ("b", "cancelled")]
    assert r.engine.tasks["a"].status == "succeeded"
    assert os.path.exists(os.path.join(tmp_path, "peft", "a", "adapter.pt"))
    assert not os.path.exists(os.path.join(tmp_path, "peft", "a", "outcome.json"))


def test_legacy_adapter_of_a_cancelled_task_is_reported_cancelled(tmp_path):
    # Before outcome.json, a cancel wrote adapter.pt too: its step < steps tells it apart.
    r, _ = runner(tmp_path, [{"name": "a", "steps": 6}])
    r.step()
    ad = r.engine.adapter(r.engine.tasks["a"])
    os.makedirs(tmp_path / "peft" / "a")
    torch.save(ad, os.path.join(tmp_path, "peft", "a", "adapter.pt"))
    again, buf = runner(tmp_path, [{"name": "a", "steps": 6}])
    assert again.engine.running() == []
    assert [(e["phase"], e["step"]) for e in events(buf) if e["event"] == "task"] == [("cancelled", 1)]


def test_reserved_fused_name_only_through_a_fused_add(tmp_path):
    fused = "j-0123456789ab_t0"
    with pytest.raises(SpecError) as ei:
        parse(workload([{"name": "a"}, {"name": fused}]))
    assert ei.value.field == "workload.peft.tasks[1].name" and "reserved" in str(ei.value)
    r, buf = runner(tmp_path, [{"name": "a", "steps": 2}])
    with open(r.control_file, "a") as f:
        f.write(json.dumps({"op": "add", "task": {"name": fused, "steps": 1}}) + "\n")  # no dir: not fused
        f.write(json.dumps({"op": "add", "task": {"name": fused, "steps": 1},
                            "dir": str(tmp_path / "guest" / "peft" / "t0")}) + "\n")
    r.step()
    assert set(r.engine.tasks) == {"a", fused}
    assert [e["field"] for e in events(buf) if e["event"] == "error"] == ["control[0].task.name"]


def test_file_datasets(tmp_path):
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps({"text": "hello world number %d, " % i * (i % 3 + 1)}) for i in range(20)) + "\n")
    tx = tmp_path / "d.txt"
    tx.write_text("\n".join("line %d of some text" % i for i in range(20)) + "\n")
    buf = io.StringIO()
    spec = {"job_id": "j", "workload": workload([
        {"name": "j", "dataset": {"kind": "jsonl", "path": str(jl)}},
        {"name": "t", "dataset": {"kind": "text", "path": str(tx), "min_len": 4}}]),
        "dist": {}, "checkpoint_dir": str(tmp_path / "ck"), "threads": 1}
    assert run(spec, Reporter(buf)) == 0
    assert events(buf)[-1]["tasks"]["j"]["tokens"] > 0


@pytest.mark.parametrize("wl,field", [
    (workload([{"name": "a", "rank": -1}]), "workload.peft.tasks[0].rank"),
    (workload([{"name": "a"}], chunk_size=None) | {"peft": {"chunk_size": 64, "tasks": [{"name": "a"}]}},
     "workload.peft.chunk_size"),
    (workload([{"name": "a", "dataset": {"kind": "text", "path": "/nonexistent/x.txt"}}]),
     "workload.peft.tasks[0].dataset.path"),
])
def test_bad_spec_is_an_error_event(tmp_path, wl, field):
    wl.pop("chunk_size", None)
    buf = io.StringIO()
    rc = run({"job_id": "j", "workload": wl, "dist": {}, "checkpoint_dir": str(tmp_path)}, Reporter(buf))
    err = [e for e in events(buf) if e["event"] == "error"]
    assert len(err) == 1
    assert rc == 2 and err[0]["field"] == field


@pytest.mark.parametrize("mode", ["spatial", "temporal"])
def test_job_progress_continues_across_a_relaunch(tmp_path, mode):
    """The job-level step/total of ``progress`` events comes from the tasks' own counts: a
    relaunched executor (its engine's counter back at 0) continues where the job was."""
    tasks = [{"name": "a", "steps": 6}, {"name": "b", "steps": 3}]
    first, buf = runner(tmp_path, tasks, mode)
    for _ in range(2):
        first.step()
    first.checkpoint_running()
    before = [e for e in events(buf) if e["event"] == "progress"][-1]
    again, buf2 = runner(tmp_path, tasks, mode)
    assert again.engine.steps_done == 0
    again.step()
    after = [e for e in events(buf2) if e["event"] == "progress"][0]
    assert after["total"] == before["total"] == (6 if mode == "spatial" else 9)
    assert after["step"] == before["step"] + 1
    while again.step():
        pass
    last = [e for e in events(buf2) if e["event"] == "progress"][-1]
    assert last["step"] == last["total"]


def test_a_resumed_task_cancelled_before_its_first_step_reports_its_saved_loss(tmp_path):
    """Its latest loss travels in its state: cancelled right after a relaunch (before it
    trains a step there) it reports that loss, not NaN (a flaky live test caught the NaN)."""
    tasks = [{"name": "a", "steps": 50}]
    first, _ = runner(tmp_path, tasks)
    for _ in range(3):
        first.step()
    first.checkpoint_running()
    saved = first.engine.tasks["a"].loss
    again, buf = runner(tmp_path, tasks)
    again.cancel_task("a")
    ended = [e for e in events(buf) if e["event"] == "task" and e["phase"] == "cancelled"]
    assert ended and ended[-1]["step"] == 3 and ended[-1]["loss"] == pytest.approx(saved) and saved == saved

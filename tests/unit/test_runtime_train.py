"""The gpt workload in one process: learning, events, checkpoints, resumption, errors."""

from __future__ import annotations

import io

import pytest

from agent.runtime import checkpoint
from agent.runtime.report import Reporter, parse_line
from agent.runtime.train import EXIT_OK, EXIT_SPEC, parse_spec, run


def spec(steps=10, ckdir=None, **w):
    workload = {
        "type": "gpt",
        "model": {"vocab": 64, "seq_len": 16, "layers": 2, "hidden": 32, "heads": 4},
        "steps": steps,
        "batch_size": 8,
        "learning_rate": 0.01,
        "seed": 0,
        "data": {"kind": "synthetic"},
        "checkpoint_every": 0,
    } | w
    return {"job_id": "j-t", "workload": workload, "checkpoint_dir": ckdir, "threads": 1}


def run_events(s) -> tuple[int, list[dict]]:
    buf = io.StringIO()
    code = run(s, Reporter(stream=buf))
    return code, [e for e in map(parse_line, buf.getvalue().splitlines()) if e]


def losses(events):
    return [e["loss"] for e in events if e["event"] == "progress"]


def test_loss_falls_on_synthetic_data():
    code, ev = run_events(spec(steps=60, learning_rate=0.01))
    assert code == EXIT_OK
    ls = losses(ev)
    assert len(ls) == 60
    # ln(64)=4.16 at init; the chain's floor is ln(4)=1.39. 60 steps get well below 75%.
    assert sum(ls[-5:]) / 5 < 0.75 * ls[0], ls[::10]
    done = ev[-1]
    assert done["event"] == "done" and done["first_loss"] == ls[0] and done["final_loss"] == ls[-1]


def test_event_stream_shape():
    code, ev = run_events(spec(steps=3))
    assert code == 0
    assert [e["event"] for e in ev] == ["start", "progress", "progress", "progress", "done"]
    p = ev[1]
    assert p["step"] == 1 and p["total"] == 3 and p["module"] == "gpt"
    assert set(p["phases"]) == {"forward", "backward", "communication", "optimizer"}
    assert p["tokens_per_s"] > 0 and p["step_time_s"] > 0


def test_step_delay_waits_for_input_with_cores_idle():
    """``step_delay_s``: each step waits that long first (counted in its step time), the
    process's CPU time does not grow with it, and the losses are those of a run without it."""
    import time

    c0, t0 = time.process_time(), time.perf_counter()
    code, ev = run_events(spec(steps=4, step_delay_s=0.2))
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    assert code == 0 and wall >= 0.8
    assert all(e["step_time_s"] >= 0.2 for e in ev if e["event"] == "progress")
    assert cpu < wall - 0.6, (cpu, wall)
    assert losses(ev) == losses(run_events(spec(steps=4))[1])


def test_runs_are_deterministic():
    assert losses(run_events(spec(steps=4))[1]) == losses(run_events(spec(steps=4))[1])


def test_checkpoints_and_exact_resume(tmp_path):
    straight = losses(run_events(spec(steps=8))[1])
    ck = str(tmp_path / "ck")
    code, ev = run_events(spec(steps=4, ckdir=ck, checkpoint_every=2))
    assert code == 0
    assert [e["step"] for e in ev if e["event"] == "checkpoint"] == [2, 4]
    saved = checkpoint.load(ck)
    assert saved["step"] == 4 and saved["plan"]["dp"] == 1
    assert saved["model"]["blocks.1.attn.qkv.weight"].shape == (96, 32)  # full, unsharded
    code, ev2 = run_events(spec(steps=8, ckdir=ck))
    assert code == 0
    assert ev2[0]["event"] == "start" and ev2[0]["step"] == 4 and ev2[0]["resumed"]
    resumed = losses(ev2)
    assert [e["step"] for e in ev2 if e["event"] == "progress"] == [5, 6, 7, 8]
    # Same process, same kernels: resumption is bit-exact.
    assert losses(ev)[:4] + resumed == straight
    assert ev2[-1]["first_loss"] == straight[0]


def test_micro_batches_match_one_batch():
    a = losses(run_events(spec(steps=4))[1])
    b = losses(run_events(spec(steps=4, plan={"micro_batches": 4}))[1])
    assert b == pytest.approx(a, rel=1e-5)


def test_file_data(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text("the quick brown fox jumps over the lazy dog. " * 50)
    s = spec(steps=30, data={"kind": "file", "path": str(p)}, learning_rate=0.01)
    s["workload"]["model"]["vocab"] = 256
    code, ev = run_events(s)
    assert code == 0
    ls = losses(ev)
    assert ls[-1] < 0.8 * ls[0]


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda s: s["workload"].update(steps=0), "workload.steps"),
        (lambda s: s["workload"].update(learning_rate=-1), "workload.learning_rate"),
        (lambda s: s["workload"]["model"].update(heads=5), "workload.model"),
        (lambda s: s["workload"].update(plan={"dp": 2}), "workload.plan"),
        (lambda s: s["workload"].update(batch_size=6, plan={"micro_batches": 4}), "workload.batch_size"),
        (lambda s: s["workload"].update(data={"kind": "http"}), "workload.data.kind"),
        (lambda s: s["workload"].update(pipeline_schedule="zb"), "workload.pipeline_schedule"),
        (lambda s: s["workload"].update(step_delay_s=-1), "workload.step_delay_s"),
    ],
)
def test_invalid_spec_is_exit_2_with_field(mutate, field):
    s = spec()
    mutate(s)
    code, ev = run_events(s)
    assert code == EXIT_SPEC
    assert ev[-1]["event"] == "error" and ev[-1]["field"] == field


def test_resume_refuses_other_model(tmp_path):
    ck = str(tmp_path)
    assert run_events(spec(steps=2, ckdir=ck))[0] == 0
    s = spec(steps=4, ckdir=ck)
    s["workload"]["model"]["hidden"] = 64
    code, ev = run_events(s)
    assert code == EXIT_SPEC and ev[-1]["field"] == "workload.model"


def test_defaults_fill_optional_fields():
    job = parse_spec({"workload": {"type": "gpt"}})
    assert job.steps > 0 and job.plan.world_size == 1 and job.checkpoint_dir is None
    assert job.data == {"kind": "synthetic"}


def test_resume_of_a_finished_job_reports_done_without_training(tmp_path):
    ck = str(tmp_path)
    code, ev = run_events(spec(steps=3, ckdir=ck))
    assert code == 0
    code, again = run_events(spec(steps=3, ckdir=ck))
    assert code == 0
    # Its progress says where it stands (the agent reports it: the controller's status
    # shows the last step even when the run that trained it was already replaced).
    assert [e["event"] for e in again] == ["start", "progress", "done"]
    assert again[1]["step"] == again[1]["total"] == 3 and again[1]["loss"] == ev[-1]["final_loss"]
    assert "step_time_s" not in again[1]
    assert again[-1]["final_loss"] == ev[-1]["final_loss"]


def test_resume_refuses_another_seed(tmp_path):
    """The checkpoint's data position belongs to its seed: resuming it under another seed
    would silently train on another data stream."""
    ck = str(tmp_path)
    assert run_events(spec(steps=2, ckdir=ck))[0] == 0
    code, ev = run_events(spec(steps=4, ckdir=ck, seed=7))
    assert code == EXIT_SPEC and ev[-1]["field"] == "workload.seed" and "seed 0" in ev[-1]["message"]
    assert checkpoint.load(ck)["step"] == 2  # nothing trained, nothing written


def test_non_finite_gradients_fail_before_the_update(tmp_path):
    """A step whose gradients are not finite (the loss itself finite) fails before the
    optimizer step: the weights and the checkpoint written before stay finite."""
    import torch

    from agent.runtime import train as tr

    ck = str(tmp_path)
    assert run_events(spec(steps=2, ckdir=ck))[0] == 0
    real = tr._grads_finite
    calls = []

    def poisoned(params):  # as if backward had produced an inf in one gradient
        params = list(params)
        calls.append(len(params))
        next(p for p in params if p.grad is not None).grad.view(-1)[0] = float("inf")
        return real(params)

    tr._grads_finite = poisoned
    try:
        code, ev = run_events(spec(steps=4, ckdir=ck))
    finally:
        tr._grads_finite = real
    assert code != EXIT_OK and calls and "gradients are not finite at step 3" in ev[-1]["message"]
    saved = checkpoint.load(ck)
    assert saved["step"] == 2
    assert all(torch.isfinite(t).all() for t in saved["model"].values() if isinstance(t, torch.Tensor))


def _rank_agree(rank: int, port: int, steps: list[int], out: str) -> None:
    import json
    import os

    import torch.distributed as dist

    from agent.runtime.parallel import context as pctx
    from agent.runtime.plan import Plan
    from agent.runtime.train import _agree_on_start

    ctx = pctx.init(Plan(dp=2), {"backend": "gloo", "rank": rank, "world_size": 2, "master_addr": "127.0.0.1",
                                 "master_port": port, "timeout_s": 60})
    try:
        _agree_on_start(steps[rank], ctx, "/ck")
        res = "agreed"
    except RuntimeError as e:
        res = str(e)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out, f"r{rank}"), "w") as f:
        json.dump(res, f)


def test_ranks_must_resume_from_the_same_checkpoint_step(tmp_path):
    """Two real gloo ranks at different start steps (a stale view of shared storage) fail
    on EVERY rank with both steps named, instead of hanging later (the same step passes:
    every multi-rank resume test, e.g. tests/integration/test_parallel_reshard.py)."""
    steps, agreed = [4, 6], False
    import json
    import torch.multiprocessing as mp

    from tessera.ports import free_port

    port = free_port()
    mp.start_processes(_rank_agree, args=(port, steps, str(tmp_path)), nprocs=2, start_method="spawn")
    res = [json.loads((tmp_path / f"r{r}").read_text()) for r in range(2)]
    if agreed:
        assert res == ["agreed", "agreed"]
    else:
        assert all("different checkpoints of /ck (steps 4 and 6)" in r for r in res)

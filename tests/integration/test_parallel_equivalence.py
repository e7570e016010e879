"""dp / tp / pp (and products) give the losses of one process, with real processes.

Tolerance: rtol 1e-4 over 5 steps (measured: max relative difference ~6e-8 on CPU/gloo;
the differences come only from summation order in all-reduces and sharded matmuls).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from agent.runtime.parallel.launch import free_port, run_local
from agent.runtime.report import Reporter, parse_line
from agent.runtime.train import run

RTOL = 1e-4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spec(plan: dict, steps: int = 5, schedule: str = "1f1b") -> dict:
    return {
        "job_id": "j-eq",
        "workload": {
            "type": "gpt",
            "model": {"vocab": 64, "seq_len": 16, "layers": 2, "hidden": 32, "heads": 4},
            "steps": steps,
            "batch_size": 8,
            "learning_rate": 0.01,
            "seed": 0,
            "data": {"kind": "synthetic"},
            "plan": plan,
            "checkpoint_every": 0,
            "pipeline_schedule": schedule,
        },
        "threads": 1,
    }


def single_process_losses(steps: int = 5) -> list[float]:
    buf = io.StringIO()
    assert run(spec({}, steps), Reporter(stream=buf)) == 0
    return [e["loss"] for e in map(parse_line, buf.getvalue().splitlines()) if e and e["event"] == "progress"]


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return single_process_losses()


def assert_close(got, ref):
    assert len(got) == len(ref)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert worst <= RTOL, (worst, got, ref)


@pytest.mark.parametrize(
    "plan",
    [
        {"dp": 2},
        {"tp": 2},
        {"pp": 2, "micro_batches": 2},
        {"pp": 2, "micro_batches": 1},
        {"dp": 2, "pp": 2, "micro_batches": 2},
        {"dp": 2, "tp": 2},
        {"tp": 2, "pp": 2, "micro_batches": 4},
        {"dp": 2, "tp": 2, "pp": 2, "micro_batches": 2},
    ],
    ids=lambda p: "x".join(f"{k}{v}" for k, v in p.items()),
)
def test_plan_matches_single_process(plan, reference):
    world = plan.get("dp", 1) * plan.get("tp", 1) * plan.get("pp", 1)
    res = run_local(spec(plan), world)
    assert res.exit_codes == [0] * world, res.events
    assert_close(res.losses(), reference)
    done = res.of("done")[0]
    assert done["final_loss"] == res.losses()[-1]
    # Communication is measured and reported as its own phase.
    assert all(e["phases"]["communication"] > 0 for e in res.of("progress"))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(
    "plan",
    [{"pp": 2, "micro_batches": 4}, {"dp": 2, "pp": 2, "micro_batches": 2}, {"tp": 2, "pp": 2, "micro_batches": 2}],
    ids=lambda p: "x".join(f"{k}{v}" for k, v in p.items()),
)
def test_both_pipeline_schedules_match_single_process(plan, schedule, reference):
    world = plan.get("dp", 1) * plan.get("tp", 1) * plan.get("pp", 1)
    res = run_local(spec(plan, schedule=schedule), world)
    assert res.exit_codes == [0] * world, res.events
    assert_close(res.losses(), reference)


@pytest.mark.slow
def test_dp2_with_real_executor_processes(tmp_path, reference):
    """The agent's way: one ``python -m agent.runtime`` per rank; only rank 0 reports."""
    port = free_port()
    procs = []
    for rank in range(2):
        s = spec({"dp": 2})
        s["dist"] = {"rank": rank, "world_size": 2, "master_addr": "127.0.0.1", "master_port": port, "backend": "gloo"}
        s["checkpoint_dir"] = str(tmp_path / "ck")
        path = tmp_path / f"spec{rank}.json"
        path.write_text(json.dumps(s))
        procs.append(subprocess.Popen([sys.executable, "-m", "agent.runtime", "--spec", str(path)], cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120))
        finally:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    ev0 = [e for e in map(parse_line, outs[0][0].splitlines()) if e]
    ev1 = [e for e in map(parse_line, outs[1][0].splitlines()) if e]
    assert ev1 == []
    assert_close([e["loss"] for e in ev0 if e["event"] == "progress"], reference)
    assert [e["event"] for e in ev0][-2:] == ["checkpoint", "done"]

"""A checkpoint written under plan A resumes under plan B as if uninterrupted.

Test: 10 steps straight in one process vs 5 steps under plan A + 5 under plan B in the
same checkpoint_dir; per-step losses equal within rtol 1e-4.
"""

from __future__ import annotations

import io

import pytest

from agent.runtime import checkpoint
from agent.runtime.parallel.launch import run_local
from agent.runtime.report import Reporter, parse_line
from agent.runtime.train import run

RTOL = 1e-4


def spec(plan: dict, steps: int, ckdir: str | None) -> dict:
    return {
        "job_id": "j-rs",
        "workload": {
            "type": "gpt",
            "model": {"vocab": 64, "seq_len": 16, "layers": 2, "hidden": 32, "heads": 4},
            "steps": steps,
            "batch_size": 8,
            "learning_rate": 0.01,
            "seed": 1,
            "data": {"kind": "synthetic"},
            "plan": plan,
            "checkpoint_every": 0,
        },
        "checkpoint_dir": ckdir,
        "threads": 1,
    }


def world(plan: dict) -> int:
    return plan.get("dp", 1) * plan.get("tp", 1) * plan.get("pp", 1)


def run_plan(plan: dict, steps: int, ckdir: str | None) -> list[dict]:
    if world(plan) == 1:
        buf = io.StringIO()
        assert run(spec(plan, steps, ckdir), Reporter(stream=buf)) == 0
        return [e for e in map(parse_line, buf.getvalue().splitlines()) if e]
    res = run_local(spec(plan, steps, ckdir), world(plan))
    assert res.exit_codes == [0] * world(plan), res.events
    return res.events


def losses(events):
    return [e["loss"] for e in events if e["event"] == "progress"]


@pytest.fixture(scope="module")
def straight() -> list[float]:
    return losses(run_plan({}, 10, None))


@pytest.mark.parametrize(
    "plan_a,plan_b",
    [
        ({"dp": 2}, {}),
        ({"pp": 2, "micro_batches": 2}, {}),
        ({}, {"pp": 2, "micro_batches": 2}),
        ({"tp": 2}, {}),
        ({}, {"tp": 2}),
        ({"tp": 2}, {"dp": 2}),
        ({"dp": 2, "pp": 2, "micro_batches": 2}, {"tp": 2, "pp": 2}),
    ],
    ids=lambda p: "x".join(f"{k}{v}" for k, v in p.items()) or "single",
)
def test_resume_under_another_plan_continues_the_curve(plan_a, plan_b, straight, tmp_path):
    ck = str(tmp_path / "ck")
    first = run_plan(plan_a, 5, ck)
    saved = checkpoint.load(ck)
    assert saved["step"] == 5 and saved["plan"]["dp"] == plan_a.get("dp", 1)
    second = run_plan(plan_b, 10, ck)
    start = second[0]
    assert start["event"] == "start" and start["step"] == 5 and start["resumed"]
    assert [e["step"] for e in second if e["event"] == "progress"] == list(range(6, 11))
    got = losses(first) + losses(second)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, straight))
    assert len(got) == 10 and worst <= RTOL, (worst, got, straight)
    assert second[-1]["first_loss"] == pytest.approx(straight[0], rel=RTOL)

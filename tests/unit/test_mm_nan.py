"""multimodal: a non-finite loss fails the step before its update (as gpt): exit 1, an
``error`` event naming the step, the last checkpoint finite; disaggregated ranks agree."""

from __future__ import annotations

import io
import os

import torch

from agent.runtime.multimodal import workload as wl
from agent.runtime.multimodal.launch import run_ranks
from agent.runtime.report import Reporter, parse_line

MODEL = {"vocab": 64, "seq_len": 48, "layers": 1, "hidden": 32, "heads": 2}


def _workload(mode: str) -> dict:
    # learning_rate 1e30: step 1 is finite, its update blows the weights up, step 2's loss is not.
    mm = {"mode": mode, "image": {"size": 16, "patch": 8, "pool": 2}, "encoder": {"layers": 1, "hidden": 32, "heads": 2},
          "data": {"max_images": 2, "min_text": 4, "max_text": 16}, "micro_batches": 2}
    if mode == "colocated":
        mm["colocated"] = {"pin": False}
    return {"type": "multimodal", "steps": 4, "batch_size": 4, "learning_rate": 1e30, "checkpoint_every": 1,
            "model": MODEL, "multimodal": mm}


def _events(buf: io.StringIO) -> list[dict]:
    return [e for e in map(parse_line, buf.getvalue().splitlines()) if e]


def _finite(path: str) -> bool:
    st = torch.load(path, weights_only=True)
    return all(bool(torch.isfinite(v).all()) for v in st["model"].values() if v.is_floating_point())


def test_colocated_non_finite_loss_fails_before_the_update(tmp_path):
    buf = io.StringIO()
    rc = wl.run({"job_id": "j", "workload": _workload("colocated"), "dist": {}, "checkpoint_dir": str(tmp_path),
                 "threads": 1}, Reporter(buf))
    ev = _events(buf)
    assert rc == 1
    assert ev[-1]["event"] == "error" and "FloatingPointError" in ev[-1]["message"] and "at step" in ev[-1]["message"]
    assert not any(e["event"] == "done" for e in ev)
    losses = [e["loss"] for e in ev if e["event"] == "progress" and e.get("module") == "multimodal"]
    assert all(torch.isfinite(torch.tensor(losses)))  # the failed step reports no progress
    assert _finite(os.path.join(tmp_path, wl.CKPT_NAME))


def _rank(rank: int, world: int, tmp: str) -> tuple[int, list[dict]]:
    buf = io.StringIO()
    spec = {"job_id": "j", "workload": _workload("disaggregated"), "checkpoint_dir": tmp,
            "dist": {"rank": rank, "world_size": world}}  # the group is up (run_ranks)
    return wl.run(spec, Reporter(buf, enabled=(rank == 0))), _events(buf)


def test_disaggregated_ranks_fail_together_at_the_same_step(tmp_path):
    (rc0, ev0), (rc1, _) = run_ranks(2, _rank, str(tmp_path))
    assert (rc0, rc1) == (1, 1)  # both left: no rank waits in a collective
    assert ev0[-1]["event"] == "error" and "at step" in ev0[-1]["message"]
    assert _finite(os.path.join(tmp_path, wl.CKPT_NAME))

"""bench.mm_colocate's two-process colocated plan (encoder | LLM processes, each owning
its module): real gloo ranks on CPU core sets train the same samples to the same losses
as the single-process temporal run of the benchmark."""

from __future__ import annotations

import math
import os

import pytest
import torch

from agent.runtime.model import GPTConfig
from agent.runtime.multimodal.data import SyntheticData
from agent.runtime.multimodal.launch import run_ranks
from bench import mm_colocate as mc
from tessera.spec.multimodal import validate_multimodal

GPT = GPTConfig(vocab=64, seq_len=48, layers=1, hidden=32, heads=2)
MM = validate_multimodal({
    "image": {"size": 16, "patch": 8, "pool": 2},
    "encoder": {"layers": 1, "hidden": 32, "heads": 2},
    "data": {"max_images": 3, "min_text": 4, "max_text": 20},
    "mix": [{"step": 0, "image_prob": 0.7}],
    "micro_batches": 2,
})
BATCH, STEPS = 6, 2


@pytest.mark.timeout(120)
def test_two_process_plan_trains_like_the_temporal_run():
    cpus = sorted(os.sched_getaffinity(0))
    enc, llm = run_ranks(2, mc._proc_rank, MM, GPT, "cpu", BATCH, STEPS, 2, 0.5, 2, cpus)
    data = SyntheticData(MM, GPT.vocab, GPT.seq_len, BATCH, seed=0)
    batches = [[data.sample(i) for i in range(s * BATCH, (s + 1) * BATCH)] for s in range(STEPS + 1)]
    _, ref = mc._run(MM, GPT, torch.device("cpu"), batches, 0.5, False, 2)
    assert len(enc[1]) == len(ref) == STEPS + 1
    for a, b in zip(enc[1], ref):
        assert math.isclose(a, b, rel_tol=1e-4), (enc[1], ref)
    assert enc[1] == llm[1]  # one all-reduced loss per step on both sides
    for side in (enc, llm):  # a mean step time per trial, every one measured
        assert len(side[0]) == 2 and all(t > 0 for t in side[0])


@pytest.mark.timeout(120)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: the CPU run has no two-process plan")
def test_a_failed_two_process_plan_is_recorded_and_the_run_completes(monkeypatch, tmp_path):
    def boom(*a, **kw):
        raise RuntimeError("rank 0 failed:\nsimulated")

    monkeypatch.setattr(mc, "run_ranks", boom)
    out = mc.main(["--steps", "1", "--trials", "1", "--no-soft", "--json", str(tmp_path / "mm.json")])
    assert list(out["errors"]) == [k for k in out["errors"] if k.startswith("colocated 2 procs")]
    assert "simulated" in next(iter(out["errors"].values()))
    assert not any(k.startswith("colocated 2 procs") for k in out["step_s"])
    assert out["speedup_vs_temporal"] > 0

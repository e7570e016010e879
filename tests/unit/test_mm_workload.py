"""The multimodal workload's checkpoint is durable and resumable under another world size;
a single-rank DistEngine leaves unused modules without gradients; failures are reported
once, from any rank."""

from __future__ import annotations

import io
import os
import stat

import pytest
import torch

from agent.runtime.model import GPTConfig
from agent.runtime.multimodal import workload as wl
from agent.runtime.multimodal.data import SyntheticData
from agent.runtime.multimodal.disagg import CostModel, DistEngine, plan_items
from agent.runtime.multimodal.engine import plain_step
from agent.runtime.multimodal.models import MMModel
from agent.runtime.multimodal.reshard import coupled_plan
from agent.runtime.report import Reporter, parse_line
from tessera.spec.multimodal import validate_multimodal

CFG = GPTConfig(vocab=64, seq_len=48, layers=1, hidden=32, heads=2)
# Step 0 is text only (ViT and audio unused), step 1 has images but no audio, step 2 both.
MM_UNUSED = validate_multimodal({
    "image": {"size": 16, "patch": 8, "pool": 2},
    "encoder": {"layers": 1, "hidden": 32, "heads": 2},
    "audio": {"enabled": True, "frames": 8, "frame_dim": 4, "pool": 4, "hidden": 16, "heads": 2},
    "data": {"max_images": 3, "max_audio": 1, "min_text": 4, "max_text": 20},
    "mix": [{"step": 0, "image_prob": 0.0, "audio_prob": 0.0}, {"step": 1, "image_prob": 0.9, "audio_prob": 0.0},
            {"step": 2, "image_prob": 0.5, "audio_prob": 0.9}, {"step": 3, "image_prob": 0.5, "audio_prob": 0.9}],
    "micro_batches": 2,
})
B, STEPS = 6, 3


def _events(text: str) -> list[dict]:
    return [e for e in map(parse_line, text.splitlines()) if e]


def _fresh():
    torch.manual_seed(4)
    m = MMModel(CFG, MM_UNUSED)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def test_dist_engine_single_rank_leaves_unused_modules_alone():
    data = SyntheticData(MM_UNUSED, CFG.vocab, CFG.seq_len, B, seed=2)
    metas = [[data.meta(i) for i in range(s * B, s * B + B)] for s in range(STEPS)]
    assert not any(m.n_images or m.n_audio for m in metas[0]) and not any(m.n_audio for m in metas[1])
    m, o = _fresh()
    for s in range(STEPS):
        plain_step(m, o, [data.sample(i) for i in range(s * B, s * B + B)])
    m2, o2 = _fresh()
    eng = DistEngine(m2, o2, data, 0, 1)
    cost = CostModel.from_flops(m2)
    for s in range(STEPS):
        ids = list(range(s * B, s * B + B))
        eng.step(ids, coupled_plan(plan_items(data, ids, cost), 1, 2), cost)
        if s < 2:  # no audio in the batch: no gradient, hence no weight decay or momentum
            assert all(p.grad is None for n, p in m2.named_parameters() if n.startswith("audio."))
    for (n, p), q in zip(m2.named_parameters(), m.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=5e-4, msg=n)


def test_checkpoint_is_fsynced_file_and_directory(tmp_path, monkeypatch):
    synced: list[bool] = []  # per fsync: was it a directory
    real = os.fsync

    def spy(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    m, o = _fresh()
    path = str(tmp_path / "ck" / wl.CKPT_NAME)
    wl._save(path, m, o, 3, {"ranks": 2, "group_batches": 4})
    assert False in synced and True in synced  # the data, then the directory entry
    assert synced.index(False) < len(synced) - 1 - synced[::-1].index(True)
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["step"] == 3 and state["order"] == {"ranks": 2, "group_batches": 4}
    assert os.listdir(tmp_path / "ck") == [wl.CKPT_NAME]  # no temp file left behind


def _spec(rank: int, world: int, **workload) -> dict:
    return {"job_id": "mm-err", "dist": {"rank": rank, "world_size": world},
            "workload": {"type": "multimodal", "model": CFG.to_dict(), "steps": 2, "batch_size": 4, **workload}}


def test_spec_error_on_a_non_zero_rank_is_reported(capsys):
    buf = io.StringIO()
    code = wl.run(_spec(1, 2, learning_rate=-1.0), Reporter(buf, enabled=False))
    assert code == 2 and buf.getvalue() == ""
    errs = [e for e in _events(capsys.readouterr().out) if e["event"] == "error"]
    assert len(errs) == 1
    assert errs[0]["rank"] == 1 and errs[0]["field"] == "workload.learning_rate"


@pytest.mark.parametrize("rank", [0, 1])
def test_failure_is_reported_once(rank, capsys, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(wl, "MMModel", boom)
    buf = io.StringIO()
    # Returns (no raise), so agent.runtime.__main__ does not report a second error.
    code = wl.run(_spec(rank, 1 if rank == 0 else 2, multimodal={"mode": "disaggregated"}),
                  Reporter(buf, enabled=(rank == 0)))
    assert code == 1
    errs = [e for e in _events(buf.getvalue() + capsys.readouterr().out) if e["event"] == "error"]
    assert len(errs) == 1
    assert errs[0]["rank"] == rank and "RuntimeError: boom" in errs[0]["message"]

"""Colocated (quota'd, pipelined) and temporal steps equal a plain step; data is
deterministic and follows the mix; the loss falls."""

from __future__ import annotations

import io
import math

import pytest
import torch

from agent.runtime.model import GPTConfig
from agent.runtime.multimodal.data import SyntheticData, mix_at
from agent.runtime.multimodal.engine import ColocatedEngine, plain_step, split_cpus, split_micro
from agent.runtime.multimodal.models import MMModel
from agent.runtime.multimodal.workload import run
from agent.runtime.report import Reporter, parse_line
from tessera.errors import SpecError
from tessera.spec.multimodal import validate_multimodal

CFG = GPTConfig(vocab=64, seq_len=48, layers=1, hidden=32, heads=2)
MM = validate_multimodal({
    "image": {"size": 16, "patch": 8, "pool": 2},
    "encoder": {"layers": 1, "hidden": 32, "heads": 2},
    "audio": {"enabled": True, "frames": 8, "frame_dim": 4, "pool": 4, "hidden": 16, "heads": 2},
    "data": {"max_images": 3, "max_audio": 1, "min_text": 4, "max_text": 20},
    "mix": [{"step": 0, "image_prob": 0.5, "audio_prob": 0.3}],
})
B = 6
TOL = 1e-5  # fp32; micro-batching only reorders sums


def _fresh():
    torch.manual_seed(1)
    m = MMModel(CFG, MM)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _batches(n):
    data = SyntheticData(MM, CFG.vocab, CFG.seq_len, B, seed=5)
    return [[data.sample(i) for i in range(s * B, s * B + B)] for s in range(n)]


@pytest.mark.parametrize("concurrent,pin", [(True, True), (True, False), (False, True)],
                         ids=["colocated-hard", "colocated-soft", "temporal"])
def test_colocated_and_temporal_match_plain(concurrent, pin):
    bs = _batches(3)
    m, o = _fresh()
    ref = [plain_step(m, o, b).loss for b in bs]
    ref_params = [p.detach().clone() for p in m.parameters()]
    m2, o2 = _fresh()
    with ColocatedEngine(m2, o2, encoder_quota=0.5, micro_batches=3, concurrent=concurrent, pin=pin) as eng:
        got = [eng.step(b) for b in bs]
    for a, b in zip([g.loss for g in got], ref):
        assert math.isclose(a, b, rel_tol=TOL)
    for p, q in zip(m2.parameters(), ref_params):
        torch.testing.assert_close(p.detach(), q, rtol=1e-4, atol=5e-4)  # Adam's normalised update magnifies rounding on ~0 grads
    # The encoder's gradient really flowed through the projector: its weights moved.
    torch.manual_seed(1)
    init = MMModel(CFG, MM)
    assert not torch.equal(init.vit.embed.weight, m2.vit.embed.weight)
    if concurrent:
        assert {"forward", "backward", "idle"} <= set(got[0].modules["encoder"])
        assert {"forward", "backward", "idle"} <= set(got[0].modules["llm"])


def test_split_helpers():
    assert split_cpus([0, 1, 2, 3], 0.25) == ([0], [1, 2, 3])
    assert split_cpus([0, 1], 0.9) == ([0], [1])
    assert split_cpus([0], 0.5) == ([0], [0])
    b = _batches(1)[0]
    mbs = split_micro(b, 4)
    assert sorted(s.meta.id for mb in mbs for s in mb) == sorted(s.meta.id for s in b)


def test_data_is_deterministic_and_follows_the_mix():
    mm = dict(MM, mix=[{"step": 0, "image_prob": 0.0, "audio_prob": 0.0}, {"step": 10, "image_prob": 1.0, "audio_prob": 0.0}])
    d1 = SyntheticData(mm, 64, 48, 4, seed=2)
    d2 = SyntheticData(mm, 64, 48, 4, seed=2)
    s1, s2 = d1.sample(7), d2.sample(7)
    assert s1.meta == s2.meta and torch.equal(s1.images, s2.images) and torch.equal(s1.text, s2.text)
    assert all(d1.meta(i).n_images == 0 for i in range(4))  # step 0: text only
    assert all(d1.meta(i).n_images > 0 for i in range(40, 48))  # step 10+: all images
    assert mix_at(mm["mix"], 5) == (0.5, 0.0)
    for i in range(100):
        m = d1.meta(i)
        assert m.text_len + m.media_tokens(d1.per_image, d1.per_audio) <= 48


def _events(buf):
    return [e for e in map(parse_line, buf.getvalue().splitlines()) if e]


def test_workload_colocated_loss_falls(tmp_path):
    spec = {
        "job_id": "j1",
        "workload": {"type": "multimodal", "model": CFG.to_dict(), "steps": 25, "batch_size": 8,
                     "learning_rate": 0.01, "seed": 0,
                     "multimodal": {"mode": "colocated", "micro_batches": 2, "image": {"size": 16, "patch": 8, "pool": 2},
                                    "encoder": {"layers": 1, "hidden": 32, "heads": 2},
                                    "data": {"max_images": 3, "min_text": 8, "max_text": 30},
                                    "mix": [{"step": 0, "image_prob": 0.2}, {"step": 20, "image_prob": 0.9}]}},
        "dist": {"rank": 0, "world_size": 1},
        "checkpoint_dir": str(tmp_path / "ckpt"),  # not there yet: the agent hands over a fresh path
    }
    spec["workload"]["checkpoint_every"] = 10
    buf = io.StringIO()
    assert run(spec, Reporter(buf)) == 0
    ev = _events(buf)
    prog = [e for e in ev if e["event"] == "progress" and e["module"] == "multimodal"]
    assert len(prog) == 25
    assert sum(e["loss"] for e in prog[-5:]) < sum(e["loss"] for e in prog[:5])
    assert any(e["event"] == "progress" and e["module"] == "encoder" and "idle" in e["phases"] for e in ev)
    assert ev[-1]["event"] == "done"
    assert [e["step"] for e in ev if e["event"] == "checkpoint"] == [10, 20, 25]
    assert (tmp_path / "ckpt" / "multimodal.pt").exists()
    # Resuming a finished job runs no further step.
    buf2 = io.StringIO()
    assert run(spec, Reporter(buf2)) == 0
    assert not [e for e in _events(buf2) if e["event"] == "progress"]


def test_workload_reports_spec_errors():
    buf = io.StringIO()
    spec = {"job_id": "j", "workload": {"model": CFG.to_dict(), "multimodal": {"mode": "x"}}, "dist": {}}
    assert run(spec, Reporter(buf)) == 2
    assert _events(buf)[-1]["field"] == "workload.multimodal.mode"
    with pytest.raises(SpecError):
        from agent.runtime.multimodal.workload import parse

        parse({"model": {"seq_len": 16}, "multimodal": {}})


def _worker_view(q):
    """(allowed cores, intra-op threads) as seen on the module worker's own thread."""
    import os

    return q.submit(lambda: (sorted(os.sched_getaffinity(0)), torch.get_num_threads())).result()


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs two cores")
def test_colocated_split_follows_a_live_regrant():
    """The agent's UpdateGrant re-pins every thread of the executor (agent.executors.
    pin_process, used here on this very process); at the next step boundary the engine
    gives the encoder and the LLM disjoint cores of the new grant again, and training
    goes on equal to a plain step."""
    import os

    from agent.executors import pin_process

    before = sorted(os.sched_getaffinity(0))
    two = before[:2]
    bs = _batches(3)
    m, o = _fresh()
    ref = [plain_step(m, o, b).loss for b in bs]
    m2, o2 = _fresh()
    try:
        pin_process(os.getpid(), two[:1])  # the grant at launch: one core, both modules share it
        with ColocatedEngine(m2, o2, encoder_quota=0.5, micro_batches=3, pin=True) as eng:
            assert (eng.enc_cpus, eng.llm_cpus) == (two[:1], two[:1])
            losses = [eng.step(bs[0]).loss]
            assert eng.follow_grant() is None  # unchanged grant: nothing to do
            pin_process(os.getpid(), two)  # grow: every thread (the workers too) now on both cores
            assert _worker_view(eng.enc)[0] == two and _worker_view(eng.llm)[0] == two
            assert eng.follow_grant() == ([two[0]], [two[1]])
            assert _worker_view(eng.enc) == ([two[0]], 1) and _worker_view(eng.llm) == ([two[1]], 1)
            losses.append(eng.step(bs[1]).loss)
            pin_process(os.getpid(), two[1:])  # shrink back to one core: shared again
            assert eng.follow_grant() == ([two[1]], [two[1]])
            assert _worker_view(eng.enc) == ([two[1]], 1) and _worker_view(eng.llm) == ([two[1]], 1)
            losses.append(eng.step(bs[2]).loss)
    finally:
        os.sched_setaffinity(0, before)
        pin_process(os.getpid(), before)
    for a, b in zip(losses, ref):
        assert math.isclose(a, b, rel_tol=TOL)

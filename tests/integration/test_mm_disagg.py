"""Disaggregated and coupled multimodal steps over real gloo ranks equal a plain
single-process step (every parameter, unused modules included); resharding ships exactly
the embeddings the plan says; a run stopped mid-group at one world size and resumed at
another trains each sample of the epoch exactly once."""

from __future__ import annotations

import io
import math
import os
import shutil

import pytest
import torch

from agent.runtime.model import GPTConfig
from agent.runtime.multimodal.data import SyntheticData
from agent.runtime.multimodal.disagg import CostModel, DistEngine, plan_items
from agent.runtime.multimodal.engine import plain_step
from agent.runtime.multimodal.launch import run_ranks
from agent.runtime.multimodal.models import MMModel
from agent.runtime.multimodal.reshard import Layout, coupled_plan, decoupled_plan
from agent.runtime.multimodal import workload as wl
from agent.runtime.multimodal.workload import run
from agent.runtime.report import Reporter, parse_line
from tessera.spec.multimodal import validate_multimodal

CFG = GPTConfig(vocab=64, seq_len=48, layers=1, hidden=32, heads=2)
MM = validate_multimodal({
    "image": {"size": 16, "patch": 8, "pool": 2},
    "encoder": {"layers": 1, "hidden": 32, "heads": 2},
    "audio": {"enabled": True, "frames": 8, "frame_dim": 4, "pool": 4, "hidden": 16, "heads": 2},
    "data": {"max_images": 3, "max_audio": 1, "min_text": 4, "max_text": 20},
    "mix": [{"step": 0, "image_prob": 0.3, "audio_prob": 0.3}, {"step": 2, "image_prob": 0.9, "audio_prob": 0.5}],
    "micro_batches": 2,
})
B, STEPS, TOL = 6, 3, 1e-4  # fp32; the all-reduce reorders sums, hence not bit-exact


def _setup():
    data = SyntheticData(MM, CFG.vocab, CFG.seq_len, B, seed=3)
    torch.manual_seed(3)
    model = MMModel(CFG, MM)
    return data, model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _layouts(world):
    # (name, layout or None for coupled) per step: the split changes between steps.
    return [Layout((0,), (1,)), Layout((0, 1), (0, 1)), None][:STEPS]


WORKLOAD_STEPS = 20


def _workload_spec(tmp: str, rank: int, world: int) -> dict:
    return {
        "job_id": "mm-dis", "checkpoint_dir": tmp,
        "workload": {"type": "multimodal", "model": CFG.to_dict(), "steps": WORKLOAD_STEPS, "batch_size": 8,
                     "learning_rate": 0.01, "seed": 0,
                     "multimodal": {"mode": "disaggregated", "micro_batches": 2,
                                    "image": {"size": 16, "patch": 8, "pool": 2},
                                    "encoder": {"layers": 1, "hidden": 32, "heads": 2},
                                    "data": {"max_images": 3, "min_text": 8, "max_text": 30},
                                    "mix": [{"step": 0, "image_prob": 0.2}, {"step": 15, "image_prob": 0.9}]}},
        # The process group is already up (run_ranks); init_from_spec leaves it alone.
        "dist": {"rank": rank, "world_size": world},
    }


# Step 0 is text only (ViT and audio unused), step 1 has images and no audio.
MM_UNUSED = validate_multimodal({**{k: MM[k] for k in ("image", "encoder", "audio", "data", "micro_batches")},
                                 "mix": [{"step": 0, "image_prob": 0.0, "audio_prob": 0.0},
                                         {"step": 1, "image_prob": 0.9, "audio_prob": 0.0},
                                         {"step": 2, "image_prob": 0.5, "audio_prob": 0.9},
                                         {"step": 3, "image_prob": 0.5, "audio_prob": 0.9}]})


def _setup_unused():
    data = SyntheticData(MM_UNUSED, CFG.vocab, CFG.seq_len, B, seed=2)
    torch.manual_seed(4)
    model = MMModel(CFG, MM_UNUSED)
    return data, model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _unused_main(rank, world):
    data, model, opt = _setup_unused()
    eng = DistEngine(model, opt, data, rank, world)
    cost = CostModel.from_flops(model)
    audio_grads = []
    for step, layout in enumerate([Layout((0,), (1,)), None, Layout((0, 1), (0, 1))]):
        ids = list(range(step * B, step * B + B))
        items = plan_items(data, ids, cost)
        eng.step(ids, coupled_plan(items, world, 2) if layout is None else decoupled_plan(items, layout, 2), cost)
        audio_grads.append([p.grad is None for n, p in model.named_parameters() if n.startswith("audio.")])
    return [p.detach().clone() for p in model.parameters()], audio_grads


RESUME = {"steps": 8, "batch_size": 8, "group_batches": 4}


def _resume_spec(tmp: str, rank: int, world: int) -> dict:
    spec = _workload_spec(tmp, rank, world)
    w = spec["workload"]
    w.update(steps=RESUME["steps"], batch_size=RESUME["batch_size"])
    w["multimodal"]["reorder"] = {"group_batches": RESUME["group_batches"]}
    w["multimodal"]["mix"] = [{"step": 0, "image_prob": 0.6}]
    return spec


def _recording_run(spec: dict, reporter) -> tuple[int, list[list[int]]]:
    """Run the workload, returning the sample ids of every step it trained."""
    trained: list[list[int]] = []
    real = wl.plan_items

    def spy(data, ids, cost):
        trained.append(list(ids))
        return real(data, ids, cost)

    wl.plan_items = spy
    try:
        return run(spec, reporter), trained
    finally:
        wl.plan_items = real


def _stopped_main(rank, world, tmp):
    """A disaggregated run over ``world`` ranks stopped (as by SIGTERM) after its first step."""
    from agent.runtime.train import STOP
    STOP.set()
    try:
        return (*_recording_run(_resume_spec(tmp, rank, world), Reporter(io.StringIO(), enabled=(rank == 0))), tmp)
    finally:
        STOP.clear()


def _rank_main(rank, world, tmp):
    data, model, opt = _setup()
    eng = DistEngine(model, opt, data, rank, world)
    cost = CostModel.from_flops(model)
    losses, sent, moved, phases = [], [], [], []
    for step, layout in enumerate(_layouts(world)):
        ids = list(range(step * B, step * B + B))
        items = plan_items(data, ids, cost)
        plan = coupled_plan(items, world, 2) if layout is None else decoupled_plan(items, layout, 2)
        st = eng.step(ids, plan, cost)
        losses.append(st.loss)
        phases.append((st.modules, st.world))
        sent.append(sorted((j, dst, tuple(i)) for j, dst, i in eng.sent))
        expect = []
        for j, mp in enumerate(plan.micro):
            for (src, dst), i in mp.transfers().items():
                if src == rank and dst != rank:
                    expect.append((j, dst, tuple(i)))
        moved.append(sorted(expect))
    # Then the executor entry point itself, disaggregated over the same two ranks.
    buf = io.StringIO()
    code = run(_workload_spec(tmp, rank, world), Reporter(buf, enabled=(rank == 0)))
    events = [e for e in map(parse_line, buf.getvalue().splitlines()) if e]
    unused = _unused_main(rank, world)
    stopped = _stopped_main(rank, world, os.path.join(tmp, "resume"))
    return (losses, sent, moved, [p.detach().clone() for p in model.parameters()], phases, (code, events),
            unused, stopped, _owned_main(rank, world))


def _owned_main(rank, world):
    """The colocated two-process form: encoder on rank 0, LLM on rank 1, each updating
    only the modules it owns (no gradient all-reduce). Its losses, its owned parameters,
    and the refusal of a layout change."""
    data, model, opt = _setup()
    eng = DistEngine(model, opt, data, rank, world, owned=True)
    cost = CostModel.from_flops(model)
    layout = Layout((0,), (1,))
    losses = []
    for step in range(STEPS):
        ids = list(range(step * B, step * B + B))
        losses.append(eng.step(ids, decoupled_plan(plan_items(data, ids, cost), layout, 2), cost).loss)
    owned = model.gpt if rank == 1 else model.vit
    try:  # checked before any collective: both ranks raise, nothing hangs
        eng.step(list(range(B)), coupled_plan(plan_items(data, list(range(B)), cost), world, 2), cost)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return losses, {n: p.detach().clone() for n, p in owned.named_parameters()}, refused


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results; one spawn serves every test here (spawning costs seconds)."""
    return run_ranks(2, _rank_main, str(tmp_path_factory.mktemp("mm-dis")))


@pytest.mark.timeout(120)
def test_disaggregated_matches_plain_step(ranks):
    data, model, opt = _setup()
    ref = []
    for step in range(STEPS):
        ref.append(plain_step(model, opt, [data.sample(i) for i in range(step * B, step * B + B)]).loss)
    ref_params = [p.detach().clone() for p in model.parameters()]

    results = ranks
    for losses, sent, moved, params, *_ in results:
        for a, b in zip(losses, ref):
            assert math.isclose(a, b, rel_tol=TOL), (losses, ref)
        assert sent == moved  # shipped exactly the planned cross-rank embeddings
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=5e-4)  # Adam's normalised update magnifies rounding on ~0 grads
    # The disjoint 1:1 step must have resharded something (media samples exist).
    assert any(results[0][1][0])


@pytest.mark.timeout(120)
def test_colocated_owned_modules_match_plain_step(ranks):
    """owned=True: no gradient all-reduce, each rank updates its own module; the losses
    and each owner's module equal a plain single-process step's."""
    data, model, opt = _setup()
    ref = [plain_step(model, opt, [data.sample(i) for i in range(step * B, step * B + B)]).loss
           for step in range(STEPS)]
    for rank, r in enumerate(ranks):
        losses, owned, refused = r[8]
        for a, b in zip(losses, ref):
            assert math.isclose(a, b, rel_tol=TOL), (losses, ref)
        mine = model.gpt if rank == 1 else model.vit
        for n, q in mine.named_parameters():
            torch.testing.assert_close(owned[n], q.detach(), rtol=1e-4, atol=5e-4, msg=n)
        assert "disjoint layout" in refused


@pytest.mark.timeout(120)
def test_unused_modules_get_no_gradient_and_match_plain_step(ranks):
    # A module nothing in the batch used (audio without audio samples, the ViT in a
    # text-only batch) keeps grad None on every rank: AdamW neither decays nor moves it.
    data, model, opt = _setup_unused()
    for step in range(3):
        plain_step(model, opt, [data.sample(i) for i in range(step * B, step * B + B)])
    for params, audio_grads in (r[6] for r in ranks):
        assert all(audio_grads[0]) and all(audio_grads[1]) and not any(audio_grads[2])
        for (n, q), p in zip(model.named_parameters(), params):
            torch.testing.assert_close(p, q.detach(), rtol=1e-4, atol=5e-4, msg=n)


@pytest.mark.timeout(120)
def test_resume_under_another_world_size_sees_each_sample_once(ranks, tmp_path):
    # Stopped after step 1 (mid-group) at world 2; relaunched on one rank from its checkpoint.
    (code0, first0, saved_dir), (code1, first1, _) = ranks[0][7], ranks[1][7]
    assert code0 == code1 == wl.EXIT_TERM and first0 == first1 and len(first0) == 1
    ckpt_dir = str(tmp_path)
    shutil.copy(os.path.join(saved_dir, wl.CKPT_NAME), ckpt_dir)
    state = torch.load(os.path.join(ckpt_dir, wl.CKPT_NAME), map_location="cpu", weights_only=True)
    assert state["step"] == 1 and state["order"] == {"ranks": 2, "group_batches": RESUME["group_batches"]}
    code, rest = _recording_run(_resume_spec(ckpt_dir, 0, 1), Reporter(io.StringIO()))
    assert code == 0 and len(rest) == RESUME["steps"] - 1
    seen = sorted(i for b in first0 + rest for i in b)
    assert seen == list(range(RESUME["steps"] * RESUME["batch_size"]))  # none twice, none skipped


def test_world_phases_sum_every_rank(ranks):
    # Rank 0 alone reports, so what it reports per module must be the sum over ranks.
    for step in range(STEPS):
        per_rank = [r[4][step][0] for r in ranks]
        for r in ranks:
            world = r[4][step][1]
            for mod in ("encoder", "llm"):
                for ph in ("forward", "backward", "idle"):
                    want = sum(m.get(mod, {}).get(ph, 0.0) for m in per_rank)
                    assert math.isclose(world[mod][ph], want, rel_tol=1e-5, abs_tol=1e-6)
    # A disjoint 1:1 step: rank 0 only encodes, rank 1 only trains the LLM; both show up.
    world0 = ranks[0][4][0][1]
    assert world0["encoder"]["forward"] > 0 and world0["llm"]["forward"] > 0
    assert "llm" not in ranks[0][4][0][0] or ranks[0][4][0][0]["llm"].get("forward", 0.0) == 0.0


def test_workload_disaggregated_trains_and_reports_modules(ranks):
    (code0, ev0), (code1, ev1) = ranks[0][5], ranks[1][5]
    assert code0 == 0 and code1 == 0
    assert not ev1  # only rank 0 reports
    prog = [e for e in ev0 if e["event"] == "progress" and e["module"] == "multimodal"]
    assert [e["step"] for e in prog] == list(range(1, WORKLOAD_STEPS + 1))
    assert sum(e["loss"] for e in prog[-4:]) < sum(e["loss"] for e in prog[:4])
    assert all(e["layout"] in ("1:1", "2:2") for e in prog)
    mods = [e for e in ev0 if e["event"] == "progress" and e["module"] in ("encoder", "llm")]
    assert {e["module"] for e in mods} == {"encoder", "llm"}
    assert len(mods) == 2 * WORKLOAD_STEPS
    for e in mods:
        assert e["ranks"] == 2 and "idle" in e["phases"] and e["phases"]["forward"] >= 0
    assert sum(e["phases"]["forward"] for e in mods if e["module"] == "encoder") > 0
    assert ev0[-1]["event"] == "done"

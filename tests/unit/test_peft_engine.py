"""MuxEngine: fused = alone = naive reference; tasks join, finish and leave mid-run.

Tolerance: float32 throughout; losses and LoRA gradients agree to rtol 1e-4 / atol 1e-6
(differences come only from summation order in differently shaped matmuls).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from agent.runtime.model import GPT, GPTConfig, lm_loss
from agent.runtime.peft import lora
from agent.runtime.peft.data import SyntheticTask
from agent.runtime.peft.engine import MuxEngine, apply_adapter_to_slot, merge_adapter
from agent.runtime.peft.packing import pack
from tessera.spec.peft import validate_task


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls: intra-op threads only add contention (badly so on a busy machine).
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)

CFG = GPTConfig(vocab=64, seq_len=32, layers=2, hidden=32, heads=4)
RTOL, ATOL = 1e-4, 1e-6


def task(name, i, **kw):
    spec = {"name": name, "rank": kw.pop("rank", 4), "target_modules": kw.pop("targets", ["qkv", "proj", "fc", "out"]),
            "learning_rate": kw.pop("lr", 1e-2), "batch_size": kw.pop("bs", 4), "steps": kw.pop("steps", 5),
            "dataset": {"seed": 10 + i, "min_len": 3, "max_len": kw.pop("max_len", 20), "distribution": "longtail"}}
    return validate_task(spec, f"tasks[{i}]", i)


def dataset(t):
    d = t["dataset"]
    return SyntheticTask(d["seed"], CFG.vocab, d["min_len"], d["max_len"], d["distribution"])


def backbone():
    torch.manual_seed(0)
    return GPT(CFG)


def engine(tasks, mode="spatial", slots=4, chunk=32):
    e = MuxEngine(backbone(), chunk, mode, slots=slots)
    for t in tasks:
        e.add_task(t, dataset(t))
    return e


def randomize_b(e):
    # B starts at zero (LoRA init), which would make every A gradient trivially zero.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for bank in e.banks.values():
            for s in range(bank.slots):
                if bank.host_scale[s]:
                    r = e.tasks[[n for n, t in e.tasks.items() if t.slot == s][0]].spec["rank"]
                    bank.B[s, :r] = torch.randn(r, bank.out_features, generator=g) * 0.1


THREE = [task("a", 0, rank=2, targets=["qkv", "out"]), task("b", 1, rank=8, targets=["proj", "fc"], max_len=32),
         task("c", 2, rank=4, bs=3)]


def fused_grads(e, names):
    ts = [e.tasks[n] for n in names]
    p = pack([(t.slot, t.dataset.batch(0, t.spec["batch_size"])) for t in ts], e.chunk_size)
    e.opt.zero_grad()
    losses, counts = e.task_losses(p.tokens, p.targets, p.positions, p.mask, p.chunk_slot,
                                   single=ts[0].slot if len(ts) == 1 else None)
    losses[[t.slot for t in ts]].sum().backward()
    # A module no stepping task targets gets no gradient at all (None): that is zero.
    grad = lambda t: (t.grad if t.grad is not None else torch.zeros_like(t))  # noqa: E731
    grads = {n: {k: (grad(b.A)[e.tasks[n].slot].clone(), grad(b.B)[e.tasks[n].slot].clone())
                 for k, b in e.banks.items()} for n in names}
    return {n: losses[e.tasks[n].slot].item() for n in names}, grads, p


def test_fused_forward_backward_equals_each_task_alone():
    e = engine(THREE)
    randomize_b(e)
    fl, fg, p = fused_grads(e, ["a", "b", "c"])
    assert len(set(p.chunk_slot.tolist())) == 3  # really fused: every task in one forward
    for n in ["a", "b", "c"]:
        al, ag, _ = fused_grads(e, [n])
        assert fl[n] == pytest.approx(al[n], rel=RTOL)
        for k in e.banks:
            for x, y in zip(fg[n][k], ag[n][k]):
                torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL)
    # Non-targeted modules get exactly zero gradient; targeted ones do not.
    assert fg["a"]["blocks.0.mlp.fc"][0].abs().max() == 0
    assert fg["a"]["blocks.0.attn.qkv"][0].abs().max() > 0
    assert fg["b"]["blocks.1.mlp.fc"][1].abs().max() > 0
    # Rank padding stays zero: task a (rank 2) in banks of rank 8.
    assert fg["a"]["blocks.0.attn.qkv"][0][:, 2:].abs().max() == 0


def test_fused_matches_naive_per_sequence_reference():
    """An independent reference: plain GPT, one sequence at a time (no packing, no mask),
    each task's LoRA added by forward hooks on its own leaf tensors."""
    ref_model = backbone()
    e = engine(THREE)
    randomize_b(e)
    fl, fg, _ = fused_grads(e, ["a", "b", "c"])
    for n in ["a", "b", "c"]:
        t = e.tasks[n]
        leaves, hooks = {}, []
        for full, bank in e.banks.items():
            if lora.short_name(full) not in t.spec["target_modules"]:
                continue
            a, b = bank.get_slot(t.slot, t.spec["rank"])
            a.requires_grad_(True)
            b.requires_grad_(True)
            leaves[full] = (a, b)
            s = t.spec["alpha"] / t.spec["rank"]
            hooks.append(ref_model.get_submodule(full).register_forward_hook(
                lambda mod, inp, out, a=a, b=b, s=s: out + (inp[0] @ a) @ b * s))
        seqs = t.dataset.batch(0, t.spec["batch_size"])
        total = sum(s.numel() - 1 for s in seqs)
        loss = sum(lm_loss(ref_model(s[None, :-1]), s[None, 1:]) * (s.numel() - 1) for s in seqs) / total
        loss.backward()
        for h in hooks:
            h.remove()
        assert fl[n] == pytest.approx(loss.item(), rel=RTOL)
        for full, (a, b) in leaves.items():
            r = t.spec["rank"]
            torch.testing.assert_close(fg[n][full][0][:, :r], a.grad, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(fg[n][full][1][:r], b.grad, rtol=RTOL, atol=ATOL)


def test_bank_adam_matches_torch_adam_per_task():
    e = engine(THREE[:2])
    randomize_b(e)
    t = e.tasks["a"]
    full = "blocks.0.attn.qkv"
    a0, b0 = (x.clone().requires_grad_(True) for x in e.banks[full].get_slot(t.slot, 2))
    ref = torch.optim.Adam([a0, b0], lr=t.spec["learning_rate"])
    for _ in range(3):
        _, g, _ = fused_grads(e, ["a", "b"])
        a0.grad, b0.grad = g["a"][full][0][:, :2].clone(), g["a"][full][1][:2].clone()
        ref.step()
        before_b = e.banks[full].A[e.tasks["b"].slot].clone()
        active = torch.zeros(e.banks[full].slots, dtype=torch.bool)
        active[t.slot] = True  # only a steps: b must not move
        e.opt.step(active)
        assert torch.equal(e.banks[full].A[e.tasks["b"].slot], before_b)
    a1, b1 = e.banks[full].get_slot(t.slot, 2)
    torch.testing.assert_close(a1, a0.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(b1, b0.detach(), rtol=1e-5, atol=1e-7)


def losses_of(e, name, steps):
    out = []
    for _ in range(steps):
        rep = e.step()
        out.append(rep.losses.get(name))
    return out


@pytest.mark.parametrize("mode", ["spatial", "temporal"])
def test_add_and_cancel_mid_run_do_not_disturb_others(mode):
    base = engine([task("a", 0, steps=6)], mode)
    ref = [base.step().losses["a"] for _ in range(6)]

    e = engine([task("a", 0, steps=6)], mode, slots=1)
    got = [e.step().losses["a"] for _ in range(2)]
    e.add_task(task("b", 1, rank=8, steps=12), dataset(task("b", 1)))  # grows banks: slots and rank
    e.add_task(task("c", 2, steps=12), dataset(task("c", 2)))
    assert e.banks["blocks.0.attn.qkv"].slots >= 3 and e.banks["blocks.0.attn.qkv"].rank == 8
    seen_b = 0
    while e.tasks["a"].status == "running":
        rep = e.step()
        if "a" in rep.losses:
            got.append(rep.losses["a"])
        if "b" in rep.losses:
            seen_b += 1
        if e.tasks["a"].step == 4 and e.tasks["c"].status == "running":
            c = e.cancel("c")
            assert c.status == "cancelled" and c.final_adapter is not None
    assert seen_b > 0
    assert got == pytest.approx(ref, rel=1e-4)
    a = e.tasks["a"]
    assert a.status == "succeeded" and a.step == 6 and a.final_adapter["step"] == 6
    assert e.tasks["c"].step < 12 and e.tasks["b"].status == "running"
    # The freed slots are reused, and the survivor keeps going to completion.
    d = e.add_task(task("d", 3, steps=2), dataset(task("d", 3)))
    assert d.slot in (a.slot, e.tasks["c"].slot)
    while e.step() is not None:
        pass
    assert e.tasks["b"].status == "succeeded" and e.tasks["b"].step == 12 and e.tasks["d"].step == 2
    assert e.tasks["b"].loss < e.tasks["b"].first_loss


def test_temporal_round_robin_interleaves():
    e = engine(THREE, "temporal")
    order = [e.step().tasks[0] for _ in range(6)]
    assert order == ["a", "b", "c", "a", "b", "c"]


def test_adapter_merged_into_backbone_reproduces_training_outputs():
    e = engine(THREE)
    for _ in range(3):
        e.step()
    x = torch.randint(0, CFG.vocab, (2, 16))
    for n in ["a", "b"]:
        during = e.forward_task(n, x)
        ad = e.adapter(e.tasks[n])
        assert set(ad["weights"]) == {k for k in e.banks if lora.short_name(k) in e.tasks[n].spec["target_modules"]}
        merged = merge_adapter(backbone(), ad)
        torch.testing.assert_close(merged(x), during, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(backbone()(x), during, atol=1e-4)  # the adapter matters
        # And loaded into a slot of a fresh engine.
        f = MuxEngine(backbone(), 32, slots=1)
        apply_adapter_to_slot(f, 0, ad)
        torch.testing.assert_close(f.forward_task(0, x), during, rtol=1e-5, atol=1e-6)


def test_micro_batches_group_chunks_by_fill_and_cut_pad_columns():
    from agent.runtime.peft.engine import micro_batches

    fills = [10, 32, 7, 30, 12, 31]
    mbs = micro_batches(fills, 2, max_pad_fraction=1.0)  # by count alone
    assert sorted(i for idx, _ in mbs for i in idx) == list(range(6))
    assert mbs == [([1, 5], 32), ([3, 4], 30), ([0, 2], 10)]
    # Default: a chunk joins only while the pad columns stay <= 5 % of the micro-batch:
    # 32+31 pad 1 of 64; 30+12 would pad 18 of 60, 12+10 2 of 24, 10+7 3 of 20.
    mbs = micro_batches(fills, 2)
    assert mbs == [([1, 5], 32), ([3], 30), ([4], 12), ([0], 10), ([2], 7)]
    assert sum(len(idx) * w for idx, w in mbs) == sum(fills) + 1
    assert micro_batches([32, 32, 32, 31, 32], 4) == [([0, 1, 2, 4], 32), ([3], 31)]  # full chunks still fuse
    assert micro_batches([], 4) == []
    with pytest.raises(ValueError, match="max_pad_fraction"):
        micro_batches(fills, 2, max_pad_fraction=1.5)


@pytest.mark.parametrize("mode", ["spatial", "temporal"])
def test_micro_batched_step_equals_one_pass_step(mode):
    """Gradient accumulation over micro-batches (one chunk each) gives the same losses and
    the same updated adapters as one forward/backward over the whole step."""
    def run(micro):
        torch.manual_seed(0)
        e = MuxEngine(GPT(CFG), 32, mode, slots=4, micro_batch_tokens=micro)
        for t in THREE:
            e.add_task(t, dataset(t))
        randomize_b(e)
        reps = [e.step() for _ in range(3)]
        return e, reps

    one, r1 = run(10_000)
    many, r2 = run(32)
    assert many.micro_chunks == 1 and one.micro_chunks > 10
    assert max(r.pack.chunks for r in r2) > 1  # really split into several micro-batches
    assert many.processed_tokens <= one.processed_tokens <= sum(r.pack.chunks for r in r1) * 32  # pads cut
    for a, b in zip(r1, r2):
        assert a.tasks == b.tasks
        for n in a.losses:
            assert b.losses[n] == pytest.approx(a.losses[n], rel=RTOL)
    for k in one.banks:
        torch.testing.assert_close(many.banks[k].A, one.banks[k].A, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(many.banks[k].B, one.banks[k].B, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["spatial", "temporal"])
def test_threaded_micro_batches_equal_serial_step(mode):
    """Micro-batches run concurrently on worker threads (forward + backward each, gradients
    accumulated into the shared banks by autograd) give the serial step's losses and updated
    adapters up to float summation order, and leave the intra-op thread count as it was."""
    def run(workers):
        torch.manual_seed(0)
        e = MuxEngine(GPT(CFG), 32, mode, slots=4, micro_batch_tokens=32, workers=workers)
        for t in THREE:
            e.add_task(t, dataset(t))
        randomize_b(e)
        reps = [e.step() for _ in range(4)]
        e.close()
        return e, reps

    before = torch.get_num_threads()
    serial, r1 = run(1)
    threaded, r2 = run(3)
    assert torch.get_num_threads() == before
    assert threaded._pool is None and max(r.pack.chunks for r in r2) > 1  # several micro-batches per step
    assert threaded.processed_tokens == serial.processed_tokens
    for a, b in zip(r1, r2):
        assert a.tasks == b.tasks
        for n in a.losses:
            assert b.losses[n] == pytest.approx(a.losses[n], rel=RTOL)
    for k in serial.banks:
        torch.testing.assert_close(threaded.banks[k].A, serial.banks[k].A, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(threaded.banks[k].B, serial.banks[k].B, rtol=RTOL, atol=ATOL)


def test_threaded_step_gradients_equal_serial_gradients():
    """The summed bank gradients the optimizer sees are the serial ones (checked before the
    update: a step with learning rate 0 leaves the adapters and keeps the gradients)."""
    def grads(workers):
        torch.manual_seed(0)
        e = MuxEngine(GPT(CFG), 32, "spatial", slots=4, micro_batch_tokens=32, workers=workers)
        for t in THREE:
            e.add_task(t, dataset(t))
        randomize_b(e)
        e.opt.lr.zero_()
        e.step()
        e.close()
        return {k: (b.A.grad.clone(), b.B.grad.clone()) for k, b in e.banks.items() if b.A.grad is not None}

    g1, g2 = grads(1), grads(2)
    assert g1.keys() == g2.keys() and g1
    for k in g1:
        torch.testing.assert_close(g2[k][0], g1[k][0], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(g2[k][1], g1[k][1], rtol=RTOL, atol=ATOL)


def test_bank_adam_touches_only_targeted_modules_of_active_slots():
    """A module a task does not target keeps its slot (zero factors, zero moments) through
    steps, even when handed a non-zero gradient there; a targeted one moves."""
    e = engine(THREE[:1])  # task a targets qkv and out only
    s = e.tasks["a"].slot
    for b in e.banks.values():
        b.A.grad, b.B.grad = torch.ones_like(b.A), torch.ones_like(b.B)
    active = torch.zeros(e._slots(), dtype=torch.bool)
    active[s] = True
    e.opt.step(active)
    proj, qkv = "blocks.0.attn.proj", "blocks.0.attn.qkv"
    assert not e.banks[proj].A[s].any() and not e.opt.state[proj]["Am"][s].any()
    assert e.opt.state[qkv]["Am"][s].any() and e.opt.state[qkv]["Bv"][s].any()
    assert not e.opt.state[qkv]["Am"][s + 1].any()  # inactive slot untouched


def test_set_workers_between_steps_keeps_the_serial_result():
    """The worker count can change between steps (the runtime follows a live change of the
    executor's cores): the pool is rebuilt for the new count and the run still equals the
    serial one; a count below one is refused and changes nothing."""
    def run(counts):
        torch.manual_seed(0)
        e = MuxEngine(GPT(CFG), 32, "spatial", slots=4, micro_batch_tokens=32, workers=counts[0])
        for t in THREE:
            e.add_task(t, dataset(t))
        randomize_b(e)
        reps = []
        for n in counts:
            e.set_workers(n)
            assert e.workers == n
            reps.append(e.step())
            assert (e._pool is not None) == (n > 1)
        e.close()
        return e, reps

    serial, r1 = run([1, 1, 1, 1])
    varied, r2 = run([2, 3, 1, 2])
    for a, b in zip(r1, r2):
        for n in a.losses:
            assert b.losses[n] == pytest.approx(a.losses[n], rel=RTOL)
    for k in serial.banks:
        torch.testing.assert_close(varied.banks[k].A, serial.banks[k].A, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="workers"):
        varied.set_workers(0)
    assert varied.workers == 2


def test_forward_task_refuses_a_task_that_is_not_running():
    # An ended task's slot may already be another task's: forwarding through it would
    # silently use that task's adapter.
    a = task("a", 0, steps=2)
    e = engine([], slots=1)
    e.add_task(a, dataset(a))
    while e.step():
        pass
    b = task("b", 1, steps=5)
    e.add_task(b, dataset(b))
    assert e.tasks["a"].slot == e.tasks["b"].slot
    x = torch.randint(0, CFG.vocab, (1, 10))
    with pytest.raises(ValueError, match="'a' is not running.*succeeded.*merge_adapter"):
        e.forward_task("a", x)
    with pytest.raises(KeyError):
        e.forward_task("zzz", x)
    assert e.forward_task("b", x).shape == (1, 10, CFG.vocab)


def test_threaded_workers_run_no_op_on_a_leaf():
    """No op a worker thread runs takes a trainable leaf (a bank's A or B) as input: the
    workers read the step's non-leaf aliases (lora.step_aliases), made on the stepping
    thread. An op on a leaf from two threads at once can deadlock in PyTorch (the leaf's
    autograd mutex against the GIL). The aliases are gone after the step, and the
    gradients reach the parameters as without threads."""
    from torch.overrides import TorchFunctionMode

    leaves = set()
    on_leaf: list[str] = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            flat = list(args) + list(kwargs.values())
            # (attribute reads such as ``A.shape`` arrive as ``__get__``: not ops)
            if getattr(func, "__name__", "") != "__get__" and any(
                    isinstance(a, torch.Tensor) and id(a) in leaves for a in flat):
                on_leaf.append(str(func))
            return func(*args, **kwargs)

    def run(workers: int):
        torch.manual_seed(0)
        e = MuxEngine(GPT(CFG), 32, "spatial", slots=4, micro_batch_tokens=32, workers=workers)
        for t in THREE:
            e.add_task(t, dataset(t))
        leaves.clear()
        leaves.update(id(p) for b in e.banks.values() for p in (b.A, b.B))
        threads = set()
        orig = e.slot_loss_sums

        def spy(*a, **kw):
            threads.add(threading.get_ident())
            with Watch():
                return orig(*a, **kw)

        e.slot_loss_sums = spy
        e.opt.step = lambda active: None  # keep the gradients of this one step to compare
        rep = e.step()
        e.close()
        return e, rep, threads

    e, rep, threads = run(2)
    assert rep is not None and rep.pack.chunks > 1 and len(threads) > 1  # the threaded path ran
    assert on_leaf == []
    assert all(b.live is None for b in e.banks.values())
    one, _, _ = run(1)
    assert on_leaf  # the watch sees leaf ops when there are any (one thread reads the parameters)
    for name, b in e.banks.items():
        assert b.A.grad is not None
        torch.testing.assert_close(b.A.grad, one.banks[name].A.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(b.B.grad, one.banks[name].B.grad, rtol=1e-4, atol=1e-6)

"""The per-step work after backward: AdamW's implementation and the exact finiteness check."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from agent.runtime.optim import ENV, EagerAdamW, adamw_impl, all_finite, is_fused, make_adamw
from tessera.errors import SpecError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_adamw_impl_defaults_to_fused_and_names_the_variable_when_bad():
    assert adamw_impl({}) == "fused" and adamw_impl({ENV: " "}) == "fused"
    assert adamw_impl({ENV: "Loop"}) == "loop" and adamw_impl({ENV: "foreach"}) == "foreach"
    with pytest.raises(SpecError) as e:
        adamw_impl({ENV: "fast"})
    assert e.value.field == ENV and "'fast'" in str(e.value)


def test_make_adamw_builds_the_named_implementation():
    p = [torch.nn.Parameter(torch.zeros(3))]
    fused = make_adamw(p, lr=0.1, env={})
    assert is_fused(fused) and fused.defaults["weight_decay"] == 0.01
    loop = make_adamw(p, lr=0.1, weight_decay=0.0, env={ENV: "loop"})
    assert not is_fused(loop) and loop.defaults["foreach"] is False and loop.defaults["weight_decay"] == 0.0
    assert make_adamw(p, lr=0.1, env={ENV: "foreach"}).defaults["foreach"] is True


def _train(slices, impl, full, grads):
    ps = [torch.nn.Parameter(full[s].clone()) for s in slices]
    opt = make_adamw(ps, lr=1e-2, weight_decay=0.1, env={ENV: impl})
    for g in grads:
        for p, s in zip(ps, slices):
            p.grad = g[s].clone()
        opt.step()
    return torch.cat([p.detach() for p in ps])


@pytest.mark.parametrize("impl", ["fused", "foreach", "loop"])
def test_a_shards_update_is_the_same_slice_of_the_full_update_bit_for_bit(impl):
    """What lets optimizer state be resharded between plans: element-wise updates."""
    torch.manual_seed(0)
    full = torch.randn(97, 33)
    grads = [torch.randn(97, 33) for _ in range(4)]
    whole = _train([slice(0, 97)], impl, full, grads)
    shards = _train([slice(0, 30), slice(30, 61), slice(61, 97)], impl, full, grads)
    assert torch.equal(whole, shards)
    assert not torch.equal(whole, full)  # it did train


def test_the_implementations_agree_up_to_rounding():
    torch.manual_seed(1)
    full = torch.randn(64, 16)
    grads = [torch.randn(64, 16) for _ in range(6)]
    ref = _train([slice(0, 64)], "loop", full, grads)
    for impl in ("fused", "foreach"):
        assert torch.allclose(_train([slice(0, 64)], impl, full, grads), ref, rtol=0, atol=1e-6)


def test_all_finite_is_exact():
    ok = [torch.randn(50, 7), None, torch.randn(3).half(), torch.randn(2, dtype=torch.float64)]
    assert all_finite(ok) and all_finite([]) and all_finite([None])
    for bad in (float("inf"), float("-inf"), float("nan")):
        for i in (0, 2, 3):
            ts = [t.clone() if t is not None else None for t in ok]
            ts[i].view(-1)[-1] = bad
            assert not all_finite(ts), (bad, i)
    # +inf and -inf in one tensor sum to NaN: still caught.
    assert not all_finite([torch.tensor([float("inf"), float("-inf"), 1.0])])
    # Finite elements whose sum overflows: the exact check answers, not the sum.
    huge = torch.full((4,), 3e38)
    assert not torch.isfinite(huge.sum()) and all_finite([huge, torch.ones(2)])
    assert not all_finite([huge, torch.tensor([float("nan")])])


def _steps(opt_cls, impl: str, **kw):
    """Three AdamW steps of a small MLP (seed 0) with ``opt_cls``; (model, optimizer)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = opt_cls(m.parameters(), **kw)
    x = torch.randn(8, 16)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        m(x).pow(2).mean().backward()
        opt.step()
    return m, opt


@pytest.mark.parametrize("impl", ["fused", "foreach", "loop"])
def test_the_eager_adamw_is_torchs_adamw_bit_for_bit(impl):
    """Same parameters, same state dict, and a state dict of either loads into the other."""
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[impl]
    ours_m, ours = _steps(lambda ps, **kw: make_adamw(ps, env={ENV: impl}, **kw), impl, lr=1e-2, weight_decay=0.1)
    ref_m, ref = _steps(torch.optim.AdamW, impl, lr=1e-2, weight_decay=0.1, **flags)
    assert type(ours) is EagerAdamW
    assert all(torch.equal(a, b) for a, b in zip(ours_m.parameters(), ref_m.parameters()))
    a, b = ours.state_dict(), ref.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for k in b["state"]:
        assert a["state"][k].keys() == b["state"][k].keys()
        assert all(torch.equal(a["state"][k][f], b["state"][k][f]) for f in b["state"][k])
    ours.load_state_dict(b)  # a checkpoint written by torch's AdamW resumes here
    ref.load_state_dict(a)


def test_the_eager_adamw_keeps_the_step_hooks_and_grad_mode():
    p = torch.nn.Parameter(torch.ones(3))
    opt = make_adamw([p], lr=0.1, env={})
    calls = []
    opt.register_step_pre_hook(lambda o, args, kw: calls.append(("pre", torch.is_grad_enabled())))
    opt.register_step_post_hook(lambda o, args, kw: calls.append("post"))
    p.grad = torch.ones(3)
    opt.step()
    assert calls == [("pre", True), "post"] and torch.is_grad_enabled()
    assert not torch.equal(p.detach(), torch.ones(3))


def test_a_runtime_process_trains_and_checkpoints_without_importing_torch_dynamo():
    """torch._dynamo is ~3 s of CPU and ~70 MB at an executor's start; the runtime never
    compiles, so its optimizers must not import it (a fresh interpreter: this one may
    have imported it already)."""
    code = (
        "import sys, torch\n"
        "from agent.runtime.optim import make_adamw\n"
        "for impl in ('fused', 'foreach', 'loop'):\n"
        "    m = torch.nn.Linear(4, 4)\n"
        "    opt = make_adamw(m.parameters(), lr=0.1, env={'TESSERA_ADAMW': impl})\n"
        "    m(torch.ones(2, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "    opt.load_state_dict(opt.state_dict())\n"
        "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"

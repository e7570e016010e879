"""The per-step work of a training loop after backward: the gradient check and AdamW.

Contract:

* :func:`make_adamw` builds ``torch.optim.AdamW`` with the implementation that
  ``TESSERA_ADAMW`` (environment) names: ``fused`` (the default: one kernel per
  parameter group, PyTorch's fused CPU / CUDA AdamW), ``foreach`` (multi-tensor ops) or
  ``loop`` (PyTorch's per-tensor Python loop, its own default on CPU). Every one is
  element-wise, so a tensor-parallel shard's update is exactly the same slice of the
  full tensor's update (checked bit for bit by the tests); the implementations differ
  from each other by rounding only (~1 ulp). Where the parameters' device or dtype
  has no fused kernel, ``fused`` falls back to ``foreach`` (logged). Any other value
  is a SpecError naming the variable.
* The optimizers it builds run eagerly without importing ``torch._dynamo``
  (:func:`eager_optimizers`): PyTorch wraps ``Optimizer.step`` in graph breaks and
  ``zero_grad`` / ``add_param_group`` / ``state_dict`` / ``load_state_dict`` in
  ``torch._disable_dynamo``, both of which import ``torch._dynamo`` on first use —
  ~3 s of CPU and ~70 MB at every executor's start (fresh executor to first step 6.5 ->
  3.4 s, 305 -> 232 MB, 2026-12-07) for a runtime that never compiles. Same kernels,
  same state dict: only those wrappers are skipped.
* :func:`all_finite` says whether every element of some tensors is finite — exactly:
  a finite sum proves it (an inf or NaN element makes any sum inf or NaN), and only a
  non-finite sum (a bad gradient, or finite ones whose sum overflows) pays the
  element-by-element check.

Why (measured 2026-12-06, 2-vCPU KVM guest, torch 2.13 CPU, one thread,
``python -m bench.step_work``): PyTorch's default AdamW on CPU loops over the tensors in
Python — 1.59 ms a step for a GPT of 2 layers × 64 wide (30 tensors), 4.34 ms for
4 × 128 (54), against 0.35 / 1.05 ms fused; ``isfinite(g).all()`` per tensor took
0.67 / 2.79 ms against 0.14 / 0.30 ms for the sums. With the data source's batch that
was 13-23 % of a training step of those small models, all of it serial work that
neither a second core nor pipeline stages divide.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable

import structlog
import torch

from tessera.errors import SpecError

logger = structlog.get_logger("tessera.runtime.optim")

ENV = "TESSERA_ADAMW"
IMPLS = ("fused", "foreach", "loop")


def adamw_impl(env: dict[str, str] | None = None) -> str:
    """The AdamW implementation asked for: ``TESSERA_ADAMW`` from ``env`` (default the
    process's environment), ``fused`` when unset or empty; SpecError (a ValueError)
    naming the variable otherwise."""
    value = (os.environ if env is None else env).get(ENV, "").strip().lower() or "fused"
    if value not in IMPLS:
        raise SpecError(ENV, f"must be one of {', '.join(IMPLS)}, got {value!r}")
    return value


def _unwrap_use_grad(step) -> Callable | None:
    """The function that ``torch.optim.optimizer._use_grad_for_differentiable`` wrapped
    into ``step`` (through any profiling wrappers above it: ``functools.wraps`` chains),
    or None when ``step`` is not such a wrapper (another PyTorch)."""
    fn, seen = step, 0
    while fn is not None and seen < 8:
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_name == "_use_grad":
            return getattr(fn, "__wrapped__", None)
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return None


_ADAM_STEP = _unwrap_use_grad(vars(torch.optim.Adam).get("step"))


def eager_optimizers() -> bool:
    """Make ``torch.optim.Optimizer``'s ``torch._disable_dynamo`` methods call their
    function directly (their lazily built ``torch._dynamo.disable`` wrapper preset to the
    function itself), unless ``torch._dynamo`` is imported already (then it is free).
    Returns whether :class:`EagerAdamW` can run without importing ``torch._dynamo``.
    Process-wide and idempotent; it changes nothing for code that is not compiled, and
    a process that does ``torch.compile`` through these methods would trace into them
    instead of around them — this runtime never compiles."""
    if _ADAM_STEP is None:
        return False
    if "torch._dynamo" in sys.modules:
        return True
    probe = torch._disable_dynamo(lambda: None).__code__
    for attr in vars(torch.optim.Optimizer).values():
        fn = getattr(attr, "__wrapped__", None)
        if fn is not None and getattr(attr, "__code__", None) is probe:
            setattr(fn, "__dynamo_disable", fn)  # torch._compile._disable_dynamo's cache slot
    return True


class EagerAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``step`` is Adam's own under the grad mode that
    ``_use_grad_for_differentiable`` sets, less its two ``torch._dynamo.graph_break()``
    calls (no-ops outside ``torch.compile``, and the import of ``torch._dynamo`` at the
    first step). Same arithmetic, state and state dict as AdamW (checked bit for bit by
    the tests); step hooks and the profiler's record_function still wrap it."""

    def step(self, closure=None):  # noqa: D102 (AdamW.step)
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return _ADAM_STEP(self, closure)


def make_adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.01,
               env: dict[str, str] | None = None) -> torch.optim.AdamW:
    """AdamW over ``params`` (module doc): :class:`EagerAdamW` where this PyTorch allows
    it, else ``torch.optim.AdamW``; SpecError for a bad ``TESSERA_ADAMW``."""
    impl = adamw_impl(env)
    params = list(params)
    cls = EagerAdamW if eager_optimizers() else torch.optim.AdamW
    if impl == "fused":
        try:
            return cls(params, lr=lr, weight_decay=weight_decay, fused=True)
        except (RuntimeError, ValueError) as e:  # no fused kernel for this device / dtype
            logger.warning("fused AdamW unavailable; using foreach", reason=str(e).splitlines()[0][:200])
            impl = "foreach"
    return cls(params, lr=lr, weight_decay=weight_decay, foreach=impl == "foreach")


def is_fused(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` runs a fused kernel (its step counters then live on the
    parameters' device, which a restored state must respect)."""
    return bool(opt.defaults.get("fused"))


def all_finite(tensors: Iterable[torch.Tensor | None]) -> bool:
    """True iff every element of every tensor (None entries skipped) is finite (exact;
    module doc)."""
    ts = [t for t in tensors if t is not None]
    if not ts:
        return True
    sums = torch.stack([t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32) for t in ts])
    finite = torch.isfinite(sums)
    if bool(finite.all()):
        return True
    # A finite sum already proved its tensor finite: only the others need the exact check.
    return all(bool(torch.isfinite(t).all()) for t, ok in zip(ts, finite.tolist()) if not ok)

"""Many LoRA adapters on one frozen backbone, applied per chunk without a task loop.

Contract:

* :class:`LoRABank` holds the adapters of every task for one target linear as two
  stacked parameters ``A`` (S, in, R) and ``B`` (S, R, out), S slots (one per task),
  R the largest rank. A task of rank r < R owns ``A[s, :, :r]`` / ``B[s, :r, :]``; the
  rest of its slot is zero and stays zero (its gradient is exactly zero because the
  matching half of the other factor is zero), so it computes exactly a rank-r LoRA.
  ``scale[s]`` is alpha/r for a task that targets this module, 0 otherwise.
* :class:`MuxLoRALinear` wraps a frozen ``nn.Linear``:
  ``y = base(x) + scale[slot] * (x @ A[slot]) @ B[slot]`` with ``slot`` the chunk's
  task slot from the shared :class:`MuxContext`. Per-row adapters are gathered with an
  index tensor and applied with ``bmm`` (one grouped matmul for all tasks); when the
  context names its slots on the host and none of them targets the module, the adapter
  is skipped (its contribution is exactly zero).
* :class:`BankAdam` is Adam (same arithmetic as ``torch.optim.Adam``, no weight decay)
  over every bank at once with per-slot learning rate and step count, updating only
  the slots that trained this step — a finished task's slot is never touched, and
  tasks with different learning rates share one vectorised update.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field

import torch
import torch.nn as nn

TARGETS = ("qkv", "proj", "fc", "out")


@dataclass
class MuxContext(threading.local):
    """What the current forward runs: the slot of each chunk, or one slot for all.

    Thread-local: every thread sees its own fields (fresh defaults in a new thread), so
    several threads can run forwards of different micro-batches through the same
    wrapped backbone at once (:class:`engine.MuxEngine` with ``workers > 1``)."""

    chunk_slot: torch.Tensor | None = None  # (N,) int64
    single: int | None = None  # temporal fusion: every chunk is this slot (no gather)
    # Host copy of the distinct slots in chunk_slot (optional): a linear that none of
    # them targets skips its adapter entirely.
    slots: tuple[int, ...] | None = None
    extra: dict = field(default_factory=dict)


class LoRABank(nn.Module):
    """Stacked adapters of every slot for one linear; see module doc."""

    def __init__(self, in_features: int, out_features: int, slots: int, rank: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.A = nn.Parameter(torch.zeros(slots, in_features, rank))
        self.B = nn.Parameter(torch.zeros(slots, rank, out_features))
        self.register_buffer("scale", torch.zeros(slots))
        # Host copy of which slots target this module: the temporal path reads it without
        # a device sync.
        self.host_scale: list[float] = [0.0] * slots
        # (A, B) that forwards read instead of the parameters while set (step_aliases).
        self.live: tuple[torch.Tensor, torch.Tensor] | None = None

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) for a forward: the step's non-leaf aliases while :func:`step_aliases`
        holds, else the parameters themselves."""
        return (self.A, self.B) if self.live is None else self.live

    @property
    def slots(self) -> int:
        return self.A.shape[0]

    @property
    def rank(self) -> int:
        return self.A.shape[2]

    @torch.no_grad()
    def resize(self, slots: int, rank: int) -> None:
        """Grow to at least ``slots`` x ``rank`` keeping every slot's values (zero padded)."""
        s, r = max(slots, self.slots), max(rank, self.rank)
        if (s, r) == (self.slots, self.rank):
            return
        a = self.A.new_zeros(s, self.in_features, r)
        b = self.B.new_zeros(s, r, self.out_features)
        a[: self.slots, :, : self.rank] = self.A
        b[: self.slots, : self.rank, :] = self.B
        sc = self.scale.new_zeros(s)
        sc[: self.slots] = self.scale
        self.A, self.B = nn.Parameter(a), nn.Parameter(b)
        self.scale = sc
        self.host_scale += [0.0] * (s - len(self.host_scale))

    @torch.no_grad()
    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scale: float) -> None:
        """Write a rank-r adapter (a: (in, r), b: (r, out)) into ``slot``; None clears it."""
        self.A[slot].zero_()
        self.B[slot].zero_()
        self.scale[slot] = scale if a is not None else 0.0
        self.host_scale[slot] = float(scale) if a is not None else 0.0
        if a is not None:
            r = a.shape[1]
            self.A[slot, :, :r] = a
            self.B[slot, :r, :] = b

    def get_slot(self, slot: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the slot's rank-``rank`` factors (in, r) and (r, out)."""
        return self.A[slot, :, :rank].detach().clone(), self.B[slot, :rank, :].detach().clone()


class MuxLoRALinear(nn.Module):
    """A frozen linear plus the per-chunk adapter of its bank; see module doc."""

    def __init__(self, base: nn.Linear, bank: LoRABank, ctx: MuxContext) -> None:
        super().__init__()
        self.base = base
        self.bank = bank
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        ctx = self.ctx
        a, b = self.bank.factors()
        if ctx.single is not None:
            s = ctx.single
            sc = self.bank.host_scale[s]
            if sc == 0.0:
                return y  # the task does not target this module
            return y + ((x @ a[s]) * sc) @ b[s]
        if ctx.chunk_slot is None:
            return y
        if ctx.slots is not None and not any(self.bank.host_scale[s] for s in ctx.slots):
            return y  # no chunk here belongs to a task that targets this module
        idx = ctx.chunk_slot
        # (N, T, in) x (N, in, R) -> (N, T, R); scaling the rank-R intermediate is cheapest.
        h = torch.bmm(x, a.index_select(0, idx)) * self.bank.scale.index_select(0, idx)[:, None, None]
        return y + torch.bmm(h, b.index_select(0, idx))


@contextlib.contextmanager
def step_aliases(banks):
    """While held, every bank's forwards (:meth:`LoRABank.factors`) read non-leaf copies
    of ``A`` and ``B`` made here, on the calling thread; their gradients flow back into
    the parameters' ``.grad`` as before. For forwards on several threads at once.

    Why: in PyTorch (2.13) an op on a leaf that requires grad takes the leaf's autograd
    mutex with the GIL held (the forward-grad check of ``A[s]``, Python indexing), while
    an op that released the GIL (``index_select``) takes that mutex first and then the
    GIL inside it (looking up the leaf's gradient accumulator, whose Python object
    must be kept alive): two workers on the same bank deadlocked that way, about once in
    700 two-worker steps (estimator benchmark, 2026-12-05; gdb showed both stacks). A
    non-leaf has no accumulator to look up: no op a worker runs touches a leaf."""
    banks = list(banks)
    with torch.enable_grad():
        for bank in banks:
            bank.live = (bank.A.clone(), bank.B.clone())
    try:
        yield
    finally:
        for bank in banks:
            bank.live = None


def module_names(cfg_layers: int) -> list[str]:
    """Names, in model order, of every linear an adapter can target (``blocks.i.attn.qkv``...)."""
    out = []
    for i in range(cfg_layers):
        out += [f"blocks.{i}.attn.qkv", f"blocks.{i}.attn.proj", f"blocks.{i}.mlp.fc", f"blocks.{i}.mlp.out"]
    return out


def short_name(full: str) -> str:
    return full.rsplit(".", 1)[1]


def inject(model: nn.Module, ctx: MuxContext, slots: int, rank: int) -> dict[str, LoRABank]:
    """Freeze ``model`` and wrap every target linear with a :class:`MuxLoRALinear`; returns the banks."""
    for p in model.parameters():
        p.requires_grad_(False)
    banks: dict[str, LoRABank] = {}
    for name in module_names(len(model.blocks)):
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        base = getattr(parent, attr)
        bank = LoRABank(base.in_features, base.out_features, slots, rank).to(base.weight.device)
        setattr(parent, attr, MuxLoRALinear(base, bank, ctx))
        banks[name] = bank
    return banks


class BankAdam:
    """Vectorised per-slot Adam over all banks; see module doc."""

    def __init__(self, banks: dict[str, LoRABank], betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.banks = banks
        self.b1, self.b2 = betas
        self.eps = eps
        dev = next(iter(banks.values())).A.device
        n = next(iter(banks.values())).slots
        self.lr = torch.zeros(n, device=dev)
        self.steps = torch.zeros(n, dtype=torch.float64, device=dev)
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self._alloc()

    def _alloc(self) -> None:
        for name, bank in self.banks.items():
            old = self.state.get(name)
            st = {}
            for p in ("A", "B"):
                t = getattr(bank, p)
                for k in ("m", "v"):
                    z = torch.zeros_like(t)
                    if old is not None:
                        o = old[p + k]
                        if p == "A":
                            z[: o.shape[0], :, : o.shape[2]] = o
                        else:
                            z[: o.shape[0], : o.shape[1], :] = o
                    st[p + k] = z
            self.state[name] = st

    def resize(self, slots: int) -> None:
        """Follow the banks after they grew (keeps every slot's moments)."""
        n = next(iter(self.banks.values())).slots
        if n > self.lr.numel():
            self.lr = torch.cat([self.lr, self.lr.new_zeros(n - self.lr.numel())])
            self.steps = torch.cat([self.steps, self.steps.new_zeros(n - self.steps.numel())])
        self._alloc()

    def reset_slot(self, slot: int, lr: float) -> None:
        """A new task in ``slot``: fresh moments, step 0, its learning rate."""
        self.lr[slot] = lr
        self.steps[slot] = 0
        for st in self.state.values():
            for t in st.values():
                t[slot].zero_()

    @torch.no_grad()
    def step(self, active: torch.Tensor) -> None:
        """One Adam step for the slots where ``active`` (S,) bool is True; others unchanged.

        Only the (slot, module) pairs that train are touched: an active slot's factors in
        a module its task targets (``host_scale`` non-zero). Every other pair has an exactly
        zero gradient and zero moments, so Adam would leave it unchanged anyway; skipping
        it saves the work. The update is a handful of ``torch._foreach_*`` calls over the
        per-slot views (per-slot step sizes as scalar lists), in place, no full-bank
        temporaries."""
        self.steps += active.to(self.steps.dtype)
        slots = active.nonzero().flatten().tolist()
        if not slots:
            return
        steps = self.steps.tolist()
        lrs = self.lr.tolist()
        params, grads, ms, vs, step_size, bc2_sqrt = [], [], [], [], [], []
        for name, bank in self.banks.items():
            st = self.state[name]
            for p in ("A", "B"):
                param = getattr(bank, p)
                g = param.grad
                if g is None:
                    continue
                m, v = st[p + "m"], st[p + "v"]
                for s in slots:
                    if bank.host_scale[s] == 0.0:
                        continue
                    t = max(steps[s], 1.0)
                    params.append(param[s])
                    grads.append(g[s])
                    ms.append(m[s])
                    vs.append(v[s])
                    # Same scalars as torch.optim.Adam: lr / (1 - b1^t) and sqrt(1 - b2^t).
                    step_size.append(-(lrs[s] / (1 - self.b1 ** t)))
                    bc2_sqrt.append(math.sqrt(1 - self.b2 ** t))
        if not params:
            return
        torch._foreach_mul_(ms, self.b1)
        torch._foreach_add_(ms, grads, alpha=1 - self.b1)
        torch._foreach_mul_(vs, self.b2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - self.b2)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(params, ms, denom, step_size)

    def zero_grad(self) -> None:
        for bank in self.banks.values():
            bank.A.grad = None
            bank.B.grad = None

    def slot_state(self, slot: int) -> dict:
        """The optimizer state of one slot (for a task checkpoint)."""
        return {"step": float(self.steps[slot]), "lr": float(self.lr[slot]),
                "moments": {n: {k: t[slot].detach().clone() for k, t in st.items()} for n, st in self.state.items()}}

    def load_slot(self, slot: int, state: dict) -> None:
        self.steps[slot] = state["step"]
        self.lr[slot] = state["lr"]
        for n, st in self.state.items():
            for k, t in st.items():
                src = state["moments"][n][k]
                t[slot].zero_()
                t[slot][tuple(slice(0, d) for d in src.shape)] = src


def init_adapter(in_features: int, out_features: int, rank: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """LoRA init as in HF PEFT: A ~ kaiming-uniform(a=sqrt(5)) (bound 1/sqrt(in)), B = 0."""
    bound = 1.0 / math.sqrt(in_features)
    a = (torch.rand(in_features, rank, generator=g) * 2 - 1) * bound
    return a, torch.zeros(rank, out_features)

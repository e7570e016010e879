"""The multiplexing engine: K LoRA tasks training on one frozen GPT backbone.

Contract: :class:`MuxEngine` owns the backbone (frozen, wrapped once by
:func:`lora.inject`), the adapter banks and one :class:`lora.BankAdam`. Tasks are added
(:meth:`MuxEngine.add_task`) and cancelled (:meth:`MuxEngine.cancel`) between steps
without touching the others; a task that reaches its step count finishes by itself and
its slot is freed (its final adapter kept on the :class:`TaskState`). A stepping task
whose step loss or any of its adapter gradients is not finite gets no update that step:
it ends ``failed`` (``TaskState.error`` says why, ``TaskState.failed_state`` is its
:meth:`MuxEngine.task_state` from before the step, still finite) and the others step on
untouched. Each :meth:`MuxEngine.step`:

* ``spatial``: takes one micro-batch from *every* running task, packs all of them into
  chunks (:mod:`packing`) and runs ONE forward/backward on the backbone; each chunk uses
  its task's adapter through a gathered ``bmm``;
* ``temporal``: takes one micro-batch from the next running task (round robin), so
  tasks interleave step by step on the backbone.

The objective is the sum over stepping tasks of each task's own mean token loss, so
every task's adapter gradient is exactly the gradient it would get training alone.

A step's chunks go through the backbone in micro-batches of at most
``micro_batch_tokens`` tokens (gradient accumulation; each token's loss is divided by
its task's token count over the WHOLE step, so the gradient equals the one-pass
gradient), so activation memory is that of one micro-batch, not of all K tasks' batches
at once. Chunks are grouped by fill (real tokens, packed from column 0), fullest first,
and each micro-batch is cut to its fullest chunk's width: the trailing pad columns that
no chunk of it uses are never computed; a chunk joins a micro-batch only while the pad
columns that remain stay within 5 % of it (:func:`micro_batches`), so a half-filled chunk
is not padded to a full one's width. The vocabulary head runs only on positions that
have a target (no logits for pads). Attention runs sequence by sequence
(:mod:`varlen`: length buckets through the causal kernel, no (N, C, C) mask), and an
adapter that no task of a micro-batch targets is skipped; a micro-batch of one task
takes the ungathered adapter path.

With ``workers`` W > 1 the micro-batches of a step run concurrently on a pool of W
threads, each running forward + backward of whole micro-batches (taken fullest first
from a shared queue) with ONE intra-op thread; the process's intra-op thread count is
set to 1 for the whole step (the optimizer update, a few ``foreach`` calls, needs no
more) and restored afterwards. Autograd accumulates the micro-batches' adapter gradients into the shared
bank leaves under its per-leaf lock, so :class:`lora.BankAdam` sees the same summed
gradients as the serial loop, up to float summation order (the losses themselves are
summed on the calling thread in micro-batch order, so they are order-independent).
Independent single-threaded workers need no barrier per kernel, so W cores are used
more fully than by W intra-op threads, and a core taken by another process slows one
worker instead of stalling every op. Cost: up to W micro-batches' activations alive at
once. The :class:`lora.MuxContext` is thread-local, which is what makes this safe.
Pure compute: no files, no events (the workload runner does I/O).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from agent.runtime.model import GPT
from agent.runtime.peft import lora
from agent.runtime.peft.packing import PackStats, pack
from agent.runtime.peft.varlen import SegmentLayout
from tessera.spec.peft import MICRO_BATCH_TOKENS

ADAPTER_FORMAT = "tessera-lora/1"


@dataclass
class TaskState:
    """One task: its resolved spec, where it lives and how far it got."""

    name: str
    spec: dict
    dataset: Any
    slot: int
    steps: int
    step: int = 0
    status: str = "running"  # running | succeeded | cancelled | failed
    tokens: int = 0
    loss: float = float("nan")
    first_loss: float = float("nan")
    added_at: float = field(default_factory=time.perf_counter)
    ended_at: float | None = None
    tokens_at_add: int = 0  # tokens already trained when it joined this engine (a resumed task's)
    pack: PackStats = field(default_factory=PackStats)
    final_adapter: dict | None = None
    error: str | None = None  # why it failed (a non-finite loss or gradient)
    failed_state: dict | None = None  # its task_state() when it failed: the last finite one

    def tokens_per_s(self, now: float | None = None) -> float:
        """Effective (non-padding) tokens per second since the task joined the engine:
        the tokens it trained here (not those of an earlier executor it resumed from) over
        the time since it was added."""
        end = self.ended_at if self.ended_at is not None else (now or time.perf_counter())
        return (self.tokens - self.tokens_at_add) / max(end - self.added_at, 1e-9)


@dataclass
class StepReport:
    """What one engine step did."""

    tasks: list[str]
    losses: dict[str, float]
    tokens: dict[str, int]
    wall_s: float
    pack: PackStats
    finished: list[TaskState]
    failed: list[TaskState] = field(default_factory=list)  # ended "failed" by this step (no update)


class MuxEngine:
    """Shared-backbone multi-task LoRA trainer; see module doc."""

    def __init__(self, model: GPT, chunk_size: int, mode: str = "spatial", slots: int = 4,
                 micro_batch_tokens: int = MICRO_BATCH_TOKENS, workers: int = 1) -> None:
        if mode not in ("spatial", "temporal"):
            raise ValueError(f"mode must be spatial or temporal, got {mode!r}")
        if not 2 <= chunk_size <= model.cfg.seq_len:
            raise ValueError(f"chunk_size must be in 2..{model.cfg.seq_len}, got {chunk_size}")
        if micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        # Attend packed sequences one by one (varlen.SegmentLayout) instead of with the
        # (N, C, C) block-causal mask: same result for real tokens, less work.
        self.varlen = True
        self._pool: ThreadPoolExecutor | None = None
        # Whole chunks per micro-batch (at least one).
        self.micro_chunks = max(1, micro_batch_tokens // chunk_size)
        self.model = model
        self.cfg = model.cfg
        self.chunk_size = chunk_size
        self.mode = mode
        self.device = next(model.parameters()).device
        self.ctx = lora.MuxContext()
        self.banks = lora.inject(model, self.ctx, slots, 1)
        self.opt = lora.BankAdam(self.banks)
        self.tasks: dict[str, TaskState] = {}
        self._free = list(range(slots))
        self._rr = 0
        self.steps_done = 0
        self.pack_total = PackStats(chunk_size=chunk_size)
        self.processed_tokens = 0  # token positions actually computed (real + pads left after trimming)

    # -- task lifecycle -------------------------------------------------------------
    def running(self) -> list[TaskState]:
        """Running tasks in the order they were added."""
        return [t for t in self.tasks.values() if t.status == "running"]

    def add_task(self, spec: dict, dataset: Any) -> TaskState:
        """Start a task (validated, with ``learning_rate``/``batch_size``/``steps`` and
        ``dataset.seed`` resolved). Its adapter is initialised from its seed, so the
        result does not depend on which other tasks run. ValueError if the name is taken."""
        name = spec["name"]
        if name in self.tasks and self.tasks[name].status == "running":
            raise ValueError(f"task {name!r} is already running")
        for key in ("learning_rate", "batch_size", "steps"):
            if spec.get(key) is None:
                raise ValueError(f"task {name!r}: {key} must be resolved before add_task")
        if not self._free:
            self._grow(2 * self._slots())
        slot = self._free.pop(0)
        rank = spec["rank"]
        if rank > next(iter(self.banks.values())).rank:
            for b in self.banks.values():
                b.resize(b.slots, rank)
            self.opt.resize(self._slots())
        g = torch.Generator().manual_seed(int(spec["dataset"]["seed"]))
        scale = spec["alpha"] / rank
        for full, bank in self.banks.items():
            # Draw for every module, targeted or not, so a task's init does not depend on
            # its target list order.
            a, b = lora.init_adapter(bank.in_features, bank.out_features, rank, g)
            if lora.short_name(full) in spec["target_modules"]:
                bank.set_slot(slot, a.to(self.device), b.to(self.device), scale)
            else:
                bank.set_slot(slot, None, None, 0.0)
        self.opt.reset_slot(slot, spec["learning_rate"])
        t = TaskState(name=name, spec=spec, dataset=dataset, slot=slot, steps=spec["steps"],
                      pack=PackStats(chunk_size=self.chunk_size))
        self.tasks[name] = t
        return t

    def cancel(self, name: str) -> TaskState:
        """Stop a running task now; its slot is freed, the others are untouched. KeyError if unknown."""
        t = self.tasks[name]
        if t.status != "running":
            return t
        t.final_adapter = self.adapter(t)
        self._end(t, "cancelled")
        return t

    def _end(self, t: TaskState, status: str) -> None:
        t.status = status
        t.ended_at = time.perf_counter()
        for bank in self.banks.values():
            bank.set_slot(t.slot, None, None, 0.0)
        self.opt.reset_slot(t.slot, 0.0)
        self._free.append(t.slot)
        self._free.sort()

    def _slots(self) -> int:
        return next(iter(self.banks.values())).slots

    def _grow(self, slots: int) -> None:
        old = self._slots()
        for b in self.banks.values():
            b.resize(slots, b.rank)
        self.opt.resize(slots)
        self._free += list(range(old, slots))

    # -- training -------------------------------------------------------------------
    def _pick(self) -> list[TaskState]:
        run = self.running()
        if not run or self.mode == "spatial":
            return run
        t = run[self._rr % len(run)]
        self._rr += 1
        return [t]

    def step(self) -> StepReport | None:
        """One fused step (see module doc); None when no task is running. With ``workers``
        > 1 the whole step (packing and the optimizer update too) runs with one intra-op
        thread; the process's count is restored when it returns."""
        tasks = self._pick()
        if not tasks:
            return None
        if self.workers == 1:
            return self._step(tasks)
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._step(tasks)
        finally:
            torch.set_num_threads(old)

    def _step(self, tasks: list[TaskState]) -> StepReport:
        t0 = time.perf_counter()
        batches = [(t.slot, t.dataset.batch(t.step, t.spec["batch_size"])) for t in tasks]
        p = pack(batches, self.chunk_size)
        dev = self.device
        tokens, targets, positions = p.tokens.to(dev), p.targets.to(dev), p.positions.to(dev)
        mask = None if self.varlen and p.seg is not None else p.mask.to(dev)
        chunk_slot = p.chunk_slot.to(dev)
        single = tasks[0].slot if len(tasks) == 1 else None
        s = self._slots()
        # Each task's token count over the whole step: the denominators of its mean.
        counts = torch.bincount(chunk_slot[:, None].expand_as(targets)[targets != -100], minlength=s)
        denom = counts.clamp(min=1).to(torch.float32)
        sums = torch.zeros(s, device=dev)
        self.opt.zero_grad()
        fills = (p.token_slot >= 0).sum(1).tolist()
        mbs = micro_batches(fills, self.micro_chunks)

        def run_mb(mb: tuple[list[int], int]) -> torch.Tensor:
            idx, w = mb
            i = torch.tensor(idx, device=dev)
            mb_sums, _ = self.slot_loss_sums(tokens[i, :w], targets[i, :w], positions[i, :w],
                                             self.attention_layout(p, mb, mask), chunk_slot[i], single,
                                             slots=[int(p.chunk_slot[j]) for j in idx])
            # Sum of per-task means, accumulated: d(total)/d(adapter k) = d(loss_k)/d(adapter k).
            (mb_sums / denom).sum().backward()
            return mb_sums.detach()

        if self.workers > 1 and len(mbs) > 1:
            for mb_sums in self._run_threaded(run_mb, mbs):
                sums += mb_sums
        else:
            for mb in mbs:
                sums += run_mb(mb)
        self.processed_tokens += sum(len(idx) * w for idx, w in mbs)
        ok = self._finite_slots(sums / denom)
        active = torch.zeros(s, dtype=torch.bool, device=dev)
        active[[t.slot for t in tasks]] = True
        active &= ok  # a task with a non-finite loss or gradient gets no update
        self.opt.step(active)
        losses = (sums / denom).cpu().tolist()
        ok_l = ok.cpu().tolist()
        wall = time.perf_counter() - t0
        self.steps_done += 1
        self.pack_total.add(p.stats)
        rep = StepReport(tasks=[t.name for t in tasks], losses={}, tokens={}, wall_s=wall, pack=p.stats, finished=[])
        for t, (_, seqs) in zip(tasks, batches):
            if not ok_l[t.slot]:
                loss = losses[t.slot]
                t.error = (f"loss is {loss} at step {t.step + 1}" if not math.isfinite(loss)
                           else f"gradients are not finite at step {t.step + 1} (loss {loss})")
                t.failed_state = self.task_state(t)  # before the update: still finite
                self._end(t, "failed")
                rep.failed.append(t)
                continue
            n = sum(int(s.numel()) for s in seqs)
            t.tokens += n
            t.step += 1
            t.loss = losses[t.slot]
            if t.step == 1:
                t.first_loss = t.loss
            t.pack.real_tokens += n
            t.pack.pad_longest += len(seqs) * max(int(s.numel()) for s in seqs) - n
            rep.losses[t.name], rep.tokens[t.name] = t.loss, n
            if t.step >= t.steps:
                t.final_adapter = self.adapter(t)
                self._end(t, "succeeded")
                rep.finished.append(t)
        return rep

    def _finite_slots(self, losses: torch.Tensor) -> torch.Tensor:
        """(S,) bool: the slot's step loss and every one of its adapter gradients are finite."""
        ok = torch.isfinite(losses)
        for bank in self.banks.values():
            for p in (bank.A, bank.B):
                if p.grad is not None:
                    ok &= torch.isfinite(p.grad).flatten(1).all(1)
        return ok

    def _run_threaded(self, fn, mbs: list) -> list[torch.Tensor]:
        """``fn`` over ``mbs`` on the worker pool (one intra-op thread each), results in
        ``mbs`` order; the process's intra-op thread count is restored afterwards. The
        workers' forwards read the banks through aliases made here, before they start
        (:func:`lora.step_aliases`): no worker runs an op on a leaf."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="mux-mb",
                                            initializer=torch.set_num_threads, initargs=(1,))
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with lora.step_aliases(self.banks.values()):
                futures = [self._pool.submit(fn, mb) for mb in mbs]
                wait(futures)  # all done (or failed) before the aliases go and the thread count is restored
            return [f.result() for f in futures]
        finally:
            torch.set_num_threads(old)

    def set_workers(self, workers: int) -> None:
        """Run later steps' micro-batches on ``workers`` threads (between steps only). The
        pool is rebuilt lazily at the next threaded step; ValueError if ``workers`` < 1."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if workers != self.workers:
            self.close()
            self.workers = workers

    def close(self) -> None:
        """Stop the micro-batch worker pool (if any); the engine stays usable (a later
        threaded step starts a new pool)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def task_losses(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor,
                    mask: torch.Tensor, chunk_slot: torch.Tensor, single: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-slot mean next-token loss (S,) (0 where a slot has no token) and token counts (S,),
        in one forward over every chunk given."""
        sums, counts = self.slot_loss_sums(tokens, targets, positions, mask, chunk_slot, single)
        return sums / counts.clamp(min=1).to(sums.dtype), counts

    def attention_layout(self, p, mb: tuple[list[int], int], mask: torch.Tensor | None = None):
        """What the blocks attend with for micro-batch ``mb`` = (chunk indices, width) of
        packed step ``p``: a :class:`varlen.SegmentLayout` (sequence by sequence, no mask)
        when ``self.varlen`` and the packing carries segment ids, else the block-causal
        mask (``mask``: ``p.mask`` already on the device, to avoid a copy per call)."""
        idx, w = mb
        if self.varlen and p.seg is not None:
            return SegmentLayout(p.seg[torch.tensor(idx), :w], self.device)
        full = p.mask if mask is None else mask
        return full[torch.tensor(idx, device=full.device), :w, :w]

    def slot_loss_sums(self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor,
                       mask, chunk_slot: torch.Tensor, single: int | None = None,
                       slots: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-slot SUM of next-token losses (S,) and token counts (S,) of these chunks. The
        head (and the cross-entropy) run only on positions with a target. ``mask``: the
        block-causal bool mask (N, T, T) or a :class:`varlen.SegmentLayout`. ``slots``
        (optional, host): the slot of each chunk — lets untargeted adapters be skipped
        and a one-task micro-batch take the plain (ungathered) adapter path."""
        m = self.model
        distinct = tuple(sorted(set(slots))) if slots is not None else None
        if single is None and distinct is not None and len(distinct) == 1:
            single = distinct[0]
        self.ctx.chunk_slot, self.ctx.single, self.ctx.slots = chunk_slot, single, distinct
        try:
            x = m.embed(tokens, positions)
            for blk in m.blocks:
                x = blk(x, mask)
        finally:
            self.ctx.chunk_slot = self.ctx.single = self.ctx.slots = None
        flat_t = targets.reshape(-1)
        valid = flat_t != -100
        h = m.ln_f(x.reshape(-1, x.shape[-1])[valid])
        tok_loss = F.cross_entropy(m.head(h), flat_t[valid], reduction="none")
        slot_of = chunk_slot[:, None].expand_as(targets).reshape(-1)[valid]
        s = self._slots()
        sums = torch.zeros(s, device=tokens.device, dtype=tok_loss.dtype).index_add(0, slot_of, tok_loss)
        return sums, torch.bincount(slot_of, minlength=s)

    @torch.no_grad()
    def forward_task(self, name_or_slot: str | int, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of plain causal ``tokens`` (B, T) through one slot's adapter (inference).
        By name: only a running task (KeyError if unknown; ValueError if it ended, since
        its slot is freed and may hold another task's adapter: apply its
        ``final_adapter`` with :func:`merge_adapter` instead)."""
        if isinstance(name_or_slot, str):
            t = self.tasks[name_or_slot]
            if t.status != "running":
                raise ValueError(f"task {name_or_slot!r} is not running ({t.status}): its slot is freed; "
                                 f"use merge_adapter(GPT(cfg), its final_adapter)")
            slot = t.slot
        else:
            slot = name_or_slot
        self.ctx.single = slot
        try:
            return self.model(tokens.to(self.device))
        finally:
            self.ctx.single = None

    # -- adapters and task checkpoints ------------------------------------------------
    def adapter(self, t: TaskState) -> dict:
        """The task's adapter only (targeted modules' rank-r factors, CPU tensors)."""
        r = t.spec["rank"]
        weights = {}
        for full, bank in self.banks.items():
            if lora.short_name(full) in t.spec["target_modules"]:
                a, b = bank.get_slot(t.slot, r)
                weights[full] = {"A": a.cpu(), "B": b.cpu()}
        return {"format": ADAPTER_FORMAT, "name": t.name, "rank": r, "alpha": t.spec["alpha"],
                "target_modules": list(t.spec["target_modules"]), "model_config": self.cfg.to_dict(),
                "step": t.step, "weights": weights}

    def task_state(self, t: TaskState) -> dict:
        """Adapter + optimizer moments + step (+ its first and latest loss): enough to resume
        the task alone."""
        st = self.opt.slot_state(t.slot)
        r = t.spec["rank"]
        keep = set(self.adapter(t)["weights"])
        moments = {}
        for n, m in st["moments"].items():
            if n in keep:
                moments[n] = {k: (v[:, :r] if k.startswith("A") else v[:r, :]).cpu() for k, v in m.items()}
        return {"adapter": self.adapter(t), "optim": {"step": st["step"], "lr": st["lr"], "moments": moments},
                "tokens": t.tokens, "first_loss": t.first_loss, "loss": t.loss}

    def restore(self, t: TaskState, state: dict) -> None:
        """Load :meth:`task_state` output into a running task (same spec). A task whose
        saved step is already >= its steps (its spec asks for fewer steps now) ends at
        once, succeeded, with that adapter as its final one: it trains no further step."""
        apply_adapter_to_slot(self, t.slot, state["adapter"])
        opt = state["optim"]
        full = {n: {k: v.to(self.device) for k, v in m.items()} for n, m in opt["moments"].items()}
        for n in self.banks:
            full.setdefault(n, {})
        self.opt.steps[t.slot] = opt["step"]
        self.opt.lr[t.slot] = opt["lr"]
        for n, st in self.opt.state.items():
            for k, tensor in st.items():
                tensor[t.slot].zero_()
                if k in full[n]:
                    src = full[n][k]
                    tensor[t.slot][tuple(slice(0, d) for d in src.shape)] = src
        t.step = int(state["adapter"]["step"])
        t.tokens = t.tokens_at_add = int(state.get("tokens", 0))
        t.first_loss = float(state.get("first_loss", float("nan")))
        # Its latest loss, until it trains here: a task cancelled (or ended) before its first
        # step in this executor reports that, not NaN.
        t.loss = float(state.get("loss", float("nan")))
        if t.step >= t.steps:
            t.final_adapter = self.adapter(t)
            self._end(t, "succeeded")


def micro_batches(fills: list[int], per_batch: int, max_pad_fraction: float = 0.05) -> list[tuple[list[int], int]]:
    """``(chunk indices, width)`` per micro-batch of at most ``per_batch`` chunks: chunks
    sorted by fill (real tokens; a chunk's pads are its trailing columns), fullest first,
    so that chunks of similar fill share a micro-batch; ``width`` is its fullest chunk's
    fill (the columns worth computing). A chunk joins the micro-batch before it only
    while the pad columns computed stay at most ``max_pad_fraction`` of the micro-batch
    (``width x chunks``); otherwise it starts the next one (fewer chunks per micro-batch,
    no padding computed: full chunks still fuse, a half-filled one is not padded to a
    full one's width; 1.0 groups by count alone). Every index appears exactly once."""
    if not 0.0 <= max_pad_fraction <= 1.0:
        raise ValueError(f"max_pad_fraction must be in [0, 1], got {max_pad_fraction}")
    order = sorted(range(len(fills)), key=lambda i: (-fills[i], i))
    out: list[tuple[list[int], int]] = []
    cur: list[int] = []
    real = 0
    for i in order:
        if cur:
            width, n = fills[cur[0]], len(cur) + 1
            if len(cur) == per_batch or width * n - (real + fills[i]) > max_pad_fraction * width * n:
                out.append((cur, fills[cur[0]]))
                cur, real = [], 0
        cur.append(i)
        real += fills[i]
    if cur:
        out.append((cur, fills[cur[0]]))
    return out


def apply_adapter_to_slot(engine: MuxEngine, slot: int, adapter: dict) -> None:
    """Write a saved adapter into one slot of the engine's banks (others untouched)."""
    scale = adapter["alpha"] / adapter["rank"]
    if adapter["rank"] > next(iter(engine.banks.values())).rank:
        for bank in engine.banks.values():
            bank.resize(bank.slots, adapter["rank"])
        engine.opt.resize(engine._slots())
    for full, bank in engine.banks.items():
        w = adapter["weights"].get(full)
        if w is None:
            bank.set_slot(slot, None, None, 0.0)
        else:
            bank.set_slot(slot, w["A"].to(bank.A.device), w["B"].to(bank.B.device), scale)


@torch.no_grad()
def merge_adapter(model: GPT, adapter: dict) -> GPT:
    """Fold a saved adapter into a plain (un-injected) GPT in place: W += alpha/r * (A B)^T.
    The merged model then computes what the task computed during training."""
    scale = adapter["alpha"] / adapter["rank"]
    if adapter["model_config"] != model.cfg.to_dict():
        raise ValueError(f"adapter was trained on {adapter['model_config']}, model is {model.cfg.to_dict()}")
    for full, w in adapter["weights"].items():
        lin = model.get_submodule(full)
        lin.weight += (scale * (w["A"] @ w["B"])).T.to(lin.weight.device, lin.weight.dtype)
    return model

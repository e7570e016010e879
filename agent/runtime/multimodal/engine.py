"""Single-process training steps: plain, temporal and colocated (after Mosaic).

Contract: every step function takes the same samples and leaves the model and optimizer
in the state a plain step (whole batch, one forward, one backward) would, up to float
rounding: micro-batch losses are normalised by the whole batch's target count, and the
encoder's backward is driven by exactly the gradient the LLM produced for its outputs.

- ``plain_step``: the reference.
- temporal (``ColocatedEngine(..., concurrent=False)``): per micro-batch, encoder forward,
  LLM forward+backward, encoder backward, one after another, each using the whole device.
- colocated (``concurrent=True``): the encoder and the LLM each run on their own worker
  thread with their own quota (CPU: a disjoint core set + intra-op thread budget; CUDA: a
  stream each, the larger-quota module at high priority — one process cannot give its
  streams hard SM shares; those are per process, MPS, see agent/partitions), pipelined
  across micro-batches:
  the encoder runs forward of micro-batch j+1 (and backward of j-1) while the LLM trains
  on j. The optimizer steps once all micro-batches are done (synchronous, no staleness).
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from agent.runtime.multimodal.data import Sample
from agent.runtime.multimodal.models import MMModel, n_targets
from agent.runtime.multimodal.reorder import balanced_bins, chunk_sizes
from agent.runtime.optim import all_finite


@dataclass
class StepStats:
    """Loss of the step and seconds per (module, phase); ``idle`` is time a module's
    worker waited on the other module. ``world``: the same phases summed over every rank
    of a distributed step (empty for a single-process step)."""

    loss: float
    wall_s: float
    modules: dict[str, dict[str, float]] = field(default_factory=dict)
    world: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, module: str, phase: str, seconds: float) -> None:
        m = self.modules.setdefault(module, {})
        m[phase] = m.get(phase, 0.0) + seconds


def plain_step(model: MMModel, opt: torch.optim.Optimizer, samples: list[Sample]) -> StepStats:
    """Reference step: whole batch in one forward and one backward. Returns the mean loss."""
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = model.llm_loss(samples, model.encode(samples), float(n_targets(samples)))
    loss.backward()
    opt.step()
    return StepStats(float(loss.detach()), time.perf_counter() - t0)


def check_finite(loss: float, params) -> None:
    """Raise ``FloatingPointError`` when ``loss`` or a gradient of ``params`` is not finite.
    Called before ``opt.step``, so a diverged step never reaches the weights (as the gpt
    workload): the model and its last checkpoint stay finite."""
    if not math.isfinite(loss):
        raise FloatingPointError(f"loss is {loss}")
    if not all_finite(p.grad for p in params):
        raise FloatingPointError(f"gradients are not finite (loss {loss})")


def split_micro(samples: list[Sample], micro_batches: int, media_cost: float = 4.0) -> list[list[Sample]]:
    """Equal-count micro-batches with balanced encoder (media) and LLM (token) load, so the
    pipeline's stages stay even; empty micro-batches are dropped."""
    m = min(micro_batches, len(samples))
    enc = [media_cost * (s.meta.n_images + s.meta.n_audio) for s in samples]
    llm = [float(s.meta.text_len + s.meta.n_images + s.meta.n_audio) for s in samples]
    return [[samples[i] for i in b] for b in balanced_bins(enc, llm, chunk_sizes(len(samples), m)) if b]


def split_cpus(cpus: list[int], encoder_quota: float) -> tuple[list[int], list[int]]:
    """Disjoint (encoder, LLM) core sets with the encoder's share rounded, each non-empty;
    on a single core both modules share it (time-sliced by the OS)."""
    if len(cpus) < 2:
        return list(cpus), list(cpus)
    k = min(max(round(encoder_quota * len(cpus)), 1), len(cpus) - 1)
    return cpus[:k], cpus[k:]


class _Quota:
    """One module's worker: a single thread pinned to its cores with its own intra-op
    thread budget (OpenMP's thread count is per calling thread, so the two budgets do
    not fight), or on CUDA its own stream."""

    def __init__(self, name: str, cpus: list[int], device: torch.device, priority: int = 0, pin: bool = True) -> None:
        self.name, self.cpus, self.device, self.pin = name, cpus, device, pin
        self.stream = torch.cuda.Stream(device=device, priority=priority) if device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mm-{name}", initializer=self._init)

    def _init(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        if self.device.type == "cpu" and self.cpus:
            if self.pin and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, self.cpus)  # pid 0 = this thread on Linux
            torch.set_num_threads(len(self.cpus))

    def repin(self, cpus: list[int]) -> None:
        """Move this worker to ``cpus`` (run on the worker thread itself: thread affinity
        and the intra-op budget are per thread). Waits until applied."""
        self.cpus = list(cpus)
        self.pool.submit(self._init).result()

    def submit(self, fn, *args) -> Future:
        def run():
            if self.stream is None:
                return fn(*args)
            with torch.cuda.stream(self.stream):
                return fn(*args)

        return self.pool.submit(run)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class ColocatedEngine:
    """Runs steps with the encoder and the LLM on separate quotas (see module doc).

    ``encoder_quota`` is the encoder's share of the device (cores on CPU). On CPU the
    quota is hard with ``pin=True`` (each worker pinned to its core set: isolation when
    the executor owns its cores) or soft with ``pin=False`` (only the thread budgets
    split; the OS places the threads, which copes better when other processes share
    the cores). With ``concurrent=False`` the same micro-batch schedule runs serially on
    the calling thread with every core: the temporal baseline.
    """

    def __init__(
        self,
        model: MMModel,
        opt: torch.optim.Optimizer,
        encoder_quota: float = 0.5,
        micro_batches: int = 4,
        concurrent: bool = True,
        cpus: list[int] | None = None,
        pin: bool = True,
    ) -> None:
        self.model, self.opt, self.micro_batches, self.concurrent = model, opt, micro_batches, concurrent
        self.encoder_quota = encoder_quota
        self.device = model.gpt.head.weight.device
        cpus = sorted(cpus if cpus is not None else (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)))
        self.cpus = cpus
        self.enc_cpus, self.llm_cpus = split_cpus(cpus, encoder_quota)
        self.enc = self.llm = None
        if concurrent:
            hi, lo = -1, 0  # CUDA: lower number = higher priority
            self.enc = _Quota("encoder", self.enc_cpus, self.device, hi if encoder_quota >= 0.5 else lo, pin)
            self.llm = _Quota("llm", self.llm_cpus, self.device, lo if encoder_quota >= 0.5 else hi, pin)

    def follow_grant(self, cpus: list[int] | None = None) -> tuple[list[int], list[int]] | None:
        """Re-split the cores after the agent changed the executor's grant in place.

        ``UpdateGrant`` re-pins every thread of the process to the new core set (the
        module workers included), which would leave both modules sharing every core.
        Called at a step boundary with the calling thread's allowed cores (the new grant;
        ``cpus`` for tests): when the set changed, the encoder and LLM workers get a new
        disjoint split with the same ``encoder_quota`` (:func:`split_cpus`), each pinned
        and with its intra-op budget resized on its own thread. Returns the new
        (encoder, LLM) cores, or None when nothing changed (or not concurrent / on
        CUDA, where the quota is not a core set)."""
        if self.device.type != "cpu":
            return None
        if cpus is None:
            if not hasattr(os, "sched_getaffinity"):
                return None
            cpus = os.sched_getaffinity(0)
        now = sorted(cpus)
        if not now or now == self.cpus:
            return None
        self.cpus = now
        self.enc_cpus, self.llm_cpus = split_cpus(now, self.encoder_quota)
        if self.enc is not None and self.llm is not None:
            self.enc.repin(self.enc_cpus)
            self.llm.repin(self.llm_cpus)
        return self.enc_cpus, self.llm_cpus

    def close(self) -> None:
        for q in (self.enc, self.llm):
            if q is not None:
                q.close()

    def __enter__(self) -> "ColocatedEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Stage bodies. Each returns what the next stage needs plus its own timings; an
    # ``event`` orders work across CUDA streams (None on CPU, where futures suffice).
    def _enc_fwd(self, mb: list[Sample]):
        t0 = time.perf_counter()
        embs = self.model.encode(mb)
        leaves = [e.detach().requires_grad_(e.numel() > 0) for e in embs]
        ev = self._record()
        return embs, leaves, ev, time.perf_counter() - t0

    def _llm(self, mb: list[Sample], fwd: Future | tuple, norm: float):
        t0 = time.perf_counter()
        embs, leaves, ev, _ = fwd.result() if isinstance(fwd, Future) else fwd
        t1 = time.perf_counter()
        self._wait(ev)
        loss = self.model.llm_loss(mb, leaves, norm)
        t2 = time.perf_counter()
        loss.backward()
        grads = [lf.grad if lf.requires_grad else None for lf in leaves]
        ev2 = self._record()
        val = loss.detach()  # read after the step: float() here would stall this stream's worker
        # (loss, grads, event, idle, forward, backward)
        return val, grads, ev2, t1 - t0, t2 - t1, time.perf_counter() - t2

    def _enc_bwd(self, fwd: Future | tuple, llm: Future | tuple):
        t0 = time.perf_counter()
        embs = (fwd.result() if isinstance(fwd, Future) else fwd)[0]
        _, grads, ev, _, _, _ = llm.result() if isinstance(llm, Future) else llm
        t1 = time.perf_counter()
        self._wait(ev)
        outs = [e for e, g in zip(embs, grads) if g is not None]
        if outs:
            torch.autograd.backward(outs, [g for g in grads if g is not None])
        self._record()
        return t1 - t0, time.perf_counter() - t1

    def _record(self):
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _wait(self, ev) -> None:
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)

    def step(self, samples: list[Sample]) -> StepStats:
        """One optimizer step over ``samples``; see the class doc for the schedule."""
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        norm = float(n_targets(samples))
        mbs = split_micro(samples, self.micro_batches)
        stats = StepStats(0.0, 0.0)
        losses: list[torch.Tensor] = []
        if not self.concurrent:
            for mb in mbs:
                f = self._enc_fwd(mb)
                l_ = self._llm(mb, f, norm)
                b = self._enc_bwd(f, l_)
                losses.append(l_[0])
                stats.add("encoder", "forward", f[3])
                stats.add("llm", "forward", l_[4])
                stats.add("llm", "backward", l_[5])
                stats.add("encoder", "backward", b[1])
        else:
            # Queue order on the encoder worker: F0, F1, B0, F2, B1, ... so that while the LLM
            # trains on j the encoder is busy with F(j+1) and then B(j-1)... B(j).
            fwd: list[Future] = []
            llm: list[Future] = []
            bwd: list[Future] = []
            fwd.append(self.enc.submit(self._enc_fwd, mbs[0]))
            for j, mb in enumerate(mbs):
                llm.append(self.llm.submit(self._llm, mb, fwd[j], norm))
                if j + 1 < len(mbs):
                    fwd.append(self.enc.submit(self._enc_fwd, mbs[j + 1]))
                bwd.append(self.enc.submit(self._enc_bwd, fwd[j], llm[j]))
            for f, l_, b in zip(fwd, llm, bwd):
                fr, lr, br = f.result(), l_.result(), b.result()
                losses.append(lr[0])
                stats.add("encoder", "forward", fr[3])
                stats.add("encoder", "backward", br[1])
                stats.add("encoder", "idle", br[0])
                stats.add("llm", "forward", lr[4])
                stats.add("llm", "backward", lr[5])
                stats.add("llm", "idle", lr[3])
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        stats.loss = sum(float(v) for v in losses)
        check_finite(stats.loss, self.model.parameters())  # before the update: weights stay finite
        t1 = time.perf_counter()
        if self.llm is not None:
            # On a quota'd worker, not the caller: the caller's intra-op pool may be the
            # whole machine, and its threads would land on the modules' cores.
            self.llm.submit(self.opt.step).result()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # next step's encoder stream reads these weights
        else:
            self.opt.step()
        stats.add("optimizer", "step", time.perf_counter() - t1)
        stats.wall_s = time.perf_counter() - t0
        return stats


__all__ = ["ColocatedEngine", "StepStats", "check_finite", "plain_step", "split_micro", "split_cpus", "threading"]

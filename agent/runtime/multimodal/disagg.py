"""Disaggregated encoder/LLM ranks over torch.distributed (after MegaScale-Omni).

Contract: ``DistEngine.step(batch_ids, plan)`` runs one synchronous optimizer step of the
whole job's batch on this rank, following ``plan`` (``reshard.StepPlan``): encoder ranks
encode the media of the samples the plan gives them and send each LLM rank exactly the
embeddings of the samples it trains on (point-to-point, gloo/NCCL); LLM ranks train and
send the embedding gradients back; the encoder ranks backpropagate them. Micro-batches
pipeline: encoder forward of j+1 is issued before the LLM works on j.

Every rank keeps a full replica of model and optimizer and all gradients are summed over
the world once per step, so (1) the encoder:LLM split can change between steps without
moving weights, and (2) the result equals a plain single-process step on the whole batch
(losses are normalised by the batch's target count) up to float rounding. A parameter
no rank produced a gradient for (a module nothing in the batch used) keeps ``grad = None``
as in a plain step, so the optimizer leaves it alone (no weight decay, no momentum). The coupled
layout (``reshard.coupled_plan``) runs through the same code with every transfer local.

``owned=True`` is the colocated form (after Mosaic: encoder and LLM as two processes on
one device, each on its own quota): the layout is disjoint and fixed for the engine's
life, so each module's gradients come from exactly one rank, which alone updates it —
no gradient all-reduce, only the embeddings, their gradients and a small all-reduce of
the loss, the "had a gradient" flags and a finiteness flag per step. A replica's copy of
a module another rank owns goes stale, unused; a parameter that got gradients on two
ranks, or a layout that changes or shares a rank, is an error (never a silent wrong
update). The losses still equal a plain step's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from agent.runtime.multimodal.data import SampleMeta, SyntheticData
from agent.runtime.multimodal.engine import StepStats, check_finite
from agent.runtime.multimodal.models import MMModel, n_targets
from agent.runtime.multimodal.reshard import Item, StepPlan
from agent.runtime.optim import all_finite
from tessera.gloo import calm_loop_threads


@dataclass
class CostModel:
    """Seconds (or any one unit) per encoder unit (an image; audio clips weighted by
    ``audio_weight``) and per LLM token. Starts from FLOP ratios, then follows measured
    times (identical on every rank: they come from an all-reduce)."""

    enc_unit: float
    llm_token: float
    audio_weight: float = 1.0
    ema: float = 0.5

    @classmethod
    def from_flops(cls, model: MMModel) -> "CostModel":
        vit = model.vit
        enc_params = sum(p.numel() for p in vit.blocks.parameters())
        img = 6.0 * enc_params * vit.n_patches
        aud = 0.0
        if model.audio is not None:
            aud = 6.0 * sum(p.numel() for p in model.audio.blocks.parameters()) * model.audio.frames
        llm = 6.0 * sum(p.numel() for p in model.gpt.parameters())
        return cls(enc_unit=img, llm_token=llm, audio_weight=(aud / img) if img else 1.0)

    def enc_units(self, m: SampleMeta) -> float:
        return m.n_images + self.audio_weight * m.n_audio

    def item(self, m: SampleMeta, per_image: int, per_audio: int) -> Item:
        return Item(m.id, self.enc_units(m) * self.enc_unit, (m.text_len + m.media_tokens(per_image, per_audio)) * self.llm_token)

    def observe(self, enc_s: float, enc_units: float, llm_s: float, llm_tokens: float, first: bool) -> None:
        """Fold in one step's measured totals (skipped where a side did no work)."""
        a = 1.0 if first else self.ema
        if enc_units > 0 and enc_s > 0:
            self.enc_unit = (1 - a) * self.enc_unit + a * enc_s / enc_units
        if llm_tokens > 0 and llm_s > 0:
            self.llm_token = (1 - a) * self.llm_token + a * llm_s / llm_tokens


def init_from_spec(dist_spec: dict, timeout_s: float = 120.0) -> None:
    """Join the job's process group (no-op for a single rank or if already joined)."""
    import datetime

    if dist_spec.get("world_size", 1) <= 1 or dist.is_initialized():
        return
    dist.init_process_group(
        backend=dist_spec.get("backend", "gloo"),
        init_method=f"tcp://{dist_spec['master_addr']}:{dist_spec['master_port']}",
        rank=dist_spec["rank"],
        world_size=dist_spec["world_size"],
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    calm_loop_threads()


# Per-module phases every rank adds into the step's all-reduce, so rank 0 (the only
# rank that reports) can report the whole job's encoder and LLM time and idle time.
_WORLD_PHASES = [(m, p) for m in ("encoder", "llm") for p in ("forward", "backward", "communication", "idle")]


class DistEngine:
    """One rank's side of disaggregated (or coupled) multimodal training.

    CUDA tensors over a gloo group (several ranks sharing one GPU, where NCCL refuses)
    are staged through host memory; over NCCL they go device to device."""

    def __init__(self, model: MMModel, opt: torch.optim.Optimizer, data: SyntheticData, rank: int, world: int,
                 owned: bool = False) -> None:
        self.model, self.opt, self.data, self.rank, self.world = model, opt, data, rank, world
        self.owned = owned
        self._layout = None  # owned: the one layout of the engine's life
        self.hidden = model.gpt.cfg.hidden
        self.params = list(model.parameters())
        self.sent: list[tuple[int, int, list[int]]] = []  # (mb, dst, ids) of the last step, for tests
        self.device = model.gpt.head.weight.device
        self.stage = (self.device.type == "cuda" and world > 1 and dist.is_initialized()
                      and dist.get_backend() == "gloo")

    def _sync(self) -> None:
        # Timings feed the cost model: on CUDA they must include the queued kernels.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _isend(self, t: torch.Tensor, dst: int, tag: int):
        t = t.detach().contiguous()
        if self.stage:
            t = t.cpu()
        return dist.isend(t, dst, tag=tag), t  # keep the buffer alive until waited on

    def _recv(self, shape: tuple[int, ...], src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, device="cpu" if self.stage else self.device)
        dist.irecv(buf, src, tag=tag).wait()
        return buf.to(self.device) if self.stage else buf

    def _all_reduce(self, buf: torch.Tensor) -> torch.Tensor:
        """Sum ``buf`` over the world (staged through host memory for CUDA over gloo);
        returns the reduced tensor on ``buf``'s device (``buf`` itself unless staged)."""
        if self.world > 1:
            if self.stage:
                host = buf.cpu()
                dist.all_reduce(host)
                return host.to(buf.device)
            dist.all_reduce(buf)
        return buf

    def _len(self, m: SampleMeta) -> int:
        return m.media_tokens(self.data.per_image, self.data.per_audio)

    def step(self, batch_ids: list[int], plan: StepPlan, cost: CostModel | None = None) -> StepStats:
        """One synchronous step of the global batch ``batch_ids`` under ``plan``; every rank
        calls it with the same arguments. Returns the global mean loss, this rank's
        per-module timings in ``stats.modules`` (``enc_units``/``llm_tokens`` totals are in
        ``stats.modules['work']``) and the same phases summed over every rank in
        ``stats.world`` (``idle``: time a module waited to receive from the other)."""
        t_start = time.perf_counter()
        r, dev = self.rank, self.device
        if self.owned:
            lay = plan.layout
            if set(lay.enc_ranks) & set(lay.llm_ranks):
                raise ValueError(f"owned modules need a disjoint layout, got enc {lay.enc_ranks} llm {lay.llm_ranks}")
            if self._layout is None:
                self._layout = lay
            elif lay != self._layout:
                raise ValueError(f"owned modules need one fixed layout: {self._layout} then {lay}")
        self.opt.zero_grad(set_to_none=True)
        metas = {i: self.data.meta(i) for i in batch_ids}
        norm = float(sum(m.text_len - (0 if (m.n_images or m.n_audio) else 1) for m in metas.values()))
        cache: dict[int, object] = {}

        def sample(i):
            if i not in cache:
                cache[i] = self.data.sample(i)
            return cache[i]

        stats = StepStats(0.0, 0.0)
        pending: list = []  # async sends to wait on before the step ends
        enc_out: dict[int, dict[int, tuple[list[int], torch.Tensor]]] = {}
        local: dict[int, torch.Tensor] = {}  # mb -> local hand-over leaf (src == dst == r)
        local_grad: dict[int, torch.Tensor | None] = {}
        self.sent = []
        loss_sum = 0.0
        work = {"enc_units": 0.0, "llm_tokens": 0.0, "enc_s": 0.0, "llm_s": 0.0}
        M = len(plan.micro)

        def tag(j: int, backward: bool) -> int:
            return 2 * j + (1 if backward else 0)

        def enc_forward(j: int) -> None:
            mp = plan.micro[j]
            mine = [s for s in mp.ids if mp.enc_owner.get(s) == r]
            if not mine:
                return
            t0 = time.perf_counter()
            embs = dict(zip(mine, self.model.encode([sample(s) for s in mine])))
            self._sync()
            enc_out[j] = {}
            for (src, dst), ids in sorted(mp.transfers().items()):
                if src != r:
                    continue
                out = torch.cat([embs[s] for s in ids])
                enc_out[j][dst] = (ids, out)
                if dst == r:
                    local[j] = out.detach().requires_grad_()
                else:
                    t1 = time.perf_counter()
                    pending.append(self._isend(out, dst, tag(j, False)))
                    stats.add("encoder", "communication", time.perf_counter() - t1)
                    self.sent.append((j, dst, list(ids)))
            dt = time.perf_counter() - t0
            stats.add("encoder", "forward", dt)
            work["enc_s"] += dt
            work["enc_units"] += sum(cost.enc_units(metas[s]) if cost else metas[s].n_images for s in mine)

        def llm(j: int) -> float:
            mp = plan.micro[j]
            mine = [s for s in mp.ids if mp.llm_owner[s] == r]
            if not mine:
                return 0.0
            leaves: dict[int, torch.Tensor] = {}
            wait = 0.0
            for (src, dst), ids in sorted(mp.transfers().items()):
                if dst != r:
                    continue
                if src == r:
                    leaves[src] = local[j]
                else:
                    t1 = time.perf_counter()
                    buf = self._recv((sum(self._len(metas[s]) for s in ids), self.hidden), src, tag(j, False))
                    wait += time.perf_counter() - t1
                    leaves[src] = buf.requires_grad_()
            t0 = time.perf_counter()
            per_sample: dict[int, torch.Tensor] = {}
            for (src, dst), ids in sorted(mp.transfers().items()):
                if dst == r:
                    for s, e in zip(ids, leaves[src].split([self._len(metas[s]) for s in ids])):
                        per_sample[s] = e
            samples = [sample(s) for s in mine]
            embs = [per_sample.get(s, torch.zeros(0, self.hidden, device=dev)) for s in mine]
            loss = self.model.llm_loss(samples, embs, norm)
            tf = time.perf_counter()
            loss.backward()
            self._sync()
            dt = time.perf_counter() - t0
            stats.add("llm", "forward", tf - t0)
            stats.add("llm", "backward", dt - (tf - t0))
            stats.add("llm", "idle", wait)
            work["llm_s"] += dt
            work["llm_tokens"] += sum(metas[s].text_len + self._len(metas[s]) for s in mine)
            t1 = time.perf_counter()
            for src, leaf in leaves.items():
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                if src == r:
                    local_grad[j] = g
                else:
                    pending.append(self._isend(g, src, tag(j, True)))
            stats.add("llm", "communication", time.perf_counter() - t1)
            return float(loss.detach())

        def enc_backward(j: int) -> None:
            if j not in enc_out:
                return
            outs, grads = [], []
            wait = 0.0
            for dst, (ids, out) in sorted(enc_out[j].items()):
                if dst == r:
                    g = local_grad[j]
                else:
                    t1 = time.perf_counter()
                    g = self._recv(tuple(out.shape), dst, tag(j, True))
                    wait += time.perf_counter() - t1
                outs.append(out)
                grads.append(g)
            t0 = time.perf_counter()
            torch.autograd.backward(outs, grads)
            self._sync()
            dt = time.perf_counter() - t0
            stats.add("encoder", "backward", dt)
            stats.add("encoder", "idle", wait)
            work["enc_s"] += dt

        # Encoder forward runs one micro-batch ahead of the LLM (a rank holding both roles
        # interleaves them); encoder backward follows once the LLM has sent its gradients.
        if M:
            enc_forward(0)
        for j in range(M):
            if j + 1 < M:
                enc_forward(j + 1)
            loss_sum += llm(j)
        for j in range(M):
            enc_backward(j)
        for w, _buf in pending:
            w.wait()

        # One world all-reduce carries every gradient, a per-parameter "had a gradient"
        # flag, the loss and the cost observations. A parameter no rank produced a
        # gradient for (a module nothing in the batch used) keeps ``grad = None``, so the
        # optimizer skips it (no weight decay, no momentum) as in a plain step.
        t0 = time.perf_counter()
        had = torch.tensor([0.0 if p.grad is None else 1.0 for p in self.params], device=dev)
        mine = [stats.modules.get(m, {}).get(p, 0.0) for m, p in _WORLD_PHASES]
        extras = torch.tensor([loss_sum, work["enc_s"], work["enc_units"], work["llm_s"], work["llm_tokens"], *mine],
                              device=dev)
        if self.owned:
            return self._finish_owned(stats, had, extras, t0, t_start)
        flat = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=dev) for p in self.params]
        buf = torch.cat(flat + [had, extras])
        buf = self._all_reduce(buf)
        off = 0
        n_grad = buf.numel() - had.numel() - extras.numel()
        used = buf[n_grad:n_grad + had.numel()].tolist()
        for p, u in zip(self.params, used):
            n = p.numel()
            p.grad = buf[off:off + n].view_as(p).clone() if u > 0.5 else None
            off += n
        ex = buf[n_grad + had.numel():].tolist()
        stats.add("sync", "communication", time.perf_counter() - t0)
        # Every rank holds the same reduced loss and gradients (a NaN/inf anywhere is in the
        # sum), so every rank takes the same decision here: all fail together, before the
        # update, and no collective is left waiting.
        check_finite(ex[0], [p for p in self.params if p.grad is not None])
        return self._update(stats, ex, t_start)

    def _update(self, stats: StepStats, ex: list[float], t_start: float) -> StepStats:
        """The optimizer step (every rank agreed the step is finite) and the step's
        world-reduced figures ``ex`` (loss, work, phases) into ``stats``."""
        t1 = time.perf_counter()
        self.opt.step()
        stats.add("optimizer", "step", time.perf_counter() - t1)
        stats.loss = ex[0]
        stats.modules["work"] = {"enc_s": ex[1], "enc_units": ex[2], "llm_s": ex[3], "llm_tokens": ex[4]}
        for (m, p), v in zip(_WORLD_PHASES, ex[5:]):
            stats.world.setdefault(m, {})[p] = v
        stats.wall_s = time.perf_counter() - t_start
        return stats

    def _finish_owned(self, stats: StepStats, had: torch.Tensor, extras: torch.Tensor, t0: float,
                      t_start: float) -> StepStats:
        """End of an ``owned`` step: one small all-reduce (had-flags, a local "gradients not
        finite" flag, the extras); every rank raises together on a shared parameter or a
        non-finite value, before any update; then each rank steps the modules it owns."""
        local = [p for p in self.params if p.grad is not None]
        bad = 0.0 if all_finite(p.grad for p in local) else 1.0
        buf = torch.cat([had, torch.tensor([bad], device=had.device), extras])
        buf = self._all_reduce(buf)
        n = had.numel()
        counts, bad_all, ex = buf[:n].tolist(), float(buf[n]), buf[n + 1:].tolist()
        stats.add("sync", "communication", time.perf_counter() - t0)
        shared = [name for (name, _), c in zip(self.model.named_parameters(), counts) if c > 1.5]
        if shared:
            raise RuntimeError(f"owned modules: {shared[:3]} got gradients on {int(max(counts))} ranks")
        check_finite(ex[0], [])
        if bad_all:
            raise FloatingPointError(f"gradients are not finite (loss {ex[0]})")
        return self._update(stats, ex, t_start)


def plan_items(data: SyntheticData, ids: list[int], cost: CostModel) -> list[Item]:
    """Planner view of a batch (ids in loader order)."""
    return [cost.item(data.meta(i), data.per_image, data.per_audio) for i in ids]


__all__ = ["CostModel", "DistEngine", "init_from_spec", "plan_items", "n_targets"]

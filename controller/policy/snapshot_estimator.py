"""The live ``Estimator``: the policy's questions answered from the estimator's model snapshot.

The controller caches the estimator service's snapshot (``controller.profiling``, fetched
over gRPC) and evaluates it locally with ``tessera.perfmodel`` — the same pure code and
numbers the estimator serves. This module is that evaluation in the policy's terms, pure
(no I/O, no clock): build one :class:`SnapshotEstimator` per snapshot version and device
classes, :meth:`~SnapshotEstimator.register` every job's :class:`JobShape` under its
:func:`job_key`, and pass it as ``ScheduleRequest.estimator``.

Contract (``controller.policy.estimator.Estimator`` plus two optional methods the engine
and grid use when present):

- ``iter_time(key, type, n_nodes, per_node)``: seconds per step of the registered job on
  that shape under the plan the controller would run there (:func:`plan_for`, the plan
  ``adapter.replan`` writes), or None when the snapshot cannot answer (no profile or fit
  of that per-rank shape, no communication table for the link) or the estimate does not
  fit in the device's memory. None means "no cell here": the policy never picks a shape
  the snapshot cannot estimate.
- ``knows(key)``: whether the snapshot estimates the job's *requested* count on some
  device type. When it does not, the engine uses the requested shapes only (as with no
  estimator), so a job with too little data is scheduled as asked, never dropped.
- ``stages(key, ...)``: the pipeline degree of that plan (the grid records it; the
  controller's ``replan`` takes it first); 0 for a ``fixed`` shape (no gpt plan).
- A ``peft`` / ``multimodal`` job (``JobShape.fixed``) is answered at its requested
  count only, from its step shape's profiles (``tessera.perfmodel.workload``): its
  remaining work orders it among the others, and it is never resized by an estimate.
- ``describe(key, ...)``: the estimate behind a cell (seconds, confidence, its reason),
  for decision reasons and logs.

Answers are memoised; a new snapshot or new device classes need a new instance (the
policy's grid cache keys on the instance). Registering a new key never changes answers
for other keys, so one instance serves many rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from tessera.perfmodel import Candidate, Estimate, PerfModel

from .estimator import SharingModel


@dataclass(frozen=True)
class JobShape:
    """What the perf model needs of a job: its model, global batch and the plan it asked
    for (``devices`` = its requested rank count). ``fixed``: a ``peft`` / ``multimodal``
    job, whose module is its step shape over exactly ``devices`` ranks
    (``tessera.modelkey.shape_key``): estimated only at that count, from its own profiles
    (those runtimes take no gpt plan, so no other count or plan is composed for them)."""

    module: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    batch: int
    micro_batches: int = 1
    tp: int = 1
    pp: int = 1
    devices: int = 1
    fixed: bool = False


@dataclass(frozen=True)
class DeviceClass:
    """A policy device type as the perf model sees it: ``kind`` ("cpu" | "gpu", the perf
    model's device type), the per-rank ``quota`` one partition gives (cores of a core set;
    1.0 for a whole GPU) and its memory (0 = unknown, not checked)."""

    kind: str
    quota: float
    memory_bytes: float = 0.0


def job_key(s: JobShape) -> str:
    """The policy's model key of a job: module, batch, micro-batches, requested tp/pp and
    count, e.g. ``gpt:l2-h64-a4-s32-v64:b8:m1:t1:p1:n1`` (jobs with one key share a grid)."""
    return f"{s.module}:b{s.batch}:m{s.micro_batches}:t{s.tp}:p{s.pp}:n{s.devices}"


def link_for(device_kind: str, nodes: int) -> str:
    """Link type of a plan's collectives (the names the communication tables use)."""
    if device_kind == "gpu":
        return "nccl-local" if nodes <= 1 else "nccl-net"
    return "loopback-gloo" if nodes <= 1 else "tcp-gloo"


def plan_for(tp0: int, pp0: int, mb0: int, heads: int, hidden: int, layers: int, batch: int, n: int,
             stages: int = 0) -> tuple[int, int, int, int] | None:
    """(dp, tp, pp, micro_batches) for ``n`` ranks close to the asked plan: keep tensor
    and pipeline degrees when they divide ``n`` (pipeline degree ``stages`` first when
    given), else drop them; data parallelism takes the rest. None when nothing fits
    (heads divisible by tp, layers >= pp, batch divisible by dp x micro-batches)."""
    tp0, pp0, mb0 = max(tp0, 1), max(pp0, 1), max(mb0, 1)
    cands: list[tuple[int, int]] = []
    for pp in ([stages] if stages > 0 else []) + [pp0, 1]:
        for tp in (tp0, 1):
            if (tp, pp) not in cands:
                cands.append((tp, pp))
    for tp, pp in cands:
        if n < 1 or n % (tp * pp):
            continue
        dp = n // (tp * pp)
        if heads % tp or (4 * hidden) % tp or layers < pp:
            continue
        for mb in (mb0, 1):
            if batch % (dp * mb) == 0:
                return dp, tp, pp, mb
    return None


class SnapshotEstimator(SharingModel):
    """Estimates from one ``PerfModel`` snapshot for registered jobs (see module doc)."""

    def __init__(self, model: PerfModel, classes: Mapping[str, DeviceClass], interference: float = 0.10,
                 fused_step: float = 0.05) -> None:
        super().__init__(interference, fused_step)
        self.model = model
        self.classes = dict(classes)
        self._jobs: dict[str, JobShape] = {}
        self._memo: dict[tuple, tuple[Estimate | None, int]] = {}

    @property
    def version(self) -> int:
        return self.model.version

    def register(self, key: str, shape: JobShape) -> None:
        """Make ``key`` answerable (idempotent; the same key always names the same shape)."""
        self._jobs.setdefault(key, shape)

    def _eval(self, key: str, gpu_type: str, n_nodes: int, per_node: int) -> tuple[Estimate | None, int]:
        """(estimate or None when not askable, pipeline stages of the plan)."""
        k = (key, gpu_type, n_nodes, per_node)
        got = self._memo.get(k)
        if got is not None:
            return got
        s, cls = self._jobs.get(key), self.classes.get(gpu_type)
        out: tuple[Estimate | None, int] = (None, 0)
        if s is not None and cls is not None and s.fixed:
            if n_nodes >= 1 and per_node >= 1 and n_nodes * per_node == s.devices:
                c = Candidate(device_type=cls.kind, layers=s.layers, hidden=s.hidden, heads=s.heads, vocab=s.vocab,
                              seq_len=s.seq_len, batch=s.batch, micro_batches=s.micro_batches, quota=cls.quota,
                              link=link_for(cls.kind, n_nodes), module=s.module)
                out = (self.model.estimate(c), 0)
        elif s is not None and cls is not None and n_nodes >= 1 and per_node >= 1:
            plan = plan_for(s.tp, s.pp, s.micro_batches, s.heads, s.hidden, s.layers, s.batch, n_nodes * per_node)
            if plan is not None:
                dp, tp, pp, mb = plan
                c = Candidate(device_type=cls.kind, layers=s.layers, hidden=s.hidden, heads=s.heads, vocab=s.vocab,
                              seq_len=s.seq_len, batch=s.batch, dp=dp, tp=tp, pp=pp, micro_batches=mb,
                              quota=cls.quota, link=link_for(cls.kind, n_nodes), module=s.module)
                out = (self.model.estimate(c), pp)
        self._memo[k] = out
        return out

    def describe(self, key: str, gpu_type: str, n_nodes: int, per_node: int) -> Estimate | None:
        """The perf model's estimate behind a cell (ok or insufficient_data), or None when
        the key or type is unknown or no plan fits that count."""
        return self._eval(key, gpu_type, n_nodes, per_node)[0]

    def iter_time(self, model: str, gpu_type: str, n_nodes: int, gpus_per_node: int) -> float | None:
        e, _ = self._eval(model, gpu_type, n_nodes, gpus_per_node)
        if e is None or not e.ok or not e.seconds > 0:
            return None
        mem = self.classes[gpu_type].memory_bytes
        if mem > 0 and e.memory_bytes == e.memory_bytes and e.memory_bytes > mem:
            return None  # out of memory on that device
        return e.seconds

    def stages(self, model: str, gpu_type: str, n_nodes: int, gpus_per_node: int) -> int:
        return self._eval(model, gpu_type, n_nodes, gpus_per_node)[1]

    def knows(self, model: str) -> bool:
        """Whether the snapshot estimates the job's requested count on some device type
        (one node first, else one rank per node)."""
        s = self._jobs.get(model)
        if s is None:
            return False
        n = max(s.devices, 1)
        return any(self.iter_time(model, t, 1, n) is not None or (n > 1 and self.iter_time(model, t, n, 1) is not None)
                   for t in self.classes)

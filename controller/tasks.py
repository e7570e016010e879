"""Per-task jobs of a peft (multi-task LoRA) job: the tasks share one executor, yet each is
visible to its tenant as its own job ``<job id>/<task name>``.

Contract (pure functions over protos; no etcd, gRPC or clock):

* :func:`split_id` tells a task id (``"j-abc/t3"``) from a job id;
* :func:`apply_report` folds an executor ``TASK`` report into the parent's
  ``status.tasks`` (one entry per task, created on its first report). A task never
  leaves a terminal phase, so a late or replayed report (a requeued executor re-announcing
  a finished task) cannot revive or relabel it;
* :func:`task_names` lists the tasks of the parent's spec, :func:`view` builds the task's
  job as a tenant sees it (id, tenant, status; the parent's placement: the executor is
  shared) and :func:`views` all of them in spec order, then tasks added at run time.
  A task not reported yet takes its parent's phase while the parent is not running; a
  non-terminal task of a terminal parent takes the parent's terminal phase.
"""

from __future__ import annotations

from google.protobuf import json_format

from tessera.api.v1 import types_pb2

P = types_pb2.JobPhase
TERMINAL = (P.SUCCEEDED, P.FAILED, P.CANCELLED)
WAITING_TO_RESUME = "waiting to resume"  # the reason of a task whose job was requeued (wait_to_resume)
# The executor's task phases (agent/runtime/peft/workload.py ``task`` event); "failed": the
# task diverged (non-finite loss or gradient) and ended without an adapter.
PHASE_OF = {"running": P.RUNNING, "succeeded": P.SUCCEEDED, "cancelled": P.CANCELLED, "failed": P.FAILED}


def split_id(job_id: str) -> tuple[str, str | None]:
    """``"j-x/t3"`` -> ``("j-x", "t3")``; a plain job id -> ``(job_id, None)``."""
    parent, sep, task = job_id.partition("/")
    return (parent, task) if sep else (job_id, None)


def task_names(job: types_pb2.Job) -> list[str]:
    """Names of the tasks in the job's spec (``workload.peft.tasks[*].name``), in order;
    empty for a job that is not peft."""
    if job.spec.workload.type != "peft" or not job.spec.workload.HasField("peft"):
        return []
    peft = json_format.MessageToDict(job.spec.workload.peft)
    return [str(t.get("name")) for t in peft.get("tasks") or [] if isinstance(t, dict) and t.get("name")]


def find(job: types_pb2.Job, name: str) -> types_pb2.TaskStatus | None:
    for t in job.status.tasks:
        if t.name == name:
            return t
    return None


def apply_report(job: types_pb2.Job, task: str, phase: str, step: int, total_steps: int, loss: float,
                 tokens_per_s: float, now_reason: str = "") -> bool:
    """Fold one task report into ``job.status.tasks``; True when something changed.
    Unknown ``phase`` strings are ignored (False)."""
    new_phase = PHASE_OF.get(phase)
    if not task or new_phase is None:
        return False
    t = find(job, task)
    if t is None:
        t = job.status.tasks.add(name=task, phase=P.PENDING)
    if t.phase in TERMINAL:
        return False
    before = t.SerializeToString(deterministic=True)
    t.phase = new_phase
    t.step = max(t.step, step)
    if total_steps:
        t.total_steps = total_steps
    if loss:
        t.loss = loss
        if not t.first_loss:
            t.first_loss = loss
    if tokens_per_s:
        t.tokens_per_s = tokens_per_s
    if new_phase in TERMINAL:
        t.reason = now_reason or {P.SUCCEEDED: "finished its steps", P.CANCELLED: "cancelled",
                                   P.FAILED: "failed: its loss or gradients became non-finite"}[new_phase]
    elif not t.reason or (new_phase == P.RUNNING and t.reason.startswith(WAITING_TO_RESUME)):
        t.reason = "training on the shared backbone"  # first report, or running again after a requeue
    return t.SerializeToString(deterministic=True) != before


def wait_to_resume(job: types_pb2.Job, why: str) -> None:
    """The job goes back to PENDING (requeue, preemption): every task of its ``status.tasks``
    that has not ended is PENDING again, its reason ``waiting to resume (<why>)``; ended
    tasks keep their outcome. (``apply_report`` clears that reason when the task reports
    running again.)"""
    for t in job.status.tasks:
        if t.phase not in TERMINAL:
            t.phase = P.PENDING
            t.reason = f"{WAITING_TO_RESUME} ({why})"[:500]


def view(job: types_pb2.Job, name: str) -> types_pb2.Job | None:
    """The task ``name`` of ``job`` as a job of its own; None if the job has no such task."""
    t = find(job, name)
    if t is None and name not in task_names(job):
        return None
    out = types_pb2.Job(id=f"{job.id}/{name}", created=job.created, revision=job.revision, parent_id=job.id)
    out.spec.CopyFrom(job.spec)
    out.spec.name = f"{job.spec.name}/{name}"
    st = out.status
    parent = job.status.phase
    if t is None:
        st.phase = parent if parent != P.RUNNING else P.SCHEDULED
        st.reason = f"not started yet (job {job.id} is {P.Name(parent)})"
    else:
        st.phase, st.reason = t.phase, t.reason
        st.step, st.total_steps, st.loss, st.first_loss = t.step, t.total_steps, t.loss, t.first_loss
        if parent in TERMINAL and t.phase not in TERMINAL:
            st.phase = parent
            st.reason = f"job {job.id} ended {P.Name(parent)}: {job.status.reason}"
        st.tasks.add().CopyFrom(t)
    st.placement.extend(job.status.placement)
    st.allocation_id = job.status.allocation_id
    st.attempts = job.status.attempts
    return out


def all_task_names(job: types_pb2.Job) -> list[str]:
    """Every task of ``job``: the spec's tasks in order, then tasks added at run time."""
    names = task_names(job)
    return names + [t.name for t in job.status.tasks if t.name not in names]


def views(job: types_pb2.Job) -> list[types_pb2.Job]:
    """Every task of ``job`` as its own job (``all_task_names`` order)."""
    return [v for v in (view(job, n) for n in all_task_names(job)) if v is not None]

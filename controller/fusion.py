"""LoRA fusion in the live controller: separately submitted ``peft`` jobs on the same frozen
backbone trained by ONE executor (pure helpers; ``core.Controller`` does the etcd writes
and the agent RPCs around them).

The policy (``controller.policy.multiplex``) decides *that* a pending peft job P joins a
shared device whose members are LoRA jobs of P's backbone (placement reason "fused with
LoRA tasks on backbone ..."). The controller then does not launch an executor for P: it
adds P's tasks to the running executor of a *host* job H on that device (agent
``ControlTask`` op "add", appended to the executor's control file, applied at a step
boundary) under names that cannot collide with H's own (:func:`fused_name`:
``<P id>_<task>``), each task checkpointing into P's own checkpoint directory
(``<checkpoint_root>/<P id>/peft/<task>``, exactly where P's own executor would look).

Contract (record fields: ``JobStatus.fused_into`` = H's id; ``allocation_id`` = H's
allocation; ``placement`` = a copy of H's, for display and node-loss detection; P holds
no partition units of its own and is not shown to the policy as a running job: its work
rides on H's grant):

* backbone (:func:`backbone_of`): a peft job's model config (``tessera.modelkey.arch_key``)
  and ``workload.seed`` (the backbone's initialisation); "" for other workloads.
* who fuses (:func:`fusion_problem`, :func:`pick_host`): P and H are peft jobs with the
  same backbone and the same resolved chunk size, H is RUNNING (its executor started),
  not itself a guest, on the partition the placement names, every fused name fits
  the 63-character task-name limit, and the executor would carry at most
  ``MAX_TASKS`` (256) unfinished tasks with P's added (:func:`executor_load`: H's own
  and every active guest's, plus the tasks fused into it earlier in the same reconcile
  round, which the round's snapshot of the jobs does not show; the cap a single job's spec
  has, now per executor, whose memory and step time grow with its tasks). Otherwise the placement is carried out as before
  (P's own executor, packed on the shared partition).
* routing (:func:`split_fused`): a TASK report of H's executor whose task name is
  ``<P id>_<task>`` goes to P's ``status.tasks`` as ``<task>`` when P is fused into that
  allocation; otherwise it is a stray (P moved on): ignored, and cancelled in the executor
  when still running. H's own tasks never see guest names.
* guest lifecycle (:func:`guest_outcome`): P turns RUNNING on its first routed report and
  SUCCEEDED when every one of its tasks has ended (succeeded or cancelled, as a plain peft
  job whose executor exits 0). ``cancel P`` cancels its tasks in H's executor and makes P
  CANCELLED at once; H's other tasks are untouched.
* host lifecycle: H stays RUNNING while its executor runs, also after its own tasks ended
  ("serving fused tasks of ..." in its reason, :func:`host_reason`); it SUCCEEDS when the
  executor exits 0 after the last task, its own or a guest's. Its allocation (units) is
  held until then: the executor is still using it.
* orphans (:func:`orphans`): a guest whose host is gone (cancelled, failed, preempted,
  resized, requeued after node loss, succeeded while a guest task had not ended) or runs
  under another allocation, or whose tasks never reported within ``grace_s`` of the fuse,
  goes back to PENDING, counted as a preemption (not a failure); it resumes from its
  tasks' ``state.pt`` (ended tasks are not rerun: ``adapter.pt`` if succeeded, ``outcome.json`` if cancelled).
"""

from __future__ import annotations

import re

from tessera import manifest
from tessera.api.v1 import types_pb2
from tessera.modelkey import arch_key
from tessera.spec.peft import MAX_TASKS, validate_peft

from . import tasks as peft_tasks
from .records import is_profile_job

P = types_pb2.JobPhase
ACTIVE = (P.SCHEDULED, P.RUNNING)
TERMINAL = (P.SUCCEEDED, P.FAILED, P.CANCELLED)
FUSED_REASON = "fused with LoRA tasks on backbone"
_FUSED_RE = re.compile(r"^(j-[0-9a-f]{12})_([a-z0-9](?:[-_a-z0-9]*[a-z0-9])?)$")
MAX_TASK_NAME = 63


def backbone_of(job: types_pb2.Job) -> str:
    """The frozen backbone a peft job trains on: ``<arch key>/seed<seed>``; "" otherwise."""
    w = job.spec.workload
    m = w.model
    if w.type != "peft" or min(m.layers, m.hidden, m.heads, m.vocab, m.seq_len) <= 0:
        return ""
    key = arch_key({"type": "gpt", "model": {"layers": m.layers, "hidden": m.hidden, "heads": m.heads,
                                             "seq_len": m.seq_len, "vocab": m.vocab}})
    return f"{key}/seed{w.seed}"


def fused_name(job_id: str, task: str) -> str:
    """The name of ``job_id``'s task inside a host's executor."""
    return f"{job_id}_{task}"


def split_fused(name: str) -> tuple[str, str] | None:
    """``"j-0123456789ab_t0"`` -> ``("j-0123456789ab", "t0")``; None for a plain task name."""
    m = _FUSED_RE.fullmatch(name)  # fullmatch: "$" would accept a trailing "\n"
    return (m.group(1), m.group(2)) if m else None


def _peft(job: types_pb2.Job) -> dict:
    """The job's peft section resolved with its workload defaults (tasks' learning rate,
    batch size, steps, dataset seed = workload.seed + index; chunk size = seq_len)."""
    w = job.spec.workload
    sec = manifest.from_proto(job.spec)["workload"].get("peft") or {}
    defaults = {"learning_rate": w.learning_rate or 3e-3, "batch_size": w.batch_size or 8, "steps": w.steps or 100,
                "seed": w.seed}
    out = validate_peft(sec, "workload.peft", defaults=defaults, hidden=w.model.hidden or None)
    if out["chunk_size"] is None:
        out["chunk_size"] = w.model.seq_len
    for t in out["tasks"]:
        if t["dataset"]["max_len"] is None:
            t["dataset"]["max_len"] = out["chunk_size"]
    return out


def executor_load(host: types_pb2.Job, jobs: list[types_pb2.Job]) -> int:
    """Unfinished tasks in ``host``'s executor: its own (spec and added; ended ones no
    longer count) plus every task of each active guest fused into it that has not ended."""
    def unfinished(job: types_pb2.Job) -> int:
        return sum(1 for n in peft_tasks.all_task_names(job)
                   if (t := peft_tasks.find(job, n)) is None or t.phase not in TERMINAL)

    return unfinished(host) + sum(unfinished(g) for g in guests_of(host.id, jobs) if g.id != host.id)


def fusion_problem(host: types_pb2.Job, guest: types_pb2.Job, load: int | None = None) -> str:
    """Why ``guest``'s tasks cannot be added to ``host``'s running executor ("" = they can).
    ``load``: the executor's unfinished tasks (:func:`executor_load`); None counts the
    host's own only (no other job known)."""
    if guest.spec.workload.type != "peft" or host.spec.workload.type != "peft":
        return "only peft jobs fuse"
    if host.id == guest.id:
        return "a job does not fuse with itself"
    if is_profile_job(host) or is_profile_job(guest):
        # its steps must measure its own workload's step (the estimate of a job is read
        # from them); a host's steps carry its guests' tasks too
        return f"profiling job {(host if is_profile_job(host) else guest).id} runs alone"
    if host.status.phase != P.RUNNING or not host.status.allocation_id:
        return f"host {host.id} is {P.Name(host.status.phase)}, not running an executor"
    if host.status.fused_into:
        return f"host {host.id} is itself fused into {host.status.fused_into}"
    bh, bg = backbone_of(host), backbone_of(guest)
    if not bh or bh != bg:
        return f"backbones differ ({bh or '-'} vs {bg or '-'})"
    try:
        ph, pg = _peft(host), _peft(guest)
    except Exception as e:  # a spec the runtime would refuse: not ours to fuse
        return f"peft section: {e}"
    if ph["chunk_size"] != pg["chunk_size"]:
        return f"chunk sizes differ ({ph['chunk_size']} vs {pg['chunk_size']})"
    for t in pg["tasks"]:
        if len(fused_name(guest.id, t["name"])) > MAX_TASK_NAME:
            return f"task name {t['name']!r} too long to fuse (at most {MAX_TASK_NAME - len(guest.id) - 1} chars)"
    have = executor_load(host, []) if load is None else load
    if have + len(pg["tasks"]) > MAX_TASKS:
        return (f"host {host.id}'s executor carries {have} unfinished tasks; {len(pg['tasks'])} more would "
                f"exceed {MAX_TASKS} per executor")
    return ""


def is_fused_placement(reason: str) -> bool:
    """The policy's placement reason says the job fuses with LoRA tasks on its backbone."""
    return reason.startswith(FUSED_REASON)


def pick_host(guest: types_pb2.Job, node: str, partition: str, jobs: list[types_pb2.Job],
              added: dict[str, int] | None = None) -> tuple[types_pb2.Job | None, str]:
    """The oldest running peft job whose executor runs on ``partition`` of ``node`` and can
    take ``guest``'s tasks (:func:`fusion_problem`), or (None, why none). ``added``: host id
    -> tasks fused into its executor since ``jobs`` was read (earlier in the same round),
    counted in its load on top of :func:`executor_load`."""
    why = f"no running peft job on {node}/{partition}"
    for h in sorted(jobs, key=lambda j: (j.created, j.id)):
        on = any(s.node == node and partition in (list(s.partition_ids) or list(s.device_ids)) for s in h.status.placement)
        if not on or h.id == guest.id or h.status.phase not in ACTIVE:
            continue
        p = fusion_problem(h, guest, executor_load(h, jobs) + (added or {}).get(h.id, 0))
        if not p:
            return h, ""
        why = p
    return None, why


def starting_host(guest: types_pb2.Job, node: str, partition: str, jobs: list[types_pb2.Job],
                  placed: dict[str, tuple[str, str]]) -> str:
    """The id of a peft job of ``guest``'s backbone whose executor is about to start on
    ``partition`` of ``node`` (SCHEDULED there, or placed there this round: ``placed`` maps
    job id -> (node, partition)), so that ``guest`` should wait a round and fuse into it
    rather than start an executor of its own; "" when there is none."""
    bb = backbone_of(guest)
    if not bb:
        return ""
    for j in sorted(jobs, key=lambda j: (j.created, j.id)):
        if j.id == guest.id or backbone_of(j) != bb or j.status.fused_into:
            continue
        here = placed.get(j.id) == (node, partition) or (
            j.status.phase == P.SCHEDULED
            and any(s.node == node and partition in (list(s.partition_ids) or list(s.device_ids)) for s in j.status.placement))
        if here:
            return j.id
    return ""


def guest_tasks(guest: types_pb2.Job, checkpoint_dir: str) -> list[tuple[str, dict, str]]:
    """(fused name, resolved task spec under that name, task checkpoint dir) per task of
    ``guest``, in spec order. ``checkpoint_dir`` is the guest's own
    (``<checkpoint_root>/<guest id>``): a requeued guest resumes from the same files."""
    out = []
    for t in _peft(guest)["tasks"]:
        name = fused_name(guest.id, t["name"])
        out.append((name, {**t, "name": name}, f"{checkpoint_dir}/peft/{t['name']}"))
    return out


def guest_outcome(guest: types_pb2.Job) -> tuple[int, str] | None:
    """(phase, reason) once every task of ``guest`` (its spec's and any added) has ended;
    None while one is still to run. The phase is the one the guest's own executor would
    have ended with (agent/runtime/peft: exit 1 when some task failed and none
    succeeded): FAILED when no task succeeded and one failed (its loss or gradients went
    non-finite), else SUCCEEDED."""
    names = peft_tasks.all_task_names(guest)
    ended = [peft_tasks.find(guest, n) for n in names]
    if not names or any(t is None or t.phase not in TERMINAL for t in ended):
        return None
    ok = sum(t.phase == P.SUCCEEDED for t in ended)
    failed = sum(t.phase == P.FAILED for t in ended)
    why = (f"all {len(names)} tasks ended in the fused executor of job {guest.status.fused_into}: "
           f"{ok} succeeded, {failed} failed, {len(names) - ok - failed} cancelled")
    return (P.FAILED if failed and not ok else P.SUCCEEDED), why


def fold_progress(guest: types_pb2.Job) -> None:
    """The guest's own step / total / loss from its tasks (it has no executor of its own):
    the slowest task's steps, the mean of the tasks' latest and first losses."""
    ts = [t for t in guest.status.tasks if t.total_steps]
    if not ts:
        return
    st = guest.status
    st.step = min(t.step for t in ts) if any(t.phase == P.RUNNING for t in ts) else max(t.step for t in ts)
    st.total_steps = max(t.total_steps for t in ts)
    losses = [t.loss for t in ts if t.loss]
    if losses:
        st.loss = sum(losses) / len(losses)
    firsts = [t.first_loss for t in ts if t.first_loss]
    if firsts and not st.first_loss:
        st.first_loss = sum(firsts) / len(firsts)


def guests_of(host_id: str, jobs: list[types_pb2.Job]) -> list[types_pb2.Job]:
    """Active jobs fused into ``host_id``'s executor."""
    return [j for j in jobs if j.status.fused_into == host_id and j.status.phase in ACTIVE]


def host_reason(host: types_pb2.Job, guests: list[types_pb2.Job]) -> str:
    """The host's reason once all its own tasks ended while guests still train in its
    executor; "" when that is not the case."""
    own = peft_tasks.task_names(host)
    if not guests or not own or any((t := peft_tasks.find(host, n)) is None or t.phase not in TERMINAL for n in own):
        return ""
    return (f"its {len(own)} tasks ended; the executor keeps running, serving fused tasks of "
            + ", ".join(g.id for g in guests))


def orphans(jobs: list[types_pb2.Job], now: float, grace_s: float) -> list[tuple[types_pb2.Job, str]]:
    """Active guests whose host executor is gone, with the reason to requeue them."""
    by_id = {j.id: j for j in jobs}
    out = []
    for g in jobs:
        hid = g.status.fused_into
        if not hid or g.status.phase not in ACTIVE:
            continue
        h = by_id.get(hid)
        if h is None:
            out.append((g, f"host job {hid} is gone"))
        elif h.status.phase not in ACTIVE:
            out.append((g, f"host job {hid} ended {P.Name(h.status.phase)}: {h.status.reason}"))
        elif h.status.allocation_id != g.status.allocation_id:
            out.append((g, f"host job {hid} moved to another executor (allocation {h.status.allocation_id or '-'})"))
        elif g.status.phase == P.SCHEDULED:
            since = next((x.time for x in reversed(g.status.history) if x.phase == P.SCHEDULED), g.created)
            if now - since > grace_s:
                out.append((g, f"the executor of host job {hid} did not report its tasks within {grace_s:g}s"))
    return out

"""Executor entry point of the ``peft`` workload (multi-task LoRA on one backbone).

Contract: ``run(spec, reporter) -> int`` trains every task of ``workload.peft`` on ONE
frozen GPT backbone (``workload.model``, initialised from ``workload.seed``) and returns
0 when no task is left running, 2 on a bad spec (``error`` event naming the field), 143
when :data:`agent.runtime.train.STOP` is set (every running task checkpointed first), 1
otherwise. ``spec`` is ``{"job_id", "workload", "dist", "checkpoint_dir", "threads"}``
and optionally ``"control_file"``. ``threads`` (the executor's thread budget) is both
the intra-op thread count and the engine's micro-batch worker count (``MuxEngine``
``workers``: that many micro-batches run at once, one intra-op thread each); absent,
one worker. When the agent changes the executor's cores live, the thread count and the
worker count follow at the next step boundary (:class:`agent.runtime.threads.ThreadFollower`;
a ``threads`` event says so).

Events: ``start``; ``task`` per task (``task``, ``phase``: running | succeeded |
cancelled, ``step``, ``steps``, ``loss``, ``tokens_per_s``) when it starts, every
``report_every`` steps of it and when it ends; ``progress`` per engine step (``step``,
``total`` = engine steps still needed if nothing changes + done, ``loss`` = mean over
the step's tasks, ``step_time_s``, ``tokens``, ``tasks``, ``pad_removed``);
``checkpoint`` (``task``, ``path``, ``step``); ``error`` for a bad control command (the
others keep training); ``done`` (``final_loss``, per-task summary, packing totals).

Files under ``checkpoint_dir``: ``peft/<task>/adapter.pt`` (adapter only, written when
the task succeeds: its existence means "succeeded") and ``peft/<task>/state.pt`` (adapter
+ optimizer, every ``workload.checkpoint_every`` steps of the task; a restarted executor
resumes from it). A cancelled task leaves no ``adapter.pt``: its end writes ``state.pt``
(its adapter so far is ``torch.load(state.pt)["adapter"]``; a ``checkpoint`` event says
so) and then ``peft/<task>/outcome.json`` (``{"phase": "cancelled", "step", "steps"}``).
A later executor (relaunch, requeued fused guest) reports a task with ``adapter.pt`` as
succeeded and one with ``outcome.json`` as that phase at that step (``task`` event with
``resumed: true``), and retrains neither; a replayed ``cancel`` of such a task is a
no-op, not an error. (An ``adapter.pt`` written by an older runner for a cancelled task
has ``step`` < ``steps`` and is reported as cancelled at that step.) All files are
written atomically (temp file, fsync, os.replace, fsync of the directory).

Control: a JSONL file (``spec["control_file"]``, default
``<checkpoint_dir>/peft-control.jsonl``) read at every step boundary; each complete
line is ``{"op": "add", "task": {...task spec...}}`` or ``{"op": "cancel", "task":
"name"}``. An "add" may also carry ``"dir"`` (the task's checkpoint directory instead of
``<checkpoint_dir>/peft/<name>``: a task fused in from another job checkpoints into that
job's directory; only such an add may use a reserved ``j-<12 hex>_`` task name, see
:mod:`tessera.spec.peft`) and ``"allocation"`` (applied only by the executor of that allocation,
``spec["allocation_id"]``: a later executor of another allocation reading the same file
does not re-add another job's tasks). :class:`PeftRunner` exposes the same operations as
methods.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from agent.runtime.model import GPT, GPTConfig
from agent.runtime.peft.data import make_dataset
from agent.runtime.peft.engine import MuxEngine, TaskState
from agent.runtime.report import Reporter
from agent.runtime.threads import ThreadFollower
from tessera import log
from tessera.errors import SpecError
from tessera.fsutil import atomic_write
from tessera.spec.peft import validate_peft, validate_task

EXIT_OK, EXIT_FAIL, EXIT_SPEC, EXIT_TERM = 0, 1, 2, 143


def _num(wl: dict, name: str, default: Any, kind: type, minimum: float) -> Any:
    v = wl.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int) or v < minimum:
        raise SpecError(f"workload.{name}", f"must be a {'number' if kind is float else 'integer'} >= {minimum}, got {v!r}")
    return kind(v)


def parse(workload: dict) -> tuple[GPTConfig, dict, dict]:
    """(model config, validated peft section with every task resolved, run params)."""
    try:
        cfg = GPTConfig(**(workload.get("model") or {}))
    except (TypeError, ValueError) as e:
        raise SpecError("workload.model", str(e)) from e
    p = {
        "steps": _num(workload, "steps", 100, int, 1),
        "batch_size": _num(workload, "batch_size", 8, int, 1),
        "learning_rate": _num(workload, "learning_rate", 3e-3, float, 1e-12),
        "seed": _num(workload, "seed", 0, int, 0),
        "checkpoint_every": _num(workload, "checkpoint_every", 0, int, 0),
        "report_every": _num(workload, "report_every", 10, int, 1),
    }
    sec = validate_peft(workload.get("peft"), "workload.peft", defaults=p)
    if sec["chunk_size"] is None:
        sec["chunk_size"] = cfg.seq_len
    if sec["chunk_size"] > cfg.seq_len:
        raise SpecError("workload.peft.chunk_size", f"must be <= model.seq_len ({cfg.seq_len}), got {sec['chunk_size']}")
    sec["tasks"] = [resolve_task(t, sec["chunk_size"], f"workload.peft.tasks[{i}]") for i, t in enumerate(sec["tasks"])]
    return cfg, sec, p


def resolve_task(t: dict, chunk_size: int, path: str) -> dict:
    """Fill ``dataset.max_len`` (chunk size) and check it fits a chunk."""
    t = {**t, "dataset": dict(t["dataset"])}
    ds = t["dataset"]
    if ds["max_len"] is None:
        ds["max_len"] = chunk_size
    if ds["max_len"] > chunk_size:
        raise SpecError(f"{path}.dataset.max_len", f"must be <= chunk_size ({chunk_size}), got {ds['max_len']}")
    if ds["min_len"] > ds["max_len"]:
        raise SpecError(f"{path}.dataset.min_len", f"must be <= max_len ({ds['max_len']}), got {ds['min_len']}")
    return t


def atomic_torch_save(obj: Any, path: str) -> None:
    """Write ``obj`` to ``path`` so that readers see the old or the new file, never a torn one."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_json_save(obj: Any, path: str) -> None:
    """:func:`atomic_torch_save` for a small JSON document."""
    atomic_write(path, lambda f: f.write(json.dumps(obj).encode() + b"\n"))


def load_adapter(path: str) -> dict:
    """An adapter written by the runner (``peft/<task>/adapter.pt``)."""
    return torch.load(path, map_location="cpu", weights_only=True)


class PeftRunner:
    """Drives a :class:`MuxEngine` with events, checkpoints and run-time task changes.

    ``add_task``/``cancel_task`` may be called between ``step`` calls (or sent through
    the control file); neither restarts or perturbs the other tasks."""

    def __init__(self, cfg: GPTConfig, section: dict, params: dict, reporter: Reporter,
                 checkpoint_dir: str | None = None, control_file: str | None = None, device: str = "cpu",
                 job_id: str | None = None, workers: int = 1, allocation_id: str | None = None) -> None:
        self.log = log.get(job_id=job_id, workload="peft")
        self.cfg, self.section, self.params, self.rep = cfg, section, params, reporter
        self.ckpt_dir = checkpoint_dir
        self.control_file = control_file or (os.path.join(checkpoint_dir, "peft-control.jsonl") if checkpoint_dir else None)
        self._control_pos = 0
        self._control_line = 0
        self.allocation_id = allocation_id
        self._task_dirs: dict[str, str] = {}  # tasks checkpointing outside peft/<name> (fused in)
        self.ended_before: dict[str, str] = {}  # task -> phase, for tasks that ended in an earlier run
        torch.manual_seed(params["seed"])
        self.model = GPT(cfg).to(device)  # the shared, frozen backbone
        self.engine = MuxEngine(self.model, section["chunk_size"], section["mode"], slots=max(1, len(section["tasks"])),
                                micro_batch_tokens=section.get("micro_batch_tokens", 512), workers=workers)
        self._added = 0
        self.losses: list[float] = []

    # -- task control -----------------------------------------------------------------
    def task_dir(self, name: str) -> str | None:
        if name in self._task_dirs:
            return self._task_dirs[name]
        return os.path.join(self.ckpt_dir, "peft", name) if self.ckpt_dir else None

    def add_task(self, task: dict, path: str | None = None, task_dir: str | None = None,
                 fused: bool = False) -> TaskState | None:
        """Validate, resolve and start a task (resuming its state.pt if any); None if it
        already ended in an earlier run (its adapter.pt: succeeded; its outcome.json:
        cancelled), reported as such. ``task_dir``: where its files live (default
        ``<checkpoint_dir>/peft/<name>``). ``fused``: the task is another job's, fused in
        by the controller, so its name may (must) have the reserved ``<job id>_`` form."""
        path = path or f"tasks[{self._added}]"
        p = self.params
        t = validate_task(task, path, self._added, defaults=p, fused=fused)
        t = resolve_task(t, self.section["chunk_size"], path)
        if task_dir is not None:
            if not isinstance(task_dir, str) or not os.path.isabs(task_dir):
                raise SpecError(f"{path.rsplit('.', 1)[0]}.dir", f"must be an absolute path, got {task_dir!r}")
            self._task_dirs[t["name"]] = task_dir
        if t["dataset"]["seed"] is None:
            t["dataset"]["seed"] = p["seed"] + self._added
        self._added += 1
        tdir = self.task_dir(t["name"])
        ended = self._ended_in_earlier_run(tdir, t["steps"]) if tdir else None
        if ended is not None:
            phase, step = ended
            self.ended_before[t["name"]] = phase
            self.rep.event("task", task=t["name"], phase=phase, step=step, steps=t["steps"],
                           loss=None, tokens_per_s=None, resumed=True)
            return None
        ds = make_dataset(t["dataset"], self.cfg.vocab, t["dataset"]["max_len"], t["dataset"]["seed"])
        st = self.engine.add_task(t, ds)
        if tdir and os.path.exists(os.path.join(tdir, "state.pt")):
            self.engine.restore(st, torch.load(os.path.join(tdir, "state.pt"), map_location="cpu", weights_only=True))
        self.log.info("task_added", task=st.name, slot=st.slot, rank=t["rank"], targets=t["target_modules"],
                      resumed_step=st.step, running=len(self.engine.running()))
        self._task_event(st)
        return st

    @staticmethod
    def _ended_in_earlier_run(tdir: str, steps: int) -> tuple[str, int] | None:
        """(phase, step) of a task whose files say it ended; None when it is to run."""
        adapter = os.path.join(tdir, "adapter.pt")
        if os.path.exists(adapter):
            step = int(load_adapter(adapter).get("step", steps))
            # Before outcome.json, a cancel also wrote adapter.pt: its step tells it apart.
            return ("succeeded" if step >= steps else "cancelled"), step
        outcome = os.path.join(tdir, "outcome.json")
        if os.path.exists(outcome):
            with open(outcome) as f:
                o = json.load(f)
            return str(o["phase"]), int(o["step"])
        return None

    def cancel_task(self, name: str) -> TaskState:
        """Cancel a running task now (its state so far is saved); KeyError if unknown. A
        task that already ended is left as it is."""
        t = self.engine.tasks[name]
        if t.status != "running":
            return t
        state = self.engine.task_state(t) if self.ckpt_dir else None  # before cancel frees the slot
        st = self.engine.cancel(name)
        self._end(st, state)
        return st

    def poll_control(self) -> None:
        """Apply the complete lines appended to the control file since the last poll."""
        if not self.control_file or not os.path.exists(self.control_file):
            return
        with open(self.control_file, "rb") as f:
            f.seek(self._control_pos)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a half-written last line waits for the next poll
        self._control_pos += end
        for raw in data[:end].splitlines():
            field = f"control[{self._control_line}]"
            self._control_line += 1
            if not raw.strip():
                continue
            try:
                cmd = json.loads(raw)
                if not isinstance(cmd, dict) or cmd.get("op") not in ("add", "cancel"):
                    raise SpecError(f"{field}.op", "must be add or cancel")
                if cmd["op"] == "add":
                    if cmd.get("allocation") and self.allocation_id and cmd["allocation"] != self.allocation_id:
                        continue  # another allocation's fused task (an earlier executor of this dir)
                    # Only the controller's fused adds carry "dir" (the guest's own directory).
                    self.add_task(cmd.get("task"), f"{field}.task", cmd.get("dir"), fused=cmd.get("dir") is not None)
                else:
                    name = cmd.get("task")
                    if name not in self.engine.tasks and name in self.ended_before:
                        continue  # replayed cancel of a task that ended in an earlier run
                    if name not in self.engine.tasks:
                        raise SpecError(f"{field}.task", f"no task named {name!r}")
                    self.cancel_task(name)
            except SpecError as e:
                self.rep.event("error", message=str(e), field=e.field, fatal=False)
            except (ValueError, KeyError) as e:
                self.rep.event("error", message=f"{field}: {e}", field=field, fatal=False)

    # -- running ----------------------------------------------------------------------
    def step(self) -> bool:
        """One engine step with its events and checkpoints; False when nothing is running."""
        self.poll_control()
        rep = self.engine.step()
        if rep is None:
            return False
        now = time.perf_counter()
        mean = sum(rep.losses.values()) / len(rep.losses)
        self.losses.append(mean)
        run = self.engine.running()
        left = [t.steps - t.step for t in run]
        more = (max(left, default=0) if self.section["mode"] == "spatial" else sum(left))
        self.rep.event("progress", step=self.engine.steps_done, total=self.engine.steps_done + more, loss=mean,
                       step_time_s=rep.wall_s, tokens=sum(rep.tokens.values()), tasks=rep.tasks,
                       pad_removed=rep.pack.pad_removed, module="peft")
        every = self.params["checkpoint_every"]
        for name in rep.tasks:
            t = self.engine.tasks[name]
            if t.status != "running":
                self._end(t)
                continue
            if t.step % self.params["report_every"] == 0:
                self._task_event(t, now)
            if every and t.step % every == 0 and self.ckpt_dir:
                path = os.path.join(self.task_dir(name), "state.pt")
                atomic_torch_save(self.engine.task_state(t), path)
                self.rep.event("checkpoint", task=name, path=path, step=t.step)
        return True

    def checkpoint_running(self) -> None:
        """Save state.pt of every running task (before stopping)."""
        if not self.ckpt_dir:
            return
        for t in self.engine.running():
            path = os.path.join(self.task_dir(t.name), "state.pt")
            atomic_torch_save(self.engine.task_state(t), path)
            self.rep.event("checkpoint", task=t.name, path=path, step=t.step)

    def _task_event(self, t: TaskState, now: float | None = None) -> None:
        self.rep.event("task", task=t.name, phase=t.status, step=t.step, steps=t.steps,
                       loss=None if t.step == 0 else t.loss, tokens_per_s=t.tokens_per_s(now),
                       slot=t.slot, rank=t.spec["rank"])

    def _end(self, t: TaskState, state: dict | None = None) -> None:
        """Files and events of a task that just ended; ``state``: its :meth:`MuxEngine.task_state`
        taken before a cancel (the engine frees the slot when the task ends)."""
        if self.ckpt_dir and t.status == "succeeded" and t.final_adapter is not None:
            path = os.path.join(self.task_dir(t.name), "adapter.pt")
            atomic_torch_save(t.final_adapter, path)
            self.rep.event("checkpoint", task=t.name, path=path, step=t.step, adapter_only=True)
        elif self.ckpt_dir and state is not None:
            # Not adapter.pt (that means "succeeded"): the state so far, then the outcome.
            tdir = self.task_dir(t.name)
            path = os.path.join(tdir, "state.pt")
            atomic_torch_save(state, path)
            self.rep.event("checkpoint", task=t.name, path=path, step=t.step)
            atomic_json_save({"phase": t.status, "step": t.step, "steps": t.steps}, os.path.join(tdir, "outcome.json"))
        self.log.info("task_ended", task=t.name, phase=t.status, step=t.step, loss=t.loss,
                      tokens_per_s=round(t.tokens_per_s(), 1), running=len(self.engine.running()))
        self._task_event(t)

    def summary(self) -> dict:
        """Per-task outcome and the packing totals."""
        return {"tasks": {n: {"phase": t.status, "step": t.step, "first_loss": t.first_loss, "loss": t.loss,
                              "tokens": t.tokens, "tokens_per_s": t.tokens_per_s()}
                          for n, t in self.engine.tasks.items()},
                "pack": self.engine.pack_total.to_dict()}


def run(spec: dict, reporter: Reporter) -> int:
    """Train the peft workload described by ``spec``; see the module doc."""
    try:
        return _run(spec, reporter)
    except SpecError as e:
        reporter.event("error", message=str(e), field=e.field)
        return EXIT_SPEC
    except Exception as e:  # the agent needs an event, not only a traceback
        reporter.event("error", message=f"{type(e).__name__}: {e}")
        return EXIT_FAIL


def _run(spec: dict, reporter: Reporter) -> int:
    from agent.runtime.train import STOP  # set by the entry point on SIGTERM

    wl = spec.get("workload") or {}
    cfg, sec, params = parse(wl)
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    runner = PeftRunner(cfg, sec, params, reporter, spec.get("checkpoint_dir"), spec.get("control_file"),
                        job_id=spec.get("job_id"), workers=max(1, int(spec.get("threads") or 1)),
                        allocation_id=spec.get("allocation_id"))
    reporter.event("start", job_id=spec.get("job_id"), workload="peft", mode=sec["mode"],
                   chunk_size=sec["chunk_size"], tasks=[t["name"] for t in sec["tasks"]],
                   backbone_params=sum(p.numel() for p in runner.model.parameters() if not p.requires_grad))
    for i, t in enumerate(sec["tasks"]):
        runner.add_task(t, f"workload.peft.tasks[{i}]")
    follower = ThreadFollower(int(spec.get("threads") or 0))
    while True:
        threads = follower.poll()  # the agent may have changed our cores live (UpdateGrant)
        if threads is not None:
            runner.engine.set_workers(threads)
            runner.log.info("threads follow the grant", threads=threads, cores=follower.cores)
            reporter.event("threads", job_id=spec.get("job_id"), threads=threads, cores=follower.cores,
                           step=runner.engine.steps_done)
        if STOP.is_set():
            runner.checkpoint_running()
            runner.log.info("stopped", running=[t.name for t in runner.engine.running()])
            return EXIT_TERM
        if not runner.step():
            break
    s = runner.summary()
    finals = [v["loss"] for v in s["tasks"].values() if v["phase"] == "succeeded"]
    reporter.event("done", final_loss=sum(finals) / len(finals) if finals else None, **s)
    return EXIT_OK

"""Executor entry point of the ``peft`` workload (multi-task LoRA on one backbone).

Contract: ``run(spec, reporter) -> int`` trains every task of ``workload.peft`` on ONE
frozen GPT backbone (``workload.model``, initialised from ``workload.seed``) and returns
0 when no task is left running (1 instead when some task failed and none succeeded: an
``error`` event lists them), 2 on a bad spec (``error`` event naming the field; the
limits are :mod:`tessera.spec.peft`'s: at most 256 tasks, rank 1..model.hidden, batch size
1..65536 — a manifest breaking them, inherited values included, is refused at submission), 143
when :data:`agent.runtime.train.STOP` is set (every running task checkpointed first), 1
otherwise. ``spec`` is ``{"job_id", "workload", "dist", "checkpoint_dir", "threads"}``
and optionally ``"control_file"``. ``threads`` (the executor's thread budget) is both
the intra-op thread count and the engine's micro-batch worker count (``MuxEngine``
``workers``: that many micro-batches run at once, one intra-op thread each); absent,
one worker. When the agent changes the executor's cores live, the thread count and the
worker count follow at the next step boundary (:class:`agent.runtime.threads.ThreadFollower`;
a ``threads`` event says so).

Events: ``start``; ``task`` per task (``task``, ``phase``: running | succeeded |
cancelled | failed, ``step``, ``steps``, ``loss``, ``tokens_per_s``) when it starts, every
``report_every`` steps of it and when it ends; ``progress`` per engine step (``step`` and
``total`` from the tasks' own counts, so they continue across a relaunch: spatial, the
furthest task's step of the longest task's steps; temporal, the tasks' steps summed; a
cancelled task counts the steps it made; ``loss`` = mean over the step's tasks,
``step_time_s``, ``tokens``, ``tasks``, ``pad_removed``, ``module`` = "peft"); ``threads``
(``threads``, ``cores``, ``step``) after a live change of the executor's cores;
``checkpoint`` (``task``, ``path``, ``step``); ``error`` for a bad control command (the
others keep training) and for a failed task (``task``, ``fatal: false``, ``message``: e.g.
``task 'x' failed: loss is nan at step 5``; the others keep training); ``done`` (``final_loss``, per-task summary, packing totals).

Files under ``checkpoint_dir``: ``peft/<task>/adapter.pt`` (adapter only, written when
the task succeeds: its existence means "succeeded") and ``peft/<task>/state.pt`` (adapter
+ optimizer, every ``workload.checkpoint_every`` steps of the task; a restarted executor
resumes from it). A cancelled task leaves no ``adapter.pt``: its end writes ``state.pt``
(its adapter so far is ``torch.load(state.pt)["adapter"]``; a ``checkpoint`` event says
so) and then ``peft/<task>/outcome.json`` (``{"phase": "cancelled", "step", "steps"}``).
A task whose step loss or adapter gradient is not finite gets no update that step and
ends ``failed``: no ``adapter.pt``; its ``state.pt`` is rewritten with its state from
before that step (finite; the engine never applied the update) and ``outcome.json`` says
``{"phase": "failed", "step", "steps", "error"}``; a relaunch reports it failed and does
not retrain it.
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

A control line that cannot be applied (not JSON, an unknown op, a bad or unknown field,
a cancel of an unknown task, an add whose dataset file is missing or unreadable, or
whose ``state.pt`` cannot be read) is *rejected*: an ``error`` event (``fatal: false``,
``line``: its index in the file, ``field``: the dotted field at fault, e.g.
``control[3].task.dataset.path``) and nothing else changes: the other tasks keep
training. A line is applied or rejected at most once: rejections are recorded in
``<checkpoint_dir>/peft-control.rejected.jsonl`` (line index + SHA-256 of the line), and a
later executor of the same directory, which re-reads the control file from its start,
skips a recorded line without applying it again or reporting it again, so a bad line
can never take a relaunch down. The one per-line failure that is fatal is the engine
failing while it admits a valid task (out of memory growing the adapter banks: the
banks may be half-resized): that line is recorded as rejected first, the running tasks
are checkpointed (best effort), and the executor exits 1; its relaunch skips the line.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

import torch

from agent.runtime.heap import keep_heap
from agent.runtime.model import GPT, GPTConfig
from agent.runtime.peft.data import make_dataset
from agent.runtime.peft.engine import MuxEngine, TaskState
from agent.runtime.report import Reporter
from agent.runtime.threads import ThreadFollower
from tessera import log
from tessera.errors import SpecError
from tessera.fsutil import atomic_write
from tessera.spec.peft import MICRO_BATCH_TOKENS, validate_peft, validate_task

EXIT_OK, EXIT_FAIL, EXIT_SPEC, EXIT_TERM = 0, 1, 2, 143
REJECTED_FILE = "peft-control.rejected.jsonl"


class EngineError(RuntimeError):
    """The engine failed while admitting a valid task (e.g. out of memory growing the
    adapter banks); its state may be inconsistent, so the executor must stop."""


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
    sec = validate_peft(workload.get("peft"), "workload.peft", defaults=p, hidden=cfg.hidden)
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


def load_dataset(ds: dict, vocab: int, path: str):
    """:func:`make_dataset` of a resolved task ``dataset`` section; a file that is missing,
    not a regular file, unreadable or without a usable sample is ``SpecError`` on
    ``<path>.path`` (a user's mistake, not an executor failure)."""
    try:
        return make_dataset(ds, vocab, ds["max_len"], ds["seed"])
    except OSError as e:
        raise SpecError(f"{path}.path", f"cannot read {ds.get('path')!r}: {e.strerror or e}") from e
    except ValueError as e:
        if ds["kind"] == "synthetic":
            raise
        raise SpecError(f"{path}.path", str(e)) from e


def atomic_torch_save(obj: Any, path: str) -> None:
    """Write ``obj`` to ``path`` so that readers see the old or the new file, never a torn one."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_json_save(obj: Any, path: str) -> None:
    """:func:`atomic_torch_save` for a small JSON document."""
    atomic_write(path, lambda f: f.write(json.dumps(obj).encode() + b"\n"))


def _finite(obj: Any) -> bool:
    """Whether every floating tensor in ``obj`` (nested dicts/lists) is finite."""
    if isinstance(obj, torch.Tensor):
        return not obj.is_floating_point() or bool(torch.isfinite(obj).all())
    if isinstance(obj, dict):
        return all(_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_finite(v) for v in obj)
    return True


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
        # Control lines rejected by this or an earlier executor: (line index, sha256).
        self._rejected_file = os.path.join(checkpoint_dir, REJECTED_FILE) if checkpoint_dir else None
        self._rejected: set[tuple[int, str]] = self._load_rejected()
        self.allocation_id = allocation_id
        self._task_dirs: dict[str, str] = {}  # tasks checkpointing outside peft/<name> (fused in)
        self.ended_before: dict[str, str] = {}  # task -> phase, for tasks that ended in an earlier run
        torch.manual_seed(params["seed"])
        self.model = GPT(cfg).to(device)  # the shared, frozen backbone
        self.engine = MuxEngine(self.model, section["chunk_size"], section["mode"], slots=max(1, len(section["tasks"])),
                                micro_batch_tokens=section.get("micro_batch_tokens", MICRO_BATCH_TOKENS), workers=workers)
        self._added = 0
        self.losses: list[float] = []

    # -- task control -----------------------------------------------------------------
    def task_dir(self, name: str) -> str | None:
        if name in self._task_dirs:
            return self._task_dirs[name]
        return os.path.join(self.ckpt_dir, "peft", name) if self.ckpt_dir else None

    def add_task(self, task: dict, path: str | None = None, task_dir: str | None = None,
                 fused: bool = False, index: int | None = None) -> TaskState | None:
        """Validate, resolve and start a task (resuming its state.pt if any); None if it
        already ended in an earlier run (its adapter.pt: succeeded; its outcome.json:
        cancelled), reported as such. ``task_dir``: where its files live (default
        ``<checkpoint_dir>/peft/<name>``). ``fused``: the task is another job's, fused in
        by the controller, so its name may (must) have the reserved ``<job id>_`` form.
        ``SpecError`` (nothing changed) for a bad task, a name already running, or a
        dataset file that is missing or unreadable (field ``<path>.dataset.path``);
        :class:`EngineError` if the engine failed while admitting it. A task without a
        ``dataset.seed`` draws ``workload.seed + index`` (``index``: the spec task's
        position; default, the number of tasks added so far). A control-file add uses
        ``len(spec tasks) + its line index`` (see :meth:`poll_control`)."""
        return self._commit_add(self._prepare_add(task, path, task_dir, fused, index))

    def _prepare_add(self, task: Any, path: str | None, task_dir: Any, fused: bool,
                     index: int | None = None) -> dict:
        """Everything of an add that can fail without changing the runner or the engine:
        validation, the dataset (files read), the task's earlier files (state.pt read).
        ``index``: the task's seed index (dataset seed = workload seed + index when the task
        gives none); None: the number of tasks added so far."""
        index = self._added if index is None else index
        path = path or f"tasks[{index}]"
        p = self.params
        t = validate_task(task, path, index, defaults=p, fused=fused, hidden=self.cfg.hidden)
        t = resolve_task(t, self.section["chunk_size"], path)
        running = self.engine.tasks.get(t["name"])
        if running is not None and running.status == "running":
            raise SpecError(f"{path}.name", f"task {t['name']!r} is already running")
        if task_dir is not None and (not isinstance(task_dir, str) or not os.path.isabs(task_dir)):
            raise SpecError(f"{path.rsplit('.', 1)[0]}.dir", f"must be an absolute path, got {task_dir!r}")
        if t["dataset"]["seed"] is None:
            t["dataset"]["seed"] = p["seed"] + index
        tdir = task_dir if task_dir is not None else self.task_dir(t["name"])
        prep: dict[str, Any] = {"t": t, "task_dir": task_dir, "tdir": tdir, "ended": None, "ds": None, "state": None}
        prep["ended"] = self._ended_in_earlier_run(tdir, t["steps"]) if tdir else None
        if prep["ended"] is not None:
            return prep
        prep["ds"] = load_dataset(t["dataset"], self.cfg.vocab, f"{path}.dataset")
        if tdir and os.path.exists(os.path.join(tdir, "state.pt")):
            prep["state"] = torch.load(os.path.join(tdir, "state.pt"), map_location="cpu", weights_only=True)
        return prep

    def _commit_add(self, prep: dict) -> TaskState | None:
        """Apply a prepared add; :class:`EngineError` if the engine failed on the way."""
        t = prep["t"]
        self._added += 1
        if prep["ended"] is not None:
            self._record_dir(t["name"], prep["task_dir"])
            phase, step = prep["ended"]
            self.ended_before[t["name"]] = phase
            self.rep.event("task", task=t["name"], phase=phase, step=step, steps=t["steps"],
                           loss=None, tokens_per_s=None, resumed=True)
            return None
        try:
            st = self.engine.add_task(t, prep["ds"])
            if prep["state"] is not None:
                self.engine.restore(st, prep["state"])
        except Exception as e:
            raise EngineError(f"adding task {t['name']!r} failed: {type(e).__name__}: {e}") from e
        # Only now: a rejected add (a duplicate name) must not re-point a running task's files.
        self._record_dir(t["name"], prep["task_dir"])
        self.log.info("task_added", task=st.name, slot=st.slot, rank=t["rank"], targets=t["target_modules"],
                      resumed_step=st.step, running=len(self.engine.running()))
        if st.status == "running":
            self._task_event(st)
        else:  # its state.pt already has its steps (fewer asked now): adapter.pt, succeeded
            self._end(st)
        return st

    def _record_dir(self, name: str, task_dir: str | None) -> None:
        """``name``'s files live in ``task_dir`` from now on (None: where they were)."""
        if task_dir is not None:
            self._task_dirs[name] = task_dir

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
        """Apply the complete lines appended to the control file since the last poll; a
        line that cannot be applied is rejected (see the module doc) and the others are
        still applied. Raises only :class:`EngineError` (the line recorded first) or an
        I/O error of a valid cancel's checkpoint."""
        if not self.control_file or not os.path.exists(self.control_file):
            return
        with open(self.control_file, "rb") as f:
            f.seek(self._control_pos)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a half-written last line waits for the next poll
        self._control_pos += end
        for raw in data[:end].splitlines():
            n = self._control_line
            self._control_line += 1
            if not raw.strip():
                continue
            key = (n, hashlib.sha256(raw).hexdigest())
            if key in self._rejected:
                self.log.info("control line rejected earlier: skipped", line=n)
                continue
            field = f"control[{n}]"
            try:
                action = self._parse_control(raw, field, n)
            except SpecError as e:
                self._reject(key, e.field, str(e))
                continue
            except Exception as e:  # nothing has changed yet: the line alone is bad
                self._reject(key, field, f"{field}: {type(e).__name__}: {e}")
                continue
            try:
                action()
            except EngineError as e:
                self._reject(key, f"{field}.task", f"{field}: {e}", fatal=True)
                try:
                    self.checkpoint_running()
                except Exception as ce:  # the engine may be half-resized; keep the first error
                    self.log.warning("checkpoint after engine failure failed", error=repr(ce))
                raise

    def _parse_control(self, raw: bytes, field: str, line: int = 0):
        """The action of one control line (a no-arg callable, or a no-op), after every check
        that can fail without changing anything; raises for a line to reject."""
        try:
            cmd = json.loads(raw)
        except ValueError as e:  # not JSON, or not UTF-8
            raise SpecError(field, f"not a JSON object ({e})") from e
        if not isinstance(cmd, dict) or cmd.get("op") not in ("add", "cancel"):
            raise SpecError(f"{field}.op", "must be add or cancel")
        if cmd["op"] == "add":
            alloc = cmd.get("allocation")
            if alloc and self.allocation_id and alloc != self.allocation_id:
                return lambda: None  # another allocation's fused task (an earlier executor of this dir)
            # Only the controller's fused adds carry "dir" (the guest's own directory).
            # Seed index from the line's position in the file (every line counts, skipped
            # ones too), not from how many adds this executor applied: a relaunch that skips
            # another allocation's lines draws the same data for the same task.
            index = len(self.section["tasks"]) + line
            prep = self._prepare_add(cmd.get("task"), f"{field}.task", cmd.get("dir"),
                                     fused=cmd.get("dir") is not None, index=index)
            return lambda: self._commit_add(prep)
        name = cmd.get("task")
        if not isinstance(name, str):
            raise SpecError(f"{field}.task", f"must be a task name (a string), got {type(name).__name__}")
        if name not in self.engine.tasks and name in self.ended_before:
            return lambda: None  # replayed cancel of a task that ended in an earlier run
        if name not in self.engine.tasks:
            raise SpecError(f"{field}.task", f"no task named {name!r}")
        return lambda: self.cancel_task(name)

    def _reject(self, key: tuple[int, str], field: str, message: str, fatal: bool = False) -> None:
        """Record a rejected control line (so no later executor applies it) and report it."""
        self._rejected.add(key)
        if self._rejected_file:
            try:
                with open(self._rejected_file, "a") as f:
                    f.write(json.dumps({"line": key[0], "sha256": key[1], "field": field, "message": message}) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:  # the line is still rejected here; a relaunch rejects it again
                self.log.warning("cannot record a rejected control line", line=key[0], error=repr(e))
        self.rep.event("error", message=message, field=field, line=key[0], fatal=fatal)

    def _load_rejected(self) -> set[tuple[int, str]]:
        out: set[tuple[int, str]] = set()
        if not self._rejected_file or not os.path.exists(self._rejected_file):
            return out
        with open(self._rejected_file, "rb") as f:
            for raw in f:
                try:
                    r = json.loads(raw)
                    out.add((int(r["line"]), str(r["sha256"])))
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last record (crash while appending): that line is re-checked
        return out

    # -- running ----------------------------------------------------------------------
    def progress(self) -> tuple[int, int]:
        """The job's (step, total) from its tasks' own counts, so that it continues across a
        relaunch (the engine's step counter restarts at 0 with each executor). Spatial: the
        furthest task's step of the longest task's steps (every running task steps with
        every fused step). Temporal: the tasks' steps summed (one task per step). A
        task that ended early (cancelled) counts the steps it made, not those it asked for."""
        ts = list(self.engine.tasks.values())
        ends = [t.steps if t.status in ("running", "succeeded") else t.step for t in ts]
        if self.section["mode"] == "spatial":
            return max((t.step for t in ts), default=0), max(ends, default=0)
        return sum(t.step for t in ts), sum(ends)

    def step(self) -> bool:
        """One engine step with its events and checkpoints; False when nothing is running."""
        self.poll_control()
        rep = self.engine.step()
        if rep is None:
            return False
        now = time.perf_counter()
        if rep.losses:  # else every stepping task failed: nothing trained, no progress
            mean = sum(rep.losses.values()) / len(rep.losses)
            self.losses.append(mean)
            step, total = self.progress()
            self.rep.event("progress", step=step, total=total, loss=mean,
                           step_time_s=rep.wall_s, tokens=sum(rep.tokens.values()), tasks=list(rep.losses),
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
        elif t.status == "failed":
            # Not adapter.pt (that means "succeeded"): its state from before the failed
            # step (finite: the engine never applied that update), then the outcome.
            if self.ckpt_dir:
                tdir = self.task_dir(t.name)
                if t.failed_state is not None and _finite(t.failed_state):
                    path = os.path.join(tdir, "state.pt")
                    atomic_torch_save(t.failed_state, path)
                    self.rep.event("checkpoint", task=t.name, path=path, step=t.step)
                atomic_json_save({"phase": "failed", "step": t.step, "steps": t.steps, "error": t.error},
                                 os.path.join(tdir, "outcome.json"))
            self.log.warning("task_failed", task=t.name, step=t.step, error=t.error)
            self.rep.event("error", message=f"task {t.name!r} failed: {t.error}", task=t.name, fatal=False)
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
    try:
        world = int((spec.get("dist") or {}).get("world_size", 1))
    except (TypeError, ValueError):
        raise SpecError("dist.world_size", f"must be an integer, got {(spec.get('dist') or {}).get('world_size')!r}") from None
    if world != 1:
        # Every rank would train every task and write the same files (nothing is sharded).
        raise SpecError("resources.devices",
                        f"a peft job runs on one device (its tasks share one backbone), got world_size {world}")
    keep_heap()
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    runner = PeftRunner(cfg, sec, params, reporter, spec.get("checkpoint_dir"), spec.get("control_file"),
                        job_id=spec.get("job_id"), workers=max(1, int(spec.get("threads") or 1)),
                        allocation_id=spec.get("allocation_id"))
    reporter.event("start", job_id=spec.get("job_id"), workload="peft", mode=sec["mode"],
                   chunk_size=sec["chunk_size"], tasks=[t["name"] for t in sec["tasks"]],
                   backbone_params=sum(p.numel() for p in runner.model.parameters() if not p.requires_grad))
    for i, t in enumerate(sec["tasks"]):
        runner.add_task(t, f"workload.peft.tasks[{i}]", index=i)
    follower = ThreadFollower(int(spec.get("threads") or 0))
    while True:
        threads = follower.poll()  # the agent may have changed our cores live (UpdateGrant)
        if threads is not None:
            runner.engine.set_workers(threads)
            runner.log.info("threads follow the grant", threads=threads, cores=follower.cores)
            reporter.event("threads", job_id=spec.get("job_id"), threads=threads, cores=follower.cores,
                           step=runner.progress()[0])
        if STOP.is_set():
            runner.checkpoint_running()
            runner.log.info("stopped", running=[t.name for t in runner.engine.running()])
            return EXIT_TERM
        if not runner.step():
            break
    s = runner.summary()
    phases = [v["phase"] for v in s["tasks"].values()] + list(runner.ended_before.values())
    failed = sorted([n for n, v in s["tasks"].items() if v["phase"] == "failed"]
                    + [n for n, ph in runner.ended_before.items() if ph == "failed"])
    if failed and "succeeded" not in phases:
        # No task produced an adapter and some diverged: the job failed (as a gpt job whose
        # loss is not finite).
        reporter.event("error", message=f"no task succeeded; failed: {', '.join(failed)}")
        return EXIT_FAIL
    finals = [v["loss"] for v in s["tasks"].values() if v["phase"] == "succeeded"]
    reporter.event("done", final_loss=sum(finals) / len(finals) if finals else None, **s)
    return EXIT_OK

"""``tessera``: the command-line interface (console script ``tessera = tessera.cli:main``).

Commands talking to a controller (``--controller HOST:PORT``, else env TESSERA_CONTROLLER,
else ``.tessera/testbed.json``), each with ``-o json`` for machine-readable output::

    tessera submit FILE.yaml [--wait] [--timeout S]   validate locally, submit, optionally follow
    tessera get JOB | list [--tenant T] [--phase P] [--tasks] | cancel JOB | nodes | logs JOB [--tail BYTES]
    (a peft job's task is a job of its own: ``tessera get JOB/TASK``, ``tessera cancel JOB/TASK``)

Local testbed::

    tessera up [--agents N] [--cpu-devices K] [--detach] [--dir .tessera]
    tessera down [--dir .tessera]
    tessera demo [FILE.yaml ...] [--examples DIR] [--timeout S] [--keep]

Exit codes: 0 success; 1 the server refused or failed (message with the gRPC status code),
a job did not succeed (``--wait``, ``demo``), or the testbed failed; 2 usage errors and
invalid manifests (the field at fault is printed, nothing is sent); 130 interrupted.

Results go to stdout; progress and errors to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import grpc
from google.protobuf import json_format
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from . import manifest
from .api.v1 import types_pb2
from .client import TERMINAL_PHASES, Client, NoControllerAddress, TesseraError, parse_phase, phase_name, resolve_address
from .errors import SpecError

ClientFactory = Callable[[str | None], Any]

PHASE_STYLE = {
    "PENDING": "yellow", "SCHEDULED": "cyan", "RUNNING": "blue",
    "SUCCEEDED": "green", "FAILED": "red", "CANCELLED": "magenta",
}


class UsageError(Exception):
    """Bad invocation (exit 2)."""


# --- formatting ---------------------------------------------------------------------------

def to_dict(msg: Any) -> dict:
    """A proto message as a JSON-ready dict (proto field names, enums as names, defaults shown)."""
    return json_format.MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _phase(job: types_pb2.Job) -> Text:
    name = phase_name(job.status.phase)
    return Text(name, style=PHASE_STYLE.get(name, ""))


def _placement(job: types_pb2.Job) -> str:
    return ", ".join(f"{s.node}[{','.join(s.partition_ids or s.device_ids)}]" + (f" {s.units}u" if s.units else "")
                     for s in job.status.placement) or "-"


def _decision(s: types_pb2.JobStatus) -> str:
    """The scheduler's last decision: action, reason, policy, quota, when."""
    d = s.last_decision
    if not d.action:
        return s.decision or "-"
    quota = f", quota {d.quota:.2f}" if d.action in ("pack",) or 0 < d.quota < 1 else ""
    return f"{d.action}: {d.reason} ({d.policy}{quota}, {_ts(d.time)}, {d.decision_id})"


def _nodes_of(job: types_pb2.Job) -> str:
    return ",".join(s.node for s in job.status.placement) or "-"


def _devices_of(job: types_pb2.Job) -> str:
    return ",".join(f"{s.node}:{d}" if len(job.status.placement) > 1 else d
                    for s in job.status.placement for d in s.device_ids) or "-"


def _loss(v: float) -> str:
    return f"{v:.3f}" if v else "-"


def _steps(job: types_pb2.Job) -> str:
    s = job.status
    total = s.total_steps or job.spec.workload.steps
    return f"{s.step}/{total}" if total else str(s.step)


def _ts(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _age(t: float) -> str:
    if not t:
        return "-"
    d = max(0.0, time.time() - t)
    if d < 120:
        return f"{d:.0f}s"
    if d < 7200:
        return f"{d / 60:.0f}m"
    return f"{d / 3600:.1f}h"


def _end_time(job: types_pb2.Job) -> float:
    for h in reversed(job.status.history):
        if h.phase in TERMINAL_PHASES:
            return h.time
    return 0.0


def wall_time(job: types_pb2.Job) -> float:
    """Seconds from submission to the terminal phase (0 if not finished)."""
    end = _end_time(job)
    return max(0.0, end - job.created) if end and job.created else 0.0


def progress_line(job: types_pb2.Job) -> Text:
    """One line: name id phase step/total loss node."""
    t = Text(f"{job.spec.name} ({job.id}) ")
    t.append_text(_phase(job))
    s = job.status
    if s.step or s.total_steps:
        t.append(f"  step {_steps(job)}")
    if s.loss:
        t.append(f"  loss {s.loss:.4f}")
    if s.step_time_median_s or s.step_time_s:
        t.append(f"  {(s.step_time_median_s or s.step_time_s) * 1000:.1f} ms/step")
    if s.placement:
        t.append(f"  on {_placement(job)}")
    if s.reason and s.phase != types_pb2.RUNNING:
        t.append(f"  — {s.reason}", style="dim")
    return t


def _row(t: Table, *cells: Any) -> None:
    # Plain strings would be parsed as rich markup ("node-1[cpu0]" loses its brackets).
    t.add_row(*(Text(c) if isinstance(c, str) else c for c in cells))


def jobs_table(jobs: list[types_pb2.Job]) -> Table:
    t = Table(box=None, header_style="bold")
    for c in ("ID", "NAME", "TENANT", "PHASE", "STEP", "LOSS", "PLACEMENT", "AGE"):
        t.add_column(c)
    for j in jobs:
        _row(t, j.id, j.spec.name, j.spec.tenant, _phase(j), _steps(j), _loss(j.status.loss), _placement(j), _age(j.created))
    return t


def _step_time(s: types_pb2.JobStatus) -> str:
    """Measured step time next to the performance model's estimate (controller/profiling.py)."""
    if s.step_time_median_s:
        measured = f"{s.step_time_median_s * 1000:.1f} ms measured (median of recent steps"
        measured += f"; last {s.step_time_s * 1000:.1f} ms)" if s.step_time_s else ")"
    elif s.step_time_s:
        measured = f"{s.step_time_s * 1000:.1f} ms measured (last step)"
    else:
        measured = "- measured"
    e = s.estimate
    if not e.status:
        return measured
    if e.status == "ok":
        est = (f"{e.step_time_s * 1000:.1f} ms estimated ±{e.rel_std * 100:.0f}% "
               f"(confidence {e.confidence:.0%}, model v{e.model_version})")
        if e.reason:  # how it was made: from a profile, beside which jobs on a shared device
            est += f" — {e.reason}"
    elif e.status == "profiling":
        est = f"estimate pending: profiling job {e.profile_job_id}"
    else:
        est = f"no estimate ({e.status}: {e.reason})"
    return f"{measured}, {est}"


def job_view(job: types_pb2.Job) -> Table:
    s = job.status
    t = Table(box=None, show_header=False)
    t.add_column(style="bold")
    t.add_column()
    _row(t, "job", f"{job.id}  {job.spec.name} (tenant {job.spec.tenant})")
    ph = _phase(job)
    if s.reason:
        ph.append(f" — {s.reason}")
    _row(t, "phase", ph)
    w = job.spec.workload
    _row(t, "workload", f"{w.type}, {job.spec.resources.devices} {job.spec.resources.device_kind or 'any'} device(s), "
                          f"plan dp{w.plan.dp} tp{w.plan.tp} pp{w.plan.pp}")
    _row(t, "placement", _placement(job))
    _row(t, "step", _steps(job))
    _row(t, "loss", f"{_loss(s.first_loss)} → {_loss(s.loss)}")
    _row(t, "step time", _step_time(s))
    _row(t, "attempts", str(s.attempts))
    _row(t, "decision", _decision(s))
    if s.HasField("plan"):
        _row(t, "running plan", f"dp{s.plan.dp} tp{s.plan.tp} pp{s.plan.pp} (resized from the spec's)")
    if s.phase == types_pb2.FAILED:
        _row(t, "exit code", str(s.exit_code))
    if s.fused_into:
        live = s.phase in (types_pb2.SCHEDULED, types_pb2.RUNNING)
        _row(t, "fused into", f"{s.fused_into}'s executor (allocation {s.allocation_id or '-'}; its tasks run there as "
                              f"{job.id}_<task>{'' if live else '; ended'})")
    if job.parent_id:
        _row(t, "task of", f"{job.parent_id} (shared executor and backbone)")
    if s.tasks:
        _row(t, "tasks", tasks_table(job))
    _row(t, "created", _ts(job.created))
    hist = Table(box=None, header_style="bold")
    for c in ("TIME (UTC)", "PHASE", "REASON"):
        hist.add_column(c)
    for h in s.history:
        name = phase_name(h.phase)
        _row(hist, _ts(h.time), Text(name, style=PHASE_STYLE.get(name, "")), h.reason)
    _row(t, "history", hist)
    return t


def tasks_table(job: types_pb2.Job) -> Table:
    """The LoRA tasks of a peft job (or of a task's own view): phase, steps, loss, tokens/s."""
    t = Table(box=None, header_style="bold")
    for c in ("TASK", "PHASE", "STEP", "LOSS", "TOK/S", "REASON"):
        t.add_column(c)
    for k in job.status.tasks:
        name = phase_name(k.phase)
        _row(t, k.name if job.parent_id else f"{job.id}/{k.name}", Text(name, style=PHASE_STYLE.get(name, "")),
             f"{k.step}/{k.total_steps}", f"{_loss(k.first_loss)} → {_loss(k.loss)}", f"{k.tokens_per_s:.0f}", k.reason)
    return t


def nodes_table(nodes: list[types_pb2.Node]) -> Table:
    t = Table(box=None, header_style="bold")
    for c in ("NAME", "STATE", "AGENT", "DEVICES", "PARTITIONS (allocated/capacity, agent free)", "ALLOCATED", "HEARTBEAT"):
        t.add_column(c)
    for n in nodes:
        state = types_pb2.NodeState.Name(n.state)
        devs = ", ".join(f"{d.id} ({d.kind}" + (f", {len(d.cores)} cores" if d.cores else "")
                         + (f", {d.memory_bytes / 2**30:.1f} GiB" if d.memory_bytes else "") + ")" for d in n.devices)
        parts = "\n".join(f"{p.id} {p.kind} {p.allocated_units}/{p.capacity_units} {p.unit}, {p.free_units} free"
                          for p in n.partitions) or "-"
        _row(t, n.name, Text(state, style="green" if n.state == types_pb2.READY else "red"), n.agent_address, devs,
                  parts, ",".join(n.allocated_device_ids) or "-", _age(n.last_heartbeat) + " ago" if n.last_heartbeat else "-")
    return t


def _json_safe(v: Any) -> Any:
    """``v`` with every non-finite float written as protobuf's JSON mapping writes it
    ("NaN", "Infinity", "-Infinity"): a diverged job's NaN loss must not make the output
    invalid JSON."""
    if isinstance(v, float) and v != v:
        return "NaN"
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return "Infinity" if v > 0 else "-Infinity"
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def emit_json(out: Console, data: Any) -> None:
    """Write ``data`` as JSON to the result stream, unwrapped and uncoloured; always valid
    JSON (non-finite numbers as strings, see ``_json_safe``)."""
    out.file.write(json.dumps(_json_safe(data), indent=2, allow_nan=False) + "\n")
    out.file.flush()


# --- following jobs ------------------------------------------------------------------------

def follow(client: Any, job_ids: list[str], err: Console, timeout: float | None) -> dict[str, types_pb2.Job]:
    """Watch ``job_ids`` until each is terminal; render live progress on ``err``. Returns
    the last Job of each. ``TesseraError(DEADLINE_EXCEEDED)`` after ``timeout`` seconds
    (the job(s) keep running), ``TesseraError(UNAVAILABLE)`` when the controller stays
    unreachable (a note on ``err`` when the watch is lost and retried); either carries
    ``.last``, the last Job seen of each job."""
    last: dict[str, types_pb2.Job] = {}
    try:
        return _follow(client, job_ids, err, timeout, last)
    except TesseraError as e:
        e.last = dict(last)
        raise


def _follow(client: Any, job_ids: list[str], err: Console, timeout: float | None,
            last: dict[str, types_pb2.Job]) -> dict[str, types_pb2.Job]:
    want = set(job_ids)
    single = job_ids[0] if len(job_ids) == 1 else ""

    def note(msg: str) -> None:
        err.print(f"[yellow]note:[/] {escape(msg)}", highlight=False)

    def watch() -> Any:
        try:
            return client.watch(job_id=single, timeout=timeout, on_retry=note)
        except TypeError:  # a client without on_retry
            return client.watch(job_id=single, timeout=timeout)

    def render() -> Table:
        t = Table(box=None, show_header=False)
        t.add_column()
        for jid in job_ids:
            t.add_row(progress_line(last[jid]) if jid in last else Text(f"{jid} waiting…"))
        return t

    if err.is_terminal:
        with Live(render(), console=err, refresh_per_second=4, transient=False) as live:
            for ev in watch():
                if ev.job.id in want:
                    last[ev.job.id] = ev.job
                    live.update(render())
                    if all(j in last and last[j].status.phase in TERMINAL_PHASES for j in want):
                        break
    else:
        # Not a terminal: print a line on each phase change and every ~10% of progress.
        seen: dict[str, tuple[int, int]] = {}
        for ev in watch():
            j = ev.job
            if j.id not in want:
                continue
            last[j.id] = j
            total = j.status.total_steps or j.spec.workload.steps or 1
            key = (j.status.phase, int(10 * j.status.step / total))
            if seen.get(j.id) != key:
                seen[j.id] = key
                err.print(progress_line(j), soft_wrap=True)
            if all(x in last and last[x].status.phase in TERMINAL_PHASES for x in want):
                break
    missing = [j for j in job_ids if j not in last or last[j].status.phase not in TERMINAL_PHASES]
    for jid in missing:  # the stream ended early (controller stopped): read the final state
        last[jid] = client.get(jid)
    return last


# --- commands ------------------------------------------------------------------------------

def cmd_submit(a, client_for, out: Console, err: Console) -> int:
    try:
        doc = manifest.load_file(a.file)
    except SpecError as e:
        err.print(f"[red]error:[/] invalid manifest {escape(a.file)}: [bold]{escape(e.field)}[/]: {escape(e.message)}",
                  highlight=False)
        return 2
    except OSError as e:
        err.print(f"[red]error:[/] cannot read {escape(a.file)}: {escape(e.strerror or str(e))}", highlight=False)
        return 2
    with client_for(a.controller) as c:
        job = c.submit(doc, idempotency_key=a.idempotency_key)
        if not a.wait:
            if a.output == "json":
                emit_json(out, to_dict(job))
            else:
                out.print(f"job [bold]{escape(job.id)}[/] submitted ({escape(job.spec.name)}, tenant {escape(job.spec.tenant)})",
                          highlight=False)
            return 0
        err.print(f"job [bold]{escape(job.id)}[/] submitted; following it (Ctrl-C stops following, not the job)", highlight=False)
        final = follow(c, [job.id], err, a.timeout)[job.id]
    if a.output == "json":
        emit_json(out, to_dict(final))
    else:
        out.print(job_view(final))
    return 0 if final.status.phase == types_pb2.SUCCEEDED else 1


def cmd_get(a, client_for, out: Console, err: Console) -> int:
    with client_for(a.controller) as c:
        job = c.get(a.job)
    if a.output == "json":
        emit_json(out, to_dict(job))
    else:
        out.print(job_view(job))
    return 0


def cmd_list(a, client_for, out: Console, err: Console) -> int:
    try:
        phases = [parse_phase(p) for p in (a.phase or [])]
    except ValueError as e:
        raise UsageError(f"--phase: {e}") from None
    with client_for(a.controller) as c:
        jobs = c.list(tenant=a.tenant or "", phases=phases, **({"include_tasks": True} if a.tasks else {}))
    if a.output == "json":
        emit_json(out, {"jobs": [to_dict(j) for j in jobs]})
    elif not jobs:
        err.print("no jobs")
    else:
        out.print(jobs_table(jobs))
    return 0


def cmd_cancel(a, client_for, out: Console, err: Console) -> int:
    with client_for(a.controller) as c:
        job = c.cancel(a.job, reason=a.reason)
    if a.output == "json":
        emit_json(out, to_dict(job))
    else:
        out.print(progress_line(job))
    return 0


def cmd_nodes(a, client_for, out: Console, err: Console) -> int:
    with client_for(a.controller) as c:
        nodes = c.nodes()
    if a.output == "json":
        emit_json(out, {"nodes": [to_dict(n) for n in nodes]})
    elif not nodes:
        err.print("no nodes registered")
    else:
        out.print(nodes_table(nodes))
    return 0


def cmd_logs(a, client_for, out: Console, err: Console) -> int:
    if a.tail < 0:
        raise UsageError(f"--tail: must be >= 0, got {a.tail}")
    with client_for(a.controller) as c:
        resp = c.logs(a.job, tail_bytes=a.tail)
    if a.output == "json":
        emit_json(out, {"job_id": a.job, "text": resp.text, "truncated": resp.truncated})
    else:
        if resp.truncated:
            err.print("(older output cut off; use --tail BYTES for more)")
        out.file.write(resp.text)
        out.file.flush()
    return 0


def cmd_up(a, client_for, out: Console, err: Console) -> int:
    from .testbed import Testbed, TestbedError

    tb = Testbed(a.dir, progress=lambda m: err.print(m, markup=False, highlight=False))
    try:
        info = tb.up(agents=a.agents, cpu_devices=a.cpu_devices, grace_s=a.grace_s, keep_state=a.keep_state,
                     timeout=a.start_timeout, colocation_benchmark=a.colocation_benchmark)
    except TestbedError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", highlight=False)
        return 1
    except KeyboardInterrupt:
        return 130
    if a.output == "json":
        emit_json(out, info)
    if a.detach:
        tb.detach()
        err.print(escape(f"detached; the CLI finds the controller through {tb.file}. Stop with: tessera down"
                         + (f" --dir {a.dir}" if a.dir != ".tessera" else "")), highlight=False)
        return 0
    try:
        tb.wait_until_signalled(on_ready=lambda: err.print("running; press Ctrl-C to stop", highlight=False))
    except KeyboardInterrupt:
        pass  # a Ctrl-C before the handlers were installed: stop all the same
    finally:
        err.print("stopping…")
        tb.down()
    return 0


def cmd_down(a, client_for, out: Console, err: Console) -> int:
    from .testbed import Testbed, TestbedError

    tb = Testbed(a.dir, progress=lambda m: err.print(m, markup=False, highlight=False))
    if tb.read() is None:
        err.print(f"no testbed recorded in {escape(str(tb.file))}; nothing to stop", highlight=False)
        if a.output == "json":
            emit_json(out, {"stopped": []})
        return 0
    try:
        stopped = tb.down()
    except TestbedError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", highlight=False)
        return 1
    if a.output == "json":
        emit_json(out, {"stopped": stopped})
    else:
        err.print(f"testbed down ({len(stopped)} process(es) stopped)")
    return 0


def cmd_demo(a, client_for, out: Console, err: Console) -> int:
    from .testbed import Testbed, TestbedError

    if a.manifests:
        files = [Path(m) for m in a.manifests]
    else:
        ex = Path(a.examples)
        if a.examples == "examples" and not ex.is_dir():
            # Run from another directory: use the examples next to the package (editable install).
            ex = Path(__file__).resolve().parents[1] / "examples"
        files = sorted(ex.glob("*.yaml")) + sorted(ex.glob("*.yml"))
        if not files:
            raise UsageError(f"--examples: no *.yaml manifests in {a.examples}")
    docs = []
    for f in files:
        try:
            docs.append((f, manifest.load_file(f)))
        except OSError as e:
            raise UsageError(f"cannot read {f}: {e.strerror}") from None
        except SpecError as e:
            err.print(f"[red]error:[/] invalid manifest {escape(str(f))}: [bold]{escape(e.field)}[/]: {escape(e.message)}",
                      highlight=False)
            return 2
    t0 = time.monotonic()
    tb = Testbed(a.dir, progress=lambda m: err.print(m, markup=False, highlight=False))
    try:
        info = tb.up(agents=a.agents, cpu_devices=a.cpu_devices, grace_s=a.grace_s)
    except TestbedError as e:  # up stopped what it started; the directory may be another testbed's
        err.print(f"[red]error:[/] {escape(str(e))}", highlight=False)
        return 1
    try:
        timed_out = False
        with client_for(info["controller"]) as c:
            ids = []
            for f, doc in docs:
                job = c.submit(doc)
                ids.append(job.id)
                err.print(f"submitted {f.name} → {job.id}", markup=False, highlight=False)
            try:
                final = follow(c, ids, err, a.timeout)
            except TesseraError as e:
                if e.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                timed_out = True
                err.print(f"[red]error:[/] --timeout: not every job finished within {a.timeout:g}s; "
                          "summary of their last state:", highlight=False)
                final = dict(getattr(e, "last", {}))
                for i in ids:
                    try:
                        final[i] = c.get(i)
                    except TesseraError:
                        final.setdefault(i, types_pb2.Job(id=i))
        jobs = [final[i] for i in ids]
        ok = not timed_out and all(j.status.phase == types_pb2.SUCCEEDED for j in jobs)
        total = time.monotonic() - t0
        if a.output == "json":
            emit_json(out, {"ok": ok, "timed_out": timed_out, "wall_s": round(total, 2), "jobs": [
                {"job": j.spec.name, "id": j.id, "phase": phase_name(j.status.phase), "placement": _placement(j),
                 "steps": j.status.step, "first_loss": j.status.first_loss, "final_loss": j.status.loss,
                 "wall_s": round(wall_time(j), 2), "reason": j.status.reason,
                 **({"tasks": [{"task": k.name, "phase": phase_name(k.phase), "steps": k.step, "first_loss": k.first_loss,
                                "final_loss": k.loss, "tokens_per_s": round(k.tokens_per_s, 1)} for k in j.status.tasks]}
                    if j.status.tasks else {})} for j in jobs]})
        else:
            t = Table(title=f"tessera demo: {sum(j.status.phase == types_pb2.SUCCEEDED for j in jobs)}/{len(jobs)} "
                            f"succeeded in {total:.1f}s", header_style="bold", box=None)
            for col in ("JOB", "ID", "PHASE", "NODE", "DEVICES", "STEPS", "LOSS first→final", "WALL"):
                t.add_column(col)
            for j in jobs:
                _row(t, j.spec.name, j.id, _phase(j), _nodes_of(j), _devices_of(j), _steps(j),
                          f"{_loss(j.status.first_loss)} → {_loss(j.status.loss)}", f"{wall_time(j):.1f}s")
            out.print(t)
            for j in jobs:
                if j.status.tasks:
                    out.print(Text(f"{j.spec.name}: {len(j.status.tasks)} tasks on one shared backbone", style="bold"))
                    out.print(tasks_table(j))
            for j in jobs:
                if j.status.phase != types_pb2.SUCCEEDED:
                    err.print(f"[red]{escape(j.spec.name)}[/] {phase_name(j.status.phase)}: {escape(j.status.reason)}",
                              highlight=False)
        return 0 if ok else 1
    finally:
        if a.keep:
            err.print(f"--keep: testbed left running (controller {tb.info.get('controller', '?')}); "
                      f"stop it with: tessera down --dir {a.dir}", markup=False, highlight=False)
        else:
            err.print("tearing the testbed down…")
            tb.down()


# --- parser --------------------------------------------------------------------------------

def seconds(text: str) -> float:
    """argparse type of a duration: a finite number of seconds > 0 (else a usage error,
    exit 2, before anything is sent or started)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return v


def positive_int(text: str) -> int:
    """argparse type of a count: an integer >= 1 (else a usage error, exit 2, before
    anything is started)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--controller", metavar="HOST:PORT",
                        help="controller address (default: env TESSERA_CONTROLLER, else .tessera/testbed.json)")
    common.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    output_only = argparse.ArgumentParser(add_help=False)
    output_only.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")

    ap = argparse.ArgumentParser(prog="tessera", description="Tessera: multiplexed deep-learning training control plane.")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    p = sub.add_parser("submit", parents=[common], help="validate a manifest and submit it")
    p.add_argument("file", metavar="FILE.yaml")
    p.add_argument("--wait", action="store_true", help="follow the job; exit 0 only if it SUCCEEDED")
    p.add_argument("--timeout", type=seconds, default=None, metavar="S", help="with --wait: give up after S seconds")
    p.add_argument("--idempotency-key", default=None, help="retry-safe key (default: a new UUID)")
    p.set_defaults(fn=cmd_submit)

    p = sub.add_parser("get", parents=[common], help="show one job")
    p.add_argument("job")
    p.set_defaults(fn=cmd_get)

    p = sub.add_parser("list", parents=[common], help="list jobs")
    p.add_argument("--tenant", default="")
    p.add_argument("--phase", action="append", metavar="P", help="filter by phase (repeatable)")
    p.add_argument("--tasks", action="store_true", help="also list each peft task as its own job JOB/TASK")
    p.set_defaults(fn=cmd_list)

    p = sub.add_parser("cancel", parents=[common], help="cancel a job")
    p.add_argument("job")
    p.add_argument("--reason", default="cancelled from the CLI")
    p.set_defaults(fn=cmd_cancel)

    p = sub.add_parser("nodes", parents=[common], help="list nodes and their devices")
    p.set_defaults(fn=cmd_nodes)

    p = sub.add_parser("logs", parents=[common], help="print the tail of a job's executor logs")
    p.add_argument("job")
    p.add_argument("--tail", type=int, default=0, metavar="BYTES", help="bytes from the end (default: server's 64 KiB)")
    p.set_defaults(fn=cmd_logs)

    tb = argparse.ArgumentParser(add_help=False)
    tb.add_argument("--dir", default=".tessera", help="testbed state directory (default .tessera)")

    p = sub.add_parser("up", parents=[output_only, tb], help="start a local testbed")
    p.add_argument("--agents", type=positive_int, default=2, metavar="N")
    p.add_argument("--cpu-devices", type=positive_int, default=2, metavar="K", help="CPU devices per agent")
    p.add_argument("--grace-s", type=seconds, default=10.0, metavar="S", help="node grace period of the controller")
    p.add_argument("--detach", action="store_true", help="return once everything is ready; stop with `tessera down`")
    p.add_argument("--keep-state", action="store_true", help="reuse etcd data and state of a previous testbed")
    p.add_argument("--start-timeout", type=seconds, default=60.0, metavar="S", help="per-process readiness deadline")
    p.add_argument("--colocation-benchmark", action="store_true",
                   help="node-1's profilerd measures how jobs sharing a CPU, and one job's ranks, slow each other "
                        "(~30 s at start), so that estimates of jobs sharing a device count it")
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser("down", parents=[output_only, tb], help="stop the local testbed")
    p.set_defaults(fn=cmd_down)

    p = sub.add_parser("demo", parents=[output_only], help="testbed + every example manifest + summary")
    p.add_argument("--dir", default=".tessera/demo", help="testbed state directory (default .tessera/demo)")
    p.add_argument("manifests", nargs="*", metavar="FILE.yaml", help="manifests to run (default: every *.yaml in --examples)")
    p.add_argument("--examples", default="examples", metavar="DIR")
    p.add_argument("--timeout", type=seconds, default=900.0, metavar="S", help="for all jobs together")
    p.add_argument("--keep", action="store_true", help="leave the testbed running")
    p.add_argument("--agents", type=positive_int, default=2, metavar="N")
    p.add_argument("--cpu-devices", type=positive_int, default=2, metavar="K")
    p.add_argument("--grace-s", type=seconds, default=10.0, metavar="S")
    p.set_defaults(fn=cmd_demo)
    return ap


def _default_client(address: str | None) -> Client:
    return Client(address)


def main(argv: list[str] | None = None, client_factory: ClientFactory | None = None,
         out: Console | None = None, err: Console | None = None) -> int:
    """Run the CLI; returns the exit code. ``client_factory(address)`` builds the client
    (tests inject a fake); ``out``/``err`` are the result and progress consoles."""
    a = build_parser().parse_args(argv)
    if out is None:
        out = Console(soft_wrap=a.output == "json")
        if not out.is_terminal:  # piped: do not squeeze tables into 80 columns
            out = Console(soft_wrap=a.output == "json", width=max(out.width, 160))
    err = err or Console(stderr=True, soft_wrap=True)
    try:
        return a.fn(a, client_factory or _default_client, out, err)
    except UsageError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", highlight=False)
        return 2
    except NoControllerAddress as e:  # nothing was asked of a server: a usage error
        err.print(f"[red]error:[/] {escape(e.message)}", highlight=False)
        return 2
    except TesseraError as e:
        err.print(f"[red]error:[/] {e.code.name}: {escape(e.message)}", highlight=False)
        return 1
    except SpecError as e:
        err.print(f"[red]error:[/] [bold]{escape(e.field)}[/]: {escape(e.message)}", highlight=False)
        return 2
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())

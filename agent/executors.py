"""Executor processes: launch one rank per request, pin it to its device, capture its
log, parse its events, report them, stop it.

Contract: an executor is ``python -m agent.runtime --spec FILE`` (see
agent/runtime/README.md) started in its own session; its stdout+stderr go, line by
line and prefixed with ``[rank N]``, to ``<state>/logs/<job_id>.log``. ``TESSERA_EVENT``
lines become reports (``on_report``) and profiler measurements (``on_step``).
Reports of start and exit are never dropped; progress is throttled.

An executor's processes are its leader (the runtime) and whatever it spawns: they share
the leader's session and carry its ``TESSERA_EXECUTOR_TOKEN``. When the leader exits, for
whatever reason, the rest of them are ended (SIGTERM, SIGKILL after ``reap_grace_s`` or a
``stop``'s own grace, whichever ends later; at once after a SIGKILL of the executor)
before its grant is released and its exit reported. The /proc scans that find them run
in worker threads, never in the event loop.

Environment variables (read here):

- ``TESSERA_EXECUTOR_TOKEN`` (set for each executor, never read from the agent's own
  environment): a random token naming one executor, recorded before it is spawned; a
  restarted agent finds the processes of an executor it never recorded by it.
- ``TESSERA_FAILPOINT`` (tests only): ``executor-spawned`` makes the agent process exit at
  once (``os._exit(FAILPOINT_EXIT)``) right after spawning an executor, before its record is
  completed: the crash window of executor records. Not passed on to executors.

Stalls: an executor whose training made no progress (no ``progress`` event) for
``stall_timeout_s`` — or for ``STALL_STEPS`` times its longest step so far, if longer —
after its first one is hung (a collective waiting for a dead peer, a deadlock):
:meth:`ExecutorManager.check_stalls` first sends SIGUSR1 (the runtime dumps every thread's
Python stack into its log, ``faulthandler``), then, ``STALL_DUMP_S`` later, kills it; its
EXITED report says why. A rank that never reports progress (ranks > 0 of most runtimes)
is not watched: a hang there stops rank 0's progress.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import math
import os
import re
import secrets
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent.runtime.report import parse_line
from tessera import log
from tessera.fsutil import atomic_write
from tessera.measurement import BREAKDOWN_MODULES
from tessera.modelkey import model_key, profile_labels
from tessera.procfs import proc_stat as _proc_stat
from tessera.procfs import process_start_ticks  # noqa: F401 - also this module's interface (tests import it here)
from tessera.procfs import read_proc as _read_proc
from tessera.quota import partition_quota

from .devices import LocalDevice
from .zygote import Zygote, ZygoteProcess
from .partitions import BadGrant, CapacityRefused, Grant, MpsBackend, Partitions, UnknownPartition


KILL_WAIT_S = 5.0  # after SIGKILL of a group, how long stop waits for the executor's output to close
KEEP_EXITED = 64  # exited executors kept for GetStatus (ExecutorManager.keep_exited), with their spec files
REAP_GRACE_S = 2.0  # default SIGTERM->SIGKILL delay for what an exited leader left (ExecutorManager.reap_grace_s)
# While reaping, /proc is scanned (off the event loop) for newcomers and stragglers at these
# intervals, doubling from the first to the last; the exit of every process already found
# ends a wait at once (pidfds).
REAP_POLL_S = (0.05, 0.5)
TOKEN_ENV = "TESSERA_EXECUTOR_TOKEN"
STALL_STEPS = 20  # a stall is at least this many of the executor's longest steps
STALL_DUMP_S = 2.0  # from the stack-dump signal to the kill
STEP_WINDOW = 32  # step times an executor keeps for the median its PROGRESS reports carry
FAILPOINT_ENV = "TESSERA_FAILPOINT"
FAILPOINT_EXIT = 86  # the exit code of an agent process stopped by a failpoint


class CapacityError(Exception):
    """The devices asked for are held by another allocation (the agent's own check)."""


class BadRequest(Exception):
    """Unknown device, malformed spec."""


class NotRunning(Exception):
    """No running executor of that allocation and rank on this node."""


class ShuttingDown(Exception):
    """The agent is stopping: no new executors (the API answers UNAVAILABLE)."""


@dataclass
class Executor:
    allocation_id: str
    job_id: str
    rank: int
    device_ids: list[str]
    log_path: Path
    proc: asyncio.subprocess.Process | ZygoteProcess | None = None
    exit_code: int | None = None
    step: int = 0
    loss: float = 0.0
    last_report: float = 0.0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    pump: asyncio.Task | None = None
    model_key: str = ""
    labels: dict = field(default_factory=dict)  # tessera.modelkey.profile_labels of the run
    grant: Grant | None = None      # its partition share; released when it exits
    fault: str = ""                 # set when a device-wide fault (MPS) took it down
    # Latest per-module phases (seconds) of the runtime's ``module: encoder|llm`` progress
    # events, by module; sent with every PROGRESS report (``modules``).
    modules: dict = field(default_factory=dict)
    # CPU busy measurement: cores of its CPU grant (0 = not a CPU executor: not measured)
    # and the (process CPU seconds, monotonic time) mark of the last PROGRESS report.
    cores: int = 0
    cpu_mark: tuple[float, float] | None = None
    # Set when the agent stops it on its own decision (its shutdown, self-fencing): its
    # EXITED report then says ``stopped_by_agent`` and the controller requeues the job as a
    # preemption instead of failing it. Never set by a stop the controller asked for.
    stopped_by_agent: bool = False
    # Its TESSERA_EXECUTOR_TOKEN (every process of it inherits the token) and its leader's
    # start time (``process_start_ticks``; None when it was gone before it could be read).
    token: str = ""
    start_ticks: int | None = None
    transport: asyncio.SubprocessTransport | None = None
    leader_exited: asyncio.Event = field(default_factory=asyncio.Event)  # set when the leader process exits
    # Set by ``stop``: the monotonic time until which it promised no SIGKILL (its grace);
    # the reap of what the leader left honours it.
    stop_deadline: float | None = None
    # Set by a SIGKILL (a stop past its grace, a device fault): the reap of what the leader
    # left (now or once it is gone) sends SIGKILL at once, without a grace.
    kill_requested: asyncio.Event = field(default_factory=asyncio.Event)
    # Stall watch (check_stalls): monotonic time of its last progress event (0: none yet),
    # its longest step so far, and when its stack dump was asked for (a stall seen).
    last_progress: float = 0.0
    max_step_s: float = 0.0
    stall_seen: float | None = None
    # The step times of its last STEP_WINDOW progress events (seconds, finite and > 0):
    # every PROGRESS report carries their median (``step_time_median_s``), so that the
    # step time the controller shows does not hinge on the one step a throttled report
    # happened to sample.
    step_times: collections.deque = field(default_factory=lambda: collections.deque(maxlen=STEP_WINDOW))

    @property
    def grant_id(self) -> str:
        return grant_id(self.allocation_id, self.rank)

    @property
    def running(self) -> bool:
        return self.exit_code is None


Report = dict  # {"kind": "STARTED"|"PROGRESS"|"EXITED", ...}
# BREAKDOWN_MODULES (tessera.measurement): modules a runtime breaks a step into
# (multimodal: ``module: encoder|llm`` progress events with forward/backward/
# communication/idle seconds; the estimator keeps them out of its step windows too); a
# PROGRESS report carries the latest phases of each as ``"modules": {name: {phase: seconds}}``.


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (utime + stime) process ``pid`` has used so far, all its threads (the
    process totals of ``/proc/<pid>/stat``; its children are not counted), or None when
    the file cannot be read or parsed (the process exited, no procfs)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        # The command name (field 2) may hold spaces and parentheses: split after its ")".
        rest = raw[raw.rindex(")") + 2:].split()
        return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15
    except (OSError, ValueError, IndexError):
        return None


def step_time_median(times) -> float:
    """Median of ``times`` (seconds; the caller keeps only finite, positive ones), 0.0
    when there are none: what ``step_time_median_s`` of a PROGRESS report says."""
    return float(statistics.median(times)) if times else 0.0


def busy_fraction(cpu_s: float, wall_s: float, cores: int) -> float | None:
    """CPU busy fraction of a quota of ``cores`` over an interval: ``cpu_s`` CPU seconds
    used in ``wall_s`` seconds, / (wall_s x cores), clamped to [0, 1]; None when the
    interval or the core count is not positive."""
    if wall_s <= 0.0 or cores < 1:
        return None
    return min(max(cpu_s / (wall_s * cores), 0.0), 1.0)


ID_MAX_LEN = 128
_SAFE_ID = re.compile(r"[A-Za-z0-9._-]+")


def id_problem(field_name: str, value: str) -> str | None:
    """Why ``value`` is no valid ``field_name`` (an allocation or job id), naming the field;
    None when it is one. Ids name files under the state dir (``logs/<job>.log``,
    ``specs/<allocation>-r<rank>.json``, the executor records) and grants
    (``<allocation>/r<rank>``): only ``[A-Za-z0-9._-]``, 1 to ``ID_MAX_LEN`` characters,
    not "." or "..". The controller's own (``j-<hex>``, ``a-<hex>``) pass."""
    if not value:
        return f"{field_name}: is required"
    if len(value) > ID_MAX_LEN:
        return f"{field_name}: at most {ID_MAX_LEN} characters, got {len(value)}"
    if not _SAFE_ID.fullmatch(value) or value in (".", ".."):
        return (f"{field_name}: only letters, digits, '.', '_' and '-' (not '.' or '..' alone), "
                f"got {value[:ID_MAX_LEN]!r}")
    return None


def grant_id(allocation_id: str, rank: int) -> str:
    """The partition grant id of one rank of an allocation."""
    return f"{allocation_id}/r{rank}"


def control_file(spec: dict) -> str:
    """The task-control file of a peft executor's runtime spec (agent/runtime/peft/workload.py)."""
    return spec.get("control_file") or os.path.join(spec["checkpoint_dir"], "peft-control.jsonl")


def _has_control(spec: dict) -> bool:
    """Whether a peft executor of ``spec`` starts with task-control lines to apply."""
    if (spec.get("workload") or {}).get("type") != "peft":
        return False
    try:
        return os.path.getsize(control_file(spec)) > 0
    except OSError:
        return False


class ExecutorManager:
    """The executors of this node. ``reap_grace_s``: once an executor's leader has exited,
    how long the rest of its processes get between SIGTERM and SIGKILL. ``keep_exited``:
    how many exited executors stay in ``executors`` (GetStatus shows them) with their spec
    files once their EXITED report was made; older ones are dropped and their spec files
    deleted, so a long-lived node does not grow without bound."""

    def __init__(
        self,
        state_dir: Path,
        devices: list[LocalDevice],
        on_report: Callable[[Executor, Report], Awaitable[None]],
        on_step: Callable[[Executor, dict], Awaitable[None]] | None = None,
        report_interval_s: float = 0.5,
        python: str = sys.executable,
        parts: Partitions | None = None,
        reap_grace_s: float = REAP_GRACE_S,
        keep_exited: int = KEEP_EXITED,
        stall_timeout_s: float = 0.0,
        zygote: bool = False,
    ) -> None:
        # Absolute, once: executors run with it as their cwd and are handed paths under it
        # (their spec file), so a relative one would resolve twice.
        self.state_dir = Path(state_dir).resolve()
        self.reap_grace_s = reap_grace_s
        self.devices = {d.id: d for d in devices}
        self.on_report = on_report
        self.on_step = on_step
        self.report_interval_s = report_interval_s
        self.stall_timeout_s = stall_timeout_s  # 0: stalls are not watched (check_stalls)
        self.python = python
        # ``zygote``: CPU executors are forked from a warm fork server (agent.zygote,
        # started by ``start_zygote``) instead of each importing torch afresh; a spawn it
        # cannot make falls back to a process of its own.
        self.use_zygote = zygote
        self.zygote: Zygote | None = None
        self._zygote_ready: asyncio.Task | None = None
        # With partitions, every executor runs on a grant (the agent's capacity check);
        # without (older callers), a device is held whole by one allocation.
        self.parts = parts
        self.executors: dict[tuple[str, int], Executor] = {}
        self.keep_exited = keep_exited
        self._exited: collections.deque[Executor] = collections.deque()  # oldest first (see _retire)
        # Per (allocation, rank): [lock, launches using it]; see launch.
        self._launch_locks: dict[tuple[str, int], list] = {}
        # Set (for good) when the agent shuts down, before stop_all: launches are refused.
        self.stopping = False
        self.log = log.get(component="executors")
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.state_dir / "specs").mkdir(parents=True, exist_ok=True)
        (self.state_dir / "executors").mkdir(parents=True, exist_ok=True)

    # -- queries ----------------------------------------------------------------------
    def holders(self, device_id: str) -> set[str]:
        return {e.allocation_id for e in self.executors.values() if e.running and device_id in e.device_ids}

    def sharing(self, ex: Executor) -> int:
        """How many allocations run on ``ex``'s partition right now, its own included: the
        running executors whose grant is on the partition of ``ex``'s grant, or, for an
        executor without a grant, that hold any of its devices. Its own other ranks are one
        allocation: a plan's ranks are its shape, not its neighbours. At least 1."""
        if ex.grant is not None:
            pid = ex.grant.partition_id
            allocs = {e.allocation_id for e in self.executors.values()
                      if e.running and e.grant is not None and e.grant.partition_id == pid}
        else:
            allocs = {a for d in ex.device_ids for a in self.holders(d)}
        return len(allocs | {ex.allocation_id})

    def running_allocations(self) -> list[str]:
        return sorted({e.allocation_id for e in self.executors.values() if e.running})

    def log_path(self, job_id: str) -> Path:
        return self.state_dir / "logs" / f"{job_id}.log"

    def append_control(self, allocation_id: str, command: dict) -> str:
        """Append ``command`` as one JSON line to the control file of the allocation's
        running multi-task (peft) executor (its spec's ``control_file``, default
        ``<checkpoint_dir>/peft-control.jsonl``), read by the executor at its next step
        boundary; returns the file. KeyError when no executor of the allocation runs here."""
        live = sorted((e for e in self.executors.values() if e.allocation_id == allocation_id and e.running),
                      key=lambda e: e.rank)
        if not live:
            raise KeyError(f"no running executor of allocation {allocation_id} on this node")
        spec = json.loads(self._spec_path(allocation_id, live[0].rank).read_text())
        path = control_file(spec)
        for e in live:  # its steps now run tasks its spec does not name: no profile of that spec's step
            e.labels.pop("module", None)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # One write of a whole line: the executor only applies lines that end in a newline.
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(command) + "\n")
        self.log.info("task control appended", allocation=allocation_id, job_id=live[0].job_id, command=command)
        return path

    # -- launch -----------------------------------------------------------------------
    async def launch(self, *, allocation_id: str, job_id: str, rank: int, world_size: int, device_ids: list[str],
                     master_addr: str, master_port: int, runtime_spec: dict, checkpoint_dir: str,
                     partition_id: str = "", units: int = 0, memory_bytes: int = 0) -> tuple[Executor, bool]:
        """Start rank ``rank`` of ``allocation_id``; idempotent. Returns (executor, already_running).

        With partitions: grants ``units`` (0: all) + ``memory_bytes`` of ``partition_id``
        (empty: ``device_ids[0]``'s partition) first; ``CapacityError`` with the ledger's
        reason when that exceeds the partition's free capacity, ``BadRequest`` for an
        unknown partition. The grant is released when the executor exits. ``ShuttingDown``
        once ``stopping`` is set (an executor whose start raced with it is stopped)."""
        if self.stopping:
            raise ShuttingDown("agent is shutting down; not launching new executors")
        for name, value in (("allocation_id", allocation_id), ("job_id", job_id)):
            why = id_problem(name, value)
            if why:
                raise BadRequest(why)
        key = (allocation_id, rank)
        # One launch per (allocation, rank) at a time, across the grant and the start: a
        # concurrent repeat would get the same (idempotent) grant and start a second
        # process on it, whose grant the first one's exit would release.
        entry = self._launch_locks.setdefault(key, [asyncio.Lock(), 0])
        entry[1] += 1  # launches using this lock (dropped with the last one)
        try:
            async with entry[0]:
                return await self._launch_locked(key, allocation_id, job_id, rank, world_size, device_ids,
                                                 master_addr, master_port, runtime_spec, checkpoint_dir,
                                                 partition_id, units, memory_bytes)
        finally:
            entry[1] -= 1
            if not entry[1]:
                self._launch_locks.pop(key, None)

    async def _launch_locked(self, key, allocation_id: str, job_id: str, rank: int, world_size: int,
                             device_ids: list[str], master_addr: str, master_port: int, runtime_spec: dict,
                             checkpoint_dir: str, partition_id: str, units: int,
                             memory_bytes: int) -> tuple[Executor, bool]:
        if self.stopping:
            raise ShuttingDown("agent is shutting down; not launching new executors")
        if key in self.executors and self.executors[key].running:
            return self.executors[key], True
        if not device_ids and not partition_id:
            raise BadRequest("device_ids: at least one device (or a partition_id) is required")
        for d in device_ids:  # before the grant: an unknown device is the device_ids' fault
            if d not in self.devices:
                raise BadRequest(f"device_ids: unknown device {d!r} (this node has {', '.join(self.devices)})")
        if checkpoint_dir and not os.path.isabs(checkpoint_dir):
            # The executor runs in the state dir, the agent (append_control) elsewhere.
            raise BadRequest(f"checkpoint_dir: must be an absolute path, got {checkpoint_dir!r}")
        grant = None
        if self.parts is not None:
            grant = self._grant(allocation_id, rank, device_ids, partition_id, units, memory_bytes)
            device_ids = device_ids or [grant.device_id]
        try:
            ex, already = await self._launch(key, allocation_id, job_id, rank, world_size, device_ids, master_addr,
                                             master_port, runtime_spec, checkpoint_dir, grant)
        except BaseException:
            if grant is not None:
                self.parts.release(grant.grant_id)
            raise
        if self.stopping:
            # Shutdown began while it was starting: stop_all may not have seen it.
            await self._stop(allocation_id, 0.0, by_agent=True)  # holding the launch lock: not stop()
            raise ShuttingDown("agent is shutting down; not launching new executors")
        return ex, already

    def _quota_label(self, dev: LocalDevice, grant: Grant | None) -> str:
        """The executor's quota in the performance model's units (cores of a CPU, the GPU's
        SM share), by the controller's rule (``tessera.quota.partition_quota``): its steps'
        label ``quota``, under which the estimator files their profile. Without a grant:
        the whole device; 1 when the device's capacity says nothing."""
        info = None
        if grant is not None:
            info = next((p for p in self.parts.describe() if p.id == grant.partition_id), None)
        q = partition_quota(dev.kind, dev.capacity, info, grant.units if grant is not None else 0)
        return f"{1.0 if q is None else q:g}"

    def _grant(self, allocation_id: str, rank: int, device_ids: list[str], partition_id: str, units: int,
               memory_bytes: int) -> Grant:
        pid = partition_id or device_ids[0]
        if units < 0:
            raise BadRequest(f"units: must be >= 0, got {units}")
        if memory_bytes < 0:
            raise BadRequest(f"memory_bytes: must be >= 0, got {memory_bytes}")
        info = next((p for p in self.parts.describe() if p.id == pid), None)
        if info is None:
            known = ", ".join(p.id for p in self.parts.describe())
            raise BadRequest(f"partition_id: unknown partition {pid!r} (this node has {known})")
        if device_ids and info.device_id not in device_ids:
            raise BadRequest(f"partition_id: {pid} is on device {info.device_id}, not on {', '.join(device_ids)}")
        try:
            return self.parts.grant(grant_id(allocation_id, rank), pid, units or info.capacity_units, memory_bytes)
        except CapacityRefused as e:
            holders = sorted({g.grant_id.rsplit("/", 1)[0] for g in self.parts.grants() if g.partition_id == pid})
            raise CapacityError(f"{e} (held by allocation {', '.join(holders)})" if holders else str(e)) from None
        except BadGrant as e:
            # A refusal about another field (MPS: memory_bytes under 1 MiB) already names it.
            raise BadRequest(str(e) if getattr(e, "field", "") else f"partition_id: {e}") from None
        except UnknownPartition as e:
            raise BadRequest(f"partition_id: {e}") from None

    async def _launch(self, key, allocation_id: str, job_id: str, rank: int, world_size: int, device_ids: list[str],
                      master_addr: str, master_port: int, runtime_spec: dict, checkpoint_dir: str,
                      grant: Grant | None) -> tuple[Executor, bool]:
        for d in device_ids:
            if d not in self.devices:
                raise BadRequest(f"device_ids: unknown device {d!r} (this node has {', '.join(self.devices)})")
            other = self.holders(d) - {allocation_id}
            if other and grant is None:
                raise CapacityError(f"device {d} is held by allocation {', '.join(sorted(other))}; refusing to oversubscribe it")
        devs = [self.devices[d] for d in device_ids]
        cores = sorted(grant.cores) if grant is not None and grant.cores else sorted({c for d in devs for c in d.cores})
        spec = dict(runtime_spec)
        spec["dist"] = {
            "rank": rank, "world_size": world_size, "master_addr": master_addr, "master_port": master_port,
            "backend": "nccl" if devs[0].kind == "gpu" else "gloo",
        }
        spec["allocation_id"] = allocation_id  # a peft runner applies only its own allocation's fused adds
        spec["checkpoint_dir"] = checkpoint_dir or str((self.state_dir / "checkpoints" / job_id).resolve())
        spec["threads"] = (grant.threads if grant is not None and grant.threads else max(1, len(cores)) if cores else 1)
        try:
            labels = profile_labels(spec, devs[0].kind)
            key_ = model_key(spec.get("workload", {}))
        except (AttributeError, TypeError, ValueError, KeyError) as e:
            # A workload section of the wrong shape (the servicer checks the usual ones).
            raise BadRequest(f"runtime_spec_json.workload: malformed ({e!r})") from None
        labels["quota"] = self._quota_label(devs[0], grant)
        if _has_control(spec):  # a relaunch re-applies earlier adds/cancels: not the spec's step shape
            labels.pop("module", None)
        env = dict(os.environ)
        env.pop(FAILPOINT_ENV, None)
        env["OMP_NUM_THREADS"] = str(spec["threads"])
        env["TESSERA_JOB_ID"], env["TESSERA_ALLOCATION_ID"], env["TESSERA_RANK"] = job_id, allocation_id, str(rank)
        env["PYTHONUNBUFFERED"] = "1"
        if devs[0].kind == "gpu":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(d.uuid or str(d.index) for d in devs)
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""

        env["TESSERA_CPU_CORES"] = ",".join(map(str, cores))
        if grant is not None:
            env = grant.apply_env(env)  # the partition's quota wins (MPS percentages, core sets)
        ex = Executor(allocation_id, job_id, rank, list(device_ids), self.log_path(job_id),
                      model_key=key_, labels=labels, grant=grant, token=secrets.token_hex(16))
        env[TOKEN_ENV] = ex.token
        # Written once nothing can refuse the request any more (removed if the spawn fails).
        spec_path = self._spec_path(allocation_id, rank)
        spec_path.write_text(json.dumps(spec, indent=1))
        # Opened before the spawn: an executor whose output cannot be kept is never started
        # (the OSError goes to the caller, which releases the grant).
        try:
            log_file = open(ex.log_path, "ab", buffering=0)
        except BaseException:
            spec_path.unlink(missing_ok=True)
            raise
        # Recorded before it exists (an intent: its token, no pid yet), so that a crash of
        # this agent at any point after the spawn leaves a record to find it by.
        self._write_record(ex)
        try:
            # create_subprocess_exec, with a protocol that says when the leader exits: the
            # Process's wait() also waits for its output to close, which a member of its
            # group may hold open for ever.
            loop = asyncio.get_running_loop()
            argv = [self.python, "-m", "agent.runtime", "--spec", str(spec_path)]
            # Forked only when its threads fit its cores: OpenMP (libgomp) decides once, at
            # load, whether idle threads spin, from the CPUs it could run on then — in a
            # fork of the zygote the agent's, not the executor's. With more threads than
            # cores (a core set declared larger than the machine: --cpu-units-per-core > 1)
            # a fork's threads spin against each other (measured: 60 MLP steps, 2 threads on
            # 1 core, 9.2 s instead of 0.47 s); a process of its own throttles them.
            forked = (await self._zygote_spawn(argv, env)
                      if devs[0].kind == "cpu" and cores and spec["threads"] <= len(cores) else None)
            if forked is not None:
                ex.proc = ex_proc = forked
                ex.transport, ex.leader_exited = forked.transport, forked.leader_exited
            else:
                transport, protocol = await loop.subprocess_exec(
                    lambda: _ExecutorProtocol(loop), *argv,
                    stdin=None, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
                    start_new_session=True, cwd=str(self.state_dir),
                )
                ex.proc = ex_proc = asyncio.subprocess.Process(transport, protocol, loop)
                ex.transport, ex.leader_exited = transport, protocol.leader_exited
        except BaseException:
            log_file.close()
            self._remove_record(ex)
            spec_path.unlink(missing_ok=True)
            raise
        _failpoint("executor-spawned")
        ex.start_ticks = process_start_ticks(ex_proc.pid)
        if cores:
            # Pin from the parent: a preexec_fn is unsafe in a process with gRPC threads
            # (fork without exec may deadlock or crash). The child has not started its
            # thread pools yet (torch is still importing), and threads inherit affinity.
            try:
                os.sched_setaffinity(ex_proc.pid, cores)
            except ProcessLookupError:
                pass
            except OSError as e:
                # Not pinned (e.g. cores outside this agent's own affinity): it must not run
                # unconfined once the caller releases its grant. Killed, reaped, unrecorded.
                await self._discard_spawned(ex, log_file)
                spec_path.unlink(missing_ok=True)
                raise BadRequest(f"cannot pin the executor to cores {sorted(cores)}: {e.strerror or e}") from None
        if devs[0].kind == "cpu" and cores:
            ex.cores = len(cores)
            ex.cpu_mark = (0.0, time.monotonic())  # a fresh process: no CPU time used yet
        self._write_record(ex)  # completes the intent: pid, group, start time
        self.executors[key] = ex
        self.log.info("executor started", job_id=job_id, allocation=allocation_id, rank=rank, pid=ex.proc.pid,
                      devices=device_ids, cores=cores, partition=grant.partition_id if grant else "",
                      units=grant.units if grant else 0)
        ex.pump = asyncio.create_task(self._pump(ex, log_file))
        try:
            await self.on_report(ex, {"kind": "STARTED"})
        except Exception as e:
            # The executor runs and its pump owns the grant from here on: a failed report
            # must not make the caller release the grant under a running process.
            self.log.error("STARTED report failed; the executor runs on", job_id=job_id,
                           allocation=allocation_id, rank=rank, error=repr(e))
        return ex, False

    def start_zygote(self) -> None:
        """Start the executor fork server in the background (with ``zygote``, on a node with
        CPU devices; once). The first CPU launch starts it: a node that never runs a CPU
        executor pays nothing, and that launch waits for it to be warm (about what its own
        import would have taken); every later one is a fork."""
        if not self.use_zygote or self._zygote_ready is not None:
            return
        if not any(d.kind == "cpu" for d in self.devices.values()):
            return  # GPU executors keep processes of their own (module doc of agent.runtime.zygote)
        self.zygote = Zygote(self.python, self.state_dir / "zygote.log")  # logs/ holds the jobs' logs only
        env = {k: v for k, v in os.environ.items() if k != FAILPOINT_ENV}
        self._zygote_ready = asyncio.create_task(self.zygote.start(env, str(self.state_dir)))

    async def _zygote_spawn(self, argv: list[str], env: dict) -> ZygoteProcess | None:
        """The executor forked by the zygote, or None: no zygote (not asked for, not
        warm, gone) or it refused — the caller spawns a process of its own."""
        self.start_zygote()
        if self._zygote_ready is None or self.zygote is None:
            return None
        try:
            if not await asyncio.shield(self._zygote_ready) or not self.zygote.alive:
                return None
            return await self.zygote.spawn(argv, env, str(self.state_dir))
        except asyncio.CancelledError:
            if self._zygote_ready.cancelled():
                return None  # stop_zygote meanwhile (the agent is stopping), not this launch
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the zygote: a process of its own
            self.log.warning("executor zygote could not spawn; the executor starts as its own process",
                             error=repr(e))
            return None

    async def stop_zygote(self) -> None:
        """Stop the fork server (after ``stop_all``: an executor of it still running is killed)."""
        if self._zygote_ready is not None:
            self._zygote_ready.cancel()  # no-op once it is done
            try:
                await self._zygote_ready
            except (asyncio.CancelledError, Exception):
                pass
        if self.zygote is not None:
            await self.zygote.stop()

    async def _discard_spawned(self, ex: Executor, log_file) -> None:
        """Undo a spawn that cannot go on (before its pump exists): SIGKILL its process
        group, wait for the leader, close its log, remove its record."""
        assert ex.proc is not None
        if not await self._kill_leader(ex):
            self.log.error("a discarded executor did not exit after SIGKILL", job_id=ex.job_id, pid=ex.proc.pid)
        if ex.transport is not None:
            ex.transport.close()
        log_file.close()
        self._remove_record(ex)

    async def _pump(self, ex: Executor, f) -> None:
        """Copy output to the log file ``f`` (opened before the spawn; closed here), turn
        events into reports; once the leader exits, end the rest of its processes
        (``_reap``), then release the grant and report the exit. The executor counts as
        running (``running``, its grant held) until then. Whatever fails here (a log write,
        a report callback, a /proc scan), the executor is killed if still running, its
        grant released, its exit reported and ``done`` set: ``stop`` and the agent's
        shutdown wait on it."""
        assert ex.proc is not None
        last_error = ""
        try:
            last_error = await self._follow(ex, f)
        except Exception as e:
            self.log.exception("executor log pump failed; killing the executor", job_id=ex.job_id,
                               allocation=ex.allocation_id, rank=ex.rank, error=repr(e))
            last_error = f"agent: handling the executor's output failed: {e!r}"
            await self._abandon(ex)
        except BaseException:
            # Cancelled (the event loop is going away): no reports any more, but nothing
            # waits for ever, and neither the grant nor the record goes before the processes
            # do: SIGKILL the group, wait (bounded) for the leader, SIGKILL what carries the
            # token; if that cannot be done the record stays, for the next agent's
            # ``kill_orphans``.
            gone = False
            try:
                if await self._kill_leader(ex):
                    for pid, ticks in executor_processes(ex.token, ex.proc.pid, ex.start_ticks):
                        _send_verified(pid, ticks, signal.SIGKILL)
                    gone = True
            except BaseException:  # cancelled again
                pass
            self._finish(ex, last_error, keep_record=not gone)
            raise
        finally:
            f.close()
        self._finish(ex, last_error)
        try:
            await self.on_report(ex, {"kind": "EXITED", "exit_code": ex.exit_code,
                                      "message": ex.fault[:400] if ex.fault else
                                      "" if ex.exit_code == 0 else last_error[-400:],
                                      # A rank that finished (0) or faulted is reported as such.
                                      "stopped_by_agent": ex.stopped_by_agent and ex.exit_code != 0 and not ex.fault})
        finally:
            self._retire(ex)

    def _retire(self, ex: Executor) -> None:
        """``ex`` exited and its EXITED report was made: it joins the recent history; the
        exited executors beyond the last ``keep_exited`` leave ``executors`` and their spec
        files are deleted — unless a later launch of the same allocation and rank took
        their place (its spec file is the new one's)."""
        self._exited.append(ex)
        while len(self._exited) > self.keep_exited:
            old = self._exited.popleft()
            key = (old.allocation_id, old.rank)
            if self.executors.get(key) is not old:
                continue
            del self.executors[key]
            try:
                self._spec_path(*key).unlink(missing_ok=True)
            except OSError as e:
                self.log.warning("cannot remove the spec file of an exited executor", allocation=old.allocation_id,
                                 rank=old.rank, error=str(e))

    async def _follow(self, ex: Executor, f) -> str:
        """``_pump``'s normal path, up to the exit code: returns the executor's last error."""
        assert ex.proc is not None and ex.proc.stdout is not None
        prefix = f"[rank {ex.rank}] ".encode()
        reader = asyncio.create_task(self._copy_output(ex, f, prefix))
        leader = asyncio.ensure_future(ex.leader_exited.wait())
        try:
            # A reader that fails while the leader runs is not left unnoticed (nothing would
            # drain the pipe: the executor would block on its next write).
            await asyncio.wait({leader, reader}, return_when=asyncio.FIRST_COMPLETED)
            if reader.done() and reader.exception() is not None:
                reader.result()
            await leader
        except BaseException:
            reader.cancel()
            raise
        finally:
            leader.cancel()
        # Not EOF first: a member of the group that holds the output open (a worker that
        # ignores SIGTERM) would keep the exit unreported, and one that closed it would leak.
        try:
            await self._reap(ex)
        except BaseException:
            reader.cancel()
            raise
        try:
            async with asyncio.timeout(KILL_WAIT_S):
                last_error = await asyncio.shield(reader)
        except TimeoutError:
            # Its processes are gone, yet the output is open: a process outside its
            # session and without its token (or not ours to kill) holds it.
            self.log.warning("executor output still open after its processes ended; closing it",
                             job_id=ex.job_id, allocation=ex.allocation_id, rank=ex.rank)
            _close_output(ex)
            last_error = await reader
        code = await ex.proc.wait()  # at once: the leader has exited and its output is closed
        # A signal kill shows as a negative return code: report it the shell's way.
        ex.exit_code = code if code >= 0 else 128 - code
        try:
            f.write(prefix + f"exited with code {ex.exit_code}\n".encode())
        except OSError as e:
            self.log.error("cannot write the executor log", job_id=ex.job_id, path=str(ex.log_path), error=str(e))
        return last_error

    async def _kill_leader(self, ex: Executor) -> bool:
        """SIGKILL ``ex``'s process group (``_signal``: while its leader is not reaped the
        group id is still its own; a reap then SIGKILLs what is left at once) and wait up to
        ``KILL_WAIT_S`` for the leader to exit. Whether it did."""
        _signal(ex, signal.SIGKILL)
        try:
            async with asyncio.timeout(KILL_WAIT_S):
                await ex.leader_exited.wait()
            return True
        except TimeoutError:
            return False

    async def _abandon(self, ex: Executor) -> None:
        """After ``_follow`` failed: SIGKILL whatever is left of ``ex`` (its leader if still
        running, then what it left: ``_reap`` with ``kill_requested``) and close its output
        (its exit code is taken by ``_finish``). Best effort: never raises."""
        assert ex.proc is not None
        if not await self._kill_leader(ex):
            self.log.error("executor leader survives SIGKILL", job_id=ex.job_id, allocation=ex.allocation_id,
                           rank=ex.rank, pid=ex.proc.pid)
        try:
            await self._reap(ex)
        except Exception as e:
            self.log.exception("cannot end the processes of an abandoned executor", job_id=ex.job_id,
                               allocation=ex.allocation_id, rank=ex.rank, error=repr(e))
        _close_output(ex)

    def _finish(self, ex: Executor, last_error: str, keep_record: bool = False) -> None:
        """The end of ``ex`` once its processes are gone (or abandoned): an MPS-wide fault
        check, the grant released, the record removed (kept with ``keep_record``: processes
        may survive, the next agent start kills them by it), ``done`` set. Never raises
        before ``done`` is set."""
        try:
            if ex.exit_code is None:
                code = ex.proc.returncode if ex.proc is not None else None
                ex.exit_code = 1 if code is None else code if code >= 0 else 128 - code
            self.log.info("executor exited", job_id=ex.job_id, allocation=ex.allocation_id, rank=ex.rank,
                          code=ex.exit_code)
            if ex.grant is not None:
                try:
                    # Before releasing: a fatal MPS fault in this client took down every client of the GPU.
                    backend = self.parts.backends.get(ex.grant.device_id)
                    if isinstance(backend, MpsBackend) and not ex.fault:
                        hit = backend.faulted_by_exit(ex.grant_id, ex.exit_code, last_error)
                        if hit:
                            ex.fault = (f"MPS fatal fault on {backend.device_id} (rank {ex.rank} of "
                                        f"{ex.allocation_id}: {last_error[-200:]}); every client of the GPU is failed")
                            self.fail_grants(hit, ex.fault)
                finally:
                    self.parts.release(ex.grant_id)
            if ex.fault and ex.exit_code == 0:
                ex.exit_code = 1  # a faulted executor never counts as a success
            try:
                if not keep_record:
                    self._remove_record(ex)
            except OSError as e:
                self.log.warning("cannot remove executor record", allocation=ex.allocation_id, rank=ex.rank,
                                 error=str(e))
        finally:
            ex.done.set()

    async def _copy_output(self, ex: Executor, f, prefix: bytes) -> str:
        """Copy ``ex``'s output to ``f`` line by line until EOF, handling its events; returns
        its last error (the last fatal ``error`` event's message, or the last non-event
        line). An ``error`` event with ``"fatal": false`` (a rejected peft control line: the
        run goes on) is logged like any line but never becomes the last error. The pipe is
        drained whatever happens: a line longer than the stream limit (64 KiB) is dropped
        with a note in the log, a failed log write drops the text (logged once), an event
        whose handling raises is logged and passed over."""
        last_error = ""
        write_failed = False

        def write(data: bytes) -> None:
            nonlocal write_failed
            if write_failed:
                return
            try:
                f.write(data)
            except OSError as e:
                write_failed = True
                self.log.error("cannot write the executor log; its output is dropped from now on",
                               job_id=ex.job_id, allocation=ex.allocation_id, rank=ex.rank, path=str(ex.log_path),
                               error=str(e))

        assert ex.proc is not None and ex.proc.stdout is not None
        async for raw in output_lines(ex.proc.stdout):
            if raw is None:
                write(prefix + b"<output line longer than 64 KiB dropped>\n")
                continue
            write(prefix + raw)
            line = raw.decode(errors="replace").rstrip("\n")
            ev = parse_line(line)
            if ev is None:
                if line.strip():
                    last_error = line.strip()
                continue
            try:
                await self._event(ex, ev)
            except Exception as e:
                self.log.exception("executor event handling failed; event passed over", job_id=ex.job_id,
                                   allocation=ex.allocation_id, rank=ex.rank, kind=ev.get("event"), error=repr(e))
            if ev["event"] == "error" and ev.get("fatal") is not False:
                last_error = str(ev.get("message", ""))
        return last_error

    async def _reap(self, ex: Executor) -> None:
        """After ``ex``'s leader exited: SIGTERM what is left of its processes (its session's
        members, its token's carriers: ``executor_processes``), SIGKILL them after
        ``reap_grace_s`` — or, while a ``stop`` is in progress, not before its own grace
        ends, if that is later; at once on ``kill_requested`` — and wait up to
        ``KILL_WAIT_S`` for them to be gone. /proc is scanned off the event loop; processes
        spawned meanwhile are found by a new scan (``REAP_POLL_S``, backing off), the exit
        of those already found ends a wait at once. Never signals a pid that was reused."""
        assert ex.proc is not None
        scan = functools.partial(executor_processes, ex.token, ex.proc.pid, ex.start_ticks)
        left = await asyncio.to_thread(scan)
        if not left:
            return
        began = time.monotonic()

        def term_deadline() -> float:  # read again at every round: a stop may begin meanwhile
            return max(began + self.reap_grace_s, ex.stop_deadline if ex.stop_deadline is not None else 0.0)

        self.log.warning("executor leader exited; ending the processes it left", job_id=ex.job_id,
                         allocation=ex.allocation_id, rank=ex.rank, pid=ex.proc.pid, code=ex.proc.returncode,
                         pids=[p for p, _ in left], grace_s=round(term_deadline() - began, 3))
        termed: set[tuple[int, int]] = set()
        sig, kill_deadline, interval = signal.SIGTERM, 0.0, REAP_POLL_S[0]
        while True:
            now = time.monotonic()
            if sig == signal.SIGTERM and (ex.kill_requested.is_set() or now >= term_deadline()):
                sig, kill_deadline, interval = signal.SIGKILL, now + KILL_WAIT_S, REAP_POLL_S[0]
            for p in left:
                if sig == signal.SIGKILL or p not in termed:  # SIGKILL again: newcomers, racers
                    _send_verified(*p, sig)
                    termed.add(p)
            if sig == signal.SIGKILL and now >= kill_deadline:
                break
            until = term_deadline() if sig == signal.SIGTERM else kill_deadline
            await _wait_exits(left, min(interval, until - now),
                              ex.kill_requested if sig == signal.SIGTERM else None)
            interval = min(interval * 2, REAP_POLL_S[1])
            left = await asyncio.to_thread(scan)
            if not left:
                return
        self.log.error("processes of an exited executor survive SIGKILL", job_id=ex.job_id,
                       allocation=ex.allocation_id, rank=ex.rank, pids=[p for p, _ in left])

    async def _event(self, ex: Executor, ev: dict) -> None:
        if ev["event"] == "task":
            # A peft task's lifecycle (few events: start, every report_every steps, end):
            # reported unthrottled, so that no phase change is dropped.
            await self.on_report(ex, {"kind": "TASK", "task": str(ev.get("task", "")),
                                      "task_phase": str(ev.get("phase", "")), "step": int(ev.get("step") or 0),
                                      "total_steps": int(ev.get("steps") or 0), "loss": float(ev.get("loss") or 0.0),
                                      "tokens_per_s": float(ev.get("tokens_per_s") or 0.0)})
            return
        if ev["event"] != "progress":
            return
        if ev.get("module") in BREAKDOWN_MODULES:
            ex.modules[ev["module"]] = {k: float(v) for k, v in (ev.get("phases") or {}).items()}
        ex.last_progress = time.monotonic()
        ex.stall_seen = None
        try:
            dt = float(ev.get("step_time_s") or 0.0)
        except (TypeError, ValueError):
            dt = 0.0
        if not (math.isfinite(dt) and dt > 0):
            dt = 0.0  # no step time: what the report sends (the controller keeps the last one)
        if dt > 0:
            ex.max_step_s = max(ex.max_step_s, dt)
            if ev.get("module") not in BREAKDOWN_MODULES:  # those repeat their step's wall time
                ex.step_times.append(dt)
        ex.step = int(ev.get("step", ex.step))
        ex.loss = float(ev.get("loss", ex.loss))
        if self.on_step is not None:
            await self.on_step(ex, ev)
        now = time.monotonic()
        final = ev.get("total") is not None and ex.step >= int(ev["total"])
        if now - ex.last_report >= self.report_interval_s or final or ex.last_report == 0:
            ex.last_report = now
            r = {"kind": "PROGRESS", "step": ex.step, "total_steps": int(ev.get("total", 0) or 0),
                 "loss": ex.loss, "step_time_s": dt,
                 "step_time_median_s": step_time_median(ex.step_times),
                 "modules": {m: dict(ph) for m, ph in ex.modules.items()}}
            busy = self.measure_busy(ex, now)
            if busy is not None:
                r["busy"] = busy
            await self.on_report(ex, r)

    def measure_busy(self, ex: Executor, now: float) -> float | None:
        """``ex``'s CPU busy fraction of its quota since its last mark (its previous PROGRESS
        report, or its start), and a new mark at ``now``: ``busy_fraction`` of the
        process's CPU seconds delta over the wall delta and its grant's current cores. None
        when not measured: no process, not a CPU executor, /proc unreadable, or no interval.
        After a live quota change the interval straddles two core counts; the current one
        is used (one report off, the EWMA in the controller smooths it).
        TODO(gpu): GPU executors — NVML per-process utilisation
        (nvmlDeviceGetProcessUtilization, SM % of the process / the grant's SM share) into
        the same ``busy`` report field; not measured today (``cores`` stays 0)."""
        if ex.proc is None or ex.cores < 1 or ex.cpu_mark is None:
            return None
        cpu = process_cpu_s(ex.proc.pid)
        if cpu is None:
            return None
        prev_cpu, prev_t = ex.cpu_mark
        ex.cpu_mark = (cpu, now)
        return busy_fraction(cpu - prev_cpu, now - prev_t, ex.cores)

    # -- live repartition -------------------------------------------------------------
    def update_grant(self, allocation_id: str, rank: int, units: int) -> tuple[Executor, Grant, int]:
        """Change the quota of running rank ``rank`` of ``allocation_id`` to ``units`` without
        restarting it: the grant is re-taken through the partition ledger, then every thread
        of the process is re-pinned to the grant's cores. Returns (executor, new grant, old
        units). Raises NotRunning, BadRequest (units < 1, no partitions), NotLive (the
        backend cannot do it in place) or CapacityError (the reason names the partition, the
        free amount and the holders); a refusal changes nothing.

        The ``gpt`` and ``peft`` runtimes follow at their next step boundary: their torch
        thread count (and peft's worker pool) is rescaled to the new core count
        (``agent.runtime.threads``; a ``threads`` event in the executor log). The
        ``multimodal`` runtime keeps its thread budgets; its module workers, re-pinned with
        every other thread, share the new cores (the per-module split returns at a relaunch)."""
        if units < 1:
            raise BadRequest(f"units: must be >= 1, got {units}")
        ex = self.executors.get((allocation_id, rank))
        if ex is None or not ex.running or ex.proc is None:
            raise NotRunning(f"no running executor of allocation {allocation_id} rank {rank} on this node")
        if self.parts is None or ex.grant is None:
            raise BadRequest(f"allocation_id: rank {rank} of {allocation_id} runs without a partition grant")
        old = ex.grant
        try:
            g = self.parts.regrant(ex.grant_id, units)
        except CapacityRefused as e:
            holders = sorted({h.grant_id.rsplit("/", 1)[0] for h in self.parts.grants()
                              if h.partition_id == old.partition_id and h.grant_id != ex.grant_id})
            raise CapacityError(f"{e} (held by allocation {', '.join(holders)})" if holders else str(e)) from None
        except BadGrant as e:
            raise BadRequest(f"units: {e}") from None
        ex.grant = g
        # The window's steps ran on the old quota: its median would mix both for up to
        # STEP_WINDOW steps (the controller clears the job's step times with the decision).
        ex.step_times.clear()
        # And its profile labels: the steps from here on run on the new quota, a new run of
        # the estimator (run key: quota), whose first steps are its warm-up; under the old
        # label they would join the old quota's profile point.
        if "threads" in ex.labels:
            ex.labels["threads"] = str(g.threads or (len(g.cores) if g.cores else ex.labels["threads"]))
        if "quota" in ex.labels and ex.device_ids and ex.device_ids[0] in self.devices:
            ex.labels["quota"] = self._quota_label(self.devices[ex.device_ids[0]], g)
        if g.cores:
            pin_process(ex.proc.pid, g.cores)
            ex.cores = len(g.cores)
        self.log.info("executor repartitioned live", job_id=ex.job_id, allocation=allocation_id, rank=rank,
                      pid=ex.proc.pid, partition=g.partition_id, old_units=old.units, units=g.units,
                      cores=list(g.cores))
        return ex, g, old.units

    # -- stop -------------------------------------------------------------------------
    async def stop(self, allocation_id: str, grace_s: float = 10.0, by_agent: bool = False) -> int:
        """SIGTERM every running rank of ``allocation_id``, SIGKILL after ``grace_s``;
        returns how many were signalled. Waits until they are gone. ``by_agent``: the
        agent's own decision (shutdown, self-fencing), not the controller's: their EXITED
        reports carry ``stopped_by_agent`` (the job is requeued, not failed).

        A launch of the allocation already in progress when the stop arrives (granted,
        spawning) is waited for first (its launch lock), so the executor it starts is
        stopped too, never left running after the stop answered. A launch that arrives
        after the stop is a later request: it is not stopped."""
        for key, entry in list(self._launch_locks.items()):
            if key[0] == allocation_id:
                async with entry[0]:
                    pass  # that launch has now registered its executor (or failed)
        return await self._stop(allocation_id, grace_s, by_agent)

    async def _stop(self, allocation_id: str, grace_s: float, by_agent: bool) -> int:
        """``stop`` without waiting for launches in progress (a launch holding its lock
        calls this)."""
        targets = [e for e in self.executors.values() if e.allocation_id == allocation_id and e.running]
        deadline = time.monotonic() + grace_s
        for e in targets:
            if by_agent:
                e.stopped_by_agent = True
            # What its leader leaves once it dies of this SIGTERM gets the same grace (_reap).
            e.stop_deadline = deadline if e.stop_deadline is None else min(e.stop_deadline, deadline)
            _signal(e, signal.SIGTERM)
        for e in targets:
            try:
                async with asyncio.timeout(grace_s):
                    await e.done.wait()
            except TimeoutError:
                _signal(e, signal.SIGKILL)
                try:
                    async with asyncio.timeout(KILL_WAIT_S):
                        await e.done.wait()
                except TimeoutError:
                    # SIGKILL took the whole group, yet its stdout is still open: a process
                    # that left the group (setsid) holds it. End the log pump at EOF so the
                    # exit is reported and the grant released.
                    self.log.warning("executor output still open after SIGKILL of its process group; "
                                     "closing it", job_id=e.job_id, allocation=e.allocation_id, rank=e.rank)
                    _close_output(e)
                    await e.done.wait()
        if targets:
            self.log.info("executors stopped", allocation=allocation_id, count=len(targets))
        return len(targets)

    # -- device-wide faults -----------------------------------------------------------
    def fail_grants(self, grants: list[Grant], why: str) -> list[Executor]:
        """Mark the running executors of ``grants`` faulted with ``why`` and kill them
        (their GPU context is gone: nothing to checkpoint). Their EXITED reports carry
        ``why`` and a non-zero code. Returns the executors hit."""
        ids = {g.grant_id for g in grants}
        hit = [e for e in self.executors.values() if e.running and e.grant_id in ids]
        for e in hit:
            if not e.fault:
                e.fault = why
            _signal(e, signal.SIGKILL)
        if hit:
            self.log.warning("device fault: failing executors", why=why,
                             executors=[f"{e.allocation_id}/r{e.rank}" for e in hit])
        return hit

    def stall_limit(self, ex: Executor) -> float:
        """Seconds without progress after which ``ex`` counts as stalled (inf: not watched)."""
        if self.stall_timeout_s <= 0:
            return math.inf
        return max(self.stall_timeout_s, STALL_STEPS * ex.max_step_s)

    def check_stalls(self, now: float | None = None) -> list[Executor]:
        """Kill the running executors whose training stopped (module doc, "Stalls"):
        the first check past the limit asks for a stack dump (SIGUSR1), one at least
        ``STALL_DUMP_S`` later kills it (SIGKILL; its EXITED report carries why). One
        being stopped is left to its stop. Returns the executors killed now. Call
        periodically (the agent: every few seconds)."""
        now = time.monotonic() if now is None else now
        killed: list[Executor] = []
        for ex in list(self.executors.values()):
            if not ex.running or ex.last_progress <= 0 or ex.stop_deadline is not None or ex.fault:
                continue
            quiet, limit = now - ex.last_progress, self.stall_limit(ex)
            if quiet <= limit:
                continue
            if ex.stall_seen is None:
                ex.stall_seen = now
                self.log.warning("executor stalled: asking for its stacks", job_id=ex.job_id,
                                 allocation=ex.allocation_id, rank=ex.rank, step=ex.step,
                                 quiet_s=round(quiet, 1), limit_s=round(limit, 1))
                _signal(ex, signal.SIGUSR1)
            elif now - ex.stall_seen >= STALL_DUMP_S:
                ex.fault = (f"stalled: no training progress for {quiet:.0f} s after step {ex.step} (limit "
                            f"{limit:.0f} s; a hung collective or a deadlock); killed — thread stacks in "
                            f"{self.log_path(ex.job_id)}")
                self.log.error("killing a stalled executor", job_id=ex.job_id, allocation=ex.allocation_id,
                               rank=ex.rank, step=ex.step, quiet_s=round(quiet, 1))
                _signal(ex, signal.SIGKILL)
                killed.append(ex)
        return killed

    def check_faults(self) -> list[Executor]:
        """Poll every MPS backend's server log; fail every executor of a GPU whose server
        reported a fatal fault. Cheap (reads only new log bytes); call periodically."""
        hit: list[Executor] = []
        if self.parts is None:
            return hit
        for b in self.parts.backends.values():
            if isinstance(b, MpsBackend):
                grants = b.poll_faults()
                if grants:
                    hit += self.fail_grants(grants, f"MPS server of {b.device_id} reported a fatal fault "
                                                    f"(see {b.daemon.server_log()}); every client of the GPU is failed")
        return hit

    async def stop_all(self, grace_s: float = 10.0, by_agent: bool = True) -> int:
        """Stop every running executor (see ``stop``). Only the agent calls this, on its
        own decision (shutdown, self-fencing, a rejected incarnation): ``by_agent``
        defaults to True."""
        allocs = self.running_allocations()
        counts = await asyncio.gather(*(self.stop(a, grace_s, by_agent=by_agent) for a in allocs))
        return sum(counts)

    # -- executors of a previous agent process ----------------------------------------
    def _spec_path(self, allocation_id: str, rank: int) -> Path:
        return self.state_dir / "specs" / f"{allocation_id}-r{rank}.json"

    def _record_path(self, allocation_id: str, rank: int) -> Path:
        return self.state_dir / "executors" / f"{allocation_id}-r{rank}.json"

    def _write_record(self, ex: Executor) -> None:
        """Record ``ex`` durably and atomically (``tessera.fsutil.atomic_write``: a crash
        leaves the old record or the new one, whole), so that an agent restarted after a
        crash can kill it. Before the spawn (no ``proc``) the record is an intent: token,
        allocation, job and rank, ``pid`` null; after it, the same with the leader's pid,
        process group and start time. A failed write is logged, not raised."""
        pid = pgid = None
        if ex.proc is not None:
            pid = ex.proc.pid
            try:
                pgid = os.getpgid(pid)
            except ProcessLookupError:
                pgid = pid  # already gone; it led its own session
        rec = {"pid": pid, "pgid": pgid, "start_ticks": ex.start_ticks if pid is not None else None,
               "token": ex.token, "allocation_id": ex.allocation_id, "job_id": ex.job_id, "rank": ex.rank}
        path = self._record_path(ex.allocation_id, ex.rank)
        data = json.dumps(rec).encode()
        try:
            atomic_write(path, lambda f: f.write(data))
        except OSError as e:
            self.log.warning("cannot record executor process; a crash of this agent would leave it running",
                             path=str(path), error=str(e), allocation=ex.allocation_id, rank=ex.rank)

    def _remove_record(self, ex: Executor) -> None:
        """Delete ``ex``'s record, unless it is already another executor's (a later launch of
        the same allocation and rank)."""
        path = self._record_path(ex.allocation_id, ex.rank)
        try:
            rec = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError):
            rec = None
        if not isinstance(rec, dict) or rec.get("token") in (None, ex.token):
            path.unlink(missing_ok=True)

    async def kill_orphans(self, wait_s: float = 5.0) -> list[dict]:
        """Kill the executors a previous agent process on this state dir left running (it
        crashed: they lead their own sessions and outlive it), before this agent registers
        and the controller relaunches their jobs here. For a complete record, the recorded
        process group is SIGKILLed when it is provably the recorded one: its leader's /proc
        start time matches the record, or (the leader gone) a member of the group still
        carries the executor's TESSERA_ALLOCATION_ID and TESSERA_RANK. Every live process
        of this uid whose environment carries the record's TESSERA_EXECUTOR_TOKEN is
        SIGKILLed too: that is how an intent (recorded, spawned, crash before its pid was
        recorded) is found. A pid or pgid reused by another process is never signalled.
        Records are read from ``*.json`` files, temp files of an interrupted write
        included (a whole record there names a real executor as well). Waits up to
        ``wait_s`` for them to die; removes every record. Returns the records of the
        executors killed (one per token)."""
        killed, pids = await asyncio.to_thread(self._kill_orphans)  # /proc scans: off the event loop
        await _wait_exits(pids, wait_s)
        return killed

    def _kill_orphans(self) -> tuple[list[dict], list[tuple[int, int | None]]]:
        """``kill_orphans`` but the wait (blocking): the records of the executors killed and
        the (pid, start ticks or None) of the processes signalled. One /proc scan finds the
        carriers of every record's token."""
        killed: list[dict] = []
        pids: list[tuple[int, int | None]] = []
        # Records first, then temp files (".tmp-*"): a record and its temp file name one executor.
        paths = sorted((self.state_dir / "executors").glob("*.json*"), key=lambda p: (p.name.startswith("."), p.name))
        recs: list[tuple[Path, dict | None]] = []
        for path in paths:
            try:
                rec = json.loads(path.read_text()) if path.suffix == ".json" else None
            except (OSError, ValueError):
                rec = None
            recs.append((path, rec if isinstance(rec, dict) else None))
        tokens = {t for _, rec in recs if rec is not None and isinstance(t := rec.get("token"), str) and t}
        carriers: dict[str, list[tuple[int, int]]] = {}
        # Before the groups are killed: a carrier that is also a group member is found while alive.
        for p, ticks, token in _scan_processes(tokens) if tokens else []:
            carriers.setdefault(token, []).append((p, ticks))
        seen: set[str] = set()
        for path, rec in recs:
            if rec is not None:
                token = rec.get("token") if isinstance(rec.get("token"), str) and rec.get("token") else None
                hit: list[tuple[int, int | None]] = []
                members = _orphan_members(rec)
                if members:
                    try:
                        os.killpg(int(rec["pgid"]), signal.SIGKILL)
                        hit += [(p, None) for p in members]
                    except ProcessLookupError:
                        pass
                for p, ticks in carriers.pop(token, []) if token else []:  # the first record of a token takes them
                    if _send_verified(p, ticks, signal.SIGKILL):
                        hit.append((p, ticks))
                if hit and (token is None or token not in seen):
                    killed.append(rec)
                    self.log.warning("killed the executor of a previous agent process", pid=rec.get("pid"),
                                     pgid=rec.get("pgid"), allocation=rec.get("allocation_id"),
                                     job_id=rec.get("job_id"), rank=rec.get("rank"), processes=len(hit),
                                     recorded="spawned" if rec.get("pid") is not None else "intent only")
                elif not hit:
                    self.log.info("executor of a previous agent process already gone", pid=rec.get("pid"),
                                  allocation=rec.get("allocation_id"), rank=rec.get("rank"))
                if token:
                    seen.add(token)
                pids += hit
            path.unlink(missing_ok=True)
        return killed, pids


class _ExecutorProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """The stream protocol of ``create_subprocess_exec``, plus ``leader_exited``: set
    when the process exits (its output may still be open)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=2 ** 16, loop=loop)  # create_subprocess_exec's default limit
        self.leader_exited = asyncio.Event()

    def process_exited(self) -> None:
        super().process_exited()
        self.leader_exited.set()


def _close_output(e: Executor) -> None:
    """Close ``e``'s output pipe on the agent's side (its reader ends at EOF of what was
    read; the Process's wait() can then return)."""
    pipe = e.transport.get_pipe_transport(1) if e.transport is not None else None
    if pipe is not None:
        pipe.close()
    elif e.proc is not None and e.proc.stdout is not None:
        e.proc.stdout.feed_eof()


def _failpoint(name: str) -> None:
    """Tests only: exit this process at once, with no cleanup, when ``TESSERA_FAILPOINT``
    names ``name`` (a crash at that point)."""
    if os.environ.get(FAILPOINT_ENV) == name:
        os._exit(FAILPOINT_EXIT)


PF_KTHREAD = 0x00200000  # a kernel thread (field 9 of /proc/<pid>/stat, flags): never an executor's


MAX_LINE = 64 << 10  # bytes of one output line; a longer one is dropped whole


async def output_lines(stream: asyncio.StreamReader, limit: int = MAX_LINE, chunk: int = 1 << 16):
    """The lines of ``stream`` (with their newline; the last one may lack it) until EOF; a
    line longer than ``limit`` bytes is dropped *whole* — from its first byte to its
    newline, however the pipe split it — and yields None in its place. (StreamReader's own
    readline, over its limit, sometimes drops the rest of such a line and sometimes hands
    it back as a line of its own, depending on how the data arrived.)"""
    buf = b""
    skipping = False  # inside a line already over the limit: drop up to its newline
    while True:
        data = await stream.read(chunk)
        if not data:
            if buf and not skipping:
                yield buf
            return
        buf += data
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                if len(buf) > limit:
                    if not skipping:
                        yield None
                    skipping = True
                    buf = b""
                break
            line, buf = buf[:nl + 1], buf[nl + 1:]
            if skipping:
                skipping = False  # the tail of the dropped line
            elif len(line) > limit + 1:
                yield None
            else:
                yield line


def executor_processes(token: str | None, sid: int | None = None,
                       since_ticks: int | None = None) -> list[tuple[int, int]]:
    """(pid, start ticks) of the live (not zombie) processes of this uid, this process
    excepted, that belong to an executor: their environment carries
    ``TESSERA_EXECUTOR_TOKEN=token``, or (``sid`` given) they are in session ``sid``.
    ``since_ticks``: the leader's start; every process of an executor (a descendant of
    its leader) started no earlier, so an older process is passed over after reading
    its ``stat`` alone (and a session id reused after the executor is not mistaken for
    its own). Reads every process's ``stat``, and the environment only of those that
    could carry the token (same uid, not a kernel thread, not older than
    ``since_ticks``, not already found by their session): blocking, run it off the
    event loop."""
    return [(p, t) for p, t, _ in _scan_processes({token} if token else set(), sid, since_ticks)]


def _scan_processes(tokens: set[str], sid: int | None = None,
                    since_ticks: int | None = None) -> list[tuple[int, int, str | None]]:
    """``executor_processes`` for any of ``tokens``: (pid, start ticks, the token its
    environment carries, or None for a member of session ``sid``)."""
    needles = [(t, f"\0{TOKEN_ENV}={t}\0".encode()) for t in tokens]  # whole entries only
    me, uid = os.getpid(), os.getuid()
    found: list[tuple[int, int, str | None]] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for d in entries:
        if not d.isdigit() or int(d) == me:
            continue
        pid = int(d)
        rest = _proc_stat(pid)
        if rest is None or rest[0] in (b"Z", b"X"):
            continue
        ticks = int(rest[19])
        if since_ticks is not None and ticks < since_ticks:
            continue
        if int(rest[6]) & PF_KTHREAD:
            continue
        try:
            if os.stat(f"/proc/{d}").st_uid != uid:
                continue
        except OSError:
            continue
        if sid is not None and int(rest[3]) == sid:
            found.append((pid, ticks, None))
            continue
        if not tokens:
            continue
        try:
            env = _read_proc(f"/proc/{d}/environ")
        except OSError:
            continue
        padded = b"\0" + env + b"\0"
        token = next((t for t, n in needles if n in padded), None)
        if token is not None:
            found.append((pid, ticks, token))
    return found


async def _wait_exits(procs: list[tuple[int, int | None]], timeout: float,
                      wake: asyncio.Event | None = None) -> None:
    """Wait up to ``timeout`` seconds until every process of ``procs`` ((pid, start ticks;
    None: not checked)) has exited, or ``wake`` is set. Through pidfds, readable once their
    process exits; without them (old kernel), the timeout or ``wake`` ends the wait."""
    if timeout <= 0:
        return
    loop = asyncio.get_running_loop()
    fds: list[int] = []
    pending: set[int] = set()
    all_gone = asyncio.Event()

    def exited(fd: int) -> None:
        loop.remove_reader(fd)
        pending.discard(fd)
        if not pending:
            all_gone.set()

    try:
        for pid, ticks in procs:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            except (AttributeError, OSError):
                pending.add(-1)  # no pidfds: never "all gone"
                break
            fds.append(fd)
            now = process_start_ticks(pid)
            if now is None or (ticks is not None and now != ticks):
                continue  # already gone (a zombie), or its pid reused: not ours to wait for
            pending.add(fd)
            loop.add_reader(fd, exited, fd)
        if not pending:
            return
        waits = [asyncio.ensure_future(all_gone.wait())]
        if wake is not None:
            waits.append(asyncio.ensure_future(wake.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
    finally:
        for fd in fds:
            if fd in pending:
                loop.remove_reader(fd)
            os.close(fd)


def _send_verified(pid: int, ticks: int, sig: int) -> bool:
    """Send ``sig`` to process ``pid`` only if it is still the one that started at
    ``ticks`` (through a pidfd: the pid cannot be reused between the check and the
    signal). True when sent."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):
        fd = None  # no pidfd (old kernel): check and kill, the classic narrow race
    try:
        if process_start_ticks(pid) != ticks:
            return False
        if fd is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)


def _orphan_members(rec: dict) -> list[int]:
    """The live processes of a recorded executor's group that are provably its own: the
    leader when its start time matches the record, else the group's members whose
    environment names the record's allocation and rank."""
    try:
        pid, pgid, ticks = int(rec["pid"]), int(rec["pgid"]), rec.get("start_ticks")
        alloc, rank = str(rec["allocation_id"]), str(rec["rank"])
    except (KeyError, TypeError, ValueError):
        return []
    if ticks is not None and process_start_ticks(pid) == int(ticks):
        return [pid]
    want = {f"TESSERA_ALLOCATION_ID={alloc}".encode(), f"TESSERA_RANK={rank}".encode()}
    members = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        rest = _proc_stat(int(d))
        if rest is None or rest[0] in (b"Z", b"X") or int(rest[2]) != pgid:
            continue
        try:
            env = set(Path(f"/proc/{d}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if want <= env:
            members.append(int(d))
    return members


def pin_process(pid: int, cores) -> None:
    """Pin every thread of running process ``pid`` to ``cores``: sched_setaffinity on a pid
    moves only that thread, and torch's pools were started with the old mask. Threads
    that end meanwhile are skipped; threads created later inherit the caller's mask."""
    cores = set(cores)
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:
            pass


def _signal(e: Executor, sig: int) -> None:
    """Send ``sig`` to every process of executor ``e`` until it is ``done``."""
    # The executor leads its own session: signal the whole group, so that anything it
    # spawned (data-loader workers, local ranks) goes too. While the leader is not reaped
    # (returncode None) its pid, and so the group id, cannot be reused. Once it is, the
    # pump is ending the rest (``_reap``), which SIGTERMs every one it finds. A SIGKILL
    # sets ``kill_requested``: the reap, now or once the leader is gone, SIGKILLs at once
    # what is left (a process that left the group included). No /proc scan here: this
    # runs in the event loop.
    if e.proc is None or e.done.is_set():
        return
    if sig == signal.SIGKILL:
        e.kill_requested.set()
    if e.proc.returncode is not None:
        return
    try:
        os.killpg(e.proc.pid, sig)
    except ProcessLookupError:
        pass

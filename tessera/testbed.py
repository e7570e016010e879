"""Local testbed: a whole Tessera cluster as processes on this machine's loopback.

``Testbed(dir).up(agents=N, cpu_devices=K)`` starts, in order and waiting for each to be
ready: etcd, ``tessera-estimator``, ``tessera-controller``, then per node ``node-i`` a
``tessera-profilerd`` and a ``tessera-agent`` with K CPU devices. Every daemon listens on
a free loopback port; it is ready when its gRPC health service reports SERVING (the
controller only does once it leads). State lives under ``dir`` (default ``.tessera``)::

    .tessera/testbed.json     addresses ("controller", ...) and pids; read by the CLI/client
    .tessera/logs/<proc>.log  stdout+stderr of each process (etcd, controller, node-1-agent, ...)
    .tessera/etcd/ estimator/ nodes/<node>/{agent,profilerd}/ checkpoints/

(the controller keeps all its state in etcd; a ``controller/`` left by an older version is
removed with the others by an ``up`` without ``keep_state``).

Every process leads its own session (process group), so a Ctrl-C in the terminal reaches
only the CLI, which then stops the cluster in order; and every process carries the
environment variable ``TESSERA_TESTBED=<marker>``, inherited by the agents' executors, so
``down()`` can find and stop anything left behind even when it was orphaned.

``down()`` stops agents (which stop their executors), profilerds, the controller, the
estimator and etcd: SIGTERM to the process group, wait, SIGKILL after a deadline, then a
sweep of every process still carrying the marker.

One testbed per directory: ``up()`` takes an exclusive ``flock`` on ``<dir>/.lock`` before
it touches anything there (a second ``up``/``demo`` in the same directory is refused at
once, ``TestbedError`` "a testbed is starting or already running in DIR") and keeps it
while it starts the cluster and, when the cluster stays owned by this process (a
foreground ``tessera up``, ``demo``), until ``down()``; ``detach()`` releases it. ``down()``
takes it too, so a ``down`` never runs alongside a starting ``up``. A start that fails
stops only the processes that run started.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .etcdproc import EtcdNotFound, EtcdProcess, find_etcd, free_ports
from .procfs import process_start_ticks

__all__ = ["Proc", "Testbed", "TestbedError", "MARKER_ENV", "find_marked", "daemon_command"]

MARKER_ENV = "TESSERA_TESTBED"
STATE_DIRS = ("etcd", "controller", "estimator", "nodes", "checkpoints")
Progress = Callable[[str], None]


class TestbedError(RuntimeError):
    """The testbed could not be started or stopped; the message says why and where to look."""

    __test__ = False  # not a pytest test class


@dataclass
class Proc:
    """One process of the testbed, as recorded in testbed.json."""

    name: str
    pid: int
    log: str
    cmd: list[str]
    address: str = ""
    role: str = ""
    popen: subprocess.Popen | None = field(default=None, repr=False, compare=False)

    def record(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "pid", "log", "cmd", "address", "role")}


def daemon_command(script: str, module: str) -> list[str]:
    """Argv prefix of a daemon: its console script next to this interpreter (how a pip
    install lays it out), else on PATH, else ``python -c`` calling ``module:main``."""
    here = Path(sys.executable).parent / script
    if here.is_file() and os.access(here, os.X_OK):
        return [str(here)]
    found = shutil.which(script)
    if found:
        return [found]
    mod, fn = module.split(":")
    return [sys.executable, "-c", f"import sys; from {mod} import {fn}; sys.exit({fn}())"]


def _module_present(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module.split(":")[0]) is not None
    except (ImportError, ValueError):
        return False


DAEMONS = {
    "controller": ("tessera-controller", "controller.main:main"),
    "agent": ("tessera-agent", "agent.main:main"),
    "profilerd": ("tessera-profilerd", "profilerd.main:main"),
    "estimator": ("tessera-estimator", "estimator.main:main"),
}


def _alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def find_marked(marker: str, key: str = MARKER_ENV) -> list[int]:
    """Pids of live processes (other than this one) whose environment has ``key=marker``."""
    pids: list[int] = []
    me = os.getpid()
    if not Path("/proc").is_dir():  # no procfs (macOS): only the recorded pids can be stopped
        return pids
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        if _environ(pid).get(key) == marker and _alive(pid):
            pids.append(pid)
    return pids


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Testbed:
    """A local cluster rooted at ``dir``. ``up()`` starts it and writes testbed.json;
    ``down()`` stops it (also from another process that only has testbed.json)."""

    __test__ = False

    def __init__(self, dir: str | Path = ".tessera", progress: Progress | None = None) -> None:
        self.dir = Path(dir).resolve()
        self.file = self.dir / "testbed.json"
        self.logs = self.dir / "logs"
        self.progress = progress or (lambda msg: None)
        self.procs: list[Proc] = []
        self.marker = ""
        self.info: dict = {}
        self._etcd: EtcdProcess | None = None
        self.lockfile = self.dir / ".lock"
        self._lock_fd: int | None = None

    # -- the directory lock -------------------------------------------------------------
    def _try_lock(self) -> bool:
        """Take the exclusive lock on ``<dir>/.lock`` without blocking (True if held now,
        also when this object already holds it); the holder's pid is written into it."""
        if self._lock_fd is not None:
            return True
        fd = os.open(self.lockfile, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        return True

    def _wait_lock(self, timeout: float) -> bool:
        """``_try_lock`` until it succeeds or ``timeout`` seconds have passed."""
        deadline = time.monotonic() + timeout
        while not self._try_lock():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)  # poll interval: flock has no timed wait
        return True

    def _release(self) -> None:
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)  # closing the descriptor drops the flock

    def _lock_holder(self) -> str:
        try:
            pid = self.lockfile.read_text().strip()
        except OSError:
            pid = ""
        return f"process {pid}" if pid.isdigit() else "another process"

    def _down_hint(self) -> str:
        """The ``tessera down`` command for this directory (``--dir`` unless the default)."""
        return "tessera down" + ("" if self.dir == Path(".tessera").resolve() else f" --dir {self.dir}")

    # -- state file -------------------------------------------------------------------
    def read(self) -> dict | None:
        """The recorded testbed.json, or None if there is none."""
        try:
            return json.loads(self.file.read_text())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        """True if the recorded testbed has a live process."""
        info = self.read()
        if not info:
            return False
        return any(_alive(p["pid"]) and _environ(p["pid"]).get(MARKER_ENV) == info.get("marker")
                   for p in info.get("processes", []))

    def detach(self) -> None:
        """The ``tessera up`` process is leaving the cluster running (``--detach``): it no
        longer owns it, so ``down`` must not signal its pid (which the OS may give to another
        process once it exits)."""
        self.info["up_pid"] = None
        self.info["up_start"] = None
        self._write()
        self._release()

    def _write(self) -> None:
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.info, indent=2))
        os.replace(tmp, self.file)

    # -- start ------------------------------------------------------------------------
    def up(self, agents: int = 2, cpu_devices: int = 2, grace_s: float = 10.0, keep_state: bool = False,
           timeout: float = 60.0, with_estimator: bool | None = None, with_profilerd: bool | None = None,
           colocation_benchmark: bool = False) -> dict:
        """Start the cluster and return the testbed.json record. Raises ``TestbedError``
        (after stopping whatever it started) if a process fails to become ready within
        ``timeout`` seconds, and too when etcd is not installed or fails to start or ``dir``
        cannot be used: never a traceback for the CLI to show; at once, touching nothing,
        when another process holds ``<dir>/.lock`` (a testbed starting or running there).
        On success this object keeps the lock until ``down()`` or ``detach()``.
        ``with_estimator``/``with_profilerd``: None = when installed. ``colocation_benchmark``:
        node-1's profilerd also runs the colocation micro-benchmark at start (profilerd
        ``--colocation-benchmark``: the estimator then prices jobs sharing a device). ``agents`` and
        ``cpu_devices`` must be >= 1 and ``grace_s`` finite and > 0 (else ``TestbedError``,
        nothing started; the CLI refuses them earlier, as usage errors)."""
        if agents < 1:
            raise TestbedError(f"--agents must be >= 1, got {agents}")
        if cpu_devices < 1:
            raise TestbedError(f"--cpu-devices must be >= 1, got {cpu_devices}")
        if not (isinstance(grace_s, (int, float)) and 0 < grace_s < float("inf")):
            raise TestbedError(f"--grace-s must be a finite number of seconds > 0, got {grace_s}")
        try:
            find_etcd()  # fail early with the clear message
        except EtcdNotFound as e:
            raise TestbedError(f"cannot start the testbed: {e}") from None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            locked = self._try_lock()
        except OSError as e:
            raise TestbedError(self._dir_error(e)) from None
        if not locked:
            raise TestbedError(f"a testbed is starting or already running in {self.dir} ({self._lock_holder()} holds "
                               f"{self.lockfile}); stop it with `{self._down_hint()}`")
        try:
            if self.running():
                raise TestbedError(f"a testbed is already running in {self.dir} (see {self.file}); "
                                   f"run `{self._down_hint()}` first")
            try:
                self.logs.mkdir(exist_ok=True)
                if not keep_state:
                    for d in STATE_DIRS:
                        shutil.rmtree(self.dir / d, ignore_errors=True)
                for old in self.logs.glob("*.log"):
                    old.unlink()
            except OSError as e:
                raise TestbedError(self._dir_error(e)) from None
            return self._start(agents, cpu_devices, grace_s, timeout, with_estimator, with_profilerd,
                               colocation_benchmark)
        except BaseException:
            self._release()
            raise

    def _dir_error(self, e: OSError) -> str:
        return (f"cannot use {self.dir} as the testbed directory (--dir): "
                f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}")

    def _start(self, agents: int, cpu_devices: int, grace_s: float, timeout: float,
               with_estimator: bool | None, with_profilerd: bool | None, colocation_benchmark: bool = False) -> dict:
        self.marker = f"{self.dir}:{uuid.uuid4().hex[:12]}"
        env = dict(os.environ)
        env[MARKER_ENV] = self.marker
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("TESSERA_CONTROLLER", None)
        self.env = env
        with_estimator = _module_present(DAEMONS["estimator"][1]) if with_estimator is None else with_estimator
        with_profilerd = _module_present(DAEMONS["profilerd"][1]) if with_profilerd is None else with_profilerd
        self.info = {"version": 1, "dir": str(self.dir), "marker": self.marker, "started": time.time(),
                     "up_pid": os.getpid(), "up_start": process_start_ticks(os.getpid()), "controller": "", "addresses": {"nodes": {}}, "processes": []}
        t0 = time.monotonic()
        try:
            self._start_etcd(timeout)
            # The estimator, the controller and the profilerds start together (each knows
            # the others' addresses before they serve, and retries until they answer: the
            # controller's estimator link, profilerd's stream); the agents then, as they
            # register with the controller to become ready.
            first = []
            est_addr = ""
            if with_estimator:
                (port,) = free_ports(1)
                est_addr = f"127.0.0.1:{port}"
                first.append(self._spawn("estimator", "estimator",
                                         ["--listen", est_addr, "--state-dir", self._state("estimator")], est_addr))
            else:
                self.progress("- estimator: not installed, skipped")
            (port,) = free_ports(1)
            ctl_addr = f"127.0.0.1:{port}"
            args = ["--listen", ctl_addr, "--etcd", self._etcd.endpoint, "--prefix", "/tessera", "--grace-s", str(grace_s),
                    "--checkpoint-root", self._state("checkpoints")]
            if est_addr:
                args += ["--estimator", est_addr]
            first.append(self._spawn("controller", "controller", args, ctl_addr))
            ports = free_ports(2 * agents)
            for i in range(agents):
                name = f"node-{i + 1}"
                node = {"agent": f"127.0.0.1:{ports[2 * i]}"}
                if with_profilerd:
                    node["profilerd"] = f"127.0.0.1:{ports[2 * i + 1]}"
                    if not est_addr:
                        raise TestbedError("profilerd needs the estimator, which is not installed")
                    first.append(self._spawn(f"{name}-profilerd", "profilerd",
                                             ["--node", name, "--listen", node["profilerd"], "--estimator", est_addr,
                                              "--state-dir", self._state("nodes", name, "profilerd")]
                                             # one loopback comm table per machine: node-1's profilerd measures it
                                             + (["--comm-benchmark"] if i == 0 else [])
                                             + (["--colocation-benchmark"] if i == 0 and colocation_benchmark else []),
                                             node["profilerd"]))
                self.info["addresses"]["nodes"][name] = node
            if not with_profilerd:
                self.progress("- profilerd: not installed, skipped")
            self._wait_ready(first, timeout)
            if est_addr:
                self.info["addresses"]["estimator"] = est_addr
            self.info["controller"] = self.info["addresses"]["controller"] = ctl_addr
            self._write()  # the controller is usable from here on

            ags = []
            for name, node in self.info["addresses"]["nodes"].items():
                args = ["--name", name, "--listen", node["agent"], "--controller", ctl_addr,
                        "--cpu-devices", str(cpu_devices), "--state-dir", self._state("nodes", name, "agent")]
                if "profilerd" in node:
                    args += ["--profilerd", node["profilerd"]]
                ags.append(self._spawn(f"{name}-agent", "agent", args, node["agent"]))
            self._wait_ready(ags, timeout)
        except BaseException as e:
            self.progress("start failed; stopping what was started")
            self._stop_started()
            if isinstance(e, TestbedError) or not isinstance(e, (RuntimeError, OSError)):
                raise
            # etcd failing to start (RuntimeError), a log or state path that cannot be
            # written, a daemon that cannot be executed (OSError): one clear error, no traceback.
            raise TestbedError(f"testbed failed to start: {e}; logs in {self.logs}") from e
        self._write()
        self.progress(f"testbed up in {time.monotonic() - t0:.1f}s: controller {self.info['controller']}, "
                      f"{agents} node(s) x {cpu_devices} cpu device(s); state in {self.dir}")
        return self.info

    def _state(self, *parts: str) -> str:
        p = self.dir.joinpath(*parts)
        p.mkdir(parents=True, exist_ok=True)
        return str(p)

    def _record(self, proc: Proc) -> None:
        self.procs.append(proc)
        self.info["processes"].append(proc.record())
        self._write()

    def _start_etcd(self, timeout: float) -> None:
        t = time.monotonic()
        self._etcd = EtcdProcess(self.dir / "etcd", log_path=self.logs / "etcd.log", start_new_session=True, env=self.env)
        try:
            self._etcd.start(timeout=timeout)
        finally:
            if self._etcd.proc is not None and self._etcd.proc.poll() is None:
                self._record(Proc("etcd", self._etcd.proc.pid, str(self._etcd.log_path), self._etcd.command(),
                                  self._etcd.endpoint, "etcd", self._etcd.proc))
        self.info["addresses"]["etcd"] = self._etcd.endpoint
        self.progress(f"✓ {'etcd':<17} {self._etcd.endpoint}  ({time.monotonic() - t:.1f}s)")

    def _spawn(self, name: str, role: str, args: list[str], address: str) -> Proc:
        script, module = DAEMONS[role]
        cmd = daemon_command(script, module) + args
        log_path = self.logs / f"{name}.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=self.env, cwd=str(self.dir))
        proc = Proc(name, popen.pid, str(log_path), cmd, address, role, popen)
        self._record(proc)
        return proc

    def _wait_ready(self, procs: list[Proc], timeout: float) -> None:
        """Poll each process's gRPC health until SERVING; ``TestbedError`` with the log
        tail if one exits or the deadline passes."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        t0 = time.monotonic()
        deadline = t0 + timeout
        pending = list(procs)
        channels = {p.name: grpc.insecure_channel(p.address) for p in pending}
        try:
            while pending:
                for p in list(pending):
                    if p.popen is not None and p.popen.poll() is not None:
                        raise TestbedError(f"{p.name} exited with code {p.popen.returncode} while starting; "
                                           f"log {p.log}:\n{_tail(p.log)}")
                    try:
                        resp = health_pb2_grpc.HealthStub(channels[p.name]).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                        ok = resp.status == health_pb2.HealthCheckResponse.SERVING
                    except grpc.RpcError:
                        ok = False
                    if ok:
                        pending.remove(p)
                        self.progress(f"✓ {p.name:<17} {p.address}  ({time.monotonic() - t0:.1f}s)")
                if pending:
                    if time.monotonic() > deadline:
                        p = pending[0]
                        raise TestbedError(f"{p.name} not SERVING after {timeout:.0f}s; log {p.log}:\n{_tail(p.log)}")
                    time.sleep(0.1)  # poll interval of the readiness check
        finally:
            for ch in channels.values():
                ch.close()

    # -- run in the foreground ----------------------------------------------------------
    def wait_until_signalled(self, on_ready: Callable[[], None] | None = None) -> None:
        """Block until SIGINT/SIGTERM/SIGHUP (then return) or until every process is gone.
        ``on_ready`` runs once the handlers are installed (announce "press Ctrl-C" there,
        so that a Ctrl-C right after the announcement is handled here). Reports processes
        that exit on their own."""
        import threading

        stop = threading.Event()
        old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        reported: set[str] = set()
        try:
            if on_ready is not None:
                on_ready()
            while not stop.wait(0.5):
                live = 0
                for p in self.procs:
                    code = p.popen.poll() if p.popen else (None if _alive(p.pid) else -1)
                    if code is None:
                        live += 1
                    elif p.name not in reported:
                        reported.add(p.name)
                        self.progress(f"! {p.name} exited (code {code}); log {p.log}")
                if live == 0:
                    return
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    # -- stop -------------------------------------------------------------------------
    def down(self, timeout: float = 20.0) -> list[str]:
        """Stop every process of this testbed: agents first, etcd last. Returns the names
        stopped. Idempotent.

        Called on the object that started the cluster, it stops the processes it started.
        Called from another process (only testbed.json to go on), it first asks a
        foreground ``tessera up`` that owns the cluster to stop it in order (SIGTERM, then
        waits for it) and counts the recorded processes gone by then as stopped; then it
        takes the directory lock (waiting up to ``timeout`` seconds for a starting ``up``
        or another ``down``; ``TestbedError`` if it stays held) and stops what testbed.json
        records plus every process carrying its marker."""
        if self.procs or self._lock_fd is not None:
            try:
                return self._stop_started(timeout)
            finally:
                self._release()
        info = self.read() or {}
        stopped: list[str] = []
        up_pid = info.get("up_pid")
        # Only the very process that recorded itself (same start time): a detached `up` has
        # exited, and its pid may now be anyone's.
        owner = bool(up_pid) and info.get("up_start") is not None and process_start_ticks(up_pid) == info.get("up_start")
        if owner and up_pid != os.getpid() and _alive(up_pid):
            # A foreground `tessera up` owns the cluster: ask it to stop everything in order.
            try:
                os.kill(up_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            _wait_gone([up_pid], timeout + 30)
            marker = info.get("marker", "")
            for p in info.get("processes", []):
                if not (_alive(p["pid"]) and (not marker or _environ(p["pid"]).get(MARKER_ENV) in (marker, None))):
                    stopped.append(p["name"])
                    self.progress(f"✓ stopped {p['name']} (by the tessera up process {up_pid})")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass
        try:
            locked = self._wait_lock(timeout)
        except OSError:
            locked = True  # cannot create the lock file (read-only dir): nothing can start there either
        if not locked:
            raise TestbedError(f"{self._lock_holder()} is starting or stopping the testbed in {self.dir} (it holds "
                               f"{self.lockfile}); try again once it has finished")
        try:
            now = self.read() or {}
            if not now and info.get("marker"):
                now = {"marker": info["marker"]}  # the owner removed the record: still sweep its marker
            return stopped + [n for n in self._stop(now, [_proc(p) for p in now.get("processes", [])], timeout)
                              if n not in stopped]
        finally:
            self._release()

    def _stop_started(self, timeout: float = 20.0) -> list[str]:
        """Stop the processes this object started (never those of testbed.json: after a
        refused or failed start that file may be another run's)."""
        return self._stop(self.info, self.procs, timeout)

    def _stop(self, info: dict, procs: list[Proc], timeout: float) -> list[str]:
        marker = info.get("marker", self.marker)
        order = {"agent": 0, "profilerd": 1, "controller": 2, "estimator": 3, "etcd": 4}
        stopped = []
        for rank in sorted(set(order.values())):
            group = [p for p in procs if order.get(p.role, 0) == rank and self._ours(p, marker)]
            for p in group:
                _killpg(p.pid, signal.SIGTERM)
            _wait_gone([p.pid for p in group], timeout, popens=[p.popen for p in group])
            for p in group:
                if _alive(p.pid):
                    self.progress(f"! {p.name} ignored SIGTERM for {timeout:.0f}s; killing it")
                _killpg(p.pid, signal.SIGKILL)  # also whatever is left in its process group
                stopped.append(p.name)
                self.progress(f"✓ stopped {p.name}")
        if self._etcd is not None:
            self._etcd.stop(timeout=5)
            self._etcd = None
        if marker:
            stragglers = find_marked(marker)
            for pid in stragglers:
                self.progress(f"! killing leftover process {pid}")
                _killpg(pid, signal.SIGKILL)
            _wait_gone(stragglers, 10)
            for pid in find_marked(marker):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            if p.popen is not None:
                try:
                    p.popen.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        rec = self.read()
        if self.file.exists() and (rec is None or rec.get("marker") == marker):
            self.file.unlink(missing_ok=True)
        self.procs = []
        return stopped

    @staticmethod
    def _ours(p: Proc, marker: str) -> bool:
        # Guard against pid reuse: only signal a pid that still carries our marker.
        if p.popen is not None:
            return p.popen.poll() is None
        if not _alive(p.pid):
            return False
        if not marker or not Path("/proc").is_dir():
            return True  # cannot read another process's environment here: trust the record
        return _environ(p.pid).get(MARKER_ENV) == marker


def _proc(rec: dict) -> Proc:
    return Proc(**{k: v for k, v in rec.items() if k in ("name", "pid", "log", "cmd", "address", "role")})


def _wait_gone(pids: list[int], timeout: float, popens: list | None = None) -> None:
    """Poll until every pid has exited (reaping our own children) or ``timeout``."""
    deadline = time.monotonic() + timeout
    popens = [p for p in (popens or []) if p is not None]
    while time.monotonic() < deadline:
        for po in popens:
            po.poll()
        if not any(_alive(pid) for pid in pids):
            return
        time.sleep(0.05)  # poll interval


def _tail(path: str, n: int = 3000) -> str:
    try:
        return Path(path).read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "(no log)"

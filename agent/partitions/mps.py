"""MPS partitions: one ``nvidia-cuda-mps-control`` daemon per GPU, SM and memory quotas
per client, and detection of faults that take down every client of a GPU.

- :class:`MpsDaemon` starts the control daemon with ``-d`` and a private
  ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY`` under the agent's state dir
  (so it never touches a system-wide MPS in /tmp/nvidia-mps) and ``CUDA_VISIBLE_DEVICES``
  set to its one GPU; it stops it by writing ``quit`` to the control program's stdin.
  The binary path is injected so tests run a fake with the same command-line contract.
- :class:`MpsBackend`: one partition per GPU, capacity 100 SM percent and the GPU's
  memory. A grant's units become ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and its memory
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=<N>M"`` (ordinal 0: the client sees one GPU),
  rounded down to whole MiB so it never exceeds the grant; a grant of under 1 MiB (but
  not 0, no limit) is refused (:class:`BadMemoryLimit`).

  The SM percentage is a **limit, not a reservation**: MPS caps how many SMs a client's
  kernels may occupy, but it does not hold SMs back for a client that is idle, nor
  guarantee them to one that is busy. Summing percentages to at most 100 keeps clients
  from contending for the same SMs; it does not make their speed independent of each
  other (memory bandwidth and caches stay shared). The memory limit is enforced by the
  driver on allocation (the client sees out-of-memory beyond it).
- Fault containment: a fatal GPU fault in one MPS client (illegal address, Xid, the
  server dying) terminates or poisons *every* client of that GPU's server.
  :func:`fatal_log_lines` and :func:`is_fatal_client_message` are pure detectors over
  the server log and a client's last error; :meth:`MpsBackend.faulted_by_exit` and
  :meth:`MpsBackend.poll_faults` return the grants to report as failed (all of them).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

from agent.devices import LocalDevice
from tessera import log

from .base import BadGrant, Grant, Ledger, LedgerBackend, PartitionError

MPS_CONTROL = "nvidia-cuda-mps-control"
_MAX_PARTIAL_LINE = 64 * 1024  # a server.log "line" longer than this is matched as it is
MIB = 1024 * 1024

# Why these: CUDA's own error strings for a client ended by the server
# (cudaErrorMpsClientTerminated, cudaErrorMpsServerNotReady, ...) and the sticky fatal
# errors which, under MPS, the server propagates to every client of the GPU.
_FATAL_CLIENT = re.compile(
    r"MPS client has been terminated|MPS server is not ready|MPS server has been|MPS client failed to connect"
    r"|CUDA_ERROR_MPS|cudaErrorMps|illegal memory access|illegal address|illegal instruction"
    r"|unspecified launch failure|uncorrectable ECC|hardware stack error|GPU has fallen off|Xid",
    re.IGNORECASE)
# Server log lines that mean the server (and so all its clients) hit a fatal fault. A
# normal client exit logs "assuming client exit", which must not match.
_FATAL_LOG = re.compile(
    r"fatal|exception|Xid|illegal (memory|address|instruction)|terminat\w* (all )?clients?|server (died|crashed)"
    r"|exited with (status|code) [1-9]|signal \d+",
    re.IGNORECASE)


def fatal_log_lines(text: str) -> list[str]:
    """The lines of MPS server/control log ``text`` that report a fatal fault. Pure."""
    return [ln for ln in text.splitlines() if _FATAL_LOG.search(ln)]


def is_fatal_client_message(message: str) -> bool:
    """Whether a client's last error message shows an MPS-wide fatal fault. Pure."""
    return bool(message) and _FATAL_CLIENT.search(message) is not None


class MpsError(PartitionError):
    """The MPS control daemon could not be started or stopped."""


class BadMemoryLimit(BadGrant):
    """A memory amount MPS cannot enforce exactly (under 1 MiB). ``field``: the request
    field to name in a refusal."""

    field = "memory_bytes"


class MpsDaemon:
    """The control daemon of one GPU. ``start`` and ``stop`` are idempotent.

    ``gpu`` is what the daemon's CUDA_VISIBLE_DEVICES gets (a UUID or an index); the
    pipe and log directories are ``<root>/pipe`` and ``<root>/log``, mode 0700 because
    whoever can reach the pipe can submit work to the GPU.
    """

    def __init__(self, gpu: str, root: Path, binary: str = MPS_CONTROL, start_timeout_s: float = 10.0,
                 base_env: dict[str, str] | None = None) -> None:
        self.gpu, self.root, self.binary = gpu, Path(root), binary
        self.pipe_dir, self.log_dir = self.root / "pipe", self.root / "log"
        self.start_timeout_s = start_timeout_s
        self.base_env = dict(os.environ if base_env is None else base_env)
        # running: a daemon of ours may be up (``-d`` ran): stop() must quit it. ready: its
        # control pipe appeared (start() succeeded).
        self.running = False
        self.ready = False
        self.log = log.get(component="partitions", backend="mps", gpu=gpu)

    def env(self) -> dict[str, str]:
        """Environment of the control program (daemon and commands)."""
        e = dict(self.base_env)
        e["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir)
        e["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir)
        e["CUDA_VISIBLE_DEVICES"] = self.gpu
        return e

    def client_env(self) -> dict[str, str]:
        """What a client needs to reach this daemon (not its quota)."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def start(self) -> None:
        """Start the daemon (``-d`` forks it and returns) and wait for its control pipe.

        Once ``-d`` has run (it returned 0, or it timed out: the daemon may have forked),
        a daemon may be left behind by any failure that follows: ``running`` is set at
        once (so ``stop`` quits it) and the failure sends ``quit`` itself, best effort;
        when that fails too, ``running`` stays set and a later ``stop`` tries again. A
        ``start`` after such a failure takes the daemon left behind if its pipe has
        appeared by then, else quits it (best effort) and starts afresh."""
        if self.running and self.ready:
            return
        if self.running:
            if (self.pipe_dir / "control").exists():  # the daemon of a failed start came up late
                self.ready = True
                self.log.info("mps daemon started", pipe_dir=str(self.pipe_dir), log_dir=str(self.log_dir))
                return
            self._quit_after_failure()
        for d in (self.pipe_dir, self.log_dir):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o700)
        try:
            r = subprocess.run([self.binary, "-d"], env=self.env(), capture_output=True, text=True,
                               timeout=self.start_timeout_s)
        except OSError as e:
            raise MpsError(f"cannot start {self.binary} for GPU {self.gpu}: {e}") from e
        except subprocess.TimeoutExpired as e:
            self.running = True  # it may have forked the daemon before hanging
            self._quit_after_failure()
            raise MpsError(f"cannot start {self.binary} for GPU {self.gpu}: {e}") from e
        if r.returncode != 0:
            raise MpsError(f"{self.binary} -d for GPU {self.gpu} exited {r.returncode}: {(r.stderr or r.stdout).strip()}")
        self.running = True  # the daemon runs: from here on, stop() must quit it
        # The daemon creates its "control" socket once it accepts commands; a client
        # started before that would silently run without MPS (no quota at all).
        deadline = time.monotonic() + self.start_timeout_s
        while not (self.pipe_dir / "control").exists():
            if time.monotonic() > deadline:
                self._quit_after_failure()
                raise MpsError(f"{self.binary} for GPU {self.gpu} did not create {self.pipe_dir / 'control'} "
                               f"within {self.start_timeout_s}s")
            time.sleep(0.05)
        self.ready = True
        self.log.info("mps daemon started", pipe_dir=str(self.pipe_dir), log_dir=str(self.log_dir))

    def _quit_after_failure(self) -> None:
        """Best effort ``quit`` of a daemon a failed start may have left; ``running`` is
        cleared when it succeeds, kept (``stop`` retries) when it does not."""
        try:
            self.command("quit", timeout_s=self.start_timeout_s)
        except MpsError as e:
            self.log.warning("cannot quit the mps daemon of a failed start; stop() will try again", error=str(e))
            return
        self.running = self.ready = False
        self.log.info("mps daemon of a failed start quit")

    def command(self, cmd: str, timeout_s: float = 10.0) -> str:
        """Send one control command (``quit``, ``get_server_list``, ...) on stdin; its output."""
        try:
            r = subprocess.run([self.binary], input=cmd + "\n", env=self.env(), capture_output=True, text=True,
                               timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsError(f"{self.binary} {cmd!r} for GPU {self.gpu}: {e}") from e
        if r.returncode != 0:
            raise MpsError(f"{self.binary} {cmd!r} for GPU {self.gpu} exited {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def stop(self) -> None:
        """``quit`` the daemon (it stops its server too); idempotent. Also quits the daemon
        a failed ``start`` may have left (``running`` without ``ready``)."""
        if not self.running:
            return
        self.command("quit")
        self.running = self.ready = False
        self.log.info("mps daemon stopped")

    def server_log(self) -> Path:
        return self.log_dir / "server.log"


class MpsBackend(LedgerBackend):
    """One GPU under MPS: partition id = the device id, 100 SM percent, the GPU's memory.

    See the module docstring: the percentage is a limit, not a reservation.
    """

    kind = "mps"

    def __init__(self, device: LocalDevice, state_dir: Path, binary: str = MPS_CONTROL,
                 daemon: MpsDaemon | None = None) -> None:
        if device.kind != "gpu":
            raise ValueError(f"device {device.id} is {device.kind}; MPS needs a GPU")
        super().__init__(device.id)
        self.device = device
        self.daemon = daemon or MpsDaemon(device.uuid or str(device.index), Path(state_dir) / "mps" / device.id,
                                          binary)
        self.ledgers[device.id] = Ledger(device.id, self.kind, 100, "sm_percent", device.memory_bytes)
        # Bytes of server.log already looked at, and a trailing partial line kept for the
        # next poll (a line split across two polls is matched whole).
        self._log_offset = 0
        self._log_partial = b""
        self.log = log.get(component="partitions", backend=self.kind, device_id=device.id)

    def start(self) -> None:
        # The log directory persists under the state dir: what an earlier run (before an
        # agent restart) wrote there is not about this run's clients, so skip it. Taken
        # before the daemon starts, so nothing this run's server writes is skipped.
        try:
            self._log_offset = self.daemon.server_log().stat().st_size
        except FileNotFoundError:
            self._log_offset = 0
        self._log_partial = b""
        self.daemon.start()

    def stop(self) -> None:
        self.daemon.stop()

    def _attributes(self, partition_id: str) -> dict[str, str]:
        return {"uuid": self.device.uuid, "pipe_dir": str(self.daemon.pipe_dir)}

    def _make_grant(self, grant_id: str, partition_id: str, units: int, memory_bytes: int) -> Grant:
        env = self.daemon.client_env()
        env["CUDA_VISIBLE_DEVICES"] = self.device.uuid or str(self.device.index)
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(units)
        if memory_bytes:
            # Documented format "<ordinal>=<N>M"; the client sees one GPU, ordinal 0.
            # Round down so the limit never exceeds what was granted; under 1 MiB there is
            # no such limit (0M is no limit at all): refused, before anything is booked.
            if memory_bytes < MIB:
                raise BadMemoryLimit(f"memory_bytes: an MPS memory limit is whole MiB; {memory_bytes} bytes is "
                                     f"under 1 MiB (ask 0 for no limit, or at least {MIB})")
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={memory_bytes // MIB}M"
        self.log.info("mps granted", grant_id=grant_id, sm_percent=units, memory_bytes=memory_bytes)
        return Grant(grant_id, partition_id, self.kind, self.device_id, units, memory_bytes, env=env)

    # -- faults ----------------------------------------------------------------------
    def affected_grants(self) -> list[Grant]:
        """Every grant on this GPU: what a fatal fault in any one client takes down."""
        return self.grants()

    def faulted_by_exit(self, grant_id: str, exit_code: int, message: str) -> list[Grant]:
        """Grants to report as failed after ``grant_id``'s client exited with
        ``exit_code`` and last error ``message``: all of this GPU's grants when the message
        shows an MPS-wide fatal fault, [] otherwise (an ordinary failure is the client's own)."""
        if exit_code == 0 or not is_fatal_client_message(message):
            return []
        hit = self.affected_grants()
        self.log.warning("mps fatal fault in a client; every client of the GPU is affected", grant_id=grant_id,
                         exit_code=exit_code, message=message[-200:], affected=[g.grant_id for g in hit])
        return hit

    def poll_faults(self) -> list[Grant]:
        """Read the server log written since the last poll; all grants when it reports a
        fatal fault, else []. Call it periodically (cheap: reads only new bytes). What the
        log held when ``start`` ran (an earlier run's lines) is never read; a trailing
        line without its newline yet is kept and matched whole on a later poll."""
        path = self.daemon.server_log()
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._log_offset:  # truncated or replaced: read it anew
                    self._log_offset, self._log_partial = 0, b""
                f.seek(self._log_offset)
                data = self._log_partial + f.read()
                self._log_offset = f.tell()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        if end == 0 and len(data) > _MAX_PARTIAL_LINE:
            end = len(data)  # no newline in a long stretch: do not hold it forever
        data, self._log_partial = data[:end], data[end:]
        lines = fatal_log_lines(data.decode(errors="replace"))
        if not lines:
            return []
        hit = self.affected_grants()
        self.log.warning("mps server log reports a fatal fault", lines=lines[:5], affected=[g.grant_id for g in hit])
        return hit

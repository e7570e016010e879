"""The agent's side of the executor fork server (``agent.runtime.zygote``).

``Zygote.start`` spawns ``python -m agent.runtime.zygote`` with one end of a
``SOCK_SEQPACKET`` socket pair; ``Zygote.spawn`` has it fork one executor and returns a
:class:`ZygoteProcess`, which offers what ``agent.executors`` uses of an asyncio
subprocess: ``pid``, ``returncode``, ``stdout`` (a StreamReader over the executor's
output pipe), ``wait()``, and the transport's ``close()`` / ``get_pipe_transport(1)``,
plus ``leader_exited``. The executor is the zygote's child, not the agent's: the zygote
reaps it and reports its exit code, which sets ``returncode`` and ``leader_exited``
(signals go to its process group, which it leads, as for any executor).

If the zygote dies, nothing can report its executors' exits any more: each one still
running is killed (SIGKILL to its group) and reads as killed (``returncode`` -9), so its
pump reaps what is left and reports the exit; ``alive`` turns False and the agent spawns
its executors itself from then on. ``stop`` hangs up (the zygote exits; executors go on).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path

from agent.runtime.zygote import SLOT_ENV  # stdlib only at import: no torch in the agent
from tessera import log

SLOT_SIZE = 512  # bytes of the zygote's blank environment slot: room for an executor's labels
READY_TIMEOUT_S = 120.0
MAX_MSG = 1 << 20


class ZygoteError(Exception):
    """The zygote cannot spawn (not started, gone, or it refused)."""


class _Transport:
    """The subset of ``asyncio.SubprocessTransport`` that agent.executors uses."""

    def __init__(self, pipe: asyncio.ReadTransport) -> None:
        self._pipe = pipe

    def get_pipe_transport(self, fd: int):
        return self._pipe if fd == 1 else None

    def close(self) -> None:
        self._pipe.close()


class ZygoteProcess:
    """An executor forked by the zygote (see module doc)."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader, transport: _Transport) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self.leader_exited = asyncio.Event()
        self.transport = transport

    def _exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self.leader_exited.set()

    async def wait(self) -> int:
        await self.leader_exited.wait()
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """One agent's fork server. ``start`` once, ``spawn`` per executor, ``stop`` at the end."""

    def __init__(self, python: str = sys.executable, log_path: Path | None = None) -> None:
        self.python = python
        self.log_path = log_path
        self.sock: socket.socket | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.pid = 0
        self.alive = False
        self._ready: asyncio.Future | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._children: dict[int, ZygoteProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before their spawn's answer was taken
        self._next = 0
        self._reader: asyncio.Task | None = None
        self.log = log.get(component="zygote")

    async def start(self, env: dict[str, str], cwd: str, timeout_s: float = READY_TIMEOUT_S) -> bool:
        """Spawn the zygote and wait until it is warm. Whether it can be used (False: it
        failed, timed out, or cannot label its children's environment; it is stopped)."""
        loop = asyncio.get_running_loop()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.setblocking(False)
        self.sock = mine  # closed by stop, however far this got
        env = dict(env)
        env[SLOT_ENV] = "." * SLOT_SIZE
        env["OMP_NUM_THREADS"] = "1"  # its own: each executor sets its own threads
        out = open(self.log_path, "ab", buffering=0) if self.log_path is not None else asyncio.subprocess.DEVNULL
        try:
            self.proc = await asyncio.create_subprocess_exec(
                self.python, "-m", "agent.runtime.zygote", "--fd", str(theirs.fileno()),
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
                pass_fds=(theirs.fileno(),), env=env, cwd=cwd, start_new_session=True)
        except OSError as e:
            self.log.warning("executor zygote not started; executors start as their own processes", error=str(e))
            mine.close()
            self.sock = None
            return False
        finally:
            theirs.close()
            if not isinstance(out, int):
                out.close()
        self.pid = self.proc.pid
        self._ready = loop.create_future()
        self._reader = asyncio.create_task(self._read())
        try:
            async with asyncio.timeout(timeout_s):
                hello = await asyncio.shield(self._ready)
        except (TimeoutError, ZygoteError) as e:
            self.log.warning("executor zygote not ready; executors start as their own processes", error=repr(e))
            await self.stop()
            return False
        if not hello.get("environ"):
            self.log.warning("executor zygote cannot label its children's environment (/proc/self/mem); "
                             "executors start as their own processes")
            await self.stop()
            return False
        self.alive = True
        self.log.info("executor zygote ready", pid=self.pid)
        return True

    async def spawn(self, argv: list[str], env: dict[str, str], cwd: str) -> ZygoteProcess:
        """Fork one executor running ``argv`` (``python -m agent.runtime --spec ...``) in
        ``cwd`` with exactly ``env``. ZygoteError when the zygote is not alive or refuses."""
        if not self.alive or self.sock is None:
            raise ZygoteError("the executor zygote is not running")
        loop = asyncio.get_running_loop()
        r, w = os.pipe()
        self._next += 1
        rid = self._next
        fut = loop.create_future()
        self._pending[rid] = fut
        try:
            msg = json.dumps({"op": "spawn", "id": rid, "argv": argv, "env": env, "cwd": cwd}).encode()
            try:
                await self._send(msg, w)
            except OSError as e:
                raise ZygoteError(f"the executor zygote is gone: {e}") from None
            finally:
                os.close(w)
            pid = await fut
        except BaseException:
            self._pending.pop(rid, None)
            os.close(r)
            raise
        reader = asyncio.StreamReader(limit=2 ** 16, loop=loop)
        pipe, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop),
                                               os.fdopen(r, "rb", buffering=0))
        proc = ZygoteProcess(pid, reader, _Transport(pipe))
        self._children[pid] = proc
        if pid in self._early:
            proc._exited(self._early.pop(pid))
        return proc

    async def _send(self, msg: bytes, fd: int) -> None:
        """One message with one descriptor, waiting while the socket is full."""
        loop = asyncio.get_running_loop()
        assert self.sock is not None
        while True:
            try:
                socket.send_fds(self.sock, [msg], [fd])
                return
            except BlockingIOError:
                writable = loop.create_future()
                loop.add_writer(self.sock.fileno(), lambda: writable.done() or writable.set_result(None))
                try:
                    await writable
                finally:
                    loop.remove_writer(self.sock.fileno())

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.sock is not None
        try:
            while True:
                data = await loop.sock_recv(self.sock, MAX_MSG)
                if not data:
                    break
                msg = json.loads(data)
                op = msg.get("op")
                if op == "ready" and self._ready is not None and not self._ready.done():
                    self._ready.set_result(msg)
                elif op == "spawned":
                    fut = self._pending.pop(msg.get("id"), None)
                    if fut is not None and not fut.done():
                        fut.set_result(int(msg["pid"]))
                elif op == "error":
                    fut = self._pending.pop(msg.get("id"), None)
                    if fut is not None and not fut.done():
                        fut.set_exception(ZygoteError(str(msg.get("error"))))
                elif op == "exited":
                    pid, code = int(msg["pid"]), int(msg["returncode"])
                    child = self._children.pop(pid, None)
                    if child is not None:
                        child._exited(code)
                    else:
                        self._early[pid] = code
        except (OSError, ValueError, KeyError) as e:
            self.log.error("executor zygote link failed", error=repr(e))
        finally:
            self._lost()

    def _lost(self) -> None:
        """The zygote is gone (or hung up): nothing reports its children's exits any more."""
        was = self.alive
        self.alive = False
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(ZygoteError("the executor zygote exited before it was ready"))
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ZygoteError("the executor zygote exited"))
        self._pending.clear()
        for pid, child in list(self._children.items()):
            if was:
                self.log.error("executor zygote lost; killing its executor", pid=pid)
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            child._exited(-signal.SIGKILL)
        self._children.clear()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Hang up: the zygote exits. Stop it after its executors: one still running is
        killed (``_lost``: nothing would report its exit). SIGKILL if the zygote has not
        exited in ``timeout_s``. Idempotent."""
        serving = self.alive
        self.alive = False
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if not serving and self.proc is not None and self.proc.returncode is None:
            try:  # still warming up (or never answered): it holds nothing, no need to wait for it
                self.proc.kill()
            except ProcessLookupError:
                pass
        if self._reader is not None:
            try:
                async with asyncio.timeout(timeout_s):
                    await asyncio.shield(self._reader)
            except TimeoutError:
                self._reader.cancel()
        if self.proc is not None and self.proc.returncode is None:
            try:
                async with asyncio.timeout(timeout_s):
                    await self.proc.wait()
            except TimeoutError:
                try:
                    self.proc.kill()
                except ProcessLookupError:
                    pass
                await self.proc.wait()
        if self.sock is not None:
            self.sock.close()
            self.sock = None

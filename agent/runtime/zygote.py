"""``python -m agent.runtime.zygote --fd N``: the executor fork server of one agent.

Why: an executor is a fresh Python process, and on a CPU node most of its start is
imports: ``import torch`` and the runtime, ~3 s of CPU here (~6.6 s until the runtime's
optimizers stopped importing ``torch._dynamo``: ``agent.runtime.optim``), more than a
short job's training. The zygote imports them once, then *forks* each executor from that
warm image: an executor reaches its first step in ~0.1 s instead of ~3 s
(``bench.executor_start``).

Contract (the agent's side is ``agent.zygote``). ``N`` is this process's end of an
``AF_UNIX`` ``SOCK_SEQPACKET`` socket pair; every message is one JSON object:

- the zygote sends ``{"op": "ready", "pid": P}`` once warm (``"environ": false`` when it
  cannot label its children's ``/proc/<pid>/environ``, see below: the agent then does not
  use it);
- the agent sends ``{"op": "spawn", "id": I, "argv": [...], "env": {...}, "cwd": D}``
  with one file descriptor (SCM_RIGHTS): the executor's stdout and stderr. The zygote
  forks; the child leads a new session (``setsid``: the agent signals its group) and
  labels its environment (below) before the zygote answers, then takes
  the descriptor as fds 1 and 2 (line-buffered, as ``PYTHONUNBUFFERED`` would), /dev/null
  as stdin, ``cwd`` and exactly ``env`` (OMP_NUM_THREADS applied to torch as a fresh
  interpreter would), and runs ``agent.runtime.__main__.main`` on the arguments after ``-m agent.runtime``, leaving with its
  exit code through the interpreter's normal exit. The zygote answers
  ``{"op": "spawned", "id": I, "pid": P}`` (or ``{"op": "error", "id": I, "error": ...}``);
- when a child exits, the zygote reaps it and sends ``{"op": "exited", "pid": P,
  "returncode": R}`` (negative: killed by signal -R, as asyncio reports it);
- end of file on the socket (the agent stopped or died): the zygote exits; its running
  children go on (a crashed agent's successor finds them by their records, as any
  executor).

``/proc/<pid>/environ`` shows the environment a process was exec'd with, and a forked
child was not: the agent finds an executor's processes by ``TESSERA_EXECUTOR_TOKEN``,
``TESSERA_ALLOCATION_ID`` and ``TESSERA_RANK`` there. So the zygote is started with a
blank ``TESSERA_ZYGOTE_SLOT`` variable, and each child overwrites that slot, in its own
memory, with those entries (``label_environ``); the zygote checks once at start that it
can (it needs a writable ``/proc/self/mem``).

Only CPU executors come here: a fork of a process that imported torch is safe before any
CUDA or OpenMP work, and the zygote does neither; GPU executors keep their own process.
And only those with no more threads than cores: libgomp decides at load, from the CPUs
the zygote may run on, whether idle threads spin; a fork with more threads than cores
would spin against itself (``agent.executors`` starts those as processes of their own).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import random
import select
import signal
import socket
import sys
import traceback

SLOT_ENV = "TESSERA_ZYGOTE_SLOT"
LABELS = ("TESSERA_EXECUTOR_TOKEN", "TESSERA_ALLOCATION_ID", "TESSERA_RANK", "TESSERA_JOB_ID")
MAX_MSG = 1 << 20
# What an executor would import on its own: the runners (and torch with them), and
# torch.fx.experimental.symbolic_shapes, which torch imports lazily at a backward given
# explicit gradients (every pipeline stage but the last: ~0.5 s of sympy). Not
# torch._dynamo: the runtime's optimizers never import it (agent.runtime.optim; it was
# ~3.6 s of CPU here, more than torch itself, and ~70 MB in every executor).
PRELOAD = ("agent.runtime.train", "agent.runtime.peft.workload", "agent.runtime.multimodal.workload",
           "torch.fx.experimental.symbolic_shapes")


def _environ_range() -> tuple[int, int]:
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2:].split()  # fields 3.. of proc(5); env_start is 50, env_end 51
    return int(fields[47]), int(fields[48])


def label_environ(entries: dict[str, str]) -> bool:
    """Write ``entries`` as ``KEY=VALUE`` into this process's ``SLOT_ENV`` slot of its
    initial environment block (what ``/proc/self/environ`` shows), padding with a shorter
    slot entry. False when there is no slot, the entries do not fit, or the memory cannot
    be written; never raises."""
    try:
        start, end = _environ_range()
        fd = os.open("/proc/self/mem", os.O_RDWR)
        try:
            blob = os.pread(fd, end - start, start)
            key = SLOT_ENV.encode() + b"="
            i = 0 if blob.startswith(key) else blob.find(b"\0" + key) + 1
            if i == 0 and not blob.startswith(key):
                return False
            j = blob.index(b"\0", i)
            new = b"\0".join(f"{k}={v}".encode() for k, v in entries.items())
            pad = (j - i) - len(new) - 1 - len(key)
            if pad < 0:
                return False
            new += b"\0" + key + b"." * pad
            os.pwrite(fd, new, start + i)
        finally:
            os.close(fd)
        return True
    except (OSError, ValueError, IndexError):
        return False


def _environ_ok() -> bool:
    """Whether ``label_environ`` works here: tried in a forked child (the zygote's own slot
    stays blank), which reads its ``/proc/self/environ`` back."""
    pid = os.fork()
    if pid == 0:
        ok = label_environ({"TESSERA_ZYGOTE_TEST": "1"})
        try:
            ok = ok and b"TESSERA_ZYGOTE_TEST=1" in open("/proc/self/environ", "rb").read().split(b"\0")
        except OSError:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _send(sock: socket.socket, msg: dict) -> None:
    sock.send(json.dumps(msg).encode())


def serve(sock: socket.socket) -> tuple[dict, int] | None:
    """The zygote's loop. Returns None in the zygote when the agent hung up, and
    ``(request, output fd)`` in a freshly forked child (which then becomes the executor)."""
    children: dict[int, int] = {}  # pidfd -> pid
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    while True:
        for fd, _ in poll.poll():
            if fd != sock.fileno() and fd not in children:
                continue
            if fd in children:
                pid = children.pop(fd)
                poll.unregister(fd)
                os.close(fd)
                try:
                    _, status = os.waitpid(pid, 0)
                    code = os.waitstatus_to_exitcode(status)
                except ChildProcessError:
                    code = -signal.SIGKILL  # not ours to reap any more: say killed
                _send(sock, {"op": "exited", "pid": pid, "returncode": code})
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 4)
            except ConnectionResetError:
                data, fds = b"", []
            if not data:
                return None  # the agent is gone
            req = json.loads(data)
            if req.get("op") != "spawn" or len(fds) != 1:
                for f in fds:
                    os.close(f)
                _send(sock, {"op": "error", "id": req.get("id"), "error": "bad request"})
                continue
            out = fds[0]
            sys.stdout.flush()
            sys.stderr.flush()
            sync_r, sync_w = os.pipe()
            try:
                pid = os.fork()
            except OSError as e:
                for f in (out, sync_r, sync_w):
                    os.close(f)
                _send(sock, {"op": "error", "id": req.get("id"), "error": f"fork: {e}"})
                continue
            if pid == 0:
                try:
                    for f in (*children, sync_r):
                        os.close(f)
                    sock.close()
                    # Before the agent hears of it: its own session (the agent signals and
                    # records its group) and its labels (the agent finds its processes by them).
                    os.setsid()
                    env = req.get("env") or {}
                    label_environ({k: str(env[k]) for k in LABELS if k in env})
                    os.close(sync_w)
                except BaseException:  # noqa: BLE001 - never back into the zygote's loop, never "success"
                    traceback.print_exc()
                    os._exit(70)
                return req, out
            os.close(out)
            os.close(sync_w)
            while os.read(sync_r, 1):  # EOF: the child has its session and labels (or died)
                pass
            os.close(sync_r)
            pidfd = os.pidfd_open(pid)
            children[pidfd] = pid
            poll.register(pidfd, select.POLLIN)
            _send(sock, {"op": "spawned", "id": req.get("id"), "pid": pid})


def _become_executor(req: dict, out: int) -> int:
    """In the forked child: take the request's session, output, directory and
    environment, then run the executor's main. Its exit code."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True,
                                  errors="backslashreplace")
    os.chdir(req["cwd"])
    env = {str(k): str(v) for k, v in req["env"].items()}
    os.environ.clear()
    os.environ.update(env)
    cores = env.get("TESSERA_CPU_CORES", "")
    if cores:
        try:  # before any thread starts (they inherit it); the agent pins from outside too
            os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
        except (OSError, ValueError):
            pass  # the agent's own pin reports the failure
    random.seed()  # not the zygote's stream, shared by every child
    import torch

    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # what a fresh interpreter takes from the variable
    argv = [str(a) for a in req["argv"]]
    args = argv[3:] if argv[1:2] == ["-m"] else argv[1:]  # "python -m agent.runtime ARGS" or "python ARGS"
    import agent.runtime.__main__ as executor

    sys.argv = [executor.__file__, *args]  # as ``python -m`` sets it
    return executor.main(args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agent.runtime.zygote", description="Tessera executor fork server")
    ap.add_argument("--fd", type=int, required=True, help="this end of the agent's SOCK_SEQPACKET socket pair")
    args = ap.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    # SIGTERM is blocked before torch starts its threads (an executor's main blocks it too
    # and takes it in a thread of its own); the agent ends the zygote by hanging up or SIGKILL.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    import importlib

    importlib.import_module("torch")  # the point of the zygote
    for mod in PRELOAD:
        try:
            importlib.import_module(mod)
        except Exception:  # noqa: BLE001 - a workload whose dependencies are missing fails in its executor
            pass
    environ = _environ_ok()
    # What the imports made lives for ever in every child: out of the collector's sight
    # (a full collection would walk it, and write to every shared page it walks).
    gc.freeze()
    _send(sock, {"op": "ready", "pid": os.getpid(), "environ": environ})
    try:
        got = serve(sock)
    except OSError:  # the agent hung up while the zygote answered
        got = None
    if got is None:
        os._exit(0)  # nothing to flush or close: skip the slow teardown of torch's interpreter
    req, out = got
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a fresh process's mask
    try:
        return _become_executor(req, out)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported on the executor's output, as a crash would be
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())

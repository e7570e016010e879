"""Reading /proc (Linux): one implementation for the agent (executor records, reaping,
orphan scans) and the testbed (is a recorded pid still the process it recorded?)."""

from __future__ import annotations

import os


def read_proc(path: str) -> bytes:
    """The whole of a /proc file, read with plain os calls (a /proc scan reads one or two
    per process: pathlib's overhead would be most of its cost). OSError as open/read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = [os.read(fd, 4096)]
        while chunks[-1]:
            chunks.append(os.read(fd, 65536))
        return b"".join(chunks)
    finally:
        os.close(fd)


def proc_stat(pid: int) -> list[bytes] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (index 0 is field 3, the state), as bytes, or
    None when the process does not exist or the file cannot be parsed."""
    try:
        raw = read_proc(f"/proc/{pid}/stat")
        # The command name (field 2) may hold spaces and parentheses: split after its ")".
        rest = raw[raw.rindex(b")") + 2:].split()
        return rest if len(rest) >= 20 else None
    except (OSError, ValueError):
        return None


def process_start_ticks(pid: int) -> int | None:
    """Start time of live process ``pid`` (field 22 of ``/proc/<pid>/stat``, clock ticks
    since boot): with the pid, it names one process, never a later one that reuses the
    pid. None when there is no such process or it is a zombie (already dead)."""
    rest = proc_stat(pid)
    if rest is None or rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])

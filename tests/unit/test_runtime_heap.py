"""The executor keeps its heap between steps (agent.runtime.heap): policy parsing, and
the real effect on a training step's page faults, measured on the gpt runtime."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agent.runtime.heap import ENV, heap_mode
from tessera.errors import SpecError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs the gpt runtime in this process (as an executor does) and prints the minor page
# faults of each step (stamped where the loop starts a step, and after the last).
CHILD = r"""
import json, os, resource, sys
import torch
torch.set_num_threads(1)
from agent.runtime.__main__ import resolve
from agent.runtime.parallel import comm
from agent.runtime.report import Reporter
marks = []
orig = comm.TIMER.reset
def reset():
    marks.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
    return orig()
comm.TIMER.reset = reset
spec = {"job_id": "heap", "threads": 1, "workload": {
    "type": "gpt", "steps": 10, "batch_size": 24, "learning_rate": 1e-3, "seed": 0, "checkpoint_every": 0,
    "data": {"kind": "synthetic"},
    "model": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 64}}}
code = resolve("gpt")(spec, Reporter(stream=open(os.devnull, "w"), enabled=False))
marks.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
assert code == 0, code
print("FAULTS", json.dumps([b - a for a, b in zip(marks, marks[1:])]))
"""


def test_heap_mode_defaults_to_keep_and_names_the_variable_when_bad():
    assert heap_mode({}) == "keep"
    assert heap_mode({ENV: ""}) == "keep"
    assert heap_mode({ENV: " Release "}) == "release"
    with pytest.raises(SpecError) as e:
        heap_mode({ENV: "sometimes"})
    assert e.value.field == ENV and "keep, release" in str(e.value)


# Allocates and frees one 8 MiB block with glibc's malloc after the runtime's policy,
# and reports where it lay (its own mapping or the heap) and what the heap kept.
MALLOC_CHILD = r"""
import ctypes, json
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
from agent.runtime.heap import keep_heap
kept = keep_heap()
before = libc.mallinfo2()
block = libc.malloc(8 << 20)
during = libc.mallinfo2()
libc.free(block)
after = libc.mallinfo2()
print("INFO", json.dumps({"kept": kept, "own_mapping": during.hblks - before.hblks,
                          "heap_grew": during.arena - before.arena, "heap_kept": after.arena - before.arena}))
"""


def _child(code: str, mode: str, tag: str) -> str:
    env = dict(os.environ, **{ENV: mode}, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith(tag + " ")]
    assert out.returncode == 0 and line, out.stderr[-2000:]
    return line[0][len(tag) + 1:]


def _glibc_version() -> tuple[int, ...]:
    try:
        name = os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.36"
    except (ValueError, OSError):
        return ()
    parts = name.split()[-1].split(".") if name.startswith("glibc") else []
    return tuple(int(x) for x in parts if x.isdigit())


glibc = pytest.mark.skipif(not _glibc_version(), reason="glibc malloc")
mallinfo2 = pytest.mark.skipif(_glibc_version() < (2, 33), reason="mallinfo2: glibc >= 2.33")


@mallinfo2
def test_kept_heap_serves_a_large_block_from_the_heap_and_keeps_it_after_free():
    kept = json.loads(_child(MALLOC_CHILD, "keep", "INFO"))
    assert kept["kept"] is True
    assert kept["own_mapping"] == 0 and kept["heap_grew"] > 4 << 20  # the heap grew by (most of) it
    assert kept["heap_kept"] > 4 << 20  # freed, still mapped for the next step
    released = json.loads(_child(MALLOC_CHILD, "release", "INFO"))
    assert released["kept"] is False
    assert released["own_mapping"] == 1 and released["heap_kept"] < 4 << 20  # glibc's defaults: mmap, munmap


@glibc
def test_a_training_step_stops_faulting_once_the_heap_is_kept():
    # A 2 x 64 GPT at 24 x 64 tokens: its activations lie above glibc's default mmap
    # threshold; released, its steps fault pages in again (~700 per step here, though
    # glibc's dynamic threshold sometimes adapts); kept, the heap grows over the first
    # steps and then serves every step from pages it already has.
    faults = json.loads(_child(CHILD, "keep", "FAULTS"))
    later = sorted(faults[3:])
    assert later[len(later) // 2] <= 16, faults  # median step after the third: no new pages

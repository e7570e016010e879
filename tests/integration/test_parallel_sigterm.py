"""SIGTERM to ONE rank of a dp=2 job stops both ranks at the same step, with a checkpoint.

The stop flag rides in the per-step all-reduce, so the rank that was not signalled
leaves too instead of hanging in the next collective.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from agent.runtime import checkpoint
from agent.runtime.parallel.launch import free_port
from agent.runtime.report import parse_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_the_job_with_a_checkpoint(tmp_path):
    port = free_port()
    ck = tmp_path / "ck"
    procs = []
    for rank in range(2):
        s = {
            "job_id": "j-term2",
            "workload": {"type": "gpt", "model": {"vocab": 64, "seq_len": 16, "layers": 2, "hidden": 32, "heads": 4},
                         "steps": 1_000_000, "batch_size": 4, "plan": {"dp": 2}, "checkpoint_every": 0},
            "dist": {"rank": rank, "world_size": 2, "master_addr": "127.0.0.1", "master_port": port, "timeout_s": 60},
            "checkpoint_dir": str(ck),
            "threads": 1,
        }
        p = tmp_path / f"spec{rank}.json"
        p.write_text(json.dumps(s))
        procs.append(subprocess.Popen([sys.executable, "-m", "agent.runtime", "--spec", str(p)], cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        for line in procs[0].stdout:  # rank 0 reports; wait until training is under way
            ev = parse_line(line)
            if ev and ev["event"] == "progress":
                break
        procs[1].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [143, 143], [o[1][-1500:] for o in outs]
    ev0 = [e for e in map(parse_line, outs[0][0].splitlines()) if e]
    ev1 = [e for e in map(parse_line, outs[1][0].splitlines()) if e]
    cks = [e for e in ev0 if e["event"] == "checkpoint"]
    assert len(cks) == 1
    assert ev0[-1]["event"] == "error" and ev0[-1]["signal"] == "SIGTERM"
    assert ev1 and ev1[-1]["event"] == "error" and ev1[-1]["rank"] == 1  # non-zero ranks still report errors
    saved = checkpoint.load(str(ck))
    assert saved["step"] == cks[0]["step"] and saved["plan"]["dp"] == 2

"""``python -m agent.runtime``: dispatch, bad input, SIGTERM (real subprocesses)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from agent.runtime import checkpoint
from agent.runtime.__main__ import RUNNERS, resolve
from agent.runtime.report import parse_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launch(spec_path: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "agent.runtime", "--spec", spec_path],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def events(text: str) -> list[dict]:
    return [e for e in map(parse_line, text.splitlines()) if e]


def test_registry_is_lazy_and_gpt_resolves():
    assert RUNNERS["gpt"] == "agent.runtime.train:run"
    assert set(RUNNERS) >= {"gpt", "peft", "multimodal"}
    assert callable(resolve("gpt"))


def test_unknown_type_is_exit_2_with_error_event(tmp_path):
    p = tmp_path / "spec.json"
    p.write_text(json.dumps({"job_id": "x", "workload": {"type": "diffusion"}}))
    proc = launch(str(p))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    ev = events(out)
    assert ev[-1]["event"] == "error" and ev[-1]["field"] == "workload.type"


def test_unreadable_spec_is_exit_2(tmp_path):
    p = tmp_path / "spec.json"
    p.write_text("{not json")
    proc = launch(str(p))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert events(out)[-1]["event"] == "error"


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_143(tmp_path):
    ck = tmp_path / "ck"
    spec = {
        "job_id": "j-term",
        "workload": {"type": "gpt", "model": {"vocab": 64, "seq_len": 16, "layers": 2, "hidden": 32, "heads": 4},
                     "steps": 1_000_000, "batch_size": 4, "checkpoint_every": 0},
        "checkpoint_dir": str(ck),
        "threads": 1,
    }
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(spec))
    proc = launch(str(p))
    try:
        # Wait (without sleeping) for training to be under way.
        for line in proc.stdout:
            ev = parse_line(line)
            if ev and ev["event"] == "progress":
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    ev = events(out)
    cks = [e for e in ev if e["event"] == "checkpoint"]
    assert len(cks) == 1 and ev[-1]["event"] == "error" and ev[-1]["signal"] == "SIGTERM"
    saved = checkpoint.load(str(ck))
    assert saved["step"] == cks[0]["step"] >= 1
    assert saved["step"] < 1_000_000


def test_an_executor_freezes_its_imports_and_never_imports_torch_dynamo(tmp_path):
    """What the imports made is out of the collector's way before training (a full
    collection would walk ~200,000 objects), and a checkpointing gpt run through ``main``
    leaves ``torch._dynamo`` unimported (agent.runtime.optim)."""
    p = tmp_path / "spec.json"
    p.write_text(json.dumps({"job_id": "fz", "checkpoint_dir": str(tmp_path / "ck"), "workload": {
        "type": "gpt", "model": {"vocab": 32, "seq_len": 8, "layers": 1, "hidden": 16, "heads": 2},
        "steps": 3, "batch_size": 2, "checkpoint_every": 1}}))
    code = ("import gc, sys\nfrom agent.runtime.__main__ import main\n"
            f"rc = main(['--spec', {str(p)!r}])\n"
            "print('RESULT', rc, gc.get_freeze_count(), 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines, out.stderr[-2000:]
    rc, frozen, dynamo = lines[0].split()[1:]
    assert rc == "0" and int(frozen) > 50_000 and dynamo == "False", out.stderr[-2000:]
    assert checkpoint.load(str(tmp_path / "ck"))["step"] == 3

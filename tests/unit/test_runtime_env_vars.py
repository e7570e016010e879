"""The executor's environment settings: a bad value fails the run before training, with
exit code 2 and an error event naming the variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agent.runtime import heap, optim
from agent.runtime.report import parse_line

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("var", [heap.ENV, optim.ENV])
def test_a_bad_setting_fails_the_executor_naming_the_variable(tmp_path, var):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"job_id": "x", "workload": {"type": "gpt", "steps": 1}}))
    out = subprocess.run([sys.executable, "-m", "agent.runtime", "--spec", str(spec)], capture_output=True,
                         text=True, cwd=REPO, env=dict(os.environ, **{var: "sometimes"}), timeout=120)
    events = [e for e in map(parse_line, out.stdout.splitlines()) if e]
    assert out.returncode == 2, out.stderr[-2000:]
    assert events[-1]["event"] == "error" and events[-1]["field"] == var and "sometimes" in events[-1]["message"]

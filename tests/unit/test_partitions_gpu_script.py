"""bench/gpu/run.sh: valid bash; without a GPU it exits 0 and writes a JSON saying so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "run.sh"


def test_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine runs the real check")
def test_no_gpu_exits_0_with_json(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT)], env={**os.environ, "OUT": str(tmp_path)}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU" in r.stdout
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["gpu"] is False and "no CUDA GPU" in s["reason"]

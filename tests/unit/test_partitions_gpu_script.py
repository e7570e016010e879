"""bench/gpu/run.sh: valid bash; without a GPU it exits 0 and writes a JSON saying so."""

from __future__ import annotations

import json
import re
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


def _bash_fn(*names: str) -> str:
    """The definitions of run.sh's pure helper functions, to source in a test shell."""
    text = SCRIPT.read_text()
    out = []
    for n in names:
        m = re.search(rf"^{n}\(\) {{.*?^}}\n", text, re.S | re.M)
        assert m, n
        out.append(m.group(0))
    return "\n".join(out)


@pytest.mark.parametrize("rc,want", [(0, "false"), (1, "false"), (124, "true"), (137, "true"), (130, "false")])
def test_timed_out_rule(rc, want):
    r = subprocess.run(["bash", "-c", _bash_fn("is_timeout") + f"\nis_timeout {rc}"], capture_output=True, text=True)
    assert r.stdout.strip() == want


@pytest.mark.parametrize("limit,elapsed,want", [(150, 0, 150), (150, 400, 75), (60, 455, 20), (60, 456, 0), (60, 500, 0)])
def test_clip_limit_keeps_term_and_kill_inside_the_budget(limit, elapsed, want):
    src = "BUDGET_S=480; KILL_AFTER=5\n" + _bash_fn("clip_limit") + f"\nclip_limit {limit} {elapsed}"
    r = subprocess.run(["bash", "-c", src], capture_output=True, text=True)
    assert int(r.stdout) == want
    if want:
        assert elapsed + want + 5 <= 480


def test_step_limits_fit_the_default_budget():
    text = SCRIPT.read_text()
    budget = int(re.search(r"BUDGET_S=\$\{TESSERA_GPU_BUDGET_S:-(\d+)\}", text).group(1))
    limits = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s*step (\w+) (\d+) ", text, re.M)}
    loop = re.search(r"for mod in ([\w ]+); do.*?limit=(\d+);.*?peft_mux \] && limit=(\d+)", text, re.S)
    for mod in loop.group(1).split():  # a step that also runs above (under MPS) counts at its larger limit
        limits[mod] = max(limits.get(mod, 0), int(loop.group(3)) if mod == "peft_mux" else int(loop.group(2)))
    assert set(limits) == {"devices", "mps_quota", "estimator_accuracy", "peft_mux", "mm_colocate", "mm_reshard"}
    assert budget <= 540 and sum(limits.values()) <= budget, limits  # the device tool: 600 s a call
    assert limits["peft_mux"] >= 150 and limits["mps_quota"] >= 75


def test_external_commands_are_bounded_and_mig_is_only_queried():
    text = SCRIPT.read_text()
    for cmd in ("nvidia-smi -L", "nvidia-cuda-mps-control -d", '"$PY" -c "import torch, sys; sys.exit(0 if torch'):
        for line in text.splitlines():
            if cmd in line and not line.lstrip().startswith(("#", "echo")):
                assert "timeout " in line, line
    assert "mig.mode.current" in text
    assert not re.search(r"nvidia-smi[^\n]*(-mig |--mig|mig -|-r\b|--gpu-reset)", text)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine runs the real check")
def test_device_run_bundles_everything_into_few_files(tmp_path):
    """The device tool returns at most 8 files: device_run.sh puts every output into
    gpu.tgz and copies the JSON documents beside it; its bound leaves run.sh its budget."""
    import tarfile

    wrapper = SCRIPT.with_name("device_run.sh")
    r = subprocess.run(["bash", str(wrapper)], env={**os.environ, "OUT": str(tmp_path)}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["gpu.tgz", "summary.json"] and len(names) <= 8
    with tarfile.open(tmp_path / "gpu.tgz") as t:
        assert {"./summary.json", "./steps.jsonl", "./gpu-modes.txt"} <= set(t.getnames())
    budget = int(re.search(r"BUDGET_S=\$\{TESSERA_GPU_BUDGET_S:-(\d+)\}", SCRIPT.read_text()).group(1))
    bound = int(re.search(r"timeout -k 5 (\d+) bash bench/gpu/run.sh", wrapper.read_text()).group(1))
    call = int(re.search(r"timeout_s=(\d+)", wrapper.read_text()).group(1))
    assert budget < bound and bound + 5 + 15 <= call <= 600  # + kill grace + the bundle

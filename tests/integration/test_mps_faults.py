"""The agent's MPS fault path against the existing doubles: the fake
``nvidia-cuda-mps-control`` (tests/unit/test_partitions_backends.py) and executors that
are real subprocesses of a fake runtime (they print what a CUDA client under MPS prints,
or wait). A fatal fault in one MPS client, or in the server's log, fails every executor
on that GPU, each reported EXITED with the fault; the agent's capacity check refuses a
quota beyond the GPU's 100 SM percent."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from agent.devices import LocalDevice
from agent.executors import CapacityError, ExecutorManager
from agent.partitions import MpsBackend, Partitions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_partitions_backends import FAKE_MPS  # noqa: E402 - the shared MPS control double

GPU = LocalDevice(id="gpu0", kind="gpu", model="H200", memory_bytes=140 << 30, capacity=100, uuid="GPU-abc", index=0)

# A fake runtime: records its MPS environment, then either fails like a CUDA client hit by
# an illegal address (job id "j-bad") or waits to be killed.
FAKE_RUNTIME = """#!{python}
import json, os, sys, time
spec_path = sys.argv[sys.argv.index("--spec") + 1]
spec = json.load(open(spec_path))
keys = ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_VISIBLE_DEVICES")
json.dump({{k: os.environ.get(k) for k in keys}}, open(spec_path + ".env", "w"))
print("ready", flush=True)
if os.environ["TESSERA_JOB_ID"] == "j-bad":
    time.sleep(float(os.environ.get("FAKE_DELAY", "0.5")))
    print("RuntimeError: CUDA error: an illegal memory access was encountered", flush=True)
    sys.exit(1)
time.sleep(120)
"""


@pytest.fixture
def mgr(tmp_path):
    mps = tmp_path / "nvidia-cuda-mps-control"
    mps.write_text(FAKE_MPS.format(python=sys.executable))
    mps.chmod(0o755)
    rt = tmp_path / "fake-python"
    rt.write_text(FAKE_RUNTIME.format(python=sys.executable))
    rt.chmod(0o755)
    parts = Partitions([MpsBackend(GPU, tmp_path / "state", str(mps))])
    parts.start()
    reports: list[tuple[str, int, dict]] = []
    started: dict[str, asyncio.Event] = {}

    async def on_report(ex, r):
        reports.append((ex.allocation_id, ex.rank, r))

    m = ExecutorManager(tmp_path / "state", [GPU], on_report, python=str(rt), parts=parts)
    m.reports, m.started = reports, started
    yield m
    parts.stop()


async def _launch(m: ExecutorManager, alloc: str, job: str, units: int):
    ex, _ = await m.launch(allocation_id=alloc, job_id=job, rank=0, world_size=1, device_ids=["gpu0"],
                           master_addr="127.0.0.1", master_port=1, runtime_spec={"workload": {"type": "gpt"}},
                           checkpoint_dir="", partition_id="gpu0", units=units)
    return ex


async def _wait_exited(m: ExecutorManager, allocs: set[str], timeout: float = 20.0) -> dict[str, dict]:
    async with asyncio.timeout(timeout):
        while True:
            got = {a: r for a, _, r in m.reports if r["kind"] == "EXITED" and a in allocs}
            if set(got) == allocs:
                return got
            await asyncio.sleep(0.05)


async def _env(m: ExecutorManager, alloc: str) -> dict:
    p = m.state_dir / "specs" / f"{alloc}-r0.json.env"
    async with asyncio.timeout(20):
        while not p.exists() or not p.read_text():
            await asyncio.sleep(0.05)
    return json.loads(p.read_text())


async def test_client_fault_fails_every_client_of_the_gpu(mgr):
    a = await _launch(mgr, "a-1", "j-ok1", 40)
    b = await _launch(mgr, "a-2", "j-ok2", 30)
    assert (await _env(mgr, "a-1"))["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert (await _env(mgr, "a-2"))["CUDA_VISIBLE_DEVICES"] == "GPU-abc"
    # Second capacity check: 40 + 30 held, 40 more is beyond 100 SM percent.
    with pytest.raises(CapacityError, match=r"partition gpu0 \(mps\): asked 40 sm_percent .* only 30 of 100"):
        await _launch(mgr, "a-3", "j-ok3", 40)
    await _launch(mgr, "a-bad", "j-bad", 30)
    got = await _wait_exited(mgr, {"a-1", "a-2", "a-bad"})
    for alloc in ("a-1", "a-2"):
        assert got[alloc]["exit_code"] != 0
        assert "MPS fatal fault on gpu0" in got[alloc]["message"] and "illegal memory access" in got[alloc]["message"]
    assert got["a-bad"]["exit_code"] == 1 and "MPS fatal fault" in got["a-bad"]["message"]
    assert not a.running and not b.running
    assert mgr.parts.grants() == []  # every grant released
    assert mgr.parts.describe()[0].free_units == 100


async def test_server_log_fault_fails_every_client(mgr):
    await _launch(mgr, "a-1", "j-ok1", 50)
    await _launch(mgr, "a-2", "j-ok2", 50)
    await _env(mgr, "a-1")
    await _env(mgr, "a-2")
    backend = mgr.parts.backends["gpu0"]
    log = backend.daemon.server_log()
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("[t] New client 1 connected\n")
    assert mgr.check_faults() == []  # an ordinary line is not a fault
    with open(log, "a") as f:
        f.write("[t] Server 42 hit a fatal GPU exception, terminating clients\n")
    hit = mgr.check_faults()
    assert sorted(e.allocation_id for e in hit) == ["a-1", "a-2"]
    got = await _wait_exited(mgr, {"a-1", "a-2"})
    for r in got.values():
        assert r["exit_code"] != 0 and "MPS server of gpu0 reported a fatal fault" in r["message"]
    assert mgr.parts.grants() == []


async def test_ordinary_failure_is_the_clients_own(mgr):
    """A client failing for its own reasons (no MPS-wide error) takes nobody else down."""
    ok = await _launch(mgr, "a-1", "j-ok1", 50)
    mgr.reports.clear()
    ex, _ = await mgr.launch(allocation_id="a-own", job_id="j-own", rank=0, world_size=1, device_ids=["gpu0"],
                             master_addr="127.0.0.1", master_port=1, runtime_spec={"workload": {"type": "gpt"}},
                             checkpoint_dir="", partition_id="gpu0", units=10)
    await _env(mgr, "a-own")
    await mgr.stop("a-own", 2)
    got = await _wait_exited(mgr, {"a-own"})
    assert "MPS" not in got["a-own"]["message"]
    assert ok.running
    await mgr.stop("a-1", 2)

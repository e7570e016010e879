"""Partition backends: capacity accounting and refusal (cpuset, timeslice, MPS), cpuset
pinning in a real child, MPS env and daemon manager against a fake control binary, MPS
fault detection, backend selection."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.devices import LocalDevice
from agent.partitions import (BadGrant, CapacityRefused, CpusetBackend, Ledger, MpsBackend, MpsDaemon, MpsError,
                              Partitions, TimeSliceBackend, UnknownPartition, fatal_log_lines,
                              is_fatal_client_message, pick_cores, select_kind)

GIB = 1024 ** 3
CPU = LocalDevice(id="cpu0", kind="cpu", model="x", memory_bytes=8 * GIB, capacity=4, cores=(0, 1, 2, 3))
GPU = LocalDevice(id="gpu0", kind="gpu", model="H200", memory_bytes=140 * GIB, capacity=100, uuid="GPU-abc", index=0)


def test_ledger_sums_and_refuses_with_numbers():
    led = Ledger("p", "mps", 100, "sm_percent", 10 * GIB)
    led.take("a", 30, 4 * GIB)
    led.take("a", 30, 4 * GIB)  # idempotent repeat
    with pytest.raises(CapacityRefused) as e:
        led.take("b", 71)
    assert (e.value.partition_id, e.value.asked, e.value.free, e.value.capacity) == ("p", 71, 70, 100)
    assert "partition p" in str(e.value) and "asked 71" in str(e.value) and "only 70" in str(e.value)
    with pytest.raises(CapacityRefused) as e:
        led.take("b", 10, 7 * GIB)
    assert e.value.resource == "memory" and e.value.free == 6 * GIB
    with pytest.raises(BadGrant):
        led.take("a", 40)
    with pytest.raises(BadGrant):
        led.take("c", 0)
    led.take("b", 70, 6 * GIB)
    assert led.free_units == 0 and led.free_memory == 0
    assert led.give("a") and not led.give("a")
    assert led.free_units == 30


def test_pick_cores_prefers_contiguous():
    assert pick_cores((0, 1, 2, 3, 4, 5), {1}, 3) == (2, 3, 4)
    assert pick_cores((0, 1, 2, 3), {1, 3}, 2) == (0, 2)


def test_cpuset_grants_distinct_cores_and_refuses():
    b = CpusetBackend(CPU)
    g1 = b.grant("a/r0", "cpu0", 2)
    g2 = b.grant("b/r0", "cpu0", 2)
    assert set(g1.cores).isdisjoint(g2.cores) and g1.threads == 2 and g1.env["OMP_NUM_THREADS"] == "2"
    with pytest.raises(CapacityRefused, match="cpu0.*asked 1 cores.*only 0 of 4"):
        b.grant("c/r0", "cpu0", 1)
    with pytest.raises(UnknownPartition):
        b.grant("c/r0", "cpu9", 1)
    b.release("a/r0")
    assert b.partitions()[0].free_units == 2
    assert b.grant("c/r0", "cpu0", 2).cores == g1.cores


def test_cpuset_units_per_core_declares_a_larger_core_set():
    """Two cores counted twice each: a 4-unit partition; a grant runs on the physical
    cores of its units, grows and shrinks by units, and refuses beyond 4."""
    dev = LocalDevice(id="cpu0", kind="cpu", model="x", memory_bytes=0, capacity=4, cores=(0, 1), units_per_core=2)
    b = CpusetBackend(dev)
    (p,) = b.partitions()
    assert (p.capacity_units, p.unit, p.attributes) == (4, "cores", {"cores": "0,1", "units_per_core": "2"})
    a, c = b.grant("a", "cpu0", 2), b.grant("c", "cpu0", 2)
    assert (a.cores, c.cores, a.threads, a.env["TESSERA_CPU_CORES"]) == ((0,), (1,), 2, "0")
    with pytest.raises(CapacityRefused, match="only 0 of 4"):
        b.grant("d", "cpu0", 1)
    assert b.regrant("a", 1).cores == (0,)           # keeps its lowest unit
    assert b.regrant("c", 3).cores == (0, 1)         # takes the unit a freed, on core 0
    assert b.partitions()[0].free_units == 0
    b.release("c")
    assert b.grant("e", "cpu0", 3).cores == (0, 1) and b.partitions()[0].free_units == 0
    with pytest.raises(ValueError):
        CpusetBackend(LocalDevice(id="x", kind="cpu", model="x", memory_bytes=0, capacity=1, cores=(0,),
                                  units_per_core=0))


def test_cpu_devices_units_per_core():
    from agent.devices import cpu_devices

    n = len(os.sched_getaffinity(0))
    (d,) = cpu_devices(1, units_per_core=3)
    assert (d.capacity, d.units_per_core, len(d.cores)) == (3 * n, 3, n)
    assert cpu_devices(1)[0].capacity == n
    with pytest.raises(ValueError):
        cpu_devices(1, units_per_core=0)


def test_cpuset_preexec_and_pin_really_pin_a_child():
    cores = sorted(os.sched_getaffinity(0))
    dev = LocalDevice(id="cpu0", kind="cpu", model="x", memory_bytes=0, capacity=len(cores), cores=tuple(cores))
    g = CpusetBackend(dev).grant("a", "cpu0", 1)
    code = "import os; print(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])"
    out = subprocess.run([sys.executable, "-c", code], preexec_fn=g.preexec, env=g.apply_env(dict(os.environ)),
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"{list(g.cores)} 1"
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        g.pin(p.pid)
        assert os.sched_getaffinity(p.pid) == set(g.cores)
    finally:
        p.communicate("")


def test_timeslice_slots():
    b = TimeSliceBackend(GPU, slots=2)
    g = b.grant("a", "gpu0", 1)
    b.grant("b", "gpu0", 1)
    assert g.env == {"CUDA_VISIBLE_DEVICES": "GPU-abc"}
    with pytest.raises(CapacityRefused, match="asked 1 slots.*only 0 of 2"):
        b.grant("c", "gpu0", 1)
    c = TimeSliceBackend(CPU, slots=3).grant("a", "cpu0", 1)
    assert c.cores == (0, 1, 2, 3) and c.threads == 4


FAKE_MPS = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
    rec = os.path.join(os.environ["CUDA_MPS_LOG_DIRECTORY"], "calls.jsonl")
    stdin = "" if "-d" in sys.argv else sys.stdin.read()
    with open(rec, "a") as f:
        f.write(json.dumps({{"args": sys.argv[1:], "stdin": stdin,
                            "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}}) + "\\n")
    if "-d" in sys.argv:
        open(os.path.join(pipe, "control"), "w").close()
    elif stdin.strip() == "quit":
        os.remove(os.path.join(pipe, "control"))
    else:
        sys.exit(1)
""")


@pytest.fixture
def fake_mps(tmp_path: Path) -> str:
    p = tmp_path / "nvidia-cuda-mps-control"
    p.write_text(FAKE_MPS.format(python=sys.executable))
    p.chmod(0o755)
    return str(p)


def _calls(d: MpsDaemon) -> list[dict]:
    import json
    return [json.loads(x) for x in (d.log_dir / "calls.jsonl").read_text().splitlines()]


def test_mps_daemon_start_quit_private_dirs(tmp_path, fake_mps):
    b = MpsBackend(GPU, tmp_path / "state", fake_mps)
    b.start()
    b.start()  # idempotent
    d = b.daemon
    assert d.pipe_dir.is_relative_to(tmp_path) and (d.pipe_dir / "control").exists()
    assert oct(d.pipe_dir.stat().st_mode & 0o777) == "0o700"
    b.stop()
    b.stop()
    calls = _calls(d)
    assert [c["args"] for c in calls] == [["-d"], []]
    assert calls[1]["stdin"] == "quit\n" and calls[0]["cvd"] == "GPU-abc"
    assert not (d.pipe_dir / "control").exists()


def test_mps_daemon_start_failure(tmp_path):
    d = MpsDaemon("0", tmp_path, binary=str(tmp_path / "missing"))
    with pytest.raises(MpsError, match="cannot start"):
        d.start()


def test_mps_grant_env_and_capacity(tmp_path, fake_mps):
    b = MpsBackend(GPU, tmp_path, fake_mps)
    g = b.grant("a", "gpu0", 30, 20 * GIB)
    assert g.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert g.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert g.env["CUDA_MPS_PIPE_DIRECTORY"] == str(b.daemon.pipe_dir)
    assert g.env["CUDA_VISIBLE_DEVICES"] == "GPU-abc"
    b.grant("b", "gpu0", 70, 100 * GIB)
    with pytest.raises(CapacityRefused, match="gpu0 \\(mps\\): asked 1 sm_percent.*only 0 of 100"):
        b.grant("c", "gpu0", 1)
    b.release("b")
    with pytest.raises(CapacityRefused) as e:
        b.grant("c", "gpu0", 10, 121 * GIB)
    assert e.value.resource == "memory" and e.value.free == 120 * GIB
    info = b.partitions()[0]
    assert (info.kind, info.capacity_units, info.unit, info.free_units) == ("mps", 100, "sm_percent", 70)


def test_mps_fault_detection(tmp_path, fake_mps):
    assert is_fatal_client_message("RuntimeError: CUDA error: an illegal memory access was encountered")
    assert is_fatal_client_message("the MPS client has been terminated by the server")
    assert not is_fatal_client_message("ValueError: loss is nan")
    assert fatal_log_lines("[x] New client 1 connected\n[x] Receive command failed, assuming client exit\n") == []
    assert len(fatal_log_lines("[x] Server 42 encountered a fatal exception\nok\n")) == 1
    b = MpsBackend(GPU, tmp_path, fake_mps)
    b.grant("a", "gpu0", 50)
    b.grant("b", "gpu0", 50)
    assert b.faulted_by_exit("a", 1, "ValueError") == []
    assert {g.grant_id for g in b.faulted_by_exit("a", 1, "an illegal memory access was encountered")} == {"a", "b"}
    b.daemon.log_dir.mkdir(parents=True, exist_ok=True)
    log = b.daemon.server_log()
    log.write_text("[t] New client 1 connected\n")
    assert b.poll_faults() == []
    with open(log, "a") as f:
        f.write("[t] Server 42 hit a fatal GPU exception, terminating clients\n")
    assert {g.grant_id for g in b.poll_faults()} == {"a", "b"}
    assert b.poll_faults() == []  # only new lines are read


def test_select_kind_rules():
    assert select_kind(CPU) == "cpuset"
    assert select_kind(GPU, mig_enabled=True, mps_available=True) == "mig"
    assert select_kind(GPU, mps_available=True) == "mps"
    assert select_kind(GPU) == "timeslice"
    assert select_kind(CPU, "timeslice") == "timeslice"
    for dev, mode in ((GPU, "cpuset"), (CPU, "mps"), (CPU, "mig"), (GPU, "mig"), (CPU, "bogus")):
        with pytest.raises(ValueError):
            select_kind(dev, mode)


def test_partitions_routes_and_describes(tmp_path, fake_mps):
    from agent.partitions.fake_nvml import FakeGpu, FakeNvml
    nv = FakeNvml([FakeGpu(0, mig_mode=0)])
    cpu1 = LocalDevice(id="cpu1", kind="cpu", model="x", memory_bytes=0, capacity=2, cores=(4, 5))
    parts = Partitions.for_devices([CPU, cpu1, GPU], "auto", state_dir=tmp_path, nvml=nv, mps_binary=fake_mps)
    kinds = {p.id: p.kind for p in parts.describe()}
    assert kinds == {"cpu0": "cpuset", "cpu1": "cpuset", "gpu0": "mps"}
    parts.start()
    g = parts.grant("j/r0", "gpu0", 40)
    assert parts.grant("j/r0", "gpu0", 40) == g
    with pytest.raises(BadGrant):
        parts.grant("j/r0", "cpu1", 1)
    assert parts.grant("k/r0", "cpu1", 2).cores == (4, 5)
    with pytest.raises(CapacityRefused, match="cpu1"):
        parts.grant("l/r0", "cpu1", 1)
    assert parts.release("j/r0") is not None and parts.release("j/r0") is None
    assert [p.to_dict()["free_units"] for p in parts.describe() if p.id == "gpu0"] == [100]
    parts.stop()
    assert nv.mutations == []


def test_mps_fault_poll_skips_an_earlier_runs_log(tmp_path, fake_mps):
    # An earlier agent run: its server hit a fatal fault, and the log dir persists.
    b = MpsBackend(GPU, tmp_path, fake_mps)
    b.start()
    with open(b.daemon.server_log(), "a") as f:
        f.write("[t] Server 42 hit a fatal GPU exception, terminating clients\n")
    b.stop()
    # The agent restarts: healthy clients of this run must not be failed for it.
    b2 = MpsBackend(GPU, tmp_path, fake_mps)
    b2.start()
    b2.grant("a", "gpu0", 50)
    b2.grant("b", "gpu0", 50)
    assert b2.poll_faults() == []
    with open(b2.daemon.server_log(), "a") as f:
        f.write("[t] New client 7 connected\n")
    assert b2.poll_faults() == []
    with open(b2.daemon.server_log(), "a") as f:
        f.write("[t] Server 43 crashed: fatal exception\n")
    assert {g.grant_id for g in b2.poll_faults()} == {"a", "b"}
    b2.stop()


def test_mps_fault_poll_matches_a_line_split_across_polls(tmp_path, fake_mps):
    b = MpsBackend(GPU, tmp_path, fake_mps)
    b.start()
    b.grant("a", "gpu0", 50)
    log = b.daemon.server_log()
    with open(log, "a") as f:
        f.write("[t] New client 1 connected\n[t] NVRM: X")  # the server is mid-line
    assert b.poll_faults() == []
    with open(log, "a") as f:
        f.write("id 79, GPU has fallen off the bus\n")
    assert {g.grant_id for g in b.poll_faults()} == {"a"}
    assert b.poll_faults() == []
    b.stop()

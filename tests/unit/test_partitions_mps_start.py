"""An MPS daemon start that fails after ``-d`` forked the daemon (its control pipe not there
in time; ``-d`` itself hanging) must not leave the daemon running, nor make the retry's
``-d`` fail against it; ``Partitions.start`` stops the backend that failed, too. Against a
fake ``nvidia-cuda-mps-control`` with the real command-line contract: ``-d`` forks a
daemon (it refuses when one already runs), stdin ``quit`` ends it (and fails when there is
none). Also: an MPS memory grant under 1 MiB is refused, not raised to 1 MiB."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from agent.devices import LocalDevice
from agent.executors import BadRequest, ExecutorManager
from agent.partitions import BadGrant, MpsBackend, MpsError, PartitionError, Partitions
from agent.partitions.base import Ledger, LedgerBackend

GIB = 1024 ** 3
MIB = 1024 ** 2
GPU = LocalDevice(id="gpu0", kind="gpu", model="H200", memory_bytes=140 * GIB, capacity=100, uuid="GPU-abc", index=0)

# Files in CUDA_MPS_LOG_DIRECTORY steer it: "no-pipe" (the daemon never creates its
# control pipe), "hang" (-d hangs after forking the daemon). "daemon.pid": the daemon's pid.
FAKE = textwrap.dedent("""\
    #!{python}
    import os, signal, sys, time
    pipe, logd = os.environ["CUDA_MPS_PIPE_DIRECTORY"], os.environ["CUDA_MPS_LOG_DIRECTORY"]
    pidf = os.path.join(logd, "daemon.pid")

    def daemon_pid():
        try:
            pid = int(open(pidf).read())
            st = open(f"/proc/{{pid}}/stat").read()
        except (OSError, ValueError):
            return None
        return None if st[st.rindex(")") + 2] in "ZX" else pid

    if "-d" in sys.argv:
        if daemon_pid() is not None:
            sys.exit("An instance of this daemon is already running")
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            fd = os.open(os.devnull, os.O_RDWR)
            for i in (0, 1, 2):
                os.dup2(fd, i)
            with open(pidf + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(pidf + ".tmp", pidf)
            os.write(w, b"x")
            if not os.path.exists(os.path.join(logd, "no-pipe")):
                open(os.path.join(pipe, "control"), "w").close()
            time.sleep(300)
            os._exit(0)
        os.read(r, 1)  # the daemon is up
        if os.path.exists(os.path.join(logd, "hang")):
            time.sleep(300)
        sys.exit(0)
    if sys.stdin.read().strip() == "quit":
        pid = daemon_pid()
        if pid is None:
            sys.exit("Cannot find MPS control daemon process")
        os.kill(pid, signal.SIGTERM)
        while daemon_pid() is not None:
            time.sleep(0.01)
        if os.path.exists(os.path.join(pipe, "control")):
            os.remove(os.path.join(pipe, "control"))
        sys.exit(0)
    sys.exit(1)
""")


def daemon_alive(b: MpsBackend) -> bool:
    try:
        pid = int((b.daemon.log_dir / "daemon.pid").read_text())
        st = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return False
    return st[st.rindex(")") + 2] not in "ZX"


@pytest.fixture
def backend(tmp_path):
    fake = tmp_path / "nvidia-cuda-mps-control"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(0o755)
    b = MpsBackend(GPU, tmp_path / "state", str(fake))
    b.daemon.log_dir.mkdir(parents=True)
    # Long enough for the fake's -d to fork its daemon on a loaded host; the "no-pipe"
    # case waits it out once.
    b.daemon.start_timeout_s = 3.0
    yield b
    try:
        pid = int((b.daemon.log_dir / "daemon.pid").read_text())
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass


def test_a_daemon_whose_pipe_never_appears_is_quit_and_a_retry_starts(backend):
    (backend.daemon.log_dir / "no-pipe").touch()
    parts = Partitions([backend])
    with pytest.raises(MpsError, match="did not create"):
        parts.start()
    # Before the fix: the daemon ran on with running False, so no stop() ever quit it.
    assert not daemon_alive(backend)
    assert not backend.daemon.running
    (backend.daemon.log_dir / "no-pipe").unlink()
    parts.start()  # before the fix: -d failed against the daemon left behind
    assert daemon_alive(backend) and backend.daemon.running
    parts.stop()
    assert not daemon_alive(backend) and not backend.daemon.running


def test_a_hanging_dash_d_has_its_daemon_quit(backend):
    (backend.daemon.log_dir / "hang").touch()
    with pytest.raises(MpsError, match="cannot start"):
        backend.start()
    # Before the fix: the daemon forked by the hung -d was left running.
    assert not daemon_alive(backend) and not backend.daemon.running
    (backend.daemon.log_dir / "hang").unlink()
    backend.start()
    assert daemon_alive(backend)
    backend.stop()
    assert not daemon_alive(backend)


class HalfStarted(LedgerBackend):
    """A backend whose start fails after it acquired something that stop() releases."""

    kind = "test"

    def __init__(self, device_id: str) -> None:
        super().__init__(device_id)
        self.ledgers[device_id] = Ledger(device_id, self.kind, 1, "unit")
        self.calls: list[str] = []

    def start(self) -> None:
        self.calls.append("start")
        raise PartitionError("half started")

    def stop(self) -> None:
        self.calls.append("stop")


def test_partitions_start_stops_the_backend_that_failed_and_those_before_it():
    first, failing, never = HalfStarted("d0"), HalfStarted("d1"), HalfStarted("d2")
    first.start = lambda: first.calls.append("start")  # this one starts
    parts = Partitions([first, failing, never])
    with pytest.raises(PartitionError, match="half started"):
        parts.start()
    # Before the fix: only the backends that had started were stopped.
    assert (first.calls, failing.calls, never.calls) == (["start", "stop"], ["start", "stop"], [])


def test_an_mps_memory_grant_under_one_mib_is_refused(tmp_path):
    b = MpsBackend(GPU, tmp_path, "unused")
    with pytest.raises(BadGrant, match="^memory_bytes: .*under 1 MiB"):
        b.grant("a/r0", "gpu0", 10, MIB - 1)
    # Before the fix: granted with a limit of 1 MiB, more than the grant.
    assert b.grants() == [] and b.partitions()[0].free_units == 100
    assert b.grant("a/r0", "gpu0", 10, MIB).env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1M"
    assert b.grant("b/r0", "gpu0", 10, 3 * MIB - 1).env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2M"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in b.grant("c/r0", "gpu0", 10, 0).env


async def test_the_agent_refuses_an_mps_grant_under_one_mib_naming_memory_bytes(tmp_path):
    b = MpsBackend(GPU, tmp_path, "unused")

    async def on_report(ex, r):
        pass

    mgr = ExecutorManager(tmp_path / "state", [GPU], on_report, python="/nonexistent", parts=Partitions([b]))
    with pytest.raises(BadRequest, match="^memory_bytes: "):
        await mgr.launch(allocation_id="a-1", job_id="j-1", rank=0, world_size=1, device_ids=["gpu0"],
                         master_addr="127.0.0.1", master_port=1, runtime_spec={"workload": {"type": "gpt"}},
                         checkpoint_dir="", partition_id="gpu0", units=10, memory_bytes=512 * 1024)
    assert b.grants() == [] and mgr.executors == {}

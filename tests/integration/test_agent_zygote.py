"""The executor fork server (agent.zygote, agent.runtime.zygote) under a real
ExecutorManager: CPU executors forked from one warm process train, stop with a
checkpoint, carry their labels where the agent looks for them, and an executor whose
zygote dies is killed and reported, later launches falling back to processes of their own."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from agent.devices import discover
from agent.executors import ExecutorManager, _orphan_members, executor_processes
from agent.runtime import checkpoint
from agent.runtime.zygote import label_environ
from agent.zygote import ZygoteProcess
from tessera.procfs import proc_stat

pytestmark = pytest.mark.slow


def gpt(job_id: str, steps: int, ck: str = "") -> dict:
    return {"job_id": job_id, "checkpoint_dir": ck,
            "workload": {"type": "gpt", "model": {"vocab": 64, "seq_len": 16, "layers": 2, "hidden": 32, "heads": 4},
                         "steps": steps, "batch_size": 4, "checkpoint_every": 0, "learning_rate": 0.01}}


class Reports:
    """The reports an ExecutorManager makes, by allocation, with an event per kind."""

    def __init__(self) -> None:
        self.by_alloc: dict[str, list[dict]] = {}
        self.events: dict[tuple[str, str], asyncio.Event] = {}

    async def __call__(self, ex, r) -> None:
        self.by_alloc.setdefault(ex.allocation_id, []).append(r)
        self._event(ex.allocation_id, r["kind"]).set()

    def _event(self, alloc: str, kind: str) -> asyncio.Event:
        return self.events.setdefault((alloc, kind), asyncio.Event())

    async def until(self, alloc: str, kind: str) -> None:
        await self._event(alloc, kind).wait()

    async def exit(self, alloc: str) -> dict:
        await self.until(alloc, "EXITED")
        return next(r for r in self.by_alloc[alloc] if r["kind"] == "EXITED")


@pytest.fixture
async def mgr(tmp_path):
    rep = Reports()
    m = ExecutorManager(tmp_path / "agent", discover(2, use_nvml=False), rep, report_interval_s=0.05,
                        reap_grace_s=0.5, zygote=True)
    m.reports = rep
    yield m
    await m.stop_all(grace_s=2.0)
    await m.stop_zygote()


async def launch(m: ExecutorManager, alloc: str, spec: dict, dev: str = "cpu0"):
    ex, _ = await m.launch(allocation_id=alloc, job_id=spec["job_id"], rank=0, world_size=1, device_ids=[dev],
                           master_addr="127.0.0.1", master_port=1, runtime_spec=spec,
                           checkpoint_dir=spec["checkpoint_dir"])
    return ex


def ppid(pid: int) -> int:
    return int(proc_stat(pid)[1])


async def _forked_train_and_carry_their_labels(mgr):
    a = await launch(mgr, "a-1", gpt("j-1", 30))
    assert (await mgr.reports.exit("a-1"))["exit_code"] == 0 and a.exit_code == 0
    b = await launch(mgr, "a-2", gpt("j-2", 1_000_000), dev="cpu1")
    assert isinstance(a.proc, ZygoteProcess) and isinstance(b.proc, ZygoteProcess)
    z = mgr.zygote.pid
    prog = [r for r in mgr.reports.by_alloc["a-1"] if r["kind"] == "PROGRESS"]
    assert prog and prog[-1]["step"] == 30 and prog[-1]["loss"] < prog[0]["loss"]
    await mgr.reports.until("a-2", "PROGRESS")
    # The second is the zygote's child, leads its own session, and /proc/<pid>/environ
    # names its token, allocation and rank: the agent's reap and orphan kill find it.
    pid = b.proc.pid
    assert ppid(pid) == z and os.getsid(pid) == pid and os.getpgid(pid) == pid
    assert [p for p, _ in executor_processes(b.token)] == [pid]
    assert _orphan_members({"pid": pid, "pgid": pid, "start_ticks": None, "allocation_id": "a-2", "rank": 0}) == [pid]
    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    assert b"TESSERA_ALLOCATION_ID=a-2" in env and b"TESSERA_RANK=0" in env
    assert os.sched_getaffinity(pid) == set(mgr.devices["cpu1"].cores)


async def _a_forked_executor_stops_with_a_checkpoint(mgr, tmp_path):
    ck = str(tmp_path / "ck")
    ex = await launch(mgr, "a-s", gpt("j-s", 1_000_000, ck))
    assert isinstance(ex.proc, ZygoteProcess)
    await mgr.reports.until("a-s", "PROGRESS")
    await mgr.stop("a-s", grace_s=20.0)
    assert ex.exit_code == 143
    saved = checkpoint.load(ck)
    assert saved is not None and 1 <= saved["step"] < 1_000_000


async def _executors_of_a_dead_zygote_are_killed_and_later_ones_run_on_their_own(mgr):
    ex = await launch(mgr, "a-z", gpt("j-z", 1_000_000))
    await mgr.reports.until("a-z", "PROGRESS")
    pid, z = ex.proc.pid, mgr.zygote.pid
    os.kill(z, signal.SIGKILL)
    assert (await mgr.reports.exit("a-z"))["exit_code"] == 137 and ex.exit_code == 137
    assert proc_stat(pid) is None or proc_stat(pid)[0] in (b"Z", b"X")
    assert not mgr.zygote.alive
    nxt = await launch(mgr, "a-n", gpt("j-n", 5))
    assert not isinstance(nxt.proc, ZygoteProcess)  # a process of its own
    assert (await mgr.reports.exit("a-n"))["exit_code"] == 0


async def test_forked_executors_train_carry_labels_stop_with_a_checkpoint_and_go_with_their_zygote(mgr, tmp_path):
    """One zygote for the whole story (its warm-up costs seconds of CPU): forked
    executors train and are found where the agent looks; one stops with a checkpoint;
    then the zygote dies with one running (the one left running above goes too)."""
    await _forked_train_and_carry_their_labels(mgr)
    await _a_forked_executor_stops_with_a_checkpoint(mgr, tmp_path)
    await _executors_of_a_dead_zygote_are_killed_and_later_ones_run_on_their_own(mgr)


def test_label_environ_writes_only_into_its_slot(tmp_path):
    """In a child started with the slot: the labels replace it in /proc/self/environ, the
    other entries stay; entries longer than the slot are refused and change nothing."""
    import subprocess
    import sys

    code = (
        "import sys; from agent.runtime.zygote import label_environ as L\n"
        "ok = L({'TESSERA_RANK': '3', 'TESSERA_ALLOCATION_ID': 'a-9'})\n"
        "big = L({'TESSERA_JOB_ID': 'x' * 600})\n"
        "env = open('/proc/self/environ', 'rb').read().split(bytes(1))\n"
        "print(ok, big, b'TESSERA_RANK=3' in env, b'TESSERA_ALLOCATION_ID=a-9' in env, b'KEEP=me' in env,"
        " any(e.startswith(b'TESSERA_JOB_ID') for e in env))\n"
    )
    env = {**os.environ, "KEEP": "me", "TESSERA_ZYGOTE_SLOT": "." * 512}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "False", "True", "True", "True", "False"], out.stderr
    # Without a slot (this test process) there is nothing to write into.
    assert label_environ({"TESSERA_RANK": "1"}) is False


async def test_an_executor_with_more_threads_than_cores_is_not_forked(tmp_path):
    """A core set declared larger than the machine (2 units per core): 2 units are 2
    threads on 1 core, which a fork of the zygote would spin on (OpenMP sized its waits
    at the zygote's load), so that executor is a process of its own; 1 unit (1 thread on
    1 core) is forked."""
    from agent.partitions import Partitions

    rep = Reports()
    devs = discover(1, use_nvml=False, units_per_core=2)
    m = ExecutorManager(tmp_path / "agent", devs, rep, report_interval_s=0.05, reap_grace_s=0.5, zygote=True,
                        parts=Partitions.for_devices(devs, state_dir=str(tmp_path / "agent")))
    try:
        kw = dict(rank=0, world_size=1, device_ids=["cpu0"], master_addr="127.0.0.1", master_port=1,
                  checkpoint_dir="")
        # units 0 and 1 (core 0) first, then unit 2 (core 1)
        two, _ = await m.launch(allocation_id="a-2", job_id="j-2", runtime_spec=gpt("j-2", 3), units=2, **kw)
        one, _ = await m.launch(allocation_id="a-1", job_id="j-1", runtime_spec=gpt("j-1", 3), units=1, **kw)
        assert one.grant.threads == len(one.grant.cores) == 1 and isinstance(one.proc, ZygoteProcess)
        assert two.grant.threads == 2 > len(two.grant.cores) == 1 and not isinstance(two.proc, ZygoteProcess)
        for a in ("a-1", "a-2"):
            assert (await rep.exit(a))["exit_code"] == 0
    finally:
        await m.stop_all(grace_s=2.0)
        await m.stop_zygote()

"""Executor processes that outlive what should end them, as real subprocesses of a fake
runtime (the manager's ``python``): a child in the executor's session that ignores
SIGTERM and holds its output open (``stop`` must still end, kill it, release the grant
and report the exit), and executors left running by a crashed agent process (a new
agent on the same state dir kills them before it registers; never a process that merely
reuses a recorded pid). Also: a shutting-down agent refuses new launches."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest

from agent.api import AgentService, NodeState
from agent.devices import discover
from agent.executors import ExecutorManager, ShuttingDown, process_start_ticks
from agent.partitions import Partitions
from tessera.api.v1 import agent_pb2

ROOT = Path(__file__).resolve().parents[2]

# A fake runtime: starts a child in its own session (a data-loader worker, say) that
# ignores SIGTERM and inherits stdout, writes both pids next to its spec, then waits.
# The leader dies of SIGTERM (default action); the child does not.
FAKE_RUNTIME = """#!{python}
import os, signal, subprocess, sys, time
spec = sys.argv[sys.argv.index("--spec") + 1]
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited: the child ignores SIGTERM from its first instruction
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
signal.signal(signal.SIGTERM, signal.SIG_DFL)
with open(spec + ".pids.tmp", "w") as f:
    f.write(f"{{os.getpid()}} {{child.pid}}")
os.replace(spec + ".pids.tmp", spec + ".pids")
print("ready", flush=True)
time.sleep(300)
"""

LAUNCH = dict(job_id="j-1", rank=0, world_size=1, master_addr="127.0.0.1", master_port=1,
              runtime_spec={"workload": {"type": "gpt"}}, checkpoint_dir="")


def fake_runtime(tmp_path: Path) -> str:
    rt = tmp_path / "fake-python"
    rt.write_text(FAKE_RUNTIME.format(python=sys.executable))
    rt.chmod(0o755)
    return str(rt)


def alive(pid: int) -> bool:
    return process_start_ticks(pid) is not None  # a zombie counts as dead


SPAWNED: list[int] = []  # fake executor processes, SIGKILLed after each test whatever its outcome


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    while SPAWNED:
        pid = SPAWNED.pop()
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


async def wait_pids(spec: Path, timeout: float = 30.0) -> tuple[int, int]:
    p = Path(str(spec) + ".pids")
    async with asyncio.timeout(timeout):
        while not p.exists():
            await asyncio.sleep(0.05)
    leader, child = map(int, p.read_text().split())
    SPAWNED.extend((leader, child))
    return leader, child


async def wait_dead(pids, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while any(alive(p) for p in pids):
            await asyncio.sleep(0.05)


def make_mgr(tmp_path: Path, state: Path, reports: list | None = None) -> ExecutorManager:
    devs = discover(1, use_nvml=False)
    parts = Partitions.for_devices(devs, state_dir=str(state))

    async def on_report(ex, r):
        if reports is not None:
            reports.append((ex.allocation_id, ex.rank, r))

    return ExecutorManager(state, devs, on_report, python=fake_runtime(tmp_path), parts=parts)


async def test_stop_ends_when_a_group_member_ignores_sigterm_and_holds_stdout(tmp_path):
    reports: list = []
    mgr = make_mgr(tmp_path, tmp_path / "state", reports)
    dev = next(iter(mgr.devices))
    ex, _ = await mgr.launch(allocation_id="a-1", device_ids=[dev], **LAUNCH)
    leader, child = await wait_pids(mgr.state_dir / "specs" / "a-1-r0.json")
    assert alive(child) and os.getpgid(child) == ex.proc.pid
    assert mgr.parts.grants(), "the executor holds a grant"
    assert (mgr.state_dir / "executors" / "a-1-r0.json").exists()

    grace = 1.0
    t0 = time.monotonic()
    async with asyncio.timeout(grace + 8):  # before the fix: waits forever
        n = await mgr.stop("a-1", grace_s=grace)
    assert n == 1 and time.monotonic() - t0 < grace + 8
    await wait_dead([leader, child], timeout=5)
    assert not ex.running and ex.done.is_set()
    assert mgr.parts.grants() == [], "the grant is released"
    assert [r["kind"] for a, _, r in reports if a == "a-1"][-1] == "EXITED"
    assert not (mgr.state_dir / "executors" / "a-1-r0.json").exists(), "the record goes with the executor"


# An agent process that launches one executor, says so, and waits to be killed -9.
CRASHING_AGENT = """
import asyncio, sys
sys.path.insert(0, {root!r})
from pathlib import Path
from agent.devices import discover
from agent.executors import ExecutorManager
from agent.partitions import Partitions

async def main():
    devs = discover(1, use_nvml=False)
    parts = Partitions.for_devices(devs, state_dir={state!r})
    async def on_report(ex, r):
        pass
    mgr = ExecutorManager(Path({state!r}), devs, on_report, python={rt!r}, parts=parts)
    ex, _ = await mgr.launch(allocation_id="a-old", job_id="j-old", rank=0, world_size=1, device_ids=[devs[0].id],
                             master_addr="127.0.0.1", master_port=1, runtime_spec={{"workload": {{"type": "gpt"}}}},
                             checkpoint_dir="")
    print("LAUNCHED", ex.proc.pid, flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""


async def test_new_agent_kills_the_executors_a_crashed_agent_left(tmp_path):
    state = tmp_path / "state"
    code = CRASHING_AGENT.format(root=str(ROOT), state=str(state), rt=fake_runtime(tmp_path))
    agent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
    try:
        async with asyncio.timeout(60):
            line = ""
            while not line.startswith("LAUNCHED"):
                line = await asyncio.to_thread(agent.stdout.readline)
                assert line, "the agent process ended before launching"
        leader = int(line.split()[1])
        _, child = await wait_pids(state / "specs" / "a-old-r0.json")
    finally:
        agent.kill()  # the crash: no stop, no cleanup
        agent.wait()
    record = state / "executors" / "a-old-r0.json"
    rec = json.loads(record.read_text())
    assert rec["pid"] == leader and rec["pgid"] == leader and rec["start_ticks"] == process_start_ticks(leader)
    assert rec["allocation_id"] == "a-old" and rec["rank"] == 0
    await asyncio.sleep(0.3)
    assert alive(leader) and alive(child), "executors lead their own sessions: they outlive the agent"

    # An unrelated process whose pid a record names, with another start time (a reused pid).
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        (state / "executors" / "a-gone-r0.json").write_text(json.dumps({
            "pid": bystander.pid, "pgid": bystander.pid, "start_ticks": process_start_ticks(bystander.pid) - 1,
            "allocation_id": "a-gone", "job_id": "j-gone", "rank": 0}))
        (state / "executors" / "a-torn-r1.json.tmp").write_text("{")  # a crash mid-write

        mgr = make_mgr(tmp_path, state)
        killed = await mgr.kill_orphans()
        assert [k["allocation_id"] for k in killed] == ["a-old"]
        await wait_dead([leader, child])
        assert alive(bystander.pid), "a reused pid is never killed"
        assert list((state / "executors").iterdir()) == [], "every record is removed"
        assert await mgr.kill_orphans() == []
    finally:
        bystander.kill()
        bystander.wait()


async def test_orphan_group_is_killed_when_only_its_leader_is_gone(tmp_path):
    """The crash came mid-stop: the leader died of SIGTERM, the worker that ignores it
    lives on in the group; its environment proves it is the recorded executor's."""
    state = tmp_path / "state"
    mgr = make_mgr(tmp_path, state)
    dev = next(iter(mgr.devices))
    ex, _ = await mgr.launch(allocation_id="a-2", device_ids=[dev], **LAUNCH)
    leader, child = await wait_pids(state / "specs" / "a-2-r0.json")
    rec = json.loads((state / "executors" / "a-2-r0.json").read_text())
    os.kill(leader, signal.SIGTERM)
    await wait_dead([leader])
    assert alive(child)
    mgr2 = make_mgr(tmp_path, state)
    (state / "executors" / "a-2-r0.json").write_text(json.dumps(rec))  # as the crashed agent left it
    assert [k["allocation_id"] for k in await mgr2.kill_orphans()] == ["a-2"]
    await wait_dead([child])
    assert await asyncio.wait_for(ex.done.wait(), 10) and not (state / "executors" / "a-2-r0.json").exists()


class Aborted(Exception):
    pass


class Ctx:
    async def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


async def test_launch_is_refused_once_shutdown_began(tmp_path):
    mgr = make_mgr(tmp_path, tmp_path / "state")
    dev = next(iter(mgr.devices))
    mgr.stopping = True
    with pytest.raises(ShuttingDown):
        await mgr.launch(allocation_id="a-3", device_ids=[dev], **LAUNCH)
    node = NodeState("n", list(mgr.devices.values()))
    node.incarnation = "i-1"
    svc, ctx = AgentService(node, mgr, 1.0), Ctx()
    req = agent_pb2.LaunchExecutorRequest(allocation_id="a-3", job_id="j-3", fencing_token=1, incarnation="i-1",
                                          rank=0, world_size=1, device_ids=[dev],
                                          runtime_spec_json='{"workload": {"type": "gpt"}}')
    with pytest.raises(Aborted):
        await svc.LaunchExecutor(req, ctx)
    assert ctx.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in ctx.details
    assert mgr.executors == {} and mgr.parts.grants() == []


async def test_concurrent_launches_of_one_rank_start_one_process(tmp_path):
    # Two LaunchExecutor calls for the same (allocation, rank) at once (a controller retry
    # racing the first call): one process on one grant; both get the same executor.
    reports: list = []
    mgr = make_mgr(tmp_path, tmp_path / "state", reports)
    dev = next(iter(mgr.devices))
    (ex1, already1), (ex2, already2) = await asyncio.gather(
        mgr.launch(allocation_id="a-4", device_ids=[dev], **LAUNCH),
        mgr.launch(allocation_id="a-4", device_ids=[dev], **LAUNCH))
    SPAWNED.append(ex1.proc.pid)
    SPAWNED.append(ex2.proc.pid)
    leader, _ = await wait_pids(tmp_path / "state" / "specs" / "a-4-r0.json")
    assert ex1 is ex2 and ex1.proc.pid == leader
    assert sorted((already1, already2)) == [False, True]
    assert [r for r in reports if r[2].get("kind") == "STARTED"] == [("a-4", 0, {"kind": "STARTED"})]
    assert [g.grant_id for g in mgr.parts.grants()] == ["a-4/r0"]
    assert mgr._launch_locks == {}
    await mgr.stop("a-4", 2.0)
    await wait_dead([leader])

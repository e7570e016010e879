"""Executor processes that outlive what should end them, as real subprocesses of a fake
runtime (the manager's ``python``): a child in the executor's session that ignores
SIGTERM and holds its output open (``stop`` must still end, kill it, release the grant
and report the exit), and executors left running by a crashed agent process (a new
agent on the same state dir kills them before it registers; never a process that merely
reuses a recorded pid; nor one spawned but not yet recorded when the agent crashed); the
processes an executor's leader leaves behind when it exits on its own (ended before the
exit is reported and the grant released; a stop's grace applies to them; the /proc scans that
find them run off the event loop, backing off, and pass over processes older than the
leader). Also: a shutting-down agent refuses new launches."""

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


def fake_runtime(tmp_path: Path, source: str = FAKE_RUNTIME, **fmt) -> str:
    rt = tmp_path / f"fake-python-{abs(hash(source + repr(sorted(fmt.items()))))}"
    rt.write_text(source.format(python=sys.executable, **fmt))
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


def make_mgr(tmp_path: Path, state: Path, reports: list | None = None, runtime: str | None = None,
             **kw) -> ExecutorManager:
    devs = discover(1, use_nvml=False)
    parts = Partitions.for_devices(devs, state_dir=str(state))

    async def on_report(ex, r):
        if reports is not None:
            reports.append((ex.allocation_id, ex.rank, r))

    return ExecutorManager(state, devs, on_report, python=runtime or fake_runtime(tmp_path), parts=parts, **kw)


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


# An agent process (a template: root, state dir, fake runtime) whose main() has its
# ExecutorManager; each use appends what main() does with it.
AGENT_PROCESS = """
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
"""

# An agent process that launches one executor, says so, and waits to be killed -9.
CRASHING_AGENT = AGENT_PROCESS + """    ex, _ = await mgr.launch(allocation_id="a-old", job_id="j-old", rank=0, world_size=1, device_ids=[devs[0].id],
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
    mgr = make_mgr(tmp_path, state, reap_grace_s=60)  # the crashed agent: it never got to SIGKILL the child
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


# A fake runtime whose leader exits on its own (code {code}) once it has started a child
# that ignores SIGTERM: a worker that keeps the output open (inherit), one that closed it
# (devnull), or one that closed it and left the session (setsid: only its inherited
# TESSERA_EXECUTOR_TOKEN says whose it is).
EXITING_RUNTIME = """#!{python}
import os, signal, subprocess, sys
spec = sys.argv[sys.argv.index("--spec") + 1]
mode = {mode!r}
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the child
out = None if mode == "inherit" else subprocess.DEVNULL
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], stdout=out, stderr=out,
                         start_new_session=mode == "setsid")
with open(spec + ".pids.tmp", "w") as f:
    f.write(f"{{os.getpid()}} {{child.pid}}")
os.replace(spec + ".pids.tmp", spec + ".pids")
print("leaving", flush=True)
sys.exit({code})
"""


@pytest.mark.parametrize("mode,code", [("inherit", 0), ("devnull", 3), ("setsid", 0)])
async def test_leader_exit_ends_what_it_left_before_the_exit_is_reported(tmp_path, mode, code):
    state = tmp_path / "state"
    seen: dict = {}
    devs = discover(1, use_nvml=False)
    parts = Partitions.for_devices(devs, state_dir=str(state))
    pids_file = state / "specs" / "a-5-r0.json.pids"
    exited = asyncio.Event()

    async def on_report(ex, r):
        if r["kind"] == "EXITED":
            # What holds at the moment the exit is reported.
            _, child = map(int, pids_file.read_text().split())
            seen.update(report=r, child_alive=alive(child), grants=[g.grant_id for g in parts.grants()],
                        record=(state / "executors" / "a-5-r0.json").exists())
            exited.set()

    rt = fake_runtime(tmp_path, EXITING_RUNTIME, mode=mode, code=code)
    mgr = ExecutorManager(state, devs, on_report, python=rt, parts=parts, reap_grace_s=0.5)
    ex, _ = await mgr.launch(allocation_id="a-5", device_ids=[devs[0].id], **LAUNCH)
    leader, child = await wait_pids(state / "specs" / "a-5-r0.json")
    # Before the fix: with the output held the exit is never reported; without, the child leaks.
    await asyncio.wait_for(exited.wait(), 15)
    assert seen["report"]["exit_code"] == code, "the leader's own exit code is reported"
    assert not seen["child_alive"], "the child is gone when the exit is reported"
    assert seen["grants"] == [], "the grant is released only after the child is gone"
    assert not seen["record"]
    assert not alive(leader) and not alive(child)
    assert ex.done.is_set() and ex.exit_code == code
    assert "leaving" in (state / "logs" / "j-1.log").read_text()


# An agent process that dies (the failpoint: os._exit) right after spawning an executor,
# before that executor's record holds its pid.
CRASH_AFTER_SPAWN = AGENT_PROCESS + """    await mgr.launch(allocation_id="a-new", job_id="j-new", rank=0, world_size=1, device_ids=[devs[0].id],
                     master_addr="127.0.0.1", master_port=1, runtime_spec={{"workload": {{"type": "gpt"}}}},
                     checkpoint_dir="")
    print("NOT CRASHED", flush=True)

asyncio.run(main())
"""

# Like FAKE_RUNTIME, but silent: its agent is gone, nobody reads its output.
QUIET_RUNTIME = FAKE_RUNTIME.replace('print("ready", flush=True)\n', "")


async def test_executor_spawned_but_not_recorded_is_killed_by_the_next_agent(tmp_path):
    from agent.executors import FAILPOINT_EXIT

    state = tmp_path / "state"
    code = CRASH_AFTER_SPAWN.format(root=str(ROOT), state=str(state), rt=fake_runtime(tmp_path, QUIET_RUNTIME))
    env = dict(os.environ, TESSERA_FAILPOINT="executor-spawned")
    agent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        out, _ = await asyncio.to_thread(agent.communicate, timeout=60)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.returncode == FAILPOINT_EXIT and "NOT CRASHED" not in out, "the agent dies right after the spawn"
    leader, child = await wait_pids(state / "specs" / "a-new-r0.json")
    rec = json.loads((state / "executors" / "a-new-r0.json").read_text())
    assert rec["pid"] is None and rec["allocation_id"] == "a-new", "only the intent was recorded"
    environ = Path(f"/proc/{leader}/environ").read_bytes().split(b"\0")
    assert f"TESSERA_EXECUTOR_TOKEN={rec['token']}".encode() in environ
    assert not any(v.startswith(b"TESSERA_FAILPOINT=") for v in environ), "the failpoint is not passed on"
    assert alive(leader) and alive(child)

    # Another executor's process (another token, same allocation and rank env) is spared.
    other = subprocess.Popen(["sleep", "60"], start_new_session=True, env=dict(
        os.environ, TESSERA_EXECUTOR_TOKEN="0" * 32, TESSERA_ALLOCATION_ID="a-new", TESSERA_RANK="0"))
    (state / "executors" / ".tmp-x1.json").write_text("{")  # atomic_write's temp file, torn by a crash
    try:
        mgr = make_mgr(tmp_path, state)
        killed = await mgr.kill_orphans()
        assert [(k["allocation_id"], k["pid"]) for k in killed] == [("a-new", None)]
        await wait_dead([leader, child])
        assert alive(other.pid), "a process with another token is never killed"
        assert list((state / "executors").iterdir()) == [], "every record is removed"
    finally:
        other.kill()
        other.wait()


async def test_a_record_is_one_durable_atomic_write(tmp_path, monkeypatch):
    """Records go through tessera.fsutil.atomic_write: the intent before the spawn, the
    complete record after; no temp file is left; the exit removes it."""
    import agent.executors as aex

    writes: list[dict] = []
    real = aex.atomic_write

    def spy(path, write):
        real(path, write)
        writes.append(json.loads(Path(path).read_text()))

    monkeypatch.setattr(aex, "atomic_write", spy)
    mgr = make_mgr(tmp_path, tmp_path / "state")
    ex, _ = await mgr.launch(allocation_id="a-6", device_ids=[next(iter(mgr.devices))], **LAUNCH)
    leader, _ = await wait_pids(mgr.state_dir / "specs" / "a-6-r0.json")
    assert [w["pid"] for w in writes] == [None, leader]
    assert writes[1]["start_ticks"] == process_start_ticks(leader) and writes[1]["pgid"] == leader
    assert writes[0]["token"] == writes[1]["token"] == ex.token
    assert sorted(p.name for p in (mgr.state_dir / "executors").iterdir()) == ["a-6-r0.json"]
    await mgr.stop("a-6", 1.0)
    assert list((mgr.state_dir / "executors").iterdir()) == []


# A fake runtime whose leader dies of SIGTERM at once (default action) while its child, in
# its session, answers SIGTERM with a flush that takes {flush_s} s (a checkpoint shard),
# then says so in a file and exits 0.
FLUSHING_RUNTIME = """#!{python}
import os, subprocess, sys, time
spec = sys.argv[sys.argv.index("--spec") + 1]
child = subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
def term(*a):
    time.sleep({flush_s})
    open(sys.argv[1], "w").write("flushed")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
open(sys.argv[1] + ".ready", "w").close()
time.sleep(300)
''', spec + ".flushed"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
with open(spec + ".pids.tmp", "w") as f:
    f.write(f"{{os.getpid()}} {{child.pid}}")
os.replace(spec + ".pids.tmp", spec + ".pids")
time.sleep(300)
"""


async def test_a_stop_grants_what_the_leader_left_its_own_grace(tmp_path):
    """stop(grace_s) promises SIGKILL only after grace_s: once the leader dies of the
    stop's SIGTERM, the reap of its child waits the stop's grace, not just reap_grace_s."""
    reports: list = []
    rt = fake_runtime(tmp_path, FLUSHING_RUNTIME, flush_s=1.5)
    mgr = make_mgr(tmp_path, tmp_path / "state", reports, runtime=rt, reap_grace_s=0.2)
    ex, _ = await mgr.launch(allocation_id="a-7", device_ids=[next(iter(mgr.devices))], **LAUNCH)
    spec = mgr.state_dir / "specs" / "a-7-r0.json"
    leader, child = await wait_pids(spec)
    async with asyncio.timeout(30):
        while not Path(str(spec) + ".flushed.ready").exists():  # its SIGTERM handler is set
            await asyncio.sleep(0.05)
    async with asyncio.timeout(20):
        assert await mgr.stop("a-7", grace_s=15.0) == 1
    # Before the fix: SIGKILLed 0.2 s after the leader died, mid-flush.
    assert Path(str(spec) + ".flushed").read_text() == "flushed", "the child finished its flush"
    assert not alive(child) and ex.done.is_set() and mgr.parts.grants() == []
    assert [r["kind"] for a, _, r in reports if a == "a-7"][-1] == "EXITED"


async def test_reaping_scans_proc_off_the_event_loop_with_backoff(tmp_path, monkeypatch):
    """The /proc scans of a reap (every process's stat, some environments: tens of ms on a
    busy node) run in worker threads, at intervals that back off; a stop's SIGKILL reaches
    the reaped executor's processes without a scan in the event loop."""
    import threading

    import agent.executors as aex

    loop_thread = threading.get_ident()
    scans: list[tuple[float, bool]] = []  # (when, in the event loop's thread)
    real = aex.executor_processes

    def spy(*a, **kw):
        scans.append((time.monotonic(), threading.get_ident() == loop_thread))
        return real(*a, **kw)

    monkeypatch.setattr(aex, "executor_processes", spy)
    rt = fake_runtime(tmp_path, EXITING_RUNTIME, mode="devnull", code=3)  # the child ignores SIGTERM
    mgr = make_mgr(tmp_path, tmp_path / "state", runtime=rt, reap_grace_s=60)
    ex, _ = await mgr.launch(allocation_id="a-8", device_ids=[next(iter(mgr.devices))], **LAUNCH)
    leader, child = await wait_pids(mgr.state_dir / "specs" / "a-8-r0.json")
    await asyncio.wait_for(ex.leader_exited.wait(), 15)
    t0 = time.monotonic()
    await asyncio.sleep(2.0)  # an observation window of the reap's polling, not a synchronisation
    polled = len([t for t, _ in scans if t >= t0])
    assert 1 <= polled <= 10, f"{polled} scans in 2 s (before the fix: one every 50 ms, about 40)"
    assert alive(child) and ex.running, "SIGTERM ignored; the reap's grace is 60 s"
    async with asyncio.timeout(10):  # the stop's SIGKILL cuts the reap's grace short
        assert await mgr.stop("a-8", grace_s=0.2) == 1
    await wait_dead([child], timeout=5)
    assert ex.done.is_set() and ex.exit_code == 3
    assert scans and not any(in_loop for _, in_loop in scans), "no /proc scan in the event loop"


def test_a_process_older_than_the_leader_is_never_taken_for_the_executors(tmp_path):
    """Every process of an executor started after its leader: older ones are passed over on
    their stat alone, their environment unread (the bulk of a busy node's processes)."""
    from agent.executors import executor_processes

    token = "f" * 32
    procs: list[subprocess.Popen] = []

    def carrier() -> subprocess.Popen:  # a process carrying the token, once it has exec'd
        p = subprocess.Popen(["sh", "-c", "echo up; exec sleep 60"], stdout=subprocess.PIPE,
                             env=dict(os.environ, TESSERA_EXECUTOR_TOKEN=token))
        procs.append(p)
        assert p.stdout.readline() == b"up\n"
        # ... and its exec has completed: while the kernel swaps the image, its environ
        # can be unreadable for an instant (seen once in a loaded CI run).
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith(b"sleep"):
            assert time.monotonic() < deadline, "the carrier never exec'd sleep"
            time.sleep(0.005)
        return p

    try:
        older = carrier()
        ticks = process_start_ticks(older.pid)
        newer = carrier()
        while process_start_ticks(newer.pid) <= ticks:  # started in the same clock tick: again
            newer = carrier()
        assert {older.pid, newer.pid} <= {p for p, _ in executor_processes(token)}
        # A leader started after `older` (ticks + 1): `older` cannot be its descendant.
        found = {p for p, _ in executor_processes(token, None, ticks + 1)}
        assert older.pid not in found and newer.pid in found
    finally:
        for p in procs:
            p.kill()
            p.wait()


# A fake runtime whose leader ignores SIGTERM and whose child ignores it too and has left
# the session (only its TESSERA_EXECUTOR_TOKEN says whose it is).
STUBBORN_RUNTIME = """#!{python}
import os, signal, subprocess, sys, time
spec = sys.argv[sys.argv.index("--spec") + 1]
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the child
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
with open(spec + ".pids.tmp", "w") as f:
    f.write(f"{{os.getpid()}} {{child.pid}}")
os.replace(spec + ".pids.tmp", spec + ".pids")
time.sleep(300)
"""


async def test_a_stop_past_its_grace_kills_what_left_the_group_at_once(tmp_path):
    """A stop's SIGKILL of the group does not reach a process that left it; the reap that
    follows the leader's death SIGKILLs it at once, without a new grace."""
    rt = fake_runtime(tmp_path, STUBBORN_RUNTIME)
    mgr = make_mgr(tmp_path, tmp_path / "state", runtime=rt, reap_grace_s=60)
    ex, _ = await mgr.launch(allocation_id="a-9", device_ids=[next(iter(mgr.devices))], **LAUNCH)
    leader, child = await wait_pids(mgr.state_dir / "specs" / "a-9-r0.json")
    assert os.getsid(child) == child
    async with asyncio.timeout(15):  # before the fix: the child got SIGTERM and 60 s more
        assert await mgr.stop("a-9", grace_s=0.2) == 1
    assert not alive(leader) and not alive(child)
    assert ex.done.is_set() and mgr.parts.grants() == []

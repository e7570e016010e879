"""Requests the agent must refuse before it changes anything, and executors whose output
handling fails, against a real ExecutorManager whose executors are real subprocesses of
a fake runtime (the manager's ``python``):

- allocation and job ids name files under the state dir: one with a '/', "..", or too long
  is refused (INVALID_ARGUMENT naming the field) by every RPC that carries one, before
  anything is granted, spawned or written; the controller's own ids pass;
- a refused request carrying a newer fencing token does not lock out the real leader; an
  accepted one still does;
- ReadLogs ``tail_bytes`` < 0 or > 4 MiB and StopExecutor ``grace_s`` < 0 or non-finite are refused;
- an executor whose log cannot be opened is never spawned (its grant released); an
  output line over the stream limit, a failing ``on_step`` callback or a failing /proc
  scan still end in an EXITED report, the grant released and ``done`` set (``stop`` and
  the agent's shutdown never wait for ever).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
import pytest

import agent.executors as executors
from agent.api import AgentService, NodeState
from agent.devices import discover
from agent.executors import BadRequest, ExecutorManager
from agent.partitions import Partitions
from tessera.api.v1 import agent_pb2
from tests.integration.test_agent_orphans import SPAWNED, alive, no_leftovers  # noqa: F401 - the autouse cleanup of spawned processes

# Writes a marker next to its spec (it ran), prints, then waits to be stopped.
SLEEPER = """#!{python}
import sys, time
spec = sys.argv[sys.argv.index("--spec") + 1]
open(spec + ".ran", "w").close()
print("hello", flush=True)
time.sleep(300)
"""



def make_mgr(tmp_path: Path, source: str = SLEEPER, reports: list | None = None, on_step=None) -> ExecutorManager:
    state = tmp_path / "state"
    devs = discover(1, use_nvml=False)
    parts = Partitions.for_devices(devs, state_dir=str(state))
    rt = tmp_path / "fake-python"
    rt.write_text(source.format(python=sys.executable))
    rt.chmod(0o755)

    async def on_report(ex, r):
        if reports is not None:
            reports.append((ex.allocation_id, dict(r)))

    return ExecutorManager(state, devs, on_report, on_step=on_step, python=str(rt), parts=parts, reap_grace_s=0.5)


class Aborted(Exception):
    pass


class Ctx:
    code = None
    details = ""

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


def service(mgr: ExecutorManager, token: int = 5) -> AgentService:
    node = NodeState("n", list(mgr.devices.values()))
    node.incarnation = "i-1"
    node.max_token = token
    return AgentService(node, mgr, 1.0)


def launch_req(mgr: ExecutorManager, **kw) -> agent_pb2.LaunchExecutorRequest:
    d = dict(allocation_id="a-0123456789ab", job_id="j-0123456789ab", rank=0, world_size=1,
             device_ids=[next(iter(mgr.devices))], fencing_token=5, incarnation="i-1",
             runtime_spec_json='{"workload": {"type": "gpt"}}')
    d.update(kw)
    return agent_pb2.LaunchExecutorRequest(**d)


async def refused(call, req) -> Ctx:
    ctx = Ctx()
    with pytest.raises(Aborted):
        await call(req, ctx)
    return ctx


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


BAD_IDS = ["team/j1", "x/y", "../../escape", "..", ".", "a" * 129, "a b", "a\0b"]


@pytest.mark.parametrize("field", ["job_id", "allocation_id"])
@pytest.mark.parametrize("bad", BAD_IDS)
async def test_launch_refuses_an_unsafe_id_before_anything_happens(tmp_path, field, bad):
    mgr = make_mgr(tmp_path)
    svc = service(mgr)
    before = files_under(tmp_path)
    ctx = await refused(svc.LaunchExecutor, launch_req(mgr, **{field: bad}))
    # Before the fix: "team/j1" launched (its log could never be opened: the exit was
    # never reported, the grant never released), "x/y" failed with UNKNOWN, and
    # "../../escape" wrote its spec outside state/specs.
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and ctx.details.startswith(f"{field}:")
    assert mgr.executors == {} and mgr.parts.grants() == []
    assert files_under(tmp_path) == before
    with pytest.raises(BadRequest, match=f"^{field}:"):  # the manager checks too
        await mgr.launch(**{"allocation_id": "a-1", "job_id": "j-1", field: bad}, rank=0, world_size=1,
                         device_ids=[next(iter(mgr.devices))], master_addr="127.0.0.1", master_port=1,
                         runtime_spec={"workload": {"type": "gpt"}}, checkpoint_dir="")
    assert mgr.parts.grants() == [] and files_under(tmp_path) == before


async def test_every_rpc_refuses_an_unsafe_id_and_controller_ids_pass(tmp_path):
    mgr = make_mgr(tmp_path)
    svc = service(mgr)
    for call, req, field in [
        (svc.StopExecutor, agent_pb2.StopExecutorRequest(allocation_id="x/y", fencing_token=5), "allocation_id"),
        (svc.ControlTask, agent_pb2.ControlTaskRequest(allocation_id="../a", op="cancel", task="t",
                                                       fencing_token=5), "allocation_id"),
        (svc.UpdateGrant, agent_pb2.UpdateGrantRequest(allocation_id="x/y", units=1, fencing_token=5),
         "allocation_id"),
        (svc.ReadLogs, agent_pb2.ReadLogsRequest(job_id=".."), "job_id"),
        (svc.ReadLogs, agent_pb2.ReadLogsRequest(job_id="j" * 129), "job_id"),
    ]:
        ctx = await refused(call, req)
        assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and ctx.details.startswith(f"{field}:"), (req, ctx.details)
    # The controller's ids (controller/core.py: "a-" / "j-" + hex) launch, log and stop.
    r = await svc.LaunchExecutor(launch_req(mgr), Ctx())
    SPAWNED.append(r.pid)
    spec = mgr.state_dir / "specs" / "a-0123456789ab-r0.json"
    async with asyncio.timeout(30):
        while not Path(str(spec) + ".ran").exists():
            await asyncio.sleep(0.05)
    r2 = await svc.StopExecutor(agent_pb2.StopExecutorRequest(allocation_id="a-0123456789ab", fencing_token=5,
                                                              grace_s=2), Ctx())
    assert r2.stopped == 1 and mgr.parts.grants() == []
    logs = await svc.ReadLogs(agent_pb2.ReadLogsRequest(job_id="j-0123456789ab"), Ctx())
    assert "[rank 0] hello" in logs.text


async def test_a_refused_request_does_not_raise_the_fencing_token(tmp_path):
    mgr = make_mgr(tmp_path)
    svc = service(mgr, token=5)
    # Malformed requests carrying a higher token: refused, and the token is not taken.
    for call, req in [
        (svc.ControlTask, agent_pb2.ControlTaskRequest(allocation_id="a-1", op="bogus", task="t", fencing_token=99)),
        (svc.LaunchExecutor, launch_req(mgr, job_id="team/j1", fencing_token=99)),
        (svc.LaunchExecutor, launch_req(mgr, runtime_spec_json="{}", fencing_token=99)),
        (svc.LaunchExecutor, launch_req(mgr, incarnation="i-0", fencing_token=99)),
        (svc.StopExecutor, agent_pb2.StopExecutorRequest(allocation_id="a-1", grace_s=-1, fencing_token=99)),
        (svc.UpdateGrant, agent_pb2.UpdateGrantRequest(allocation_id="a-1", units=0, fencing_token=99)),
        # refused by the executor manager, past the servicer's own checks
        (svc.LaunchExecutor, launch_req(mgr, device_ids=["nope"], fencing_token=99)),
        (svc.LaunchExecutor, launch_req(mgr, partition_id="bogus", fencing_token=99)),
        (svc.ControlTask, agent_pb2.ControlTaskRequest(allocation_id="a-1", op="cancel", task="t", fencing_token=99)),
        (svc.UpdateGrant, agent_pb2.UpdateGrantRequest(allocation_id="a-1", units=1, fencing_token=99)),
    ]:
        ctx = await refused(call, req)
        assert ctx.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.NOT_FOUND)
        # Before the fix: 99 was recorded before the request was validated.
        assert svc.node.max_token == 5, req
    r = await svc.StopExecutor(agent_pb2.StopExecutorRequest(allocation_id="a-1", fencing_token=5), Ctx())
    assert r.stopped == 0
    # An accepted request from a newer leader still fences the old one out.
    await svc.StopExecutor(agent_pb2.StopExecutorRequest(allocation_id="a-1", fencing_token=6), Ctx())
    assert svc.node.max_token == 6
    ctx = await refused(svc.StopExecutor, agent_pb2.StopExecutorRequest(allocation_id="a-1", fencing_token=5))
    assert ctx.code == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("grace", [-3.0, float("nan"), float("inf"), float("-inf")])
async def test_stop_refuses_a_negative_or_non_finite_grace(tmp_path, grace):
    mgr = make_mgr(tmp_path)
    svc = service(mgr)
    r = await svc.LaunchExecutor(launch_req(mgr), Ctx())
    SPAWNED.append(r.pid)
    ctx = await refused(svc.StopExecutor, agent_pb2.StopExecutorRequest(allocation_id="a-0123456789ab",
                                                                        fencing_token=5, grace_s=grace))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and ctx.details.startswith("grace_s:")
    assert alive(r.pid) and mgr.running_allocations() == ["a-0123456789ab"]
    await mgr.stop("a-0123456789ab", 2.0)


async def test_read_logs_refuses_a_negative_or_huge_tail(tmp_path):
    mgr = make_mgr(tmp_path)
    svc = service(mgr)
    mgr.log_path("j-1").write_text("some log\n")
    for bad in (-5, (4 << 20) + 1, 1 << 62):  # a huge tail would read the whole log into one reply
        ctx = await refused(svc.ReadLogs, agent_pb2.ReadLogsRequest(job_id="j-1", tail_bytes=bad))
        assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and ctx.details.startswith("tail_bytes:"), bad
    r = await svc.ReadLogs(agent_pb2.ReadLogsRequest(job_id="j-1", tail_bytes=4 << 20), Ctx())
    assert (r.text, r.truncated) == ("some log\n", False)
    r = await svc.ReadLogs(agent_pb2.ReadLogsRequest(job_id="j-1", tail_bytes=4), Ctx())
    assert (r.text, r.truncated) == ("log\n", True)


async def test_an_executor_whose_log_cannot_be_opened_is_never_spawned(tmp_path):
    reports: list = []
    mgr = make_mgr(tmp_path, reports=reports)
    svc = service(mgr)
    mgr.log_path("j-0123456789ab").mkdir()  # open(..., "ab") fails: IsADirectoryError
    ctx = await refused(svc.LaunchExecutor, launch_req(mgr))
    # Before the fix: launched; the pump died opening the log, the exit was never
    # reported, the grant never released, and a stop waited for ever.
    assert ctx.code == grpc.StatusCode.INTERNAL and "j-0123456789ab.log" in ctx.details
    assert mgr.executors == {} and mgr.parts.grants() == [] and reports == []
    assert not (mgr.state_dir / "specs" / "a-0123456789ab-r0.json.ran").exists()
    assert list((mgr.state_dir / "executors").iterdir()) == []


# A line far over the stream limit (64 KiB), then a line, then exit 3.
LONG_LINE = """#!{python}
import sys
sys.stdout.write("x" * (300 * 1024) + "\\n")
sys.stdout.write("after the long line\\n")
sys.stdout.flush()
sys.exit(3)
"""

# A progress event, then exit 0.
PROGRESS = """#!{python}
import json
print("TESSERA_EVENT " + json.dumps({{"event": "progress", "step": 1, "loss": 2.0, "total": 5}}), flush=True)
print("done", flush=True)
"""


async def launch_and_wait(mgr: ExecutorManager, reports: list) -> dict:
    ex, _ = await mgr.launch(allocation_id="a-1", job_id="j-1", rank=0, world_size=1,
                             device_ids=[next(iter(mgr.devices))], master_addr="127.0.0.1", master_port=1,
                             runtime_spec={"workload": {"type": "gpt"}}, checkpoint_dir="")
    SPAWNED.append(ex.proc.pid)
    await asyncio.wait_for(ex.done.wait(), 30)
    assert mgr.parts.grants() == [] and not ex.running
    assert list((mgr.state_dir / "executors").iterdir()) == []
    assert await asyncio.wait_for(mgr.stop("a-1", 0.5), 10) == 0
    exited = [r for _, r in reports if r["kind"] == "EXITED"]
    assert len(exited) == 1
    return exited[0]


async def test_a_line_over_the_stream_limit_is_dropped_not_fatal(tmp_path):
    reports: list = []
    mgr = make_mgr(tmp_path, LONG_LINE, reports)
    # Before the fix: the reader died of ValueError; the pump with it (no EXITED, grant held).
    r = await launch_and_wait(mgr, reports)
    assert r["exit_code"] == 3 and r["message"] == "after the long line"
    log = mgr.log_path("j-1").read_text()
    assert "longer than 64 KiB dropped" in log and "[rank 0] after the long line" in log
    assert "[rank 0] exited with code 3" in log


async def test_a_failing_step_callback_does_not_lose_the_exit(tmp_path):
    reports: list = []

    async def on_step(ex, ev):
        raise RuntimeError("profiler down")

    mgr = make_mgr(tmp_path, PROGRESS, reports, on_step=on_step)
    # Before the fix: the callback's error killed the reader, then the pump.
    r = await launch_and_wait(mgr, reports)
    assert r["exit_code"] == 0
    assert "[rank 0] done" in mgr.log_path("j-1").read_text()


async def test_a_failing_proc_scan_still_reports_the_exit(tmp_path, monkeypatch):
    reports: list = []

    def broken(*a, **kw):
        raise OSError("procfs unreadable")

    monkeypatch.setattr(executors, "executor_processes", broken)
    mgr = make_mgr(tmp_path, PROGRESS, reports)
    # Before the fix: the pump died in _reap: no EXITED, the grant held, done never set.
    r = await launch_and_wait(mgr, reports)
    assert r["exit_code"] == 0


async def test_an_executor_that_cannot_be_pinned_is_killed_not_left_running(tmp_path):
    """Pinning happens after the spawn (from the parent): if it fails (a core this host does
    not have), the launch is refused and the spawned process is gone — it must not run
    unconfined once the caller releases its grant — with no record or executor left."""
    from agent.devices import LocalDevice

    rt = tmp_path / "fake-python"
    rt.write_text(SLEEPER.format(python=sys.executable))
    rt.chmod(0o755)
    dev = LocalDevice(id="cpu0", kind="cpu", model="cpu", memory_bytes=1 << 30, capacity=1, cores=(4096,))
    reports: list = []

    async def on_report(ex, r):
        reports.append(dict(r))

    state = tmp_path / "state"
    mgr = ExecutorManager(state, [dev], on_report, python=str(rt), reap_grace_s=0.5)
    seen: list[int] = []
    real_exec = asyncio.get_running_loop().subprocess_exec

    async def spy(*a, **kw):
        t, p = await real_exec(*a, **kw)
        seen.append(t.get_pid())
        SPAWNED.append(t.get_pid())
        return t, p

    asyncio.get_running_loop().subprocess_exec = spy
    try:
        with pytest.raises(BadRequest, match="cannot pin the executor to cores"):
            await mgr.launch(allocation_id="a-0123456789ab", job_id="j-0123456789ab", rank=0, world_size=1,
                             device_ids=["cpu0"], master_addr="127.0.0.1", master_port=1,
                             runtime_spec={"workload": {"type": "gpt"}}, checkpoint_dir="")
    finally:
        del asyncio.get_running_loop().subprocess_exec
    assert len(seen) == 1 and not alive(seen[0])
    assert mgr.executors == {} and reports == []
    assert list((state / "executors").glob("*")) == []


async def test_a_failed_started_report_leaves_the_running_executor_its_grant(tmp_path):
    """Once spawned, the pump owns the executor's grant: a STARTED report that raises must
    not make the launch fail (the caller would release the grant under a running process)."""
    reports: list = []
    mgr = make_mgr(tmp_path)

    async def on_report(ex, r):
        if r["kind"] == "STARTED":
            raise RuntimeError("report queue closed")
        reports.append(dict(r))

    mgr.on_report = on_report
    ex, again = await mgr.launch(allocation_id="a-0123456789ab", job_id="j-0123456789ab", rank=0, world_size=1,
                                 device_ids=[next(iter(mgr.devices))], master_addr="127.0.0.1", master_port=1,
                                 runtime_spec={"workload": {"type": "gpt"}}, checkpoint_dir="")
    SPAWNED.append(ex.proc.pid)
    assert not again and ex.running and alive(ex.proc.pid)
    assert [g.grant_id for g in mgr.parts.grants()] == [ex.grant_id]
    assert await mgr.stop("a-0123456789ab", grace_s=1) == 1
    assert mgr.parts.grants() == [] and reports[-1]["kind"] == "EXITED"


# Starts a child in a session of its own (it still carries the executor's token), records
# its pid next to the spec, then waits to be stopped.
SETSID_PARENT = """#!{python}
import subprocess, sys, time
spec = sys.argv[sys.argv.index("--spec") + 1]
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
open(spec + ".child", "w").write(str(p.pid))
print("hello", flush=True)
time.sleep(300)
"""


async def test_a_cancelled_pump_kills_every_process_before_the_grant_goes(tmp_path):
    """The event loop going away cancels the pumps: the grant is released (and ``done`` set)
    only once the leader is dead and whatever carries its token (here a child that left
    the session) has been SIGKILLed."""
    mgr = make_mgr(tmp_path, SETSID_PARENT)
    ex, _ = await mgr.launch(allocation_id="a-0123456789ab", job_id="j-0123456789ab", rank=0, world_size=1,
                             device_ids=[next(iter(mgr.devices))], master_addr="127.0.0.1", master_port=1,
                             runtime_spec={"workload": {"type": "gpt"}}, checkpoint_dir="")
    SPAWNED.append(ex.proc.pid)
    marker = Path(str(mgr.state_dir / "specs" / "a-0123456789ab-r0.json") + ".child")
    deadline = asyncio.get_running_loop().time() + 30
    while not (marker.exists() and marker.read_text()):
        assert asyncio.get_running_loop().time() < deadline, "the child never started"
        await asyncio.sleep(0.02)
    child = int(marker.read_text())
    SPAWNED.append(child)
    ex.pump.cancel()
    with pytest.raises(asyncio.CancelledError):
        await ex.pump
    assert ex.done.is_set() and mgr.parts.grants() == []
    assert not alive(ex.proc.pid)
    deadline = asyncio.get_running_loop().time() + 5
    while alive(child):  # SIGKILLed: gone as soon as the kernel reaps it (its parent, pid 1 here)
        assert asyncio.get_running_loop().time() < deadline, "the token-carrying child survived"
        await asyncio.sleep(0.02)
    assert list((mgr.state_dir / "executors").glob("*")) == []


@pytest.mark.parametrize("n", [66_000, 140_000, 300_000, 1_000_000])
@pytest.mark.parametrize("chunk", [1, 7, 4096, 65536])
async def test_an_over_long_line_is_dropped_whole_however_the_pipe_splits_it(n, chunk):
    data = b"first\n" + b"x" * n + b"TAIL-OF-LONG-LINE\n" + b"after\n" + b"last-without-newline"
    r = asyncio.StreamReader(limit=2 ** 16)
    for i in range(0, len(data), max(chunk, 1) * 997):
        r.feed_data(data[i:i + max(chunk, 1) * 997])
    r.feed_eof()
    got = [x async for x in executors.output_lines(r, chunk=chunk * 13 + 1)]
    assert got == [b"first\n", None, b"after\n", b"last-without-newline"]


# Reads its spec file (as the real runtime does) and says whether it could.
OPEN_SPEC = """#!{python}
import sys
spec = sys.argv[sys.argv.index("--spec") + 1]
try:
    open(spec).read()
except OSError as e:
    print("cannot read spec", spec, e, flush=True)
    sys.exit(2)
print("spec ok", flush=True)
"""


async def test_a_relative_state_dir_is_resolved_once(tmp_path, monkeypatch):
    # The agent's default --state-dir (".tessera/agent") is relative, and executors run
    # with the state dir as their cwd: before the fix the spec path handed to them was
    # relative too, so every executor looked for .tessera/agent/.tessera/agent/specs/...
    monkeypatch.chdir(tmp_path)
    rt = tmp_path / "fake-python"
    rt.write_text(OPEN_SPEC.format(python=sys.executable))
    rt.chmod(0o755)
    devs = discover(1, use_nvml=False)
    state = Path(".tessera/agent")
    mgr = ExecutorManager(state, devs, _no_report, python=str(rt),
                          parts=Partitions.for_devices(devs, state_dir=str(state)), reap_grace_s=0.5)
    assert mgr.state_dir == tmp_path / ".tessera" / "agent"
    ex, _ = await mgr.launch(allocation_id="a-1", job_id="j-1", rank=0, world_size=1, device_ids=["cpu0"],
                             master_addr="127.0.0.1", master_port=1, runtime_spec={"workload": {"type": "gpt"}},
                             checkpoint_dir="")
    SPAWNED.append(ex.proc.pid)
    await asyncio.wait_for(ex.done.wait(), 30)
    assert ex.exit_code == 0, mgr.log_path("j-1").read_text()


async def _no_report(ex, r):
    pass


async def test_a_stop_during_a_launch_stops_what_it_starts(tmp_path, monkeypatch):
    mgr = make_mgr(tmp_path)
    svc = service(mgr)
    loop = asyncio.get_running_loop()
    spawning, go = asyncio.Event(), asyncio.Event()
    real_exec = loop.subprocess_exec

    async def held_exec(*a, **kw):  # the launch holds its grant and lock, the spawn not yet done
        spawning.set()
        await go.wait()
        return await real_exec(*a, **kw)

    monkeypatch.setattr(loop, "subprocess_exec", held_exec)
    launch = asyncio.create_task(svc.LaunchExecutor(launch_req(mgr), Ctx()))
    await spawning.wait()
    stop = asyncio.create_task(svc.StopExecutor(
        agent_pb2.StopExecutorRequest(allocation_id="a-0123456789ab", fencing_token=5, grace_s=2), Ctx()))
    loop.call_soon(go.set)  # after the stop's first step (the ready queue is FIFO)
    async with asyncio.timeout(30):
        r = await launch
        SPAWNED.append(r.pid)
        s = await stop
    # Before the fix: stopped=0 (nothing registered yet) and the executor ran on, its grant held.
    assert s.stopped == 1
    assert mgr.running_allocations() == [] and mgr.parts.grants() == []


@pytest.mark.parametrize("spec_json, field", [
    ('{"workload": "gpt"}', "runtime_spec_json.workload:"),
    ('{"workload": null}', "runtime_spec_json.workload:"),
    ('{"workload": ["gpt"]}', "runtime_spec_json.workload:"),
    ('[1]', "runtime_spec_json:"),
    ('{"workload": {"type": "gpt", "model": "x"}}', "runtime_spec_json.workload.model:"),
    ('{"workload": {"type": "gpt", "plan": [1]}}', "runtime_spec_json.workload.plan:"),
    ('{"workload": {"type": "peft", "peft": 3}}', "runtime_spec_json.workload.peft:"),
    ('{"workload": {"type": "peft", "peft": {"tasks": [1]}}, "profiling": true}',
     "runtime_spec_json.workload.peft.tasks[0]:"),
    # An unknown (or missing) type: before the fix it was granted and spawned, and failed later.
    ('{"workload": {"type": "nope"}}', "runtime_spec_json.workload.type: must be one of gpt, multimodal, peft"),
    ('{"workload": {}}', "runtime_spec_json.workload.type:"),
])
async def test_launch_refuses_a_malformed_runtime_spec_before_anything_happens(tmp_path, spec_json, field):
    reports: list = []
    mgr = make_mgr(tmp_path, reports=reports)
    svc = service(mgr)
    before = files_under(tmp_path)
    # Before the fix: AttributeError (gRPC UNKNOWN) after the spec file was written.
    ctx = await refused(svc.LaunchExecutor, launch_req(mgr, runtime_spec_json=spec_json))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and ctx.details.startswith(field), ctx.details
    assert mgr.executors == {} and mgr.parts.grants() == [] and reports == []
    assert files_under(tmp_path) == before


async def test_the_manager_refuses_a_workload_of_the_wrong_shape_without_writing(tmp_path):
    mgr = make_mgr(tmp_path)
    before = files_under(tmp_path)
    with pytest.raises(BadRequest, match=r"^runtime_spec_json\.workload"):
        await mgr.launch(allocation_id="a-1", job_id="j-1", rank=0, world_size=1, device_ids=["cpu0"],
                         master_addr="127.0.0.1", master_port=1, runtime_spec={"workload": {"type": "gpt", "model": [1]}},
                         checkpoint_dir="")
    assert mgr.executors == {} and mgr.parts.grants() == [] and files_under(tmp_path) == before


@pytest.mark.parametrize("kw, field", [
    (dict(world_size=0, rank=0), "world_size: must be >= 1"),
    (dict(device_ids=["cpu9"]), "device_ids: unknown device 'cpu9' (this node has cpu0)"),
    (dict(checkpoint_dir="ckpt/j1"), "checkpoint_dir: must be an absolute path"),
])
async def test_launch_refusals_name_the_field_at_fault(tmp_path, kw, field):
    # Before the fix: world_size=0 was blamed on rank, an unknown device on a partition_id
    # the request never carried, and a relative checkpoint_dir was accepted (the executor,
    # running in the state dir, and ControlTask then named two different files).
    mgr = make_mgr(tmp_path)
    svc = service(mgr)
    before = files_under(tmp_path)
    ctx = await refused(svc.LaunchExecutor, launch_req(mgr, **kw))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and ctx.details.startswith(field), ctx.details
    assert mgr.executors == {} and mgr.parts.grants() == [] and files_under(tmp_path) == before
    if "world_size" not in kw:  # the manager refuses the same way
        args = dict(allocation_id="a-1", job_id="j-1", rank=0, world_size=1, device_ids=["cpu0"],
                    master_addr="127.0.0.1", master_port=1, runtime_spec={"workload": {"type": "gpt"}},
                    checkpoint_dir="")
        args.update(kw)
        with pytest.raises(BadRequest, match="^" + field.split(":")[0] + ":"):
            await mgr.launch(**args)
        assert mgr.parts.grants() == [] and files_under(tmp_path) == before


QUICK = """#!{python}
print("bye", flush=True)
"""


async def test_exited_executors_and_their_specs_are_not_kept_for_ever(tmp_path):
    reports: list = []
    mgr = make_mgr(tmp_path, QUICK, reports)
    mgr = ExecutorManager(mgr.state_dir, list(mgr.devices.values()), mgr.on_report, python=mgr.python,
                          parts=mgr.parts, reap_grace_s=0.5, keep_exited=2)
    svc = service(mgr)
    for i in range(5):
        ex, _ = await mgr.launch(allocation_id=f"a-{i}", job_id=f"j-{i}", rank=0, world_size=1, device_ids=["cpu0"],
                                 master_addr="127.0.0.1", master_port=1, runtime_spec={"workload": {"type": "gpt"}},
                                 checkpoint_dir="")
        SPAWNED.append(ex.proc.pid)
        await asyncio.wait_for(ex.pump, 30)  # its EXITED report made
    # Before the fix: all five kept (and listed by GetStatus), and their five spec files.
    assert sorted(mgr.executors) == [("a-3", 0), ("a-4", 0)]
    assert sorted(p.name for p in (mgr.state_dir / "specs").iterdir()) == ["a-3-r0.json", "a-4-r0.json"]
    st = await svc.GetStatus(agent_pb2.GetStatusRequest(), Ctx())
    assert [(e.allocation_id, e.running, e.exit_code) for e in st.executors] == [("a-3", False, 0), ("a-4", False, 0)]
    assert [r["kind"] for _, r in reports].count("EXITED") == 5


async def test_a_relaunch_keeps_its_spec_when_the_old_executor_leaves_the_history(tmp_path):
    mgr = make_mgr(tmp_path, QUICK)
    mgr.keep_exited = 1
    exs = []
    for alloc in ("a-1", "a-1", "a-2"):  # a-1 rank 0 launched twice (a relaunch), then another
        ex, _ = await mgr.launch(allocation_id=alloc, job_id="j-1", rank=0, world_size=1, device_ids=["cpu0"],
                                 master_addr="127.0.0.1", master_port=1, runtime_spec={"workload": {"type": "gpt"}},
                                 checkpoint_dir="")
        SPAWNED.append(ex.proc.pid)
        await asyncio.wait_for(ex.pump, 30)
        exs.append(ex)
        if len(exs) == 2:  # the first a-1 left the history; the relaunch (same key) kept its place and spec
            assert mgr.executors == {("a-1", 0): exs[1]}
            assert (mgr.state_dir / "specs" / "a-1-r0.json").exists()
    assert mgr.executors == {("a-2", 0): exs[2]}
    assert [p.name for p in (mgr.state_dir / "specs").iterdir()] == ["a-2-r0.json"]

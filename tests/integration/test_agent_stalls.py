"""A stalled executor (progress, then a deadlock) gets its thread stacks dumped into its
log and is killed, with the reason in its EXITED report; a slow one is not (fake runtime
as a real subprocess, the manager's ``python``)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from agent.devices import discover
from agent.executors import STALL_DUMP_S, ExecutorManager
from agent.partitions import Partitions

# Reports one step like the runtime (faulthandler on SIGUSR1, as agent.runtime does), then
# deadlocks in a function whose name the stack dump must show; or keeps stepping slowly.
RUNTIME = """#!{python}
import faulthandler, json, signal, threading, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
def step(k, secs):
    print("TESSERA_EVENT " + json.dumps({{"event": "progress", "step": k, "total": 100, "loss": 1.0,
                                          "step_time_s": secs}}), flush=True)
def stuck_in_a_collective():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()
if {slow!r}:
    for k in range(1, 100):
        step(k, 0.3)
        time.sleep(0.3)
else:
    step(1, 0.01)
    stuck_in_a_collective()
"""


async def _run(tmp_path, slow: bool, watch_s: float):
    state = tmp_path / "state"
    devs = discover(1, use_nvml=False)
    parts = Partitions.for_devices(devs, state_dir=str(state))
    exited: asyncio.Future = asyncio.Future()

    async def on_report(ex, r):
        if r["kind"] == "EXITED" and not exited.done():
            exited.set_result(r)

    rt = tmp_path / "fake-python"
    rt.write_text(RUNTIME.format(python=sys.executable, slow=slow))
    rt.chmod(0o755)
    mgr = ExecutorManager(state, devs, on_report, python=str(rt), parts=parts, report_interval_s=0,
                          stall_timeout_s=0.5)
    ex, _ = await mgr.launch(allocation_id="a-1", job_id="j-1", rank=0, world_size=1, device_ids=[devs[0].id],
                          master_addr="127.0.0.1", master_port=1, runtime_spec={"workload": {"type": "gpt"}},
                          checkpoint_dir="")
    killed = []
    t0 = time.monotonic()
    while not exited.done() and time.monotonic() - t0 < watch_s:
        killed += mgr.check_stalls()
        await asyncio.sleep(0.1)
    return mgr, ex, exited, killed, state


async def test_a_stalled_executor_dumps_its_stacks_and_is_killed(tmp_path):
    mgr, ex, exited, killed, state = await _run(tmp_path, slow=False, watch_s=30)
    r = await asyncio.wait_for(exited, 10)
    assert killed == [ex] and ex.step == 1
    assert r["exit_code"] == 137 and "stalled: no training progress" in r["message"] and "after step 1" in r["message"]
    log = Path(state / "logs" / "j-1.log").read_text()
    assert "stuck_in_a_collective" in log, "faulthandler's dump of the stuck thread is in the log"
    # Asked for the stacks first, killed STALL_DUMP_S later.
    assert ex.stall_seen is not None and STALL_DUMP_S > 0


async def test_a_slow_executor_that_keeps_stepping_is_not_a_stall(tmp_path):
    # 0.3 s steps, limit max(0.5 s, 20 x 0.3 s): watched for 3 s, never killed.
    mgr, ex, exited, killed, _ = await _run(tmp_path, slow=True, watch_s=3.0)
    assert killed == [] and ex.running and ex.step >= 5 and mgr.stall_limit(ex) >= 6.0
    await mgr.stop("a-1", grace_s=1.0)
    r = await asyncio.wait_for(exited, 10)
    assert "stalled" not in r["message"]

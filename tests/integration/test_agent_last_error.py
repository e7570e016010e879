"""The message of an executor's EXITED report (its last error), from a fake runtime (the
manager's ``python``) run as a real subprocess: an ``error`` event with ``"fatal": false``
(a peft control line rejected while the run goes on) is logged but never becomes it."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from agent.devices import discover
from agent.executors import ExecutorManager
from agent.partitions import Partitions

# Prints the given events, then exits 1 (with nothing more to say: killed, say, or a crash
# whose traceback went elsewhere).
RUNTIME = """#!{python}
import json, sys
for ev in {events!r}:
    print("TESSERA_EVENT " + json.dumps(ev), flush=True)
sys.exit(1)
"""

REJECTED = {"event": "error", "message": "control[0]: unknown task 't9'", "field": "control[0].task", "line": 0,
            "fatal": False}
FATAL = {"event": "error", "message": "engine failed: out of memory", "fatal": True}
PLAIN = {"event": "error", "message": "boom"}  # no "fatal": an error as before


@pytest.mark.parametrize("events,message", [
    ([REJECTED], ""),
    ([PLAIN, REJECTED], "boom"),
    ([REJECTED, FATAL, REJECTED], "engine failed: out of memory"),
])
async def test_a_non_fatal_error_event_is_never_the_reported_failure(tmp_path, events, message):
    state = tmp_path / "state"
    devs = discover(1, use_nvml=False)
    parts = Partitions.for_devices(devs, state_dir=str(state))
    exited = asyncio.Future()

    async def on_report(ex, r):
        if r["kind"] == "EXITED":
            exited.set_result(r)

    rt = tmp_path / "fake-python"
    rt.write_text(RUNTIME.format(python=sys.executable, events=events))
    rt.chmod(0o755)
    mgr = ExecutorManager(state, devs, on_report, python=str(rt), parts=parts)
    await mgr.launch(allocation_id="a-1", job_id="j-1", rank=0, world_size=1, device_ids=[devs[0].id],
                     master_addr="127.0.0.1", master_port=1, runtime_spec={"workload": {"type": "peft"}},
                     checkpoint_dir="")
    r = await asyncio.wait_for(exited, 30)
    # Before the fix: the rejected control line was reported as the failure.
    assert r["exit_code"] == 1 and r["message"] == message
    log = Path(state / "logs" / "j-1.log").read_text()
    assert json.dumps(REJECTED) in log, "the non-fatal error is still logged"

"""controller.records.transition keeps status.history bounded: the first entry and the last
HISTORY_KEEP, the dropped ones counted in the first entry's reason."""

from controller.records import HISTORY_KEEP, dropped_transitions, transition
from tessera.api.v1 import types_pb2 as tpb

P = tpb.JobPhase


def test_history_keeps_the_first_and_the_last_entries_and_counts_the_dropped():
    j = tpb.Job()
    transition(j, P.PENDING, "submitted", 1.0)
    for i in range(300):
        transition(j, P.SCHEDULED if i % 2 == 0 else P.PENDING, f"r{i}", 2.0 + i)
    h = j.status.history
    assert len(h) == HISTORY_KEEP + 1
    assert h[0].reason.startswith("submitted") and h[0].time == 1.0
    assert [e.reason for e in h[1:]] == [f"r{i}" for i in range(300 - HISTORY_KEEP, 300)]
    assert dropped_transitions(j) == 301 - (HISTORY_KEEP + 1)
    assert j.status.phase == P.PENDING and j.status.reason == "r299"
    # The count accumulates over further drops and is not repeated in the reason.
    transition(j, P.SCHEDULED, "again", 999.0)
    assert dropped_transitions(j) == 302 - (HISTORY_KEEP + 1)
    assert h[0].reason.count("dropped") == 1


def test_a_short_history_is_untouched():
    j = tpb.Job()
    transition(j, P.PENDING, "submitted", 1.0)
    transition(j, P.SCHEDULED, "placed", 2.0)
    transition(j, P.SCHEDULED, "placed again", 3.0)  # same phase: no entry
    assert [e.reason for e in j.status.history] == ["submitted", "placed"] and dropped_transitions(j) == 0


async def test_drain_stops_waits_a_bounded_time_then_cancels_the_hung_ones():
    """A controller shutting down awaits its background StopExecutor calls for a bounded
    time: a stop that already answered is awaited, a hung one is cancelled (not waited
    out for its 60 s RPC)."""
    import asyncio
    from types import SimpleNamespace

    from controller.core import Controller
    from tessera import log

    done, hung = asyncio.Event(), asyncio.Event()

    async def quick():
        done.set()

    async def forever():
        await hung.wait()

    tasks = {asyncio.create_task(quick()), asyncio.create_task(forever())}
    fake = SimpleNamespace(_stops=tasks, log=log.get(component="test"))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await Controller.drain_stops(fake, timeout_s=0.2)
    assert loop.time() - t0 < 5.0
    assert done.is_set() and all(t.done() for t in tasks)
    assert sum(t.cancelled() for t in tasks) == 1

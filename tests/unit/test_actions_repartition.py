"""Live repartition error handling in controller/actions.py against a fake controller:
which UpdateGrant errors count as refusals (old units written back) and which leave the
outcome unknown (records keep max(old, new)); a failed write-back is logged; Conflict and
NotFound from the job's read-modify-write do not escape ``repartition``; the measured
``busy`` is rescaled in the write that changes the units."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from controller import actions
from controller.core import NotFound
from controller.policy import Repartition
from controller.store import Conflict
from tessera.api.v1 import types_pb2 as tpb


class Log:
    def __init__(self):
        self.lines = []

    def _add(self, level, msg, **kw):
        self.lines.append((level, msg, kw))

    def info(self, msg, **kw):
        self._add("info", msg, **kw)

    def warning(self, msg, **kw):
        self._add("warning", msg, **kw)

    def error(self, msg, **kw):
        self._add("error", msg, **kw)


class Store:
    fencing_token = 7

    async def realloc_ops(self, **kw):
        return [], []

    async def get_node(self, name):
        return None


class RpcError(grpc.aio.AioRpcError):
    def __init__(self, code):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")


class Stub:
    def __init__(self, ctl):
        self.ctl = ctl

    async def UpdateGrant(self, req, timeout=None):
        self.ctl.calls.append((req.allocation_id, req.units))
        err = self.ctl.errors.pop(0) if self.ctl.errors else None
        if err is not None:
            raise RpcError(err)
        return type("R", (), {"pid": 1, "cores": [], "old_units": 0, "units": req.units})()


class Ctl:
    """What actions.repartition uses of the controller: _rmw over in-memory jobs."""

    def __init__(self, jobs):
        self.jobs, self.log, self.store = jobs, Log(), Store()
        self.policy = type("P", (), {"name": "tessera"})()
        self.agents = type("A", (), {"stub": lambda _s, addr: Stub(self)})()
        self.errors, self.calls, self.rmw_fail = [], [], {}

    def clock(self):
        return 1.0

    async def _rmw(self, job_id, fn):
        exc = self.rmw_fail.get(job_id)
        if exc is not None:
            raise exc
        if job_id not in self.jobs:
            raise NotFound(job_id)
        j = tpb.Job()
        j.CopyFrom(self.jobs[job_id])
        out = await fn(j)
        if out is not None:
            self.jobs[job_id] = j
        return self.jobs[job_id]


def _job(jid, units, busy=0.0):
    j = tpb.Job(id=jid)
    j.status.phase = tpb.RUNNING
    j.status.allocation_id = "a-" + jid
    j.status.busy = busy
    j.status.placement.add(node="n1", device_ids=["cpu0"], partition_ids=["cpu0"], units=units)
    return j


def _nodes(cap=8):
    n = tpb.Node(name="n1")
    n.partitions.add(id="cpu0", kind="cpuset", device_id="cpu0", capacity_units=cap, unit="cores")
    return {"n1": n}


def _run(ctl, quotas):
    return asyncio.run(actions.repartition(ctl, Repartition("g", quotas, True), dict(ctl.jobs), _nodes(), "d1"))


def _units(ctl, jid):
    return ctl.jobs[jid].status.placement[0].units


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
                                  grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT])
def test_refusal_writes_old_units_back(code):
    ctl = Ctl({"a": _job("a", 2), "b": _job("b", 6)})
    ctl.errors = [None, code]  # a shrinks (applied), then b's grow is refused
    assert _run(ctl, (("a", 0.125), ("b", 0.875))) == 1
    assert (_units(ctl, "a"), _units(ctl, "b")) == (1, 6)
    assert "refused by the agent" in ctl.jobs["b"].status.decision


@pytest.mark.parametrize("code", [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL])
def test_unknown_outcome_never_undercounts(code):
    # A grow whose outcome is unknown: the agent may hold the new units; the records keep them.
    ctl = Ctl({"a": _job("a", 2), "b": _job("b", 6)})
    ctl.errors = [None, code]
    assert _run(ctl, (("a", 0.125), ("b", 0.875))) == 1
    assert (_units(ctl, "a"), _units(ctl, "b")) == (1, 7)
    assert any("outcome unknown" in m for _, m, _ in ctl.log.lines)
    # A shrink whose outcome is unknown: the agent may still hold the old units; they are
    # written back and the grows after it are not attempted.
    ctl = Ctl({"a": _job("a", 4), "b": _job("b", 4)})
    ctl.errors = [code]
    assert _run(ctl, (("a", 0.25), ("b", 0.75))) == 0
    assert (_units(ctl, "a"), _units(ctl, "b")) == (4, 4)
    assert "outcome unknown" in ctl.jobs["a"].status.decision
    assert ctl.calls == [("a-a", 2)]


def test_failed_write_back_is_logged_and_conflict_or_notfound_do_not_escape():
    ctl = Ctl({"a": _job("a", 2), "b": _job("b", 6)})
    ctl.errors = [None, grpc.StatusCode.RESOURCE_EXHAUSTED]
    # b: the first write succeeds, the write-back meets too many concurrent updates.
    orig = ctl._rmw
    n = {"b": 0}

    async def rmw(job_id, fn):
        if job_id == "b":
            n["b"] += 1
            if n["b"] == 2:
                raise Conflict("job b: too many concurrent updates")
        return await orig(job_id, fn)

    ctl._rmw = rmw
    assert _run(ctl, (("a", 0.125), ("b", 0.875))) == 1
    assert any(lv == "error" and "could not write the units back" in m for lv, m, _ in ctl.log.lines)

    # Conflict on the first write: logged, nothing raised, the grows after it skipped.
    ctl = Ctl({"a": _job("a", 4), "b": _job("b", 4)})
    ctl.rmw_fail = {"a": Conflict("too many")}
    assert _run(ctl, (("a", 0.25), ("b", 0.75))) == 0
    assert ctl.calls == [] and any("units not written" in m for _, m, _ in ctl.log.lines)
    # The job vanished between the plan and the write: NotFound, logged, not raised.
    ctl = Ctl({"a": _job("a", 4), "b": _job("b", 4)})
    ctl.rmw_fail = {"b": NotFound("job b not found")}
    assert _run(ctl, (("a", 0.25), ("b", 0.75))) == 1
    assert _units(ctl, "a") == 2 and _units(ctl, "b") == 4


def test_busy_rescaled_with_the_units():
    # busy is a fraction of the current units: after 6 -> 4 and 2 -> 4 it must describe
    # the same cores used (kept as is, B's 0.5 would read as 2 cores used of 4, not 1).
    ctl = Ctl({"a": _job("a", 6, busy=1.0), "b": _job("b", 2, busy=0.5)})
    assert _run(ctl, (("a", 0.5), ("b", 0.5))) == 2
    assert ctl.jobs["a"].status.busy == pytest.approx(1.0)          # 6 cores used of 4: clamped
    assert ctl.jobs["b"].status.busy == pytest.approx(0.25)         # 1 core used of 4
    # A refused grow writes back: busy goes back with the units.
    ctl = Ctl({"a": _job("a", 4, busy=0.5), "b": _job("b", 4, busy=1.0)})
    ctl.errors = [None, grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert _run(ctl, (("a", 0.25), ("b", 0.75))) == 1
    assert ctl.jobs["a"].status.busy == pytest.approx(1.0)          # 2 cores used of 2
    assert ctl.jobs["b"].status.busy == pytest.approx(1.0)          # 4 -> 6 -> 4: unchanged
    # Not measured stays not measured.
    j = _job("x", 2)
    actions.rescale_busy(j, 2, 4)
    assert j.status.busy == 0.0


def test_busy_to_units_rescales_uniform_units_and_resets_mixed_ones():
    j = _job("a", 1, busy=1.0)
    actions.busy_to_units(j, {("n", "p0"): 1}, {("n", "p0"): 1})
    assert j.status.busy == 1.0                                       # same units: unchanged
    actions.busy_to_units(j, {("n", "p0"): 1}, {("n", "p0"): 4, ("n", "p1"): 4})
    assert j.status.busy == pytest.approx(0.25)                       # 1 core's work of 4
    actions.busy_to_units(j, {("n", "p0"): 4}, {("n", "p0"): 2, ("n", "p1"): 4})
    assert j.status.busy == 0.0                                       # mixed: not measured


def test_busy_to_units_resets_when_units_swap_between_partitions():
    """The same set of unit values but per partition swapped (p0 50 -> 10, p1 10 -> 50): the
    job's quota on each rank changed, so the measured busy no longer applies."""
    j = _job("a", 1, busy=0.9)
    actions.busy_to_units(j, {("n", "p0"): 50, ("n", "p1"): 10}, {("n", "p0"): 10, ("n", "p1"): 50})
    assert j.status.busy == 0.0

"""profilerd's ReportStep: the size is checked as the measurement would be buffered
(stamped and numbered), OK only for what was buffered, and an oversized measurement
never evicts buffered ones."""

from __future__ import annotations

import grpc
import pytest

from profilerd.api import ProfilerService
from profilerd.config import MAX_MEASUREMENT_BYTES, ProfilerdConfig
from profilerd.main import Profilerd
from tessera.api.v1 import profiler_pb2


class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class Ctx:
    async def abort(self, code, details):
        raise Aborted(code, details)


def sized(n: int) -> profiler_pb2.Measurement:
    """A step whose request (before stamping) is exactly ``n`` bytes serialized."""
    m = profiler_pb2.Measurement(kind="step", job_id="big", step=1, step_time_s=0.1, labels={"x": ""})
    m.labels["x"] = "y" * (n - m.ByteSize())
    while m.ByteSize() > n:  # the label's length prefix grew
        m.labels["x"] = m.labels["x"][:-1]
    assert m.ByteSize() == n
    return m


@pytest.fixture
def svc(tmp_path):
    core = Profilerd(ProfilerdConfig(node="n1", state_dir=str(tmp_path), buffer_bytes=MAX_MEASUREMENT_BYTES,
                                     sample_interval_s=0), samplers=[])
    return ProfilerService(core), core


async def test_size_is_checked_after_stamping_and_nothing_is_evicted(svc):
    s, core = svc
    for i in range(5):
        await s.ReportStep(profiler_pb2.Measurement(job_id=f"j{i}", step=1, step_time_s=0.1), Ctx())
    before = [m.seq for m in core.buffer.pending()]
    with pytest.raises(Aborted) as ei:  # under the limit as sent, over it once stamped
        await s.ReportStep(sized(MAX_MEASUREMENT_BYTES), Ctx())
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details.startswith("measurement:")
    assert [m.seq for m in core.buffer.pending()] == before and core.buffer.dropped == 0


async def test_not_buffered_is_never_ok(svc, monkeypatch):
    s, core = svc
    await s.ReportStep(profiler_pb2.Measurement(job_id="j", step=1, step_time_s=0.1), Ctx())
    core.buffer.max_bytes = 200  # a buffer smaller than the measurement: refused, not OK
    with pytest.raises(Aborted) as ei:
        await s.ReportStep(sized(400), Ctx())
    assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(core.buffer) == 1 and core.buffer.dropped == 0 and core.buffer.oversized == 1

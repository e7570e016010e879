"""Device discovery: CPU core sets, and the NVML path against a double of pynvml."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.devices import discover, split_cores


@given(cores=st.lists(st.integers(0, 255), min_size=1, max_size=64, unique=True), n=st.integers(1, 16))
def test_split_cores_covers_and_is_balanced(cores, n):
    sets = split_cores(cores, n)
    assert len(sets) == n and all(sets)
    if len(cores) >= n:
        flat = [c for s in sets for c in s]
        assert sorted(flat) == sorted(cores)  # a partition: each core once
        assert max(map(len, sets)) - min(map(len, sets)) <= 1


def test_split_cores_rejects_zero():
    with pytest.raises(ValueError):
        split_cores([0, 1], 0)


class FakeNVML:
    """Behaves like pynvml for the calls discovery makes."""

    def __init__(self, n: int, fail_init: bool = False):
        self.n, self.fail_init = n, fail_init

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h:04d}"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=141 << 30)


def test_gpus_when_nvml_finds_them():
    devs = discover(2, nvml=FakeNVML(2))
    assert [(d.id, d.kind, d.uuid, d.capacity) for d in devs] == [("gpu0", "gpu", "GPU-0000", 100), ("gpu1", "gpu", "GPU-0001", 100)]


def test_cpu_sets_without_nvml():
    devs = discover(2, nvml=FakeNVML(0, fail_init=True))
    assert [d.kind for d in devs] == ["cpu", "cpu"] and all(d.cores for d in devs)

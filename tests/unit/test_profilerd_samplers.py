"""profilerd's samplers: /proc parsing and an NVML double behind pynvml's interface."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from profilerd.samplers import CpuSampler, NvmlSampler, parse_meminfo, parse_proc_stat, utilisation

STAT1 = """cpu  100 0 100 800 0 0 0 0 0 0
cpu0 50 0 50 400 0 0 0 0 0 0
cpu1 50 0 50 400 0 0 0 0 0 0
intr 1 2 3
"""
STAT2 = """cpu  250 0 150 900 100 0 0 0 0 0
cpu0 150 0 50 400 0 0 0 0 0 0
cpu1 100 0 100 500 100 0 0 0 0 0
intr 1 2 3
"""
MEMINFO = "MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    400 kB\nHugePages_Total:       0\n"


def test_parse_and_utilisation():
    a, b = parse_proc_stat(STAT1), parse_proc_stat(STAT2)
    assert a["cpu0"] == (100, 500)
    u = utilisation(a, b)
    assert u["cpu0"] == pytest.approx(1.0)        # 100 busy of 100 elapsed
    assert u["cpu1"] == pytest.approx(100 / 300)  # iowait counts as idle
    assert u["cpu"] == pytest.approx(200 / 400)
    assert utilisation(b, b) == {}                # no time elapsed: nothing claimed


def test_meminfo_bytes():
    mem = parse_meminfo(MEMINFO)
    assert mem["MemTotal"] == 1024000 and mem["MemAvailable"] == 409600 and mem["HugePages_Total"] == 0


def test_cpu_sampler_on_fake_proc(tmp_path):
    (tmp_path / "stat").write_text(STAT1)
    (tmp_path / "meminfo").write_text(MEMINFO)
    s = CpuSampler("n1", proc=tmp_path)
    (tmp_path / "stat").write_text(STAT2)
    [m] = s.sample()
    assert (m.kind, m.node, m.device_id, m.labels["cores"]) == ("device", "n1", "cpu", "2")
    assert m.values["cpu0_util"] == pytest.approx(1.0)
    assert m.values["cpu_util"] == pytest.approx(0.5)
    assert m.values["mem_used_bytes"] == 600 * 1024


def test_cpu_sampler_on_this_machine():
    [m] = CpuSampler("n1").sample()
    assert m.values["mem_used_bytes"] > 0


class FakeNvml:
    NVML_CLOCK_SM = 1

    def __init__(self, n=2, power_supported=True):
        self.n, self.power_supported, self.shut = n, power_supported, False

    def nvmlInit(self): pass
    def nvmlShutdown(self): self.shut = True
    def nvmlDeviceGetCount(self): return self.n
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetUtilizationRates(self, h): return SimpleNamespace(gpu=40 + h, memory=10)
    def nvmlDeviceGetMemoryInfo(self, h): return SimpleNamespace(used=(h + 1) * 2**30, total=80 * 2**30)
    def nvmlDeviceGetUUID(self, h): return f"GPU-{h}".encode()

    def nvmlDeviceGetClockInfo(self, h, kind):
        assert kind == self.NVML_CLOCK_SM
        return 1410

    def nvmlDeviceGetPowerUsage(self, h):
        if not self.power_supported:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 250000


def test_nvml_sampler_with_double():
    nv = FakeNvml(power_supported=False)
    s = NvmlSampler.create("n1", nv)
    ms = s.sample()
    assert [m.device_id for m in ms] == ["gpu0", "gpu1"]
    v = ms[1].values
    assert v["sm_util"] == pytest.approx(0.41) and v["mem_used_bytes"] == 2 * 2**30 and v["sm_clock_mhz"] == 1410
    assert "power_w" not in v  # unsupported figure left out, not faked
    assert ms[0].labels["uuid"] == "GPU-0"
    assert NvmlSampler.create("n1", FakeNvml()).sample()[0].values["power_w"] == 250.0
    s.close()
    assert nv.shut


def test_nvml_absent_or_empty():
    class Broken:
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    assert NvmlSampler.create("n1", Broken()) is None
    assert NvmlSampler.create("n1", FakeNvml(n=0)) is None

"""tessera.ports: loopback ports for daemons told their port — outside the kernel's
ephemeral range, free when picked, never handed out twice in a row by one process."""

from __future__ import annotations

import socket

import pytest

from tessera import ports
from tessera.etcdproc import free_port as etcdproc_free_port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_ports_are_distinct_free_and_outside_the_ephemeral_range():
    lo, hi = ports.ephemeral_range()
    got = ports.free_ports(20)
    assert len(set(got)) == 20
    assert all(ports._LOW_PORT <= p <= 65535 and not lo <= p <= hi for p in got)
    assert all(_bindable(p) for p in got)


def test_successive_calls_do_not_hand_out_a_port_again():
    got = [ports.free_port() for _ in range(300)]
    assert len(set(got)) == len(got)


def test_the_etcdproc_names_are_the_same_helpers():
    assert etcdproc_free_port is ports.free_port


class _Scripted:
    """Stands in for random.SystemRandom: hands out the indices ``script`` first, then
    counts up from index 10000 (port 20000 of the first span)."""

    script: list[int] = []

    def __init__(self):
        self.next = list(self.script)
        self.n = 10000

    def randrange(self, stop):
        if self.next:
            return self.next.pop(0)
        self.n += 1
        return self.n


def test_a_port_someone_listens_on_is_skipped(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (32768, 60999))
    monkeypatch.setattr(ports, "_HANDED", [])
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken = ports.free_port()  # outside the range, so the scripted index can name it
        busy.bind(("127.0.0.1", taken))
        busy.listen()
        first = (ports._LOW_PORT, 32767)
        index = taken - first[0] if taken <= first[1] else first[1] - first[0] + 1 + taken - 61000
        assert ports._nth([first, (61000, 65535)], index) == taken
        monkeypatch.setattr(_Scripted, "script", [index])
        monkeypatch.setattr(ports.random, "SystemRandom", _Scripted)
        (p,) = ports.free_ports(1)
    assert p != taken and p > 20000


def test_with_no_room_outside_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    got = ports.free_ports(3)
    assert len(set(got)) == 3 and all(_bindable(p) for p in got)


@pytest.mark.parametrize("text,expected", [("20000\t30000\n", (20000, 30000)), ("garbage", (32768, 60999)),
                                           ("70000 80000", (32768, 60999))])
def test_the_ephemeral_range_is_read_from_proc_or_defaults(monkeypatch, tmp_path, text, expected):
    f = tmp_path / "range"
    f.write_text(text)
    real = ports.Path
    monkeypatch.setattr(ports, "Path", lambda p: real(f) if "ip_local_port_range" in str(p) else real(p))
    assert ports.ephemeral_range() == expected


def test_the_nth_port_walks_the_spans_in_order():
    spans = [(10000, 10002), (61000, 61001)]
    assert [ports._nth(spans, i) for i in range(5)] == [10000, 10001, 10002, 61000, 61001]
    with pytest.raises(IndexError):
        ports._nth(spans, 5)


def test_a_host_that_cannot_bind_raises_instead_of_looping(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))  # the kernel's choice only
    with pytest.raises(OSError):
        ports.free_ports(1, host="192.0.2.1")  # TEST-NET-1: no interface of this host has it

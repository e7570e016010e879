"""tessera.gloo: which threads it changes, and only those; the switch that turns it off."""

from __future__ import annotations

import os
import threading

import pytest

from tessera import gloo

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")


def _named_thread(name: str):
    """A parked thread whose kernel name (``comm``) is ``name``; returns (tid, release)."""
    ready, release = threading.Event(), threading.Event()
    box = {}

    def body():
        box["tid"] = threading.get_native_id()
        with open(f"/proc/self/task/{box['tid']}/comm", "w") as f:
            f.write(name)
        ready.set()
        release.wait(30)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    assert ready.wait(10)
    return box["tid"], lambda: (release.set(), t.join(10))


def test_only_loop_threads_become_batch():
    loop, free_loop = _named_thread("gloo_tcp_loop")
    other, free_other = _named_thread("pt_gloo_runloop")
    try:
        assert gloo.loop_threads() == [loop]
        assert gloo.calm_loop_threads() == 1
        assert os.sched_getscheduler(loop) == os.SCHED_BATCH
        assert os.sched_getscheduler(other) == os.SCHED_OTHER
        assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
        assert gloo.calm_loop_threads() == 1  # idempotent
    finally:
        free_loop()
        free_other()


def test_switched_off_by_env(monkeypatch):
    loop, free_loop = _named_thread("gloo_tcp_loop")
    try:
        monkeypatch.setenv(gloo.ENV, "0")
        assert gloo.calm_loop_threads() == 0
        assert os.sched_getscheduler(loop) == os.SCHED_OTHER
    finally:
        free_loop()


@pytest.mark.parametrize("value,on", [("1", True), ("", True), ("yes", True), ("0", False), ("off", False),
                                      ("False", False), (" no ", False)])
def test_enabled_parsing(value, on):
    assert gloo.enabled({gloo.ENV: value}) is on
    assert gloo.enabled({}) is True


def test_no_threads_no_error():
    assert gloo.loop_threads(pid=2 ** 22 + 7) == []  # no such process

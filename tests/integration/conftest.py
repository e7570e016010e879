"""Fixtures of the integration tests: a real etcd, a controller and agents in-process
on loopback ports. Plain helpers (wait helpers, /proc affinity, the live cluster itself)
are in ``_live.py``: ``from _live import watch_until, ...``.

- ``controller``: a running controller (policy tessera) against the test's etcd; yields
  its ``ControllerConfig``.
- ``live``: ``async with live(policy=..., prefix=..., agents=..., cpu_devices=..., **agent
  options) as (jobs, nodes, agent):`` a controller and agents, every node READY
  (``_live.live_cluster`` over this test's etcd and tmp dir; several per test with
  distinct prefixes).
"""

from __future__ import annotations

import asyncio
import functools
import os
from dataclasses import replace

import pytest

from _live import live_cluster
from controller.config import ControllerConfig
from tessera.ports import free_port as _free_port


@pytest.fixture
async def controller(etcd_server, tmp_path):
    """A running controller (in-process, policy tessera) against the test's etcd; yields its config."""
    from controller import main as cmain

    cfg = ControllerConfig(listen=f"127.0.0.1:{_free_port()}", etcd=etcd_server, prefix=f"/t{os.getpid()}",
                           grace_s=3.0, heartbeat_interval_s=0.3, reconcile_interval_s=0.3,
                           state_dir=str(tmp_path / "ctl"), checkpoint_root=str(tmp_path / "ckpt"))
    stop = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.create_task(cmain.serve(cfg, ready=ready, stop=stop))
    await asyncio.wait_for(ready.wait(), 20)
    yield cfg
    stop.set()
    await asyncio.wait_for(task, 30)


@pytest.fixture
def live(etcd_server, tmp_path):
    """``live(policy="tessera", prefix="/live", agents=1, cpu_devices=1, ...)``: see the
    module docstring and ``_live.live_cluster``."""
    return functools.partial(live_cluster, etcd_server, tmp_path)


def with_port(cfg, **kw):
    return replace(cfg, **kw)

"""A real 2-rank gloo world built by the runtime (dp=1, tp=2): its gloo loop threads
run SCHED_BATCH (tessera.gloo), and not when switched off."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from agent.runtime.parallel.launch import free_port

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")


def _rank(rank: int, port: int, q) -> None:
    import torch

    from agent.runtime.parallel import context
    from agent.runtime.plan import Plan
    from tessera.gloo import loop_threads

    torch.set_num_threads(1)
    ctx = context.init(Plan(tp=2), {"rank": rank, "world_size": 2, "master_addr": "127.0.0.1",
                                    "master_port": port, "backend": "gloo", "timeout_s": 60})
    try:
        x = torch.ones(1024)
        torch.distributed.all_reduce(x, group=ctx.tp_group)
        q.put((rank, float(x[0]), [os.sched_getscheduler(t) for t in loop_threads()]))
    finally:
        context.shutdown(ctx)


def _world(env: dict) -> dict:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        ctx = mp.get_context("spawn")
        q, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(2)]
        for p in procs:
            p.start()
        out = {}
        for _ in procs:
            rank, value, policies = q.get(timeout=120)
            out[rank] = (value, policies)
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        return out
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_runtime_world_runs_loop_threads_batch():
    out = _world({"TESSERA_GLOO_BATCH_LOOP": "1"})
    for value, policies in out.values():
        assert value == 2.0
        assert policies and all(p == os.SCHED_BATCH for p in policies), policies


def test_switched_off_leaves_them_normal():
    out = _world({"TESSERA_GLOO_BATCH_LOOP": "0"})
    for value, policies in out.values():
        assert value == 2.0
        assert policies and all(p == os.SCHED_OTHER for p in policies), policies

"""Run a function on N local ranks joined in a gloo process group (tests, benchmarks).

Contract: ``run_ranks(world, fn, *args)`` starts ``world`` fresh processes (spawn), each
joins a process group on a free loopback port and calls ``fn(rank, world, *args)``
(``fn`` must be importable at module level); returns the ranks' return values in rank
order, or raises RuntimeError carrying a failing rank's traceback.
"""

from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

from tessera.gloo import calm_loop_threads
from tessera.ports import free_port


def _child(rank: int, world: int, port: int, out_dir: str, threads: int, fn, args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if world > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
            calm_loop_threads()
        result = fn(rank, world, *args)
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"err": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, threads: int = 1) -> list:
    """See the module doc. ``threads`` is each rank's intra-op thread budget."""
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.start_processes(_child, args=(world, free_port(), d, threads, fn, args), nprocs=world, start_method="spawn")
        except Exception:
            pass  # a rank's own traceback (saved below) says more than the spawn wrapper
        out = []
        for r in range(world):
            path = os.path.join(d, f"{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died without a result")
            res = torch.load(path, weights_only=False)
            if "err" in res:
                raise RuntimeError(f"rank {r} failed:\n{res['err']}")
            out.append(res["ok"])
        return out

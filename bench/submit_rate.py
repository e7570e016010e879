"""Job submission rate of the controller under concurrent gRPC clients, next to the
raw etcd transaction rate at the same concurrency (the ceiling).

    python -m bench.submit_rate [--clients 16] [--jobs 2000] [--json PATH]

Starts its own etcd and controller (no agents: submitted jobs stay PENDING, which is
what is measured) on free loopback ports, in a temporary directory. Every submission
is a full SubmitJob: validation, idempotency key, one fenced etcd transaction.
JSON keys: jobs_per_s, p50_ms, p99_ms, etcd_txn_per_s (plus the run's parameters).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import aetcd
import grpc

from tessera import etcdproc, manifest
from tessera.api.v1 import controller_pb2 as cpb
from tessera.api.v1 import controller_pb2_grpc as cgrpc

SPEC = manifest.to_proto(manifest.validate({
    "apiVersion": "tessera/v1", "name": "bench", "tenant": "bench",
    "workload": {"type": "gpt", "steps": 100}, "resources": {"devices": 1, "device_kind": "cpu"}}))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def wait_leader(stub) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            await stub.SubmitJob(cpb.SubmitJobRequest(spec=SPEC, idempotency_key="warmup"), timeout=2)
            return
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def submit_load(addr: str, clients: int, jobs: int) -> dict:
    channels = [grpc.aio.insecure_channel(addr) for _ in range(clients)]
    stubs = [cgrpc.JobServiceStub(c) for c in channels]
    await wait_leader(stubs[0])
    lat: list[float] = []
    per = jobs // clients

    async def worker(stub):
        for _ in range(per):
            t = time.perf_counter()
            await stub.SubmitJob(cpb.SubmitJobRequest(spec=SPEC, idempotency_key=uuid.uuid4().hex), timeout=30)
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(s) for s in stubs))
    wall = time.perf_counter() - t0
    for c in channels:
        await c.close()
    return {"jobs_per_s": len(lat) / wall, "p50_ms": 1000 * statistics.median(lat), "p99_ms": 1000 * pct(lat, 0.99),
            "submitted": len(lat)}


async def etcd_load(endpoint: str, clients: int, txns: int) -> dict:
    """The same shape of write as a submission (compare-absent + put job + put key)."""
    host, port = endpoint.rsplit(":", 1)
    cs = [aetcd.Client(host=host, port=int(port)) for _ in range(clients)]
    for c in cs:
        await c.connect()
    value = SPEC.SerializeToString() * 2
    per = txns // clients

    async def worker(c, w):
        for i in range(per):
            k = f"/raw/{w}/{i}".encode()
            await c.transaction(compare=[c.transactions.version(k) == 0],
                                success=[c.transactions.put(k, value), c.transactions.put(k + b"/i", b"x")], failure=[])

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c, w) for w, c in enumerate(cs)))
    wall = time.perf_counter() - t0
    for c in cs:
        await c.close()
    return {"etcd_txn_per_s": per * clients / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tessera-bench-") as tmp:
        etcd = etcdproc.start(os.path.join(tmp, "etcd"))
        ctl = None
        try:
            port = etcdproc.free_port()
            env = dict(os.environ, TESSERA_LOG_LEVEL="warning")
            ctl = subprocess.Popen(
                [sys.executable, "-m", "controller", "--listen", f"127.0.0.1:{port}", "--etcd", etcd.endpoint,
                 "--state-dir", os.path.join(tmp, "ctl"), "--checkpoint-root", os.path.join(tmp, "ck")],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            sub = asyncio.run(submit_load(f"127.0.0.1:{port}", a.clients, a.jobs))
            raw = asyncio.run(etcd_load(etcd.endpoint, a.clients, a.jobs))
        finally:
            if ctl is not None:
                ctl.terminate()
                ctl.wait(20)
            etcd.stop()
    out = {**sub, **raw, "clients": a.clients, "jobs": a.jobs,
           "fraction_of_etcd_ceiling": sub["jobs_per_s"] / raw["etcd_txn_per_s"]}
    print(f"{'measure':<34}{'value':>12}")
    print(f"{'SubmitJob, jobs/s':<34}{out['jobs_per_s']:>12.0f}")
    print(f"{'SubmitJob p50 latency, ms':<34}{out['p50_ms']:>12.2f}")
    print(f"{'SubmitJob p99 latency, ms':<34}{out['p99_ms']:>12.2f}")
    print(f"{'raw etcd txn/s (same shape)':<34}{out['etcd_txn_per_s']:>12.0f}")
    print(f"{'controller / etcd ceiling':<34}{out['fraction_of_etcd_ceiling']:>12.2f}")
    print(f"({a.clients} concurrent gRPC clients, {out['submitted']} submissions)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``tessera-controller``: the control plane's leader-elected API and reconcile loop."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys

import aetcd
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from controller.policy import FirstFit, TesseraPolicy
from tessera import config, log
from tessera.api.v1 import controller_pb2, controller_pb2_grpc
from tessera.errors import SpecError

from .api import JobService, NodeService
from .config import ControllerConfig
from .core import Controller
from .leader import Leadership
from .profiling import Profiling
from .store import Store

POLICIES = {"tessera": TesseraPolicy, "firstfit": FirstFit}


def make_policy(name: str):
    if name not in POLICIES:
        raise SpecError("policy", f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    return POLICIES[name]()


async def serve(cfg: ControllerConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Run the controller until ``stop`` is set (or SIGTERM/SIGINT when run as a daemon)."""
    logger = log.get(component="controller")
    host, port = cfg.etcd.rsplit(":", 1)
    # Every round reads every job in one range: lift gRPC's 4 MiB default reply limit.
    client = aetcd.Client(host=host, port=int(port), timeout=10,
                          options={"grpc.max_receive_message_length": 512 << 20})
    await client.connect()
    store = Store(client, cfg.prefix)
    ctl = Controller(store, cfg, make_policy(cfg.policy))
    identity = cfg.identity or f"{socket.gethostname()}:{os.getpid()}"
    leadership = Leadership(client, store, identity, ttl=cfg.lease_ttl_s)

    server = grpc.aio.server()
    loop_stop = asyncio.Event()  # set when the controller stops: its loops and open watches end
    controller_pb2_grpc.add_JobServiceServicer_to_server(JobService(ctl, loop_stop), server)
    controller_pb2_grpc.add_NodeServiceServicer_to_server(NodeService(ctl), server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    names = [
        controller_pb2.DESCRIPTOR.services_by_name["JobService"].full_name,
        controller_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name,
        health.SERVICE_NAME,
        reflection.SERVICE_NAME,
    ]
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(cfg.listen)
    if bound == 0:
        raise SystemExit(f"--listen: cannot bind {cfg.listen}")
    await server.start()
    stop = stop or asyncio.Event()

    async def elected():
        await ctl.on_elected()
        for n in names[:2] + [""]:
            await hs.set(n, health_pb2.HealthCheckResponse.SERVING)

    async def lost():
        await ctl.on_lost()
        # A standby again: health checks (and load balancers) must stop sending it work.
        for n in names[:2] + [""]:
            await hs.set(n, health_pb2.HealthCheckResponse.NOT_SERVING)

    campaign = asyncio.create_task(leadership.campaign(elected, lost))
    reconcile = asyncio.create_task(ctl.run(loop_stop))
    loops = [campaign, reconcile]
    if cfg.estimator:  # profiling jobs and estimates (controller/profiling.py)
        prof = Profiling(ctl, cfg.estimator, steps=cfg.profile_steps, interval_s=cfg.reconcile_interval_s,
                         grace_s=cfg.profile_grace_s, attempts=cfg.profile_attempts, retry_s=cfg.profile_retry_s)
        # The policy's live estimator evaluates the snapshot this loop keeps fresh.
        ctl.snapshot = lambda: prof.link.model
        loops.append(asyncio.create_task(prof.run(loop_stop)))
    if cfg.state_dir:
        logger.warning("state_dir is deprecated and ignored: the controller keeps all its state in etcd",
                       state_dir=cfg.state_dir)
    logger.info("controller started", listen=cfg.listen, port=bound, etcd=cfg.etcd, prefix=cfg.prefix, identity=identity)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        logger.info("controller stopping")
        await hs.enter_graceful_shutdown()
        loop_stop.set()
        ctl.kick.set()
        campaign.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        await server.stop(grace=3)
        await ctl.agents.close()
        await client.close()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = config.load(ControllerConfig, argv, "TESSERA_CONTROLLER_", __doc__)
        make_policy(cfg.policy)
    except SpecError as e:
        print(f"tessera-controller: {e}", file=sys.stderr)
        return 2
    log.setup("controller")

    async def run():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop=stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())

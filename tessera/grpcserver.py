"""grpc.aio server helper shared by the daemons.

``start`` builds and starts a server with the given servicers, the standard health
service (every named service and the overall "" set SERVING) and reflection, and
returns a ``Running`` handle (tests use it directly). ``serve`` runs one until a stop
event is set, or until SIGTERM/SIGINT when no event is given, then stops gracefully:
health goes NOT_SERVING, in-flight RPCs get ``grace`` seconds, then ``on_stop`` runs.

Example::

    await grpcserver.serve(
        [(profiler_pb2_grpc.add_ProfilerServiceServicer_to_server, servicer)],
        [grpcserver.full_name(profiler_pb2, "ProfilerService")],
        "127.0.0.1:50062")
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from . import wire

AddFn = Callable[[Any, grpc.aio.Server], None]


def full_name(pb2_module: Any, service: str) -> str:
    """The fully qualified name of ``service`` declared in ``pb2_module`` (health/reflection key)."""
    return pb2_module.DESCRIPTOR.services_by_name[service].full_name


@dataclass
class Running:
    """A started server. ``port`` is the bound port (useful with ``HOST:0``)."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    service_names: list[str]

    async def set_serving(self, serving: bool) -> None:
        """Flip the health status of every named service and of the server ("")."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in [*self.service_names, ""]:
            await self.health.set(name, status)

    async def stop(self, grace: float | None = 3.0) -> None:
        """Report NOT_SERVING, refuse new RPCs and give in-flight ones ``grace`` seconds."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


# Message limits (both ways), defined in ``tessera.wire`` (which the client imports
# without this module's health and reflection services): servers pass LARGE_MESSAGES to
# ``start``/``serve``; their clients' channels take the same options.
MAX_MESSAGE_BYTES = wire.MAX_MESSAGE_BYTES
LARGE_MESSAGES = wire.LARGE_MESSAGES


async def start(servicers: Sequence[tuple[AddFn, Any]], service_names: Sequence[str], listen: str,
                options: Sequence[tuple[str, Any]] | None = None) -> Running:
    """Build, bind (insecure) and start a server on ``listen``; raise ``OSError`` when the
    address cannot be bound. All ``service_names`` are SERVING when this returns.
    SO_REUSEPORT is off unless ``options`` turn it on: a second daemon on a busy port
    must fail, not share the port silently."""
    opts = dict(options or [])
    opts.setdefault("grpc.so_reuseport", 0)
    server = grpc.aio.server(options=list(opts.items()))
    for add, servicer in servicers:
        add(servicer, server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as e:  # grpc >= 1.5x raises instead of returning 0
        raise OSError(f"cannot bind {listen}: {e}") from None
    if port == 0:
        raise OSError(f"cannot bind {listen}")
    await server.start()
    running = Running(server, hs, port, list(service_names))
    await running.set_serving(True)
    return running


async def serve(servicers: Sequence[tuple[AddFn, Any]], service_names: Sequence[str], listen: str, *,
                stop: asyncio.Event | None = None, grace: float = 3.0,
                on_started: Callable[[Running], Awaitable[None] | None] | None = None,
                on_stop: Callable[[], Awaitable[None] | None] | None = None,
                options: Sequence[tuple[str, Any]] | None = None) -> None:
    """Run a server until ``stop`` is set; without ``stop``, until SIGTERM or SIGINT
    (handlers installed on the running loop, main thread only). ``on_started`` gets the
    ``Running`` handle once serving; ``on_stop`` runs after the server has stopped;
    ``options``: server options as in ``start`` (e.g. ``LARGE_MESSAGES``)."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    running = await start(servicers, service_names, listen, options)
    try:
        if on_started is not None:
            r = on_started(running)
            if asyncio.iscoroutine(r):
                await r
        await stop.wait()
    finally:
        await running.stop(grace)
        if on_stop is not None:
            r = on_stop()
            if asyncio.iscoroutine(r):
                await r

"""``tessera-estimator``: receives measurements from the profilerds, persists them
(fsync before ack, duplicates dropped by (source, seq)), fits the performance model
from them (versioned, persisted) and answers profiles, estimates and model snapshots."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable

import structlog

from tessera import config, grpcserver, log
from tessera.api.v1 import estimator_pb2, estimator_pb2_grpc
from tessera.errors import SpecError

from .api import EstimatorService
from .config import EstimatorConfig
from .models import ModelKeeper
from .store import MeasurementStore, Retention, elapsed_clock

SERVICE = grpcserver.full_name(estimator_pb2, "EstimatorService")


def open_store(cfg: EstimatorConfig, clock: Callable[[], float] = time.time,
               monotonic: Callable[[], float] = elapsed_clock) -> MeasurementStore:
    """The measurement store of ``cfg`` (its directory, retention windows, compaction threshold,
    key expiry); receipt times and key ages are ``clock`` (wall clock) at open plus
    ``monotonic`` elapsed since (see ``MeasurementStore``)."""
    return MeasurementStore(cfg.state_dir, Retention(step_window=cfg.step_window, run_steps=cfg.run_steps,
                                                     row_window=cfg.row_window), compact_bytes=cfg.compact_bytes,
                            key_ttl_s=cfg.key_ttl_s, clock=clock, monotonic=monotonic)


async def start(cfg: EstimatorConfig,
                clock: Callable[[], float] = time.time,
                monotonic: Callable[[], float] = elapsed_clock) -> tuple[grpcserver.Running, MeasurementStore]:
    """Open the store (``clock``, ``monotonic`` as in ``open_store``) and start serving
    (messages up to ``grpcserver.MAX_MESSAGE_BYTES`` both ways: EstimateBatch at
    ``api.MAX_BATCH``); the caller stops the server, then closes the store."""
    store = open_store(cfg, clock, monotonic)
    try:
        svc = EstimatorService(store, ModelKeeper(store, cfg.state_dir, min_refit_interval_s=cfg.min_refit_interval_s))
        running = await grpcserver.start([(estimator_pb2_grpc.add_EstimatorServiceServicer_to_server, svc)],
                                         [SERVICE], cfg.listen, grpcserver.LARGE_MESSAGES)
    except BaseException:
        store.close()
        raise
    log.get(component="estimator").info("estimator started", listen=cfg.listen, port=running.port, state_dir=cfg.state_dir)
    return running, store


async def serve(cfg: EstimatorConfig, stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set (SIGTERM/SIGINT when None)."""
    logger = log.get(component="estimator")
    store = open_store(cfg)

    def started(r: grpcserver.Running) -> None:
        logger.info("estimator started", listen=cfg.listen, port=r.port, state_dir=cfg.state_dir)

    try:
        svc = EstimatorService(store, ModelKeeper(store, cfg.state_dir, min_refit_interval_s=cfg.min_refit_interval_s))
        await grpcserver.serve([(estimator_pb2_grpc.add_EstimatorServiceServicer_to_server, svc)],
                               [SERVICE], cfg.listen, stop=stop, grace=cfg.grace_s, on_started=started,
                               options=grpcserver.LARGE_MESSAGES)
    finally:
        store.close()
        logger.info("estimator stopped", measurements=store.count, duplicates=store.duplicates, retained=store.retained,
                    compactions=store.compactions, keys=store.keys, expired=dict(store.expired))


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2: bad configuration, 1: cannot serve)."""
    try:
        cfg = config.load(EstimatorConfig, argv, "TESSERA_ESTIMATOR_", __doc__)
    except SpecError as e:
        print(f"tessera-estimator: {e}", file=sys.stderr)
        return 2
    logger = log.setup("estimator")
    structlog.contextvars.bind_contextvars(service="estimator")  # on every line, not only this logger's
    try:
        asyncio.run(serve(cfg))
    except OSError as e:
        logger.error("estimator failed", error=str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

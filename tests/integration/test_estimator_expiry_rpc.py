"""Key expiry seen through the estimator's RPCs over real loopback gRPC: a long-gone
job's profile and its source's key are forgotten (its watermark stays), the latest profile of each
configuration and the model key's profile stay, across a restart; and the daemon as a
real process with ``TESSERA_ESTIMATOR_KEY_TTL_S`` (env) expires, logs and restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from _live import eventually
from grpc_health.v1 import health_pb2, health_pb2_grpc

from estimator import main as emain
from estimator.config import EstimatorConfig
from tessera.api.v1 import estimator_pb2, estimator_pb2_grpc, profiler_pb2

ROOT = Path(__file__).resolve().parents[2]
TTL = 1000.0
MODULE = "gpt:l2-h64-a4-s32-v256"
LABELS = {"module": MODULE, "workload_type": "gpt", "layers": "2", "hidden": "64", "heads": "4", "vocab": "256",
          "seq_len": "32", "batch": "8", "dp": "1", "tp": "1", "pp": "1", "micro_batches": "1", "threads": "1",
          "world_size": "1", "device_kind": "cpu", "rank": "0"}


class Clock:
    """Time moved by hand: the wall clock and the monotonic clock (``mono``) together."""

    def __init__(self, t: float = 1.7e9) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def mono(self) -> float:
        return self.t


def run(source: str, seq0: int, job: str, n: int = 6, scale: float = 0.01, **labels) -> list[profiler_pb2.Measurement]:
    """``n`` steps of one single-device run (5 make a profile point), model key ``gpt:x``."""
    return [profiler_pb2.Measurement(source=source, seq=seq0 + k, kind="step", job_id=job, model_key="gpt:x",
                                     step=k + 1, step_time_s=scale * (k + 1), labels={**LABELS, **labels})
            for k in range(n)]


async def report(stub, ms):
    return await stub.ReportMeasurements(iter([estimator_pb2.MeasurementBatch(measurements=ms)]))


async def not_found(call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    return e.value.details()


async def serve(state_dir: Path, clock: Clock):
    cfg = EstimatorConfig(listen="127.0.0.1:0", state_dir=str(state_dir), grace_s=0, min_refit_interval_s=0,
                          key_ttl_s=TTL)
    running, store = await emain.start(cfg, clock, clock.mono)
    return running, store, grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")


async def check_expired(stub) -> None:
    """What a client sees once job-old (and its source) expired and job-new took over config A."""
    msg = await not_found(stub.GetProfile(estimator_pb2.GetProfileRequest(job_id="job-old")))
    assert "job-old" in msg
    assert (await stub.GetProfile(estimator_pb2.GetProfileRequest(model_key="gpt:x"))).samples == 18
    # its source's key expired too, but not its watermark: a resent batch is still a duplicate
    assert (await stub.GetWatermark(estimator_pb2.GetWatermarkRequest(source="profilerd/old"))).seq == 12
    assert (await stub.GetWatermark(estimator_pb2.GetWatermarkRequest(source="profilerd/new"))).seq == 6
    profs = (await stub.ListProfiles(estimator_pb2.ListProfilesRequest(module=MODULE))).profiles
    # config A: job-new's run superseded job-old's; config B: job-b's run is its only one, kept however old
    assert sorted((p.job_id, p.rows) for p in profs) == [("job-b", 16), ("job-new", 8)]
    snap = await stub.GetModelSnapshot(estimator_pb2.GetModelSnapshotRequest())
    assert snap.json and '"profiles"' in snap.json


async def test_expired_job_is_forgotten_over_grpc_and_stays_so_after_restart(tmp_path):
    clock = Clock()
    running, store, ch = await serve(tmp_path, clock)
    try:
        stub = estimator_pb2_grpc.EstimatorServiceStub(ch)
        await report(stub, run("profilerd/old", 1, "job-old") + run("profilerd/old", 7, "job-b", batch="16"))
        assert (await stub.GetProfile(estimator_pb2.GetProfileRequest(job_id="job-old"))).samples == 6
        v0 = (await stub.GetModelSnapshot(estimator_pb2.GetModelSnapshotRequest())).version
        clock.t += TTL + 1
        await report(stub, run("profilerd/new", 1, "job-new", scale=0.02))  # slower; this append sweeps
        await check_expired(stub)
        assert dict(store.expired) == {"job": 2, "job_model": 2, "run": 1, "source": 1}
        # the model refits without job-old's run: config A's point is job-new's median now
        snap = await stub.GetModelSnapshot(estimator_pb2.GetModelSnapshotRequest())
        points = sorted((p["rows"], p["seconds"]) for p in json.loads(snap.json)["profiles"]["cpu"])
        assert snap.version > v0 and points == [(8, pytest.approx(0.09)), (16, pytest.approx(0.045))]
    finally:
        await ch.close()
        await running.stop(0)
        store.close()
    # a restart with the clock back where it started: the tombstone in the log still holds
    running, store, ch = await serve(tmp_path, Clock())
    try:
        await check_expired(estimator_pb2_grpc.EstimatorServiceStub(ch))
    finally:
        await ch.close()
        await running.stop(0)
        store.close()


async def test_daemon_process_expires_by_env_ttl_and_restarts(tmp_path, free_port):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), TESSERA_ESTIMATOR_KEY_TTL_S="0.5")
    argv = [sys.executable, "-m", "estimator", "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path)]

    async def started(ch) -> estimator_pb2_grpc.EstimatorServiceStub:
        await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), wait_for_ready=True, timeout=20)
        return estimator_pb2_grpc.EstimatorServiceStub(ch)

    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = await started(ch)
            await report(stub, run("profilerd/gone", 1, "job-gone", n=2))
            seq = 0

            async def gone():
                # keep another source reporting: appends are what sweep
                nonlocal seq
                seq += 1
                await report(stub, [profiler_pb2.Measurement(source="profilerd/live", seq=seq, kind="step",
                                                             job_id="job-live", step=seq, step_time_s=0.01)])
                try:
                    await stub.GetProfile(estimator_pb2.GetProfileRequest(job_id="job-gone"))
                    return False
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.NOT_FOUND
                    return True

            await eventually(gone, timeout=20, what="job-gone to expire", interval=0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=15)[1]
    assert proc.returncode == 0, err
    assert '"event": "keys expired"' in err and '"event": "estimator stopped"' in err
    stopped = next(line for line in err.splitlines() if '"event": "estimator stopped"' in line)
    assert '"job": ' in stopped.split('"expired"')[1]

    # restarted without the env (the 7-day default): job-gone stays expired, job-live answers
    env.pop("TESSERA_ESTIMATOR_KEY_TTL_S")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = await started(ch)
            await not_found(stub.GetProfile(estimator_pb2.GetProfileRequest(job_id="job-gone")))
            # its source's key expired, its watermark did not
            assert (await stub.GetWatermark(estimator_pb2.GetWatermarkRequest(source="profilerd/gone"))).seq == 2
            assert (await stub.GetProfile(estimator_pb2.GetProfileRequest(job_id="job-live"))).samples >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=15)[1]
    assert proc.returncode == 0, err

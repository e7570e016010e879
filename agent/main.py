"""``tessera-agent``: one per node. Registers the node's devices, heartbeats, runs
executors on request, reports their events, and self-fences (stops its executors)
when it has lost the controller for half the grace period (the controller requeues
the node's jobs after the whole grace period)."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tessera import config, log
from tessera.api.v1 import agent_pb2, agent_pb2_grpc, controller_pb2, controller_pb2_grpc, profiler_pb2, profiler_pb2_grpc
from tessera.errors import SpecError

from .api import AgentService, NodeState, partitions_proto, to_proto
from .config import AgentConfig
from .devices import discover
from .executors import Executor, ExecutorManager
from .partitions import MODES, Partitions

K = controller_pb2.ExecutorReport


def module_time(phases: dict) -> controller_pb2.ModuleTime:
    """A runtime's per-module phases ``{"forward"|"backward"|"communication"|"idle":
    seconds}`` (other keys ignored, missing ones 0) as the report's ``ModuleTime``."""
    return controller_pb2.ModuleTime(
        forward_s=float(phases.get("forward", 0.0)), backward_s=float(phases.get("backward", 0.0)),
        communication_s=float(phases.get("communication", 0.0)), idle_s=float(phases.get("idle", 0.0)))


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.log = log.get(component="agent", node_id=cfg.name)
        self.devices = discover(cfg.cpu_devices, use_nvml=not cfg.disable_nvml, units_per_core=cfg.cpu_units_per_core)
        self.node = NodeState(cfg.name, self.devices)
        # One partition backend per device (cpuset on CPUs; MIG, MPS or time slicing on GPUs);
        # ValueError when an explicit --partition-mode cannot apply to a device.
        self.parts = Partitions.for_devices(self.devices, mode=cfg.partition_mode, state_dir=cfg.state_dir,
                                            mig_allow_changes=False, timeslice_slots=cfg.timeslice_slots)
        self.mgr = ExecutorManager(Path(cfg.state_dir), self.devices, self._on_report, self._on_step, cfg.report_interval_s,
                                   parts=self.parts)
        self.channel = grpc.aio.insecure_channel(cfg.controller)
        self.nodes = controller_pb2_grpc.NodeServiceStub(self.channel)
        self.prof = None
        if cfg.profilerd:
            self.prof_channel = grpc.aio.insecure_channel(cfg.profilerd)
            self.prof = profiler_pb2_grpc.ProfilerServiceStub(self.prof_channel)
        self.reports: asyncio.Queue[K] = asyncio.Queue()
        self.grace_s = 10.0
        self.interval_s = 1.0
        self.registered = asyncio.Event()
        self.stale: set[str] = set()

    # -- reports ----------------------------------------------------------------------
    async def _on_report(self, ex: Executor, r: dict) -> None:
        kind = {"STARTED": K.STARTED, "PROGRESS": K.PROGRESS, "EXITED": K.EXITED, "TASK": K.TASK}[r["kind"]]
        msg = K(node=self.cfg.name, incarnation=self.node.incarnation, job_id=ex.job_id, allocation_id=ex.allocation_id,
                rank=ex.rank, kind=kind, step=r.get("step", 0), total_steps=r.get("total_steps", 0),
                loss=r.get("loss", 0.0), step_time_s=r.get("step_time_s", 0.0), exit_code=r.get("exit_code", 0),
                message=r.get("message", ""), task=r.get("task", ""), task_phase=r.get("task_phase", ""),
                tokens_per_s=r.get("tokens_per_s", 0.0))
        for name, ph in (r.get("modules") or {}).items():
            msg.modules[name].CopyFrom(module_time(ph))
        if r.get("busy") is not None:
            msg.busy = float(r["busy"])
        await self.reports.put(msg)

    async def _send_reports(self) -> None:
        """Deliver reports in order; retry each until the controller answers (start and
        exit must not be lost). A stale answer stops the allocation here."""
        backoff = 0.1
        while True:
            msg = await self.reports.get()
            while True:
                try:
                    resp = await self.nodes.ReportExecutor(msg, timeout=5)
                    backoff = 0.1
                    if resp.stale and msg.allocation_id not in self.stale:
                        self.stale.add(msg.allocation_id)
                        self.log.warning("allocation is stale; stopping it", allocation=msg.allocation_id, job_id=msg.job_id)
                        asyncio.create_task(self.mgr.stop(msg.allocation_id, self.cfg.stop_grace_s))
                    break
                except grpc.aio.AioRpcError as e:
                    if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                        self.log.warning("report refused", error=e.details(), job_id=msg.job_id)
                        break
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)

    async def _on_step(self, ex: Executor, ev: dict) -> None:
        if self.prof is None:
            return
        m = profiler_pb2.Measurement(
            node=self.cfg.name, kind="step", job_id=ex.job_id, model_key=ex.model_key,
            module=str(ev.get("module", "")), step=int(ev.get("step", 0)), step_time_s=float(ev.get("step_time_s", 0.0)),
            time=time.time(), device_id=",".join(ex.device_ids),
        )
        for k, v in (ev.get("phases") or {}).items():
            m.phases[k] = float(v)
        m.labels.update(ex.labels)  # the run's configuration: the estimator profiles from it
        m.labels["rank"] = str(ex.rank)
        try:
            await self.prof.ReportStep(m, timeout=1)
        except grpc.aio.AioRpcError:
            pass  # profiling is best effort; training goes on

    # -- registration and heartbeats --------------------------------------------------
    async def register(self) -> None:
        backoff = 0.2
        while True:
            try:
                resp = await self.nodes.RegisterNode(controller_pb2.RegisterNodeRequest(
                    name=self.cfg.name, agent_address=self.cfg.advertise or self.cfg.listen,
                    profilerd_address=self.cfg.profilerd, devices=[to_proto(d) for d in self.devices],
                    partitions=partitions_proto(self.parts)), timeout=5)
                self.node.incarnation = resp.incarnation
                self.grace_s, self.interval_s = resp.grace_s or 10.0, resp.heartbeat_interval_s or 1.0
                self.registered.set()
                self.log.info("registered", incarnation=resp.incarnation, devices=[d.id for d in self.devices],
                              partitions=[f"{p.id}:{p.kind}:{p.capacity_units}{p.unit}" for p in self.parts.describe()])
                return
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise SystemExit(f"controller refused registration: {e.details()}")
                self.log.info("waiting for controller", error=e.code().name)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def heartbeats(self) -> None:
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                resp = await self.nodes.Heartbeat(controller_pb2.HeartbeatRequest(
                    name=self.cfg.name, incarnation=self.node.incarnation,
                    running_allocations=self.mgr.running_allocations(), partitions=partitions_proto(self.parts)),
                    timeout=max(self.interval_s, 1.0))
                last_ok = time.monotonic()
                for a in resp.stop_allocations:
                    self.log.warning("controller says allocation is not current; stopping it", allocation=a)
                    asyncio.create_task(self.mgr.stop(a, self.cfg.stop_grace_s))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self.log.warning("incarnation rejected; stopping executors and registering again", error=e.details())
                    await self.mgr.stop_all(self.cfg.stop_grace_s)
                    await self.register()
                    last_ok = time.monotonic()
                elif time.monotonic() - last_ok > self.grace_s / 2 and self.mgr.running_allocations():
                    # The controller requeues our jobs once it has not heard from us for
                    # grace_s; stopping at half of that means a job never runs here and
                    # elsewhere at once, even if the controller's clock runs a bit fast.
                    self.log.warning("lost the controller for half the grace period; stopping executors",
                                     silent_s=round(time.monotonic() - last_ok, 1))
                    await self.mgr.stop_all(self.cfg.stop_grace_s)


    async def watch_faults(self) -> None:
        """Poll MPS server logs; a fatal fault fails every executor of that GPU (each
        reported EXITED with the fault as its message)."""
        if not any(b.kind == "mps" for b in self.parts.backends.values()):
            return
        while True:
            await asyncio.sleep(self.cfg.fault_poll_s)
            self.mgr.check_faults()


async def serve(cfg: AgentConfig, stop: asyncio.Event | None = None) -> None:
    try:
        agent = Agent(cfg)
    except ValueError as e:  # an explicit partition mode that cannot apply to a device
        raise SystemExit(f"--partition-mode: {e}") from None
    # Executors a crashed predecessor left running (own sessions): killed before this
    # incarnation registers, or the controller would relaunch their jobs beside them.
    await agent.mgr.kill_orphans()
    agent.parts.start()  # MPS daemons; stopped (idempotently) when the agent stops
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(AgentService(agent.node, agent.mgr, cfg.stop_grace_s), server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    svc = agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name
    reflection.enable_server_reflection([svc, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if server.add_insecure_port(cfg.listen) == 0:
        raise SystemExit(f"--listen: cannot bind {cfg.listen}")
    await server.start()
    sender = asyncio.create_task(agent._send_reports())
    await agent.register()
    for n in (svc, ""):
        await hs.set(n, health_pb2.HealthCheckResponse.SERVING)
    beats = asyncio.create_task(agent.heartbeats())
    faults = asyncio.create_task(agent.watch_faults())
    stop = stop or asyncio.Event()
    try:
        await stop.wait()
    finally:
        agent.log.info("agent stopping")
        agent.mgr.stopping = True  # LaunchExecutor: UNAVAILABLE from now on
        await hs.enter_graceful_shutdown()
        beats.cancel()
        faults.cancel()
        await agent.mgr.stop_all(cfg.stop_grace_s)
        agent.parts.stop()
        # Let the exit reports of the executors just stopped reach the controller.
        try:
            async with asyncio.timeout(3):
                while not agent.reports.empty():
                    await asyncio.sleep(0.05)
        except TimeoutError:
            pass
        sender.cancel()
        await server.stop(grace=2)
        await agent.channel.close()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = config.load(AgentConfig, argv, "TESSERA_AGENT_", __doc__)
        if cfg.cpu_devices < 1:
            raise SpecError("--cpu-devices", f"must be >= 1, got {cfg.cpu_devices}")
        if cfg.cpu_units_per_core < 1:
            raise SpecError("--cpu-units-per-core", f"must be >= 1, got {cfg.cpu_units_per_core}")
        if cfg.partition_mode not in MODES:
            raise SpecError("--partition-mode", f"must be one of {', '.join(MODES)}, got {cfg.partition_mode!r}")
        if cfg.timeslice_slots < 1:
            raise SpecError("--timeslice-slots", f"must be >= 1, got {cfg.timeslice_slots}")
    except SpecError as e:
        print(f"tessera-agent: {e}", file=sys.stderr)
        return 2
    log.setup("agent", node_id=cfg.name)

    async def run():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())

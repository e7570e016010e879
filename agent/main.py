"""``tessera-agent``: one per node. Registers the node's devices, heartbeats, runs
executors on request, reports their events, and self-fences (stops its executors)
when it has lost the controller for half the grace period (the controller requeues
the node's jobs after the whole grace period). Executors it stops on its own decision
(shutdown, self-fencing) are reported ``stopped_by_agent``: the controller requeues
their jobs as preemptions instead of failing them."""

from __future__ import annotations

import asyncio
import signal
import traceback
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

# Self-fencing must end before the controller's grace period does (it then requeues the
# node's jobs elsewhere): the fence's SIGTERM->SIGKILL delay is what is left of the grace
# period after this margin (for the SIGKILL, clock drift, the controller's own timing).
FENCE_MARGIN_S = 1.0
DRAIN_S = 3.0  # at shutdown, how long the exit reports of the stopped executors may take


class RegistrationRefused(Exception):
    """The controller refused this node's registration (INVALID_ARGUMENT)."""


def fence_grace(stop_grace_s: float, grace_s: float, silent_s: float) -> float:
    """The SIGTERM->SIGKILL delay of a self-fence after ``silent_s`` without the controller:
    ``stop_grace_s``, cut so that the executors are gone before the controller's grace
    period ``grace_s`` ends (less ``FENCE_MARGIN_S``), but at least 1 s."""
    return min(stop_grace_s, max(1.0, grace_s - silent_s - FENCE_MARGIN_S))


def heartbeat_timeout(grace_s: float) -> float:
    """One heartbeat RPC's deadline: a quarter of the grace period (at least 1 s), so that a
    slow controller round is not taken for silence, and a lost one still leaves time to fence."""
    return max(1.0, grace_s / 4)


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
        # Absolute once for all: executors (and MPS clients) run with other working dirs.
        state_dir = Path(cfg.state_dir).resolve()
        self.parts = Partitions.for_devices(self.devices, mode=cfg.partition_mode, state_dir=state_dir,
                                            mig_allow_changes=False, timeslice_slots=cfg.timeslice_slots)
        self.mgr = ExecutorManager(state_dir, self.devices, self._on_report, self._on_step, cfg.report_interval_s,
                                   parts=self.parts, stall_timeout_s=cfg.stall_timeout_s,
                                   zygote=cfg.executor_zygote)
        self.channel = grpc.aio.insecure_channel(cfg.controller)
        self.nodes = controller_pb2_grpc.NodeServiceStub(self.channel)
        self.prof = None
        self.steps_unreported = 0  # step measurements profilerd did not take (it was down, or refused)
        self._unreported_since: int | None = None  # steps_unreported when the current outage began
        if cfg.profilerd:
            self.prof_channel = grpc.aio.insecure_channel(cfg.profilerd)
            self.prof = profiler_pb2_grpc.ProfilerServiceStub(self.prof_channel)
        self.reports: asyncio.Queue[K] = asyncio.Queue()
        self.grace_s = 10.0
        self.interval_s = 1.0
        self.registered = asyncio.Event()
        self.stale: set[str] = set()
        self.failure = ""  # set when a background task died: the daemon stops, non-zero

    def supervise(self, task: asyncio.Task, name: str, stop: asyncio.Event) -> asyncio.Task:
        """Fail-stop: when ``task`` dies of an exception, log it and set ``stop`` (the daemon
        exits non-zero rather than run without heartbeats or reports)."""
        def done(t: asyncio.Task) -> None:
            if t.cancelled() or t.exception() is None:
                return
            e = t.exception()
            self.log.error("background task died; stopping the agent", task=name, error=repr(e),
                           traceback="".join(traceback.format_exception(e)))
            self.failure = self.failure or f"{name} died: {e!r}"
            stop.set()
        task.add_done_callback(done)
        return task

    # -- reports ----------------------------------------------------------------------
    async def _on_report(self, ex: Executor, r: dict) -> None:
        kind = {"STARTED": K.STARTED, "PROGRESS": K.PROGRESS, "EXITED": K.EXITED, "TASK": K.TASK}[r["kind"]]
        msg = K(node=self.cfg.name, incarnation=self.node.incarnation, job_id=ex.job_id, allocation_id=ex.allocation_id,
                rank=ex.rank, kind=kind, step=r.get("step", 0), total_steps=r.get("total_steps", 0),
                loss=r.get("loss", 0.0), step_time_s=r.get("step_time_s", 0.0),
                step_time_median_s=r.get("step_time_median_s", 0.0), exit_code=r.get("exit_code", 0),
                message=r.get("message", ""), task=r.get("task", ""), task_phase=r.get("task_phase", ""),
                tokens_per_s=r.get("tokens_per_s", 0.0))
        for name, ph in (r.get("modules") or {}).items():
            msg.modules[name].CopyFrom(module_time(ph))
        if r.get("busy") is not None:
            msg.busy = float(r["busy"])
        if r.get("stopped_by_agent"):
            msg.stopped_by_agent = True  # the agent's shutdown or self-fence: requeued, not failed
        await self.reports.put(msg)

    async def _send_reports(self) -> None:
        """Deliver reports in order; retry each until the controller answers (start and
        exit must not be lost). A stale answer stops the allocation here."""
        backoff = 0.1
        while True:
            msg = await self.reports.get()
            try:
                while True:
                    try:
                        resp = await self.nodes.ReportExecutor(msg, timeout=5)
                        backoff = 0.1
                        if resp.stale and msg.allocation_id not in self.stale:
                            self.stale.add(msg.allocation_id)
                            self.log.warning("allocation is stale; stopping it", allocation=msg.allocation_id,
                                             job_id=msg.job_id)
                            asyncio.create_task(self.mgr.stop(msg.allocation_id, self.cfg.stop_grace_s))
                        break
                    except grpc.aio.AioRpcError as e:
                        if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                            self.log.warning("report refused", error=e.details(), job_id=msg.job_id)
                            break
                    except Exception as e:  # a bug here must not end reporting: retried like a lost RPC
                        self.log.error("report failed", error=repr(e), job_id=msg.job_id,
                                       traceback=traceback.format_exc())
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
            finally:
                self.reports.task_done()  # acknowledged or dropped (or the sender cancelled): see serve's drain

    async def _on_step(self, ex: Executor, ev: dict) -> None:
        if self.prof is None or "step_time_s" not in ev:
            return  # no profiler, or a progress without a step (a resumed run with nothing left)
        m = profiler_pb2.Measurement(
            node=self.cfg.name, kind="step", job_id=ex.job_id, model_key=ex.model_key,
            module=str(ev.get("module", "")), step=int(ev.get("step", 0)), step_time_s=float(ev.get("step_time_s", 0.0)),
            time=time.time(), device_id=",".join(ex.device_ids),
        )
        for k, v in (ev.get("phases") or {}).items():
            m.phases[k] = float(v)
        m.labels.update(ex.labels)  # the run's configuration: the estimator profiles from it
        m.labels["rank"] = str(ex.rank)
        # Allocations on its partition at this step, its own included: a step measured
        # beside other jobs is no profile of the module alone (estimator.models.run_key).
        m.labels["colocated"] = str(self.mgr.sharing(ex))
        try:
            await self.prof.ReportStep(m, timeout=1)
        except grpc.aio.AioRpcError as e:
            # Best effort (training goes on; the controller re-profiles a model whose
            # profile never arrived), but never silent: counted, and logged once per outage.
            self.steps_unreported += 1
            if self._unreported_since is None:
                self._unreported_since = self.steps_unreported - 1
                self.log.warning("step measurements not reaching profilerd; training goes on without profiling",
                                 profilerd=self.cfg.profilerd, job_id=ex.job_id, code=e.code().name,
                                 error=e.details())
            return
        if self._unreported_since is not None:
            self.log.info("step measurements reach profilerd again", profilerd=self.cfg.profilerd,
                          lost=self.steps_unreported - self._unreported_since, lost_total=self.steps_unreported)
            self._unreported_since = None

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
                    raise RegistrationRefused(f"controller refused registration: {e.details()}") from None
                self.log.info("waiting for controller", error=e.code().name)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def heartbeats(self) -> None:
        """Heartbeat every interval; stop what the controller says is not current; re-register
        when the incarnation is rejected; self-fence after half the grace period without an
        answer. Any other error of a round (logged) counts as a failed heartbeat."""
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                resp = await self.nodes.Heartbeat(controller_pb2.HeartbeatRequest(
                    name=self.cfg.name, incarnation=self.node.incarnation,
                    running_allocations=self.mgr.running_allocations(), partitions=partitions_proto(self.parts)),
                    timeout=heartbeat_timeout(self.grace_s))
                last_ok = time.monotonic()
                for a in resp.stop_allocations:
                    self.log.warning("controller says allocation is not current; stopping it", allocation=a)
                    asyncio.create_task(self.mgr.stop(a, self.cfg.stop_grace_s))
                continue
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self.log.warning("incarnation rejected; stopping executors and registering again", error=e.details())
                    await self.mgr.stop_all(self.cfg.stop_grace_s, by_agent=True)
                    await self.register()  # RegistrationRefused: this task dies, the agent stops
                    last_ok = time.monotonic()
                    continue
            except Exception as e:
                self.log.error("heartbeat failed", error=repr(e), traceback=traceback.format_exc())
            await self._maybe_fence(last_ok)

    async def _maybe_fence(self, last_ok: float) -> None:
        silent = time.monotonic() - last_ok
        if silent > self.grace_s / 2 and self.mgr.running_allocations():
            # The controller requeues our jobs once it has not heard from us for grace_s;
            # stopping at half of that, and within what is left of it (fence_grace), means a
            # job never runs here and elsewhere at once, even if the controller's clock runs
            # a bit fast. Reported stopped_by_agent: requeued, not failed.
            grace = fence_grace(self.cfg.stop_grace_s, self.grace_s, silent)
            self.log.warning("lost the controller for half the grace period; stopping executors",
                             silent_s=round(silent, 1), stop_grace_s=round(grace, 1))
            try:
                await self.mgr.stop_all(grace, by_agent=True)
            except Exception as e:
                self.log.error("self-fence failed", error=repr(e), traceback=traceback.format_exc())

    async def watch_faults(self) -> None:
        """Poll MPS server logs; a fatal fault fails every executor of that GPU (each
        reported EXITED with the fault as its message)."""
        if not any(b.kind == "mps" for b in self.parts.backends.values()):
            return
        while True:
            await asyncio.sleep(self.cfg.fault_poll_s)
            try:
                self.mgr.check_faults()
            except Exception as e:
                self.log.error("fault check failed", error=repr(e), traceback=traceback.format_exc())

    async def watch_stalls(self) -> None:
        """Every few seconds (a tenth of the stall timeout, at most 5 s), ask for the
        stacks of, then kill, executors whose training stopped
        (``ExecutorManager.check_stalls``); nothing with ``stall_timeout_s`` 0."""
        if self.cfg.stall_timeout_s <= 0:
            return
        while True:
            await asyncio.sleep(min(5.0, self.cfg.stall_timeout_s / 10))
            try:
                self.mgr.check_stalls()
            except Exception as e:
                self.log.error("stall check failed", error=repr(e), traceback=traceback.format_exc())


async def serve(cfg: AgentConfig, stop: asyncio.Event | None = None) -> None:
    try:
        agent = Agent(cfg)
    except ValueError as e:  # an explicit partition mode that cannot apply to a device
        raise SystemExit(f"--partition-mode: {e}") from None
    # Executors a crashed predecessor left running (own sessions): killed before this
    # incarnation registers, or the controller would relaunch their jobs beside them.
    await agent.mgr.kill_orphans()
    stop = stop or asyncio.Event()
    agent.parts.start()  # MPS daemons; stopped (idempotently) when the agent stops
    server = None
    hs = health.aio.HealthServicer()
    tasks: list[asyncio.Task] = []
    refused = ""
    try:
        server = grpc.aio.server()
        agent_pb2_grpc.add_AgentServiceServicer_to_server(AgentService(agent.node, agent.mgr, cfg.stop_grace_s), server)
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        svc = agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name
        reflection.enable_server_reflection([svc, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        if server.add_insecure_port(cfg.listen) == 0:
            server = None
            raise SystemExit(f"--listen: cannot bind {cfg.listen}")
        await server.start()
        tasks.append(agent.supervise(asyncio.create_task(agent._send_reports()), "report sender", stop))
        # Registration retries until the controller answers; a stop (SIGTERM) ends it.
        reg = asyncio.create_task(agent.register())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({reg, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not reg.done():
            reg.cancel()
            agent.log.info("stopped before registering")
        else:
            try:
                reg.result()
            except RegistrationRefused as e:
                refused = str(e)
                stop.set()
        if not stop.is_set():
            for n in (svc, ""):
                await hs.set(n, health_pb2.HealthCheckResponse.SERVING)
            tasks.append(agent.supervise(asyncio.create_task(agent.heartbeats()), "heartbeats", stop))
            tasks.append(agent.supervise(asyncio.create_task(agent.watch_faults()), "fault watcher", stop))
            tasks.append(agent.supervise(asyncio.create_task(agent.watch_stalls()), "stall watcher", stop))
            await stop.wait()
    finally:
        agent.log.info("agent stopping")
        agent.mgr.stopping = True  # LaunchExecutor: UNAVAILABLE from now on
        await hs.enter_graceful_shutdown()
        for t in tasks[1:]:
            t.cancel()
        try:
            # The agent's decision: the exits are reported stopped_by_agent (requeued, not failed).
            await agent.mgr.stop_all(cfg.stop_grace_s, by_agent=True)
        finally:
            await agent.mgr.stop_zygote()
            agent.parts.stop()
            # Let the exit reports of the executors just stopped reach the controller: the
            # sender marks each report done once acknowledged (or refused), so join waits
            # for the one in flight too.
            if tasks and not tasks[0].done():
                try:
                    await asyncio.wait_for(agent.reports.join(), DRAIN_S)
                except TimeoutError:
                    agent.log.warning("exit reports not delivered before shutdown", pending=agent.reports.qsize())
            for t in tasks:
                t.cancel()
            if server is not None:
                await server.stop(grace=2)
            await agent.channel.close()
    if refused:
        raise SystemExit(refused)
    if agent.failure:
        raise SystemExit(f"tessera-agent: {agent.failure}")


def check_config(cfg: AgentConfig, sources: dict[str, str] | None = None) -> None:
    """SpecError for a setting out of range, named as ``sources`` says it was given
    (``config.load``'s; else the flag): cpu_devices, cpu_units_per_core and
    timeslice_slots >= 1, a known partition_mode, stop_grace_s >= 0 (0: SIGKILL at once),
    report_interval_s >= 0 (0: every progress event reported), fault_poll_s > 0,
    stall_timeout_s >= 0 (0: stalls not watched)."""
    def bad(name: str, why: str) -> SpecError:
        return SpecError((sources or {}).get(name, "--" + name.replace("_", "-")), why)

    for name in ("cpu_devices", "cpu_units_per_core", "timeslice_slots"):
        if getattr(cfg, name) < 1:
            raise bad(name, f"must be >= 1, got {getattr(cfg, name)}")
    if cfg.partition_mode not in MODES:
        raise bad("partition_mode", f"must be one of {', '.join(MODES)}, got {cfg.partition_mode!r}")
    for name in ("stop_grace_s", "report_interval_s", "stall_timeout_s"):
        if getattr(cfg, name) < 0:
            raise bad(name, f"must be >= 0, got {getattr(cfg, name)}")
    if cfg.fault_poll_s <= 0:
        raise bad("fault_poll_s", f"must be > 0, got {cfg.fault_poll_s}")


def main(argv: list[str] | None = None) -> int:
    """Run the agent; 2 (a message on stderr naming the setting as it was given: flag,
    environment variable or file key) for a configuration it refuses."""
    try:
        src: dict[str, str] = {}
        cfg = config.load(AgentConfig, argv, "TESSERA_AGENT_", __doc__, sources=src)
        check_config(cfg, src)
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

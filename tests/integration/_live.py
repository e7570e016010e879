"""Helpers of the integration tests that run a live cluster in-process (the fixtures that
use them are in conftest.py): a real etcd, a controller and agents on loopback gRPC, real
executor subprocesses.

- ``live_cluster(etcd, tmp, policy, prefix, ...)``: async context manager; a controller
  with ``policy`` and ``agents`` agents of ``cpu_devices`` CPU core-set partitions each,
  waited until every node is READY; yields a :class:`Live` that unpacks as
  ``jobs, nodes, agent`` (JobService and NodeService stubs, the first agent's
  ``AgentConfig``). Other agent options (``cpu_units_per_core``, ...) pass through. The
  ``live`` fixture (conftest.py) binds it to the test's etcd and tmp dir.
- ``watch_until(jobs, job_id, pred, timeout, seen)``: follow WatchJobs until ``pred(job)``.
- ``ended(job)``: the job is SUCCEEDED, FAILED or CANCELLED.
- ``eventually(fn, timeout, what)``: poll an (async or plain) condition until it returns
  a truthy value, which is returned; fails with ``what`` after ``timeout``.
- ``cpus(pid[, tid])`` / ``thread_cpus(pid)``: the CPU affinity /proc shows.
- ``running_executors(agent_stub)``: the agent's running executors by job id.
- ``etcd_client(addr)``: a connected ``aetcd.Client`` of ``host:port``;
  ``take_leadership(client, store)``: write ``store``'s leader key as this test's and
  give the store its fencing token (a controller built on it may then write).
- ``leading_controller(etcd, prefix, cfg, policy, clock, agents)``: a ``Controller`` on a
  fresh store under ``prefix`` that this test leads, elected; returns ``(ctl, store,
  client)`` (close the client at the end).
- ``serve_agent(servicer)``: a stand-in AgentService on a free loopback port; returns
  ``(server, "127.0.0.1:PORT")``.
- ``ProfilesLink``: the controller's estimator link as a stand-in: an empty model and
  the profiles in ``known``.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aetcd
import grpc

from agent.config import AgentConfig
from agent.main import serve as agent_serve
from controller import main as cmain
from controller.config import ControllerConfig
from controller.core import Controller
from controller.store import Store
from tessera.api.v1 import agent_pb2, agent_pb2_grpc
from tessera.api.v1 import controller_pb2 as cpb
from tessera.api.v1 import controller_pb2_grpc as cgrpc
from tessera.api.v1 import types_pb2 as tpb
from tessera.etcdproc import free_port


@dataclass
class Live:
    """What ``live_cluster`` yields; unpacks as ``jobs, nodes, agent`` (the first agent's
    config); ``agents`` holds every agent's config, ``controller`` the controller's."""

    jobs: cgrpc.JobServiceStub
    nodes: cgrpc.NodeServiceStub
    controller: ControllerConfig
    agents: list[AgentConfig] = field(default_factory=list)

    def __iter__(self):
        return iter((self.jobs, self.nodes, self.agents[0] if self.agents else None))


async def eventually(fn, timeout: float = 30.0, what: str = "condition", interval: float = 0.05):
    """Poll ``fn()`` (a plain or async callable) until it returns something truthy, and
    return that; AssertionError naming ``what`` after ``timeout`` seconds."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                v = fn()
                if inspect.isawaitable(v):
                    v = await v
                if v:
                    return v
                await asyncio.sleep(interval)
    except TimeoutError:
        raise AssertionError(f"{what}: not reached in {timeout}s") from None


async def wait_nodes_ready(nodes: cgrpc.NodeServiceStub, count: int, timeout: float = 60.0) -> None:
    """Until ``count`` nodes are READY (the controller may still be campaigning: UNAVAILABLE)."""

    async def ready():
        try:
            ls = await nodes.ListNodes(cpb.ListNodesRequest())
        except grpc.aio.AioRpcError:
            return False
        return len([n for n in ls.nodes if n.state == tpb.READY]) >= count

    await eventually(ready, timeout, f"{count} node(s) READY")


@asynccontextmanager
async def live_cluster(etcd: str, tmp, policy: str = "tessera", prefix: str = "/live", agents: int = 1,
                       cpu_devices: int = 1, estimator: str = "", grace_s: float = 5.0, stop_grace_s: float = 10.0,
                       ready_timeout: float = 60.0, **agent_options):
    """See the module docstring. State lives under ``tmp/<prefix>-ctl``, ``-ckpt``, ``-agentN``."""
    name = prefix.strip("/").replace("/", "-") or "live"
    cfg = ControllerConfig(listen=f"127.0.0.1:{free_port()}", etcd=etcd, prefix=prefix, grace_s=grace_s,
                           heartbeat_interval_s=0.3, reconcile_interval_s=0.3, policy=policy, estimator=estimator,
                           state_dir=str(tmp / f"{name}-ctl"), checkpoint_root=str(tmp / f"{name}-ckpt"))
    cstop, ready = asyncio.Event(), asyncio.Event()
    ctask = asyncio.create_task(cmain.serve(cfg, ready=ready, stop=cstop))
    stops, tasks, acfgs = [], [], []
    ch = None
    try:
        await asyncio.wait_for(ready.wait(), 20)
        for i in range(1, agents + 1):
            acfg = AgentConfig(name=f"node-{i}", listen=f"127.0.0.1:{free_port()}", controller=cfg.listen,
                               cpu_devices=cpu_devices, state_dir=str(tmp / f"{name}-agent{i}"),
                               stop_grace_s=stop_grace_s, report_interval_s=0.2, **agent_options)
            acfgs.append(acfg)
            stops.append(asyncio.Event())
            tasks.append(asyncio.create_task(agent_serve(acfg, stops[-1])))
        ch = grpc.aio.insecure_channel(cfg.listen)
        live = Live(cgrpc.JobServiceStub(ch), cgrpc.NodeServiceStub(ch), cfg, acfgs)
        await wait_nodes_ready(live.nodes, agents, ready_timeout)
        yield live
    finally:
        for s in stops:
            s.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        if ch is not None:
            await ch.close()
        cstop.set()
        await asyncio.wait_for(ctask, 30)


def ended(j: tpb.Job) -> bool:
    return j.status.phase in (tpb.SUCCEEDED, tpb.FAILED, tpb.CANCELLED)


async def watch_until(jobs: cgrpc.JobServiceStub, job_id: str, pred, timeout: float = 120.0,
                      seen: list | None = None) -> tpb.Job:
    """Follow ``WatchJobs`` for ``job_id`` until ``pred(job)``; every event's job is
    appended to ``seen`` when given. TimeoutError after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        async for ev in jobs.WatchJobs(cpb.WatchJobsRequest(job_id=job_id)):
            if seen is not None:
                seen.append(ev.job)
            if pred(ev.job):
                return ev.job
    raise AssertionError("watch ended")


def cpus(pid: int, tid: int | None = None) -> set[int]:
    """The CPU affinity of a process (or one of its threads) as /proc shows it."""
    path = f"/proc/{pid}/status" if tid is None else f"/proc/{pid}/task/{tid}/status"
    with open(path) as f:
        text = next(line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list:"))
    out: set[int] = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out


def thread_cpus(pid: int) -> list[set[int]]:
    """The affinity of every thread of ``pid`` (threads that end meanwhile are skipped)."""
    out = []
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            out.append(cpus(pid, int(t)))
        except FileNotFoundError:
            pass
    return out


async def running_executors(stub) -> dict[str, agent_pb2.ExecutorStatus]:
    st = await stub.GetStatus(agent_pb2.GetStatusRequest())
    return {e.job_id: e for e in st.executors if e.running}


async def etcd_client(addr: str) -> aetcd.Client:
    """A connected etcd client of ``host:port`` (close it with ``await client.close()``)."""
    host, port = addr.rsplit(":", 1)
    c = aetcd.Client(host=host, port=int(port))
    await c.connect()
    return c


async def take_leadership(c: aetcd.Client, store: Store) -> None:
    """Make this test the leader of ``store``'s prefix: its leader key, value ``me``, and the
    key's create revision as the store's fencing token."""
    await c.put(store.leader_key(), b"me")
    store.fencing_token = (await c.get(store.leader_key())).create_revision


async def leading_controller(etcd: str, prefix: str, cfg: ControllerConfig, policy, clock=None,
                             agents=None) -> tuple[Controller, Store, aetcd.Client]:
    """A ``Controller`` with ``cfg`` and ``policy`` (and ``clock`` / stand-in ``agents``
    when given) on a fresh store under ``prefix`` that this test leads, elected."""
    c = await etcd_client(etcd)
    store = Store(c, prefix)
    await take_leadership(c, store)
    ctl = Controller(store, cfg, policy, clock=clock or time.time)
    if agents is not None:
        ctl.agents = agents
    await ctl.on_elected()
    return ctl, store, c


async def serve_agent(servicer) -> tuple[grpc.aio.Server, str]:
    """``servicer`` (an AgentService stand-in) served on a free loopback port, started."""
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


class ProfilesLink:
    """The controller's estimator link (``controller.profiling.EstimatorLink``) as a
    stand-in: an empty model (version 0) and the profiles in ``known`` for any module."""

    def __init__(self) -> None:
        from tessera.perfmodel import PerfModel

        self.model = PerfModel(version=0)
        self.known: list = []

    async def snapshot(self):
        return self.model

    async def profiles(self, module):
        return list(self.known)

    async def close(self) -> None:
        pass


async def stand_in_profiling(ctl, clock, **settings):
    """``controller.profiling.Profiling`` over ``ctl`` with ``clock`` and ``settings``
    (grace_s, attempts, retry_s, ...), its estimator link a ``ProfilesLink`` (knowing no
    profile until a test gives it some; the loop's own link, never dialled, closed)."""
    from controller.profiling import Profiling

    prof = Profiling(ctl, "127.0.0.1:1", clock=clock, **settings)
    await prof.link.close()
    prof.link = ProfilesLink()
    return prof

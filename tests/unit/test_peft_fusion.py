"""LoRA fusion in the live controller, pure parts (controller/fusion.py, the adapter's view of
fused jobs, the policy's decision on the live request), the agent's "add" command check, and
the peft runner's fused adds (own task directory, other allocations' adds skipped)."""

from __future__ import annotations

import io
import json
import os

import pytest

from agent.api import add_command
from controller import adapter, fusion
from controller.policy import TesseraPolicy
from tessera import manifest
from tessera.api.v1 import agent_pb2
from tessera.api.v1 import types_pb2 as tpb

P = tpb.JobPhase
MODEL = {"vocab": 64, "seq_len": 32, "layers": 1, "hidden": 32, "heads": 4}


def peft_job(jid: str, phase=P.PENDING, seed: int = 0, tasks=("a", "b"), created: float = 0.0, model=None,
             chunk: int | None = None, share: float = 0.5) -> tpb.Job:
    peft = {"mode": "spatial", "tasks": [{"name": t, "rank": 4} for t in tasks]}
    if chunk:
        peft["chunk_size"] = chunk
    doc = manifest.validate({"apiVersion": "tessera/v1", "name": jid.replace("j-", "p"), "tenant": "t",
                             "workload": {"type": "peft", "model": model or MODEL, "steps": 5, "batch_size": 3,
                                          "learning_rate": 0.01, "seed": seed, "peft": peft},
                             "resources": {"devices": 1, "device_kind": "cpu", "share": share}})
    j = tpb.Job(id=jid, spec=manifest.to_proto(doc), created=created)
    j.status.phase = phase
    return j


def running_on(j: tpb.Job, alloc: str = "a-host", node: str = "n1", part: str = "cpu0", units: int = 1) -> tpb.Job:
    j.status.phase = P.RUNNING
    j.status.allocation_id = alloc
    j.status.placement.add(node=node, device_ids=[part], partition_ids=[part], units=units)
    return j


H, G = "j-000000000001", "j-000000000002"


def test_backbone_is_model_and_seed_of_peft_jobs_only():
    a, b = peft_job(H), peft_job(G, tasks=("x",))
    assert fusion.backbone_of(a) == fusion.backbone_of(b) != ""
    assert fusion.backbone_of(peft_job(G, seed=1)) != fusion.backbone_of(a)
    assert fusion.backbone_of(peft_job(G, model={**MODEL, "hidden": 64})) != fusion.backbone_of(a)
    g = tpb.Job(id="j-x")
    g.spec.workload.type = "gpt"
    assert fusion.backbone_of(g) == ""


def test_fused_names_round_trip_and_plain_names_are_not_fused():
    assert fusion.split_fused(fusion.fused_name(G, "t-1_x")) == (G, "t-1_x")
    for plain in ("t0", "j-0001_t0", "j-000000000001", "j-00000000000g_t0", "j-000000000001_"):
        assert fusion.split_fused(plain) is None


def test_which_jobs_fuse():
    host, guest = running_on(peft_job(H)), peft_job(G)
    assert fusion.fusion_problem(host, guest) == ""
    assert "backbones differ" in fusion.fusion_problem(host, peft_job(G, seed=3))
    assert "chunk sizes differ" in fusion.fusion_problem(host, peft_job(G, chunk=16))
    assert "not running" in fusion.fusion_problem(peft_job(H, phase=P.SCHEDULED), guest)
    inner = running_on(peft_job(H))
    inner.status.fused_into = "j-000000000009"
    assert "itself fused" in fusion.fusion_problem(inner, guest)
    assert "too long" in fusion.fusion_problem(host, peft_job(G, tasks=("x" * 60,)))
    g = tpb.Job(id=G)
    g.spec.workload.type = "gpt"
    assert fusion.fusion_problem(host, g) == "only peft jobs fuse"


def test_a_profiling_job_neither_hosts_nor_joins_a_fusion():
    """Its steps are the measurement of its own step shape (controller/profiling.py)."""
    from controller.records import PROFILE_PREFIX, PROFILE_TENANT

    host, guest = running_on(peft_job(H)), peft_job(G)
    for j in (host, guest):
        prof = tpb.Job()
        prof.CopyFrom(j)
        prof.spec.tenant, prof.spec.name = PROFILE_TENANT, PROFILE_PREFIX + "0123456789ab"
        pair = (prof, guest) if j is host else (host, prof)
        assert fusion.fusion_problem(*pair) == f"profiling job {prof.id} runs alone"
    assert fusion.fusion_problem(host, guest) == ""


def test_an_executor_carries_at_most_max_tasks_unfinished_tasks_fused_ones_included():
    from tessera.spec.peft import MAX_TASKS

    host = running_on(peft_job(H, tasks=tuple(f"h{i}" for i in range(100))))
    g1 = running_on(peft_job("j-00000000000d", tasks=tuple(f"g{i}" for i in range(100))))
    g1.status.fused_into = H
    jobs = [host, g1]
    assert fusion.executor_load(host, jobs) == 200
    big = peft_job(G, tasks=tuple(f"n{i}" for i in range(MAX_TASKS - 199)))
    why = fusion.fusion_problem(host, big, fusion.executor_load(host, jobs))
    assert "200 unfinished tasks" in why and f"exceed {MAX_TASKS}" in why
    h, why = fusion.pick_host(big, "n1", "cpu0", jobs)
    assert h is None  # (the last candidate's reason is reported: the guest g1 is itself fused)
    fits = peft_job(G, tasks=tuple(f"n{i}" for i in range(MAX_TASKS - 200)))
    assert fusion.pick_host(fits, "n1", "cpu0", jobs)[0] is host
    # ended tasks no longer count: the guest's first 50 finished, the host's first 10 were cancelled
    for i in range(50):
        g1.status.tasks.add(name=f"g{i}", phase=P.SUCCEEDED)
    for i in range(10):
        host.status.tasks.add(name=f"h{i}", phase=P.CANCELLED)
    assert fusion.executor_load(host, jobs) == 140
    assert fusion.pick_host(big, "n1", "cpu0", jobs)[0] is host
    # a guest that ended (or moved on) no longer loads the executor
    g1.status.phase = P.SUCCEEDED
    assert fusion.executor_load(host, jobs) == 90


def test_pick_host_takes_the_oldest_running_peft_job_on_the_partition():
    old = running_on(peft_job("j-00000000000a", created=1.0), alloc="a-old")
    new = running_on(peft_job("j-00000000000b", created=2.0), alloc="a-new")
    other = running_on(peft_job("j-00000000000c", created=0.0), part="cpu1")
    h, why = fusion.pick_host(peft_job(G, created=3.0), "n1", "cpu0", [new, other, old])
    assert h is old and why == ""
    h, why = fusion.pick_host(peft_job(G, seed=7), "n1", "cpu0", [new, old])
    assert h is None and "backbones differ" in why
    assert fusion.pick_host(peft_job(G), "n1", "cpu9", [new, old])[0] is None


def test_a_guest_waits_for_a_starting_host_of_its_backbone():
    g = peft_job(G, created=2.0)
    fresh = peft_job(H, created=1.0)  # PENDING in the snapshot, placed earlier this round
    assert fusion.starting_host(g, "n1", "cpu0", [fresh, g], {H: ("n1", "cpu0")}) == H
    assert fusion.starting_host(g, "n1", "cpu0", [fresh, g], {H: ("n1", "cpu1")}) == ""
    sched = running_on(peft_job(H, created=1.0))
    sched.status.phase = P.SCHEDULED
    assert fusion.starting_host(g, "n1", "cpu0", [sched, g], {}) == H
    assert fusion.starting_host(peft_job(G, seed=2), "n1", "cpu0", [sched], {}) == ""
    sched.status.phase = P.RUNNING  # started: fuse now (pick_host), no waiting
    assert fusion.starting_host(g, "n1", "cpu0", [sched, g], {}) == ""


def test_guest_tasks_are_resolved_with_the_guests_own_defaults_and_directories():
    adds = fusion.guest_tasks(peft_job(G, seed=5, tasks=("a", "b")), "/ck/" + G)
    assert [a[0] for a in adds] == [f"{G}_a", f"{G}_b"]
    for i, (name, spec, tdir) in enumerate(adds):
        assert spec["name"] == name and tdir == f"/ck/{G}/peft/{'ab'[i]}"
        assert (spec["steps"], spec["batch_size"], spec["learning_rate"]) == (5, 3, 0.01)
        # the dataset the guest's own executor would draw: seed + index, max_len = chunk
        assert spec["dataset"]["seed"] == 5 + i and spec["dataset"]["max_len"] == MODEL["seq_len"]


def test_guest_outcome_and_progress_follow_its_tasks():
    g = running_on(peft_job(G))
    g.status.fused_into = H
    assert fusion.guest_outcome(g) is None
    g.status.tasks.add(name="a", phase=P.SUCCEEDED, step=5, total_steps=5, loss=1.0, first_loss=4.0)
    g.status.tasks.add(name="b", phase=P.RUNNING, step=2, total_steps=5, loss=3.0, first_loss=4.2)
    fusion.fold_progress(g)
    assert (g.status.step, g.status.total_steps, g.status.loss) == (2, 5, 2.0)
    assert fusion.guest_outcome(g) is None
    g.status.tasks[1].phase = P.CANCELLED
    ph, why = fusion.guest_outcome(g)
    assert ph == P.SUCCEEDED and "1 succeeded, 0 failed, 1 cancelled" in why and H in why
    # A task that failed (non-finite loss) is counted as failed; with none succeeded the
    # guest fails, as its own executor would have (exit 1).
    g.status.tasks[1].phase = P.FAILED
    ph, why = fusion.guest_outcome(g)
    assert ph == P.SUCCEEDED and "1 succeeded, 1 failed, 0 cancelled" in why
    g.status.tasks[0].phase = P.CANCELLED
    ph, why = fusion.guest_outcome(g)
    assert ph == P.FAILED and "0 succeeded, 1 failed, 1 cancelled" in why


def test_host_stays_running_serving_guests_once_its_own_tasks_ended():
    h = running_on(peft_job(H))
    g = running_on(peft_job(G))
    g.status.fused_into = H
    h.status.tasks.add(name="a", phase=P.SUCCEEDED)
    assert fusion.host_reason(h, [g]) == ""  # b has not ended
    h.status.tasks.add(name="b", phase=P.CANCELLED)
    assert G in fusion.host_reason(h, [g]) and "keeps running" in fusion.host_reason(h, [g])
    assert fusion.host_reason(h, []) == ""
    assert fusion.guests_of(H, [h, g]) == [g]


def test_orphans_are_guests_whose_host_executor_is_gone():
    h = running_on(peft_job(H))
    g = running_on(peft_job(G))
    g.status.fused_into, g.status.allocation_id = H, "a-host"
    assert fusion.orphans([h, g], now=10.0, grace_s=30.0) == []
    h.status.allocation_id = "a-moved"
    assert "another executor" in fusion.orphans([h, g], 10.0, 30.0)[0][1]
    h.status.allocation_id = "a-host"
    h.status.phase = P.CANCELLED
    h.status.reason = "cancelled by its tenant"
    assert "ended CANCELLED" in fusion.orphans([h, g], 10.0, 30.0)[0][1]
    assert "is gone" in fusion.orphans([g], 10.0, 30.0)[0][1]
    h.status.phase = P.RUNNING
    g.status.phase = P.SCHEDULED
    g.status.history.add(phase=P.SCHEDULED, time=1.0)
    assert fusion.orphans([h, g], 20.0, 30.0) == []
    assert "did not report" in fusion.orphans([h, g], 40.0, 30.0)[0][1]
    g.status.phase = P.SUCCEEDED  # ended guests stay as they are
    assert fusion.orphans([g], 40.0, 30.0) == []


def node2() -> tpb.Node:
    n = tpb.Node(name="n1", state=tpb.READY)
    n.devices.add(id="cpu0", kind="cpu", model="Xeon", capacity=2)
    n.partitions.add(id="cpu0", kind="cpuset", device_id="cpu0", capacity_units=2, unit="cores")
    return n


def test_policy_on_the_live_request_fuses_a_pending_job_with_the_running_one():
    h = running_on(peft_job(H, created=0.0))
    g = peft_job(G, created=1.0)
    req = adapter.build_request([node2()], [h, g], now=100.0)
    assert req.pending[0].backbone == req.running[0].job.backbone == fusion.backbone_of(h)
    reply = TesseraPolicy().schedule(req)
    [p] = [p for p in reply.placements if p.job_id == G]
    assert fusion.is_fused_placement(p.reason) and p.shards[0].device_ids == ("cpu0",)
    # Another backbone is packed, not fused.
    other = peft_job(G, seed=9, created=1.0)
    [p] = [p for p in TesseraPolicy().schedule(adapter.build_request([node2()], [h, other], 100.0)).placements
           if p.job_id == G]
    assert not fusion.is_fused_placement(p.reason)


def test_a_fused_guest_is_not_shown_to_the_policy_as_running():
    h = running_on(peft_job(H))
    g = running_on(peft_job(G), alloc="a-host")
    g.status.fused_into = H
    req = adapter.build_request([node2()], [h, g], now=5.0)
    assert [r.job.job_id for r in req.running] == [H] and req.groups == ()


@pytest.mark.parametrize("kw,field", [
    ({"task_json": "{"}, "task_json"),
    ({"task_json": "[1]"}, "task_json"),
    ({"task_json": '{"name": "other"}'}, "task_json.name"),
    ({"task_json": '{"name": "t"}', "task_dir": "rel/dir"}, "task_dir"),
])
def test_agent_add_command_names_the_bad_field(kw, field):
    why, _ = add_command(agent_pb2.ControlTaskRequest(allocation_id="a-1", op="add", task="t", **kw))
    assert why.startswith(field + ":"), why


def test_agent_add_command():
    why, cmd = add_command(agent_pb2.ControlTaskRequest(allocation_id="a-1", op="add", task="t",
                                                        task_json='{"name": "t", "steps": 2}', task_dir="/x/peft/t"))
    assert why == "" and cmd == {"op": "add", "task": {"name": "t", "steps": 2}, "allocation": "a-1", "dir": "/x/peft/t"}


def test_runner_fused_add_checkpoints_in_the_guests_dir_and_skips_other_allocations(tmp_path):
    from agent.runtime.peft.workload import PeftRunner, parse
    from agent.runtime.report import Reporter, parse_line

    wl = {"type": "peft", "model": MODEL, "steps": 3, "batch_size": 2, "learning_rate": 0.01, "seed": 0,
          "checkpoint_every": 1, "peft": {"mode": "spatial", "chunk_size": 32, "tasks": [{"name": "a", "steps": 3}]}}
    cfg, sec, p = parse(wl)
    buf = io.StringIO()
    host_dir, guest_dir = tmp_path / "host", tmp_path / "guest" / "peft" / "x"
    r = PeftRunner(cfg, sec, p, Reporter(buf), str(host_dir), allocation_id="a-1")
    r.add_task(sec["tasks"][0])
    host_dir.mkdir()
    with open(r.control_file, "a") as f:
        f.write(json.dumps({"op": "add", "task": {"name": f"{G}_x", "steps": 2}, "dir": str(guest_dir),
                            "allocation": "a-1"}) + "\n")
        f.write(json.dumps({"op": "add", "task": {"name": f"{G}_y", "steps": 2}, "allocation": "a-old"}) + "\n")
        f.write(json.dumps({"op": "add", "task": {"name": "z", "steps": 2}, "dir": "rel"}) + "\n")
    while r.step():
        pass
    assert set(r.engine.tasks) == {"a", f"{G}_x"}
    assert os.path.exists(guest_dir / "adapter.pt") and os.path.exists(guest_dir / "state.pt")
    assert not os.path.exists(host_dir / "peft" / f"{G}_x")
    errs = [e for e in (parse_line(x) for x in buf.getvalue().splitlines()) if e and e["event"] == "error"]
    assert [e["field"] for e in errs] == ["control[2].dir"]


def test_a_job_fuses_into_a_long_running_group_instead_of_preempting_it():
    h = running_on(peft_job(H, created=0.0))
    h.status.total_steps = 1_000_000  # far more remaining work than the pending job
    reply = TesseraPolicy().schedule(adapter.build_request([node2()], [h, peft_job(G, created=1.0)], now=1000.0))
    assert reply.preemptions == ()
    [p] = reply.placements
    assert p.job_id == G and fusion.is_fused_placement(p.reason)
    # Another backbone with little work left does preempt the long group (SRPT, as before).
    reply = TesseraPolicy().schedule(adapter.build_request([node2()], [h, peft_job(G, seed=4, created=1.0)], 1000.0))
    assert [x.job_id for x in reply.preemptions] == [H]


def test_a_stored_guest_whose_rank_exceeds_the_hidden_size_does_not_fuse():
    # A record stored before submission checked the rank against the model: the executor would
    # refuse the add, so fusion refuses it first (the job then gets its own executor, which
    # fails it with the same field).
    host, guest = running_on(peft_job(H)), peft_job(G)
    guest.spec.workload.peft["tasks"][0]["rank"] = MODEL["hidden"] + 1
    why = fusion.fusion_problem(host, guest)
    assert why.startswith("peft section:") and "workload.peft.tasks[0].rank" in why
    guest.spec.workload.peft["tasks"][0]["rank"] = MODEL["hidden"]
    assert fusion.fusion_problem(host, guest) == ""


def test_tasks_fused_earlier_in_the_round_count_toward_the_cap():
    from tessera.spec.peft import MAX_TASKS

    host = running_on(peft_job(H, tasks=tuple(f"h{i}" for i in range(100))))
    guest = peft_job(G, tasks=tuple(f"g{i}" for i in range(100)))
    assert fusion.pick_host(guest, "n1", "cpu0", [host, guest])[0] is host
    # 100 tasks of another guest fused into it this round (not in the round's snapshot).
    h, why = fusion.pick_host(guest, "n1", "cpu0", [host, guest], {H: 100})
    assert h is None and "200 unfinished tasks" in why and f"exceed {MAX_TASKS}" in why
    assert fusion.pick_host(guest, "n1", "cpu0", [host, guest], {H: MAX_TASKS - 200})[0] is host
    assert fusion.pick_host(guest, "n1", "cpu0", [host, guest], {"j-0000000000ff": 200})[0] is host


def test_split_fused_refuses_a_trailing_newline():
    assert fusion.split_fused(f"{G}_t0") == (G, "t0")
    assert fusion.split_fused(f"{G}_t0\n") is None

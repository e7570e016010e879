"""A profiling job that SUCCEEDED but whose profile never reached the estimator (its
node's profilerd down or not streaming) must not leave the jobs waiting on it saying
``profiling`` for ever: after ``profile_grace_s`` the profiling loop marks them
``insufficient_data`` naming the profiling job and its node, once; before the grace they
still say ``profiling``; a profile arriving later still gives the estimate. A real etcd
and controller store; the estimator link is a stand-in (``_live.ProfilesLink``) that knows
the profiles the test gives it, and the loop's clock is injected: nothing sleeps."""

from __future__ import annotations

import pytest

from _live import leading_controller, stand_in_profiling
from controller.config import ControllerConfig
from controller.policy import FirstFit
from controller.profiling import module_of, profile_doc
from controller.store import Store
from tessera import manifest
from tessera.api.v1 import estimator_pb2
from tessera.api.v1 import types_pb2 as tpb
from tessera.errors import SpecError

P = tpb.JobPhase
T0 = 1000.0
GRACE = 60.0
DOC = {"apiVersion": "tessera/v1", "name": "g1", "tenant": "t",
       "workload": {"type": "gpt", "steps": 5, "model": {"layers": 1, "hidden": 16, "heads": 2, "seq_len": 8}},
       # No gpu anywhere: the job stays pending, nothing is launched.
       "resources": {"devices": 1, "device_kind": "gpu"}}


@pytest.fixture
async def setup(etcd_server, request):
    now = [T0]
    ctl, store, c = await leading_controller(etcd_server, f"/grace-{request.node.name[:40]}",
                                             ControllerConfig(grace_s=3.0), FirstFit(), clock=lambda: now[0])
    # One attempt: what the jobs say once no profiling job is left to try
    # (test_controller_profile_retry.py: the attempts before it).
    prof = await stand_in_profiling(ctl, lambda: now[0], grace_s=GRACE, attempts=1)
    yield store, prof, now
    await c.close()


async def _pair(store: Store, user_phase: int = P.PENDING) -> tuple[tpb.Job, tpb.Job]:
    """A profiling job of ``DOC`` (stored under its idempotency key) that ran on node n1 and
    SUCCEEDED at ``T0``, and the user job of ``DOC`` (in ``user_phase``) waiting on it."""
    doc = manifest.validate(DOC)
    pdoc, idem = profile_doc(doc, 8)
    pj = tpb.Job(id="j-000000000801", spec=manifest.to_proto(manifest.validate(pdoc)), created=T0 - 20,
                 idempotency_key=idem)
    pj.status.placement.add(node="n1", device_ids=["gpu0"], partition_ids=["gpu0"], first_rank=0)
    pj.status.history.add(phase=P.SUCCEEDED, time=T0)
    pj.status.phase = P.SUCCEEDED
    await store.create_job(pj, idem)
    u = tpb.Job(id="j-000000000802", spec=manifest.to_proto(doc), created=T0 - 20)
    u.status.history.add(phase=user_phase, time=T0 - 20)
    u.status.phase = user_phase
    u.status.estimate.CopyFrom(tpb.JobEstimate(status="profiling", profile_job_id=pj.id, time=T0 - 10,
                                               reason="no profile yet"))
    await store.create_job(u, "")
    return pj, u


async def _estimate(store: Store, job_id: str) -> tpb.JobEstimate:
    return (await store.get_job(job_id)).value.status.estimate


@pytest.mark.parametrize("user_phase", [P.PENDING, P.CANCELLED])
async def test_a_succeeded_profiling_job_without_a_profile_ends_profiling_after_the_grace(setup, user_phase):
    store, prof, now = setup
    pj, u = await _pair(store, user_phase)
    now[0] = T0 + GRACE - 1  # within the grace: the profile may still be on its way
    assert (await prof.once())["requested"] == 0
    assert (await _estimate(store, u.id)).status == "profiling"
    now[0] = T0 + GRACE + 5
    assert await prof.once() == {"requested": 0, "estimated": 1}
    est = await _estimate(store, u.id)
    assert est.status == "insufficient_data" and est.profile_job_id == pj.id, est
    assert "succeeded at 1970-01-01T00:16:40Z" in est.reason and "within 60 s" in est.reason, est.reason
    assert f"no profile of {module_of(manifest.validate(DOC))} reached" in est.reason, est.reason
    assert "node n1" in est.reason and "profilerd" in est.reason, est.reason
    now[0] += 100
    assert await prof.once() == {"requested": 0, "estimated": 0}  # said once, no new profiling job
    assert len((await store.list_jobs())[0]) == 2


async def test_a_profile_arriving_after_the_grace_still_gives_the_estimate(setup):
    store, prof, now = setup
    pj, u = await _pair(store)
    now[0] = T0 + GRACE + 1
    await prof.once()
    assert (await _estimate(store, u.id)).status == "insufficient_data"
    # The profile arrives late (profilerd's buffer drained after an outage).
    pdoc, _ = profile_doc(manifest.validate(DOC), 8)
    prof.link.known = [estimator_pb2.ProfileEntry(device_type="gpu", rows=pdoc["workload"]["batch_size"],
                                                  micro_batches=1, quota=1.0)]
    assert (await prof.once())["estimated"] == 1
    est = await _estimate(store, u.id)
    # The model has no fitted curve for gpu yet: the estimate says so, no longer naming a lost profile.
    assert "no profile of" not in est.reason and "succeeded" not in est.reason, est.reason


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "60"])
def test_profile_grace_must_be_a_positive_finite_number(bad):
    with pytest.raises(SpecError) as e:
        ControllerConfig(profile_grace_s=bad)
    assert e.value.field == "profile_grace_s"

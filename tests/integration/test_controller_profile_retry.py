"""A profiling job that FAILED, or SUCCEEDED without its profile reaching the estimator, is
submitted again — up to ``attempts`` jobs, each after a doubling wait (a lost profile: after
the grace) — instead of leaving its model unprofiled for good; a CANCELLED one is not
retried; a PENDING one says why it waits; an input-bound job's wait for its input is not
copied into its profiling job. A real etcd and controller store; the estimator link is a
stand-in (``_live.ProfilesLink``, knowing no profile) and the loop's clock is injected:
nothing sleeps."""

from __future__ import annotations

import pytest

from _live import leading_controller, stand_in_profiling
from controller.config import ControllerConfig
from controller.policy import FirstFit
from controller.profiling import attempt_key, is_profile_job, profile_doc
from controller.store import Store
from tessera import manifest
from tessera.api.v1 import types_pb2 as tpb
from tessera.errors import SpecError

P = tpb.JobPhase
T0 = 1000.0
RETRY = 10.0
DOC = {"apiVersion": "tessera/v1", "name": "r1", "tenant": "t",
       "workload": {"type": "gpt", "steps": 5, "model": {"layers": 1, "hidden": 16, "heads": 2, "seq_len": 8}},
       # No gpu anywhere: nothing is launched; the test moves the profiling jobs' phases itself.
       "resources": {"devices": 1, "device_kind": "gpu"}}


@pytest.fixture
async def setup(etcd_server, request):
    now = [T0]
    ctl, store, c = await leading_controller(etcd_server, f"/retry-{request.node.name[:40]}",
                                             ControllerConfig(grace_s=3.0), FirstFit(), clock=lambda: now[0])
    prof = await stand_in_profiling(ctl, lambda: now[0], attempts=3, retry_s=RETRY)
    yield ctl, store, prof, now
    await c.close()


async def _user_job(store: Store) -> tpb.Job:
    u = tpb.Job(id="j-000000000901", spec=manifest.to_proto(manifest.validate(DOC)), created=T0 - 20)
    u.status.history.add(phase=P.PENDING, time=T0 - 20)
    u.status.phase = P.PENDING
    await store.create_job(u, "")
    return u


async def _profile_jobs(store: Store) -> dict[str, tpb.Job]:
    return {j.idempotency_key: j for j in (await store.list_jobs())[0] if is_profile_job(j)}


async def _end(ctl, job_id: str, phase: int, at: float, reason: str = "") -> None:
    """Move a profiling job to ``phase`` at ``at`` (as the agent's report would)."""

    def fn(j):
        j.status.phase = phase
        j.status.reason = reason
        j.status.history.add(phase=phase, time=at, reason=reason)
        return [], []

    await ctl._rmw(job_id, fn)  # noqa: SLF001


async def _estimate(store: Store, job_id: str) -> tpb.JobEstimate:
    return (await store.get_job(job_id)).value.status.estimate


async def test_a_failed_profiling_job_is_retried_after_a_doubling_wait_up_to_the_attempts(setup):
    ctl, store, prof, now = setup
    u = await _user_job(store)
    _, idem = profile_doc(manifest.validate(DOC), prof.steps)
    assert (await prof.once())["requested"] == 1
    pj = (await _profile_jobs(store))[idem]
    assert pj.spec.name == idem  # the first attempt keeps the shape's key and name

    waits = []
    for k in (1, 2):
        failed_at = now[0]
        await _end(ctl, pj.id, P.FAILED, failed_at, f"executor exited 137 (attempt {k})")
        wait = RETRY * 2 ** (k - 1)
        waits.append(wait)
        now[0] = failed_at + wait - 1  # not yet: the estimate says the next attempt is coming, and when
        assert (await prof.once())["requested"] == 0
        est = await _estimate(store, u.id)
        assert est.status == "profiling" and est.profile_job_id == pj.id, est
        assert f"attempt {k} of 3: executor exited 137 (attempt {k})" in est.reason, est.reason
        assert f"attempt {k + 1} at" in est.reason, est.reason
        assert await prof.once() == {"requested": 0, "estimated": 0}  # said once
        now[0] = failed_at + wait
        assert (await prof.once())["requested"] == 1
        jobs = await _profile_jobs(store)
        assert set(jobs) == {attempt_key(idem, i) for i in range(1, k + 2)}
        pj = jobs[attempt_key(idem, k + 1)]
        assert pj.spec.name == f"{idem}-a{k + 1}" and pj.status.phase == P.PENDING
        est = await _estimate(store, u.id)
        assert est.status == "profiling" and est.profile_job_id == pj.id, est
    assert waits == [10.0, 20.0]

    # The third attempt fails too: no fourth; the job says so, naming the last one.
    await _end(ctl, pj.id, P.FAILED, now[0], "out of memory")
    now[0] += 1000
    assert (await prof.once())["requested"] == 0
    est = await _estimate(store, u.id)
    assert est.status == "insufficient_data" and est.profile_job_id == pj.id, est
    assert est.reason == f"profiling job {pj.id} ended FAILED (attempt 3 of 3: out of memory)", est.reason
    now[0] += 1000
    assert await prof.once() == {"requested": 0, "estimated": 0}
    assert len(await _profile_jobs(store)) == 3


async def test_a_profiling_job_whose_profile_never_arrived_is_retried_after_the_grace(setup):
    """Its node's profilerd was down while it ran (the agent's reports are best effort): it
    SUCCEEDED, but no profile reached the estimator. After the grace, a new attempt —
    possibly on another node — rather than insufficient_data at once."""
    ctl, store, prof, now = setup
    u = await _user_job(store)
    _, idem = profile_doc(manifest.validate(DOC), prof.steps)
    assert (await prof.once())["requested"] == 1
    pj = (await _profile_jobs(store))[idem]
    await _end(ctl, pj.id, P.SUCCEEDED, T0, "finished")
    now[0] = T0 + prof.grace_s - 1  # within the grace: the profile may still be on its way
    assert (await prof.once())["requested"] == 0
    assert (await _estimate(store, u.id)).status == "profiling"
    now[0] = T0 + prof.grace_s
    assert (await prof.once())["requested"] == 1
    pj2 = (await _profile_jobs(store))[attempt_key(idem, 2)]
    est = await _estimate(store, u.id)
    assert est.status == "profiling" and est.profile_job_id == pj2.id, est
    # The last attempt's profile does not arrive either: insufficient_data naming it, no fourth.
    await _end(ctl, pj2.id, P.FAILED, now[0], "node lost")
    now[0] += 2 * RETRY
    assert (await prof.once())["requested"] == 1
    pj3 = (await _profile_jobs(store))[attempt_key(idem, 3)]
    await _end(ctl, pj3.id, P.SUCCEEDED, now[0], "finished")
    now[0] += prof.grace_s + 1
    assert (await prof.once())["requested"] == 0
    est = await _estimate(store, u.id)
    assert est.status == "insufficient_data" and est.profile_job_id == pj3.id, est
    assert "no profile of" in est.reason and "profilerd" in est.reason, est.reason
    assert len(await _profile_jobs(store)) == 3


async def test_a_cancelled_profiling_job_is_not_retried(setup):
    ctl, store, prof, now = setup
    u = await _user_job(store)
    assert (await prof.once())["requested"] == 1
    (pj,) = (await _profile_jobs(store)).values()
    await _end(ctl, pj.id, P.CANCELLED, now[0], "cancelled by an operator")
    now[0] += 1000
    assert (await prof.once())["requested"] == 0
    est = await _estimate(store, u.id)
    assert est.status == "insufficient_data" and est.reason == f"profiling job {pj.id} ended CANCELLED", est
    assert len(await _profile_jobs(store)) == 1


async def test_a_pending_profiling_job_says_why_it_waits(setup):
    ctl, store, prof, now = setup
    u = await _user_job(store)
    await prof.once()
    (pj,) = (await _profile_jobs(store)).values()
    assert "pending" not in (await _estimate(store, u.id)).reason

    def waits(j):
        j.status.last_decision.action = "wait"
        j.status.last_decision.reason = "no feasible configuration on this cluster (no gpu device)"
        return [], []

    await ctl._rmw(pj.id, waits)  # noqa: SLF001 - the policy's wait decision
    assert (await prof.once())["estimated"] == 1
    est = await _estimate(store, u.id)
    assert est.status == "profiling" and est.profile_job_id == pj.id
    assert est.reason.endswith(f"profiling job {pj.id} (pending: no feasible configuration on this cluster "
                               "(no gpu device))"), est.reason
    assert (await prof.once())["estimated"] == 0  # stable: written once


def test_an_input_bound_jobs_profiling_job_waits_for_no_input():
    plain = manifest.validate({**DOC, "resources": {"devices": 1, "device_kind": "cpu"}})
    delayed = manifest.validate({**plain, "workload": {**DOC["workload"], "step_delay_s": 2.0}})
    (pa, ka), (pb, kb) = profile_doc(plain, 8), profile_doc(delayed, 8)
    assert delayed["workload"]["step_delay_s"] == 2.0
    assert "step_delay_s" not in pb["workload"] and ka == kb and pa == pb
    manifest.validate(pb)


@pytest.mark.parametrize("field,bad", [("profile_attempts", 0), ("profile_attempts", 1.5),
                                       ("profile_attempts", True), ("profile_retry_s", 0),
                                       ("profile_retry_s", float("nan")), ("profile_retry_s", float("inf"))])
def test_profile_retry_settings_are_checked(field, bad):
    with pytest.raises(SpecError) as e:
        ControllerConfig(**{field: bad})
    assert e.value.field == field

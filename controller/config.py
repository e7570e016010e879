"""The controller's typed configuration (flag > env TESSERA_CONTROLLER_* > --config file)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tessera.errors import SpecError
from tessera.measurement import PROFILE_MIN_MEASURED, PROFILE_WARMUP_STEPS


@dataclass(frozen=True)
class ControllerConfig:
    """The controller's settings; construction refuses a value it could not run with
    (``SpecError`` naming the field): ``grace_s``, ``heartbeat_interval_s``,
    ``reconcile_interval_s``, ``profile_grace_s`` and ``profile_retry_s`` finite and > 0,
    ``lease_ttl_s``, ``max_attempts`` and ``profile_attempts`` integers >= 1,
    ``profile_steps`` enough for a profile point,
    ``finished_job_ttl_s`` finite and >= 0."""

    listen: str = field(default="127.0.0.1:50051", metadata={"help": "gRPC listen address HOST:PORT"})
    etcd: str = field(default="127.0.0.1:2379", metadata={"help": "etcd endpoint HOST:PORT"})
    prefix: str = field(default="/tessera", metadata={"help": "etcd key prefix of this cluster's state"})
    grace_s: float = field(default=10.0, metadata={"help": "a node silent this long is NotReady and its jobs requeued"})
    heartbeat_interval_s: float = field(default=1.0, metadata={"help": "how often agents heartbeat"})
    reconcile_interval_s: float = field(default=1.0, metadata={"help": "period of the reconcile loop, one policy round each (it also runs on events: submit, finish, node change)"})
    lease_ttl_s: int = field(default=5, metadata={"help": "TTL of the leader lease, seconds"})
    max_attempts: int = field(default=5, metadata={"help": "placements of a job before it is FAILED"})
    # Deprecated: everything the controller keeps is in etcd (jobs, nodes, leases); it has
    # no local state. Accepted (and ignored, with a warning) so that existing configs and
    # command lines keep working.
    state_dir: str = field(default="", metadata={"help": "deprecated and ignored: the controller keeps all its state in etcd"})
    checkpoint_root: str = field(default=".tessera/checkpoints", metadata={"help": "checkpoint root shared by all nodes (a shared filesystem in a real cluster)"})
    estimator: str = field(default="", metadata={"help": "estimator address HOST:PORT (optional; enables profiling jobs and estimates)"})
    profile_steps: int = field(default=8, metadata={"help": "steps of a profiling job (the estimator drops the first 2 as warm-up)"})
    profile_grace_s: float = field(default=60.0, metadata={
        "help": "a profiling job that SUCCEEDED this many seconds ago without its profile reaching the estimator "
                "(profilerd down or not streaming) marks the jobs waiting on it insufficient_data, naming it; a "
                "profile arriving later still gives them estimates"})
    profile_attempts: int = field(default=3, metadata={
        "help": "profiling jobs submitted for one model and shape when they FAIL or their profile does not arrive "
                "within profile_grace_s (a transient fault must not leave it unprofiled); after the last, the jobs "
                "waiting on it say insufficient_data. A CANCELLED profiling job is not retried"})
    profile_retry_s: float = field(default=10.0, metadata={
        "help": "wait after the k-th profiling job of a shape FAILED before the next: profile_retry_s * 2^(k-1)"})
    policy: str = field(default="tessera", metadata={"help": "scheduling policy: tessera (packing, elastic resize, preemption) | firstfit (whole partitions, submission order)"})
    identity: str = field(default="", metadata={"help": "this controller's identity in the election (default: host:pid)"})
    finished_job_ttl_s: float = field(default=604800.0, metadata={
        "help": "a finished job (SUCCEEDED, FAILED, CANCELLED) is removed from etcd this many seconds after it "
                "ended (default 7 days; 0 keeps finished jobs forever)"})

    def __post_init__(self) -> None:
        least = PROFILE_WARMUP_STEPS + PROFILE_MIN_MEASURED
        if isinstance(self.profile_steps, bool) or not isinstance(self.profile_steps, int) \
                or self.profile_steps < least:
            # fewer steps make no profile point: the job would stay "profiling" for ever
            raise SpecError("profile_steps", f"must be an integer >= {least} (the estimator drops the first "
                                             f"{PROFILE_WARMUP_STEPS} as warm-up and needs {PROFILE_MIN_MEASURED} "
                                             f"measured), got {self.profile_steps!r}")
        # Durations and counts the controller loops on: 0, negative or NaN would make nodes
        # NOT_READY at once, a busy loop, a lease that never holds or jobs that never run.
        for name in ("grace_s", "heartbeat_interval_s", "reconcile_interval_s", "profile_grace_s", "profile_retry_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise SpecError(name, f"must be a finite number > 0 seconds, got {v!r}")
        for name in ("lease_ttl_s", "max_attempts", "profile_attempts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(name, f"must be an integer >= 1, got {v!r}")
        # Checked here too, not only by the loader (which refuses a non-finite float): a
        # config built in code must not slip NaN (compares false: kept forever) or inf in.
        ttl = self.finished_job_ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not (math.isfinite(ttl) and ttl >= 0):
            raise SpecError("finished_job_ttl_s",
                            f"must be a finite number >= 0 seconds (0 keeps finished jobs forever), got {ttl!r}")

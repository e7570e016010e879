"""The quota of one executor (rank) in the performance model's units (pure).

The performance model's ``q`` (``tessera.perfmodel``: ``Candidate.quota``,
``ComputeSample.q``) is cores on a CPU and the share of the GPU's SMs on a GPU (1.0 = the
whole GPU). Two services must agree on it: the controller, which estimates a placed job
at its grant's quota (``controller/profiling.py``), and the agent, which labels every
step its executors report with the quota they ran at (label ``quota``) so that the
estimator files the profile under it (``estimator/models.py: run_key``). One rule, here:
before it the agent labelled the executor's CPU threads, which on a GPU say nothing of
its SM share (an MPS grant of 30 % and the whole GPU were one profile point) and on a
core set with ``units_per_core`` > 1 counted units where the controller counts cores; and
the controller priced a MIG instance as the whole GPU (a 1g instance of an H200 has 16 of
its 132 SMs).
"""

from __future__ import annotations


def quota_of(device_kind: str, device_capacity: float, partition_kind: str = "", unit: str = "",
             capacity_units: int = 0, units: int = 0, units_per_core: int = 1,
             sm_share: float = 0.0) -> float | None:
    """Per-rank quota of a grant of ``units`` of a partition (``partition_kind``: cpuset,
    mps, mig, timeslice; ``unit``: cores, sm_percent, instance, slots; ``capacity_units``
    its size) carved from a device of ``device_kind`` ("cpu" | "gpu") and
    ``device_capacity`` (cores x units_per_core of a CPU, 100 for a GPU). ``units`` 0 is
    the whole partition; no partition (kind and unit "") is the whole device.

    - a core set (unit ``cores``): its units over ``units_per_core`` — cores;
    - time slicing (kind ``timeslice`` or unit ``slots``): no quota, each executor runs on
      the whole device (sharing it is the estimate's oversubscription) — the device's
      cores on a CPU, 1.0 on a GPU;
    - MPS (unit ``sm_percent``): the percentage / 100 (at most 1.0);
    - a partition that is a fixed share of a GPU's SMs (``sm_share`` > 0: a MIG instance,
      whose partition attribute ``sm_share`` is its profile's SMs over the GPU's): that
      share times the grant's share of the partition;
    - anything else (the whole device): the device's capacity (cores; a GPU's 1.0) times
      the grant's share of the partition;
    None when nothing is known (none of the above, on a device of capacity 0 or not
    known: the caller's fallback). Pure."""
    per_core = max(1, int(units_per_core or 1))
    cap = float(device_capacity) if device_kind == "cpu" else float(device_capacity) / 100.0
    if unit == "cores" and units > 0:
        return units / per_core
    if (partition_kind == "timeslice" or unit == "slots") and device_capacity > 0:
        return cap / (per_core if device_kind == "cpu" else 1)
    if unit == "sm_percent" and units > 0:
        return min(units, 100) / 100.0
    share = units / capacity_units if capacity_units and units else 1.0
    if device_capacity <= 0:
        return None
    if device_kind == "gpu" and 0 < sm_share <= 1:
        return sm_share * min(share, 1.0)
    return cap * min(share, 1.0)


def partition_quota(device_kind: str, device_capacity: float, part, units: int) -> float | None:
    """:func:`quota_of` a grant of ``units`` of ``part`` — anything with ``kind``, ``unit``,
    ``capacity_units`` and an ``attributes`` mapping (the agent's ``PartitionInfo``, the
    controller's ``types_pb2.Partition``), whose ``units_per_core`` and ``sm_share``
    attributes it reads; ``part`` None: the whole device. The one reading of a partition
    for the agent's step labels, the controller's estimates and the policy's device
    classes. Pure."""
    if part is None:
        return quota_of(device_kind, device_capacity, units=units)
    per_core = str(part.attributes.get("units_per_core", "1"))
    return quota_of(device_kind, device_capacity, part.kind, part.unit, part.capacity_units, units,
                    int(per_core) if per_core.isdigit() else 1, sm_share_of(part.attributes))


def sm_share_of(attributes) -> float:
    """A partition's ``sm_share`` attribute (a MIG instance's share of its GPU's SMs, set by
    the agent) as a number in (0, 1], else 0.0 (absent, unparseable or out of range)."""
    try:
        v = float((attributes or {}).get("sm_share", "") or 0.0)
    except (TypeError, ValueError):
        return 0.0
    return v if 0.0 < v <= 1.0 else 0.0

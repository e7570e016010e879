"""Partition backends: CPU core sets, MPS, MIG, time slicing (see README.md).

The agent holds one :class:`Partitions` built by ``Partitions.for_devices``; it grants
shares of partitions (a second capacity check after the controller's) and reports each
partition's capacity. ``fake_nvml`` is a test double, never imported from here.
"""

from .base import (BadGrant, CapacityRefused, Grant, Ledger, NotLive, PartitionBackend, PartitionError, PartitionInfo,
                   UnknownPartition)
from .cpuset import CpusetBackend, pick_cores
from .mig import MigBackend, MigError, MigInstance, MigManager, MigProfile, MigReadOnly, MigState
from .mps import MpsBackend, MpsDaemon, MpsError, fatal_log_lines, is_fatal_client_message
from .registry import MODES, Partitions, make_backend, select_kind
from .timeslice import TimeSliceBackend

__all__ = [
    "BadGrant", "CapacityRefused", "CpusetBackend", "Grant", "Ledger", "MODES", "MigBackend", "MigError",
    "MigInstance", "MigManager", "MigProfile", "MigReadOnly", "MigState", "NotLive", "MpsBackend", "MpsDaemon", "MpsError",
    "PartitionBackend", "PartitionError", "PartitionInfo", "Partitions", "TimeSliceBackend", "UnknownPartition",
    "fatal_log_lines", "is_fatal_client_message", "make_backend", "pick_cores", "select_kind",
]

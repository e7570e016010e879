from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_PHASE_UNSPECIFIED: _ClassVar[JobPhase]
    PENDING: _ClassVar[JobPhase]
    SCHEDULED: _ClassVar[JobPhase]
    RUNNING: _ClassVar[JobPhase]
    SUCCEEDED: _ClassVar[JobPhase]
    FAILED: _ClassVar[JobPhase]
    CANCELLED: _ClassVar[JobPhase]

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    READY: _ClassVar[NodeState]
    NOT_READY: _ClassVar[NodeState]
JOB_PHASE_UNSPECIFIED: JobPhase
PENDING: JobPhase
SCHEDULED: JobPhase
RUNNING: JobPhase
SUCCEEDED: JobPhase
FAILED: JobPhase
CANCELLED: JobPhase
NODE_STATE_UNSPECIFIED: NodeState
READY: NodeState
NOT_READY: NodeState

class Device(_message.Message):
    __slots__ = ("id", "kind", "model", "memory_bytes", "capacity", "cores", "uuid")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: str
    model: str
    memory_bytes: int
    capacity: int
    cores: _containers.RepeatedScalarFieldContainer[int]
    uuid: str
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[str] = ..., model: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., capacity: _Optional[int] = ..., cores: _Optional[_Iterable[int]] = ..., uuid: _Optional[str] = ...) -> None: ...

class Partition(_message.Message):
    __slots__ = ("id", "kind", "device_id", "capacity_units", "unit", "memory_bytes", "free_units", "free_memory_bytes", "attributes", "allocated_units")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_UNITS_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_UNITS_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_UNITS_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: str
    device_id: str
    capacity_units: int
    unit: str
    memory_bytes: int
    free_units: int
    free_memory_bytes: int
    attributes: _containers.ScalarMap[str, str]
    allocated_units: int
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[str] = ..., device_id: _Optional[str] = ..., capacity_units: _Optional[int] = ..., unit: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., free_units: _Optional[int] = ..., free_memory_bytes: _Optional[int] = ..., attributes: _Optional[_Mapping[str, str]] = ..., allocated_units: _Optional[int] = ...) -> None: ...

class ModelConfig(_message.Message):
    __slots__ = ("vocab", "seq_len", "layers", "hidden", "heads")
    VOCAB_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    vocab: int
    seq_len: int
    layers: int
    hidden: int
    heads: int
    def __init__(self, vocab: _Optional[int] = ..., seq_len: _Optional[int] = ..., layers: _Optional[int] = ..., hidden: _Optional[int] = ..., heads: _Optional[int] = ...) -> None: ...

class DataSource(_message.Message):
    __slots__ = ("kind", "path")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    kind: str
    path: str
    def __init__(self, kind: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ParallelPlan(_message.Message):
    __slots__ = ("dp", "tp", "pp", "micro_batches")
    DP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    dp: int
    tp: int
    pp: int
    micro_batches: int
    def __init__(self, dp: _Optional[int] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., micro_batches: _Optional[int] = ...) -> None: ...

class Workload(_message.Message):
    __slots__ = ("type", "model", "steps", "batch_size", "learning_rate", "seed", "data", "plan", "checkpoint_every", "peft", "multimodal", "step_delay_s")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    PEFT_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_FIELD_NUMBER: _ClassVar[int]
    STEP_DELAY_S_FIELD_NUMBER: _ClassVar[int]
    type: str
    model: ModelConfig
    steps: int
    batch_size: int
    learning_rate: float
    seed: int
    data: DataSource
    plan: ParallelPlan
    checkpoint_every: int
    peft: _struct_pb2.Struct
    multimodal: _struct_pb2.Struct
    step_delay_s: float
    def __init__(self, type: _Optional[str] = ..., model: _Optional[_Union[ModelConfig, _Mapping]] = ..., steps: _Optional[int] = ..., batch_size: _Optional[int] = ..., learning_rate: _Optional[float] = ..., seed: _Optional[int] = ..., data: _Optional[_Union[DataSource, _Mapping]] = ..., plan: _Optional[_Union[ParallelPlan, _Mapping]] = ..., checkpoint_every: _Optional[int] = ..., peft: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., multimodal: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., step_delay_s: _Optional[float] = ...) -> None: ...

class Resources(_message.Message):
    __slots__ = ("devices", "device_kind", "share")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    devices: int
    device_kind: str
    share: float
    def __init__(self, devices: _Optional[int] = ..., device_kind: _Optional[str] = ..., share: _Optional[float] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("api_version", "name", "tenant", "workload", "resources")
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    api_version: str
    name: str
    tenant: str
    workload: Workload
    resources: Resources
    def __init__(self, api_version: _Optional[str] = ..., name: _Optional[str] = ..., tenant: _Optional[str] = ..., workload: _Optional[_Union[Workload, _Mapping]] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ...) -> None: ...

class Shard(_message.Message):
    __slots__ = ("node", "device_ids", "first_rank", "partition_ids", "units", "memory_bytes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_RANK_FIELD_NUMBER: _ClassVar[int]
    PARTITION_IDS_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    node: str
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    first_rank: int
    partition_ids: _containers.RepeatedScalarFieldContainer[str]
    units: int
    memory_bytes: int
    def __init__(self, node: _Optional[str] = ..., device_ids: _Optional[_Iterable[str]] = ..., first_rank: _Optional[int] = ..., partition_ids: _Optional[_Iterable[str]] = ..., units: _Optional[int] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("policy", "action", "reason", "time", "decision_id", "quota")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    policy: str
    action: str
    reason: str
    time: float
    decision_id: str
    quota: float
    def __init__(self, policy: _Optional[str] = ..., action: _Optional[str] = ..., reason: _Optional[str] = ..., time: _Optional[float] = ..., decision_id: _Optional[str] = ..., quota: _Optional[float] = ...) -> None: ...

class PhaseTransition(_message.Message):
    __slots__ = ("phase", "time", "reason")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    phase: JobPhase
    time: float
    reason: str
    def __init__(self, phase: _Optional[_Union[JobPhase, str]] = ..., time: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("phase", "reason", "history", "placement", "allocation_id", "step", "total_steps", "loss", "first_loss", "step_time_s", "attempts", "decision", "exit_code", "last_decision", "plan", "preemptions", "encoder_ranks", "encoder_share", "busy", "estimate", "fused_into", "tasks", "step_time_median_s")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    LAST_DECISION_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_RANKS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_SHARE_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    FUSED_INTO_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MEDIAN_S_FIELD_NUMBER: _ClassVar[int]
    phase: JobPhase
    reason: str
    history: _containers.RepeatedCompositeFieldContainer[PhaseTransition]
    placement: _containers.RepeatedCompositeFieldContainer[Shard]
    allocation_id: str
    step: int
    total_steps: int
    loss: float
    first_loss: float
    step_time_s: float
    attempts: int
    decision: str
    exit_code: int
    last_decision: Decision
    plan: ParallelPlan
    preemptions: int
    encoder_ranks: int
    encoder_share: float
    busy: float
    estimate: JobEstimate
    fused_into: str
    tasks: _containers.RepeatedCompositeFieldContainer[TaskStatus]
    step_time_median_s: float
    def __init__(self, phase: _Optional[_Union[JobPhase, str]] = ..., reason: _Optional[str] = ..., history: _Optional[_Iterable[_Union[PhaseTransition, _Mapping]]] = ..., placement: _Optional[_Iterable[_Union[Shard, _Mapping]]] = ..., allocation_id: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., loss: _Optional[float] = ..., first_loss: _Optional[float] = ..., step_time_s: _Optional[float] = ..., attempts: _Optional[int] = ..., decision: _Optional[str] = ..., exit_code: _Optional[int] = ..., last_decision: _Optional[_Union[Decision, _Mapping]] = ..., plan: _Optional[_Union[ParallelPlan, _Mapping]] = ..., preemptions: _Optional[int] = ..., encoder_ranks: _Optional[int] = ..., encoder_share: _Optional[float] = ..., busy: _Optional[float] = ..., estimate: _Optional[_Union[JobEstimate, _Mapping]] = ..., fused_into: _Optional[str] = ..., tasks: _Optional[_Iterable[_Union[TaskStatus, _Mapping]]] = ..., step_time_median_s: _Optional[float] = ...) -> None: ...

class TaskStatus(_message.Message):
    __slots__ = ("name", "phase", "step", "total_steps", "loss", "first_loss", "tokens_per_s", "reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    phase: JobPhase
    step: int
    total_steps: int
    loss: float
    first_loss: float
    tokens_per_s: float
    reason: str
    def __init__(self, name: _Optional[str] = ..., phase: _Optional[_Union[JobPhase, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., loss: _Optional[float] = ..., first_loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class JobEstimate(_message.Message):
    __slots__ = ("status", "step_time_s", "rel_std", "confidence", "memory_bytes", "reason", "model_version", "profile_job_id", "time")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    REL_STD_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROFILE_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    status: str
    step_time_s: float
    rel_std: float
    confidence: float
    memory_bytes: float
    reason: str
    model_version: int
    profile_job_id: str
    time: float
    def __init__(self, status: _Optional[str] = ..., step_time_s: _Optional[float] = ..., rel_std: _Optional[float] = ..., confidence: _Optional[float] = ..., memory_bytes: _Optional[float] = ..., reason: _Optional[str] = ..., model_version: _Optional[int] = ..., profile_job_id: _Optional[str] = ..., time: _Optional[float] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "spec", "status", "created", "idempotency_key", "revision", "parent_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    spec: JobSpec
    status: JobStatus
    created: float
    idempotency_key: str
    revision: int
    parent_id: str
    def __init__(self, id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., status: _Optional[_Union[JobStatus, _Mapping]] = ..., created: _Optional[float] = ..., idempotency_key: _Optional[str] = ..., revision: _Optional[int] = ..., parent_id: _Optional[str] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("name", "agent_address", "profilerd_address", "devices", "state", "incarnation", "last_heartbeat", "allocated_device_ids", "partitions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROFILERD_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    agent_address: str
    profilerd_address: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    state: NodeState
    incarnation: str
    last_heartbeat: float
    allocated_device_ids: _containers.RepeatedScalarFieldContainer[str]
    partitions: _containers.RepeatedCompositeFieldContainer[Partition]
    def __init__(self, name: _Optional[str] = ..., agent_address: _Optional[str] = ..., profilerd_address: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., state: _Optional[_Union[NodeState, str]] = ..., incarnation: _Optional[str] = ..., last_heartbeat: _Optional[float] = ..., allocated_device_ids: _Optional[_Iterable[str]] = ..., partitions: _Optional[_Iterable[_Union[Partition, _Mapping]]] = ...) -> None: ...

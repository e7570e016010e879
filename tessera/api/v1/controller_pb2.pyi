from tessera.api.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec", "idempotency_key")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    spec: _types_pb2.JobSpec
    idempotency_key: str
    def __init__(self, spec: _Optional[_Union[_types_pb2.JobSpec, _Mapping]] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job", "created")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    job: _types_pb2.Job
    created: bool
    def __init__(self, job: _Optional[_Union[_types_pb2.Job, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("tenant", "phases", "page_size", "page_token", "include_tasks")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TASKS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    phases: _containers.RepeatedScalarFieldContainer[_types_pb2.JobPhase]
    page_size: int
    page_token: str
    include_tasks: bool
    def __init__(self, tenant: _Optional[str] = ..., phases: _Optional[_Iterable[_Union[_types_pb2.JobPhase, str]]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., include_tasks: _Optional[bool] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token", "revision")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.Job]
    next_page_token: str
    revision: int
    def __init__(self, jobs: _Optional[_Iterable[_Union[_types_pb2.Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., revision: _Optional[int] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class GetJobLogsRequest(_message.Message):
    __slots__ = ("job_id", "tail_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TAIL_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    tail_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., tail_bytes: _Optional[int] = ...) -> None: ...

class GetJobLogsResponse(_message.Message):
    __slots__ = ("text", "truncated")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    text: str
    truncated: bool
    def __init__(self, text: _Optional[str] = ..., truncated: _Optional[bool] = ...) -> None: ...

class WatchJobsRequest(_message.Message):
    __slots__ = ("tenant", "job_id", "start_revision")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    START_REVISION_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    job_id: str
    start_revision: int
    def __init__(self, tenant: _Optional[str] = ..., job_id: _Optional[str] = ..., start_revision: _Optional[int] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("type", "job", "revision")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TYPE_UNSPECIFIED: _ClassVar[JobEvent.Type]
        SNAPSHOT: _ClassVar[JobEvent.Type]
        UPDATED: _ClassVar[JobEvent.Type]
        DELETED: _ClassVar[JobEvent.Type]
    TYPE_UNSPECIFIED: JobEvent.Type
    SNAPSHOT: JobEvent.Type
    UPDATED: JobEvent.Type
    DELETED: JobEvent.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    type: JobEvent.Type
    job: _types_pb2.Job
    revision: int
    def __init__(self, type: _Optional[_Union[JobEvent.Type, str]] = ..., job: _Optional[_Union[_types_pb2.Job, _Mapping]] = ..., revision: _Optional[int] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("name", "agent_address", "profilerd_address", "devices", "partitions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROFILERD_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    agent_address: str
    profilerd_address: str
    devices: _containers.RepeatedCompositeFieldContainer[_types_pb2.Device]
    partitions: _containers.RepeatedCompositeFieldContainer[_types_pb2.Partition]
    def __init__(self, name: _Optional[str] = ..., agent_address: _Optional[str] = ..., profilerd_address: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[_types_pb2.Device, _Mapping]]] = ..., partitions: _Optional[_Iterable[_Union[_types_pb2.Partition, _Mapping]]] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("incarnation", "heartbeat_interval_s", "grace_s")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    heartbeat_interval_s: float
    grace_s: float
    def __init__(self, incarnation: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., grace_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("name", "incarnation", "running_allocations", "partitions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    incarnation: str
    running_allocations: _containers.RepeatedScalarFieldContainer[str]
    partitions: _containers.RepeatedCompositeFieldContainer[_types_pb2.Partition]
    def __init__(self, name: _Optional[str] = ..., incarnation: _Optional[str] = ..., running_allocations: _Optional[_Iterable[str]] = ..., partitions: _Optional[_Iterable[_Union[_types_pb2.Partition, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("stop_allocations",)
    STOP_ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    stop_allocations: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stop_allocations: _Optional[_Iterable[str]] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[_types_pb2.Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[_types_pb2.Node, _Mapping]]] = ...) -> None: ...

class ExecutorReport(_message.Message):
    __slots__ = ("node", "incarnation", "job_id", "allocation_id", "rank", "kind", "step", "total_steps", "loss", "step_time_s", "exit_code", "message", "task", "task_phase", "tokens_per_s", "modules", "busy", "stopped_by_agent", "step_time_median_s")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[ExecutorReport.Kind]
        STARTED: _ClassVar[ExecutorReport.Kind]
        PROGRESS: _ClassVar[ExecutorReport.Kind]
        EXITED: _ClassVar[ExecutorReport.Kind]
        TASK: _ClassVar[ExecutorReport.Kind]
    KIND_UNSPECIFIED: ExecutorReport.Kind
    STARTED: ExecutorReport.Kind
    PROGRESS: ExecutorReport.Kind
    EXITED: ExecutorReport.Kind
    TASK: ExecutorReport.Kind
    class ModulesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ModuleTime
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ModuleTime, _Mapping]] = ...) -> None: ...
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TASK_PHASE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    STOPPED_BY_AGENT_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MEDIAN_S_FIELD_NUMBER: _ClassVar[int]
    node: str
    incarnation: str
    job_id: str
    allocation_id: str
    rank: int
    kind: ExecutorReport.Kind
    step: int
    total_steps: int
    loss: float
    step_time_s: float
    exit_code: int
    message: str
    task: str
    task_phase: str
    tokens_per_s: float
    modules: _containers.MessageMap[str, ModuleTime]
    busy: float
    stopped_by_agent: bool
    step_time_median_s: float
    def __init__(self, node: _Optional[str] = ..., incarnation: _Optional[str] = ..., job_id: _Optional[str] = ..., allocation_id: _Optional[str] = ..., rank: _Optional[int] = ..., kind: _Optional[_Union[ExecutorReport.Kind, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., loss: _Optional[float] = ..., step_time_s: _Optional[float] = ..., exit_code: _Optional[int] = ..., message: _Optional[str] = ..., task: _Optional[str] = ..., task_phase: _Optional[str] = ..., tokens_per_s: _Optional[float] = ..., modules: _Optional[_Mapping[str, ModuleTime]] = ..., busy: _Optional[float] = ..., stopped_by_agent: _Optional[bool] = ..., step_time_median_s: _Optional[float] = ...) -> None: ...

class ModuleTime(_message.Message):
    __slots__ = ("forward_s", "backward_s", "communication_s", "idle_s")
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_S_FIELD_NUMBER: _ClassVar[int]
    COMMUNICATION_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    forward_s: float
    backward_s: float
    communication_s: float
    idle_s: float
    def __init__(self, forward_s: _Optional[float] = ..., backward_s: _Optional[float] = ..., communication_s: _Optional[float] = ..., idle_s: _Optional[float] = ...) -> None: ...

class ReportExecutorResponse(_message.Message):
    __slots__ = ("stale",)
    STALE_FIELD_NUMBER: _ClassVar[int]
    stale: bool
    def __init__(self, stale: _Optional[bool] = ...) -> None: ...

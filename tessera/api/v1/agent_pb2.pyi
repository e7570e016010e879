from tessera.api.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UpdateGrantRequest(_message.Message):
    __slots__ = ("allocation_id", "rank", "units", "fencing_token")
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    allocation_id: str
    rank: int
    units: int
    fencing_token: int
    def __init__(self, allocation_id: _Optional[str] = ..., rank: _Optional[int] = ..., units: _Optional[int] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class UpdateGrantResponse(_message.Message):
    __slots__ = ("partition_id", "units", "cores", "pid", "old_units")
    PARTITION_ID_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    OLD_UNITS_FIELD_NUMBER: _ClassVar[int]
    partition_id: str
    units: int
    cores: _containers.RepeatedScalarFieldContainer[int]
    pid: int
    old_units: int
    def __init__(self, partition_id: _Optional[str] = ..., units: _Optional[int] = ..., cores: _Optional[_Iterable[int]] = ..., pid: _Optional[int] = ..., old_units: _Optional[int] = ...) -> None: ...

class ControlTaskRequest(_message.Message):
    __slots__ = ("allocation_id", "fencing_token", "op", "task", "task_json", "task_dir")
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    TASK_DIR_FIELD_NUMBER: _ClassVar[int]
    allocation_id: str
    fencing_token: int
    op: str
    task: str
    task_json: str
    task_dir: str
    def __init__(self, allocation_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., op: _Optional[str] = ..., task: _Optional[str] = ..., task_json: _Optional[str] = ..., task_dir: _Optional[str] = ...) -> None: ...

class ControlTaskResponse(_message.Message):
    __slots__ = ("control_file",)
    CONTROL_FILE_FIELD_NUMBER: _ClassVar[int]
    control_file: str
    def __init__(self, control_file: _Optional[str] = ...) -> None: ...

class ReadLogsRequest(_message.Message):
    __slots__ = ("job_id", "tail_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TAIL_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    tail_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., tail_bytes: _Optional[int] = ...) -> None: ...

class ReadLogsResponse(_message.Message):
    __slots__ = ("text", "truncated")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    text: str
    truncated: bool
    def __init__(self, text: _Optional[str] = ..., truncated: _Optional[bool] = ...) -> None: ...

class LaunchExecutorRequest(_message.Message):
    __slots__ = ("allocation_id", "job_id", "fencing_token", "incarnation", "rank", "world_size", "device_ids", "master_addr", "master_port", "runtime_spec_json", "checkpoint_dir", "partition_id", "units", "memory_bytes")
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    PARTITION_ID_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    allocation_id: str
    job_id: str
    fencing_token: int
    incarnation: str
    rank: int
    world_size: int
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    master_addr: str
    master_port: int
    runtime_spec_json: str
    checkpoint_dir: str
    partition_id: str
    units: int
    memory_bytes: int
    def __init__(self, allocation_id: _Optional[str] = ..., job_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., incarnation: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., device_ids: _Optional[_Iterable[str]] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., runtime_spec_json: _Optional[str] = ..., checkpoint_dir: _Optional[str] = ..., partition_id: _Optional[str] = ..., units: _Optional[int] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class LaunchExecutorResponse(_message.Message):
    __slots__ = ("pid", "already_running")
    PID_FIELD_NUMBER: _ClassVar[int]
    ALREADY_RUNNING_FIELD_NUMBER: _ClassVar[int]
    pid: int
    already_running: bool
    def __init__(self, pid: _Optional[int] = ..., already_running: _Optional[bool] = ...) -> None: ...

class StopExecutorRequest(_message.Message):
    __slots__ = ("allocation_id", "fencing_token", "reason", "grace_s")
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    allocation_id: str
    fencing_token: int
    reason: str
    grace_s: float
    def __init__(self, allocation_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., reason: _Optional[str] = ..., grace_s: _Optional[float] = ...) -> None: ...

class StopExecutorResponse(_message.Message):
    __slots__ = ("stopped",)
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    stopped: int
    def __init__(self, stopped: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecutorStatus(_message.Message):
    __slots__ = ("allocation_id", "job_id", "rank", "pid", "device_ids", "running", "exit_code", "log_path", "step", "loss", "partition_id", "units")
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    LOG_PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_ID_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    allocation_id: str
    job_id: str
    rank: int
    pid: int
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    running: bool
    exit_code: int
    log_path: str
    step: int
    loss: float
    partition_id: str
    units: int
    def __init__(self, allocation_id: _Optional[str] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., device_ids: _Optional[_Iterable[str]] = ..., running: _Optional[bool] = ..., exit_code: _Optional[int] = ..., log_path: _Optional[str] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., partition_id: _Optional[str] = ..., units: _Optional[int] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("node", "incarnation", "devices", "executors", "partitions")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    node: str
    incarnation: str
    devices: _containers.RepeatedCompositeFieldContainer[_types_pb2.Device]
    executors: _containers.RepeatedCompositeFieldContainer[ExecutorStatus]
    partitions: _containers.RepeatedCompositeFieldContainer[_types_pb2.Partition]
    def __init__(self, node: _Optional[str] = ..., incarnation: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[_types_pb2.Device, _Mapping]]] = ..., executors: _Optional[_Iterable[_Union[ExecutorStatus, _Mapping]]] = ..., partitions: _Optional[_Iterable[_Union[_types_pb2.Partition, _Mapping]]] = ...) -> None: ...

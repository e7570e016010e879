from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Measurement(_message.Message):
    __slots__ = ("source", "seq", "time", "node", "kind", "job_id", "model_key", "module", "step", "step_time_s", "phases", "device_id", "values", "labels")
    class PhasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_KEY_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    source: str
    seq: int
    time: float
    node: str
    kind: str
    job_id: str
    model_key: str
    module: str
    step: int
    step_time_s: float
    phases: _containers.ScalarMap[str, float]
    device_id: str
    values: _containers.ScalarMap[str, float]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, source: _Optional[str] = ..., seq: _Optional[int] = ..., time: _Optional[float] = ..., node: _Optional[str] = ..., kind: _Optional[str] = ..., job_id: _Optional[str] = ..., model_key: _Optional[str] = ..., module: _Optional[str] = ..., step: _Optional[int] = ..., step_time_s: _Optional[float] = ..., phases: _Optional[_Mapping[str, float]] = ..., device_id: _Optional[str] = ..., values: _Optional[_Mapping[str, float]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ReportStepResponse(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProfilerStats(_message.Message):
    __slots__ = ("buffered", "sent", "dropped", "next_seq", "connected", "stream_errors")
    BUFFERED_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    STREAM_ERRORS_FIELD_NUMBER: _ClassVar[int]
    buffered: int
    sent: int
    dropped: int
    next_seq: int
    connected: bool
    stream_errors: int
    def __init__(self, buffered: _Optional[int] = ..., sent: _Optional[int] = ..., dropped: _Optional[int] = ..., next_seq: _Optional[int] = ..., connected: _Optional[bool] = ..., stream_errors: _Optional[int] = ...) -> None: ...

from tessera.api.v1 import profiler_pb2 as _profiler_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MeasurementBatch(_message.Message):
    __slots__ = ("measurements",)
    MEASUREMENTS_FIELD_NUMBER: _ClassVar[int]
    measurements: _containers.RepeatedCompositeFieldContainer[_profiler_pb2.Measurement]
    def __init__(self, measurements: _Optional[_Iterable[_Union[_profiler_pb2.Measurement, _Mapping]]] = ...) -> None: ...

class ReportAck(_message.Message):
    __slots__ = ("accepted", "duplicates", "watermark")
    class WatermarkEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    watermark: _containers.ScalarMap[str, int]
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ..., watermark: _Optional[_Mapping[str, int]] = ...) -> None: ...

class GetWatermarkRequest(_message.Message):
    __slots__ = ("source",)
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    source: str
    def __init__(self, source: _Optional[str] = ...) -> None: ...

class Watermark(_message.Message):
    __slots__ = ("source", "seq")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    source: str
    seq: int
    def __init__(self, source: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class GetProfileRequest(_message.Message):
    __slots__ = ("job_id", "model_key")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_KEY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    model_key: str
    def __init__(self, job_id: _Optional[str] = ..., model_key: _Optional[str] = ...) -> None: ...

class Profile(_message.Message):
    __slots__ = ("job_id", "model_key", "samples", "mean_step_time_s", "p50_step_time_s", "p90_step_time_s", "mean_phases", "last_time")
    class MeanPhasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_KEY_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MEAN_STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    P50_STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    P90_STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_PHASES_FIELD_NUMBER: _ClassVar[int]
    LAST_TIME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    model_key: str
    samples: int
    mean_step_time_s: float
    p50_step_time_s: float
    p90_step_time_s: float
    mean_phases: _containers.ScalarMap[str, float]
    last_time: float
    def __init__(self, job_id: _Optional[str] = ..., model_key: _Optional[str] = ..., samples: _Optional[int] = ..., mean_step_time_s: _Optional[float] = ..., p50_step_time_s: _Optional[float] = ..., p90_step_time_s: _Optional[float] = ..., mean_phases: _Optional[_Mapping[str, float]] = ..., last_time: _Optional[float] = ...) -> None: ...

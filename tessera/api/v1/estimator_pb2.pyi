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

class Candidate(_message.Message):
    __slots__ = ("device_type", "layers", "hidden", "heads", "vocab", "seq_len", "batch", "seq", "dp", "tp", "pp", "micro_batches", "quota", "link", "module", "colocated", "oversubscription", "schedule")
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    OVERSUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    device_type: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    batch: int
    seq: int
    dp: int
    tp: int
    pp: int
    micro_batches: int
    quota: float
    link: str
    module: str
    colocated: int
    oversubscription: float
    schedule: str
    def __init__(self, device_type: _Optional[str] = ..., layers: _Optional[int] = ..., hidden: _Optional[int] = ..., heads: _Optional[int] = ..., vocab: _Optional[int] = ..., seq_len: _Optional[int] = ..., batch: _Optional[int] = ..., seq: _Optional[int] = ..., dp: _Optional[int] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., micro_batches: _Optional[int] = ..., quota: _Optional[float] = ..., link: _Optional[str] = ..., module: _Optional[str] = ..., colocated: _Optional[int] = ..., oversubscription: _Optional[float] = ..., schedule: _Optional[str] = ...) -> None: ...

class EstimateRequest(_message.Message):
    __slots__ = ("candidate",)
    CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    candidate: Candidate
    def __init__(self, candidate: _Optional[_Union[Candidate, _Mapping]] = ...) -> None: ...

class EstimateReply(_message.Message):
    __slots__ = ("status", "seconds", "memory_bytes", "rel_std", "confidence", "reason", "breakdown", "model_version")
    class BreakdownEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REL_STD_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    status: str
    seconds: float
    memory_bytes: float
    rel_std: float
    confidence: float
    reason: str
    breakdown: _containers.ScalarMap[str, float]
    model_version: int
    def __init__(self, status: _Optional[str] = ..., seconds: _Optional[float] = ..., memory_bytes: _Optional[float] = ..., rel_std: _Optional[float] = ..., confidence: _Optional[float] = ..., reason: _Optional[str] = ..., breakdown: _Optional[_Mapping[str, float]] = ..., model_version: _Optional[int] = ...) -> None: ...

class EstimateBatchRequest(_message.Message):
    __slots__ = ("candidates",)
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    def __init__(self, candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ...) -> None: ...

class EstimateBatchReply(_message.Message):
    __slots__ = ("estimates", "model_version")
    ESTIMATES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    estimates: _containers.RepeatedCompositeFieldContainer[EstimateReply]
    model_version: int
    def __init__(self, estimates: _Optional[_Iterable[_Union[EstimateReply, _Mapping]]] = ..., model_version: _Optional[int] = ...) -> None: ...

class GetModelSnapshotRequest(_message.Message):
    __slots__ = ("if_newer_than",)
    IF_NEWER_THAN_FIELD_NUMBER: _ClassVar[int]
    if_newer_than: int
    def __init__(self, if_newer_than: _Optional[int] = ...) -> None: ...

class ModelSnapshot(_message.Message):
    __slots__ = ("version", "unchanged", "format", "json", "fitted_at", "measurements")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    FITTED_AT_FIELD_NUMBER: _ClassVar[int]
    MEASUREMENTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    unchanged: bool
    format: str
    json: str
    fitted_at: float
    measurements: int
    def __init__(self, version: _Optional[int] = ..., unchanged: _Optional[bool] = ..., format: _Optional[str] = ..., json: _Optional[str] = ..., fitted_at: _Optional[float] = ..., measurements: _Optional[int] = ...) -> None: ...

class ListProfilesRequest(_message.Message):
    __slots__ = ("module", "device_type")
    MODULE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    module: str
    device_type: str
    def __init__(self, module: _Optional[str] = ..., device_type: _Optional[str] = ...) -> None: ...

class ProfileEntry(_message.Message):
    __slots__ = ("module", "model_key", "device_type", "job_id", "rows", "seq", "micro_batches", "quota", "steps", "median_step_time_s", "spread")
    MODULE_FIELD_NUMBER: _ClassVar[int]
    MODEL_KEY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    SPREAD_FIELD_NUMBER: _ClassVar[int]
    module: str
    model_key: str
    device_type: str
    job_id: str
    rows: int
    seq: int
    micro_batches: int
    quota: float
    steps: int
    median_step_time_s: float
    spread: float
    def __init__(self, module: _Optional[str] = ..., model_key: _Optional[str] = ..., device_type: _Optional[str] = ..., job_id: _Optional[str] = ..., rows: _Optional[int] = ..., seq: _Optional[int] = ..., micro_batches: _Optional[int] = ..., quota: _Optional[float] = ..., steps: _Optional[int] = ..., median_step_time_s: _Optional[float] = ..., spread: _Optional[float] = ...) -> None: ...

class ListProfilesResponse(_message.Message):
    __slots__ = ("profiles", "model_version")
    PROFILES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    profiles: _containers.RepeatedCompositeFieldContainer[ProfileEntry]
    model_version: int
    def __init__(self, profiles: _Optional[_Iterable[_Union[ProfileEntry, _Mapping]]] = ..., model_version: _Optional[int] = ...) -> None: ...

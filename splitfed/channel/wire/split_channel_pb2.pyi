from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    BOOL: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    INT8: _ClassVar[DType]

class CompressionMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_NONE: _ClassVar[CompressionMethod]
    INT8_BLOCKWISE: _ClassVar[CompressionMethod]
    TOPK: _ClassVar[CompressionMethod]

class UpdateOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_OUTCOME_UNSPECIFIED: _ClassVar[UpdateOutcome]
    APPLIED: _ClassVar[UpdateOutcome]
    DOWNWEIGHTED: _ClassVar[UpdateOutcome]
    REJECTED_STALE: _ClassVar[UpdateOutcome]
    REJECTED_GUARD: _ClassVar[UpdateOutcome]
    NOT_TRAINED: _ClassVar[UpdateOutcome]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
INT64: DType
INT32: DType
BOOL: DType
UINT8: DType
INT8: DType
COMPRESSION_NONE: CompressionMethod
INT8_BLOCKWISE: CompressionMethod
TOPK: CompressionMethod
UPDATE_OUTCOME_UNSPECIFIED: UpdateOutcome
APPLIED: UpdateOutcome
DOWNWEIGHTED: UpdateOutcome
REJECTED_STALE: UpdateOutcome
REJECTED_GUARD: UpdateOutcome
NOT_TRAINED: UpdateOutcome

class Compressed(_message.Message):
    __slots__ = ("method", "dtype", "block_size", "count", "scales", "indices")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    method: CompressionMethod
    dtype: DType
    block_size: int
    count: int
    scales: bytes
    indices: bytes
    def __init__(self, method: _Optional[_Union[CompressionMethod, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., block_size: _Optional[int] = ..., count: _Optional[int] = ..., scales: _Optional[bytes] = ..., indices: _Optional[bytes] = ...) -> None: ...

class CompressionSpec(_message.Message):
    __slots__ = ("method", "topk_ratio", "block_size", "error_feedback")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TOPK_RATIO_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    method: CompressionMethod
    topk_ratio: float
    block_size: int
    error_feedback: bool
    def __init__(self, method: _Optional[_Union[CompressionMethod, str]] = ..., topk_ratio: _Optional[float] = ..., block_size: _Optional[int] = ..., error_feedback: _Optional[bool] = ...) -> None: ...

class RegionSlice(_message.Message):
    __slots__ = ("region", "offset", "nbytes", "event", "device")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    nbytes: int
    event: int
    device: bool
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., event: _Optional[int] = ..., device: _Optional[bool] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data", "compressed", "region")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    compressed: Compressed
    region: RegionSlice
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., compressed: _Optional[_Union[Compressed, _Mapping]] = ..., region: _Optional[_Union[RegionSlice, _Mapping]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("activation_id", "train", "tensors", "reply_dtype", "num_examples", "session_id", "reply_compression", "cut_start", "cut_end", "reply_region")
    ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    REPLY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    CUT_START_FIELD_NUMBER: _ClassVar[int]
    CUT_END_FIELD_NUMBER: _ClassVar[int]
    REPLY_REGION_FIELD_NUMBER: _ClassVar[int]
    activation_id: str
    train: bool
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    reply_dtype: DType
    num_examples: int
    session_id: str
    reply_compression: CompressionSpec
    cut_start: int
    cut_end: int
    reply_region: RegionSlice
    def __init__(self, activation_id: _Optional[str] = ..., train: _Optional[bool] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., reply_dtype: _Optional[_Union[DType, str]] = ..., num_examples: _Optional[int] = ..., session_id: _Optional[str] = ..., reply_compression: _Optional[_Union[CompressionSpec, _Mapping]] = ..., cut_start: _Optional[int] = ..., cut_end: _Optional[int] = ..., reply_region: _Optional[_Union[RegionSlice, _Mapping]] = ...) -> None: ...

class ForwardReply(_message.Message):
    __slots__ = ("activation_id", "tensors", "trunk_version")
    ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TRUNK_VERSION_FIELD_NUMBER: _ClassVar[int]
    activation_id: str
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    trunk_version: int
    def __init__(self, activation_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., trunk_version: _Optional[int] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("activation_id", "tensors", "reply_dtype", "reply_compression", "step_id", "step_parts", "reply_region")
    ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    REPLY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    REPLY_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_PARTS_FIELD_NUMBER: _ClassVar[int]
    REPLY_REGION_FIELD_NUMBER: _ClassVar[int]
    activation_id: str
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    reply_dtype: DType
    reply_compression: CompressionSpec
    step_id: str
    step_parts: int
    reply_region: RegionSlice
    def __init__(self, activation_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., reply_dtype: _Optional[_Union[DType, str]] = ..., reply_compression: _Optional[_Union[CompressionSpec, _Mapping]] = ..., step_id: _Optional[str] = ..., step_parts: _Optional[int] = ..., reply_region: _Optional[_Union[RegionSlice, _Mapping]] = ...) -> None: ...

class BackwardReply(_message.Message):
    __slots__ = ("activation_id", "tensors", "trunk_version", "outcome", "staleness")
    ACTIVATION_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TRUNK_VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    activation_id: str
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    trunk_version: int
    outcome: UpdateOutcome
    staleness: int
    def __init__(self, activation_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., trunk_version: _Optional[int] = ..., outcome: _Optional[_Union[UpdateOutcome, str]] = ..., staleness: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("forward_request", "forward_reply", "backward_request", "backward_reply", "chunk", "bulk")
    FORWARD_REQUEST_FIELD_NUMBER: _ClassVar[int]
    FORWARD_REPLY_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_REQUEST_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_REPLY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    forward_request: ForwardRequest
    forward_reply: ForwardReply
    backward_request: BackwardRequest
    backward_reply: BackwardReply
    chunk: Chunk
    bulk: BulkRef
    def __init__(self, forward_request: _Optional[_Union[ForwardRequest, _Mapping]] = ..., forward_reply: _Optional[_Union[ForwardReply, _Mapping]] = ..., backward_request: _Optional[_Union[BackwardRequest, _Mapping]] = ..., backward_reply: _Optional[_Union[BackwardReply, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., bulk: _Optional[_Union[BulkRef, _Mapping]] = ...) -> None: ...

class BulkRef(_message.Message):
    __slots__ = ("link", "transfer")
    LINK_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    link: str
    transfer: int
    def __init__(self, link: _Optional[str] = ..., transfer: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("model", "cuts", "trunk_mode", "trunk_version", "max_message_bytes", "stream_threshold_bytes", "auth_required", "server_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNK_MODE_FIELD_NUMBER: _ClassVar[int]
    TRUNK_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_THRESHOLD_BYTES_FIELD_NUMBER: _ClassVar[int]
    AUTH_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    cuts: _containers.RepeatedScalarFieldContainer[int]
    trunk_mode: str
    trunk_version: int
    max_message_bytes: int
    stream_threshold_bytes: int
    auth_required: bool
    server_version: str
    def __init__(self, model: _Optional[str] = ..., cuts: _Optional[_Iterable[int]] = ..., trunk_mode: _Optional[str] = ..., trunk_version: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., stream_threshold_bytes: _Optional[int] = ..., auth_required: _Optional[bool] = ..., server_version: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("trunk_version", "group_size")
    TRUNK_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    trunk_version: int
    group_size: int
    def __init__(self, trunk_version: _Optional[int] = ..., group_size: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("group_size",)
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    group_size: int
    def __init__(self, group_size: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("max_length", "batch_size")
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    max_length: int
    batch_size: int
    def __init__(self, max_length: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("session_id", "idle_ttl_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IDLE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    idle_ttl_s: float
    def __init__(self, session_id: _Optional[str] = ..., idle_ttl_s: _Optional[float] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenRegionRequest(_message.Message):
    __slots__ = ("nbytes", "cuda_events", "client_pid")
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_EVENTS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PID_FIELD_NUMBER: _ClassVar[int]
    nbytes: int
    cuda_events: bool
    client_pid: int
    def __init__(self, nbytes: _Optional[int] = ..., cuda_events: _Optional[bool] = ..., client_pid: _Optional[int] = ...) -> None: ...

class OpenRegionReply(_message.Message):
    __slots__ = ("region", "path", "nbytes", "event_handles", "server_pid", "device", "device_uuid", "device_memory", "direct_path", "direct_ticket")
    REGION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    SERVER_PID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    DIRECT_PATH_FIELD_NUMBER: _ClassVar[int]
    DIRECT_TICKET_FIELD_NUMBER: _ClassVar[int]
    region: str
    path: str
    nbytes: int
    event_handles: _containers.RepeatedScalarFieldContainer[bytes]
    server_pid: int
    device: int
    device_uuid: str
    device_memory: bytes
    direct_path: str
    direct_ticket: str
    def __init__(self, region: _Optional[str] = ..., path: _Optional[str] = ..., nbytes: _Optional[int] = ..., event_handles: _Optional[_Iterable[bytes]] = ..., server_pid: _Optional[int] = ..., device: _Optional[int] = ..., device_uuid: _Optional[str] = ..., device_memory: _Optional[bytes] = ..., direct_path: _Optional[str] = ..., direct_ticket: _Optional[str] = ...) -> None: ...

class CloseRegionRequest(_message.Message):
    __slots__ = ("region",)
    REGION_FIELD_NUMBER: _ClassVar[int]
    region: str
    def __init__(self, region: _Optional[str] = ...) -> None: ...

class CloseRegionReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenBulkRequest(_message.Message):
    __slots__ = ("connections",)
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    connections: int
    def __init__(self, connections: _Optional[int] = ...) -> None: ...

class OpenBulkReply(_message.Message):
    __slots__ = ("link", "ticket", "port", "connections")
    LINK_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    link: str
    ticket: bytes
    port: int
    connections: int
    def __init__(self, link: _Optional[str] = ..., ticket: _Optional[bytes] = ..., port: _Optional[int] = ..., connections: _Optional[int] = ...) -> None: ...

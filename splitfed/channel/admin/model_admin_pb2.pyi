from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    LOADING: _ClassVar[ModelState]
    READY: _ClassVar[ModelState]
    UNLOADING: _ClassVar[ModelState]
    FAILED: _ClassVar[ModelState]
MODEL_STATE_UNSPECIFIED: ModelState
LOADING: ModelState
READY: ModelState
UNLOADING: ModelState
FAILED: ModelState

class ModelSpec(_message.Message):
    __slots__ = ("name", "model", "cuts", "lora_rank", "device", "trunk_mode", "quorum", "max_staleness", "trunk_timeout_s", "optimizer", "lr", "batch_window_ms", "max_batch_tokens", "checkpointing", "shared_memory_mib", "seed", "frozen", "compile", "lora_alpha", "lora_targets")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CUTS_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TRUNK_MODE_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    TRUNK_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    BATCH_WINDOW_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTING_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FROZEN_FIELD_NUMBER: _ClassVar[int]
    COMPILE_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    LORA_TARGETS_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    cuts: _containers.RepeatedScalarFieldContainer[int]
    lora_rank: int
    device: str
    trunk_mode: str
    quorum: int
    max_staleness: int
    trunk_timeout_s: float
    optimizer: str
    lr: float
    batch_window_ms: float
    max_batch_tokens: int
    checkpointing: bool
    shared_memory_mib: int
    seed: int
    frozen: bool
    compile: bool
    lora_alpha: float
    lora_targets: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ..., cuts: _Optional[_Iterable[int]] = ..., lora_rank: _Optional[int] = ..., device: _Optional[str] = ..., trunk_mode: _Optional[str] = ..., quorum: _Optional[int] = ..., max_staleness: _Optional[int] = ..., trunk_timeout_s: _Optional[float] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., batch_window_ms: _Optional[float] = ..., max_batch_tokens: _Optional[int] = ..., checkpointing: _Optional[bool] = ..., shared_memory_mib: _Optional[int] = ..., seed: _Optional[int] = ..., frozen: _Optional[bool] = ..., compile: _Optional[bool] = ..., lora_alpha: _Optional[float] = ..., lora_targets: _Optional[_Iterable[str]] = ...) -> None: ...

class DeviceBytes(_message.Message):
    __slots__ = ("device", "bytes")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    device: str
    bytes: int
    def __init__(self, device: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("name", "state", "model", "cuts", "trunk_mode", "lora_rank", "device", "bytes", "estimated_bytes", "trunk_version", "calls_in_flight", "error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNK_MODE_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRUNK_VERSION_FIELD_NUMBER: _ClassVar[int]
    CALLS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: ModelState
    model: str
    cuts: _containers.RepeatedScalarFieldContainer[int]
    trunk_mode: str
    lora_rank: int
    device: str
    bytes: _containers.RepeatedCompositeFieldContainer[DeviceBytes]
    estimated_bytes: int
    trunk_version: int
    calls_in_flight: int
    error: str
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[ModelState, str]] = ..., model: _Optional[str] = ..., cuts: _Optional[_Iterable[int]] = ..., trunk_mode: _Optional[str] = ..., lora_rank: _Optional[int] = ..., device: _Optional[str] = ..., bytes: _Optional[_Iterable[_Union[DeviceBytes, _Mapping]]] = ..., estimated_bytes: _Optional[int] = ..., trunk_version: _Optional[int] = ..., calls_in_flight: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListReply(_message.Message):
    __slots__ = ("models", "budget")
    class BudgetEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODELS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    budget: _containers.ScalarMap[str, int]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ..., budget: _Optional[_Mapping[str, int]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("spec", "wait")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    spec: ModelSpec
    wait: bool
    def __init__(self, spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., wait: _Optional[bool] = ...) -> None: ...

class LoadReply(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelStatus
    def __init__(self, model: _Optional[_Union[ModelStatus, _Mapping]] = ...) -> None: ...

class UnloadRequest(_message.Message):
    __slots__ = ("name", "drain_timeout_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    drain_timeout_s: float
    def __init__(self, name: _Optional[str] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class UnloadReply(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelStatus
    def __init__(self, model: _Optional[_Union[ModelStatus, _Mapping]] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ("name", "spec", "wait", "drain_timeout_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: ModelSpec
    wait: bool
    drain_timeout_s: float
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., wait: _Optional[bool] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class ReloadReply(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelStatus
    def __init__(self, model: _Optional[_Union[ModelStatus, _Mapping]] = ...) -> None: ...

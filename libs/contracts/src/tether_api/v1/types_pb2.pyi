from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RiskClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RISK_CLASS_UNSPECIFIED: _ClassVar[RiskClass]
    RISK_CLASS_READ_ONLY: _ClassVar[RiskClass]
    RISK_CLASS_WRITE: _ClassVar[RiskClass]
    RISK_CLASS_IRREVERSIBLE: _ClassVar[RiskClass]
RISK_CLASS_UNSPECIFIED: RiskClass
RISK_CLASS_READ_ONLY: RiskClass
RISK_CLASS_WRITE: RiskClass
RISK_CLASS_IRREVERSIBLE: RiskClass

class Caps(_message.Message):
    __slots__ = ("max_steps", "max_wall_clock_ms", "max_tokens", "max_cost_usd_micros", "max_tool_calls")
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_WALL_CLOCK_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_COST_USD_MICROS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    max_steps: int
    max_wall_clock_ms: int
    max_tokens: int
    max_cost_usd_micros: int
    max_tool_calls: int
    def __init__(self, max_steps: _Optional[int] = ..., max_wall_clock_ms: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_cost_usd_micros: _Optional[int] = ..., max_tool_calls: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("input_tokens", "output_tokens", "cost_usd_micros")
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_USD_MICROS_FIELD_NUMBER: _ClassVar[int]
    input_tokens: int
    output_tokens: int
    cost_usd_micros: int
    def __init__(self, input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., cost_usd_micros: _Optional[int] = ...) -> None: ...

class ModelRef(_message.Message):
    __slots__ = ("provider", "name", "context_window_tokens")
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    provider: str
    name: str
    context_window_tokens: int
    def __init__(self, provider: _Optional[str] = ..., name: _Optional[str] = ..., context_window_tokens: _Optional[int] = ...) -> None: ...

class TerminationReport(_message.Message):
    __slots__ = ("reason_code", "detail", "steps_done", "tool_calls_done", "pending", "usage", "last_error", "suggested_next_action")
    REASON_CODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_DONE_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    SUGGESTED_NEXT_ACTION_FIELD_NUMBER: _ClassVar[int]
    reason_code: str
    detail: str
    steps_done: int
    tool_calls_done: _containers.RepeatedScalarFieldContainer[str]
    pending: _containers.RepeatedScalarFieldContainer[str]
    usage: Usage
    last_error: str
    suggested_next_action: str
    def __init__(self, reason_code: _Optional[str] = ..., detail: _Optional[str] = ..., steps_done: _Optional[int] = ..., tool_calls_done: _Optional[_Iterable[str]] = ..., pending: _Optional[_Iterable[str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., last_error: _Optional[str] = ..., suggested_next_action: _Optional[str] = ...) -> None: ...

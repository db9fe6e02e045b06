import datetime

from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from tether_api.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATUS_UNSPECIFIED: _ClassVar[RunStatus]
    RUN_STATUS_PENDING: _ClassVar[RunStatus]
    RUN_STATUS_RUNNING: _ClassVar[RunStatus]
    RUN_STATUS_WAITING: _ClassVar[RunStatus]
    RUN_STATUS_COMPLETED: _ClassVar[RunStatus]
    RUN_STATUS_TERMINATED: _ClassVar[RunStatus]
    RUN_STATUS_REJECTED: _ClassVar[RunStatus]
    RUN_STATUS_QUEUED: _ClassVar[RunStatus]
RUN_STATUS_UNSPECIFIED: RunStatus
RUN_STATUS_PENDING: RunStatus
RUN_STATUS_RUNNING: RunStatus
RUN_STATUS_WAITING: RunStatus
RUN_STATUS_COMPLETED: RunStatus
RUN_STATUS_TERMINATED: RunStatus
RUN_STATUS_REJECTED: RunStatus
RUN_STATUS_QUEUED: RunStatus

class Run(_message.Message):
    __slots__ = ("run_id", "agent_id", "agent_version", "status", "goal", "principal_id", "answer", "usage", "steps", "termination", "create_time", "update_time", "end_time", "last_seq", "chain_ok")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    GOAL_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_ID_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TERMINATION_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    CHAIN_OK_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    agent_id: str
    agent_version: int
    status: RunStatus
    goal: str
    principal_id: str
    answer: str
    usage: _types_pb2.Usage
    steps: int
    termination: _types_pb2.TerminationReport
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    last_seq: int
    chain_ok: bool
    def __init__(self, run_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., agent_version: _Optional[int] = ..., status: _Optional[_Union[RunStatus, str]] = ..., goal: _Optional[str] = ..., principal_id: _Optional[str] = ..., answer: _Optional[str] = ..., usage: _Optional[_Union[_types_pb2.Usage, _Mapping]] = ..., steps: _Optional[int] = ..., termination: _Optional[_Union[_types_pb2.TerminationReport, _Mapping]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_seq: _Optional[int] = ..., chain_ok: _Optional[bool] = ...) -> None: ...

class SubmitRunRequest(_message.Message):
    __slots__ = ("request_id", "agent_id", "agent_version", "goal", "caps", "delegated_scope")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    GOAL_FIELD_NUMBER: _ClassVar[int]
    CAPS_FIELD_NUMBER: _ClassVar[int]
    DELEGATED_SCOPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    agent_id: str
    agent_version: int
    goal: str
    caps: _types_pb2.Caps
    delegated_scope: DelegatedScope
    def __init__(self, request_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., agent_version: _Optional[int] = ..., goal: _Optional[str] = ..., caps: _Optional[_Union[_types_pb2.Caps, _Mapping]] = ..., delegated_scope: _Optional[_Union[DelegatedScope, _Mapping]] = ...) -> None: ...

class DelegatedScope(_message.Message):
    __slots__ = ("tools",)
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tools: _Optional[_Iterable[str]] = ...) -> None: ...

class SubmitRunResponse(_message.Message):
    __slots__ = ("run_id", "agent_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    agent_version: int
    def __init__(self, run_id: _Optional[str] = ..., agent_version: _Optional[int] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs", "next_page_token")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[Run]
    next_page_token: str
    def __init__(self, runs: _Optional[_Iterable[_Union[Run, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RunToolCall(_message.Message):
    __slots__ = ("call_id", "tool_name", "args_json", "args_hash", "status", "result_json", "error_code", "detail", "approval_id")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    ARGS_HASH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_ID_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    tool_name: str
    args_json: str
    args_hash: str
    status: str
    result_json: str
    error_code: str
    detail: str
    approval_id: str
    def __init__(self, call_id: _Optional[str] = ..., tool_name: _Optional[str] = ..., args_json: _Optional[str] = ..., args_hash: _Optional[str] = ..., status: _Optional[str] = ..., result_json: _Optional[str] = ..., error_code: _Optional[str] = ..., detail: _Optional[str] = ..., approval_id: _Optional[str] = ...) -> None: ...

class RunStep(_message.Message):
    __slots__ = ("step", "status", "usage", "assistant_text", "finish_reason", "tool_calls", "start_time", "end_time")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    step: int
    status: str
    usage: _types_pb2.Usage
    assistant_text: str
    finish_reason: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[RunToolCall]
    start_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    def __init__(self, step: _Optional[int] = ..., status: _Optional[str] = ..., usage: _Optional[_Union[_types_pb2.Usage, _Mapping]] = ..., assistant_text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[RunToolCall, _Mapping]]] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ListRunStepsRequest(_message.Message):
    __slots__ = ("run_id", "page_size", "page_token")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    page_size: int
    page_token: str
    def __init__(self, run_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRunStepsResponse(_message.Message):
    __slots__ = ("steps", "next_page_token")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[RunStep]
    next_page_token: str
    def __init__(self, steps: _Optional[_Iterable[_Union[RunStep, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("run_id", "seq", "event_id", "event_type", "record_time", "payload_json", "hash", "prev_hash", "terminal")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    RECORD_TIME_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_JSON_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    PREV_HASH_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    seq: int
    event_id: str
    event_type: str
    record_time: _timestamp_pb2.Timestamp
    payload_json: str
    hash: str
    prev_hash: str
    terminal: bool
    def __init__(self, run_id: _Optional[str] = ..., seq: _Optional[int] = ..., event_id: _Optional[str] = ..., event_type: _Optional[str] = ..., record_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., payload_json: _Optional[str] = ..., hash: _Optional[str] = ..., prev_hash: _Optional[str] = ..., terminal: _Optional[bool] = ...) -> None: ...

class StreamRunEventsRequest(_message.Message):
    __slots__ = ("run_id", "from_seq")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    from_seq: int
    def __init__(self, run_id: _Optional[str] = ..., from_seq: _Optional[int] = ...) -> None: ...

class StreamRunEventsResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: RunEvent
    def __init__(self, event: _Optional[_Union[RunEvent, _Mapping]] = ...) -> None: ...

class CancelRunRequest(_message.Message):
    __slots__ = ("run_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelRunResponse(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRunTraceRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class TraceEvent(_message.Message):
    __slots__ = ("seq", "event_type", "event_id", "record_time", "offset_ms", "since_previous_ms", "step", "call_id", "payload_json")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    RECORD_TIME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_MS_FIELD_NUMBER: _ClassVar[int]
    SINCE_PREVIOUS_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_JSON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    event_type: str
    event_id: str
    record_time: _timestamp_pb2.Timestamp
    offset_ms: int
    since_previous_ms: int
    step: int
    call_id: str
    payload_json: str
    def __init__(self, seq: _Optional[int] = ..., event_type: _Optional[str] = ..., event_id: _Optional[str] = ..., record_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., offset_ms: _Optional[int] = ..., since_previous_ms: _Optional[int] = ..., step: _Optional[int] = ..., call_id: _Optional[str] = ..., payload_json: _Optional[str] = ...) -> None: ...

class TraceSpan(_message.Message):
    __slots__ = ("name", "kind", "step", "call_id", "start_seq", "end_seq", "start_offset_ms", "duration_ms", "outcome")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    START_SEQ_FIELD_NUMBER: _ClassVar[int]
    END_SEQ_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_MS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    step: int
    call_id: str
    start_seq: int
    end_seq: int
    start_offset_ms: int
    duration_ms: int
    outcome: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., step: _Optional[int] = ..., call_id: _Optional[str] = ..., start_seq: _Optional[int] = ..., end_seq: _Optional[int] = ..., start_offset_ms: _Optional[int] = ..., duration_ms: _Optional[int] = ..., outcome: _Optional[str] = ...) -> None: ...

class GetRunTraceResponse(_message.Message):
    __slots__ = ("run", "events", "spans", "duration_ms", "truncated")
    RUN_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    run: Run
    events: _containers.RepeatedCompositeFieldContainer[TraceEvent]
    spans: _containers.RepeatedCompositeFieldContainer[TraceSpan]
    duration_ms: int
    truncated: bool
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ..., events: _Optional[_Iterable[_Union[TraceEvent, _Mapping]]] = ..., spans: _Optional[_Iterable[_Union[TraceSpan, _Mapping]]] = ..., duration_ms: _Optional[int] = ..., truncated: _Optional[bool] = ...) -> None: ...

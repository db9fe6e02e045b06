import datetime

from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from tether_api.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tool(_message.Message):
    __slots__ = ("name", "version", "description", "args_schema_json", "risk_class", "idempotent", "untrusted_source", "executor_kind", "executor_config_json", "timeout_ms", "pollable", "egress", "disabled", "create_time", "created_by", "constraints_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    ARGS_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    RISK_CLASS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENT_FIELD_NUMBER: _ClassVar[int]
    UNTRUSTED_SOURCE_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_KIND_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    POLLABLE_FIELD_NUMBER: _ClassVar[int]
    EGRESS_FIELD_NUMBER: _ClassVar[int]
    DISABLED_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    CREATED_BY_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINTS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    description: str
    args_schema_json: str
    risk_class: _types_pb2.RiskClass
    idempotent: bool
    untrusted_source: bool
    executor_kind: str
    executor_config_json: str
    timeout_ms: int
    pollable: bool
    egress: bool
    disabled: bool
    create_time: _timestamp_pb2.Timestamp
    created_by: str
    constraints_json: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., description: _Optional[str] = ..., args_schema_json: _Optional[str] = ..., risk_class: _Optional[_Union[_types_pb2.RiskClass, str]] = ..., idempotent: _Optional[bool] = ..., untrusted_source: _Optional[bool] = ..., executor_kind: _Optional[str] = ..., executor_config_json: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., pollable: _Optional[bool] = ..., egress: _Optional[bool] = ..., disabled: _Optional[bool] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., created_by: _Optional[str] = ..., constraints_json: _Optional[str] = ...) -> None: ...

class RegisterToolRequest(_message.Message):
    __slots__ = ("request_id", "tool")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tool: Tool
    def __init__(self, request_id: _Optional[str] = ..., tool: _Optional[_Union[Tool, _Mapping]] = ...) -> None: ...

class RegisterToolResponse(_message.Message):
    __slots__ = ("tool",)
    TOOL_FIELD_NUMBER: _ClassVar[int]
    tool: Tool
    def __init__(self, tool: _Optional[_Union[Tool, _Mapping]] = ...) -> None: ...

class GetToolRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class GetToolResponse(_message.Message):
    __slots__ = ("tool",)
    TOOL_FIELD_NUMBER: _ClassVar[int]
    tool: Tool
    def __init__(self, tool: _Optional[_Union[Tool, _Mapping]] = ...) -> None: ...

class ListToolsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "show_disabled")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SHOW_DISABLED_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    show_disabled: bool
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., show_disabled: _Optional[bool] = ...) -> None: ...

class ListToolsResponse(_message.Message):
    __slots__ = ("tools", "next_page_token")
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    next_page_token: str
    def __init__(self, tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DisableToolRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class DisableToolResponse(_message.Message):
    __slots__ = ("disabled_versions",)
    DISABLED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    disabled_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, disabled_versions: _Optional[_Iterable[int]] = ...) -> None: ...

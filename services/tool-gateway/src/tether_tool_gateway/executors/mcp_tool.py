"""Executor for executor_kind 'mcp': a tool of a Model Context Protocol server (streamable HTTP), via the `mcp` SDK.

Config (ToolSpec.executor_config_json):
  url           the server's streamable HTTP endpoint (e.g. http://tools.internal:8000/mcp); its path may hold
                a `secret://name` handle, resolved at execution time (http_tool.secret_path)
  tool          the tool's name on the server (Tether's name may differ: it must match [a-z][a-z0-9_]*)
  headers       extra headers; values may hold `secret://name` handles, resolved at execution time
  allow_hosts   hosts the tool may contact (default: the url's host)
  max_response_bytes  an answer (a response body; for SSE, one event) larger than this fails (default 1 MiB)

The gateway opens a session, calls `tools/call` with the validated arguments (the call's idem_key
goes in the request's `_meta` as `tether/idempotency_key`), and records the result; a result the
server flags `isError` is a tool error, and so is a JSON-RPC error the server itself answered (not
retryable for invalid request, method not found and invalid params: FINAL_JSONRPC_ERRORS). Any
other failure once the call went out (a cut connection, a proxy's 5xx, an answer that is not
JSON-RPC, a 202 with no answer) leaves open whether the tool ran (ToolError.effect_unknown). `tool_specs_from_mcp` turns a server's `tools/list` into
ToolSpecs, by default in the most restrictive class (IRREVERSIBLE, not idempotent, untrusted).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import httpx2
from httpx2._sse import _SSEParser  # the parser the SDK's EventSource uses: read the stream as the SDK does
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.dispatcher import coerce_request_id
from mcp.shared.exceptions import MCPError
from mcp_types import (
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    CallToolResult,
    ErrorData,
    JSONRPCError,
    JSONRPCMessage,
    RequestId,
    jsonrpc_message_adapter,
)

from tether_contracts.records import RiskClass, ToolSpec
from tether_security.argument_schema import NotAnObjectSchema, object_schema
from tether_tool_gateway.domain.errors import ToolError, cut_text
from tether_tool_gateway.executors.builtin import _config, _headers
from tether_tool_gateway.executors.http_tool import endpoint
from tether_tool_gateway.ports import ExecutionRequest, SecretProvider

EXECUTOR_KIND = "mcp"
IDEMPOTENCY_META_KEY = "tether/idempotency_key"
_DEADLINE_MARGIN_S = 0.25
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
DEFAULT_MAX_RESPONSE_BYTES = 1024 * 1024


class OversizedAnswer(Exception):
    """The server announced (or sent) an answer larger than the tool's cap; it is not read further."""


class InvalidServerOutput(Exception):
    """The server sent something that is not an MCP (JSON-RPC) message where only those may be."""


class ServerAnswer:
    """The JSON-RPC error the server itself sent in answer to a session's tools/call, if any, as the
    gateway's own transport code read it off the wire.

    The SDK resolves a request it got no readable answer to with a JSON-RPC error of its own making,
    of the same type (MCPError) and with the same codes as a server's: over streamable HTTP a proxy's
    5xx becomes INTERNAL_ERROR, a body that is not JSON-RPC PARSE_ERROR, a 202 or an unexpected
    content type INVALID_REQUEST, a stream that ended CONNECTION_CLOSED. The server may have run the
    tool before any of these. Only an error the server sent says it refused (`server_refused`)."""

    def __init__(self) -> None:
        self.error: ErrorData | None = None
        #: The tools/call request's id, once it is on its way (stdio: an error answers it only by this id).
        self.call_id: RequestId | None = None

    def note(self, message: JSONRPCMessage) -> None:
        """Keep `message` if it is the first JSON-RPC error answering the call (the one the SDK acts on)."""
        if self.error is None and isinstance(message, JSONRPCError):
            self.error = message.error

    def answers_call(self, request_id: RequestId | None) -> bool:
        """Whether a message with `request_id` answers the tools/call (ids correlate as the SDK's do)."""
        return (self.call_id is not None and request_id is not None
                and coerce_request_id(request_id) == coerce_request_id(self.call_id))


class _CappedBody(httpx2.AsyncByteStream):
    """A response body that fails with OversizedAnswer once more than `max_bytes` of it have arrived."""

    def __init__(self, body: httpx2.AsyncByteStream, max_bytes: int) -> None:
        self._body = body
        self._max_bytes = max_bytes

    async def __aiter__(self) -> AsyncIterator[bytes]:
        received = 0
        async for chunk in self._body:
            received += len(chunk)
            if received > self._max_bytes:
                raise OversizedAnswer(f"the MCP server's answer passed the limit of {self._max_bytes} bytes")
            yield chunk

    async def aclose(self) -> None:
        await self._body.aclose()


class _WitnessedBody(httpx2.AsyncByteStream):
    """The body of the answer to a tools/call POST, passed on unchanged; the JSON-RPC error in it, if the
    server sent one, goes to `answer`. Parsed as the SDK parses it: a JSON body whole (it is capped
    below), an SSE stream event by event (an event past `max_bytes` is left unread, as the SDK fails it)."""

    def __init__(self, body: httpx2.AsyncByteStream, answer: ServerAnswer, max_bytes: int, *, sse: bool) -> None:
        self._body = body
        self._answer = answer
        self._max_bytes = max_bytes
        self._sse = sse

    async def __aiter__(self) -> AsyncIterator[bytes]:
        events: _SSEParser | None = _SSEParser(self._max_bytes) if self._sse else None
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        whole = bytearray()
        async for chunk in self._body:
            if not self._sse:
                whole += chunk
            elif events is not None:
                try:
                    for event in events.decode(text.decode(chunk)):
                        if event.event == "message" and event.data:
                            self._note(event.data)
                except httpx2.SSEError:
                    events = None  # an event over the cap: the SDK gives up on the stream too
            yield chunk
        if not self._sse:
            self._note(bytes(whole))  # the body arrived whole: what the SDK parses

    def _note(self, data: str | bytes) -> None:
        try:
            self._answer.note(jsonrpc_message_adapter.validate_json(data, by_name=False))
        except ValueError:
            pass  # not JSON-RPC: the SDK answers the call with a PARSE_ERROR of its own

    async def aclose(self) -> None:
        await self._body.aclose()


def _is_tools_call(request: httpx2.Request) -> bool:
    if request.method != "POST":
        return False
    try:
        message = json.loads(request.content)
    except (httpx2.RequestNotRead, ValueError):
        return False
    return isinstance(message, dict) and message.get("method") == "tools/call" and "id" in message


class _CappedTransport(httpx2.AsyncBaseTransport):
    """Holds every answer to `max_bytes`, however it is sent.

    An answer announcing more (Content-Length) is refused before its body is read; any other
    body (a chunked application/json answer, which the SDK reads whole) is counted as it
    arrives. SSE bodies are left to the SDK's per-event cap: a stream of progress events may
    rightly total more than one answer. Answers must not be compressed (the client asks for
    identity): the cap counts the bytes on the wire, and a compressed body would decode past it.

    With an `answer`, the body of the answer to tools/call is also read for the server's own
    JSON-RPC error (`ServerAnswer`).
    """

    def __init__(self, inner: httpx2.AsyncBaseTransport, max_bytes: int, answer: ServerAnswer | None = None) -> None:
        self._inner = inner
        self._max_bytes = max_bytes
        self._answer = answer

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        declared = response.headers.get("content-length")
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if declared is not None and declared.isdigit() and int(declared) > self._max_bytes:
            await response.aclose()
            raise OversizedAnswer(f"the MCP server announced {declared} bytes; the limit is {self._max_bytes}")
        if encoding not in ("", "identity"):
            await response.aclose()
            raise InvalidServerOutput(f"the MCP server sent a {encoding!r}-encoded answer; only identity is accepted")
        content_type = response.headers.get("content-type", "").lower()
        sse = content_type.startswith("text/event-stream")
        if not sse:
            response.stream = _CappedBody(response.stream, self._max_bytes)
        # The content types the SDK reads an answer from (the same test as its own).
        if self._answer is not None and (sse or content_type.startswith("application/json")) \
                and _is_tools_call(request):
            response.stream = _WitnessedBody(response.stream, self._answer, self._max_bytes, sse=sse)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def _client(url: httpx.URL, headers: dict[str, str], timeout_s: float,
            max_bytes: int = DEFAULT_MAX_RESPONSE_BYTES, answer: ServerAnswer | None = None) -> Client:
    transport = _CappedTransport(httpx2.AsyncHTTPTransport(trust_env=False), max_bytes, answer)
    request_headers = httpx2.Headers(headers)
    request_headers["Accept-Encoding"] = "identity"  # whatever the config says: see _CappedTransport
    # follow_redirects off as well: the SDK itself only follows same-origin redirects.
    http = httpx2.AsyncClient(headers=request_headers, timeout=timeout_s, follow_redirects=False, trust_env=False,
                              transport=transport)
    return Client(streamable_http_client(str(url), http_client=http, max_sse_event_size=max_bytes),
                  read_timeout_seconds=timeout_s)


def _flatten(exc: BaseException) -> BaseException:
    # anyio task groups wrap the transport's errors in exception groups.
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _find(exc: BaseException, kind: type[BaseException] | tuple[type[BaseException], ...]) -> BaseException | None:
    seen: list[BaseException] = [exc]
    while seen:
        cur = seen.pop()
        if isinstance(cur, kind):
            return cur
        if isinstance(cur, BaseExceptionGroup):
            seen.extend(cur.exceptions)
        for nxt in (cur.__cause__, cur.__context__):
            if nxt is not None and nxt not in seen:
                seen.append(nxt)
    return None


def transport_error(exc: BaseException, what: str) -> ToolError:
    """The ToolError for a failed MCP exchange, whatever the transport (streamable HTTP or stdio)."""
    oversized = _find(exc, OversizedAnswer)
    if oversized is not None:
        return ToolError("OVERSIZED_RESULT", str(oversized))
    invalid = _find(exc, InvalidServerOutput)
    if invalid is not None:
        return ToolError("INVALID_RESULT", str(invalid))
    inner = _flatten(exc)
    if isinstance(inner, (TimeoutError, httpx2.TimeoutException)):
        return ToolError("TIMEOUT", f"the MCP server did not answer {what} in time", retryable=True)
    return ToolError("TOOL_ERROR", f"MCP {what} failed: {type(inner).__name__}: {inner}", retryable=True)


def server_refused(exc: BaseException, answer: ServerAnswer) -> bool:
    """Whether `exc` carries the server's own JSON-RPC error answer to tools/call (a definite refusal),
    the one `answer` saw on the wire: not an error the SDK made up for an answer that never came or
    could not be read, whatever its code."""
    refusal = _find(exc, MCPError)
    said = answer.error
    return isinstance(refusal, MCPError) and said is not None and \
        (refusal.code, refusal.message, refusal.data) == (said.code, said.message, said.data)


#: JSON-RPC errors that say the request itself is wrong (JSON-RPC 2.0 section 5.1; MCP answers an unknown
#: tool or arguments it refuses with INVALID_PARAMS): the same tools/call sent again fails the same way.
#: INTERNAL_ERROR and the server's own codes may pass (a lock, an overload) and stay retryable.
FINAL_JSONRPC_ERRORS = {INVALID_REQUEST: "invalid request", METHOD_NOT_FOUND: "method not found",
                        INVALID_PARAMS: "invalid params"}


def refusal_error(error: ToolError, exc: BaseException, answer: ServerAnswer) -> ToolError:
    """`error` (from `transport_error`) for a tools/call the server refused with its own JSON-RPC error
    (`server_refused`): the detail names the code, and a refusal of the request itself
    (FINAL_JSONRPC_ERRORS) is not retryable. Any other failure is returned as it is."""
    said = answer.error
    if said is None or not server_refused(exc, answer):
        return error
    final = FINAL_JSONRPC_ERRORS.get(said.code)
    why = f"{said.code}, {final}: sent again it would fail the same way" if final else f"{said.code}"
    return ToolError(error.code, f"{error.detail} (the server's JSON-RPC error {why})",
                     error.retryable and final is None, effect_unknown=error.effect_unknown, tail=error.tail)


def _jsonable(block: Any) -> Any:
    return block.model_dump(mode="json", by_alias=True, exclude_none=True)


class McpToolExecutor:
    """Calls one tool of an MCP server over streamable HTTP, one session per call."""

    def execute(self, request: ExecutionRequest, secrets: SecretProvider) -> Any:
        config = _config(request)
        url = endpoint(config, secrets=secrets)
        remote = config.get("tool")
        if not isinstance(remote, str) or not remote:
            raise ToolError("EXECUTOR_UNAVAILABLE", "executor config has no 'tool' (the server's tool name)")
        headers = _headers(config, secrets)
        timeout = max(0.1, request.timeout_s - _DEADLINE_MARGIN_S)
        max_bytes = config.get("max_response_bytes", DEFAULT_MAX_RESPONSE_BYTES)
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ToolError("EXECUTOR_UNAVAILABLE", "executor config 'max_response_bytes' must be a positive integer")
        if not isinstance(request.args, dict):
            raise ToolError("TOOL_ERROR", "MCP tool arguments must be a JSON object")
        return anyio.run(self._call, url, headers, remote, request.args, request.idem_key, timeout, max_bytes)

    async def _call(self, url: httpx.URL, headers: dict[str, str], remote: str, args: dict[str, Any],
                    idem_key: str, timeout: float, max_bytes: int) -> Any:
        calling = False  # the session is open and tools/call is on its way: the server may act on it
        answer = ServerAnswer()
        try:
            with anyio.fail_after(timeout):
                async with _client(url, headers, timeout, max_bytes, answer) as client:
                    calling = True
                    result = await client.call_tool(remote, args, meta={IDEMPOTENCY_META_KEY: idem_key})
        except ToolError:
            raise
        except Exception as exc:  # transport, protocol (MCPError) and timeouts alike
            error = transport_error(exc, f"tools/call {remote!r}")
            error.effect_unknown = calling and call_may_have_arrived(exc, answer)
            raise refusal_error(error, exc, answer) from exc
        return call_result(remote, result)


#: Failures that sent nothing: no connection was made, or none was free to send the request on.
_NOTHING_SENT = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout)


def call_may_have_arrived(exc: BaseException, answer: ServerAnswer) -> bool:
    """Whether a tools/call that failed with `exc` may have reached the server and taken effect.

    A connection cut or timed out after the request went out (RemoteProtocolError, ReadError,
    WriteError, ReadTimeout, WriteTimeout, the SDK's CONNECTION_CLOSED when a stream ends without
    the answer), an answer that could not be read (oversized, not JSON-RPC) or one the server did
    not give (a proxy's 5xx, a 202: the SDK's own JSON-RPC errors) leaves it unknown: the server may
    have done the work. Only a connection never made, or the server's own JSON-RPC error answer
    (`server_refused`), says it did not."""
    if _find(exc, _NOTHING_SENT) is not None:
        return False
    return not server_refused(exc, answer)


def call_result(remote: str, result: CallToolResult) -> dict[str, Any]:
    """What the gateway records for a tools/call answer; a result the server flags `isError` is a ToolError."""
    content = [_jsonable(block) for block in result.content]
    if result.is_error:
        text = " ".join(b.get("text", "") for b in content if isinstance(b, dict))
        # Bounded for memory only: the runner redacts the text whole, then shortens it.
        raise ToolError("TOOL_ERROR", f"the MCP tool {remote!r} reported an error: {cut_text(text)}")
    out: dict[str, Any] = {"content": content}
    if result.structured_content is not None:
        out["structured_content"] = result.structured_content
    return out


# -- listing and registering a server's tools ---------------------------------------------------
@dataclass(frozen=True)
class McpTool:
    """A tool as an MCP server declares it in tools/list."""

    name: str
    description: str
    input_schema: dict[str, Any]


async def declared_tools(client: Client) -> list[McpTool]:
    """Every page of the connected server's tools/list."""
    tools: list[McpTool] = []
    cursor: str | None = None
    while True:
        page = await client.list_tools(cursor=cursor)
        tools += [McpTool(t.name, t.description or "", dict(t.input_schema)) for t in page.tools]
        cursor = page.next_cursor
        if not cursor:
            return tools


def list_mcp_tools(url: str, *, headers: dict[str, str] | None = None, timeout_s: float = 30.0) -> list[McpTool]:
    """The tools the server at `url` (streamable HTTP) declares, every page of tools/list."""

    async def fetch() -> list[McpTool]:
        with anyio.fail_after(timeout_s):
            async with _client(httpx.URL(url), dict(headers or {}), timeout_s) as client:
                return await declared_tools(client)

    try:
        return anyio.run(fetch)
    except Exception as exc:
        raise transport_error(exc, "tools/list") from exc


def tether_name(remote: str, prefix: str = "") -> str:
    """A Tether tool name for a server's tool: lower-case, [a-z0-9_], starting with a letter."""
    name = re.sub(r"[^a-z0-9_]", "_", (prefix + remote).lower())
    if not name or not name[0].isalpha():
        name = "mcp_" + name
    name = name[:64]
    if not _NAME.match(name):
        raise ValueError(f"cannot make a tool name from {remote!r}")
    return name


def tool_specs_from_mcp(url: str, tools: Sequence[McpTool], *, prefix: str = "",
                        risk_class: RiskClass = RiskClass.IRREVERSIBLE, idempotent: bool = False,
                        untrusted_source: bool = True, egress: bool = True, timeout_ms: int = 30_000,
                        headers: dict[str, str] | None = None, allow_hosts: Sequence[str] | None = None,
                        constraints: dict[str, Any] | None = None, version: int = 1) -> list[ToolSpec]:
    """One ToolSpec (executor_kind 'mcp') per declared tool, with the schema the server declares.

    The defaults are the most restrictive class until an operator says otherwise: IRREVERSIBLE
    (a human approves each call under the default policy), not idempotent (never re-run after a
    crash: OutcomeUnknown), untrusted output, egress."""
    server: dict[str, Any] = {"url": url}
    if headers:
        server["headers"] = dict(headers)
    if allow_hosts is not None:
        server["allow_hosts"] = sorted({h.lower() for h in allow_hosts})
    return tool_specs(tools, executor_kind=EXECUTOR_KIND, server_config=server, prefix=prefix,
                      risk_class=risk_class, idempotent=idempotent, untrusted_source=untrusted_source,
                      egress=egress, timeout_ms=timeout_ms, constraints=constraints, version=version)


def tool_specs(tools: Sequence[McpTool], *, executor_kind: str, server_config: dict[str, Any], prefix: str = "",
               risk_class: RiskClass = RiskClass.IRREVERSIBLE, idempotent: bool = False,
               untrusted_source: bool = True, egress: bool = True, timeout_ms: int = 30_000,
               constraints: dict[str, Any] | None = None, version: int = 1) -> list[ToolSpec]:
    """One ToolSpec per declared tool of a server, whatever its transport: `server_config` (how to
    reach the server) plus `"tool": <the server's name>` is each one's executor config. The
    defaults are the most restrictive class (see `tool_specs_from_mcp`).

    Each spec's argument schema is the one the tool declares, with `"type": "object"` at its root
    (`tether_security.argument_schema.object_schema`: a root `$ref`, `allOf` or `anyOf`, as zod
    writes them, is kept and validated as declared). Raises NotAnObjectSchema, naming the tool,
    for a schema that matches no JSON object: no call of it could be valid."""
    specs = []
    for tool in tools:
        config: dict[str, Any] = {**server_config, "tool": tool.name}
        try:
            schema = object_schema(tool.input_schema)
        except NotAnObjectSchema as exc:
            raise NotAnObjectSchema(f"the input schema of the MCP tool {tool.name!r} {exc}") from None
        specs.append(ToolSpec(
            name=tether_name(tool.name, prefix),
            version=version,
            description=tool.description or f"MCP tool {tool.name}",
            args_schema_json=json.dumps(schema, sort_keys=True, separators=(",", ":")),
            risk_class=risk_class,
            idempotent=idempotent,
            untrusted_source=untrusted_source,
            executor_kind=executor_kind,
            executor_config_json=json.dumps(config, sort_keys=True, separators=(",", ":")),
            timeout_ms=timeout_ms,
            egress=egress,
            constraints_json=json.dumps(constraints or {}, sort_keys=True, separators=(",", ":")),
        ))
    return specs

"""An MCP server's own JSON-RPC error answering tools/call: which refusals are worth another try."""

from __future__ import annotations

import pytest
from mcp.shared.exceptions import MCPError
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, ErrorData, JSONRPCError

from tether_tool_gateway.executors.mcp_tool import ServerAnswer, refusal_error, transport_error


def refused(code: int, message: str = "no") -> tuple[MCPError, ServerAnswer]:
    """The SDK's error for the server's answer, and what the gateway's transport read off the wire."""
    answer = ServerAnswer()
    answer.note(JSONRPCError(jsonrpc="2.0", id=1, error=ErrorData(code=code, message=message)))
    return MCPError(code=code, message=message), answer


@pytest.mark.parametrize(("code", "retryable", "named"), [
    (INVALID_REQUEST, False, "-32600, invalid request: sent again it would fail the same way)"),
    (METHOD_NOT_FOUND, False, "-32601, method not found: sent again it would fail the same way)"),
    (INVALID_PARAMS, False, "-32602, invalid params: sent again it would fail the same way)"),
    (INTERNAL_ERROR, True, "-32603)"),
    (-32001, True, "-32001)"),  # the server's own code (a lock, an overload)
])
def test_a_refusal_of_the_request_itself_is_not_retryable(code, retryable, named):
    # Every code was retryable: an unknown tool or refused arguments were tried again to the same answer.
    exc, answer = refused(code, "Unknown tool: charge")
    error = refusal_error(transport_error(exc, "tools/call 'charge'"), exc, answer)
    assert (error.code, error.retryable, error.effect_unknown) == ("TOOL_ERROR", retryable, False)
    assert error.detail == ("MCP tools/call 'charge' failed: MCPError: Unknown tool: charge "
                            f"(the server's JSON-RPC error {named}")


def test_an_error_the_sdk_made_up_keeps_its_retry():
    # A proxy's 202 becomes the SDK's own INVALID_REQUEST: the server said nothing, so nothing is final.
    exc = MCPError(code=INVALID_REQUEST, message="Unexpected content type")
    error = transport_error(exc, "tools/call 'charge'")
    assert refusal_error(error, exc, ServerAnswer()) is error and error.retryable
    # Nor does an error the server sent count for a different one the SDK raised.
    _, answer = refused(INVALID_PARAMS, "bad")
    assert refusal_error(error, exc, answer) is error

"""The working context's vocabulary, independent of any provider's wire format."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["system", "user", "assistant", "tool"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ToolCallRef(_Frozen):
    """A tool call inside an assistant message, as it goes back to the model."""

    #: The provider's id for the call; the tool result message refers to it.
    id: str
    name: str
    #: Argument text exactly as the model sent it (for a valid call: its canonical JSON).
    arguments: str
    #: The Tether call id ('<step>.<index>') when the call became a ToolCallRequested.
    call_id: str | None = None


class ChatMessage(_Frozen):
    """One message of the working context.

    `system` messages after the start are platform notes (loop warnings); the agent's
    instructions are not a message but `ModelRequest.system`. `tool` messages carry a tool's
    result inside a data envelope (domain.tool_results).
    """

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCallRef, ...] = ()
    #: For role 'tool': the provider call id answered, the tool's name and the Tether call id.
    tool_call_id: str | None = None
    tool_name: str | None = None
    call_id: str | None = None
    #: The step whose model call produced this message (assistant) or whose call it answers.
    step: int | None = None
    #: True for the planner's own answers to malformed calls (never executed).
    repair: bool = False

    def chars(self) -> int:
        return len(self.content) + sum(len(c.name) + len(c.arguments) + len(c.id) for c in self.tool_calls)


class ToolView(_Frozen):
    """What the planner knows about a tool of the run: enough to offer it and check calls."""

    name: str
    description: str = ""
    args_schema_json: str = "{}"

    def schema(self) -> dict[str, Any]:
        """The argument JSON Schema, or an open object schema when the snapshot's is unreadable."""
        try:
            schema = json.loads(self.args_schema_json)
        except json.JSONDecodeError:
            return {"type": "object"}
        return schema if isinstance(schema, dict) else {"type": "object"}


class UsageTotals(_Frozen):
    """Tokens and cost, per call or cumulative."""

    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd_micros: int = 0

    def __add__(self, other: UsageTotals) -> UsageTotals:
        return UsageTotals(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cost_usd_micros=self.cost_usd_micros + other.cost_usd_micros,
        )


class PinnedModel(_Frozen):
    """The model a run is pinned to (from the agent snapshot in RunAccepted)."""

    provider: str
    name: str
    context_window_tokens: int = Field(128_000, ge=1)

"""The port between the planner and a model provider, and the errors a provider call can end with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tether_planner.domain.messages import ChatMessage, ToolView
from tether_planner.domain.validation import RawToolCall

#: Normalised finish reasons (ModelCallCompleted.finish_reason).
FINISH_STOP = "stop"
FINISH_TOOL_CALLS = "tool_calls"
FINISH_LENGTH = "length"
FINISH_ERROR = "error"
#: The provider ended the response for a reason the adapter does not know, or paused it (Anthropic
#: `pause_turn`): not a finished answer.
FINISH_INCOMPLETE = "incomplete"


@dataclass(frozen=True)
class ModelRequest:
    """One model call: the pinned model, the agent's instructions, the working context and the offered tools.

    `run_id`, `step` and `call` (the model call's index within the step) go out as the
    headers X-Tether-Run, X-Tether-Step and X-Tether-Call; each HTTP attempt adds X-Tether-Attempt.
    """

    model: str
    system: str
    messages: Sequence[ChatMessage]
    tools: Sequence[ToolView]
    max_tokens: int
    run_id: str
    step: int
    call: int = 0
    stream: bool = False


@dataclass(frozen=True)
class ModelResponse:
    """What the model answered. Token counts are None when the provider did not report them."""

    text: str
    tool_calls: tuple[RawToolCall, ...]
    finish_reason: str
    input_tokens: int | None
    output_tokens: int | None
    attempts: int
    latency_ms: int
    model: str
    #: The finish/stop reason as the provider sent it (for details), when there was one.
    raw_finish_reason: str | None = None
    #: Tokens reported for earlier attempts of this call that failed after being billed.
    retried_input_tokens: int = 0
    retried_output_tokens: int = 0
    #: True when part of the retried tokens is the adapter's estimate (an attempt cut before the
    #: provider reported its usage: providers/http.py `estimate_usage`).
    retried_usage_estimated: bool = False


class ProviderError(Exception):
    """A model call that did not produce a response.

    `code` is the ModelCallFailed error code (PROVIDER_ERROR or TIMEOUT), `detail` is safe to
    record (credentials scrubbed), `status` the last HTTP status if any, `attempts` the HTTP
    attempts made, `retry_after` the server's hint in seconds.
    """

    code = "PROVIDER_ERROR"

    def __init__(
        self,
        detail: str,
        *,
        status: int | None = None,
        retryable: bool = False,
        retry_after: float | None = None,
        attempts: int = 1,
        input_tokens: int = 0,
        output_tokens: int = 0,
        usage_estimated: bool = False,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status
        self.retryable = retryable
        self.retry_after = retry_after
        self.attempts = attempts
        #: Tokens of attempts that failed after the provider billed them (a stream cut after its usage
        #: chunk: as reported; cut before it: estimated); summed over the call's attempts by the adapter.
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        #: True when part of those tokens is an estimate: an attempt whose answer was cut before
        #: the provider reported its usage is billed at a deliberately high estimate, never as free.
        self.usage_estimated = usage_estimated


class ProviderTimeout(ProviderError):
    """The provider did not answer in time (after retries)."""

    code = "TIMEOUT"


class ContextOverflow(ProviderError):
    """The provider refused the request because the context is longer than the model's window."""

    code = "CONTEXT_OVERFLOW"


class MalformedResponse(ProviderError):
    """The provider answered, but not in the shape of its API (a field of the wrong type, a body that
    is not UTF-8, nesting too deep to read): a malformed answer, asked again within the step's
    malformed limit (not retried by the adapter), then MALFORMED_OUTPUT. Its usage could not be read."""

    code = "MALFORMED_OUTPUT"


class UnknownProvider(ProviderError):
    """The run's model names a provider the planner has no adapter for."""


class ModelProvider(Protocol):
    """A model provider adapter (OpenAI-compatible chat completions, Anthropic Messages, ...).

    `complete` makes the call, retrying 429/5xx/timeouts with backoff itself, and returns the
    response or raises `ProviderError` (`ContextOverflow` for a context-length refusal).
    It is called from worker threads, never from the loop thread.
    """

    def complete(self, request: ModelRequest) -> ModelResponse: ...

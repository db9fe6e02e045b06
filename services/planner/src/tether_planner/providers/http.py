"""HTTP mechanics shared by the provider adapters: retries with backoff (tenacity), Retry-After, SSE, error mapping."""

from __future__ import annotations

import email.utils
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import structlog
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from tether_planner.domain.redaction import Scrubber, cut_whole
from tether_planner.providers.deadline import attempt_deadline, deadline_transport
from tether_planner.providers.port import (
    ContextOverflow,
    MalformedResponse,
    ModelRequest,
    ProviderError,
    ProviderTimeout,
)

log = structlog.get_logger("tether_planner.providers")

T = TypeVar("T")

#: Statuses worth another attempt: timeouts, conflicts, rate limits, server errors, Anthropic's 529.
RETRYABLE_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 529})
#: An error body that is not JSON is quoted up to this many characters, scrubbed first (below)...
ERROR_TEXT_SHOWN = 500
#: ...from at most this much of it (memory; where it is cut, its last token goes: it may end inside a key).
_ERROR_TEXT_SCRUBBED = 8192
_LAST_TOKEN = re.compile(r"\S*\Z")

# How providers word a context-length refusal (OpenAI, vLLM, Ollama, llama.cpp, Anthropic).
_CONTEXT_MARKERS = (
    "context_length_exceeded",
    "maximum context length",
    "context length",
    "context window",
    "exceed_context_size",
    "exceeds the available context size",
    "prompt is too long",
    "too many tokens",
    "input is too long",
)


#: Tokens per byte for an attempt the provider billed but never reported (an answer cut before its
#: usage chunk). Deliberately high: English runs about 0.25 tokens a byte, JSON and code about 0.3,
#: so the estimate of the request body (the prompt, with its JSON framing) overstates the prompt;
#: the bytes of the answer received (with its SSE framing) overstate its output far more, so that
#: part is capped at the request's max_tokens, which the provider cannot have exceeded.
ESTIMATE_TOKENS_PER_BYTE = 0.5


def estimate_usage(prompt_bytes: int, received_bytes: int, max_tokens: int) -> tuple[int, int]:
    """A conservative (input, output) for an attempt whose usage the provider never reported."""
    output = min(max(1, max_tokens), math.ceil(received_bytes * ESTIMATE_TOKENS_PER_BYTE))
    return max(1, math.ceil(prompt_bytes * ESTIMATE_TOKENS_PER_BYTE)), output


class StreamCut(ProviderError):
    """A stream that ended before its answer was complete (retried). `reported` holds the usage the
    provider had sent by then, a count None where it had not sent its final value: the adapter
    estimates those (`estimate_usage`), since the provider billed the attempt all the same."""

    def __init__(self, detail: str, *, reported: tuple[int | None, int | None]) -> None:
        super().__init__(detail, retryable=True)
        self.reported = reported


@dataclass
class _Progress:
    """How far an attempt got: whether the provider started a 2xx answer, and its bytes read."""

    answering: bool = False
    received: int = 0


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter; a server's Retry-After wins (capped)."""

    max_attempts: int = 5
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    retry_after_max_s: float = 60.0


@dataclass(frozen=True)
class HttpSettings:
    """Where and how an adapter talks to its provider. `api_key` never leaves the Authorization header."""

    base_url: str
    api_key: str | None = None
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 120.0
    #: One attempt as a whole (connect, status, headers and body or stream): every read gets
    #: min(read_timeout_s, time left) (providers/deadline.py), so a provider that keeps a stream
    #: alive (pings, a slow drip) or goes quiet near the end cannot hold a work thread past it.
    call_timeout_s: float = 600.0
    #: Most bytes of one answer (body or stream) read before it is refused as malformed.
    max_response_bytes: int = 16 * 1024 * 1024
    retry: RetryPolicy = RetryPolicy()
    max_connections: int = 16


def parse_retry_after(headers: httpx.Headers, now: float | None = None) -> float | None:
    """Seconds to wait from `retry-after-ms` or `Retry-After` (seconds or an HTTP date)."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (now if now is not None else time.time()))


def error_message(body: Any, fallback: str) -> str:
    """The human message inside an error body of either wire format."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            code = err.get("code") or err.get("type")
            return f"{err['message']}" + (f" ({code})" if code else "")
        if isinstance(err, str):
            return err
        if body.get("message"):
            return str(body["message"])
    return fallback


def token_count(value: Any) -> int | None:
    """A usage count as sent: an integer (also 12.0), or None when absent; anything else
    (a string, a fraction, a bool, an object) is not a count (ValueError: a malformed answer)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"a token count is {type(value).__name__}, not an integer")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"a token count is {value!r}, not an integer")
    return int(value)


def usage_object(value: Any) -> dict[str, Any]:
    """The usage object of an answer ({} when absent); anything but an object is a malformed answer."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"usage is {type(value).__name__}, not an object")
    return value


def _malformed(exc: BaseException) -> MalformedResponse:
    text = str(exc)
    return MalformedResponse(
        f"INVALID_RESPONSE: the provider's answer is not in the expected shape: {type(exc).__name__}: "
        f"{cut_whole(text, 4000)}"
    )


def is_context_overflow(status: int | None, message: str) -> bool:
    if status not in (None, 400, 413, 422):
        return False
    lowered = message.lower()
    return any(m in lowered for m in _CONTEXT_MARKERS)


def status_error(response: httpx.Response, scrub: Scrubber, content: bytes | None = None) -> ProviderError:
    """The ProviderError an HTTP error response stands for (`content`: its body, if already read)."""
    try:
        text = (response.read() if content is None else content).decode("utf-8", "replace")
    except httpx.HTTPError:
        text = ""
    try:
        body: Any = json.loads(text)
    except json.JSONDecodeError:
        body = None
    # Scrub, then cut: a key cut in half matches neither its value nor its shape, and part of it would pass.
    head = text if len(text) <= _ERROR_TEXT_SCRUBBED else _LAST_TOKEN.sub("", text[:_ERROR_TEXT_SCRUBBED])
    shown = scrub(head)[:ERROR_TEXT_SHOWN]
    message = scrub(error_message(body, shown or response.reason_phrase))
    status = response.status_code
    detail = f"HTTP {status}: {message}"
    if is_context_overflow(status, message):
        return ContextOverflow(detail, status=status)
    return ProviderError(
        detail,
        status=status,
        retryable=status in RETRYABLE_STATUSES,
        retry_after=parse_retry_after(response.headers),
    )


def iter_sse(lines: Iterator[str]) -> Iterator[tuple[str | None, str]]:
    """(event, data) pairs of a server-sent-event stream; multi-line data is joined with newlines."""
    event: str | None = None
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield event, "\n".join(data)
            event, data = None, []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            event = value
        elif field == "data":
            data.append(value)
    if data:
        yield event, "\n".join(data)


class HttpProvider:
    """Base of the adapters: one pooled httpx client, retries around one attempt function."""

    def __init__(self, settings: HttpSettings, *, sleep: Callable[[float], None] = time.sleep) -> None:
        self.settings = settings
        self.scrub = Scrubber([settings.api_key] if settings.api_key else [])
        self._sleep = sleep
        limits = httpx.Limits(max_connections=settings.max_connections)
        self._client = httpx.Client(
            timeout=httpx.Timeout(settings.read_timeout_s, connect=settings.connect_timeout_s),
            limits=limits,
            transport=deadline_transport(limits),
        )
        policy = settings.retry
        self._backoff = wait_exponential_jitter(
            multiplier=policy.backoff_initial_s, max=policy.backoff_max_s, jitter=policy.backoff_initial_s
        )

    def close(self) -> None:
        self._client.close()

    @staticmethod
    def tether_headers(request: ModelRequest, attempt: int) -> dict[str, str]:
        return {
            "X-Tether-Run": request.run_id,
            "X-Tether-Step": str(request.step),
            "X-Tether-Call": str(request.call),
            "X-Tether-Attempt": str(attempt),
        }

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, ProviderError) and exc.retry_after is not None:
            return min(exc.retry_after, self.settings.retry.retry_after_max_s)
        return float(self._backoff(state))

    def with_retries(
        self, request: ModelRequest, attempt_fn: Callable[[int], T]
    ) -> tuple[T, int, tuple[int, int, bool]]:
        """Run `attempt_fn(attempt_number)` until it succeeds or a non-retryable error / the last attempt.

        Returns the value, the attempts made and the (input, output) tokens of failed attempts
        (billed though unusable) with whether any of them is estimated; a final ProviderError
        carries those sums."""
        billed = [0, 0]
        estimated = False
        retrying = Retrying(
            stop=stop_after_attempt(self.settings.retry.max_attempts),
            wait=self._wait,
            retry=retry_if_exception(lambda e: isinstance(e, ProviderError) and e.retryable),
            reraise=True,
            sleep=self._sleep,
        )
        attempt_number = 0
        try:
            for attempt in retrying:
                with attempt:
                    attempt_number = attempt.retry_state.attempt_number
                    try:
                        return attempt_fn(attempt_number), attempt_number, (billed[0], billed[1], estimated)
                    except ProviderError as exc:
                        billed[0] += exc.input_tokens
                        billed[1] += exc.output_tokens
                        estimated = estimated or exc.usage_estimated
                        log.info(
                            "model_attempt_failed",
                            run_id=request.run_id,
                            step=request.step,
                            attempt=attempt_number,
                            status=exc.status,
                            retryable=exc.retryable,
                            detail=exc.detail,
                            input_tokens=exc.input_tokens,
                            output_tokens=exc.output_tokens,
                            usage_estimated=exc.usage_estimated,
                        )
                        raise
        except ProviderError as exc:
            exc.attempts = attempt_number
            exc.input_tokens, exc.output_tokens = billed
            exc.usage_estimated = estimated
            raise
        raise ProviderError("no attempt was made", attempts=attempt_number)  # unreachable: stop_after_attempt >= 1

    def _bounded_lines(self, response: httpx.Response, deadline: float, progress: _Progress) -> Iterator[str]:
        """The response's lines, refused past the attempt's deadline or the answer's size limit."""
        for line in response.iter_lines():
            progress.received += len(line.encode("utf-8", "replace")) + 1
            self._check(progress.received, deadline)
            yield line

    def _bounded_body(self, response: httpx.Response, deadline: float, progress: _Progress | None = None) -> bytes:
        progress = progress if progress is not None else _Progress()
        chunks = []
        for chunk in response.iter_bytes():
            progress.received += len(chunk)
            self._check(progress.received, deadline)
            chunks.append(chunk)
        return b"".join(chunks)

    def _check(self, read: int, deadline: float) -> None:
        if read > self.settings.max_response_bytes:
            raise MalformedResponse(
                f"ANSWER_TOO_LARGE: the provider's answer passed {self.settings.max_response_bytes} bytes")
        if time.monotonic() > deadline:
            raise self._call_timeout()

    def _call_timeout(self) -> ProviderTimeout:
        # Not retried: a provider that kept this call alive that long would likely do it again.
        return ProviderTimeout(
            f"the model call did not finish within {self.settings.call_timeout_s:g} s (call_timeout_s)",
            retryable=False)

    def post(
        self,
        request: ModelRequest,
        url: str,
        headers: dict[str, str],
        body: dict[str, Any],
        parse: Callable[[Any], T],
        parse_stream: Callable[[Iterator[tuple[str | None, str]]], T],
    ) -> tuple[T, int, tuple[int, int]]:
        """POST with retries; `parse` reads a JSON body, `parse_stream` an SSE stream.

        An attempt cut while its 2xx answer was arriving (a stream that ends or a connection reset
        before the usage, a read timeout, the call timeout) was billed by the provider: its error
        carries the usage reported by then, the rest estimated (`estimate_usage`, marked
        `usage_estimated`)."""
        prompt_bytes = len(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace"))

        def attempt(n: int) -> T:
            all_headers = {**headers, **self.tether_headers(request, n)}
            deadline = time.monotonic() + self.settings.call_timeout_s
            progress = _Progress()
            cause: BaseException | None = None
            with attempt_deadline(deadline) as bound:
                try:
                    return self._attempt(request, url, all_headers, body, parse, parse_stream, deadline, progress)
                except httpx.TimeoutException as exc:
                    cause = exc
                    error: ProviderError = self._call_timeout() if bound.cut else ProviderTimeout(
                        f"{type(exc).__name__} talking to the model provider", retryable=True)
                except httpx.TransportError as exc:
                    cause = exc
                    error = ProviderError(
                        f"{type(exc).__name__} talking to the model provider: {self.scrub(str(exc))}", retryable=True)
                except ProviderError as exc:
                    error = exc
            if progress.answering and (isinstance(error, (StreamCut, ProviderTimeout)) or cause is not None):
                self._bill_cut(error, request, prompt_bytes, progress.received)
            if cause is None:
                raise error
            raise error from cause

        return self.with_retries(request, attempt)

    def _bill_cut(self, error: ProviderError, request: ModelRequest, prompt_bytes: int, received: int) -> None:
        """Give a cut attempt's error its usage: as reported, else estimated (and marked so)."""
        reported_in, reported_out = error.reported if isinstance(error, StreamCut) else (None, None)
        if reported_in is not None and reported_out is not None:
            error.input_tokens, error.output_tokens = max(0, reported_in), max(0, reported_out)
            return
        estimated_in, estimated_out = estimate_usage(prompt_bytes, received, request.max_tokens)
        error.input_tokens = max(0, reported_in) if reported_in is not None else estimated_in
        error.output_tokens = max(0, reported_out) if reported_out is not None else estimated_out
        error.usage_estimated = True

    def _attempt(
        self,
        request: ModelRequest,
        url: str,
        headers: dict[str, str],
        body: dict[str, Any],
        parse: Callable[[Any], T],
        parse_stream: Callable[[Iterator[tuple[str | None, str]]], T],
        deadline: float,
        progress: _Progress,
    ) -> T:
        if request.stream:
            with self._client.stream("POST", url, json=body, headers=headers) as response:
                if response.status_code >= 400:
                    raise status_error(response, self.scrub, self._bounded_body(response, deadline))
                progress.answering = True
                try:
                    return parse_stream(iter_sse(self._bounded_lines(response, deadline, progress)))
                except (ProviderError, httpx.HTTPError):
                    raise
                except Exception as exc:  # the answer's shape: untrusted input, never a crash
                    raise _malformed(exc) from exc
        with self._client.stream("POST", url, json=body, headers=headers) as response:
            progress.answering = response.status_code < 400
            content = self._bounded_body(response, deadline, progress)
        if response.status_code >= 400:
            raise status_error(response, self.scrub, content)
        try:
            data = json.loads(content)
        except json.JSONDecodeError as exc:
            raise ProviderError(f"response is not JSON: {exc}", status=response.status_code, retryable=True) from exc
        except (UnicodeDecodeError, RecursionError) as exc:
            raise _malformed(exc) from exc
        try:
            return parse(data)
        except ProviderError:
            raise
        except Exception as exc:  # the answer's shape: untrusted input, never a crash
            raise _malformed(exc) from exc

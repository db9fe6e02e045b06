"""The gateway's ports besides the ledger: executors (one per executor_kind), secrets, redaction, rate limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tether_contracts.records import ToolSpec
from tether_security import SecretNotFound
from tether_tool_gateway.domain.policy import RateAnswer
from tether_tool_gateway.domain.policy_document import RateLimit


class SecretProvider(Protocol):
    """Resolves secret names or handles (`secret://name`, from a tool's executor config) to values
    at execution time. Values never leave the executor: not in events, logs, traces or the ledger.
    In production this is `tether_security.SecretRegistry`, which also teaches the redactor each
    value it hands out."""

    def resolve(self, name: str) -> str:
        """The secret's value; raises `SecretNotFound` (tether_security's)."""
        ...


class MappingSecretProvider:
    """Secrets from a mapping (tests); production uses tether_security's providers and registry."""

    def __init__(self, secrets: Mapping[str, str] | None = None) -> None:
        self._secrets = dict(secrets or {})

    def resolve(self, name: str) -> str:
        key = name.removeprefix("secret://")
        try:
            return self._secrets[key]
        except KeyError:
            raise SecretNotFound(key) from None

    def values(self) -> list[str]:
        """Every known secret value (for a redactor)."""
        return list(self._secrets.values())


class Redactor(Protocol):
    """Scrubs secrets from tool output before it is recorded anywhere (production:
    `tether_security.Redactor`: known values in their encodings, and secret-shaped strings)."""

    def redact(self, text: str) -> str: ...


class PassthroughRedactor:
    """Redacts nothing (unit tests that are not about redaction)."""

    def redact(self, text: str) -> str:
        return text


@dataclass(frozen=True)
class ExecutionRequest:
    """One execution of a tool call, as an executor sees it."""

    tool: ToolSpec
    args: Any
    idem_key: str  # passed downstream (e.g. as an Idempotency-Key header) so re-runs are deduplicated
    run_id: str
    tenant_id: str
    call_id: str
    attempt: int
    timeout_s: float


class Executor(Protocol):
    """Runs tools of one executor_kind ('builtin', 'http', 'mcp', 'mcp_stdio', 'sandbox').

    Returns the result as a JSON-compatible value, or raises `ToolError` (TIMEOUT, TOOL_ERROR,
    INVALID_RESULT, ...). Any other exception is reported as TOOL_ERROR. Called on a worker
    thread, never on the loop thread; must honour `request.timeout_s` where it can.
    """

    def execute(self, request: ExecutionRequest, secrets: SecretProvider) -> Any: ...


class RateLimiterUnavailable(RuntimeError):
    """The limiter could not answer (no limiter configured, or its store is unreachable).
    The call does not run without an answer; it is looked at again later."""


class RateLimiter(Protocol):
    """Token buckets per (tenant, tool), shared by every gateway instance.

    `acquire` takes a token for one call, or reserves the next one and answers how long to wait.
    It is idempotent per `idem_key`: asking again for the same call returns the same grant (now
    allowed, or the remaining wait), never a second token — so a replayed or restarted call is
    not charged twice. Raises `RateLimiterUnavailable` when it cannot answer.
    """

    def acquire(self, tenant_id: str, tool_name: str, limit: RateLimit, idem_key: str) -> RateAnswer: ...

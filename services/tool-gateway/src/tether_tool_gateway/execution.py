"""Running a tool call safely: ledger intent first, execution with a timeout and a heartbeat, result after.

Everything here runs on worker threads (started with `Context.start_work`), never on the loop
thread. It returns an `Outcome`; the handlers turn outcomes into events.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import partial
from typing import Any

import structlog

from tether_contracts.records import BlobRef, ToolSpec
from tether_messaging.blobstore import BlobStore
from tether_security.redaction import marker
from tether_tool_gateway.domain.canonical import canonical_json
from tether_tool_gateway.domain.errors import ToolError
from tether_tool_gateway.domain.policy import RateAnswer
from tether_tool_gateway.domain.policy_document import RateLimit
from tether_tool_gateway.domain.results import Placement, ResultLimits
from tether_tool_gateway.ledger.port import (
    Busy,
    Execute,
    IdempotencyLedger,
    Intent,
    IntentMismatch,
    Owner,
    Resolution,
    ResolutionStatus,
    Resolved,
)
from tether_tool_gateway.ports import (
    ExecutionRequest,
    Executor,
    MappingSecretProvider,
    PassthroughRedactor,
    RateLimiter,
    RateLimiterUnavailable,
    Redactor,
    SecretProvider,
)

log = structlog.get_logger("tether_tool_gateway.execution")

_DETAIL_MAX = 1000
_UNSTORABLE = re.compile(r"[\x00\ud800-\udfff]")
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")
_MARKER = re.compile(r"\[REDACTED:([^\]\s]+)\]")


# -- outcomes ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CallRef:
    """Which call an outcome is about (everything an outcome event needs to name it)."""

    run_id: str
    tenant_id: str
    partition: int
    step: int
    call_id: str
    idem_key: str
    tool_name: str

    @classmethod
    def of(cls, intent: Intent) -> CallRef:
        return cls(intent.run_id, intent.tenant_id, intent.partition, intent.step, intent.call_id,
                   intent.idem_key, intent.tool_name)


@dataclass(frozen=True)
class Completed:
    call: CallRef
    result_json: str | None
    result_ref: BlobRef | None
    untrusted: bool
    duration_ms: int
    replayed: bool


@dataclass(frozen=True)
class Failed:
    call: CallRef
    error_code: str
    detail: str
    retryable: bool


@dataclass(frozen=True)
class Unknown:
    """A non-idempotent call's intent has no result: the run waits for a human."""

    call: CallRef
    detail: str


@dataclass(frozen=True)
class Pending:
    """No outcome yet (another claimant holds the call); nothing to emit, look again later."""

    call: CallRef
    reason: str


@dataclass(frozen=True)
class RateLimited:
    """The rate limiter said wait: nothing ran; the handlers record the decision and retry later."""

    call: CallRef
    limit: RateLimit
    answer: RateAnswer
    attempt: int


Outcome = Completed | Failed | Unknown | Pending | RateLimited


@dataclass(frozen=True)
class SweepResult:
    """What a recovery sweep of one partition took over."""

    partition: int
    resolved: list[Outcome]  # OUTCOME_UNKNOWN resolutions to emit
    to_resume: list[Execute]  # idempotent intents now leased to us: re-execute each with `resume`


def outcome_of(call: CallRef, resolution: Resolution, *, replayed: bool) -> Outcome:
    """The outcome a ledger resolution stands for."""
    if resolution.status is ResolutionStatus.COMPLETED:
        return Completed(call, resolution.result_json, resolution.result_ref, resolution.untrusted,
                         resolution.duration_ms, replayed)
    if resolution.status is ResolutionStatus.FAILED:
        return Failed(call, resolution.error_code or "TOOL_ERROR", resolution.detail, resolution.retryable)
    return Unknown(call, resolution.detail)


def _unknown_detail(what: str) -> str:
    return _short(f"{what}; the tool is not idempotent, so its effect may or may not have happened")


def _short(text: str) -> str:
    """A failure detail fit for the ledger: at most _DETAIL_MAX characters, and storable as
    PostgreSQL text (no NUL; no lone surrogate, which UTF-8 cannot encode). Every detail that
    holds text from a tool (its error, a server's body or stderr, an exception) passes here."""
    text = _UNSTORABLE.sub(lambda m: "\\u0000" if m.group() == "\x00" else "\ufffd", text)
    return text if len(text) <= _DETAIL_MAX else text[: _DETAIL_MAX - 1] + "…"


def error_detail(redactor: Redactor, error: ToolError) -> str:
    """A ToolError's detail (and tail) for the ledger: redacted whole first, then shortened.

    Never the other way round: the redactor matches a registered secret whole (in its encodings),
    and a piece of one too short for the entropy rules passes it. The tail (a stderr tail) is kept
    from its end, with at least half of the room, and starts at a whole token."""
    head = redactor.redact(error.detail)
    if not error.tail:
        return _short(head)
    if len(head) > _DETAIL_MAX // 2:
        head = head[: _DETAIL_MAX // 2 - 1] + "…"
    tail = redactor.redact(error.tail)
    room = _DETAIL_MAX - len(head)
    if len(tail) > room:
        kept = tail[len(tail) - room + 1:]
        start = re.search(r"\s", kept)
        tail = "…" + (kept[start.end():] if start is not None else kept)
    return _short(head + tail)


def redact_result(redactor: Redactor, text: str) -> str:
    """A result's canonical JSON `text` with secrets redacted, and still JSON (canonical).

    The redactor reads the text as a whole, so it sees a credential by its key (`"token":...`). Its
    spans can cross JSON syntax, though: a number under a credential key, a PEM key without its END
    line running to the end of the text. When the redacted text is not JSON, the result is redacted
    entry by entry instead: keys, and each scalar together with its key, a scalar the redactor
    changes becoming the redacted string (or a marker string where that is not JSON).
    """
    redacted = redactor.redact(text)
    if redacted == text:
        return text
    with contextlib.suppress(ValueError):
        return canonical_json(json.loads(redacted))
    shaped = canonical_json(_redact_node(redactor, json.loads(text)))
    again = redactor.redact(shaped)  # entries read apart may still show a secret read together
    if again == shaped:
        return shaped
    with contextlib.suppress(ValueError):
        return canonical_json(json.loads(again))
    return canonical_json(marker("result"))  # fail closed: nothing of the result rather than a secret


def _redact_node(redactor: Redactor, node: Any, key: str | None = None) -> Any:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            name = redactor.redact(k)
            while name in out:  # two keys redacted alike: keep both entries
                name += "'"
            out[name] = _redact_node(redactor, v, k)
        return out
    if isinstance(node, list):
        return [_redact_node(redactor, v) for v in node]
    if isinstance(node, str):
        node = redactor.redact(node)  # the string itself, its line breaks unescaped
    entry = canonical_json(node if key is None else {key: node})
    redacted = redactor.redact(entry)
    if redacted == entry:
        return node
    with contextlib.suppress(ValueError):
        parsed = json.loads(redacted)
        if key is None and isinstance(parsed, str):
            return parsed
        if key is not None and isinstance(parsed, dict) and len(parsed) == 1:
            return next(iter(parsed.values()))
    kind = _MARKER.search(redacted)
    return marker(kind.group(1) if kind else "credential")


def tool_spec_json(tool: ToolSpec) -> str:
    """A ToolSpec snapshot as stored in the ledger intent."""
    return json.dumps(tool.to_avro(), sort_keys=True)


# -- the runner --------------------------------------------------------------------------------
class ToolRunner:
    """Executes tool calls under the idempotency ledger's rules (see ledger.port)."""

    def __init__(
        self,
        *,
        ledger: IdempotencyLedger,
        executors: Mapping[str, Executor],
        blobs: BlobStore,
        owner: Owner,
        secrets: SecretProvider | None = None,
        redactor: Redactor | None = None,
        limiter: RateLimiter | None = None,
        limits: ResultLimits | None = None,
        lease_ms: int = 30_000,
        heartbeat_ms: int = 10_000,
        max_parallel: int = 16,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger = ledger
        self.owner = owner
        self._executors = dict(executors)
        self.blobs = blobs
        self._secrets = secrets or MappingSecretProvider()
        self._redactor = redactor or PassthroughRedactor()
        self._limiter = limiter
        self._limits = limits or ResultLimits()
        self.lease_ms = lease_ms
        self._heartbeat_s = heartbeat_ms / 1000
        self._monotonic = monotonic
        # Executions run on their own threads so the worker waiting for one can heartbeat the
        # lease and give up at the tool's timeout (a timed-out execution is abandoned, not killed).
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="tool-exec")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def remove_executor(self, kind: str) -> None:
        """Stop offering an executor kind (its tools then fail with EXECUTOR_UNAVAILABLE)."""
        self._executors.pop(kind, None)

    def run(self, intent: Intent, tool: ToolSpec, limit: RateLimit | None = None, attempt: int = 1) -> Outcome:
        """Execute a decided call once: pass the rate limit (if any), claim its intent, then
        execute, replay or wait. `attempt` numbers the rate-limit checks of the call."""
        call = CallRef.of(intent)
        if limit is not None:
            if self._limiter is None:
                raise RateLimiterUnavailable("the policy limits this tool but no rate limiter is configured")
            answer = self._limiter.acquire(intent.tenant_id, intent.tool_name, limit, intent.idem_key)
            if not answer.allowed:
                return RateLimited(call, limit, answer, attempt)
        executor = self._executors.get(tool.executor_kind)
        if executor is None:
            return Failed(call, "EXECUTOR_UNAVAILABLE", f"no executor for kind {tool.executor_kind!r}", False)
        try:
            claim = self.ledger.claim(intent, self.owner, self.lease_ms)
        except IntentMismatch as exc:
            return Failed(call, "TOOL_ERROR", str(exc), False)
        if isinstance(claim, Resolved):
            return outcome_of(call, claim.resolution, replayed=not claim.by_this_claim)
        if isinstance(claim, Busy):
            return Pending(call, "another gateway instance holds the call's lease")
        return self._execute(claim, tool, executor)

    def resume(self, claim: Execute) -> Outcome:
        """Re-execute an idempotent intent a sweep took over (the lease is already ours)."""
        intent = claim.record.intent
        tool = ToolSpec.from_avro(json.loads(intent.tool_spec_json))
        executor = self._executors.get(tool.executor_kind)
        if executor is None:
            resolution = Resolution(ResolutionStatus.FAILED, error_code="EXECUTOR_UNAVAILABLE",
                                    detail=f"no executor for kind {tool.executor_kind!r}")
            return self._complete(claim, resolution)
        return self._execute(claim, tool, executor)

    def sweep(self, partition: int, limit: int = 100) -> SweepResult:
        """Take over this partition's unresolved intents whose lease expired."""
        resolved: list[Outcome] = []
        to_resume: list[Execute] = []
        for claim in self.ledger.sweep(self.owner, self.lease_ms, partitions=[partition], limit=limit):
            if isinstance(claim, Execute):
                to_resume.append(claim)
            elif isinstance(claim, Resolved):
                resolved.append(outcome_of(CallRef.of(claim.record.intent), claim.resolution, replayed=False))
        if resolved or to_resume:
            log.info("sweep_took_over", partition=partition, unknown=len(resolved), re_execute=len(to_resume))
        return SweepResult(partition, resolved, to_resume)

    # -- execution -----------------------------------------------------------------------------
    def _execute(self, claim: Execute, tool: ToolSpec, executor: Executor) -> Outcome:
        intent = claim.record.intent
        request = ExecutionRequest(
            tool=tool,
            args=json.loads(intent.args_json),
            idem_key=intent.idem_key,
            run_id=intent.run_id,
            tenant_id=intent.tenant_id,
            call_id=intent.call_id,
            attempt=claim.attempt,
            timeout_s=tool.timeout_ms / 1000,
        )
        log.info("tool_executing", run_id=intent.run_id, call_id=intent.call_id, tool=tool.name,
                 attempt=claim.attempt, resumed=claim.resumed)
        started = self._monotonic()
        deadline = started + request.timeout_s
        future = self._pool.submit(executor.execute, request, self._secrets)
        abandoned = False
        while True:
            remaining = deadline - self._monotonic()
            if remaining <= 0:
                abandoned = not future.cancel()
                if abandoned and not tool.idempotent:
                    # Still running, and nobody can say whether its effect has happened or will:
                    # reporting a failure would invite the model to do it again.
                    resolution = Resolution(ResolutionStatus.OUTCOME_UNKNOWN, detail=_unknown_detail(
                        f"TIMEOUT: the tool did not finish within {tool.timeout_ms} ms and was left running"))
                else:
                    resolution = Resolution(ResolutionStatus.FAILED, error_code="TIMEOUT",
                                            detail=f"the tool did not finish within {tool.timeout_ms} ms"
                                            + ("" if abandoned else " (it never started)"),
                                            retryable=tool.idempotent)
                break
            try:
                value = future.result(timeout=min(remaining, self._heartbeat_s))
            except FutureTimeout:
                if not self._heartbeat(intent.idem_key, claim.token):
                    # Someone took the call over (our lease lapsed); they resolve it.
                    return Pending(CallRef.of(intent), "lease lost while executing")
                continue
            except ToolError as exc:
                detail = error_detail(self._redactor, exc)
                if exc.effect_unknown and not tool.idempotent:
                    # The request may have reached the other side (an HTTP POST sent, an email's
                    # DATA sent) with the answer lost: unknown, as after a crash mid-call; a human
                    # decides, and the model is not told it failed (it would try again).
                    resolution = Resolution(ResolutionStatus.OUTCOME_UNKNOWN, detail=_unknown_detail(
                        f"{exc.code}: {detail}"))
                else:
                    resolution = Resolution(ResolutionStatus.FAILED, error_code=exc.code, detail=detail,
                                            retryable=exc.retryable)
                break
            except Exception as exc:  # an executor bug or an unexpected library error
                detail = _short(self._redactor.redact(f"{type(exc).__name__}: {exc}"))
                resolution = Resolution(ResolutionStatus.FAILED, error_code="TOOL_ERROR", detail=detail,
                                        retryable=tool.idempotent)
                break
            resolution = self._shape(value, tool)
            break
        duration_ms = int((self._monotonic() - started) * 1000)
        outcome = self._complete(claim, dataclasses.replace(resolution, duration_ms=duration_ms))
        if abandoned:
            # Still running: if it ever finishes, keep what it did as the call's late resolution.
            future.add_done_callback(partial(self._record_late, claim, tool))
        return outcome

    def _record_late(self, claim: Execute, tool: ToolSpec, future: Future[Any]) -> None:
        try:
            exc = future.exception()
            if exc is None:
                late = self._shape(future.result(), tool)
            else:
                error = exc if isinstance(exc, ToolError) else ToolError("TOOL_ERROR", f"{type(exc).__name__}: {exc}")
                late = Resolution(ResolutionStatus.FAILED, error_code=error.code,
                                  detail=error_detail(self._redactor, error))
            self.ledger.complete(claim.record.intent.idem_key, claim.token, late)
        except Exception as err:  # best effort: the call's outcome (TIMEOUT) is already recorded
            log.warning("late_result_not_recorded", idem_key=claim.record.intent.idem_key,
                        error=f"{type(err).__name__}: {err}")

    def _heartbeat(self, idem_key: str, token: str) -> bool:
        try:
            return self.ledger.heartbeat(idem_key, token, self.lease_ms)
        except Exception as exc:  # a ledger hiccup: keep executing, the next heartbeat may pass
            log.warning("heartbeat_failed", idem_key=idem_key, error=f"{type(exc).__name__}: {exc}")
            return True

    def _shape(self, value: object, tool: ToolSpec) -> Resolution:
        """Canonical JSON → redaction → inline, claim check, or refused as oversized."""
        try:
            text = canonical_json(value)
        except (TypeError, ValueError) as exc:
            return self._unrecordable(tool, "INVALID_RESULT", _short(f"the tool's result is not JSON: {exc}"))
        # A lone surrogate (a JSON "\ud800" decodes to one) cannot be UTF-8 encoded, nor stored: in
        # canonical JSON it can only stand inside a string, so U+FFFD keeps the text JSON.
        text = redact_result(self._redactor, _LONE_SURROGATE.sub("\ufffd", text))
        data = text.encode("utf-8")
        placement = self._limits.place(len(data))
        if placement is Placement.OVERSIZED:
            return self._unrecordable(tool, "OVERSIZED_RESULT",
                                      f"the result is {len(data)} bytes; the limit is {self._limits.max_bytes}")
        if placement is Placement.BLOB:
            ref = self.blobs.put(data, "application/json")
            return Resolution(ResolutionStatus.COMPLETED, result_ref=ref, untrusted=tool.untrusted_source)
        return Resolution(ResolutionStatus.COMPLETED, result_json=text, untrusted=tool.untrusted_source)

    def _unrecordable(self, tool: ToolSpec, code: str, detail: str) -> Resolution:
        """A result the tool returned but the gateway cannot record. The tool did finish, so its effect
        took place: a non-idempotent call completes with `{"result_unrecorded": {code, detail}}`
        (reported as a failure it would invite the model to do it again); an idempotent one fails."""
        if tool.idempotent:
            return Resolution(ResolutionStatus.FAILED, error_code=code, detail=detail)
        text = canonical_json({"result_unrecorded": {"code": code, "detail": detail}})
        return Resolution(ResolutionStatus.COMPLETED, result_json=text, untrusted=tool.untrusted_source)

    def _complete(self, claim: Execute, resolution: Resolution) -> Outcome:
        call = CallRef.of(claim.record.intent)
        completion = self.ledger.complete(call.idem_key, claim.token, resolution)
        if completion.recorded:
            return outcome_of(call, resolution, replayed=False)
        if completion.resolution is not None:
            return outcome_of(call, completion.resolution, replayed=True)
        return Pending(call, "another claimant holds the call")

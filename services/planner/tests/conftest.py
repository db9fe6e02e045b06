"""A harness around the planner processor on the in-memory driver, against the scripted model server over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    AgentSpec,
    Caps,
    Envelope,
    ModelRef,
    Remaining,
    RiskClass,
    RunAccepted,
    StepGranted,
    ToolCallCompleted,
    ToolCallDenied,
    ToolCallFailed,
    ToolCallRequested,
    ToolSpec,
)
from tether_messaging.envelopes import derived_id, make_envelope
from tether_messaging.serde import encode
from tether_messaging.testing import Emitted, InMemoryDriver
from tether_messaging.topics import RUN_EVENTS, RUN_INTAKE, Topics
from tether_modelserver import ModelServer, bundled_scenarios_dir, load_scenarios
from tether_planner.domain.redaction import Scrubber
from tether_planner.entrypoint import PlannerProcessor
from tether_planner.handlers import Deps, Limits
from tether_planner.metrics import PlannerMetrics
from tether_planner.pricing import PricingTable
from tether_planner.providers.anthropic import AnthropicProvider
from tether_planner.providers.http import HttpSettings, RetryPolicy
from tether_planner.providers.openai import OpenAIChatProvider
from tether_planner.providers.registry import ProviderRegistry
from tether_planner.step import StepConfig

SCENARIOS = Path(__file__).parent / "scenarios"
API_KEY = "sk-test-secret-0123456789"
SCRIPTED = ModelRef(provider="openai", name="tether-scripted")


def schema(**props: str) -> str:
    return json.dumps(
        {
            "type": "object",
            "properties": {name: {"type": kind} for name, kind in props.items()},
            "required": sorted(props),
            "additionalProperties": False,
        }
    )


def tool(name: str, args_schema_json: str, *, untrusted: bool = False) -> ToolSpec:
    return ToolSpec(
        name=name,
        version=1,
        description=f"The {name} tool.",
        args_schema_json=args_schema_json,
        risk_class=RiskClass.READ_ONLY,
        idempotent=True,
        untrusted_source=untrusted,
        executor_kind="builtin",
    )


TOOLS = [
    tool("http_get", schema(url="string"), untrusted=True),
    tool("kv_put", schema(key="string", value="string")),
    tool("send_email", schema(to="string", subject="string", body="string")),
]


class Harness:
    """Drives one planner processor. Log events are made as the budget would seal them
    (sequence numbers per run); the planner's own intake events can be echoed back sequenced."""

    def __init__(
        self,
        server: ModelServer,
        *,
        stream: bool = False,
        malformed_limit: int = 3,
        max_attempts: int = 3,
        state_max_bytes: int = StepConfig().state_max_bytes,
    ) -> None:
        self.server = server
        self.registry = CollectorRegistry()
        retry = RetryPolicy(max_attempts=max_attempts, backoff_initial_s=0.01, backoff_max_s=0.05, retry_after_max_s=1)
        providers = ProviderRegistry(
            {
                "openai": OpenAIChatProvider(HttpSettings(server.base_url, API_KEY, read_timeout_s=10, retry=retry)),
                "anthropic": AnthropicProvider(HttpSettings(server.url, API_KEY, read_timeout_s=10, retry=retry)),
            }
        )
        self.providers = providers
        self.deps = Deps(
            topics=Topics(),
            providers=providers,
            pricing=PricingTable(),
            step_config=StepConfig(stream=stream, malformed_limit=malformed_limit, state_max_bytes=state_max_bytes),
            limits=Limits(),
            metrics=PlannerMetrics(self.registry),
            scrub=Scrubber([API_KEY]),
        )
        self.processor = PlannerProcessor(self.deps)
        self.driver = InMemoryDriver(self.processor, producer_name="budget")
        self.seqs: dict[str, int] = {}
        self.log_envelopes: dict[str, list[Envelope]] = {}

    # -- the log, as the budget writes it ---------------------------------------------------
    def sealed(self, run_id: str, payload: AvroRecord, event_id: str | None = None, producer: str = "budget") -> Envelope:
        seq = self.seqs.get(run_id, 0) + 1
        self.seqs[run_id] = seq
        env = make_envelope(
            payload,
            run_id=run_id,
            tenant_id="t1",
            event_id=event_id or derived_id(run_id, payload.AVRO_NAME, seq),
            producer=producer,
            recorded_at_ms=self.driver.now_ms,
        )
        env = env.model_copy(update={"seq": seq, "prev_hash": "0" * 64, "hash": f"{seq:064x}"})
        self.log_envelopes.setdefault(run_id, []).append(env)
        return env

    def feed(self, env: Envelope) -> list[Emitted]:
        return self.driver.feed(RUN_EVENTS, env)

    def log(self, run_id: str, payload: AvroRecord) -> list[Emitted]:
        return self.feed(self.sealed(run_id, payload))

    def accept(
        self,
        run_id: str,
        goal: str,
        *,
        model: ModelRef = SCRIPTED,
        tools: list[ToolSpec] | None = None,
        allowlist: list[str] | None = None,
        instructions: str = "You are a careful assistant. Use tools when needed.",
        compaction_threshold: float = 0.8,
    ) -> None:
        tools = TOOLS if tools is None else tools
        caps = Caps(max_steps=10, max_wall_clock_ms=600_000, max_tokens=1_000_000, max_cost_usd_micros=10_000_000)
        agent = AgentSpec(
            agent_id="a1",
            version=1,
            name="agent",
            instructions=instructions,
            model=model,
            tool_allowlist=allowlist if allowlist is not None else [t.name for t in tools],
            caps=caps,
            compaction_threshold=compaction_threshold,
        )
        self.log(
            run_id,
            RunAccepted(
                principal_id="p1",
                request_id="r1",
                goal=goal,
                agent=agent,
                tools=tools,
                caps=caps,
                tenant_grants=[t.name for t in tools],
                deadline_ms=self.driver.now_ms + 600_000,
            ),
        )

    def grant(self, run_id: str, step: int, *, tokens: int = 1_000_000, loop_warning: str | None = None) -> Envelope:
        env = self.sealed(
            run_id,
            StepGranted(
                step=step,
                remaining=Remaining(steps=10 - step, tokens=tokens, cost_usd_micros=10_000_000, wall_clock_ms=600_000),
                loop_warning=loop_warning,
            ),
        )
        assert self.feed(env) == []
        return env

    def work(self) -> list[AvroRecord]:
        """Run the started model work; the planner's emitted payloads."""
        return [e.payload for e in self.driver.run_work()]

    def echo(self, run_id: str, payloads: list[AvroRecord]) -> None:
        """Append the planner's intake events to the log, as the budget sequences them."""
        for p in payloads:
            self.log(run_id, p)

    def step(self, run_id: str, step: int, **grant: Any) -> list[AvroRecord]:
        """Grant a step, run the model work, echo the outcome into the log; returns the outcome."""
        self.grant(run_id, step, **grant)
        out = self.work()
        self.echo(run_id, out)
        return out

    def complete(self, run_id: str, request: ToolCallRequested, result: Any, *, untrusted: bool = False) -> None:
        c = request.call
        self.log(
            run_id,
            ToolCallCompleted(
                step=request.step,
                call_id=c.call_id,
                idem_key=c.idem_key,
                tool_name=c.tool_name,
                result_json=json.dumps(result) if not isinstance(result, str) else result,
                untrusted=untrusted,
                duration_ms=5,
            ),
        )

    def deny(self, run_id: str, request: ToolCallRequested, reason: str = "APPROVAL_REJECTED") -> None:
        c = request.call
        self.log(
            run_id,
            ToolCallDenied(
                step=request.step,
                call_id=c.call_id,
                idem_key=c.idem_key,
                tool_name=c.tool_name,
                reason_code=reason,
                detail="a human said no",
                policy_version="p1",
                inputs_hash="0" * 64,
            ),
        )

    def fail(self, run_id: str, request: ToolCallRequested) -> None:
        c = request.call
        self.log(
            run_id,
            ToolCallFailed(
                step=request.step,
                call_id=c.call_id,
                idem_key=c.idem_key,
                tool_name=c.tool_name,
                error_code="TIMEOUT",
                detail="took too long",
                retryable=True,
            ),
        )

    def requests(self, run_id: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.server.requests() if run_id is None or r["headers"].get("x-tether-run") == run_id]

    def intake(self) -> list[Emitted]:
        return [e for e in self.driver.emitted if e.topic == RUN_INTAKE]

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def close(self) -> None:
        self.providers.close()


#: A tool that takes any object: the answer's shape, not the tool's schema, is under test.
OPEN_TOOLS = [tool("anything", json.dumps({"type": "object"}))]
Answer = dict[str, Any] | bytes | Callable[[httpx.Request], httpx.Response]


class _NoServer:
    base_url = "http://model.invalid/v1"
    url = "http://model.invalid"

    def requests(self) -> list[dict[str, Any]]:
        return []


class Mocked(Harness):
    """A harness whose adapters get their answers, in order, from `answers`."""

    def __init__(self, answers: list[Answer], **kw: Any) -> None:
        super().__init__(_NoServer(), **kw)  # type: ignore[arg-type]
        pending = iter(answers)
        self.http_requests: list[httpx.Request] = []

        def handler(request: httpx.Request) -> httpx.Response:
            self.http_requests.append(request)
            answer = next(pending)
            if callable(answer):
                return answer(request)
            if isinstance(answer, bytes):
                return httpx.Response(200, content=answer, headers={"content-type": "application/json"})
            return httpx.Response(200, json=answer)

        for name in ("openai", "anthropic"):
            adapter = self.providers.get(name)
            adapter._client = httpx.Client(transport=httpx.MockTransport(handler))
            adapter._sleep = lambda _s: None

    def run(self, *, open_tools: bool = False, model: ModelRef = SCRIPTED) -> list[AvroRecord]:
        self.accept("r1", "fetch https://example.com", tools=OPEN_TOOLS if open_tools else None, model=model)
        self.grant("r1", 1)
        out = self.work()
        state = self.driver.states.get("r1")
        assert state is None or state.pending is None, "the step was left pending"
        for payload in out:
            encode(payload)  # everything emitted can be written
        return out


@pytest.fixture
def mock_model() -> Iterator[Callable[..., Mocked]]:
    """Harnesses whose model answers are given (bodies, raw bytes or handlers), in order."""
    made: list[Mocked] = []

    def make(answers: list[Answer], **kw: Any) -> Mocked:
        h = Mocked(answers, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@pytest.fixture
def model_server(tmp_path: Path) -> Iterator[ModelServer]:
    scenarios = load_scenarios([SCENARIOS, bundled_scenarios_dir()])
    with ModelServer(scenarios, request_log=tmp_path / "model-requests.jsonl") as server:
        yield server


@pytest.fixture
def harness(model_server: ModelServer) -> Iterator[Harness]:
    h = Harness(model_server)
    yield h
    h.close()


@pytest.fixture
def make_harness(model_server: ModelServer) -> Iterator[Any]:
    made: list[Harness] = []

    def make(**kw: Any) -> Harness:
        h = Harness(model_server, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def types(records: list[AvroRecord]) -> list[str]:
    return [type(r).__name__ for r in records]


@pytest.fixture
def kinds():
    return types


"""Builds the planner processor and its adapters from settings (no I/O besides topic declaration)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry
from pydantic import SecretStr

from tether_messaging.topics import Topics
from tether_planner.domain.redaction import Scrubber
from tether_planner.entrypoint import PlannerProcessor
from tether_planner.handlers import Deps, Limits
from tether_planner.metrics import PlannerMetrics
from tether_planner.pricing import Price, PricingTable
from tether_planner.providers.anthropic import AnthropicProvider
from tether_planner.providers.http import HttpSettings, RetryPolicy
from tether_planner.providers.openai import OpenAIChatProvider
from tether_planner.providers.registry import ProviderRegistry
from tether_planner.settings import PlannerSettings
from tether_planner.step import StepConfig
from tether_runtime.logging import log_redactor


def _secret(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value is not None else None


def build_providers(settings: PlannerSettings) -> ProviderRegistry:
    """The OpenAI-compatible and Anthropic adapters with their credentials."""
    retry = RetryPolicy(
        max_attempts=settings.max_attempts,
        backoff_initial_s=settings.backoff_initial_s,
        backoff_max_s=settings.backoff_max_s,
        retry_after_max_s=settings.retry_after_max_s,
    )

    def http(base_url: str, key: str | None) -> HttpSettings:
        return HttpSettings(
            base_url=base_url,
            api_key=key,
            connect_timeout_s=settings.connect_timeout_s,
            read_timeout_s=settings.read_timeout_s,
            call_timeout_s=settings.call_timeout_s,
            max_response_bytes=settings.max_response_bytes,
            retry=retry,
            max_connections=max(4, settings.work_threads),
        )

    openai = OpenAIChatProvider(
        http(settings.llm_base_url or settings.openai_base_url, _secret(settings.openai_api_key)),
        max_tokens_param=settings.openai_max_tokens_param,
    )
    anthropic = AnthropicProvider(
        http(settings.anthropic_base_url, _secret(settings.anthropic_api_key)), version=settings.anthropic_version
    )
    # Self-hosted OpenAI-compatible servers may be named for what they are.
    return ProviderRegistry(
        {
            "openai": openai,
            "openai-compatible": openai,
            "vllm": openai,
            "ollama": openai,
            "llamacpp": openai,
            "anthropic": anthropic,
        }
    )


def build_deps(
    settings: PlannerSettings, *, providers: ProviderRegistry | None = None, registry: CollectorRegistry = REGISTRY
) -> Deps:
    """The handlers' dependencies as the settings describe them."""
    pricing = PricingTable(default=Price(settings.default_input_usd_per_mtok, settings.default_output_usd_per_mtok))
    if settings.pricing_file is not None:
        pricing = pricing.with_file(settings.pricing_file)
    secrets = [s for s in (_secret(settings.openai_api_key), _secret(settings.anthropic_api_key)) if s]
    # Log lines go through the process-wide redactor, not the events' scrubber: it must know the
    # keys too (a provider's error text is logged before it is recorded).
    log_redactor().add_secrets(secrets)
    return Deps(
        topics=Topics(settings.topic_prefix),
        providers=providers or build_providers(settings),
        pricing=pricing,
        step_config=StepConfig(
            max_output_tokens=settings.max_output_tokens,
            malformed_limit=settings.malformed_limit,
            stream=settings.stream,
            keep_turns=settings.compaction_keep_turns,
            summary_max_chars=settings.summary_max_chars,
            state_max_bytes=settings.state_max_bytes,
            max_tool_calls=settings.max_tool_calls,
            max_tool_args_bytes=settings.max_tool_args_bytes,
            max_text_bytes=settings.max_text_bytes,
            assert_formats=frozenset(settings.assert_formats),
        ),
        limits=Limits(
            assistant_text_max_chars=settings.assistant_text_max_chars,
            answer_max_chars=settings.answer_max_chars,
            tool_result_max_chars=settings.tool_result_max_chars,
        ),
        metrics=PlannerMetrics(registry),
        scrub=Scrubber(secrets),
    )


def build_processor(settings: PlannerSettings, *, registry: CollectorRegistry = REGISTRY) -> PlannerProcessor:
    """The planner processor wired from settings."""
    return PlannerProcessor(build_deps(settings, registry=registry))


def declare_topics(settings: PlannerSettings) -> None:
    """Create the topics the planner reads and writes (and its changelog) if missing; idempotent."""
    from tether_messaging.admin import declare_topics as declare

    declare(settings.kafka_bootstrap, settings.partitions, [PlannerProcessor.name], prefix=settings.topic_prefix,
            replication_factor=settings.topic_replication_factor)

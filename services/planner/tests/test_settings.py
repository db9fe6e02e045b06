"""Settings and bootstrap: environment names, credentials kept secret, adapters wired from settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tether_planner.bootstrap import build_deps
from tether_planner.providers.anthropic import AnthropicProvider
from tether_planner.providers.openai import OpenAIChatProvider
from tether_planner.providers.port import UnknownProvider
from tether_planner.settings import PlannerSettings


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"version": "test-1", "models": {"local-llama": [0, 0]}}))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret-1234")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-secret-5678")
    monkeypatch.setenv("TETHER_LLM_BASE_URL", "http://127.0.0.1:8089/v1")
    monkeypatch.setenv("TETHER_PLANNER_STREAM", "true")
    monkeypatch.setenv("TETHER_PLANNER_MAX_ATTEMPTS", "7")
    monkeypatch.setenv("TETHER_PLANNER_STATE_MAX_BYTES", "300000")
    monkeypatch.setenv("TETHER_PLANNER_PRICING_FILE", str(prices))
    monkeypatch.setenv("TETHER_TOPIC_PREFIX", "p.")
    settings = PlannerSettings()
    assert settings.llm_base_url == "http://127.0.0.1:8089/v1"
    assert settings.stream is True and settings.max_attempts == 7
    assert "sk-openai-secret-1234" not in repr(settings) and "sk-ant-secret-5678" not in str(settings.model_dump())

    deps = build_deps(settings, registry=CollectorRegistry())
    try:
        openai = deps.providers.get("openai")
        assert isinstance(openai, OpenAIChatProvider)
        assert openai.settings.base_url == "http://127.0.0.1:8089/v1"
        assert openai.settings.api_key == "sk-openai-secret-1234"
        assert openai.settings.retry.max_attempts == 7
        assert openai.max_tokens_param == "max_tokens"
        assert deps.providers.get("vllm") is openai
        anthropic = deps.providers.get("anthropic")
        assert isinstance(anthropic, AnthropicProvider)
        assert anthropic.url() == "https://api.anthropic.com/v1/messages"
        with pytest.raises(UnknownProvider):
            deps.providers.get("acme")
        assert deps.step_config.stream is True and deps.step_config.state_max_bytes == 300_000
        assert deps.topics.run_intake == "p.tether.run-intake.v1"
        assert deps.pricing.version == "test-1" and deps.pricing.cost("local-llama", 10, 10).priced
        assert deps.scrub("key sk-ant-secret-5678") == "key [redacted]"
    finally:
        deps.providers.close()


def test_defaults_without_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "TETHER_LLM_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    settings = PlannerSettings()
    deps = build_deps(settings, registry=CollectorRegistry())
    try:
        openai = deps.providers.get("openai")
        assert openai.settings.base_url == "https://api.openai.com/v1"
        assert openai.settings.api_key is None
        assert openai.max_tokens_param == "max_completion_tokens"
    finally:
        deps.providers.close()


def test_the_provider_keys_are_registered_with_the_log_redactor(monkeypatch: pytest.MonkeyPatch) -> None:
    # Log lines are redacted by the process-wide redactor, not by the events' scrubber: a provider's
    # error text is logged before it is recorded, so that redactor must know the keys too. (A key
    # with no recognisable shape: only registration catches it.)
    from tether_runtime.logging import log_redactor

    key = "local-model-key-plain-words"
    assert key in log_redactor().redact(f"provider said: bad key {key}")
    monkeypatch.setenv("OPENAI_API_KEY", key)
    deps = build_deps(PlannerSettings(), registry=CollectorRegistry())
    deps.providers.close()
    assert key not in log_redactor().redact(f"provider said: bad key {key}")


def test_the_formats_checked_before_a_call_follow_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from tether_security.argument_schema import ASSERTABLE_FORMATS

    # By default every format (as the gateway's default policy asserts: tests/test_planner_formats_agree.py).
    assert set(PlannerSettings().assert_formats) == ASSERTABLE_FORMATS
    monkeypatch.setenv("TETHER_PLANNER_ASSERT_FORMATS", '["uri", "date", "uri"]')
    settings = PlannerSettings()
    assert settings.assert_formats == ["date", "uri"]
    deps = build_deps(settings, registry=CollectorRegistry())
    try:
        assert deps.step_config.assert_formats == frozenset({"date", "uri"})
    finally:
        deps.providers.close()
    monkeypatch.setenv("TETHER_PLANNER_ASSERT_FORMATS", '["phone"]')  # not one the gateway can assert
    with pytest.raises(ValueError, match="phone"):
        PlannerSettings()

"""The planner's settings (env prefix TETHER_PLANNER_; provider credentials from their usual names)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from tether_runtime.settings import LoopServiceSettings
from tether_security.argument_schema import ASSERTABLE_FORMATS, check_assertable


class PlannerSettings(LoopServiceSettings):
    """Everything `python -m tether_planner` reads from the environment.

    API keys are `SecretStr`: they are handed to the adapters' HTTP headers and nowhere else
    (never logged, never put in events).
    """

    model_config = SettingsConfigDict(env_prefix="TETHER_PLANNER_", extra="ignore", populate_by_name=True)

    declare_topics: bool = Field(True, description="Create missing topics at start-up (idempotent).")

    # -- providers --------------------------------------------------------------------------
    openai_api_key: SecretStr | None = Field(None, validation_alias=AliasChoices("OPENAI_API_KEY"),
                                           description="OpenAI API key (a secret: never logged or recorded).")
    anthropic_api_key: SecretStr | None = Field(None, validation_alias=AliasChoices("ANTHROPIC_API_KEY"),
                                              description="Anthropic API key (a secret: never logged or recorded).")
    llm_base_url: str | None = Field(
        None,
        validation_alias=AliasChoices("TETHER_LLM_BASE_URL"),
        description="Base URL (…/v1) of the OpenAI-compatible server: vLLM, Ollama, llama.cpp, the scripted server.",
    )
    openai_base_url: str = Field("https://api.openai.com/v1", description="Used when TETHER_LLM_BASE_URL is not set.")
    anthropic_base_url: str = Field("https://api.anthropic.com", description="Base URL of the Messages API.")
    anthropic_version: str = Field("2023-06-01", description="The anthropic-version header.")
    openai_max_tokens_param: Literal["auto", "max_tokens", "max_completion_tokens"] = Field(
        "auto", description="auto: max_completion_tokens for api.openai.com, max_tokens elsewhere."
    )
    stream: bool = Field(False, description="Stream responses (SSE) instead of waiting for the whole body.")

    # -- retries and timeouts ----------------------------------------------------------------
    connect_timeout_s: float = Field(10.0, gt=0, description="TCP/TLS connect timeout of a model call.")
    read_timeout_s: float = Field(120.0, gt=0, description="Per read; with streaming, between chunks.")
    call_timeout_s: float = Field(600.0, gt=0, description="One model-call attempt as a whole (every connect "
                                  "and read gets min(its timeout, time left)); past it the step fails with "
                                  "TIMEOUT, not retried.")
    max_response_bytes: int = Field(16 * 1024 * 1024, gt=0, description="Most bytes of one model answer (body "
                                    "or stream); a larger one is a malformed answer.")
    max_attempts: int = Field(5, ge=1, description="HTTP attempts per model call (429/5xx/timeouts are retried).")
    backoff_initial_s: float = Field(0.5, ge=0, description="First wait before retrying a model call (doubles, jittered).")
    backoff_max_s: float = Field(30.0, ge=0, description="Longest wait between model-call attempts.")
    retry_after_max_s: float = Field(60.0, ge=0, description="Longest Retry-After honoured.")

    # -- the step -----------------------------------------------------------------------------
    max_output_tokens: int = Field(4096, ge=1, description="Upper bound of max_tokens (also bounded by the grant).")
    malformed_limit: int = Field(3, ge=1, description="Consecutive invalid responses after which the step fails.")
    max_tool_calls: int = Field(
        64, ge=1, description="Most tool calls one model answer may make; more is a malformed answer (asked again)."
    )
    max_tool_args_bytes: int = Field(
        65_536, ge=1024, le=512_000,
        description="Most UTF-8 bytes of one tool call's arguments; larger is a malformed answer (asked again).",
    )
    max_text_bytes: int = Field(
        262_144, ge=1024, le=512_000,
        description="Most UTF-8 bytes of a model answer's text; larger is a malformed answer (asked again).",
    )
    assert_formats: list[str] = Field(
        default_factory=lambda: sorted(ASSERTABLE_FORMATS),
        description="The JSON Schema `format`s checked in a tool call's arguments before the call is proposed (a "
        "failure goes back to the model at once); JSON list, each one the gateway can assert. Keep it to the "
        "gateway policy's arguments.assert_formats (the default: every one, as default/4 asserts): a format "
        "checked here but not by the policy refuses calls the gateway would allow; one the policy checks but "
        "not here costs a step and a denial.",
    )

    @field_validator("assert_formats")
    @classmethod
    def _known_formats(cls, value: list[str]) -> list[str]:
        return sorted(set(check_assertable(value)))

    compaction_keep_turns: int = Field(2, ge=1, description="Turns kept verbatim when compacting.")
    summary_max_chars: int = Field(6000, ge=200, description="Cap on the summary that replaces compacted turns.")
    state_max_bytes: int = Field(
        524_288,
        ge=65_536,
        le=900_000,
        description="Most bytes a run's checkpoint (compressed) may take, whatever the model's window: after every "
        "record, older turns are compacted, then a tool result past it is shortened (its whole text stays in the "
        "run log); under Kafka's 1,000,000-byte record limit.",
    )

    # -- records ------------------------------------------------------------------------------
    assistant_text_max_chars: int = Field(8000, ge=100, description="Cap on the model's text recorded per call.")
    answer_max_chars: int = Field(64000, ge=100, description="Cap on a run's final answer as recorded.")
    tool_result_max_chars: int = Field(16000, ge=100, description="Cap on one tool result in the model's context.")

    # -- pricing ------------------------------------------------------------------------------
    pricing_file: Path | None = Field(None, description='JSON {"version": ..., "models": {"name": [in, out]}} (USD/Mtok).')
    default_input_usd_per_mtok: float = Field(10.0, ge=0, description="Price of an unknown model's input.")
    default_output_usd_per_mtok: float = Field(30.0, ge=0, description="Price of an unknown model's output.")

"""docs/settings.md is what the settings classes say, and every setting has something to say."""

from __future__ import annotations

import pytest
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from tether_runtime.settings import ServiceSettings
from tether_testing.settings_reference import DOC, UndocumentedSetting, render


def test_the_committed_reference_is_up_to_date() -> None:
    assert DOC.read_text() == render(), "docs/settings.md is stale: run python -m tether_testing.settings_reference"


def test_a_setting_without_a_description_is_refused() -> None:
    class Sloppy(ServiceSettings):
        model_config = SettingsConfigDict(env_prefix="TETHER_SLOPPY_")
        knob: int = 3

    with pytest.raises(UndocumentedSetting, match="Sloppy.knob"):
        render({"sloppy": Sloppy})


def test_variables_defaults_and_secrets_are_rendered_from_the_class() -> None:
    from pydantic import AliasChoices, SecretStr

    class Tidy(ServiceSettings):
        model_config = SettingsConfigDict(env_prefix="TETHER_TIDY_")
        knob: int = Field(3, description="How many.")
        token: SecretStr | None = Field(None, validation_alias=AliasChoices("TIDY_TOKEN"), description="A token.")

    text = render({"tidy": Tidy})
    assert "| `TETHER_TIDY_KNOB` | `3` | How many. |" in text
    assert "| `TIDY_TOKEN` | unset | A token. **Secret.** |" in text
    assert "| `TETHER_KAFKA_BOOTSTRAP` | `127.0.0.1:9092` |" in text  # infrastructure: fixed names

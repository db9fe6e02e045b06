"""Secret providers (environment, files, static) and the registry that registers values with the redactor."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tether_security.redaction import MIN_SECRET_LENGTH, Redactor
from tether_security.secrets import (
    EnvSecretProvider,
    FileSecretProvider,
    InsecureSecretStore,
    InvalidSecretName,
    SecretNotFound,
    SecretProvider,
    SecretRegistry,
    SecretTooShort,
    StaticSecretProvider,
    handle,
    secret_name,
)

VALUE = "sk_test_4eC39HqLyjWDarjtT1zdp7dc"


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _private_file(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture(params=["static", "env", "dir", "json", "toml"])
def provider(request: pytest.FixtureRequest, tmp_path: Path) -> SecretProvider:
    """The same two secrets behind every provider: one conformance suite for all of them."""
    if request.param == "static":
        return StaticSecretProvider({"stripe/test": VALUE, "github/bot": "ghp_x\n"})
    if request.param == "env":
        return EnvSecretProvider({"TETHER_SECRET_STRIPE_TEST": VALUE, "TETHER_SECRET_GITHUB_BOT": "ghp_x\n"})
    if request.param == "dir":
        root = _private_dir(tmp_path / "secrets")
        _private_dir(root / "stripe")
        _private_dir(root / "github")
        _private_file(root / "stripe" / "test", VALUE + "\n")
        _private_file(root / "github" / "bot", "ghp_x\n\n")
        return FileSecretProvider(root)
    if request.param == "json":
        return FileSecretProvider(_private_file(tmp_path / "s.json", json.dumps(
            {"stripe": {"test": VALUE}, "github/bot": "ghp_x\n"})))
    return FileSecretProvider(_private_file(tmp_path / "s.toml", f'[stripe]\ntest = "{VALUE}"\n'
                                                                 '[github]\nbot = "ghp_x\\n"\n'))


def test_provider_resolves_names_and_handles(provider: SecretProvider) -> None:
    assert provider.resolve("stripe/test") == VALUE
    assert provider.resolve("github/bot") == "ghp_x\n"


def test_provider_raises_secret_not_found(provider: SecretProvider) -> None:
    with pytest.raises(SecretNotFound) as err:
        provider.resolve("stripe/live")
    assert err.value.name == "stripe/live"


def test_names_and_handles() -> None:
    assert secret_name("secret://stripe/test") == "stripe/test" == secret_name("stripe/test")
    assert handle("stripe/test") == "secret://stripe/test"
    for bad in ("../etc/shadow", "/abs", "a//b", "a/../b", "", "secret://", "a b"):
        with pytest.raises(InvalidSecretName):
            secret_name(bad)


def test_env_provider_maps_names_to_prefixed_variables() -> None:
    env = {"APP_SECRET_OPENAI_API_KEY": "k" * 20, "APP_SECRET_EMPTY": ""}
    p = EnvSecretProvider(env, prefix="APP_SECRET_")
    assert p.variable("openai/api-key") == "APP_SECRET_OPENAI_API_KEY"
    assert p.resolve("openai/api-key") == "k" * 20
    with pytest.raises(SecretNotFound):
        p.resolve("empty")


def test_file_provider_refuses_group_or_world_access(tmp_path: Path) -> None:
    root = _private_dir(tmp_path / "secrets")
    leaky = _private_file(root / "leaky", VALUE)
    leaky.chmod(0o644)
    p = FileSecretProvider(root)
    with pytest.raises(InsecureSecretStore):
        p.resolve("leaky")
    root.chmod(0o755)
    with pytest.raises(InsecureSecretStore):
        FileSecretProvider(root)
    doc = _private_file(tmp_path / "s.json", json.dumps({"a": VALUE}))
    doc.chmod(0o640)
    with pytest.raises(InsecureSecretStore):
        FileSecretProvider(doc)
    assert FileSecretProvider(doc, require_private=False).resolve("a") == VALUE


def test_file_provider_refuses_symlinks_out_of_the_store(tmp_path: Path) -> None:
    root = _private_dir(tmp_path / "secrets")
    outside = _private_file(tmp_path / "outside", "not-for-you")
    os.symlink(outside, root / "escape")
    with pytest.raises(InvalidSecretName):
        FileSecretProvider(root).resolve("escape")


def test_file_provider_rejects_unknown_formats_and_missing_stores(tmp_path: Path) -> None:
    with pytest.raises(InvalidSecretName):
        FileSecretProvider(_private_file(tmp_path / "s.yaml", "a: b"))
    with pytest.raises(SecretNotFound):
        FileSecretProvider(tmp_path / "nope")


def test_registry_registers_each_resolved_value_with_the_redactor() -> None:
    redactor = Redactor(patterns=False, entropy=False)
    registry = SecretRegistry(StaticSecretProvider({"db/password": "correct-horse-battery"}), redactor)
    assert redactor.redact("pw correct-horse-battery") == "pw correct-horse-battery"  # not resolved yet
    assert registry.resolve("secret://db/password") == "correct-horse-battery"
    assert redactor.redact("pw correct-horse-battery") == "pw [REDACTED:secret]"
    assert registry.resolved_names() == frozenset({"db/password"})
    with pytest.raises(SecretNotFound):
        registry.resolve("db/other")


def test_registry_preload_registers_everything_at_once() -> None:
    redactor = Redactor(patterns=False, entropy=False)
    registry = SecretRegistry(StaticSecretProvider({"a": "alpha-value-1", "b": "bravo-value-2"}), redactor)
    registry.preload(["a", "secret://b"])
    assert redactor.secret_count == 2
    assert redactor.redact("alpha-value-1 bravo-value-2") == "[REDACTED:secret] [REDACTED:secret]"


@pytest.mark.parametrize("short", ["48213", "  4821 \n", "x"])
def test_registry_refuses_a_secret_too_short_to_redact(short: str) -> None:
    redactor = Redactor(patterns=False, entropy=False)
    registry = SecretRegistry(StaticSecretProvider({"pin": short, "ok": "correct-horse-battery"}), redactor)
    with pytest.raises(SecretTooShort) as refused:
        registry.resolve("secret://pin")
    err = refused.value
    assert isinstance(err, SecretNotFound)  # refused wherever a missing secret is
    assert err.code == "SECRET_TOO_SHORT" and err.name == "pin" and err.min_length == MIN_SECRET_LENGTH
    assert short.strip() not in str(err) and short.strip() not in repr(err.args)
    assert registry.resolved_names() == frozenset() and redactor.secret_count == 0
    # preload registers what it can, then refuses the short one the same way.
    with pytest.raises(SecretTooShort) as preloaded:
        registry.preload(["ok", "pin"])
    assert preloaded.value.name == "pin" and short.strip() not in str(preloaded.value)
    assert registry.resolved_names() == frozenset({"ok"}) and redactor.secret_count == 1
    assert registry.resolve("ok") == "correct-horse-battery"
    # The limit is the redactor's own.
    lenient = SecretRegistry(StaticSecretProvider({"pin": "48213"}), Redactor(min_secret_length=4))
    assert lenient.resolve("pin") == "48213"

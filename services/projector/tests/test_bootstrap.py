"""Settings and wiring: the composition root builds everything from the environment without I/O."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from tether_projector.__main__ import main
from tether_projector.adapters.postgres import PostgresReadModel
from tether_projector.adapters.redis_live import RedisLiveState
from tether_projector.bootstrap import build_processor
from tether_projector.settings import ProjectorSettings


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_TOPIC_PREFIX", "t1.")
    monkeypatch.setenv("TETHER_PG_DSN", "postgresql://nobody@127.0.0.1:1/x")
    monkeypatch.setenv("TETHER_PROJECTOR_READ_MODEL_SCHEMA", "rm_test")
    monkeypatch.setenv("TETHER_PROJECTOR_REDIS_KEY_PREFIX", "p:")
    monkeypatch.setenv("TETHER_PROJECTOR_ENDED_TTL_S", "60")
    s = ProjectorSettings()
    assert s.input_topic() == "t1.tether.run-events.v1"
    assert (s.read_model_schema, s.redis_key_prefix, s.ended_ttl_s) == ("rm_test", "p:", 60)
    monkeypatch.setenv("TETHER_PROJECTOR_EVENTS_TOPIC", "other-log")
    assert ProjectorSettings().input_topic() == "other-log"


def test_schema_names_are_plain_identifiers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_PROJECTOR_READ_MODEL_SCHEMA", 'x"; DROP SCHEMA public; --')
    with pytest.raises(ValidationError):
        ProjectorSettings()


def test_processor_is_wired_without_touching_the_network(monkeypatch: pytest.MonkeyPatch) -> None:
    # Unreachable addresses: building must not connect to anything.
    monkeypatch.setenv("TETHER_PG_DSN", "postgresql://nobody@127.0.0.1:1/x")
    monkeypatch.setenv("TETHER_REDIS_URL", "redis://127.0.0.1:1/0")
    processor = build_processor(ProjectorSettings(), registry=CollectorRegistry())
    assert processor.name == "projector" and processor.inputs == ("tether.run-events.v1",)
    assert isinstance(processor.deps.read_model, PostgresReadModel)
    assert processor.deps.read_model.schema == "read_model"
    assert isinstance(processor.deps.live, RedisLiveState)


def test_rebuild_refuses_a_bad_schema_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rebuild", "--schema", "Bad-Name"]) == 2
    assert "schema name" in capsys.readouterr().err

"""Settings: shared infrastructure from fixed names, everything else under the service's prefix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from pydantic_settings import SettingsConfigDict

from tether_runtime.settings import LoopServiceSettings, ServiceSettings


class BudgetSettings(LoopServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TETHER_BUDGET_")
    tenant_cap: int = 5


def test_defaults_are_the_local_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TETHER_KAFKA_BOOTSTRAP", "TETHER_PG_DSN", "TETHER_REDIS_URL", "TETHER_PARTITIONS", "TETHER_TOPIC_PREFIX"):
        monkeypatch.delenv(var, raising=False)
    s = BudgetSettings()
    assert (s.kafka_bootstrap, s.pg_dsn, s.redis_url, s.partitions, s.topic_prefix) == (
        "127.0.0.1:9092",
        "postgresql://tether@127.0.0.1:5432/tether",
        "redis://127.0.0.1:6379/0",
        6,
        "",
    )
    assert (s.instance_id, s.http_host) == (0, "127.0.0.1")


def test_infrastructure_ignores_the_prefix_and_service_fields_use_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_KAFKA_BOOTSTRAP", "kafka:9093")
    monkeypatch.setenv("TETHER_PARTITIONS", "12")
    monkeypatch.setenv("TETHER_TOPIC_PREFIX", "it.")
    monkeypatch.setenv("TETHER_BUDGET_PARTITIONS", "3")  # not an infrastructure name: ignored
    monkeypatch.setenv("TETHER_BUDGET_INSTANCE_ID", "2")
    monkeypatch.setenv("TETHER_BUDGET_METRICS_PORT", "9102")
    monkeypatch.setenv("TETHER_BUDGET_BATCH_MAX_MS", "25")
    monkeypatch.setenv("TETHER_BUDGET_BATCH_MAX_MESSAGES", "50")
    monkeypatch.setenv("TETHER_BUDGET_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("TETHER_BUDGET_WORK_THREADS", "4")
    monkeypatch.setenv("TETHER_BUDGET_TENANT_CAP", "9")
    monkeypatch.setenv("TETHER_INSTANCE_ID", "7")  # another service's or no prefix: ignored
    s = BudgetSettings()
    assert (s.kafka_bootstrap, s.partitions, s.topic_prefix) == ("kafka:9093", 12, "it.")
    assert (s.instance_id, s.metrics_port, s.batch_max_ms, s.batch_max_messages) == (2, 9102, 25, 50)
    assert (s.log_level, s.work_threads, s.tenant_cap) == ("DEBUG", 4, 9)


def test_fields_can_be_given_by_name_in_code() -> None:
    s = BudgetSettings(kafka_bootstrap="b:1", partitions=2, instance_id=1)
    assert (s.kafka_bootstrap, s.partitions, s.instance_id) == ("b:1", 2, 1)


def test_invalid_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_PARTITIONS", "0")
    with pytest.raises(ValidationError):
        BudgetSettings()


def test_a_service_without_the_loop_reads_none_of_its_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    class ApiSettings(ServiceSettings):
        model_config = SettingsConfigDict(env_prefix="TETHER_API_")

    monkeypatch.setenv("TETHER_API_BATCH_MAX_MS", "25")
    fields = set(ApiSettings.model_fields)
    assert "batch_max_ms" not in fields and "work_threads" not in fields and "state_cache_runs" not in fields
    assert {"batch_max_ms", "work_threads", "noop_commit_ms"} <= set(LoopServiceSettings.model_fields)

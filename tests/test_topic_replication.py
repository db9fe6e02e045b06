"""Every service declares its topics with the shared TETHER_TOPIC_REPLICATION_FACTOR, never a library default."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from tether_messaging import admin

# service package -> its settings class (each bootstrap has declare_topics(settings))
LOOP_SERVICES = {
    "tether_approval": "ApprovalSettings",
    "tether_budget": "BudgetSettings",
    "tether_planner": "PlannerSettings",
    "tether_projector": "ProjectorSettings",
    "tether_tool_gateway": "GatewaySettings",
}


@pytest.fixture
def declared(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def record(bootstrap: str, partitions: int, services: list[str], **kwargs: Any) -> list[str]:
        calls.append(kwargs)
        return []

    monkeypatch.setattr(admin, "declare_topics", record)
    return calls


def test_services_default_to_three_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    from tether_runtime.settings import ServiceSettings

    monkeypatch.delenv("TETHER_TOPIC_REPLICATION_FACTOR", raising=False)
    assert ServiceSettings().topic_replication_factor == 3
    assert admin.min_insync_replicas(3) == 2


@pytest.mark.parametrize("package", sorted(LOOP_SERVICES))
def test_each_processor_declares_with_the_setting(
    package: str, declared: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TETHER_TOPIC_REPLICATION_FACTOR", "5")
    settings = getattr(importlib.import_module(f"{package}.settings"), LOOP_SERVICES[package])()
    importlib.import_module(f"{package}.bootstrap").declare_topics(settings)
    assert [call["replication_factor"] for call in declared] == [5]


def test_run_api_declares_with_the_setting(declared: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    from tether_run_api import bootstrap
    from tether_run_api.settings import RunApiSettings

    class Stop(Exception):
        pass

    def stop_after_declaring(*args: Any, **kwargs: Any) -> None:
        raise Stop

    monkeypatch.setattr(bootstrap, "declare_topics", lambda *a, **kw: admin.declare_topics(*a, **kw))
    monkeypatch.setattr(bootstrap, "wait_for_dependency", stop_after_declaring)
    monkeypatch.setenv("TETHER_TOPIC_REPLICATION_FACTOR", "2")
    with pytest.raises(Stop):
        bootstrap.build_app(RunApiSettings())
    assert [call["replication_factor"] for call in declared] == [2]

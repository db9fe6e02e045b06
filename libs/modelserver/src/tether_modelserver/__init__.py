"""A deterministic scripted model server for tests and the offline demo (see libs/modelserver/README.md)."""

from tether_modelserver.scenarios import (
    Scenario,
    ScenarioError,
    ScenarioSet,
    bundled_scenarios_dir,
    demo_scenario_path,
    load_scenarios,
    parse_scenario,
)
from tether_modelserver.server import ModelServer, read_request_log

__all__ = [
    "ModelServer",
    "Scenario",
    "ScenarioError",
    "ScenarioSet",
    "bundled_scenarios_dir",
    "demo_scenario_path",
    "load_scenarios",
    "parse_scenario",
    "read_request_log",
]

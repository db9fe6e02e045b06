"""Scenario files: which conversations a scenario answers and the assistant turns it plays, in order.

A scenario is one JSON file (format in libs/modelserver/README.md). JSON, not YAML, so the
server needs nothing beyond the standard library and pydantic.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ScenarioError(Exception):
    """A scenario file cannot be loaded: bad JSON, a field of the wrong shape, a duplicate name."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ScriptedUsage(_Strict):
    """Token counts to report for a turn (otherwise estimated as characters / 4)."""

    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)


class ScriptedError(_Strict):
    """An HTTP error returned instead of the turn's answer, for one attempt of the request."""

    status: int = Field(ge=400, le=599)
    message: str = "scripted error"
    code: str | None = None
    #: Seconds, sent as the Retry-After header when set.
    retry_after: float | None = Field(None, ge=0)
    latency_ms: int = Field(0, ge=0)


class ScriptedToolCall(_Strict):
    """One tool call of a turn. `arguments_raw` is sent verbatim (e.g. deliberately broken JSON)."""

    name: str
    arguments: Any = None
    arguments_raw: str | None = None
    id: str | None = None

    @model_validator(mode="after")
    def _one_kind_of_arguments(self) -> ScriptedToolCall:
        if self.arguments is not None and self.arguments_raw is not None:
            raise ValueError("give either 'arguments' or 'arguments_raw', not both")
        return self


class ScriptedTurn(_Strict):
    """One assistant turn: text and/or tool calls, with optional latency, usage and failed attempts."""

    text: str | None = None
    tool_calls: list[ScriptedToolCall] = Field(default_factory=list)
    finish_reason: str | None = None
    latency_ms: int = Field(0, ge=0)
    usage: ScriptedUsage | None = None
    #: errors[k] answers attempt k+1 of this turn's request (header X-Tether-Attempt, default 1).
    errors: list[ScriptedError] = Field(default_factory=list)

    @model_validator(mode="after")
    def _says_something(self) -> ScriptedTurn:
        if self.text is None and not self.tool_calls:
            raise ValueError("a turn needs 'text' or 'tool_calls'")
        return self


class ScenarioMatch(_Strict):
    """How a scenario recognises its conversation, by the goal (the first user message).

    `goal_contains` is a literal substring, `goal_regex` a Python regular expression
    (re.search); when both are given both must match. `default` scenarios answer any goal
    that no other scenario matched.
    """

    goal_contains: str | None = None
    goal_regex: str | None = None
    default: bool = False

    @model_validator(mode="after")
    def _has_a_rule(self) -> ScenarioMatch:
        if not self.default and self.goal_contains is None and self.goal_regex is None:
            raise ValueError("match needs 'goal_contains', 'goal_regex' or 'default': true")
        if self.default and (self.goal_contains is not None or self.goal_regex is not None):
            raise ValueError("a default scenario has no other match rule")
        if self.goal_regex is not None:
            try:
                re.compile(self.goal_regex)
            except re.error as exc:
                raise ValueError(f"goal_regex does not compile: {exc}") from exc
        return self

    def matches(self, goal: str) -> bool:
        if self.default:
            return True
        if self.goal_contains is not None and self.goal_contains not in goal:
            return False
        if self.goal_regex is not None and re.search(self.goal_regex, goal) is None:
            return False
        return True


class Scenario(_Strict):
    """A scripted conversation: the match rule and the assistant turns in order."""

    name: str = Field(min_length=1)
    description: str = ""
    match: ScenarioMatch
    turns: list[ScriptedTurn] = Field(min_length=1)
    #: What to answer once every turn has been played: an error (the default) or the last turn again.
    on_exhausted: Literal["error", "repeat_last"] = "error"
    #: Simulated context window in characters of the request's messages; over it the server
    #: answers with the provider's context-length error.
    context_window_chars: int | None = Field(None, ge=1)


class ScenarioSet:
    """Loaded scenarios; `select` picks the one answering a goal.

    Non-default scenarios are tried in name order and the first match wins; default
    scenarios are tried only when none matched.
    """

    def __init__(self, scenarios: Iterable[Scenario]) -> None:
        by_name: dict[str, Scenario] = {}
        for s in scenarios:
            if s.name in by_name:
                raise ScenarioError(f"two scenarios are named {s.name!r}")
            by_name[s.name] = s
        ordered = [by_name[n] for n in sorted(by_name)]
        self._specific = [s for s in ordered if not s.match.default]
        self._defaults = [s for s in ordered if s.match.default]

    def __len__(self) -> int:
        return len(self._specific) + len(self._defaults)

    @property
    def names(self) -> list[str]:
        return [s.name for s in (*self._specific, *self._defaults)]

    def select(self, goal: str) -> Scenario | None:
        for s in self._specific:
            if s.match.matches(goal):
                return s
        return self._defaults[0] if self._defaults else None


def parse_scenario(data: Any, origin: str = "<data>") -> Scenario:
    """Validate one scenario from parsed JSON."""
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(f"{origin}: {exc}") from exc


def load_scenario_file(path: Path) -> list[Scenario]:
    """A file holds one scenario object or a list of them."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ScenarioError(f"{path}: {exc}") from exc
    items = data if isinstance(data, list) else [data]
    return [parse_scenario(item, str(path)) for item in items]


def load_scenarios(paths: Sequence[Path]) -> ScenarioSet:
    """Load every *.json file under the given directories (or the given files)."""
    scenarios: list[Scenario] = []
    for p in paths:
        if p.is_dir():
            files = sorted(p.glob("*.json"))
        elif p.is_file():
            files = [p]
        else:
            raise ScenarioError(f"{p}: no such file or directory")
        for f in files:
            scenarios.extend(load_scenario_file(f))
    return ScenarioSet(scenarios)


def bundled_scenarios_dir() -> Path:
    """The scenarios shipped with the package (the offline demo)."""
    return Path(str(resources.files("tether_modelserver") / "scenarios"))


def demo_scenario_path() -> Path:
    """The offline demo scenario used by `make run` when no API key is configured."""
    return bundled_scenarios_dir() / "demo.json"

"""The scripted agents the bench and the chaos run drive: scenario files for the model server and their goals."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Workload:
    """One scripted agent: its scenario (for tether_modelserver) and how many steps a run of it takes."""

    name: str
    turns: list[dict[str, Any]]
    description: str

    @property
    def marker(self) -> str:
        return f"[scenario:{self.name}]"

    @property
    def steps(self) -> int:
        """Model-call rounds per run (one StepGranted each): every turn, the final answer included."""
        return len(self.turns)

    def goal(self, note: str = "") -> str:
        """A goal the model server maps to this scenario; unique, so every run is its own."""
        return f"{self.marker} {note or uuid.uuid4().hex}"

    def scenario(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "match": {"goal_contains": self.marker},
                "on_exhausted": "error", "turns": self.turns}


def kv_get_steps(name: str, steps: int, *, latency_ms: int = 0) -> Workload:
    """`steps - 1` steps of one instant read-only tool call each (kv_get of a key no one wrote: no
    effect, a fast answer), then the final answer. Each step reads another key, so the loop guard
    sees new actions, not a loop."""
    if steps < 1:
        raise ValueError("a run has at least one step (the answer)")
    turns: list[dict[str, Any]] = [
        {"text": f"Step {i + 1}.", "tool_calls": [{"name": "kv_get", "arguments": {"key": f"bench/k{i}"}}],
         "latency_ms": latency_ms, "usage": {"input_tokens": 100, "output_tokens": 20}}
        for i in range(steps - 1)
    ]
    turns.append({"text": "Done after {{tool_result_count}} tool results.", "latency_ms": latency_ms,
                  "usage": {"input_tokens": 100, "output_tokens": 20}})
    return Workload(name, turns, f"{steps - 1} kv_get steps then an answer, model latency {latency_ms} ms")


def park_on_approval(name: str = "bench-park") -> Workload:
    """Step 1 proposes send_email (IRREVERSIBLE: the gateway asks a human), so the run parks; if
    approved, it answers."""
    turns = [
        {"text": "Asking to send.", "tool_calls": [{"name": "send_email", "arguments": {
            "to": "oncall@example.com", "subject": "bench {{run_id}}", "body": "parked run"}}],
         "usage": {"input_tokens": 100, "output_tokens": 20}},
        {"text": "Sent.", "usage": {"input_tokens": 100, "output_tokens": 20}},
    ]
    return Workload(name, turns, "send_email (waits for an approval), then an answer")


def chaos_mix(name: str, *, latency_ms: int = 0) -> Workload:
    """Idempotent and non-idempotent effects: kv_put + kv_get, then send_email (approval), then
    another kv_put, then the answer."""
    usage = {"input_tokens": 100, "output_tokens": 20}
    turns = [
        {"text": "Noting and reading.", "latency_ms": latency_ms, "usage": usage, "tool_calls": [
            {"name": "kv_put", "arguments": {"key": "chaos/{{run_id}}/a", "value": {"goal": "{{goal}}"}}},
            {"name": "kv_get", "arguments": {"key": "chaos/{{run_id}}/a"}},
        ]},
        {"text": "Mailing.", "latency_ms": latency_ms, "usage": usage, "tool_calls": [
            {"name": "send_email", "arguments": {"to": "oncall@example.com", "subject": "chaos {{run_id}}",
                                                 "body": "chaos run {{run_id}}"}},
        ]},
        {"text": "Noting the result.", "latency_ms": latency_ms, "usage": usage, "tool_calls": [
            {"name": "kv_put", "arguments": {"key": "chaos/{{run_id}}/b", "value": {"done": True}}},
        ]},
        {"text": "Chaos run done: {{tool_result_count}} results.", "latency_ms": latency_ms, "usage": usage},
    ]
    return Workload(name, turns, f"kv_put+kv_get, send_email (approval), kv_put, answer; latency {latency_ms} ms")


def write_scenarios(directory: Path, workloads: list[Workload]) -> Path:
    """Write the workloads' scenarios as one file in `directory` (for SystemConfig.scenarios)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "bench.json").write_text(json.dumps([w.scenario() for w in workloads], indent=1))
    return directory

"""The `make run` demo: start Tether on the local stack, run one goal, stream its events live, print the answer.

Run through deploy/local/run-demo (which `make run` calls after `make up`). Settings (environment):

  GOAL                     the goal (default: look up the local status page, save a note, email the on-call)
  TETHER_LLM_BASE_URL      an OpenAI-compatible server (vLLM, Ollama, ...); model TETHER_DEMO_MODEL
  OPENAI_API_KEY           use OpenAI (model TETHER_DEMO_MODEL, default gpt-4.1-mini)
  ANTHROPIC_API_KEY        use Anthropic (model TETHER_DEMO_MODEL, default claude-sonnet-4-5)
                           none of these: the built-in offline demo model (the scripted model server)
  TETHER_DEMO_KEEP=1       leave the services running afterwards (for the `tether` CLI); `make down` stops them
  TETHER_DEMO_NAMESPACE    isolate topics/schemas/keys under a namespace (default: the production names)
  TETHER_DEMO_TIMEOUT_S    give up after this long (default 300)

Every process it starts is recorded under $TETHER_STATE_DIR/demo/processes.json, so `make down`
stops them even if this script was killed. Exit status: 0 when the run completed, 2 when it was
terminated or rejected, 1 when the demo could not run.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import grpc
import structlog
from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import SettingsConfigDict

from tether_api.v1 import run_service_pb2 as runs_pb
from tether_run_api.cli.render import event_line, run_status, usd
from tether_runtime.settings import ServiceSettings
from tether_testing.processes import ServiceFailed
from tether_testing.system import ModelChoice, SystemConfig, TetherSystem, TetherSystemError, stop_recorded

DEFAULT_GOAL = ("Look up the service status page at {url}, save a note about it, and email the on-call "
                "a summary.")
#: Ports the demo prefers (so the `tether` CLI's default address works with TETHER_DEMO_KEEP=1);
#: a taken one is replaced by a free one.
PREFERRED_PORTS = {"grpc": 50051, "model": 8089, "http": 8090, "kv": 8091, "smtp": 2525}
TERMINAL = {runs_pb.RUN_STATUS_COMPLETED, runs_pb.RUN_STATUS_TERMINATED, runs_pb.RUN_STATUS_REJECTED}


class DemoSettings(ServiceSettings):
    """What the demo reads from the environment (read once, in main)."""

    model_config = SettingsConfigDict(env_prefix="TETHER_DEMO_", extra="ignore", populate_by_name=True)

    goal: str | None = Field(None, validation_alias=AliasChoices("GOAL"))
    state_dir: Path = Field(Path(".state"), validation_alias=AliasChoices("TETHER_STATE_DIR"))
    llm_base_url: str | None = Field(None, validation_alias=AliasChoices("TETHER_LLM_BASE_URL"))
    openai_api_key: SecretStr | None = Field(None, validation_alias=AliasChoices("OPENAI_API_KEY"))
    anthropic_api_key: SecretStr | None = Field(None, validation_alias=AliasChoices("ANTHROPIC_API_KEY"))
    model: str | None = Field(None, description="Model name for a real provider.")
    namespace: str = Field("", description="Empty: the production topic and schema names.")
    keep: bool = Field(False, description="Leave the services running after the run.")
    timeout_s: float = Field(300.0, gt=0, description="Give up on the run after this long.")


def say(text: str = "") -> None:
    print(text, flush=True)


def choose_model(settings: DemoSettings) -> tuple[ModelChoice, str]:
    """The model and a sentence saying which one is used and why."""
    if settings.llm_base_url:
        name = settings.model or "gpt-4.1-mini"
        return (ModelChoice(provider="openai", name=name, scripted=False, base_url=settings.llm_base_url),
                f"Using the OpenAI-compatible server at {settings.llm_base_url} (model {name}; TETHER_LLM_BASE_URL).")
    if settings.openai_api_key and settings.openai_api_key.get_secret_value():
        name = settings.model or "gpt-4.1-mini"
        return (ModelChoice(provider="openai", name=name, scripted=False),
                f"Using OpenAI (model {name}; OPENAI_API_KEY).")
    if settings.anthropic_api_key and settings.anthropic_api_key.get_secret_value():
        name = settings.model or "claude-sonnet-4-5"
        return (ModelChoice(provider="anthropic", name=name, scripted=False),
                f"Using Anthropic (model {name}; ANTHROPIC_API_KEY).")
    return ModelChoice(), ("No TETHER_LLM_BASE_URL, OPENAI_API_KEY or ANTHROPIC_API_KEY: using the built-in offline "
                           "demo model (the scripted model server with its demo scenario).")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def demo_ports(namespace: str) -> dict[str, int]:
    if namespace:
        return {}  # an isolated demo (tests) takes free ports
    return {name: port for name, port in PREFERRED_PORTS.items() if _free(port)}


def approve(system: TetherSystem, event: runs_pb.RunEvent) -> None:
    """Decide an approval the way a human would in the CLI, with the demo approver's key."""
    payload = json.loads(event.payload_json or "{}")
    args = payload.get("args_json", "")
    reasons = ", ".join(payload.get("reasons", []))
    say(f"        approval needed: {payload.get('tool_name')} {args} (reasons: {reasons})")
    say(f"        approving as demo approver ({system.config.approver_id}) via ApprovalService.DecideApproval")
    system.approver.decide(payload["approval_id"], payload["args_hash"], approve=True,
                           comment="approved by the make run demo")


def final_run(system: TetherSystem, run_id: str, deadline: float) -> runs_pb.Run:
    """The run as the read model shows it once it has ended (the row may trail the terminal event)."""
    while True:
        run = system.client.get_run(run_id)
        if run.status in TERMINAL or time.monotonic() > deadline:
            return run
        time.sleep(0.2)


def show_result(run: runs_pb.Run) -> None:
    status = run_status(run.status)
    say()
    say(f"run {run.run_id}: {status}")
    say(f"  steps {run.steps}, events {run.last_seq}, tokens {run.usage.input_tokens}+{run.usage.output_tokens}, "
        f"cost {usd(run.usage.cost_usd_micros)}")
    if run.answer:
        say("answer:")
        say(run.answer)
    t = run.termination
    if status != "COMPLETED" and t.reason_code:
        say(f"stopped: {t.reason_code}: {t.detail}")
        for item in t.pending:
            say(f"  pending {item}")


class DemoFailed(Exception):
    """The demo cannot go on; the message says why."""


def watch(system: TetherSystem, run_id: str, deadline: float) -> None:
    """Stream the run's events as they happen, approving what needs approval, until its terminal event."""
    start_ms = None
    try:
        for event in system.client.follow(run_id, timeout_s=max(1.0, deadline - time.monotonic())):
            if start_ms is None:
                start_ms = event.record_time.ToMilliseconds()
            say(event_line(event, start_ms))
            if event.event_type == "tether.v1.ApprovalRequested":
                try:
                    approve(system, event)
                except grpc.RpcError as err:
                    raise DemoFailed(f"DecideApproval was refused: {err.code().name}: {err.details()}") from None
    except grpc.RpcError as err:
        if time.monotonic() >= deadline:
            raise DemoFailed("the run did not finish within TETHER_DEMO_TIMEOUT_S") from None
        raise DemoFailed(f"lost the event stream: {err.code().name}: {err.details()}") from None


def _interrupt(signum: int, frame: object) -> None:
    # SIGTERM (e.g. from a supervisor's timeout) stops the services the way Ctrl-C does.
    raise KeyboardInterrupt


def main() -> int:
    settings = DemoSettings()
    # Library logs (topic declaration, ...) would interleave with the run's events; warnings still show.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    workdir = settings.state_dir.resolve() / "demo" if not settings.namespace else \
        settings.state_dir.resolve() / f"demo-{settings.namespace}"
    stale = stop_recorded(workdir)
    if stale:
        say(f"stopped the services a previous demo left running: {', '.join(stale)}")
    for old in ("logs", "sinks"):
        shutil.rmtree(workdir / old, ignore_errors=True)
    (workdir / "model-requests.jsonl").unlink(missing_ok=True)

    model, why = choose_model(settings)
    say(why)
    config = SystemConfig(
        kafka_bootstrap=settings.kafka_bootstrap, pg_dsn=settings.pg_dsn, redis_url=settings.redis_url,
        workdir=workdir, namespace=settings.namespace, partitions=settings.partitions, model=model,
        ports=demo_ports(settings.namespace),
    )
    system = TetherSystem(config)
    signal.signal(signal.SIGTERM, _interrupt)
    keep = False
    try:
        say(f"Starting Tether (Kafka {settings.kafka_bootstrap}, PostgreSQL, Redis; logs in {system.log_dir}) ...")
        started = time.monotonic()
        try:
            system.start()
        except (TetherSystemError, ServiceFailed) as err:
            say(f"Tether did not start:\n{err}")
            return 1
        say(f"Tether is up in {time.monotonic() - started:.0f}s: run-api on {system.address}, "
            f"tenant {system.bootstrap.tenant_id}, agent {system.bootstrap.agent_id} "
            f"v{system.bootstrap.agent_version} with tools {', '.join(system.bootstrap.tools)}.")

        goal = settings.goal or DEFAULT_GOAL.format(url=system.status_page_url)
        if model.scripted and "http" not in goal:
            # The offline model fetches the first URL in the goal; give it the local one.
            goal = f"{goal} (The status page is at {system.status_page_url}.)"
        say(f"Goal: {goal}")
        deadline = time.monotonic() + settings.timeout_s
        run_id = system.client.submit(goal)
        say(f"Submitted run {run_id}; streaming its events (seq, time since the first event, event):")
        try:
            watch(system, run_id, deadline)
        except DemoFailed as err:
            say(f"The demo failed: {err}.")
            for name in ("planner", "budget", "tool-gateway", "projector"):
                say(f"--- last lines of {system.log_path(name)}\n{system.log_tail(name, 15)}")
            return 1
        run = final_run(system, run_id, time.monotonic() + 30)
        show_result(run)
        say()
        say(f"Side effects at the sinks: {len(system.sink_records('http'))} HTTP request(s), "
            f"{len(system.sink_records('kv'))} KV write(s), {len(system.sink_records('smtp'))} email(s) "
            f"(records in {system.workdir / 'sinks'}).")
        keep = settings.keep
        if keep:
            say()
            say("The services keep running (TETHER_DEMO_KEEP=1). Try the CLI:")
            say(f"  export TETHER_ADDR={system.address} TETHER_API_KEY={system.bootstrap.api_key} "
                f"TETHER_APPROVER_KEY={system.bootstrap.approver_key}")
            say(f"  .venv/bin/tether get {run_id}; .venv/bin/tether trace {run_id}")
            say("Stop them (and the stack) with `make down`.")
        return 0 if run.status == runs_pb.RUN_STATUS_COMPLETED else 2
    except KeyboardInterrupt:
        say("\ninterrupted; stopping the services")
        return 130
    finally:
        if not keep:
            system.stop()


if __name__ == "__main__":
    sys.exit(main())

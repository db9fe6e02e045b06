"""`tether audit verify`: replay the run event log from Kafka and re-derive every recorded decision."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from tether_messaging.logreader import LogReadError
from tether_messaging.topics import Topics
from tether_run_api.audit import AuditConfig, policies_from_texts, read_run_log, render_text, verify_log
from tether_run_api.cli.client import CliError

audit_app = typer.Typer(help="Audit the run event log: hash chains and every decision re-derived.",
                        no_args_is_help=True)

#: Exit code when the log does not verify (a mismatch or a broken chain).
EXIT_MISMATCH = 3
#: Exit code when the log could not be read.
EXIT_UNREADABLE = 4
#: Exit code when a --policy-file cannot be read or is not a valid policy document.
EXIT_BAD_POLICY = 2


def _fail(message: str, reason: str, exit_code: int, as_json: bool) -> CliError:
    """The error to raise; with --json the reason is also printed as a JSON object on stdout, so a
    script reading the output gets one document whatever happened."""
    if as_json:
        typer.echo(json.dumps({"ok": False, "error": {"reason": reason, "message": message}}, indent=2))
    return CliError(message, exit_code=exit_code)


@audit_app.command()
def verify(
    bootstrap: Annotated[str, typer.Option(help="Kafka bootstrap servers", envvar="TETHER_KAFKA_BOOTSTRAP")
                         ] = "127.0.0.1:9092",
    topic_prefix: Annotated[str, typer.Option(help="topic prefix of the deployment", envvar="TETHER_TOPIC_PREFIX")
                            ] = "",
    schema_registry_url: Annotated[str | None, typer.Option(
        help="schema registry the services wrote with (needed for a log in the Confluent wire format)",
        envvar="TETHER_SCHEMA_REGISTRY_URL")] = None,
    run: Annotated[list[str] | None, typer.Option("--run", help="only these run ids (repeatable)")] = None,
    policy_file: Annotated[list[Path] | None, typer.Option(
        help="gateway policy document(s) decisions were made under (default: the built-in one); "
             "the last one checks allowed calls")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    timeout_s: Annotated[float, typer.Option(help="give up reading the log after this long")] = 120.0,
) -> None:
    """Read tether.run-events.v1 from offset 0 (read_committed, either wire format), check every run's
    hash chain and re-derive its budget, gateway and approval decisions; exit non-zero on any mismatch."""
    from tether_run_api.cli.main import _json  # the global --json option counts too
    from tether_tool_gateway.domain.policy_document import PolicyDocumentInvalid

    as_json = json_output or _json()
    try:
        texts = {str(p): p.read_text(encoding="utf-8") for p in policy_file or []}
        config = AuditConfig(gateway_policies=policies_from_texts(texts))
    except (OSError, UnicodeDecodeError, PolicyDocumentInvalid) as err:
        raise _fail(f"--policy-file: {err}", "BAD_POLICY_FILE", EXIT_BAD_POLICY, as_json) from None
    try:
        envelopes = read_run_log(bootstrap, Topics(topic_prefix).run_events,
                                 schema_registry_url=schema_registry_url, timeout_s=timeout_s)
    except LogReadError as err:
        raise _fail(f"cannot read the run event log: {err}", "LOG_UNREADABLE", EXIT_UNREADABLE, as_json) from err
    report = verify_log(envelopes, config, run_ids=set(run) if run else None)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        typer.echo(render_text(report))
    if not report.ok:
        raise typer.Exit(EXIT_MISMATCH)

"""Composition root: `python -m tether_projector` projects the run event log; `... rebuild` replays it from 0."""

from __future__ import annotations

import argparse
import json
import sys
import threading

from tether_messaging.loop import serve_processor
from tether_projector.bootstrap import build_live, build_processor, declare_topics, loop_options
from tether_projector.metrics import ProjectorMetrics
from tether_projector.ports import ReadModelUnavailable
from tether_projector.settings import ProjectorSettings
from tether_runtime.startup import wait_for_dependency


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tether_projector", description=__doc__)
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("run", help="project the run event log continuously (the default)")
    rebuild = commands.add_parser(
        "rebuild",
        help="drop and rebuild the read model by replaying the run event log from offset 0",
        description="Replays the log into <schema>__rebuild, then swaps it in for <schema> in one transaction. "
        "Refused (PROJECTOR_RUNNING) while the projector's consumer group has members when <schema> is the "
        "schema it writes, and (REBUILD_RUNNING) while another rebuild of <schema> runs. On failure prints "
        '{"error": REASON, "detail": ...} to stderr and exits 1; the target is left untouched.',
    )
    rebuild.add_argument("--schema", help="target schema (default: TETHER_PROJECTOR_READ_MODEL_SCHEMA)")
    rebuild.add_argument("--redis", action="store_true", help="also republish Redis hot state and live streams")
    rebuild.add_argument("--batch", type=int, help="events per transaction (default: TETHER_PROJECTOR_REBUILD_BATCH)")
    rebuild.add_argument("--idle-timeout", type=float, metavar="SECONDS",
                         help="fail after reading nothing for this long "
                              "(default: TETHER_PROJECTOR_REBUILD_IDLE_TIMEOUT_S)")
    return parser


def run(settings: ProjectorSettings) -> int:
    """The live projector on the shared loop, at-least-once (offsets committed after the database)."""
    if settings.declare_topics:
        declare_topics(settings)
    processor = build_processor(settings)
    read_model = processor.deps.read_model

    def start_up(stop: threading.Event) -> None:
        # PostgreSQL may be restarting (or not up yet): wait for it, not ready meanwhile.
        wait_for_dependency(read_model.ensure_schema, what="postgresql", retry_on=(ReadModelUnavailable,),
                            stop=stop, timeout_s=settings.startup_wait_s)

    return serve_processor(processor, settings, start_up=start_up, **loop_options(settings))


def _failed(reason: str, detail: str) -> int:
    print(json.dumps({"error": reason, "detail": detail}), file=sys.stderr)
    return 1


def rebuild(settings: ProjectorSettings, schema: str | None, with_redis: bool, batch: int | None,
            idle_timeout_s: float | None = None) -> int:
    """Replay the log from offset 0 into a fresh read model; prints the report as JSON."""
    from tether_projector.ports import ReadModelUnavailable
    from tether_projector.rebuild import SCHEMA_NAME, RebuildFailed, rebuild as replay
    from tether_runtime import logging as runtime_logging

    target = schema or settings.read_model_schema
    if not SCHEMA_NAME.match(target):
        _failed("INVALID_SCHEMA_NAME", f"schema name {target!r} must match {SCHEMA_NAME.pattern}")
        return 2
    runtime_logging.configure("projector", settings.log_level, instance="rebuild")
    try:
        report = replay(
            bootstrap=settings.kafka_bootstrap,
            topic=settings.input_topic(),
            dsn=settings.pg_dsn,
            target_schema=target,
            group_id=f"{settings.topics().group_id('projector')}.rebuild",
            metrics=ProjectorMetrics(),
            live=build_live(settings) if with_redis else None,
            schema_registry_url=settings.schema_registry_url,
            batch_size=batch or settings.rebuild_batch,
            idle_timeout_s=idle_timeout_s or settings.rebuild_idle_timeout_s,
            projector_group=settings.topics().group_id("projector"),
            live_schema=settings.read_model_schema,
        )
    except RebuildFailed as exc:
        return _failed(exc.reason, exc.detail)
    except ReadModelUnavailable as exc:
        return _failed("READ_MODEL_UNAVAILABLE", str(exc))
    print(json.dumps(report.__dict__, sort_keys=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    settings = ProjectorSettings()
    if args.command == "rebuild":
        return rebuild(settings, args.schema, args.redis, args.batch, args.idle_timeout)
    return run(settings)


if __name__ == "__main__":
    raise SystemExit(main())

"""Composition root: `python -m tether_tool_gateway` runs the gateway processor on the exactly-once loop."""

from __future__ import annotations

import os
import threading

import psycopg

from tether_messaging.loop import serve_processor
from tether_runtime.startup import wait_for_dependency
from tether_tool_gateway.bootstrap import build_gateway, declare_topics
from tether_tool_gateway.settings import GatewaySettings


def main() -> int:
    settings = GatewaySettings()
    if settings.declare_topics:
        declare_topics(settings)
    gateway = build_gateway(settings, environ=os.environ)

    def start_up(stop: threading.Event) -> None:
        # The ledger's PostgreSQL may be restarting (or not up yet): wait for it, not ready
        # meanwhile. A pool that timed out (PoolTimeout is an OperationalError) keeps trying
        # in the background; opening it again just waits again.
        wait_for_dependency(gateway.open, what="postgresql", retry_on=(psycopg.OperationalError,), stop=stop,
                            timeout_s=settings.startup_wait_s)

    try:
        return serve_processor(gateway.processor, settings, start_up=start_up)
    finally:
        gateway.close()


if __name__ == "__main__":
    raise SystemExit(main())

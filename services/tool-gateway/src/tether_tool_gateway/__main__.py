"""Composition root: `python -m tether_tool_gateway` runs the gateway processor on the exactly-once loop."""

from __future__ import annotations

import os

from tether_messaging.loop import serve_processor
from tether_tool_gateway.bootstrap import build_gateway, declare_topics
from tether_tool_gateway.settings import GatewaySettings


def main() -> int:
    settings = GatewaySettings()
    if settings.declare_topics:
        declare_topics(settings)
    gateway = build_gateway(settings, environ=os.environ)
    gateway.open()
    try:
        return serve_processor(gateway.processor, settings)
    finally:
        gateway.close()


if __name__ == "__main__":
    raise SystemExit(main())

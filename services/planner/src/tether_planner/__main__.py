"""Composition root: `python -m tether_planner` runs the planner processor on the exactly-once loop."""

from __future__ import annotations

from tether_messaging.loop import serve_processor
from tether_planner.bootstrap import build_processor, declare_topics
from tether_planner.settings import PlannerSettings


def main() -> int:
    settings = PlannerSettings()
    if settings.declare_topics:
        declare_topics(settings)
    processor = build_processor(settings)
    try:
        return serve_processor(processor, settings)
    finally:
        processor.deps.providers.close()


if __name__ == "__main__":
    raise SystemExit(main())

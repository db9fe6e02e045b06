"""Composition root: `python -m tether_approval` runs the approval processor on the exactly-once loop."""

from __future__ import annotations

from tether_approval.bootstrap import build_processor, declare_topics
from tether_approval.settings import ApprovalSettings
from tether_messaging.loop import serve_processor


def main() -> int:
    settings = ApprovalSettings()
    if settings.declare_topics:
        declare_topics(settings)
    return serve_processor(build_processor(settings), settings)


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m tether_devservices http|smtp|kv --port P --record FILE`: run one dev service until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from tether_devservices.http_service import start_http_service
from tether_devservices.kv_service import start_kv_service
from tether_devservices.smtp_sink import start_smtp_sink

STARTERS = {"http": start_http_service, "smtp": start_smtp_sink, "kv": start_kv_service}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tether_devservices", description=__doc__)
    parser.add_argument("kind", choices=sorted(STARTERS))
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0 picks a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback only by default)")
    parser.add_argument("--record", required=True, help="JSONL file every effect is appended to")
    parser.add_argument("--delay-ms", type=int, default=0,
                        help="answer every request this much later (the effect is recorded at once)")
    args = parser.parse_args(argv)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    service = STARTERS[args.kind](args.record, host=args.host, port=args.port, delay_ms=args.delay_ms)
    # One JSON line on stdout tells a launcher where we listen (useful with --port 0).
    print(json.dumps({"service": args.kind, "host": service.host, "port": service.port, "url": service.url}), flush=True)
    try:
        stop.wait()
    finally:
        service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m tether_modelserver --port P --scenarios DIR --request-log FILE`: serve scenarios on 127.0.0.1."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from tether_modelserver.scenarios import ScenarioError, bundled_scenarios_dir, load_scenarios
from tether_modelserver.server import ModelServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tether_modelserver", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8089, help="port; 0 picks a free one (see --port-file)")
    parser.add_argument(
        "--scenarios",
        type=Path,
        action="append",
        help="scenario directory or file; repeatable (default: the bundled scenarios, incl. the demo)",
    )
    parser.add_argument("--request-log", type=Path, help="append every request as a JSON line to this file")
    parser.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    parser.add_argument("--model", action="append", default=[], help="extra model name for GET /v1/models")
    args = parser.parse_args(argv)

    try:
        scenarios = load_scenarios(args.scenarios or [bundled_scenarios_dir()])
    except ScenarioError as exc:
        print(f"tether_modelserver: {exc}", file=sys.stderr)
        return 2
    server = ModelServer(
        scenarios, host=args.host, port=args.port, request_log=args.request_log, model_names=tuple(args.model)
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server.start()
    if args.port_file is not None:
        args.port_file.write_text(str(server.port))
    print(f"tether_modelserver listening on {server.url} with {len(scenarios)} scenarios: {', '.join(scenarios.names)}", flush=True)
    try:
        stop.wait()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

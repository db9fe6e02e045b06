"""Canary secrets through the real services: 20 secrets in 8 encodings flow through tools and are found nowhere.

The secrets live in the gateway's secret provider (environment, TETHER_GATEWAY_SECRETS_ENV_PREFIX); an
http_get version sends all of them as headers by handle (secret://canary/cNN); the page it fetches
holds every secret in 8 encodings. Afterwards every Kafka topic of the namespace, every log, a
pg_dump of the namespace's schemas, its Redis keys and the model server's request log are searched
for every form of every secret.
"""

from __future__ import annotations

import base64
import json
import secrets
import string
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote

import pytest

from tether_api.v1 import run_service_pb2 as runs_pb
from tether_testing.evidence import collect, leaks
from tether_testing.system import SystemConfig, TetherSystem

pytestmark = pytest.mark.e2e

SCENARIOS = Path(__file__).parent / "scenarios"
ENV_PREFIX = "E2E_CANARY_SECRET_"
TERMINAL = {runs_pb.RUN_STATUS_COMPLETED, runs_pb.RUN_STATUS_TERMINATED, runs_pb.RUN_STATUS_REJECTED}


def _rand(alphabet: str, n: int) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(n))


def make_canaries() -> dict[str, str]:
    """20 fresh secret values in the shapes real credentials have (ASCII: they travel in HTTP headers)."""
    an, up, hx = string.ascii_letters + string.digits, string.ascii_uppercase + string.digits, "0123456789abcdef"
    values = [
        "sk_live_" + _rand(an, 24),
        "AKIA" + _rand(up, 16),
        "ghp_" + _rand(an, 36),
        "xoxb-" + _rand(string.digits, 12) + "-" + _rand(an, 24),
        "eyJhbGciOiJIUzI1NiJ9." + base64.urlsafe_b64encode(secrets.token_bytes(24)).decode().rstrip("=")
        + "." + _rand(an, 22),
        str(uuid.uuid4()),
        secrets.token_hex(16),
        "Tr0ub4dor&3-" + _rand(an, 8) + "!",
        "correct horse battery " + _rand(string.ascii_lowercase, 10),
        base64.b64encode(secrets.token_bytes(24)).decode(),
        "AIza" + _rand(an + "-_", 35),
        "glpat-" + _rand(an, 20),
        "p@ss/w+rd=" + _rand(an, 10) + "%",
        "npm_" + _rand(an, 36),
        _rand(string.digits, 12),
        "SG." + _rand(an, 22) + "." + _rand(an, 43),
        "hunter2-" + _rand(hx, 12),
        "rk_test_" + _rand(an, 30),
        "mongodb+srv://app:" + _rand(an, 14) + "@db.internal",
        "Bearer-" + _rand(an + "._~", 28),
    ]
    return {f"c{i:02d}": v for i, v in enumerate(values)}


def encodings(value: str) -> dict[str, str]:
    """The 8 forms the page carries each secret in."""
    raw = value.encode()
    half = len(value) // 2
    return {
        "raw": value,
        "base64": base64.b64encode(raw).decode(),
        "base64url": base64.urlsafe_b64encode(raw).decode().rstrip("="),
        "hex": raw.hex(),
        "HEX": raw.hex().upper(),
        "urlencoded": quote(value, safe=""),
        "json": json.dumps(value)[1:-1],
        "split": value[:half] + "\n" + value[half:],
    }


class CanaryPage:
    """A web page (on 127.0.0.1) holding every canary in every encoding; records the headers it got."""

    def __init__(self, canaries: dict[str, str]) -> None:
        lines = [f"Status page. {name} {form}: {text}" for name, value in canaries.items()
                 for form, text in encodings(value).items()]
        body = ("\n".join(lines) + "\n").encode()
        self.received: list[dict[str, str]] = []
        page = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (stdlib name)
                page.received.append({k.lower(): v for k, v in self.headers.items()})
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/status"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def register_http_get_with_headers(system: TetherSystem, headers: dict[str, str]) -> None:
    """A new http_get version for the system's tenant that sends `headers` (secret handles) with each GET."""
    from tether_run_api.adapters.postgres import PostgresStore, open_pool
    from tether_tool_gateway.builtin_tools import http_get_spec

    pool = open_pool(system.config.pg_dsn, max_size=1)
    try:
        PostgresStore(pool, system.names.run_api_schema).register_tool(
            system.bootstrap.tenant_id, http_get_spec(["127.0.0.1", "localhost"], headers=headers), "e2e",
            time.time_ns() // 1_000_000, None)
    finally:
        pool.close()


@pytest.fixture(scope="module")
def canaries() -> dict[str, str]:
    return make_canaries()


@pytest.fixture(scope="module")
def canary_system(kafka_bootstrap, pg_dsn, redis_url, tmp_path_factory, canaries) -> Iterator[TetherSystem]:
    gateway_env = {"TETHER_GATEWAY_SECRETS_ENV_PREFIX": ENV_PREFIX}
    gateway_env |= {f"{ENV_PREFIX}CANARY_{name.upper()}": value for name, value in canaries.items()}
    system = TetherSystem(SystemConfig(
        kafka_bootstrap=kafka_bootstrap, pg_dsn=pg_dsn, redis_url=redis_url, partitions=2,
        workdir=tmp_path_factory.mktemp("tether-canary"), scenarios=[SCENARIOS],
        extra_env={"tool-gateway": gateway_env},
    ))
    try:
        system.start()
        yield system
    finally:
        system.stop()
        system.drop_data()


def test_twenty_canaries_in_eight_encodings_are_found_nowhere(canary_system, canaries):
    system = canary_system
    register_http_get_with_headers(system, {f"X-Canary-{name}": f"secret://canary/{name}" for name in canaries})
    page = CanaryPage(canaries)
    try:
        run_id = system.client.submit(f"[scenario:e2e-canary] Read {page.url} and keep a copy.")
        # Keeping a copy of a page it read is kv_put on a tainted run: a human approves it (TAINTED_EGRESS),
        # which also puts the approval path's events and rows among the places searched below.
        asked = []
        for event in system.client.follow(run_id, timeout_s=120):
            if event.event_type == "tether.v1.ApprovalRequested":
                request = json.loads(event.payload_json)
                asked.append((request["tool_name"], request["reasons"]))
                system.approver.decide(request["approval_id"], request["args_hash"], approve=True)
        run = system.client.get_run(run_id)
        if run.status not in TERMINAL:
            pytest.fail("the canary run did not end\n" + system.log_tail("tool-gateway", 30))
        assert asked == [("kv_put", ["TAINTED_EGRESS"])]
    finally:
        page.close()
    assert run.status == runs_pb.RUN_STATUS_COMPLETED, system.log_tail("tool-gateway", 30)

    # The secrets really flowed: the gateway resolved every handle and sent the values.
    assert len(page.received) >= 1
    assert {name: page.received[0].get(f"x-canary-{name}".lower()) for name in canaries} == canaries
    # And the page's content reached the model (redacted), through the tool results and kv_put.
    bodies = [json.dumps(r["body"]) for r in system.model_requests() if r["headers"].get("x-tether-run") == run_id]
    assert any("Status page. c00 raw" in b for b in bodies)
    assert any("[REDACTED" in b for b in bodies)
    assert [r for r in system.sink_records("kv") if r.get("key") == system.kv_store_key(f"canary/{run_id}")]

    needles = {f"{name}/{form}": text.encode() for name, value in canaries.items()
               for form, text in encodings(value).items() if form != "split"}
    evidence = collect(system)
    kinds = {ev.where.split(" ", 1)[0] for ev in evidence}
    assert {"kafka", "log", "pg_dump", "redis", "model"} <= kinds, kinds
    assert any(b"Status page. c00 raw" in ev.data for ev in evidence if ev.where.startswith("kafka"))
    found = leaks(evidence, needles)
    assert found == [], "\n".join(found[:40]) + "\n" + _context(evidence, found, needles)


def _context(evidence, found: list[str], needles: dict[str, bytes]) -> str:
    """Where the first few leaks are, with the bytes around them (for the failure message)."""
    out = []
    for hit in found[:3]:
        where, name = hit.rsplit(": ", 1)
        ev = next(e for e in evidence if e.where == where)
        at = ev.data.find(needles[name])
        out.append(f"{hit}: ...{ev.data[max(0, at - 300):at + 60]!r}...")
    return "\n".join(out)

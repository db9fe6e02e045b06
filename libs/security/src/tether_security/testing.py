"""Test support: deterministic canary secrets, their 8 encodings, and benign log records to plant them in."""

from __future__ import annotations

import base64
import hashlib
import json
import random
import string
import uuid
from dataclasses import dataclass
from urllib.parse import quote

ALNUM = string.ascii_letters + string.digits
UPPER_ALNUM = string.ascii_uppercase + string.digits


@dataclass(frozen=True)
class Planted:
    """One secret in one encoding, inside one log record."""

    secret_name: str
    encoding: str
    encoded: str  # the planted text as it appears in the record (line breaks included for "split")
    record: str


def _pick(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def canary_secrets(seed: int = 20) -> dict[str, str]:
    """20 canaries of mixed formats (vendor tokens, JWT, PEM key, random hex/base64, JSON blob, passwords)."""
    rng = random.Random(seed)
    header = _b64url(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    payload = _b64url(json.dumps({"sub": _pick(rng, ALNUM, 12), "iat": 1700000000 + rng.randrange(10**6)}).encode())
    body = base64.b64encode(rng.randbytes(600)).decode()
    pem = "-----BEGIN RSA PRIVATE KEY-----\n" + "\n".join(body[i:i + 64] for i in range(0, len(body), 64)) + \
        "\n-----END RSA PRIVATE KEY-----\n"
    return {
        "aws_access_key_id": "AKIA" + _pick(rng, UPPER_ALNUM, 16),
        "aws_secret_access_key": _pick(rng, ALNUM + "+/", 40),
        "github_classic": "ghp_" + _pick(rng, ALNUM, 36),
        "github_fine_grained": "github_pat_" + _pick(rng, ALNUM, 22) + "_" + _pick(rng, ALNUM, 59),
        "github_oauth": "gho_" + _pick(rng, ALNUM, 36),
        "slack_bot": f"xoxb-{rng.randrange(10**11, 10**12)}-{rng.randrange(10**12, 10**13)}-{_pick(rng, ALNUM, 24)}",
        "stripe_live": "sk_live_" + _pick(rng, ALNUM, 24),
        "stripe_test": "sk_test_" + _pick(rng, ALNUM, 24),
        "jwt": f"{header}.{payload}.{_b64url(rng.randbytes(32))}",
        "pem_private_key": pem,
        "random_hex_32": rng.randbytes(32).hex(),
        "random_base64_32": base64.b64encode(rng.randbytes(32)).decode(),
        "json_blob": json.dumps({"client_id": _pick(rng, ALNUM, 16), "client_secret": _pick(rng, ALNUM, 32)}),
        "passphrase_unicode": "correct horse/battery+staple&9=Ω" + _pick(rng, ALNUM, 4),
        "google_api_key": "AIza" + _pick(rng, ALNUM + "_-", 35),
        "sendgrid": "SG." + _pick(rng, ALNUM, 22) + "." + _pick(rng, ALNUM, 43),
        "npm": "npm_" + _pick(rng, ALNUM, 36),
        "openai_project": "sk-proj-" + _pick(rng, ALNUM, 48),
        "database_url": f"postgresql://app:{_pick(rng, ALNUM, 10)}!pa55@db.internal:5432/app",
        "human_password": "Tr0ub4dor&3" + _pick(rng, ALNUM, 2),
    }


def _split3(value: str) -> str:
    a, b = len(value) // 3, 2 * len(value) // 3
    return value[:a] + "\n" + value[a:b] + "\n" + value[b:]


ENCODINGS = {
    "raw": lambda v: v,
    "base64": lambda v: base64.b64encode(v.encode()).decode(),
    "base64url_nopad": lambda v: base64.urlsafe_b64encode(v.encode()).decode().rstrip("="),
    "hex": lambda v: v.encode().hex(),
    "hex_upper": lambda v: v.encode().hex().upper(),
    "url": lambda v: quote(v, safe=""),
    "json_escaped": lambda v: json.dumps(v)[1:-1],
    "split_lines": _split3,
}


def _benign(rng: random.Random, i: int) -> str:
    ts = f"2025-11-{1 + i % 28:02d}T{i % 24:02d}:{i % 60:02d}:{(i * 7) % 60:02d}.{i % 1000:03d}Z"
    run = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    digest = hashlib.sha256(f"benign-{i}".encode()).hexdigest()
    sha1 = hashlib.sha1(f"commit-{i}".encode()).hexdigest()
    step, call = rng.randrange(1, 40), rng.randrange(0, 4)
    svc = rng.choice(["planner", "budget", "tool-gateway", "approval", "projector", "run-api"])
    pod = f"{svc}-{_pick(rng, 'bcdfghjklmnpqrstvwxz2456789', 10)}-{_pick(rng, 'bcdfghjklmnpqrstvwxz2456789', 5)}"
    templates = [
        f'{ts} INFO {svc} step granted run_id={run} step={step} remaining_tokens={rng.randrange(10**5)}',
        f'{{"ts": "{ts}", "level": "info", "service": "{svc}", "event": "envelope appended", "run_id": "{run}", '
        f'"event_id": "{digest}", "seq": {rng.randrange(10**6)}}}',
        f'{ts} DEBUG tool-gateway call_id={step}.{call} args_hash={digest} '
        f'idem_key={hashlib.sha256(digest.encode()).hexdigest()}',
        f'{ts} INFO http GET /v1/runs/{run}/events?page={rng.randrange(9)}&limit=50 status=200 '
        f'duration_ms={rng.randrange(900)}',
        f'{ts} WARNING planner model call retried attempt={rng.randrange(1, 4)} model=claude-sonnet-4-5 '
        f'input_tokens={rng.randrange(9000)} output_tokens={rng.randrange(4000)} cost_usd=0.{rng.randrange(10**4):04d}',
        f'{ts} INFO deploy image=ghcr.io/acme/tether-{svc}@sha256:{digest} pod={pod} node=worker-{rng.randrange(9)}',
        f'{ts} INFO git checkout commit {sha1} branch=feature/{_pick(rng, string.ascii_lowercase, 8)}',
        f'{ts} DEBUG sql SELECT run_id, step, status FROM read_model.runs WHERE tenant_id = %s AND updated_at > %s '
        f'LIMIT {rng.randrange(10, 500)}',
        f'{ts} INFO kafka committed topic=tether.run-events.v1 partition={rng.randrange(12)} '
        f'offset={rng.randrange(10**7)} group=projector-{rng.randrange(9)}',
        f'  File "/work/main/services/{svc.replace("-", "_")}/src/tether_{svc.replace("-", "_")}/handlers.py", '
        f'line {rng.randrange(20, 400)}, in on_tool_call_budgeted',
        f'{ts} INFO approval requested approval_id={run} tool=send_email risk=irreversible approver_group=finance',
        f'{ts} INFO secret resolved name=stripe/test handle=secret://stripe/test for call_id={step}.{call}',
        f'{ts} INFO password reset email queued for user_id={rng.randrange(10**6)} template=reset_v2',
        f'{ts} INFO token budget check run_id={run} tokens_used={rng.randrange(10**5)} max_tokens=200000',
        f'{ts} ERROR tool-gateway ToolCallFailed code=HTTP_502 url=https://api.example.com/v2/orders/'
        f'{rng.randrange(10**6)}?expand=items retry_after_s={rng.randrange(60)}',
        f'{ts} INFO etag="W/{hashlib.md5(run.encode()).hexdigest()}" cache=hit path=/static/app.{sha1[:8]}.js',
        f'{ts} DEBUG loop guard signature a={digest[:16]} o={sha1[:16]} period=2 repeats={rng.randrange(4)}',
        f'{ts} INFO trace_id={uuid.UUID(int=rng.getrandbits(128)).hex} span_id={rng.getrandbits(64):016x} '
        f'parent_id={rng.getrandbits(64):016x}',
        f'{ts} INFO sandbox finished argv=["/usr/bin/python3", "/run/tether/script"] exit_code=0 '
        f'peak_tasks={rng.randrange(1, 9)} cpu_seconds=0.{rng.randrange(99):02d}',
        f'{ts} INFO projector upsert run {run} status=RUNNING steps={step} '
        f'path=/var/lib/tether/blobs/{digest[:2]}/{digest[2:4]}/{digest}',
        f'{ts} INFO user agent="Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) '
        f'Chrome/124.0.0.0 Safari/537.36"',
        f'{ts} INFO schema fingerprint=sha256:{digest} record=tether.v1.ToolCallRequested version={rng.randrange(9)}',
        f'{ts} ERROR blobs checksum mismatch: expected {digest} got {hashlib.sha256(run.encode()).hexdigest()}',
        f'{ts} INFO http GET /v1/runs?cursor={base64.urlsafe_b64encode(json.dumps({"after": run}).encode()).decode()}'
        f' status=200',
        f'{ts} INFO request id={_pick(rng, "0123456789ABCDEFGHJKMNPQRSTVWXYZ", 26)} tenant=acme-{rng.randrange(99)} '
        f'route=/tether.v1.RunService/SubmitRun grpc_code=OK',
        f'{ts} DEBUG module tether_tool_gateway.executors.builtin.http_fetch_with_redirect_limit_and_size_cap '
        f'loaded in {rng.randrange(90)}ms',
    ]
    return templates[i % len(templates)]


def _planted_record(rng: random.Random, name: str, encoding: str, encoded: str, i: int) -> str:
    ts = f"2025-11-{1 + i % 28:02d}T{i % 24:02d}:{i % 60:02d}:00.000Z"
    if encoding == "json_escaped":
        return f'{{"ts": "{ts}", "event": "tool output", "call_id": "{i}.0", "stdout": "result {encoded} done"}}'
    if encoding == "split_lines":
        return f"{ts} INFO tool output call_id={i}.0 stdout:\n{encoded}\nexit_code=0"
    return f"{ts} INFO tool output call_id={i}.0 body={encoded} bytes={rng.randrange(10**4)}"


def build_corpus(seed: int = 2025, benign_count: int = 2000) -> tuple[dict[str, str], list[str], list[Planted]]:
    """(secrets, benign records, planted records) — the same every run for a given seed."""
    rng = random.Random(seed)
    secrets = canary_secrets()
    benign = [_benign(rng, i) for i in range(benign_count)]
    planted = []
    i = 0
    for name, value in secrets.items():
        for encoding, encode in ENCODINGS.items():
            encoded = encode(value)
            planted.append(Planted(name, encoding, encoded, _planted_record(rng, name, encoding, encoded, i)))
            i += 1
    return secrets, benign, planted

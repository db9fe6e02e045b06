"""`make run`'s demo (deploy/local/run-demo) on the running stack: offline, approved, answered, exit 0, nothing left."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tether_testing.names import unique_name
from tether_testing.system import Names, drop_namespace

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
RUN_DEMO = ROOT / "deploy" / "local" / "run-demo"
#: Settings that would make the demo use a real provider or another goal.
NOT_INHERITED = ("GOAL", "TETHER_LLM_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_API_KEY")


def test_run_demo_completes_offline_with_an_approval_and_prints_the_answer(
        kafka_bootstrap, pg_dsn, redis_url, tmp_path, processes_of):
    namespace = unique_name("e2e_demo", sep="_")
    env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED and not k.startswith("TETHER_DEMO_")}
    env |= {
        "TETHER_KAFKA_BOOTSTRAP": kafka_bootstrap, "TETHER_PG_DSN": pg_dsn, "TETHER_REDIS_URL": redis_url,
        "TETHER_STATE_DIR": str(tmp_path), "TETHER_PARTITIONS": "2",
        "TETHER_DEMO_NAMESPACE": namespace, "TETHER_DEMO_TIMEOUT_S": "240",
    }
    try:
        done = subprocess.run([str(RUN_DEMO)], env=env, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=480)
        out = done.stdout
        assert done.returncode == 0, f"exit {done.returncode}\n{out}\n{done.stderr}"
        assert "using the built-in offline demo model" in out
        # The events were streamed as they happened, in order, the approval decided in between.
        lines = out.splitlines()
        order = [next(i for i, line in enumerate(lines) if marker in line) for marker in (
            "RunAccepted", "ToolCallCompleted", "ApprovalRequested", "approving as demo approver",
            "ApprovalDecided", "RunCompleted")]
        assert order == sorted(order)
        assert re.search(r"^run \S+: COMPLETED$", out, re.MULTILINE)
        answer = lines[lines.index("answer:") + 1]
        assert answer.startswith('Summary for the goal "Look up the service status page at http://127.0.0.1:')
        assert "1 HTTP request(s), 1 KV write(s), 1 email(s)" in out

        workdir = tmp_path / f"demo-{namespace}"
        assert not (workdir / "processes.json").exists()
        # Services carry the topic prefix, the sinks and the model the demo's namespace.
        assert processes_of(env_entry=f"TETHER_TOPIC_PREFIX={namespace}.") == []
        assert processes_of(env_entry=f"TETHER_DEMO_NAMESPACE={namespace}") == []
        fetched = [line for line in (workdir / "sinks" / "http.jsonl").read_text().splitlines() if line.strip()]
        assert len(fetched) == 1 and '"/service-status"' in fetched[0]
    finally:
        drop_namespace(Names(namespace), kafka_bootstrap=kafka_bootstrap, pg_dsn=pg_dsn, redis_url=redis_url)

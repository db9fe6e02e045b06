"""On the real stack: a run's hash-chain verdict from the projector reaches a gRPC client (Run.chain_ok)."""

from __future__ import annotations

import uuid

import pytest
from psycopg import sql
from typer.testing import CliRunner

from tether_api.v1 import run_service_pb2 as runs_pb, run_service_pb2_grpc as runs_grpc
from tether_run_api import admin
from tether_run_api.cli import main as cli
from tether_run_api.domain.auth import ROLE_MEMBER
from tether_run_api.domain.runs import new_run_id

pytestmark = pytest.mark.integration


def test_get_run_says_whether_the_run_s_hash_chain_is_intact(stack, monkeypatch) -> None:
    tenant_id = f"t-{uuid.uuid4().hex[:10]}"
    admin.create_tenant(stack.app.store, tenant_id, spread=1)
    key = admin.issue_key(stack.app.store, tenant_id, "alice", (ROLE_MEMBER,)).api_key
    intact, broken = (new_run_id(1_700_000_000_000 + i, uuid.uuid4().bytes[:10]) for i in range(2))
    with stack.pg() as conn:
        for run_id, chain_ok in ((intact, True), (broken, False)):
            # The projector's row: a PREV_HASH_MISMATCH at seq 2 set chain_ok false.
            conn.execute(sql.SQL(
                "INSERT INTO {}.runs (run_id, tenant_id, status, agent_id, agent_version, goal, principal_id, "
                "created_at_ms, updated_at_ms, last_seq, last_hash, state, chain_ok, chain_problems) "
                "VALUES (%s, %s, 'COMPLETED', 'helper', 1, 'g', 'alice', 1, 1, 2, '', '{{}}', %s, %s)").format(
                sql.Identifier(stack.settings.read_model_schema)),
                (run_id, tenant_id, chain_ok, "[]" if chain_ok else '["seq 2 PREV_HASH_MISMATCH: prev_hash x != y"]'))
    runs = runs_grpc.RunServiceStub(stack.channel)
    md = [("authorization", f"Bearer {key}")]
    got = {run_id: runs.GetRun(runs_pb.GetRunRequest(run_id=run_id), metadata=md, timeout=30).run
           for run_id in (intact, broken)}
    assert all(run.HasField("chain_ok") for run in got.values())
    assert got[intact].chain_ok is True and got[broken].chain_ok is False

    # `tether get` says so, with the command to investigate; an intact run says nothing of it.
    monkeypatch.setenv("TETHER_ADDR", stack.address)
    monkeypatch.setenv("TETHER_API_KEY", key)
    shown = {run_id: CliRunner().invoke(cli.app, ["get", run_id]) for run_id in (intact, broken)}
    assert shown[broken].exit_code == 0, shown[broken].output
    assert "chain broken" in shown[broken].output and f"tether audit verify --run {broken}" in shown[broken].output
    assert "chain broken" not in shown[intact].output
    assert '"chain_ok": false' in CliRunner().invoke(cli.app, ["--json", "get", broken]).output

"""The read model's load: the run lock's answer never stands in for the runs read after it.

The 10,000-run load test once killed the projector with KeyError 'run_id': the load's `fetchall`
returned rows without the column, i.e. the lock statement's rows, which ran just before it on the
same cursor inside one pipeline. That was not reproduced on demand (this test, under the
conditions of the failure — a batch of thousands of runs, the lock's answer back before the read
is sent — passed against the pipelined code too); the load now runs its two statements one at a
time, so a cursor holds only the answer it waits for, and the 10,000-run test passes.
"""

from __future__ import annotations

import time

import psycopg
import pytest
from psycopg import sql

from tether_projector.adapters.postgres import PostgresReadModel
from tether_projector.domain.state import RunFold


def test_a_load_of_thousands_of_runs_reads_the_runs_after_a_late_lock(pg_read_model: PostgresReadModel, pg_dsn: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    fold = RunFold(run_id="run-1", tenant_id="t", created_at_ms=1)
    with psycopg.connect(pg_dsn, autocommit=True) as setup:
        setup.execute(
            sql.SQL("INSERT INTO {}.runs (run_id, tenant_id, status, created_at_ms, updated_at_ms, last_seq, last_hash,"
                    " state) VALUES (%s, %s, 'RUNNING', 1, 1, 0, '', %s)").format(sql.Identifier(pg_read_model.schema)),
            ("run-1", "t", fold.model_dump_json()))

    # One lock row per run: a batch of a few hundred runs makes the lock's answer outgrow the
    # server's output buffer, which is then sent before the read's (not only at the sync).
    many = ["run-1", *(f"absent-{n}" for n in range(3000))]
    statement = PostgresReadModel.statement

    def read_statement_after_the_lock_answered(self: PostgresReadModel, key: tuple) -> bytes:
        if key == ("load",):
            time.sleep(0.3)  # a busy machine: the lock's answer is back before the read is sent
        return statement(self, key)

    monkeypatch.setattr(PostgresReadModel, "statement", read_statement_after_the_lock_answered)
    with pg_read_model.transaction() as tx:
        assert tx.load_runs(many) == {"run-1": fold}

"""The door's tenant backlog gauge over PostgreSQL: the read model's open runs plus recent submits it does not show yet."""

from __future__ import annotations

from psycopg import errors, sql
from psycopg_pool import ConnectionPool

from tether_run_api.adapters.postgres import unavailable_as_error
from tether_run_api.domain.errors import BackendUnavailable

#: The projector's runs.status values of a run that is queued or in progress (holds capacity).
OPEN_STATUSES = ("QUEUED", "ACCEPTED", "RUNNING", "WAITING_APPROVAL", "OUTCOME_UNKNOWN")

_QUERY = """
SELECT
  (SELECT count(*) FROM {rm}.runs WHERE tenant_id = %(t)s AND status = ANY(%(open)s))
  + (SELECT count(*) FROM {ra}.submissions s
       WHERE s.tenant_id = %(t)s AND s.created_at_ms >= %(since)s
         AND NOT EXISTS (SELECT 1 FROM {rm}.runs r WHERE r.run_id = s.run_id)) AS backlog
"""


class PostgresTenantBacklog:
    """TenantBacklog over the run_api submit ledger and the projector's runs table (one query,
    on the indexes runs(tenant_id, status) and submissions(tenant_id, created_at_ms))."""

    def __init__(self, pool: ConnectionPool, run_api_schema: str = "run_api", read_model_schema: str = "read_model"):
        self._pool = pool
        self._query = sql.SQL(_QUERY).format(ra=sql.Identifier(run_api_schema), rm=sql.Identifier(read_model_schema))

    @unavailable_as_error
    def backlog(self, tenant_id: str, submitted_since_ms: int) -> int:
        try:
            with self._pool.connection() as conn:
                row = conn.execute(self._query, {"t": tenant_id, "open": list(OPEN_STATUSES),
                                                 "since": submitted_since_ms}).fetchone()
        except (errors.UndefinedTable, errors.InvalidSchemaName) as exc:
            raise BackendUnavailable("read model", "its tables do not exist yet; is the projector running?") from exc
        return int(row["backlog"])

"""A fresh PostgreSQL schema per test, so parallel runs share one database without colliding."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from tether_testing.names import unique_name


@dataclass(frozen=True)
class PgSchema:
    """A schema created for one test: connect with `dsn` and unqualified names land in it."""

    name: str
    dsn: str
    base_dsn: str


def create_schema(base_dsn: str, prefix: str = "test") -> PgSchema:
    """Create a uniquely named schema and return a DSN whose search_path is that schema."""
    name = unique_name(prefix, sep="_").lower()
    with psycopg.connect(base_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    return PgSchema(name=name, dsn=make_conninfo(base_dsn, options=f"-csearch_path={name}"), base_dsn=base_dsn)


def drop_schema(schema: PgSchema) -> None:
    """Drop the schema and everything in it."""
    with psycopg.connect(schema.base_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema.name)))

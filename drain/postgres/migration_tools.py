"""``drain migrate`` inside an application's own migration tool (docs/migration_tools.md).

The Django app (drain.postgres.django) and the Alembic helper
(drain.postgres.alembic) both end here: :func:`apply` runs
:func:`drain.postgres.migration.migrate`, the very code ``drain migrate`` runs,
on the psycopg connection the tool already holds. So the
schema, the recorded ``schema_version`` and the group roles are the ones
``drain migrate`` gives, and so are its lock-timeout and deadlock retries.

Those retries are the reason the connection must be outside any transaction
when the schema is applied: each attempt is a transaction of its own, which
holds the tables' locks only while the schema is applied. Inside the tool's
transaction each attempt would be a savepoint, and the locks it took, and its
``SET LOCAL lock_timeout``, would last until the tool committed, holding the
application's writers up behind the rest of its migrations. Each tool gets
there its own way (drain.postgres.django: ``atomic = False``;
drain.postgres.alembic: Alembic's ``autocommit_block``); :func:`apply` refuses a connection in a
transaction rather than quietly run the schema in someone else's.

Nothing here imports Django or Alembic: ``import drain`` never does either.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from psycopg import pq

from drain.errors import ConfigError
from drain.postgres import migration

log = logging.getLogger("drain.store")


def check_prefix(prefix: object, setting: str) -> str | None:
    """``prefix`` (None: the database's own, staging_schema.sql) if it is a role
    prefix ``drain migrate --role-prefix`` takes, else ConfigError in one line
    naming ``setting``."""
    if prefix is None or prefix == "":
        return None
    return migration.check_role_prefix(prefix, setting)


def apply(conn: Any, *, role_prefix: str | None, tool: str) -> str:
    """Apply the staging schema on ``conn``, the psycopg (3) connection a migration
    ``tool`` holds, as ``drain migrate`` does; return the database's role prefix.

    ConfigError in one line when ``conn`` is another driver's connection, or is
    in a transaction or out of autocommit (module docstring)."""
    if not isinstance(conn, psycopg.Connection):
        raise ConfigError(
            f"{tool}: drain's schema needs a psycopg (3) connection, not "
            f"{type(conn).__module__}.{type(conn).__qualname__} (docs/migration_tools.md)")
    # Not in autocommit: the tool has a transaction open, or will open one at the next
    # statement, and would then commit or roll back what it believes its own.
    if not conn.autocommit or conn.info.transaction_status != pq.TransactionStatus.IDLE:
        raise ConfigError(
            f"{tool}: the connection is in a transaction of its own (not in autocommit); "
            "drain's schema is applied in transactions of drain's (docs/migration_tools.md)")
    prefix = migration.migrate(conn, role_prefix=role_prefix)
    log.info("%s: drain's schema version %d applied; its roles: %s", tool,
             migration.SCHEMA_VERSION, ", ".join(migration.role_names(prefix)))
    return prefix

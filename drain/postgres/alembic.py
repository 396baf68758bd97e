"""drain's schema through Alembic: a revision calls :func:`upgrade` (docs/migration_tools.md).

A revision of the application's::

    from alembic import op

    from drain.postgres import alembic as drain_schema

    def upgrade() -> None:
        drain_schema.upgrade(op)

    def downgrade() -> None:
        drain_schema.downgrade(op)

:func:`upgrade` runs ``drain migrate``'s own code (drain.postgres.migration_tools)
on the psycopg connection under Alembic's SQLAlchemy connection, reached through
SQLAlchemy's public ``Connection.connection.driver_connection``: the same
schema, ``schema_version`` and group roles, the same lock-timeout and deadlock
retries. It does so inside Alembic's ``autocommit_block()``, outside the
migration's transaction, for the reason drain.postgres.migration_tools gives; as
Alembic warns, that commits the revisions that ran before it in the same
``alembic upgrade`` first (``transaction_per_migration=True`` in env.py makes
every revision a transaction of its own anyway). The URL must use SQLAlchemy's
psycopg (3) driver, ``postgresql+psycopg://``; offline mode (``alembic upgrade
--sql``) is refused: ``drain migrate --print`` prints the schema for a script.

One revision is enough for one drain version: it applies the whole staging
schema of the drain installed. After upgrading to a drain whose
``SCHEMA_VERSION`` is higher, add a revision that calls :func:`upgrade` again
(or run ``drain migrate``): ``drain migrate --check`` tells whether one is due.

Importing this module imports Alembic; ``import drain`` never does.
"""

from __future__ import annotations

import psycopg
from alembic.operations import Operations
from alembic.util import CommandError

from drain.errors import ConfigError, DrainError
from drain.postgres import migration_tools
from drain.settings.url_parts import first_line

TOOL = "drain.postgres.alembic"


def upgrade(op: Operations, *, role_prefix: str | None = None) -> str:
    """Apply drain's staging schema as ``drain migrate --role-prefix role_prefix``
    does (None: the database's own prefix), on the revision's database; return the
    database's role prefix.

    Errors are Alembic's CommandError in one line (``alembic`` prints that line
    alone): offline mode, another database than PostgreSQL, another
    driver than psycopg (3), and what ``drain migrate`` refuses."""
    try:
        return _upgrade(op, role_prefix)
    except DrainError as exc:
        raise CommandError(str(exc)) from exc
    except psycopg.Error as exc:
        raise CommandError(f"{TOOL}: {first_line(exc)}") from exc


def _upgrade(op: Operations, role_prefix: str | None) -> str:
    prefix = migration_tools.check_prefix(role_prefix, f"{TOOL}.upgrade role_prefix")
    context = op.get_context()
    if context.as_sql:
        raise ConfigError(
            f"{TOOL}: offline mode (--sql) cannot run drain's migrate; "
            "`drain migrate --print` prints the schema")
    dialect = op.get_bind().dialect
    if dialect.name != "postgresql":
        raise ConfigError(f"{TOOL}: the database is {dialect.name}; drain's schema needs "
                          "PostgreSQL")
    with context.autocommit_block():
        driver = op.get_bind().connection.driver_connection
        return migration_tools.apply(driver, role_prefix=prefix, tool=TOOL)


def downgrade(op: Operations) -> None:
    """Leave drain's schema in place: its tables may hold staged jobs that no
    downgrade should drop. A later :func:`upgrade` finds it there and changes
    nothing; drop it by hand once drained, if ever (docs/migration_tools.md)."""
    del op

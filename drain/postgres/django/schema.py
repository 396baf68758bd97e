"""What drain's Django migrations run: ``drain migrate``, on Django's own connection.

**One migration per schema version.** ``migrations/000N_schema_version_N.py``
for each ``SCHEMA_VERSION`` N (drain.postgres.migration), each one a
``RunPython(forwards, backwards)``, each depending on the one before.
:func:`forwards` always applies the whole of the installed drain's staging_schema.sql, as ``drain
migrate`` does (it is idempotent): on a new database 0001 brings it to the
current version at once and the later ones repeat it, harmlessly; on a database
at version N, upgrading the package adds N+1's file and ``manage.py migrate``
applies it. A database ``drain migrate`` already migrated is migrated again,
changing nothing. tests/unit/test_django_migrations.py keeps the files and
``SCHEMA_VERSION`` in step.

**Not atomic.** Each migration says ``atomic = False``: Django's connection
stays in autocommit, and drain's migrate makes its own transactions, one per
attempt, waiting at most a second for each table lock and retrying
(drain.postgres.migration_tools says why a transaction of Django's would not
do). Should the process die between drain's commit and Django's record of the migration,
the next ``manage.py migrate`` applies the schema again, which changes nothing.

**Backwards leaves the schema.** Unapplying a drain migration (``manage.py
migrate drain zero``) changes nothing in the database: dropping the tables could
drop staged jobs. The next ``manage.py migrate`` applies the schema again, which
changes nothing either (docs/migration_tools.md).

The role prefix is ``settings.DRAIN_ROLE_PREFIX`` when set (a string, or a dict
of database alias to prefix); otherwise the database's own, as with ``drain
migrate`` without ``--role-prefix`` (docs/running.md, "Database roles").
"""

from __future__ import annotations

from typing import Any

import psycopg
from django.conf import settings
from django.core.management.base import CommandError

from drain.errors import DrainError
from drain.postgres import migration_tools
from drain.settings.url_parts import first_line

TOOL = "drain.postgres.django"


def forwards(apps: Any, schema_editor: Any) -> None:
    """A drain migration's RunPython: the staging schema on ``schema_editor``'s
    database. Errors are CommandError in one line (manage.py prints just that)."""
    del apps  # drain has no Django models
    connection = schema_editor.connection
    alias = connection.alias
    if connection.vendor != "postgresql":
        raise CommandError(
            f"{TOOL}: database {alias!r} is {connection.vendor}; drain's schema needs "
            "PostgreSQL (route the drain app to a PostgreSQL database: "
            "docs/migration_tools.md)")
    try:
        prefix = migration_tools.check_prefix(_prefix_setting(alias), "DRAIN_ROLE_PREFIX")
        connection.ensure_connection()
        migration_tools.apply(connection.connection, role_prefix=prefix,
                              tool=f"{TOOL} (database {alias!r})")
    except DrainError as exc:
        raise CommandError(str(exc)) from exc
    except psycopg.Error as exc:
        raise CommandError(f"{TOOL} (database {alias!r}): {first_line(exc)}") from exc


def _prefix_setting(alias: str) -> object:
    value = getattr(settings, "DRAIN_ROLE_PREFIX", None)
    return value.get(alias) if isinstance(value, dict) else value


def backwards(apps: Any, schema_editor: Any) -> None:
    """Unapplying a drain migration leaves the schema as it is (module docstring)."""
    del apps, schema_editor

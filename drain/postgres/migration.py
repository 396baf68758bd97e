"""``drain migrate``: the staging schema applied to a live database, and its roles.

The schema itself is staging_schema.sql (drain.postgres.sql reads it); this module
applies it in one transaction that waits briefly for each table lock, and names
the group roles it makes.
"""

from __future__ import annotations

import logging
import re
import time

import psycopg
import psycopg.errors
from psycopg import sql as psql

from drain.errors import ConfigError, DrainError, RolesShared, SchemaMissing, SchemaNewer
from drain.postgres import sql
from drain.settings.url_parts import first_line

log = logging.getLogger("drain.store")


#: The version staging_schema.sql records in drain_settings ('schema_version'):
#: one more with each release that changes the schema (tests/unit/test_schema_version.py
#: keeps the two equal).
SCHEMA_VERSION = 1

#: `drain migrate` waits this long for each lock on a table in use, then tries again.
MIGRATE_LOCK_TIMEOUT = 1.0
MIGRATE_ATTEMPTS = 60


#: The kinds of group role ``drain migrate`` makes, each ``<role prefix><kind>``.
ROLE_KINDS = ("stager", "runner", "operator", "consumer")
#: What ``--role-prefix`` accepts: a lowercase SQL name that leaves room for the kind.
ROLE_PREFIX = re.compile(r"[a-z_][a-z0-9_]{0,54}")
#: The SQLSTATE staging_schema.sql raises when a prefix's roles serve another database.
ROLES_SHARED = "DR001"


def check_role_prefix(prefix: object, setting: str = "--role-prefix") -> str:
    """``prefix`` if it may be a role prefix, else ConfigError in one line naming
    ``setting`` (where it was given: the option, a Django setting...)."""
    if not isinstance(prefix, str) or not ROLE_PREFIX.fullmatch(prefix):
        raise ConfigError(
            f"{setting} {prefix!r}: give 1 to 55 lowercase letters, digits and _, "
            "not starting with a digit (e.g. billing_drain_)")
    return prefix


def migrate(conn: psycopg.Connection[tuple[object, ...]], *,
            role_prefix: str | None = None,
            lock_timeout: float = MIGRATE_LOCK_TIMEOUT,
            attempts: int = MIGRATE_ATTEMPTS) -> str:
    """Apply the staging schema in one transaction (idempotent), on a live database;
    return the prefix of the database's group roles (staging_schema.sql says how
    it is chosen; ``role_prefix`` chooses it).

    The schema's changes to a table in use (staging_schema.sql) lock it
    briefly, and every writer queues behind a lock that is waiting. So each
    attempt waits at most ``lock_timeout`` seconds for a lock, then rolls back
    and tries again a moment later: the application's writers are held up for
    at most that long, even behind a long transaction. A deadlock with another
    session (Postgres ends one of the two: a drain that took the tables in the
    other order) rolls the attempt back and tries again too. Raises DrainError after
    ``attempts`` tries, RolesShared when the prefix's roles hold privileges in
    another database of the cluster.
    """
    if role_prefix is not None:
        check_role_prefix(role_prefix)
    for attempt in range(1, attempts + 1):
        try:
            with conn.transaction():
                # Two migrations at once would race on CREATE ... IF NOT EXISTS.
                conn.execute("SELECT pg_advisory_xact_lock(hashtext('drain migrate'))")
                conn.execute(psql.SQL("SET LOCAL lock_timeout = {}").format(
                    psql.Literal(f"{max(1, int(lock_timeout * 1000))}ms")))
                conn.execute("SELECT set_config('drain.role_prefix', %s, true)",
                             (role_prefix or "",))
                _lock_in_the_drains_order(conn)
                conn.execute(psql.SQL(sql.schema_text()))
                row = conn.execute(
                    "SELECT value FROM drain_settings WHERE key = 'role_prefix'").fetchone()
        except psycopg.errors.LockNotAvailable:
            log.info("drain migrate: a table is in use, trying again (%d/%d)", attempt, attempts)
            time.sleep(min(0.05 * attempt, 0.5))
        except psycopg.errors.DeadlockDetected:
            # A running drain (of another version, during a rolling deploy) that took
            # the tables' locks the other way round: its statement goes on.
            log.info("drain migrate: deadlocked with another session's statement, which "
                     "goes on; trying again (%d/%d)", attempt, attempts)
            time.sleep(min(0.05 * attempt, 0.5))
        except psycopg.Error as exc:
            if exc.sqlstate == ROLES_SHARED:
                hint = exc.diag.message_hint or ""
                raise RolesShared(f"{first_line(exc)}; {hint}" if hint else first_line(exc)
                                  ) from None
            raise
        else:
            return str(row[0]) if row else ""
    raise DrainError(
        f"drain migrate: a table stayed locked by other sessions through {attempts} tries of "
        f"{lock_timeout:g}s each (a long transaction on staged_jobs? see pg_stat_activity); "
        "nothing was changed, run it again"
    )


def _lock_in_the_drains_order(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    """Lock staged_jobs, then dead_jobs, as the schema's changes to them would, but
    at once and in the order a drain's batch takes them (its fetch reads
    staged_jobs, its expiry then moves rows to dead_jobs): a migrate never holds
    dead_jobs while it waits for staged_jobs. Tables not made yet are skipped."""
    row = conn.execute("SELECT to_regclass('staged_jobs') IS NOT NULL, "
                       "to_regclass('dead_jobs') IS NOT NULL").fetchone()
    tables = [name for name, there in zip(("staged_jobs", "dead_jobs"), row or (), strict=False)
              if there]
    if tables:
        conn.execute(psql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(
            psql.SQL(", ").join(psql.Identifier(name) for name in tables)))


def role_names(prefix: str) -> list[str]:
    """The group roles of a database whose role prefix is ``prefix``."""
    return [f"{prefix}{kind}" for kind in ROLE_KINDS]


def schema_version(conn: psycopg.Connection[tuple[object, ...]]) -> int | None:
    """The schema version ``drain migrate`` recorded in this database (None: none,
    a schema an older drain made); SchemaMissing when it has no staged_jobs."""
    row = conn.execute(sql.query("schema_tables")).fetchone()
    staged, settings = row if row else (False, False)
    if not staged:
        raise SchemaMissing("no staged_jobs table: run `drain migrate`")
    if not settings:
        return None
    found = conn.execute(sql.query("schema_version")).fetchone()
    return int(str(found[0])) if found else None


def check(conn: psycopg.Connection[tuple[object, ...]]) -> str:
    """``drain migrate --check``: one line when the schema is this drain's version;
    SchemaMissing when it needs ``drain migrate``, SchemaNewer when a newer drain
    migrated it (each in one line)."""
    version = schema_version(conn)
    if version is None:
        raise SchemaMissing(
            f"the schema is from a drain older than version {SCHEMA_VERSION} (it records "
            "no version): run `drain migrate`")
    if version < SCHEMA_VERSION:
        raise SchemaMissing(
            f"schema version {version}, this drain's is {SCHEMA_VERSION}: run `drain migrate`")
    if version > SCHEMA_VERSION:
        raise SchemaNewer(
            f"schema version {version} is newer than this drain's ({SCHEMA_VERSION}): "
            "a newer drain migrated it; upgrade this one (docs/running.md, \"Upgrading\")")
    return f"schema version {version}: current"

"""The drain's side of Postgres: one session holding the lock, the batches, LISTEN.

Everything runs on one connection on purpose. The advisory lock, the
REPEATABLE READ batch transaction and the LISTEN all belong to the same
session, so losing that session ends the batch (it rolls back) and frees the
lock in one stroke: a drain that lost its connection can no longer delete
anything, and a standby taking over cannot overlap with it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import re
import select
import socket
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg.errors
from psycopg import conninfo
from psycopg import sql as psql

from drain import sql
from drain.config import Settings, mask_database_url, scrub
from drain.errors import DatabaseRefused, DatabaseUnavailable, DrainError, SchemaMissing
from drain.message import StagedRow

log = logging.getLogger(__name__)

#: Server-side settings of the drain's own session. It must never become the
#: long transaction that stops vacuum for everyone else, and the server must
#: notice a vanished drain quickly so that the lock is released for a standby.
#: ``synchronous_commit=off`` is safe here: the drain's transactions only
#: delete rows already confirmed by the broker, so a commit lost in a Postgres
#: crash brings those rows back and they are published again with the same
#: task ids: a duplicate, never a loss. It spares a WAL flush per batch.
#: libpq options for the drain's connection, unless its URL sets them itself.
CLIENT_DEFAULTS = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
}

#: ``enable_seqscan`` / ``enable_bitmapscan`` off: the drain's queries must walk
#: their indexes in order and stop at LIMIT. A queue table changes faster than
#: its statistics (a fresh backlog of a million rows looks empty to the
#: planner until autoanalyze runs), and a plan that reads the whole backlog and
#: sorts it costs O(backlog) per batch; measured: 13 ms instead of 0.9 ms per
#: fetch at 40,000 rows, growing with the backlog. ``plan_cache_mode`` for the
#: same reason: psycopg prepares a statement after a few runs, and Postgres's
#: generic plan for the fetch (array sizes and LIMIT unknown) cost ~20 ms per
#: batch in a live drain against ~2 ms for the custom one (planning: ~1 ms).
SESSION_SETTINGS = {
    "synchronous_commit": "off",
    "enable_seqscan": "off",
    "enable_bitmapscan": "off",
    "plan_cache_mode": "force_custom_plan",
    "statement_timeout": "30s",
    "lock_timeout": "10s",
    "tcp_keepalives_idle": "5",
    "tcp_keepalives_interval": "2",
    "tcp_keepalives_count": "3",
    "tcp_user_timeout": "10000",
}


class Store:
    """One Postgres session of a drain process."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._secrets = settings.secrets()
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        self._display = mask_database_url(settings.database_url)
        self.holds_lock = False

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def connect(self) -> None:
        """Connect, check the schema, LISTEN. Raises DatabaseUnavailable / SchemaMissing."""
        self.close()
        settings = self._settings
        # The batch transaction is open while the broker confirms, so the idle
        # timeout must outlast the confirm timeout.
        idle_timeout = int((settings.confirm_timeout + 30) * 1000)
        session = {**SESSION_SETTINGS, "idle_in_transaction_session_timeout": str(idle_timeout)}
        # Client-side defaults only where the user's URL does not choose otherwise.
        given = conninfo.conninfo_to_dict(settings.database_url)
        client = {k: v for k, v in CLIENT_DEFAULTS.items() if k not in given}
        try:
            dsn = conninfo.make_conninfo(
                settings.database_url,
                application_name=self.application_name(leader_since=None),
                **client,
            )
            conn = psycopg.connect(dsn, autocommit=True)
        except psycopg.Error as exc:
            if _REFUSALS.search(str(exc)):
                raise DatabaseRefused(
                    f"database {self._display} refused the connection: "
                    f"{scrub(_server_message(exc), self._secrets)}"
                ) from None
            raise self._unavailable("unreachable", exc) from None
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        self._conn = conn
        self.holds_lock = False
        try:
            conn.execute(
                "SELECT " + ", ".join("set_config(%s, %s, false)" for _ in session),
                [item for pair in session.items() for item in pair],
            )
            present = conn.execute(sql.query("schema_present")).fetchone()
            if not present or not present[0]:
                raise SchemaMissing(
                    f"database {self._display} has no staged_jobs table: run `drain migrate` first"
                )
            conn.execute(sql.query("listen"))
        except psycopg.Error as exc:
            self.close()
            raise self._unavailable("failed", exc) from None
        except DrainError:
            self.close()
            raise

    def close(self) -> None:
        """Close the session; this also releases the lock and rolls back a batch."""
        conn, self._conn = self._conn, None
        self.holds_lock = False
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def application_name(self, leader_since: dt.datetime | None) -> str:
        """What ``drain status`` shows: ``drain pid=N host=H [since=EPOCH]`` (63 bytes max)."""
        name = f"drain pid={os.getpid()}"
        if leader_since is not None:
            name += f" since={int(leader_since.timestamp())}"
        name += f" host={socket.gethostname()}"
        return name.encode()[:63].decode("utf-8", "ignore")

    def try_lock(self) -> bool:
        """Take the advisory lock if it is free (never waits)."""
        row = self._execute("try_lock", {"key": self._settings.lock_key}).fetchone()
        self.holds_lock = bool(row and row[0])
        if self.holds_lock:
            name = self.application_name(leader_since=dt.datetime.now(dt.timezone.utc))
            self._execute("set_application_name", {"name": name})
        return self.holds_lock

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """A REPEATABLE READ transaction; commits on success, rolls back on error."""
        conn = self._require()
        try:
            with conn.transaction():
                yield
        except psycopg.Error as exc:
            self.close()
            raise self._unavailable("lost", exc) from None

    def fetch(
        self, limit: int, exclude: list[int] | None = None, paused: list[str] | None = None
    ) -> list[StagedRow]:
        """The next ``limit`` due rows, leaving out ``exclude`` (rows in flight) and
        the rows of ``paused`` queues."""
        cur = self._execute(
            "fetch_batch", {"limit": limit, "exclude": exclude or [], "paused": paused or []}
        )
        return [StagedRow(*row) for row in cur.fetchall()]  # type: ignore[arg-type]

    def delete(self, ids: list[int]) -> int:
        return self._execute("delete_confirmed", {"ids": ids}).rowcount

    def expire(self, exclude: list[int], limit: int) -> int:
        """Move up to ``limit`` expired rows to dead_jobs; returns how many."""
        return self._execute("expire", {"exclude": exclude, "limit": limit}).rowcount

    def bury(self, doomed: list[tuple[int, str, str]]) -> int:
        """Move rows to dead_jobs: ``[(id, reason, detail)]``; returns how many."""
        ids, reasons, details = (list(column) for column in zip(*doomed, strict=True))
        return self._execute(
            "bury", {"ids": ids, "reasons": reasons, "details": details}
        ).rowcount

    def wait(self, timeout: float, extra_fds: tuple[int, ...] = ()) -> bool:
        """Wait up to ``timeout`` for a NOTIFY; True when one arrived."""
        conn = self._require()
        if self._notified(conn):
            return True
        try:
            ready, _, _ = select.select([conn.fileno(), *extra_fds], [], [], timeout)
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            return False
        if conn.fileno() in ready:
            return self._notified(conn)
        return False

    def _notified(self, conn: psycopg.Connection[tuple[object, ...]]) -> bool:
        try:
            return any(True for _ in conn.notifies(timeout=0))
        except psycopg.Error as exc:
            self.close()
            raise self._unavailable("lost", exc) from None

    def _execute(
        self, name: str, params: dict[str, object] | None = None
    ) -> psycopg.Cursor[tuple[object, ...]]:
        conn = self._require()
        try:
            return conn.execute(sql.query(name), params)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise DrainError(
                f"database {self._display}: {first_line(exc)} (grant the drain's role "
                "drain_runner, see staging_schema.sql)"
            ) from None
        except psycopg.errors.UndefinedTable:
            raise SchemaMissing(
                f"database {self._display} has no staged_jobs table: run `drain migrate` first"
            ) from None
        except (psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedFunction) as exc:
            raise SchemaMissing(
                f"database {self._display} has an older drain schema ({first_line(exc)}): "
                "run `drain migrate`"
            ) from None
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            self.close()
            raise self._unavailable("lost", exc) from None

    def _require(self) -> psycopg.Connection[tuple[object, ...]]:
        if self._conn is None or self._conn.closed:
            self._conn = None
            self.holds_lock = False
            raise DatabaseUnavailable(f"database {self._display}: not connected")
        return self._conn

    def _unavailable(self, what: str, exc: BaseException) -> DatabaseUnavailable:
        return DatabaseUnavailable(
            f"database {self._display} {what}: {scrub(first_line(exc), self._secrets)}"
        )


#: Server answers that retrying will not change (unlike "too many clients").
_REFUSALS = re.compile(
    r"password authentication failed|does not exist|no pg_hba\.conf entry|"
    r"permission denied for database|role .* is not permitted to log in"
)


def _server_message(exc: BaseException) -> str:
    """libpq's text without its 'connection to server at ... failed:' preamble."""
    text = first_line(exc)
    return text.split("FATAL:", 1)[1].strip() if "FATAL:" in text else text


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def connect_plain(settings: Settings) -> psycopg.Connection[tuple[object, ...]]:
    """A short-lived connection for operator commands (migrate, status, stage)."""
    try:
        return psycopg.connect(
            settings.database_url, connect_timeout=5, application_name="drain cli"
        )
    except psycopg.Error as exc:
        raise DatabaseUnavailable(
            f"database {mask_database_url(settings.database_url)} unreachable: "
            f"{scrub(first_line(exc), settings.secrets())}"
        ) from None


def migrate(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    """Apply the staging schema in one transaction (idempotent)."""
    with conn.transaction():
        # Two migrations at once would race on CREATE ... IF NOT EXISTS.
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('drain migrate'))")
        conn.execute(psql.SQL(sql.schema_text()))


def status(conn: psycopg.Connection[tuple[object, ...]], lock_key: int) -> dict[str, Any]:
    """Backlog, oldest staged age and the lock holder, as ``drain status`` shows them."""
    try:
        row = conn.execute(sql.query("backlog")).fetchone()
        holder = conn.execute(sql.query("lock_holder"), {"key": lock_key}).fetchone()
        groups = conn.execute(sql.query("backlog_groups")).fetchall()
        dead = conn.execute(sql.query("dead_by_reason")).fetchall()
    except psycopg.errors.UndefinedTable:
        raise SchemaMissing("no staged_jobs table: run `drain migrate` first") from None
    backlog, oldest, delayed = row if row else (0, None, 0)
    lock: dict[str, Any] = {"held": False, "key": lock_key}
    if holder is not None:
        pid, app_name, client_addr, _backend_start = holder
        fields = dict(
            part.split("=", 1) for part in str(app_name or "").split() if "=" in part
        )
        since = fields.get("since")
        lock = {
            "held": True,
            "key": lock_key,
            "pid": int(fields.get("pid", pid)),  # type: ignore[call-overload]
            "host": fields.get("host"),
            "since": dt.datetime.fromtimestamp(int(since), dt.timezone.utc).isoformat()
            if since and since.isdigit()
            else None,
            "client_addr": client_addr,
            "backend_pid": pid,
        }
    return {
        "backlog": backlog,
        "delayed": delayed,
        "oldest_age_seconds": oldest,
        "by_group": [
            {"queue": q, "tag": t, "task": n, "count": c, "oldest_age_seconds": a}
            for q, t, n, c, a in groups
        ],
        "dead_by_reason": {str(reason): count for reason, count in dead},
        "lock": lock,
    }

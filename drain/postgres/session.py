"""The drain's Postgres session: connecting, commands, and a session that hangs.

A :class:`Session` is one connection with the drain's session settings, its
identity on the server, and the bookkeeping the watchdog needs to give up a
connection that stopped answering (:meth:`Session.abandon`) and to end the
abandoned backend at the next connect. drain.postgres.store builds the drain's queries,
the lock and the batches on top of it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import re
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import psycopg
import psycopg.errors
from psycopg import conninfo
from psycopg.pq import TransactionStatus

from drain.errors import (
    DatabaseRefused,
    DatabaseUnavailable,
    DrainError,
    PermissionDenied,
    SchemaMissing,
)
from drain.postgres import abandoned, failover, sql, timestamps
from drain.postgres.command_watch import Watch
from drain.postgres.session_probe import check as check_session
from drain.settings.config import Settings
from drain.settings.url_parts import first_line
from drain.settings.urls import mask_database_url, scrub

log = logging.getLogger("drain.session")

T = TypeVar("T")

#: The payload of the notification drain_pauses' trigger sends (staging_schema.sql).
PAUSES_CHANGED = "pauses"

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


class Session:
    """One Postgres connection of a drain process, with its settings and identity.

    A command may wait, for a lock say, up to the session's lock and statement
    timeouts. The loop's other connection must not starve meanwhile: the
    broker drops a connection whose heartbeats stop (two missed, 2 s with a
    1 s heartbeat). So with :attr:`while_waiting` set, a watch thread
    (drain.postgres.command_watch) calls it every SERVE_EVERY while a command has
    been waiting that long.
    Each command still runs on the calling thread, as without it: most
    answer within a millisecond, and a handoff to another thread and back
    cost more than that on every command (see :class:`Watch`).
    """

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._secrets = settings.secrets()
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        self._display = mask_database_url(settings.database_url)
        #: The session holds the drain's lock (it ends with the session).
        self.holds_lock = False
        #: When the last command was sent (time.monotonic()): with
        #: :attr:`waiting`, how long the server has owed an answer (abandon()).
        self.asked_at = 0.0
        #: Held while the connection is closed, so that abandon() never shuts a
        #: socket whose descriptor was closed and handed to another one.
        self._closing = threading.Lock()
        #: This session's backend (its server pid and token, drain.postgres.abandoned), and
        #: the ones abandoned while they may still hold the lock on the server
        #: (ended at the next connect, if they still hold it and their token).
        self._backend: abandoned.Backend | None = None
        self._abandoned: list[abandoned.Backend] = []
        #: The server's pid for this session (``pg_backend_pid()``): through a
        #: pool, ``conn.info.backend_pid`` is the pool's key, not the server's.
        self.server_pid = 0
        #: Called every SERVE_EVERY while a command waits, from the session's
        #: :class:`Watch` thread, never at the same time as the calling thread
        #: runs anything but the command (the broker's I/O loop:
        #: drain.daemon.runner); it must not raise.
        self.while_waiting: Callable[[], None] | None = None
        self._watch: Watch | None = None
        #: The operators' pauses may have changed since they were last read: a
        #: notification said so (:data:`PAUSES_CHANGED`), or this is a new session
        #: (set by :meth:`connect`), which heard nothing before it listened.
        self.pauses_changed = True

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    @property
    def waiting(self) -> bool:
        """A command was sent and its answer has not come yet. Read by the loop's
        watchdog thread: it only looks at libpq's connection status."""
        conn = self._conn
        return (conn is not None and not conn.closed
                and conn.info.transaction_status == TransactionStatus.ACTIVE)

    def connect(self) -> None:
        """Connect, check the session and :meth:`_prepare` it; end a session this
        process abandoned. Raises DatabaseUnavailable (and what _prepare raises)."""
        self.close()
        settings = self._settings
        # The batch transaction is open while the broker confirms, so the idle
        # timeout must outlast the confirm timeout.
        idle_timeout = int((settings.confirm_timeout + 30) * 1000)
        session = {
            **SESSION_SETTINGS,
            "idle_in_transaction_session_timeout": str(idle_timeout),
            "statement_timeout": f"{round(settings.db_timeout * 1000)}ms",
            "lock_timeout": f"{round(min(settings.db_timeout, 10.0) * 1000)}ms",
        }
        # Client-side defaults only where the user's URL does not choose otherwise.
        given = conninfo.conninfo_to_dict(settings.database_url)
        client: dict[str, str | int] = {k: v for k, v in CLIENT_DEFAULTS.items() if k not in given}
        client.update(failover.client_defaults(given))
        try:
            dsn = conninfo.make_conninfo(
                settings.database_url,
                application_name=self.application_name(leader_since=None),
                **client,
            )
            conn = psycopg.connect(dsn, autocommit=True)
            timestamps.register(conn)  # a row's 'infinity' must not fail the batch
        except psycopg.Error as exc:
            if _REFUSALS.search(str(exc)):
                raise DatabaseRefused(
                    f"database {self._display} refused the connection: "
                    f"{scrub(_server_message(exc), self._secrets)}"
                ) from None
            raise self._unavailable("unreachable", exc) from None
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        self._conn = conn
        self.asked_at = time.monotonic()  # the set-up commands below
        self.holds_lock = False
        self.pauses_changed = True  # nothing heard before this session listens
        try:
            # Refuses a pool that does not keep sessions (fatal), before LISTEN and the lock.
            self.server_pid = check_session(conn, dsn, self._display, self._secrets)
            conn.execute(
                "SELECT " + ", ".join("set_config(%s, %s, false)" for _ in session),
                [item for pair in session.items() for item in pair],
            )
            self._prepare(conn)
            token = abandoned.take_token(lambda key: self._ask(
                "take_token", {"class": abandoned.TOKEN_CLASS, "key": key}))
            self._backend = abandoned.Backend(self.server_pid, token)
            self._end_abandoned()
        except psycopg.Error as exc:
            self.close()
            refused = refusal(exc, self._display, RUNNER_GRANT)
            raise (refused or self._unavailable("failed", exc)) from None
        except DrainError:
            self.close()
            raise

    def _prepare(self, conn: psycopg.Connection[tuple[object, ...]]) -> None:
        """What a subclass does on a new connection, after the session settings."""

    def close(self) -> None:
        """Close the session; this also releases the locks and rolls back a batch."""
        with self._closing:
            conn, self._conn = self._conn, None
            self.holds_lock = False
            self._backend = None
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()

    def abandon(self, bound: float) -> float | None:
        """From the watchdog thread: when the server has owed the answer to a
        command for ``bound`` seconds or more, give the connection up; returns how
        long it waited (None: nothing done).

        The statement timeout bounds every command the drain sends, so an answer
        this late will not come: the server, or a pooler or network path in
        front of it, hangs. Shutting the socket down ends the loop's wait with a
        lost connection, and the loop reconnects. Whatever the hung session was
        doing can no longer commit from this side: rows are deleted only by a
        commit this process sends, so nothing unconfirmed is deleted, and
        confirmed rows whose delete did not commit are published again (same
        task ids). The abandoned backend may live on behind the hang, holding
        the lock: the next connect ends it if it still holds the lock and this
        session's token (drain.postgres.abandoned).
        """
        with self._closing:
            conn = self._conn
            if conn is None or conn.closed or not self.waiting:
                return None
            waited = time.monotonic() - self.asked_at
            if waited < bound:
                return None
            if self._backend is not None:
                self._abandoned.append(self._backend)
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as s:
                s.shutdown(socket.SHUT_RDWR)
            return waited

    def _end_abandoned(self) -> None:
        """End the backends of sessions this process abandoned, if they live on as
        this drain's: holding its lock and their token (drain.postgres.abandoned)."""
        while self._abandoned:
            backend = self._abandoned[0]
            ended = self._execute(
                "end_abandoned", abandoned.end_params(backend, self._settings)).fetchall()
            self._abandoned.pop(0)
            abandoned.report(backend, bool(ended))

    def application_name(self, leader_since: dt.datetime | None) -> str:
        """What ``drain status`` shows: ``drain pid=N host=H [since=EPOCH]`` (63 bytes max)."""
        name = f"drain pid={os.getpid()}"
        if self._settings.lanes > 1:
            name += f" lane={self._settings.lane}/{self._settings.lanes}"
        if leader_since is not None:
            name += f" since={int(leader_since.timestamp())}"
        name += f" host={socket.gethostname()}"
        return name.encode()[:63].decode("utf-8", "ignore")

    def alive(self) -> None:
        """Prove the session (and so the lock it holds) is still there: one round trip.

        Raises :class:`DatabaseUnavailable` when the server ended it meanwhile.
        """
        self._execute("alive")

    def _ask(self, name: str, params: dict[str, object] | None = None) -> bool:
        row = self._execute(name, params).fetchone()
        return bool(row and row[0])

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
        """Take every notification psycopg has queued; True if there was one.

        All of them, not one: psycopg queues each NOTIFY that arrives during
        other queries, one per committed staging transaction, without bound.
        """
        got = False
        own = self.server_pid  # its own announcements (drain.postgres.wakeup) wake no one
        try:
            for note in conn.notifies(timeout=0):
                got = got or note.pid != own
                if note.payload == PAUSES_CHANGED:
                    self.pauses_changed = True
        except psycopg.Error as exc:
            self.close()
            raise self._unavailable("lost", exc) from None
        return got

    def _execute(
        self, name: str, params: dict[str, object] | None = None, *, binary: bool = False
    ) -> psycopg.Cursor[tuple[object, ...]]:
        """Run the query ``name``; ``binary``: its results in binary form (numbers,
        booleans and times cost less to read so)."""
        query = self._query(name)
        return self._guarded(lambda conn: conn.execute(query, params, binary=binary))

    def _execute_all(
        self, commands: Sequence[tuple[str, dict[str, object] | None]]
    ) -> list[psycopg.Cursor[tuple[object, ...]]]:
        """The commands ``[(name, params)]`` in this order, in one round trip
        (psycopg's pipeline mode: one Sync after the last), each one's cursor.

        The first command that fails raises as :meth:`_execute` would, and the
        server skips the rest (in a transaction, it is then aborted: roll back to
        a savepoint the commands took, or the batch rolls back).

        Never prepared: psycopg (3.3.9) counts a statement the server skipped
        after an error in the pipeline as prepared when that run was the one
        to prepare it, and every later run of it then fails with 'prepared
        statement "_pg3_N" does not exist' (seen: the hot-row test lost the
        session). Unprepared, the server parses each one every time; the
        drain's plans are custom anyway (``plan_cache_mode``)."""
        queries = [(self._query(name), params) for name, params in commands]

        def run(conn: psycopg.Connection[tuple[object, ...]]
                ) -> list[psycopg.Cursor[tuple[object, ...]]]:
            with conn.pipeline():
                return [conn.execute(query, params, prepare=False)
                        for query, params in queries]

        return self._guarded(run)

    def _guarded(self, work: Callable[[psycopg.Connection[tuple[object, ...]]], T]) -> T:
        """``work(conn)``, the session's commands (:meth:`_run`), with the drain's
        errors for the driver's."""
        conn = self._require()
        try:
            self.asked_at = time.monotonic()
            return self._run(conn, work)
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedTable,
                psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedFunction) as exc:
            refused = refusal(exc, self._display, RUNNER_GRANT)
            assert refused is not None
            raise refused from None
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            if rolled_back(exc) and conn.info.transaction_status == TransactionStatus.INERROR:
                raise  # inside a batch: Store.batch rolls it back and says so
            self.close()
            raise self._unavailable("lost", exc) from None

    def _run(self, conn: psycopg.Connection[tuple[object, ...]],
             work: Callable[[psycopg.Connection[tuple[object, ...]]], T]) -> T:
        """``work(conn)`` on this thread; while it waits, :attr:`while_waiting` is
        called now and then (:class:`Watch`)."""
        serve = self.while_waiting
        if serve is None:
            return work(conn)
        watch = self._watch
        if watch is None or watch.serve is not serve:
            if watch is not None:
                watch.stop()
            watch = self._watch = Watch(serve)
        with watch.command():
            return work(conn)

    def _query(self, name: str) -> str:
        """The text of the query ``name`` for this session's schema."""
        return sql.query(name)

    def _require(self) -> psycopg.Connection[tuple[object, ...]]:
        if self._conn is None or self._conn.closed:
            self._conn = None
            self.holds_lock = False
            raise DatabaseUnavailable(f"database {self._display}: not connected")
        return self._conn

    def _unavailable(self, what: str, exc: BaseException) -> DatabaseUnavailable:
        return DatabaseUnavailable(
            f"database {self._display} {what}: {scrub(failover.describe(exc), self._secrets)}"
        )


#: What the drain's role needs, said when the database refuses it something.
RUNNER_GRANT = ("`drain run` and `drain status` need this database's runner role, "
                "<prefix>runner as `drain migrate` names it")
#: ... and the operators' commands.
OPERATOR_GRANT = ("`drain stage`, `drain dead`, `drain processed`, `drain pause`, `drain resume` "
                  "and `drain audit` need this database's "
                  "operator role, <prefix>operator as `drain migrate` names it")


def refusal(exc: psycopg.Error, display: str, needs: str) -> DrainError | None:
    """A database error no retry can change, as the error drain raises for it:
    PermissionDenied (the role lacks a grant; ``needs`` says which role would do),
    SchemaMissing (no such table, column or function: run `drain migrate`);
    None for any other error."""
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        return PermissionDenied(
            f"database {display}: {first_line(exc)} (docs/running.md, \"Database roles\": {needs})")
    if isinstance(exc, psycopg.errors.UndefinedTable):
        return SchemaMissing(
            f"database {display} has no drain schema ({first_line(exc)}): run `drain migrate` "
            "first")
    if isinstance(exc, (psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedFunction)):
        return SchemaMissing(
            f"database {display} has an older drain schema ({first_line(exc)}): "
            "run `drain migrate`")
    return None


def connected_to(conn: psycopg.Connection[tuple[object, ...]]) -> str:
    """The database a connection reached, as a URL without password: its user,
    host, port and name as the server session has them (libpq's defaults and
    PG* variables resolved)."""
    info = conn.info
    host = info.host if not info.host.startswith("/") else f"[socket {info.host}]"
    return f"postgresql://{info.user}@{host}:{info.port}/{info.dbname}"


#: Server answers that retrying will not change (unlike "too many clients").
_REFUSALS = re.compile(
    r"password authentication failed|does not exist|no pg_hba\.conf entry|"
    r"permission denied for database|role .* is not permitted to log in"
)


def rolled_back(exc: psycopg.Error) -> bool:
    """SQLSTATE class 40 (a serialization failure, a deadlock) or a lock timeout
    (55P03), which end the transaction (or the savepoint) but not the session
    (psycopg 3 does not group them in one class)."""
    state = exc.sqlstate or ""
    return state.startswith("40") or state == "55P03"


def _server_message(exc: BaseException) -> str:
    """libpq's text without its 'connection to server at ... failed:' preamble."""
    text = first_line(exc)
    return text.split("FATAL:", 1)[1].strip() if "FATAL:" in text else text


def connect_plain(
    settings: Settings, application_name: str = "drain cli"
) -> psycopg.Connection[tuple[object, ...]]:
    """A short-lived connection for operator commands (migrate, status, stage)."""
    try:
        conn = psycopg.connect(
            settings.database_url, connect_timeout=5, application_name=application_name
        )
    except psycopg.Error as exc:
        raise DatabaseUnavailable(
            f"database {mask_database_url(settings.database_url)} unreachable: "
            f"{scrub(first_line(exc), settings.secrets())}"
        ) from None
    timestamps.register(conn)  # a row's 'infinity' is shown, not a crash
    return conn

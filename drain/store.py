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
import zlib
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg.errors
from psycopg import conninfo
from psycopg import sql as psql
from psycopg.pq import TransactionStatus

from drain import keyset, sql
from drain.config import Settings, mask_database_url, scrub
from drain.errors import (
    DatabaseRefused,
    DatabaseUnavailable,
    DrainError,
    LaneConflict,
    SchemaMissing,
)
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
        self._joined = False

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
        self._joined = False
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
        if self._settings.lanes > 1:
            name += f" lane={self._settings.lane}/{self._settings.lanes}"
        if leader_since is not None:
            name += f" since={int(leader_since.timestamp())}"
        name += f" host={socket.gethostname()}"
        return name.encode()[:63].decode("utf-8", "ignore")

    def try_lock(self) -> bool:
        """Take the advisory lock (this lane's, with lanes) if it is free (never waits).

        Raises LaneConflict while drains split in another number of lanes run.
        """
        settings = self._settings
        if not self._joined:
            guard = lane_guard(settings.lock_key)
            self._execute("join_lanes", {"guard": guard, "lanes": settings.lanes})
            others = [
                count for (count,) in self._execute("lanes_in_use", {"guard": guard}).fetchall()
                if count != settings.lanes
            ]
            self._joined = not others
            if others:
                # Keep (guard, N): the others see us as well, and none of us publishes.
                raise LaneConflict(
                    f"other drains on lock key {settings.lock_key} run with --lanes "
                    f"{', '.join(map(str, others))} (this one: --lanes {settings.lanes}); all "
                    "drains of one lock key must use the same number of lanes"
                )
        if settings.lanes == 1:
            row = self._execute("try_lock", {"key": settings.lock_key}).fetchone()
        else:
            row = self._execute("try_lane_lock", {
                "class": lane_class(settings.lock_key, settings.lanes), "lane": settings.lane,
            }).fetchone()
        self.holds_lock = bool(row and row[0])
        if self.holds_lock:
            name = self.application_name(leader_since=dt.datetime.now(dt.timezone.utc))
            self._execute("set_application_name", {"name": name})
        return self.holds_lock

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """A REPEATABLE READ transaction; commits on success, rolls back on error."""
        conn = self._require()
        # Rows whose NOTIFY already arrived are visible to this batch's snapshot:
        # forget those notifications, or each would cost an empty cycle later.
        self._notified(conn)
        try:
            with conn.transaction():
                yield
        except psycopg.Error as exc:
            self.close()
            raise self._unavailable("lost", exc) from None

    def fetch(
        self,
        limit: int,
        exclude: list[int] | None = None,
        paused: list[str] | None = None,
        plan: keyset.FetchPlan | None = None,
    ) -> list[StagedRow]:
        """The next ``limit`` due rows, leaving out ``exclude`` (rows in flight),
        the rows of ``paused`` queues and other lanes' rows; ``plan`` says where
        each priority's scan starts (None: from the head)."""
        params = fetch_params(limit, exclude=exclude, paused=paused, plan=plan,
                              lanes=self._settings.lanes, lane=self._settings.lane)
        cur = self._execute("fetch_batch", params)
        return [StagedRow(*row) for row in cur.fetchall()]  # type: ignore[arg-type]

    def heads(self, plan: keyset.FetchPlan) -> tuple[dict[int, int | None], int, int]:
        """For :meth:`keyset.Marks.observe`: each marked priority's smallest staged id
        at or above its mark, and this snapshot's xmin and xmax."""
        row = self._execute("fetch_heads", {
            "priorities": plan.priorities, "marks": plan.marks,
            "lanes": self._settings.lanes, "lane": self._settings.lane,
        }).fetchone()
        assert row is not None
        xmin, xmax, heads = row
        found = dict(zip(plan.priorities, heads, strict=True))  # type: ignore[call-overload]
        return found, int(xmin), int(xmax)  # type: ignore[call-overload]

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
        """Take every notification psycopg has queued; True if there was one.

        All of them, not one: psycopg queues each NOTIFY that arrives during
        other queries, one per committed staging transaction, without bound.
        """
        got = False
        try:
            for _ in conn.notifies(timeout=0):
                got = True
        except psycopg.Error as exc:
            self.close()
            raise self._unavailable("lost", exc) from None
        return got

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


def lane_guard(lock_key: int) -> int:
    """The int4 class of the (guard, lanes) locks of a lock key."""
    return _int4(f"drain lanes {lock_key}")


def lane_class(lock_key: int, lanes: int) -> int:
    """The int4 class of the (class, lane) locks of a lock key split in ``lanes``."""
    return _int4(f"drain lane {lock_key}/{lanes}")


def _int4(text: str) -> int:
    value = zlib.crc32(text.encode())
    return value - 2**32 if value >= 2**31 else value


def fetch_params(
    limit: int,
    *,
    exclude: list[int] | None = None,
    paused: list[str] | None = None,
    plan: keyset.FetchPlan | None = None,
    lanes: int = 1,
    lane: int = 0,
) -> dict[str, object]:
    """The parameters of the ``fetch_batch`` query (no plan: every priority from its head)."""
    plan = plan or keyset.FROM_HEAD
    return {
        "limit": limit, "exclude": exclude or [], "paused": paused or [],
        "priorities": plan.priorities, "marks": plan.marks,
        "gap_above": plan.gap_above, "gap_below": plan.gap_below,
        "lanes": lanes, "lane": lane,
    }


def connect_plain(
    settings: Settings, application_name: str = "drain cli"
) -> psycopg.Connection[tuple[object, ...]]:
    """A short-lived connection for operator commands (migrate, status, stage)."""
    try:
        return psycopg.connect(
            settings.database_url, connect_timeout=5, application_name=application_name
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


#: ``drain status`` and the metrics sampler count the backlog exactly while
#: the statistics (``pg_stat_user_tables.n_live_tup``, kept by every commit)
#: estimate fewer staged rows than this: one scan of the table. From this many
#: on, the total is that estimate and the groups come from a block sample of
#: about :data:`SAMPLE_PAGES` pages, scaled to it; ``backlog_estimated`` says so.
ESTIMATE_ABOVE = 100_000
#: Pages of staged_jobs the sample reads above :data:`ESTIMATE_ABOVE` (8 kB
#: each: ~35,000 rows of a typical job), whatever the table's size.
SAMPLE_PAGES = 500


def status(
    conn: psycopg.Connection[tuple[object, ...]], lock_key: int, *,
    estimate_above: int = ESTIMATE_ABOVE, sample_pages: int = SAMPLE_PAGES,
) -> dict[str, Any]:
    """What ``drain status`` shows, cheap at any backlog (the metrics sample it too).

    * ``backlog``, ``delayed`` (staged with a ``not_before`` still ahead) and
      ``by_group`` (the 50 biggest queue/tag/task groups of ``group_count``):
      exact below ``estimate_above`` estimated rows; above, ``backlog_estimated``
      is true, ``backlog`` is the statistics' estimate and the groups and
      ``delayed`` are scaled from a block sample (``sample``: its percentage of
      the pages and the rows it read); a sample may miss small groups.
    * ``oldest_age_seconds``: how long the oldest due row has waited (a ready
      row since it was staged, a delayed one since it became due; None: no
      row is due), from the heads of the fetch's indexes: no scan, and
      approximate where concurrent transactions staged rows out of id order.
    * ``dead_tuples``: deleted rows of staged_jobs that vacuum has not removed
      yet (statistics); ``oldest_transaction``: the database's oldest open
      transaction other than this one (None: none), which keeps them there
      while ``blocks_vacuum``.
    * ``dead_by_reason``, ``lock`` (its holder) and ``lanes`` (holders by lane).

    Runs in a transaction of its own (a savepoint inside the caller's), so a
    watching operator or the sampler never holds one open between calls.
    """
    try:
        with conn.transaction():
            live, dead_tuples, pages = _first(conn, "backlog_estimate")
            sample: dict[str, Any] | None = None
            if live >= estimate_above and pages > sample_pages:
                percent = 100.0 * sample_pages / pages
                groups = _rows(conn, "backlog_groups_sample", {"percent": percent})
                sample = {"percent": round(percent, 3), "rows": groups[0][6] if groups else 0}
            else:
                groups = _rows(conn, "backlog_groups")
            ready_age, due_age = _first(conn, "backlog_oldest")
            dead = conn.execute(sql.query("dead_by_reason")).fetchall()
            oldest_xact = conn.execute(sql.query("oldest_transaction")).fetchone()
            lock = _holder(conn, lock_key >> 32, lock_key, form=1)
            lanes: dict[str, list[dict[str, Any]]] = {}
            for (count,) in conn.execute(sql.query("lanes_in_use"),
                                         {"guard": lane_guard(lock_key)}).fetchall():
                if isinstance(count, int) and count > 1:
                    held = {row[0]: _holder_fields(row[1:]) for row in _rows(
                        conn, "lane_holders", {"class": lane_class(lock_key, count)})}
                    lanes[str(count)] = [
                        {"lane": lane, **held.get(lane, {"held": False})}
                        for lane in range(count)
                    ]
    except psycopg.errors.UndefinedTable:
        raise SchemaMissing("no staged_jobs table: run `drain migrate` first") from None
    total, delayed, group_count = (int(n) for n in groups[0][6:9]) if groups else (0, 0, 0)
    scale = 1.0
    if sample is not None:
        scale = live / total if total else 0.0
        total, delayed = live, round(delayed * scale)
    waits = [age for age in (ready_age, due_age, *(g[5] for g in groups))
             if isinstance(age, float) and age >= 0]
    return {
        "backlog": total,
        "backlog_estimated": sample is not None,
        "sample": sample,
        "delayed": delayed,
        "oldest_age_seconds": max(waits) if waits else None,
        "group_count": group_count,
        "by_group": [
            {"queue": q, "tag": t, "task": n, "count": round(c * scale),
             "delayed": round(d * scale), "oldest_age_seconds": a}
            for q, t, n, c, d, a, *_ in groups
        ],
        "dead_by_reason": {str(reason): count for reason, count in dead},
        "dead_tuples": dead_tuples,
        "oldest_transaction": _transaction(oldest_xact),
        "lock": {"key": lock_key, **lock},
        "lanes": lanes,
    }


class StatusReader:
    """:func:`status` on a connection kept from one read to the next.

    For the readers that repeat (``drain status --watch``, the metrics
    sampler): a failed read closes the connection and raises
    :class:`DatabaseUnavailable` with the driver's text scrubbed of passwords;
    the next read connects again.
    """

    def __init__(self, settings: Settings, application_name: str = "drain cli") -> None:
        self._settings = settings
        self._application_name = application_name
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None

    def read(self) -> dict[str, Any]:
        try:
            if self._conn is None or self._conn.closed:
                self._conn = connect_plain(self._settings, self._application_name)
                self._conn.autocommit = True
            return status(self._conn, self._settings.lock_key)
        except Exception as exc:
            self.close()
            if isinstance(exc, DrainError):
                raise
            raise DatabaseUnavailable(
                scrub(first_line(exc), self._settings.secrets())
            ) from None

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


def _first(conn: psycopg.Connection[tuple[object, ...]], name: str) -> tuple[Any, ...]:
    """The one row a status query returns."""
    row = conn.execute(sql.query(name)).fetchone()
    if row is None:
        raise DrainError(f"query {name} returned no row")
    return row


def _rows(conn: psycopg.Connection[tuple[object, ...]], name: str,
          params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    return conn.execute(sql.query(name), params).fetchall()


def _transaction(row: tuple[Any, ...] | None) -> dict[str, Any] | None:
    """The oldest open transaction, as ``drain status`` reports it."""
    if row is None:
        return None
    pid, state, app_name, since, age, blocks_vacuum = row
    return {
        "pid": pid,
        "state": state,
        "application_name": app_name,
        "since": since.isoformat() if isinstance(since, dt.datetime) else None,
        "age_seconds": age,
        "blocks_vacuum": bool(blocks_vacuum),
    }


def _holder(conn: psycopg.Connection[tuple[object, ...]], high: int, low: int, *,
            form: int) -> dict[str, Any]:
    """The holder of one advisory lock: ``{"held": False}`` or its pid, host and since."""
    holder = conn.execute(sql.query("lock_holder"),
                          {"high": high, "low": low, "form": form}).fetchone()
    return {"held": False} if holder is None else _holder_fields(holder)


def _holder_fields(row: tuple[Any, ...]) -> dict[str, Any]:
    """A lock holder's pid, host and since, from its application_name."""
    pid, app_name, client_addr, _backend_start = row
    fields = dict(part.split("=", 1) for part in str(app_name or "").split() if "=" in part)
    since = fields.get("since")
    return {
        "held": True,
        "pid": int(fields.get("pid", pid)),
        "host": fields.get("host"),
        "since": dt.datetime.fromtimestamp(int(since), dt.timezone.utc).isoformat()
        if since and since.isdigit()
        else None,
        "client_addr": client_addr,
        "backend_pid": pid,
    }

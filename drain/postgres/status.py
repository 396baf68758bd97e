"""What ``drain status``, the status page and the metrics sampler read: the
backlog, dead letters, the oldest transaction and who holds the lock.

Reads only, from a session of their own (never the drain's): a status read
takes no lock and cannot get in the drain's way.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from typing import Any

import psycopg

from drain.errors import DatabaseUnavailable, DrainError
from drain.postgres import migration, session, sql
from drain.postgres.abandoned import lane_class, lane_guard
from drain.postgres.session import connect_plain
from drain.settings.config import Settings
from drain.settings.url_parts import first_line
from drain.settings.urls import scrub

#: ``drain status`` and the metrics sampler count the backlog exactly while
#: the statistics (``pg_stat_user_tables.n_live_tup``, kept by every commit)
#: estimate fewer staged rows than this: one scan of the table. From this many
#: on, the total is that estimate and the groups come from a block sample of
#: about :data:`SAMPLE_PAGES` pages, scaled to it; ``backlog_estimated`` says so.
ESTIMATE_ABOVE = 100_000
#: Pages of staged_jobs the sample reads above :data:`ESTIMATE_ABOVE` (8 kB
#: each: ~35,000 rows of a typical job), whatever the table's size.
SAMPLE_PAGES = 500


def read(
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
    * ``dead_by_reason``: as the backlog, exact below ``estimate_above`` estimated
      rows of dead_jobs; above, scaled to the statistics' estimate from a block
      sample (``dead_estimated``, ``dead_sample``), so that a status read and the
      metrics' sample cost the same with 10 million dead jobs as with none. A
      reason too rare to be sampled is missing; ``drain dead list`` counts exactly.
    * ``lock`` (its holder) and ``lanes`` (holders by lane).
    * ``pauses``: the queues and tasks whose publishing an operator paused
      (drain.postgres.pauses), with why, by whom and since when.
    * ``database``: the database read, as connected to (user, host, port, name;
      no password).
    * ``schema``: the version ``drain migrate`` recorded (None: none, an older
      drain's schema) and this drain's (drain.postgres.migration).

    Runs in a transaction of its own (a savepoint inside the caller's), so a
    watching operator or the sampler never holds one open between calls.
    """
    try:
        with conn.transaction():
            version = migration.schema_version(conn)
            live, dead_tuples, pages = _first(conn, "backlog_estimate")
            sample: dict[str, Any] | None = None
            if live >= estimate_above and pages > sample_pages:
                percent = 100.0 * sample_pages / pages
                groups = _rows(conn, "backlog_groups_sample", {"percent": percent})
                sample = {"percent": round(percent, 3), "rows": groups[0][6] if groups else 0}
            else:
                groups = _rows(conn, "backlog_groups")
            ready_age, due_age = _first(conn, "backlog_oldest")
            dead, dead_sample = _dead_by_reason(conn, estimate_above, sample_pages)
            oldest_xact = conn.execute(sql.query("oldest_transaction")).fetchone()
            paused = (_rows(conn, "pauses") if _first(conn, "pauses_present")[0] else [])
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
    except psycopg.Error as exc:
        refused = session.refusal(exc, session.connected_to(conn), session.RUNNER_GRANT)
        if refused is None:
            raise
        raise refused from None
    total, delayed, group_count = (int(n) for n in groups[0][6:9]) if groups else (0, 0, 0)
    scale = 1.0
    if sample is not None:
        scale = live / total if total else 0.0
        total, delayed = live, round(delayed * scale)
    waits = [age for age in (ready_age, due_age, *(g[5] for g in groups))
             if isinstance(age, float) and age >= 0]
    return {
        "database": session.connected_to(conn),
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
        "dead_by_reason": dead,
        "dead_estimated": dead_sample is not None,
        "dead_sample": dead_sample,
        "dead_tuples": dead_tuples,
        "oldest_transaction": _transaction(oldest_xact),
        "lock": {"key": lock_key, **lock},
        "lanes": lanes,
        "schema": {"version": version, "drain": migration.SCHEMA_VERSION},
        "pauses": [
            {"kind": kind, "name": name, "reason": reason, "paused_by": by,
             "paused_at": at.isoformat() if isinstance(at, dt.datetime) else None}
            for kind, name, reason, by, at in paused
        ],
    }


def _dead_by_reason(conn: psycopg.Connection[tuple[object, ...]], estimate_above: int,
                    sample_pages: int) -> tuple[dict[str, int], dict[str, Any] | None]:
    """Dead jobs by reason, and the sample they were scaled from (None: exact)."""
    live, pages = _first(conn, "dead_estimate")
    if live < estimate_above or pages <= sample_pages:
        rows = _rows(conn, "dead_by_reason")
        return {str(reason): int(count) for reason, count in rows}, None
    percent = 100.0 * sample_pages / pages
    rows = _rows(conn, "dead_by_reason_sample", {"percent": percent})
    sampled = sum(int(count) for _, count in rows)
    scale = live / sampled if sampled else 0.0
    counts = {str(reason): max(1, round(int(count) * scale)) for reason, count in rows}
    return counts, {"percent": round(percent, 3), "rows": sampled}


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
            return read(self._conn, self._settings.lock_key)
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

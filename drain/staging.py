"""Staging jobs in the application's own transaction.

:func:`stage` and :func:`stage_many` run INSERTs (or one COPY) on whatever
connection the caller is already using and never commit, roll back or open a
transaction of their own: the job becomes visible to the drain exactly when the
caller's transaction commits, and vanishes if it rolls back.

Accepted connection objects:

* psycopg 3 ``Connection`` or ``Cursor``;
* SQLAlchemy ``Connection`` or ``Session`` (``orm.Session``, ``scoped_session``);
* any DB-API connection with ``cursor()``, such as Django's
  ``django.db.connection`` or a psycopg2 connection, and DB-API cursors.
  These use the ``pyformat`` placeholder style (``%(name)s``), which the
  Postgres drivers and Django all speak.

Every value is checked and encoded first (drain.staging_values): arguments as
Celery's JSON serializer sends them (plain JSON, and kombu's datetime, date,
time, Decimal, UUID and bytes), refusing what ``jsonb`` cannot store (NaN and
infinities, NUL, lone surrogates) and an ``expires`` beyond what RabbitMQ
accepts (3,650 days) with :class:`~drain.errors.StagingError`, naming the
field, before any SQL is run.

An application may take this package before ``drain migrate`` has run on its
database (a rolling deploy deploys them separately). The columns added since
the first release, ``embed`` and ``trace``, are written only where the table
has them (:func:`_writable`): a job staged inside an OpenTelemetry span on a
database without ``trace`` is staged without its trace context, said once in
the log, and the caller's transaction never fails for it; a signature with
callbacks or a chain, whose ``embed`` cannot be dropped without changing what
runs, is refused with StagingError naming ``drain migrate`` before any SQL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import inspect
import logging
import operator
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from drain import staging_values, trace_context
from drain.errors import StagingError, UnsupportedConnection
from drain.signatures import from_signature
from drain.staging_values import COLUMNS, EMBED_COLUMNS, TRACE_COLUMN, Row

#: Where a job staged without a queue goes when the drain runs without ``--app``.
DEFAULT_QUEUE = "celery"
#: How each column's parameter is cast in the INSERT (they are sent as text).
_CASTS = {
    "task_id": "uuid", "args": "jsonb", "kwargs": "jsonb", "priority": "smallint",
    "not_before": "timestamptz", "expires_at": "timestamptz", "embed": "jsonb",
    "trace": "jsonb",
}
_MULTI_ROW_CHUNK = 500
#: The columns a database migrated by an older drain may lack, and how a
#: connection asks which it has (``to_regclass`` follows the search path, as the
#: INSERT does).
_NEWER_COLUMNS = ("embed", "trace")
_NEWER_COLUMNS_SQL = (
    "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass('staged_jobs') "
    "AND attname IN ('embed', 'trace') AND attnum > 0 AND NOT attisdropped")
#: A connection whose database lacked one is asked again after this many seconds
#: (``drain migrate`` may have run since); one that has them all, never.
_RECHECK = 60.0
_ALL_NEWER = frozenset(_NEWER_COLUMNS)

log = logging.getLogger("drain.staging")
#: Per connection object: the newer columns its database has, and when it was asked.
_seen: weakref.WeakKeyDictionary[Any, tuple[frozenset[str], float]] = (
    weakref.WeakKeyDictionary())
_said: set[str] = set()


@dataclasses.dataclass(frozen=True)
class Job:
    """One job for :func:`stage_many` (a mapping with these keys works too)."""

    task_name: str
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] | None = None
    queue: str | None = None
    task_id: uuid.UUID | str | None = None
    priority: int = 0
    tag: str | None = None
    countdown: float | None = None
    eta: dt.datetime | None = None
    expires: float | dt.datetime | None = None


_JOB_FIELDS = tuple(field.name for field in dataclasses.fields(Job))


def stage(
    conn: Any,
    task_name: str | Mapping[str, Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    queue: str | None = None,
    task_id: uuid.UUID | str | None = None,
    priority: int = 0,
    tag: str | None = None,
    countdown: float | None = None,
    eta: dt.datetime | None = None,
    expires: float | dt.datetime | None = None,
) -> uuid.UUID:
    """Stage one job on ``conn`` and return its Celery task id.

    One INSERT on the caller's connection, inside the caller's transaction.
    The drain publishes the job after that transaction commits; every copy it
    publishes carries the returned task id.

    * ``queue``: the Celery queue, as ``apply_async(queue=...)``. None (the
      default) gives none: ``drain run --app`` routes the job as the app's
      ``apply_async`` would (``task_routes``, the task's queue, the app's
      default queue); a drain without ``--app`` sends it to ``celery``.
    * ``priority``: higher is published first (default 0; use negative numbers
      for backfills). See ``--queue-max-priority`` for AMQP message priority.
    * ``tag``: who staged it, e.g. ``"api.create_annotation"``; sent in the
      ``drain_tag`` header and used to group ``drain status``.
    * ``countdown`` (seconds) or ``eta`` (a datetime; naive means UTC): not
      published before then. The delay is kept in Postgres, so it survives
      anything and never occupies the broker or a worker.
    * ``expires`` (seconds from now, or a datetime): not published after then;
      moved to ``dead_jobs`` with reason ``expired`` instead. The message
      carries Celery's ``expires`` too, so a worker will not run it late.
      At most 3,650 days ahead (drain.limits): RabbitMQ refuses later ones.

    ``countdown`` and relative ``expires`` are measured on this process's clock.

    ``task_name`` may also be a Celery signature (``add.s(2, 2).set(queue=...,
    countdown=...)``, with ``link`` / ``link_error`` callbacks) or a chain
    (``a.s(1) | b.s() | c.s()``): the message is what its ``apply_async``
    would send (drain.signatures), and the worker runs the callbacks and the
    rest of the chain as after ``apply_async``; the other arguments must then
    be left out. For a chain, the returned id is its first task's; the last
    task's (what ``chain.apply_async().id`` gives) is that of the chain's
    ``freeze()``, called before staging. Groups, chords and
    ``task.chunks(...)`` (a group of starmaps) are refused.
    """
    trace = trace_context.capture()
    if isinstance(task_name, Mapping):
        if (args, kwargs, queue, task_id, priority, tag, countdown, eta, expires) != (
                (), None, None, None, 0, None, None, None, None):
            raise StagingError("give a signature its options with .set(...): "
                               "drain.stage(conn, signature) takes nothing else")
        spec = from_signature(task_name)
        row = staging_values.row(spec.pop("task_name"), spec.pop("args"), spec.pop("kwargs"),
                                 spec.pop("queue", None), spec.pop("task_id", None),
                                 trace=trace, **spec)
    else:
        row = staging_values.row(
            task_name, args, kwargs, queue, task_id,
            priority=priority, tag=tag, countdown=countdown, eta=eta, expires=expires,
            trace=trace,
        )
    _execute_insert(conn, _writable(conn, [row]))
    return row.task_id


def stage_many(conn: Any, jobs: Iterable[Job | Mapping[str, Any]]) -> list[uuid.UUID]:
    """Stage many jobs in one round trip (COPY on psycopg 3, multi-row INSERT otherwise).

    Every job is validated before anything is written; returns the task ids
    in the order of ``jobs``. Each job carries the caller's OpenTelemetry
    context, as with :func:`stage`.
    """
    trace = trace_context.capture()
    rows = []
    for position, job in enumerate(jobs):
        if isinstance(job, Job):  # not dataclasses.asdict: it deep-copies the args
            spec = {name: getattr(job, name) for name in _JOB_FIELDS}
        elif isinstance(job, Mapping):
            unknown = set(job) - set(_JOB_FIELDS)
            if unknown:
                raise StagingError(f"job #{position}: unknown field(s) {sorted(unknown)}")
            spec = dict(job)
        else:
            raise StagingError(
                f"job #{position}: expected drain.Job or a mapping, got {type(job).__name__}"
            )
        if "task_name" not in spec:
            raise StagingError(f"job #{position}: task_name is required")
        rows.append(
            staging_values.row(
                spec["task_name"],
                spec.get("args", ()),
                spec.get("kwargs"),
                spec.get("queue"),
                spec.get("task_id"),
                priority=spec.get("priority", 0),
                tag=spec.get("tag"),
                countdown=spec.get("countdown"),
                eta=spec.get("eta"),
                expires=spec.get("expires"),
                trace=trace,
            )
        )
    if rows:
        _refuse_async(conn)
        rows = _writable(conn, rows)
        if _is_psycopg(conn):
            _copy(conn, rows)
        else:
            for start in range(0, len(rows), _MULTI_ROW_CHUNK):
                _execute_insert(conn, rows[start : start + _MULTI_ROW_CHUNK])
    return [row.task_id for row in rows]


# -- execution ---------------------------------------------------------------------


def _is_psycopg(conn: Any) -> bool:
    module = type(conn).__module__
    return module.startswith("psycopg.") or module == "psycopg"


def _is_sqlalchemy(conn: Any) -> bool:
    return type(conn).__module__.startswith("sqlalchemy.")


def _writable(conn: Any, rows: list[Row]) -> list[Row]:
    """``rows`` as the database can take them: without a trace context where
    staged_jobs has no ``trace`` column yet (said once per process); StagingError
    where a row has an embed and the table no ``embed`` column. Asks the database
    only when some row has either (once per connection, see :data:`_RECHECK`)."""
    if not any(row.trace is not None or row.embed is not None for row in rows):
        return rows
    has = _newer_columns(conn)
    if "embed" not in has and any(row.embed is not None for row in rows):
        raise StagingError(
            "staged_jobs has no embed column, which a signature's callbacks or a "
            "chain need: run `drain migrate` on this database (nothing was staged)")
    if "trace" not in has and any(row.trace is not None for row in rows):
        if "trace" not in _said:
            _said.add("trace")
            log.warning("staged_jobs has no trace column yet (`drain migrate` has not run "
                        "on this database): jobs are staged without their OpenTelemetry "
                        "context until it has")
        rows = [dataclasses.replace(row, trace=None) for row in rows]
    return rows


def _newer_columns(conn: Any) -> frozenset[str]:
    """Which of :data:`_NEWER_COLUMNS` staged_jobs has, as ``conn`` sees it."""
    now = time.monotonic()
    try:
        seen = _seen.get(conn)
    except TypeError:  # an object that takes no weak reference: asked every time
        seen = None
    if seen is not None and (seen[0] == _ALL_NEWER or now - seen[1] < _RECHECK):
        return seen[0]
    has = frozenset(str(row[0]) for row in _execute(conn, _NEWER_COLUMNS_SQL, fetch=True))
    with contextlib.suppress(TypeError):
        _seen[conn] = (has, now)
    return has


def _columns(rows: list[Row]) -> tuple[str, ...]:
    """The columns the rows give: embed and trace only when some row has one."""
    columns = EMBED_COLUMNS if any(row.embed is not None for row in rows) else COLUMNS
    if any(row.trace is not None for row in rows):
        columns = (*columns, TRACE_COLUMN)
    return columns


def _copy_columns(rows: list[Row]) -> tuple[str, ...]:
    """COPY's columns: without queue when no row gives one, so that the column's
    default applies, as in the INSERT (:func:`_insert_sql`)."""
    columns = _columns(rows)
    if all(row.queue is None for row in rows):
        columns = tuple(c for c in columns if c != "queue")
    return columns


def _insert_sql(rows: list[Row], style: str, columns: tuple[str, ...] = COLUMNS) -> str:
    """The INSERT of ``rows``. A row without a queue takes the column's DEFAULT,
    which is NULL, or 'celery' on a database `drain migrate` has not upgraded
    yet (where that was how "no queue given" read)."""
    def placeholder(column: str, i: int) -> str:
        if column == "queue" and rows[i].queue is None:
            return "DEFAULT"
        name = f":{column}{i}" if style == "named" else f"%({column}{i})s"
        cast = _CASTS.get(column)
        return f"CAST({name} AS {cast})" if cast else f"CAST({name} AS text)"

    values = ", ".join(
        "(" + ", ".join(placeholder(column, i) for column in columns) + ")"
        for i in range(len(rows))
    )
    # Only constant column names and generated placeholders: no value is pasted in.
    return f"INSERT INTO staged_jobs ({', '.join(columns)}) VALUES {values}"  # noqa: S608


def _params(rows: list[Row], columns: tuple[str, ...] = COLUMNS) -> dict[str, str | None]:
    params: dict[str, str | None] = {}
    for i, row in enumerate(rows):
        params.update(row.params(str(i), columns))
    return params


def _refuse_async(conn: Any) -> None:
    """An async connection's execute() returns a coroutine: nothing would be written."""
    if inspect.iscoroutinefunction(getattr(conn, "execute", None)):
        raise UnsupportedConnection(
            f"cannot stage on {type(conn).__module__}.{type(conn).__name__}: it is asynchronous "
            "and stage() is not; run it on a synchronous connection (or through "
            "AsyncSession.run_sync / AsyncConnection.run_sync in SQLAlchemy)"
        )


def _execute_insert(conn: Any, rows: list[Row]) -> None:
    columns = _columns(rows)
    named = _is_sqlalchemy(conn)
    _execute(conn, _insert_sql(rows, "named" if named else "pyformat", columns),
             _params(rows, columns))


def _execute(conn: Any, statement: str, params: Mapping[str, Any] | None = None, *,
             fetch: bool = False) -> list[tuple[Any, ...]]:
    """Run ``statement`` (``:name`` placeholders on SQLAlchemy, ``%(name)s`` on the
    others) on any connection :func:`stage` takes; its rows with ``fetch``."""
    _refuse_async(conn)

    def rows(result: Any) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in result.fetchall()] if fetch else []

    if _is_sqlalchemy(conn):
        from sqlalchemy import text  # noqa: PLC0415 - SQLAlchemy is optional

        return rows(conn.execute(text(statement), params or {}))
    if _is_psycopg(conn) and hasattr(conn, "execute"):
        return rows(conn.execute(statement, params))
    if callable(getattr(conn, "cursor", None)):
        cursor = conn.cursor()
        try:
            cursor.execute(statement, params)
            return rows(cursor)
        finally:
            cursor.close()
    if callable(getattr(conn, "execute", None)) and hasattr(conn, "fetchone"):
        conn.execute(statement, params)  # a DB-API cursor
        return rows(conn)
    raise UnsupportedConnection(
        f"cannot stage on a {type(conn).__module__}.{type(conn).__name__}: pass a psycopg "
        "connection or cursor, a SQLAlchemy Connection or Session, or a DB-API connection"
    )


def _copy(conn: Any, rows: list[Row]) -> None:
    columns = _copy_columns(rows)
    statement = f"COPY staged_jobs ({', '.join(columns)}) FROM STDIN"
    if hasattr(conn, "copy"):  # a psycopg Cursor
        _copy_rows(conn, statement, rows, columns)
        return
    with conn.cursor() as cursor:
        _copy_rows(cursor, statement, rows, columns)


def _copy_rows(cursor: Any, statement: str, rows: list[Row], columns: tuple[str, ...]) -> None:
    values = operator.attrgetter(*columns)
    with cursor.copy(statement) as copy:
        for row in rows:
            copy.write_row(values(row))

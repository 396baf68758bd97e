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

Arguments are encoded as strict JSON (what Celery's JSON serializer sends):
lists, dicts with string keys, strings, numbers, booleans and None. Anything
else raises :class:`~drain.errors.StagingError` before any SQL is run.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from drain.errors import StagingError, UnsupportedConnection

DEFAULT_QUEUE = "celery"
_COLUMNS = ("task_id", "task_name", "args", "kwargs", "queue")
_MULTI_ROW_CHUNK = 500
# A \u0000 escape in JSON text: preceded by an even number of backslashes, so
# that a string holding a literal backslash followed by "u0000" is not taken
# for a NUL.
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


@dataclasses.dataclass(frozen=True)
class Job:
    """One job for :func:`stage_many` (a mapping with these keys works too)."""

    task_name: str
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] | None = None
    queue: str | None = None
    task_id: uuid.UUID | str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Row:
    task_id: uuid.UUID
    task_name: str
    args: str
    kwargs: str
    queue: str

    def params(self, suffix: str = "") -> dict[str, str]:
        return {
            f"task_id{suffix}": str(self.task_id),
            f"task_name{suffix}": self.task_name,
            f"args{suffix}": self.args,
            f"kwargs{suffix}": self.kwargs,
            f"queue{suffix}": self.queue,
        }


def stage(
    conn: Any,
    task_name: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    queue: str | None = None,
    task_id: uuid.UUID | str | None = None,
) -> uuid.UUID:
    """Stage one job on ``conn`` and return its Celery task id.

    One INSERT on the caller's connection, inside the caller's transaction.
    The drain publishes the job after that transaction commits; every copy it
    publishes carries the returned task id.
    """
    row = _row(task_name, args, kwargs, queue, task_id)
    _execute_insert(conn, [row])
    return row.task_id


def stage_many(conn: Any, jobs: Iterable[Job | Mapping[str, Any]]) -> list[uuid.UUID]:
    """Stage many jobs in one round trip (COPY on psycopg 3, multi-row INSERT otherwise).

    Every job is validated before anything is written; returns the task ids
    in the order of ``jobs``.
    """
    rows = []
    for position, job in enumerate(jobs):
        if isinstance(job, Job):
            spec = dataclasses.asdict(job)
        elif isinstance(job, Mapping):
            unknown = set(job) - {f.name for f in dataclasses.fields(Job)}
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
            _row(
                spec["task_name"],
                spec.get("args", ()),
                spec.get("kwargs"),
                spec.get("queue"),
                spec.get("task_id"),
            )
        )
    if rows:
        _refuse_async(conn)
        if _is_psycopg(conn):
            _copy(conn, rows)
        else:
            for start in range(0, len(rows), _MULTI_ROW_CHUNK):
                _execute_insert(conn, rows[start : start + _MULTI_ROW_CHUNK])
    return [row.task_id for row in rows]


# -- validation ------------------------------------------------------------------


def _row(
    task_name: Any,
    args: Any,
    kwargs: Any,
    queue: Any,
    task_id: Any,
) -> _Row:
    if not isinstance(task_name, str) or not task_name.strip():
        raise StagingError(f"task name must be a non-empty string, got {task_name!r}")
    if len(_text("task name", task_name)) > 1024:
        raise StagingError(f"task name is longer than 1024 bytes: {task_name[:40]!r}...")
    if args is None:
        args = ()
    if isinstance(args, (str, bytes, Mapping)) or not isinstance(args, Sequence):
        raise StagingError(
            f"args for {task_name} must be a list or tuple, got {type(args).__name__}"
        )
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise StagingError(f"kwargs for {task_name} must be a dict, got {type(kwargs).__name__}")
    bad_keys = [k for k in kwargs if not isinstance(k, str)]
    if bad_keys:
        raise StagingError(f"kwargs for {task_name} must have string keys, got {bad_keys[0]!r}")
    if queue is None:
        queue = DEFAULT_QUEUE
    if not isinstance(queue, str) or not 1 <= len(_text(f"queue for {task_name}", queue)) <= 255:
        raise StagingError(f"queue for {task_name} must be a string of 1 to 255 bytes")
    if task_id is None:
        task_id = uuid.uuid4()
    elif not isinstance(task_id, uuid.UUID):
        try:
            task_id = uuid.UUID(str(task_id))
        except ValueError:
            raise StagingError(f"task_id for {task_name} is not a UUID: {task_id!r}") from None
    return _Row(
        task_id=task_id,
        task_name=task_name,
        args=_json(task_name, "args", list(args)),
        kwargs=_json(task_name, "kwargs", dict(kwargs)),
        queue=queue,
    )


def _json(task_name: str, what: str, value: Any) -> str:
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise StagingError(
            f"{what} for {task_name} are not JSON-serialisable: {exc}; "
            "convert them to lists, dicts, strings, numbers, booleans or None"
        ) from None
    if _JSON_NUL.search(text):
        raise StagingError(f"{what} for {task_name} contain a NUL character, which jsonb refuses")
    _text(f"{what} for {task_name}", text)
    return text


def _text(what: str, value: str) -> bytes:
    """``value`` as UTF-8; refuses what Postgres text cannot hold (NUL, lone surrogates)."""
    if "\x00" in value:
        raise StagingError(f"{what} contains a NUL character, which Postgres refuses")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise StagingError(f"{what} is not valid Unicode text: {exc.reason}") from None


# -- execution ---------------------------------------------------------------------


def _is_psycopg(conn: Any) -> bool:
    module = type(conn).__module__
    return module.startswith("psycopg.") or module == "psycopg"


def _is_sqlalchemy(conn: Any) -> bool:
    return type(conn).__module__.startswith("sqlalchemy.")


def _insert_sql(count: int, style: str) -> str:
    def placeholder(column: str, i: int) -> str:
        name = f"{column}{i}"
        return f":{name}" if style == "named" else f"%({name})s"

    values = ", ".join(
        f"(CAST({placeholder('task_id', i)} AS uuid), {placeholder('task_name', i)}, "
        f"CAST({placeholder('args', i)} AS jsonb), CAST({placeholder('kwargs', i)} AS jsonb), "
        f"{placeholder('queue', i)})"
        for i in range(count)
    )
    # Only constant column names and generated placeholders: no value is pasted in.
    return f"INSERT INTO staged_jobs ({', '.join(_COLUMNS)}) VALUES {values}"  # noqa: S608


def _params(rows: list[_Row]) -> dict[str, str]:
    params: dict[str, str] = {}
    for i, row in enumerate(rows):
        params.update(row.params(str(i)))
    return params


def _refuse_async(conn: Any) -> None:
    """An async connection's execute() returns a coroutine: nothing would be written."""
    if inspect.iscoroutinefunction(getattr(conn, "execute", None)):
        raise UnsupportedConnection(
            f"cannot stage on {type(conn).__module__}.{type(conn).__name__}: it is asynchronous "
            "and stage() is not; run it on a synchronous connection (or through "
            "AsyncSession.run_sync / AsyncConnection.run_sync in SQLAlchemy)"
        )


def _execute_insert(conn: Any, rows: list[_Row]) -> None:
    _refuse_async(conn)
    params = _params(rows)
    if _is_sqlalchemy(conn):
        from sqlalchemy import text  # noqa: PLC0415 - SQLAlchemy is optional

        conn.execute(text(_insert_sql(len(rows), "named")), params)
        return
    statement = _insert_sql(len(rows), "pyformat")
    if _is_psycopg(conn) and hasattr(conn, "execute"):
        conn.execute(statement, params)
    elif callable(getattr(conn, "cursor", None)):
        cursor = conn.cursor()
        try:
            cursor.execute(statement, params)
        finally:
            cursor.close()
    elif callable(getattr(conn, "execute", None)) and hasattr(conn, "fetchone"):
        conn.execute(statement, params)
    else:
        raise UnsupportedConnection(
            f"cannot stage on a {type(conn).__module__}.{type(conn).__name__}: pass a psycopg "
            "connection or cursor, a SQLAlchemy Connection or Session, or a DB-API connection"
        )


def _copy(conn: Any, rows: list[_Row]) -> None:
    statement = f"COPY staged_jobs ({', '.join(_COLUMNS)}) FROM STDIN"
    if hasattr(conn, "copy"):  # a psycopg Cursor
        _copy_rows(conn, statement, rows)
        return
    with conn.cursor() as cursor:
        _copy_rows(cursor, statement, rows)


def _copy_rows(cursor: Any, statement: str, rows: list[_Row]) -> None:
    with cursor.copy(statement) as copy:
        for row in rows:
            copy.write_row((row.task_id, row.task_name, row.args, row.kwargs, row.queue))

"""How drain.consumer runs its SQL on any kind of connection, and which it refuses.

:mod:`drain.consumer` hands the caller's connection here; this module
dispatches on its kind (psycopg 3, SQLAlchemy, Django, any other DB-API, as
:mod:`drain.staging` does) to run a statement, and refuses a connection on
which that statement would commit on its own: a claim committed by itself,
before the work it stands for, is what makes a job lost when that work then
fails (the redelivery finds the claim and skips the work). drain.testing
reads and deletes staged rows on a test's connection through :func:`rows` and
:func:`execute`.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any, TypeVar

from drain.errors import DrainError

_PYFORMAT = re.compile(r"%\((\w+)\)s")
# psycopg2's connection.get_transaction_status() when no transaction is open
# (psycopg2.extensions.TRANSACTION_STATUS_IDLE).
_PSYCOPG2_IDLE = 0
T = TypeVar("T")


class ConsumerError(DrainError):
    """drain.consumer was misused: a task id that is not a UUID, a bad connection..."""


def is_psycopg(conn: Any) -> bool:
    module = type(conn).__module__
    return module.startswith("psycopg.") or module == "psycopg"


def is_sqlalchemy(conn: Any) -> bool:
    return type(conn).__module__.startswith("sqlalchemy.")


def is_django(conn: Any) -> bool:
    return type(conn).__module__.startswith("django.")


def refuse_async(conn: Any) -> None:
    if inspect.iscoroutinefunction(getattr(conn, "execute", None)):
        raise ConsumerError(
            f"{type(conn).__module__}.{type(conn).__name__} is asynchronous and "
            "drain.consumer is not; use a synchronous connection"
        )


def refuse_autocommit(conn: Any) -> None:
    """Raise :class:`ConsumerError` if a statement on ``conn`` would commit on its own.

    psycopg 3 in autocommit mode outside ``conn.transaction()``; a SQLAlchemy
    Connection or Session whose driver connection is in autocommit mode
    (``isolation_level="AUTOCOMMIT"``, where ``begin()`` opens no database
    transaction); Django's connection outside ``transaction.atomic()``
    (``get_autocommit()``); another DB-API connection with ``autocommit`` on.
    """
    if is_sqlalchemy(conn):
        refused = _sqlalchemy_autocommit(conn)
    elif is_django(conn):
        wrapper = getattr(conn, "db", conn)  # a Django CursorWrapper has .db
        get_autocommit = getattr(wrapper, "get_autocommit", None)
        refused = (
            ("Django's connection outside transaction.atomic()",
             "run it inside `with transaction.atomic():`")
            if callable(get_autocommit) and get_autocommit()
            else None
        )
    else:
        refused = _driver_autocommit(getattr(conn, "connection", conn))  # a cursor's .connection
    if refused is not None:
        where, fix = refused
        raise ConsumerError(
            f"claim() on {where} would commit the record on its own, before the task's work "
            f"(if the work then failed, its redelivery would skip it): {fix}, together with "
            "that work"
        )


def _sqlalchemy_autocommit(conn: Any) -> tuple[str, str] | None:
    from sqlalchemy.engine import Connection  # noqa: PLC0415 - SQLAlchemy is optional

    # A Session (or scoped_session) hands out the Connection its transaction runs on.
    connection = conn if isinstance(conn, Connection) else conn.connection()
    driver = connection.connection.dbapi_connection
    if _driver_autocommit(driver) is None:
        return None
    return (
        "a SQLAlchemy connection in AUTOCOMMIT mode",
        "use one without isolation_level='AUTOCOMMIT' (begin() opens no transaction there)",
    )


def _driver_autocommit(driver: Any) -> tuple[str, str] | None:
    """(what, fix) if a DB-API connection would commit each statement on its own."""
    if getattr(driver, "autocommit", False) is not True:
        return None
    info = getattr(driver, "info", None)
    status = getattr(info, "transaction_status", None)
    if is_psycopg(driver) and status is not None:
        if status.name != "IDLE":
            return None  # inside conn.transaction()
        return ("an autocommit connection outside a transaction",
                "run it inside `with conn.transaction():`")
    get_status = getattr(driver, "get_transaction_status", None)  # psycopg2
    if callable(get_status) and get_status() != _PSYCOPG2_IDLE:
        return None  # an explicit BEGIN is open
    return (f"a {type(driver).__module__}.{type(driver).__name__} in autocommit mode",
            "turn autocommit off and commit after the work")


def execute(
    conn: Any, statement: str, params: dict[str, Any], *, fetch: bool = False
) -> tuple[Any, int]:
    """Run ``statement`` (pyformat placeholders) on ``conn``: (first row if fetch, rowcount)."""
    return run(conn, statement, params,
               lambda result: ((result.fetchone() if fetch else None), int(result.rowcount)))


def rows(conn: Any, statement: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Run the query ``statement`` (pyformat placeholders) on ``conn``: every row."""
    return run(conn, statement, params, lambda result: [tuple(row) for row in result.fetchall()])


def run(conn: Any, statement: str, params: dict[str, Any], read: Callable[[Any], T]) -> T:
    """Run ``statement`` (pyformat placeholders) on ``conn`` and ``read`` its result
    (a cursor, or SQLAlchemy's Result: ``fetchone``, ``fetchall``, ``rowcount``)."""
    if is_sqlalchemy(conn):
        from sqlalchemy import text  # noqa: PLC0415 - SQLAlchemy is optional

        return read(conn.execute(text(_PYFORMAT.sub(r":\1", statement)), params))
    if is_psycopg(conn) and hasattr(conn, "execute"):
        cursor = conn.execute(statement, params)
        if cursor is None:  # a psycopg Cursor returns itself; be lenient all the same
            cursor = conn
        return read(cursor)
    if callable(getattr(conn, "cursor", None)):
        cursor = conn.cursor()
        try:
            cursor.execute(statement, params)
            return read(cursor)
        finally:
            cursor.close()
    if callable(getattr(conn, "execute", None)) and hasattr(conn, "fetchone"):
        conn.execute(statement, params)
        return read(conn)
    raise ConsumerError(
        f"cannot run SQL on a {type(conn).__module__}.{type(conn).__name__}: pass a psycopg "
        "connection or cursor, a SQLAlchemy Connection or Session, or a DB-API connection"
    )

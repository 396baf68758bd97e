"""Effectively-once consumers: skip Celery tasks whose task id was already processed.

drain delivers at least once: after a crash a job can be published, and so
delivered, more than once, and Celery redelivers unacked messages when a
worker dies. Every copy of a job carries the same Celery task id, so a
consumer can recognise a copy it has already processed. This module keeps
that record in the table ``drain_processed`` (created by ``drain migrate``):

* :func:`claim` inserts the task id in the caller's transaction and says
  whether this was the first time;
* :func:`effectively_once` wraps a Celery task so that the claim and the
  task's own database writes commit (or roll back) together;
* :func:`purge` deletes old records in small batches.

When this gives exactly-once effects
------------------------------------
Only for effects that are writes to the same Postgres database, made on the
same connection, in the same transaction as the claim. Then either both
commit (the job is done and recorded) or neither does (the job is not done
and not recorded, and the next delivery runs it). A copy delivered after the
commit finds the record and is skipped; a copy delivered while the first is
still running waits for it (see :func:`claim`).

When it cannot
--------------
Anything outside that transaction: sending an email, calling an HTTP API,
publishing to a broker, writing to another database, a search engine or a
file. Such an effect can happen and then the transaction roll back (an
exception after it, a lost connection, a worker killed before COMMIT), and the
next delivery does it again. Make those effects idempotent downstream (an
idempotency key such as the task id, an upsert keyed by your own id, a
conditional write) or stage them in a transactional outbox of their own (for
example ``drain.stage`` a follow-up job in the same transaction, and make that
job idempotent). This module narrows duplicates to crashes between such an
effect and the commit; it cannot remove them.

Records are kept per task id, not per task name or arguments: a new job
(a new task id) doing the same work runs again, as it should. Celery's own
retries (``self.retry()``, ``autoretry_for``) keep the task id: the failed
attempt rolled back its claim, so the retry runs.

Running the SQL on each kind of connection, and refusing those that would
commit a claim on its own, is :mod:`drain.consumer_sql`'s part.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import inspect
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar, overload

from drain.consumer_sql import (
    ConsumerError,
    execute,
    is_psycopg,
    refuse_async,
    refuse_autocommit,
)

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import psycopg

__all__ = [
    "PURGE_BATCH_SIZE",
    "AbortedTransactionError",
    "ConsumerError",
    "TaskLike",
    "claim",
    "effectively_once",
    "purge",
]

log = logging.getLogger(__name__)

#: Rows deleted per statement (and per transaction) by :func:`purge`.
PURGE_BATCH_SIZE = 10_000

_CLAIM_SQL = (
    "INSERT INTO drain_processed (task_id) VALUES (CAST(%(task_id)s AS uuid)) "
    "ON CONFLICT (task_id) DO NOTHING RETURNING task_id"
)
# Oldest first, through drain_processed_at_idx; each batch is its own statement
# and transaction, so no single DELETE holds many row locks or much WAL.
_PURGE_SQL = (
    "DELETE FROM drain_processed WHERE task_id IN ("
    "SELECT task_id FROM drain_processed "
    "WHERE processed_at < now() - make_interval(secs => CAST(%(seconds)s AS double precision)) "
    "ORDER BY processed_at LIMIT %(batch_size)s)"
)


class AbortedTransactionError(ConsumerError):
    """An effectively_once body returned, but an error it caught had aborted the transaction.

    Committing would have rolled back the claim and every write of the task
    while the task reported success: the job would have been lost without a
    trace. The transaction is rolled back and the task fails with this error.
    """


class TaskLike(Protocol):
    """What :func:`effectively_once` needs of a bound Celery task (``bind=True``)."""

    @property
    def name(self) -> str: ...

    @property
    def request(self) -> Any: ...


_Task = TypeVar("_Task", bound=TaskLike)
_P = ParamSpec("_P")
_R = TypeVar("_R")

if TYPE_CHECKING:
    _Conn = psycopg.Connection[Any]
    #: What ``connect`` may return: a connection (borrowed, left open) or a
    #: context manager yielding one (exited after the task).
    ConnectionSource = Callable[[], "_Conn | AbstractContextManager[_Conn]"]


# -- claim -------------------------------------------------------------------------


def claim(conn: Any, task_id: uuid.UUID | str) -> bool:
    """Record ``task_id`` as processed; True if this call recorded it first.

    Runs ``INSERT INTO drain_processed ... ON CONFLICT DO NOTHING`` on the
    caller's connection, inside the caller's transaction, and never commits,
    rolls back or opens a transaction of its own: the record becomes durable
    exactly when the caller's transaction commits, together with whatever else
    that transaction wrote, and vanishes if it rolls back. Do the job's work
    in the same transaction only when this returns True.

    Accepts the connections :func:`drain.stage` does: a psycopg 3 Connection
    or Cursor, a SQLAlchemy Connection or Session, a DB-API connection or
    cursor. It refuses (:class:`ConsumerError`) a connection on which the
    record would commit on its own, before the work it stands for, so that a
    failure of that work would make its redelivery skip it: psycopg in
    autocommit mode outside ``conn.transaction()``, SQLAlchemy with
    ``isolation_level="AUTOCOMMIT"``, Django's connection outside
    ``transaction.atomic()``.

    Concurrency (READ COMMITTED, Postgres's default): when two deliveries of
    the same task id run at once, the second INSERT waits on the primary key
    until the first transaction ends. If it commits, the second call returns
    False; if it rolls back, the second call returns True and its caller does
    the work. The first transaction holds that lock for its whole duration, so
    keep it short. Under REPEATABLE READ or SERIALIZABLE the second call
    raises a serialization failure instead of returning False (the first
    committed after the second's snapshot); the duplicate then fails, which is
    harmless since the first did the work.

    Raises :class:`ConsumerError`, before running any SQL, when ``task_id`` is
    not a UUID (``drain_processed.task_id`` is ``uuid``: every drain-published
    and default Celery task id is one).
    """
    key = _task_uuid(task_id)
    refuse_async(conn)
    refuse_autocommit(conn)
    row, _ = execute(conn, _CLAIM_SQL, {"task_id": str(key)}, fetch=True)
    return row is not None


def _task_uuid(task_id: object) -> uuid.UUID:
    if isinstance(task_id, uuid.UUID):
        return task_id
    if task_id is None:
        raise ConsumerError(
            "task id is None: the task was called directly rather than delivered "
            "by a worker (or applied eagerly without an id); there is nothing to dedupe on"
        )
    if not isinstance(task_id, str):
        raise ConsumerError(
            f"task id must be a uuid.UUID or a str, got {type(task_id).__name__}: {task_id!r}"
        )
    try:
        return uuid.UUID(task_id)
    except ValueError:
        raise ConsumerError(
            f"task id is not a UUID: {task_id!r} (drain_processed.task_id is uuid; "
            "drain-published and default Celery task ids always are)"
        ) from None


# -- purge -------------------------------------------------------------------------


def purge(
    conn: Any, older_than: dt.timedelta, *, batch_size: int = PURGE_BATCH_SIZE
) -> int:
    """Delete records processed more than ``older_than`` ago; return how many.

    Deletes in batches of ``batch_size`` rows, oldest first, each batch in a
    transaction of its own that is committed before the next one starts, so a
    purge of a large table never holds one long transaction or millions of row
    locks. Because it commits, call it on a connection with no transaction of
    the caller's in progress: a psycopg connection that is inside a
    transaction is refused (its pending work would be committed along).
    Rows are compared with the database's clock (``now() - older_than``).

    Choosing ``older_than``: a record may only go once no copy of its job can
    still arrive; a copy arriving after its record was purged runs again. It
    must therefore be longer than the longest time a job can take from its
    first delivery to its last possible redelivery: how long a message can
    sit in a queue (the queue's message TTL, or your worst backlog and outage
    if there is none), plus how long a worker can hold it unacked (a task's
    run time, the broker's ``consumer_timeout``), plus Celery retries and
    their countdowns, plus how long a crashed drain can take to republish
    (staged rows wait as long as the drain is down). Days, not minutes: the
    table holds one small row per job, and a week of them is cheap
    (``drain processed purge --older-than 7d``).
    """
    if not isinstance(older_than, dt.timedelta):
        raise ConsumerError(
            f"older_than must be a datetime.timedelta, got {type(older_than).__name__}"
        )
    if older_than <= dt.timedelta(0):
        raise ConsumerError(f"older_than must be positive, got {older_than}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConsumerError(f"batch_size must be a positive integer, got {batch_size!r}")
    refuse_async(conn)
    if is_psycopg(conn):
        status = getattr(getattr(conn, "info", None), "transaction_status", None)
        if not hasattr(conn, "transaction"):
            raise ConsumerError("purge() commits between batches: pass a psycopg Connection")
        if status is not None and status.name != "IDLE":
            raise ConsumerError(
                "purge() commits after every batch, but the connection has a transaction "
                f"in progress ({status.name}): commit or roll back first"
            )
    elif not callable(getattr(conn, "commit", None)):
        raise ConsumerError(
            f"purge() commits between batches: pass a connection with commit(), not a "
            f"{type(conn).__module__}.{type(conn).__name__}"
        )
    params = {"seconds": older_than.total_seconds(), "batch_size": batch_size}
    total = 0
    while True:
        deleted = _purge_batch(conn, params)
        total += deleted
        log.debug("purged %d drain_processed rows (%d so far)", deleted, total)
        if deleted < batch_size:
            return total


def _purge_batch(conn: Any, params: dict[str, Any]) -> int:
    if is_psycopg(conn):
        with conn.transaction():
            _, deleted = execute(conn, _PURGE_SQL, params)
    else:
        try:
            _, deleted = execute(conn, _PURGE_SQL, params)
        except BaseException:
            conn.rollback()
            raise
        conn.commit()
    if deleted < 0:
        raise ConsumerError(
            f"{type(conn).__module__}.{type(conn).__name__} does not report how many rows a "
            "DELETE removed (rowcount -1); purge() needs it to know when to stop"
        )
    return deleted


# -- the decorator -------------------------------------------------------------------


@overload
def effectively_once(
    connect: ConnectionSource,
) -> Callable[
    [Callable[Concatenate[_Task, _Conn, _P], _R]], Callable[Concatenate[_Task, _P], _R | None]
]: ...


@overload
def effectively_once(
    connect: ConnectionSource,
    *,
    on_skip: Callable[Concatenate[_Task, _Conn, _P], object],
) -> Callable[
    [Callable[Concatenate[_Task, _Conn, _P], _R]], Callable[Concatenate[_Task, _P], _R | None]
]: ...


def effectively_once(
    connect: ConnectionSource,
    *,
    on_skip: Callable[..., object] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run a bound Celery task at most once per task id, in one transaction.

    ``connect`` is called with no arguments for every delivery and returns a
    psycopg 3 connection, or a context manager that yields one (such as
    ``psycopg_pool.ConnectionPool.connection``). A connection returned
    directly is borrowed: it is left open for the next task (keep one per
    worker process or thread, as ``celery_app.tasks`` does); a context
    manager is exited after the task. So do not return a fresh
    ``psycopg.connect(...)``, which would never be closed: return
    ``contextlib.closing(psycopg.connect(...))`` or a pool's context manager.
    The connection must have no transaction in progress (autocommit or
    idle): the decorator has to own the transaction it commits.

    For every delivery the wrapper opens ``conn.transaction()``, calls
    :func:`claim` with ``task.request.id``, then

    * if the id is new, runs ``body(task, conn, *args, **kwargs)``: do the
      task's database writes on ``conn``, and they commit together with the
      claim when the body returns. An exception rolls both back and
      propagates, so a retry or a later delivery runs the body again. A body
      that returns after catching a database error (its transaction is then
      aborted and could only roll back) fails with
      :class:`AbortedTransactionError` and rolls back the same way;
    * if the id was already processed, skips the body, logs
      ``task <name>[<id>] already processed; skipped`` at INFO, calls
      ``on_skip(task, conn, *args, **kwargs)`` if given (in the same
      transaction, e.g. to record the skip), commits and returns None.

    Place it under ``@app.task(bind=True)``; the task's signature, as Celery
    sees it, is the body's without ``conn``::

        @app.task(bind=True, name="search.index_annotation")
        @effectively_once(get_connection)
        def index_annotation(self, conn, annotation_id):
            conn.execute("INSERT INTO search_index ...", (annotation_id,))

    See the module documentation for which effects this makes exactly-once
    (writes through ``conn``) and which it cannot (everything else).
    """
    if not callable(connect):
        raise ConsumerError(f"connect must be callable, got {type(connect).__name__}")

    def decorate(body: Callable[..., Any]) -> Callable[..., Any]:
        signature = _task_signature(body)

        @functools.wraps(body)
        def task(self: TaskLike, *args: Any, **kwargs: Any) -> Any:
            task_id = _task_uuid(getattr(self.request, "id", None))
            with _connection(connect) as conn:
                if conn.closed:
                    raise ConsumerError(
                        f"task {self.name}[{task_id}]: connect() returned a closed connection"
                    )
                status = conn.info.transaction_status
                if status.name != "IDLE":
                    raise ConsumerError(
                        f"task {self.name}[{task_id}]: the connection has a transaction in "
                        f"progress ({status.name}); effectively_once needs an idle connection "
                        "so that the claim and the task's writes commit together"
                    )
                with conn.transaction():
                    if not claim(conn, task_id):
                        log.info("task %s[%s] already processed; skipped", self.name, task_id)
                        if on_skip is not None:
                            on_skip(self, conn, *args, **kwargs)
                            _refuse_aborted(conn, f"task {self.name}[{task_id}]: on_skip")
                        return None
                    result = body(self, conn, *args, **kwargs)
                    _refuse_aborted(conn, f"task {self.name}[{task_id}]")
                    return result

        # What Celery checks calls against (it reads __signature__, not __wrapped__).
        task.__signature__ = signature  # type: ignore[attr-defined]
        return task

    return decorate


def _refuse_aborted(conn: Any, who: str) -> None:
    """Raise (and so roll back) instead of committing a transaction an error aborted.

    Postgres answers COMMIT of an aborted transaction with ROLLBACK and no
    error, and psycopg raises nothing: the claim and every write would vanish
    while the task returned success.
    """
    status = conn.info.transaction_status
    if status.name == "INERROR":
        raise AbortedTransactionError(
            f"{who} returned, but a database error it caught had aborted the transaction "
            "(Postgres ignores every later statement and turns COMMIT into ROLLBACK): rolled "
            "back the claim and the task's writes instead of losing the job; to go on after "
            "an expected error, run that statement inside `with conn.transaction():` (a savepoint)"
        )


def _task_signature(body: Callable[..., Any]) -> inspect.Signature:
    signature = inspect.signature(body)
    params = list(signature.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(params) < 2 or any(p.kind not in positional for p in params[:2]):
        raise ConsumerError(
            f"{getattr(body, '__qualname__', body)!r} must take (self, conn, ...): "
            "the bound task, then the connection the claim runs on"
        )
    return signature.replace(parameters=[params[0], *params[2:]])


@contextlib.contextmanager
def _connection(connect: Callable[[], Any]) -> Iterator[Any]:
    obtained = connect()
    if is_psycopg(obtained) and hasattr(obtained, "transaction"):
        refuse_async(obtained)
        yield obtained
    elif hasattr(obtained, "__enter__") and hasattr(obtained, "__exit__"):
        with obtained as conn:
            if not (is_psycopg(conn) and hasattr(conn, "transaction")):
                raise ConsumerError(_not_a_connection(conn))
            refuse_async(conn)
            yield conn
    else:
        raise ConsumerError(_not_a_connection(obtained))


def _not_a_connection(obj: object) -> str:
    return (
        f"effectively_once's connect() returned a {type(obj).__module__}."
        f"{type(obj).__name__}: it must return a psycopg 3 Connection, or a context "
        "manager yielding one"
    )

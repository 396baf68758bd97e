"""A Celery app whose effectively-once task swallows a database error.

``celery -A tests.aborted_app worker`` runs ``aborted.tag``: it inserts the
annotation's tag into ``tags``, then the tag's name into ``tag_names`` and lets
a duplicate name pass (``except UniqueViolation: pass``, the common idiom).
Under :func:`drain.consumer.effectively_once` that error has aborted the whole
transaction, and the wrapper fails the task with ``AbortedTransactionError``;
the task retries on it (``autoretry_for``, same task id). Every attempt is
counted in ``tag_attempts`` on a connection of its own (autocommit), which the
task's rollback does not undo. Configured like celery_app (acks_late...);
reads ``CELERY_APP_DATABASE_URL``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import psycopg
from celery import Celery, Task

from drain.consumer import AbortedTransactionError, effectively_once
from tests import support

DDL = """
CREATE TABLE IF NOT EXISTS tags (annotation_id int NOT NULL, tag text NOT NULL);
CREATE TABLE IF NOT EXISTS tag_names (tag text PRIMARY KEY);
CREATE TABLE IF NOT EXISTS tag_attempts (
    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, task_id uuid NOT NULL);
"""

app = Celery("aborted_app", broker=support.BROKER_URL)
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_local = threading.local()


def _conn(kind: str) -> psycopg.Connection[Any]:
    conn: psycopg.Connection[Any] | None = getattr(_local, kind, None)
    if conn is None or conn.closed:
        conn = psycopg.connect(os.environ["CELERY_APP_DATABASE_URL"], autocommit=True)
        setattr(_local, kind, conn)
    return conn


def _task_conn() -> psycopg.Connection[Any]:
    return _conn("task")


@app.task(bind=True, name="aborted.tag", autoretry_for=(AbortedTransactionError,),
          retry_kwargs={"countdown": 0.2}, max_retries=None)
@effectively_once(_task_conn)
def tag(self: Task, conn: psycopg.Connection[Any], annotation_id: int, name: str) -> None:
    _conn("attempts").execute("INSERT INTO tag_attempts (task_id) VALUES (%s)",
                              (self.request.id,))
    conn.execute("INSERT INTO tags VALUES (%s, %s)", (annotation_id, name))
    try:  # noqa: SIM105 - the idiom under test, as users write it
        conn.execute("INSERT INTO tag_names VALUES (%s)", (name,))
    except psycopg.errors.UniqueViolation:
        pass

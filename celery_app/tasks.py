"""Example tasks: a stand-in search index, and a recorder used by the tests.

Both write to Postgres (``CELERY_APP_DATABASE_URL``, falling back to
``DRAIN_DATABASE_URL``): ``search.index_annotation`` maintains
``search_index``, the downstream copy a real app would keep in Elasticsearch;
every task also appends to ``executed_jobs`` so that tests and the demo can see
exactly what ran, with which arguments, task id and drain tag.

``search.index_annotation`` is an effectively-once consumer
(:func:`drain.consumer.effectively_once`): its upsert commits in one
transaction with the claim of its task id in ``drain_processed``, so a
redelivered copy of the same job (same task id) does not index again. Such a
copy still appends to ``executed_jobs``, with ``skipped = true``.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import psycopg
from celery import Task

from celery_app.app import app
from drain.consumer import effectively_once

_DDL = """
CREATE TABLE IF NOT EXISTS executed_jobs (
    seq         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id     uuid NOT NULL,
    task_name   text NOT NULL,
    args        jsonb NOT NULL,
    kwargs      jsonb NOT NULL,
    executed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- True when an effectively-once task recognised its task id and skipped its body.
    skipped     boolean NOT NULL DEFAULT false,
    -- The job's drain tag (the message's drain_tag header), if it had one.
    tag         text
);
-- Databases created before the columns existed (the demo's survives between runs).
ALTER TABLE executed_jobs ADD COLUMN IF NOT EXISTS skipped boolean NOT NULL DEFAULT false;
ALTER TABLE executed_jobs ADD COLUMN IF NOT EXISTS tag text;
CREATE TABLE IF NOT EXISTS search_index (
    annotation_id bigint PRIMARY KEY,
    indexed_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    times_indexed integer NOT NULL DEFAULT 1
);
"""

_local = threading.local()


def _conn() -> psycopg.Connection[Any]:
    conn: psycopg.Connection[Any] | None = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        url = os.environ.get("CELERY_APP_DATABASE_URL") or os.environ.get("DRAIN_DATABASE_URL", "")
        conn = psycopg.connect(url, autocommit=True)
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('celery_app ddl'))")
            conn.execute(_DDL)
        _local.conn = conn
    return conn


def _record(
    task: Task, args: Any, kwargs: Any, conn: psycopg.Connection[Any], *, skipped: bool = False
) -> None:
    # Celery puts the message's headers on the request, unknown ones included.
    tag = task.request.get("drain_tag")
    conn.execute(
        "INSERT INTO executed_jobs (task_id, task_name, args, kwargs, skipped, tag) "
        "VALUES (%s, %s, %s, %s, %s, %s)",
        (task.request.id, task.name, json.dumps(list(args)), json.dumps(kwargs), skipped, tag),
    )


def _index_skipped(self: Task, conn: psycopg.Connection[Any], annotation_id: int) -> None:
    _record(self, (), {"annotation_id": annotation_id}, conn, skipped=True)


@app.task(bind=True, name="search.index_annotation")
@effectively_once(_conn, on_skip=_index_skipped)
def index_annotation(self: Task, conn: psycopg.Connection[Any], annotation_id: int) -> None:
    """Index one annotation (here: upsert a row standing in for the search document).

    At most once per task id: the upsert commits together with the task id's
    record in drain_processed; a copy of an already indexed job is skipped.
    """
    conn.execute(
        "INSERT INTO search_index (annotation_id) VALUES (%s) "
        "ON CONFLICT (annotation_id) DO UPDATE "
        "SET indexed_at = clock_timestamp(), times_indexed = search_index.times_indexed + 1",
        (annotation_id,),
    )
    _record(self, (), {"annotation_id": annotation_id}, conn)


@app.task(bind=True, name="celery_app.record", autoretry_for=(psycopg.OperationalError,),
          retry_backoff=1, retry_backoff_max=4, max_retries=30)
def record(self: Task, *args: Any, **kwargs: Any) -> None:
    """Do nothing but record that it ran, with what.

    Retried (same task id) while the database is unreachable: during a primary
    failover its connection dies and there is no primary for a moment; the
    next attempt connects afresh, to whichever server the URL leads to now.
    """
    conn = _conn()
    _record(self, args, kwargs, conn)

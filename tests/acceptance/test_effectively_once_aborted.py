"""A real Celery worker: a task that swallows a database error fails and retries; no job is lost.

``aborted.tag`` (tests/aborted_app.py) inserts a tag and lets a duplicate tag
name pass with ``except UniqueViolation: pass``. Staged through a real
``drain run`` while the name is already there, every attempt fails with
``AbortedTransactionError`` and retries (same task id): nothing is committed,
no claim is recorded. Once the conflicting name is gone, the next retry tags
the annotation, once, and records the claim.

Before (effectively_once committed the aborted transaction, which Postgres
turns into a ROLLBACK): the first attempt returned success, Celery acked it,
and the job was gone: one attempt, no tag, no claim, nothing retried.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg

import drain
from tests import aborted_app, support


def count(db_url: str, sql: str, *params: Any) -> int:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(sql, params).fetchone()
        assert row is not None
        return int(row[0])


def test_a_swallowed_database_error_fails_the_task_and_its_retry_does_the_job(
    db_url: str, queue: str, spawn: Any
) -> None:
    task_id = uuid.uuid4()
    with psycopg.connect(db_url) as conn:
        conn.execute(aborted_app.DDL)
        conn.execute("INSERT INTO tag_names VALUES ('red')")
        drain.stage(conn, "aborted.tag", kwargs={"annotation_id": 7, "name": "red"},
                    queue=queue, task_id=task_id)

    env = support.drain_env(db_url)
    argv = support.celery_argv(queue)
    argv[argv.index("celery_app")] = "tests.aborted_app"
    worker = spawn(argv, env, "worker")
    runner = spawn(support.drain_argv("run", "--poll-interval", "0.5"), env, "drain")
    worker.wait_for_output("ready.", timeout=60)
    runner.wait_for_output("broker connected", timeout=30)

    attempts = "SELECT count(*) FROM tag_attempts WHERE task_id = %s"
    support.wait_for(lambda: count(db_url, attempts, task_id) >= 3, 60,
                     "the task to fail and be retried twice")
    worker.wait_for_output("AbortedTransactionError", timeout=30)
    assert count(db_url, "SELECT count(*) FROM tags") == 0
    assert count(db_url, "SELECT count(*) FROM drain_processed WHERE task_id = %s", task_id) == 0

    with psycopg.connect(db_url) as conn:
        conn.execute("DELETE FROM tag_names")
    support.wait_for(
        lambda: count(db_url, "SELECT count(*) FROM drain_processed WHERE task_id = %s",
                      task_id) == 1, 60, "a retry to do the job")
    assert count(db_url, "SELECT count(*) FROM tags WHERE annotation_id = 7") == 1
    assert count(db_url, "SELECT count(*) FROM tag_names") == 1
    support.wait_for(lambda: support.queue_depth(queue) == 0, 30, "the queue to drain")

"""A stock Celery worker receives the same job twice and indexes it once.

What a republish after a crash looks like to a consumer: two messages with
the same task id. Both are staged (same task id, both committed), published by
a real ``drain run`` and executed by a real ``celery worker`` running
celery_app's ``search.index_annotation``, which is wrapped in
``drain.consumer.effectively_once``. Both deliveries run the task (two rows
in ``executed_jobs``), but only the first indexes (``skipped`` false); the
second is recognised through ``drain_processed`` and skipped, so
``search_index`` counts one indexing. A new job (a new task id) for the same
annotation does index again.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg

import drain
from tests import support


def runs(db_url: str, task_id: uuid.UUID) -> list[bool]:
    """``skipped`` of each executed_jobs row of ``task_id``, in execution order."""
    with psycopg.connect(db_url) as conn:
        exists = conn.execute("SELECT to_regclass('executed_jobs') IS NOT NULL").fetchone()
        if not exists or not exists[0]:
            return []
        return [
            bool(row[0])
            for row in conn.execute(
                "SELECT skipped FROM executed_jobs WHERE task_id = %s ORDER BY seq", (task_id,)
            )
        ]


def times_indexed(db_url: str, annotation_id: int) -> int | None:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT times_indexed FROM search_index WHERE annotation_id = %s", (annotation_id,)
        ).fetchone()
        return None if row is None else int(row[0])


def test_a_job_delivered_twice_is_indexed_once(
    db_url: str, queue: str, start_pipeline: Any
) -> None:
    task_id = uuid.UUID("7e0f8a52-35c4-4c2b-9d67-2f1e5a0b7c11")
    with psycopg.connect(db_url) as conn:
        for _ in range(2):
            staged = drain.stage(
                conn, "search.index_annotation", kwargs={"annotation_id": 7},
                queue=queue, task_id=task_id,
            )
            assert staged == task_id
            conn.commit()
        copies = conn.execute(
            "SELECT count(*) FROM staged_jobs WHERE task_id = %s", (task_id,)
        ).fetchone()
        assert copies == (2,)

    start_pipeline(db_url, queue)
    support.wait_for(lambda: len(runs(db_url, task_id)) >= 2, 60,
                     "the worker to run both deliveries of the job")
    assert runs(db_url, task_id) == [False, True]
    assert times_indexed(db_url, 7) == 1
    with psycopg.connect(db_url) as conn:
        claimed = conn.execute(
            "SELECT count(*) FROM drain_processed WHERE task_id = %s", (task_id,)
        ).fetchone()
        assert claimed == (1,)
    assert support.staged_count(db_url) == 0

    # Control: a new job for the same annotation is new work, and runs.
    with psycopg.connect(db_url) as conn:
        other = drain.stage(conn, "search.index_annotation", kwargs={"annotation_id": 7},
                            queue=queue)
    support.wait_for(lambda: runs(db_url, other), 60, "the worker to run the new job")
    assert runs(db_url, other) == [False]
    assert times_indexed(db_url, 7) == 2
    assert runs(db_url, task_id) == [False, True]
    assert support.queue_depth(queue) == 0

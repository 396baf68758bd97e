"""Stage -> drain -> stock Celery worker, with real processes on the real services."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg

import drain
from tests import support


def test_committed_jobs_run_and_rolled_back_jobs_never_do(
    db_url: str, queue: str, start_pipeline: Any
) -> None:
    start_pipeline(db_url, queue)
    committed: dict[str, dict[str, Any]] = {}
    with psycopg.connect(db_url) as conn:
        for i in range(5):
            conn.execute("CREATE TABLE IF NOT EXISTS annotation (id int PRIMARY KEY)")
            conn.execute("INSERT INTO annotation VALUES (%s)", (i,))
            staged_id = drain.stage(
                conn, "celery_app.record", [i, "x"], {"n": i, "name": f"job-{i}"}, queue=queue
            )
            conn.commit()
            committed[str(staged_id)] = {"args": [i, "x"], "kwargs": {"n": i, "name": f"job-{i}"}}
        rolled_back = []
        for i in range(3):
            conn.execute("INSERT INTO annotation VALUES (%s)", (100 + i,))
            rolled_back.append(str(drain.stage(conn, "celery_app.record", [-i], queue=queue)))
            conn.rollback()
        # Plain SQL staging, committed.
        row = conn.execute(
            "INSERT INTO staged_jobs (task_name, args, kwargs, queue) "
            "VALUES ('celery_app.record', '[\"sql\"]', '{\"via\": \"sql\"}', %s) "
            "RETURNING task_id::text",
            (queue,),
        ).fetchone()
        assert row is not None
        committed[row[0]] = {"args": ["sql"], "kwargs": {"via": "sql"}}
        conn.commit()
        # Staged after the rolled-back ones: published later (id order), run later (one
        # one worker thread, prefetch 1). Once it ran, a rolled-back job would have run too.
        sentinel = str(drain.stage(conn, "celery_app.record", ["sentinel"], queue=queue))
        conn.commit()

    done = support.wait_for(
        lambda: (rows := support.executed(db_url))
        and any(r["task_id"] == sentinel for r in rows)
        and rows,
        60,
        "the worker to run the sentinel job",
    )
    ran = {r["task_id"]: r for r in done}
    for task_id, job in committed.items():
        assert task_id in ran, f"committed job {task_id} never ran"
        assert ran[task_id]["args"] == job["args"]
        assert ran[task_id]["kwargs"] == job["kwargs"]
        assert ran[task_id]["task_name"] == "celery_app.record"
    assert not set(rolled_back) & set(ran), "a rolled-back job was executed"
    assert support.staged_count(db_url) == 0


def _ran(db_url: str, task_id: str) -> Callable[[], bool]:
    return lambda: any(r["task_id"] == task_id for r in support.executed(db_url))


def test_job_in_open_transaction_waits_for_commit(
    db_url: str, queue: str, start_pipeline: Any
) -> None:
    runner, _ = start_pipeline(db_url, queue)
    conn = psycopg.connect(db_url)
    try:
        task_id = str(drain.stage(conn, "celery_app.record", ["late"], queue=queue))
        # Other jobs committed meanwhile flow past it: the drain is live, not blocked.
        for i in range(3):
            with psycopg.connect(db_url) as other:
                drain.stage(other, "celery_app.record", [i], queue=queue)
        support.wait_for(lambda: len(support.executed(db_url)) >= 3, 60,
                         "the committed jobs to run")
        # Keep the transaction open through several seconds of drain cycles: each
        # committed job below wakes the drain (NOTIFY), is published and runs, while
        # the uncommitted job must stay unpublished.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            with psycopg.connect(db_url) as other:
                probe = str(drain.stage(other, "celery_app.record", ["probe"], queue=queue))
            support.wait_for(_ran(db_url, probe), 30, "a probe job to run")
        assert support.queue_depth(queue) == 0
        assert all(r["task_id"] != task_id for r in support.executed(db_url))
        conn.commit()
        support.wait_for(
            lambda: any(r["task_id"] == task_id for r in support.executed(db_url)),
            10,
            "the job to run promptly after its transaction committed",
        )
    finally:
        conn.close()
    assert "error" not in runner.output().lower()


def test_unknown_task_is_rejected_by_the_worker_not_retried_forever(
    db_url: str, queue: str, start_pipeline: Any
) -> None:
    _, worker = start_pipeline(db_url, queue)
    with psycopg.connect(db_url) as conn:
        unknown = drain.stage(conn, "no.such.task", [1], queue=queue)
        known = drain.stage(conn, "celery_app.record", [2], queue=queue)
    support.wait_for(
        lambda: any(r["task_id"] == str(known) for r in support.executed(db_url)),
        60, "the known task to run after the unknown one",
    )
    assert "no.such.task" in worker.output()
    assert str(unknown) not in {r["task_id"] for r in support.executed(db_url)}
    uuid.UUID(str(unknown))

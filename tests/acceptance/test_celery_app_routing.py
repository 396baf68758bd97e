"""``drain run --app``: a real ``celery worker`` of the app runs every job, each
from the queue the app routes it to.

The app is tests/routing_app.py (router function, glob, regex, topic
exchange, quorum and priority queues, a task with its own queue, time limits,
priority and ignore_result), with queue and exchange names of this test's own.
The drain runs as ``drain run --app tests.routing_app``, as a user runs it.
That each message is the one ``apply_async`` sends, field by field, is
tests/acceptance/test_routing_differential.py's.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg

import drain
from tests import routing_app, support


def cases(suffix: str) -> list[tuple[str, list[Any], dict[str, Any], dict[str, Any], str]]:
    """(task, args, kwargs, apply_async options, the queue it must land in)."""
    n = routing_app.names(suffix)
    return [
        ("orders.process", [1], {"vip": True}, {}, n["priority"]),   # router function
        ("orders.process", [2], {"vip": False}, {}, n["default"]),   # task_default_queue
        ("mail.send", ["a@example.com"], {}, {}, n["quorum"]),       # glob -> quorum queue
        ("report.daily", [], {"day": 3}, {}, n["reports"]),          # regex -> topic exchange
        ("video.encode", [5], {}, {}, n["video"]),                   # the task's own options
        ("orders.process", [3], {}, {"queue": n["quorum"]}, n["quorum"]),  # queue named
    ]


def _env(db_url: str, suffix: str) -> dict[str, str]:
    return support.drain_env(db_url, ROUTING_APP_SUFFIX=suffix, ROUTING_APP_DATABASE_URL=db_url)


def _stage_all(db_url: str, suffix: str) -> dict[str, int]:
    """Stage every case (and a task the app does not know): {task id: case index}."""
    staged: dict[str, int] = {}
    with psycopg.connect(db_url) as conn:
        for i, (task, args, kwargs, options, _) in enumerate(cases(suffix)):
            staged[str(drain.stage(conn, task, args, kwargs, queue=options.get("queue")))] = i
    return staged


def test_a_celery_worker_of_the_app_runs_them(db_url: str, suffix: str, spawn: Any) -> None:
    env = _env(db_url, suffix)
    queues = sorted({expected for *_, expected in cases(suffix)})
    worker = spawn([*support.celery_argv(queues[0])[:3], "-A", "tests.routing_app", "worker",
                    "-Q", ",".join(queues), "-P", "threads", "-c", "1", "--without-gossip",
                    "--without-mingle", "-l", "info", "-n", f"rt{suffix}@%h"], env, "worker")
    worker.wait_for_output("ready.", timeout=60)
    staged = _stage_all(db_url, suffix)
    spawn(support.drain_argv("run", "--app", "tests.routing_app", "--poll-interval", "0.2"),
          env, "drain")

    def ran() -> list[tuple[str, str, str, str]]:
        with psycopg.connect(db_url) as conn:
            if conn.execute("SELECT to_regclass('routing_runs')").fetchone() == (None,):
                return []
            rows = conn.execute("SELECT * FROM routing_runs").fetchall()
        return rows if len(rows) >= len(staged) else []

    runs = support.wait_for(ran, 60, "the worker to run every job")
    assert sorted(r[0] for r in runs) == sorted(staged), json.dumps(runs)
    for task_id, task_name, exchange, routing_key in runs:
        task, _, kwargs, _, expected = cases(suffix)[staged[task_id]]
        assert task_name == task
        if task == "report.daily":
            assert (exchange, routing_key) == (routing_app.names(suffix)["topic"],
                                               "report.daily.eu")
        else:
            assert (exchange, routing_key) == ("", expected), (task, kwargs)

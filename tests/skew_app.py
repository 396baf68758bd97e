"""An application staging jobs with whichever drain it is run with (a script).

Run by tests/acceptance/test_version_skew.py and test_rolling_deploy.py with the
interpreter of a release's venv (tests/previous.py) or of the checkout, never
from the repository's root: ``import drain`` then finds that release's package.
It imports nothing of the tests.

``once URL QUEUE MARKER [--span]``
    In one transaction of the application's own (a row of its ``orders``
    table beside its jobs), stage ``celery_app.record`` jobs each way an
    application can: ``drain.stage()``, ``drain.stage_many()``, a Celery
    task's ``.stage()`` and ``.stage_with(link=...)`` (a callback: the embed
    column), and the two plain-SQL recipes of docs/staging.md (``INSERT INTO
    staged_jobs``, ``drain_stage()``); commit. With ``--span``, inside an
    OpenTelemetry span (where the release captures it). Prints one JSON object:
    the release's version, whether the order committed, and each job's task id,
    args and kwargs.
``load URL QUEUE MARKER RATE STOP_FILE`` [--span]
    Stage one job per transaction, RATE a second, until STOP_FILE exists (or 300
    s have gone by); print each committed job's task id on a line of its own.
    A failed transaction is printed as ``failed: <error>`` and staging goes on.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery

import drain
from drain.celery_task import StagingTask

#: How long ``load`` stages at most, whatever happens to its stop file.
LOAD_LIMIT = 300.0

app = Celery("skew_app", set_as_current=False)

#: docs/staging.md's two plain-SQL recipes, by the name each job's kwargs carry: each
#: takes args, kwargs and queue, and returns the task id.
SQL_RECIPES = {
    "sql": "INSERT INTO staged_jobs (task_name, args, kwargs, queue) "
           "VALUES ('celery_app.record', %s, %s, %s) RETURNING task_id",
    "drain_stage": "SELECT drain_stage('celery_app.record', args => %s::jsonb, "
                   "kwargs => %s::jsonb, queue => %s)",
}


@app.task(base=StagingTask, name="celery_app.record")
def record(*args: Any, **kwargs: Any) -> None:
    """Never runs here: celery_app's worker runs it."""


@contextlib.contextmanager
def span(wanted: bool) -> Iterator[None]:
    """An OpenTelemetry span around the block, where asked and installed."""
    if not wanted:
        yield
        return
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    trace.set_tracer_provider(TracerProvider())
    with trace.get_tracer("skew_app").start_as_current_span("request"):
        yield


def once(url: str, queue: str, marker: str) -> dict[str, Any]:
    jobs: dict[str, dict[str, Any]] = {}

    def note(task_id: object, args: list[Any], kwargs: dict[str, Any]) -> None:
        jobs[str(task_id)] = {"args": args, "kwargs": kwargs}

    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS orders (marker text PRIMARY KEY)")
        conn.commit()
        conn.execute("INSERT INTO orders VALUES (%s)", [marker])
        note(drain.stage(conn, "celery_app.record", [marker, "stage"], {"way": "stage"},
                         queue=queue), [marker, "stage"], {"way": "stage"})
        many = drain.stage_many(conn, [
            drain.Job("celery_app.record", [marker, "many", i], {"way": "many"}, queue=queue)
            for i in range(2)])
        for i, task_id in enumerate(many):
            note(task_id, [marker, "many", i], {"way": "many"})
        note(record.stage_with(conn, [marker, "task"], {"way": "task"}, queue=queue),
             [marker, "task"], {"way": "task"})
        note(record.stage_with(conn, [marker, "linked"], {"way": "linked"}, queue=queue,
                               link=record.s(marker, "callback").set(queue=queue)),
             [marker, "linked"], {"way": "linked"})
        for way, recipe in SQL_RECIPES.items():
            args, kwargs = [marker, way], {"way": way}
            row = conn.execute(recipe, [json.dumps(args), json.dumps(kwargs), queue]).fetchone()
            assert row is not None
            note(row[0], args, kwargs)
        conn.commit()
        ordered = conn.execute("SELECT count(*) FROM orders WHERE marker = %s",
                               [marker]).fetchone()
    return {"version": drain.__version__, "order_committed": bool(ordered and ordered[0]),
            "jobs": jobs}


def load(url: str, queue: str, marker: str, rate: float, stop: Path) -> None:
    interval = 1.0 / rate
    started = time.monotonic()
    n = 0
    with psycopg.connect(url) as conn:
        while not stop.exists() and time.monotonic() - started < LOAD_LIMIT:
            try:
                task_id = drain.stage(conn, "celery_app.record", [marker, n], {"n": n},
                                      queue=queue)
                conn.commit()
            except psycopg.Error as exc:
                conn.rollback()
                print(f"failed: {type(exc).__name__}: {exc}".splitlines()[0], flush=True)
            else:
                print(task_id, flush=True)
            n += 1
            time.sleep(max(0.0, started + n * interval - time.monotonic()))


def main(argv: list[str]) -> None:
    wanted = "--span" in argv
    argv = [a for a in argv if a != "--span"]
    with span(wanted):
        if argv[0] == "once":
            print(json.dumps(once(argv[1], argv[2], argv[3])), flush=True)
        else:
            load(argv[1], argv[2], argv[3], float(argv[4]), Path(argv[5]))


if __name__ == "__main__":
    main(sys.argv[1:])

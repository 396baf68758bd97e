"""drain in one minute: ``make demo`` (``python -m celery_app.demo``).

On the local Postgres and RabbitMQ, the demo says first what it creates and
leaves behind (:func:`celery_app.demo_setup.first_screen`), then

1. recreates a database ``drain_demo`` and runs ``drain migrate`` on it;
2. starts an ordinary Celery worker (this package's app, which knows nothing
   about drain) on the queue ``drain_demo``, and ``drain run --app
   celery_app``, serving its status page on a free port: the drain routes
   each job as that app's ``apply_async`` would, here by its ``task_routes``
   (``search.*`` to ``drain_demo``);
3. stages jobs the way an application does, in the same transaction as the
   data they are about: with :func:`drain.stage` and with a plain SQL INSERT
   (neither names a queue: the app's routes decide), in a transaction that
   rolls back, and one job with an explicit queue;
4. waits until the worker ran every committed job, checks that no rolled-back
   job ran, and prints what happened;
5. stops both processes and deletes the queue and its exchange. The database
   stays, to look at.

It exits 0 when every check passed, 1 when one failed, 2 when a setting is
malformed or names a database or queue that is not the demo's to delete. The
names, the port and the servers come from ``DRAIN_DEMO_*`` variables only
(:mod:`celery_app.demo_setup`); ``make demo`` runs it in a venv of its own with
drain's runtime dependencies only (``.venv-demo``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg

import drain
from celery_app.demo_setup import (
    ROOT,
    DemoFailed,
    DemoRefused,
    Settings,
    broker,
    delete_queue,
    first_screen,
    recreate_database,
    refuse_unless_ours,
    reset_queue,
)
from drain.settings import config

#: Seconds for the worker and the drain to start, then for the jobs to run.
START_TIMEOUT = 30.0
RUN_TIMEOUT = 45.0

ANNOTATIONS = {
    1: "Staged jobs become visible when the transaction commits.",
    2: "A rolled-back transaction takes its jobs with it.",
    3: "Rows are deleted only after the broker confirmed them.",
}


@dataclasses.dataclass
class StagedJob:
    task_id: uuid.UUID
    task_name: str
    arguments: str  # args or kwargs as JSON, for the report
    how: str
    committed_at: dt.datetime | None  # None: the transaction rolled back


@dataclasses.dataclass
class ExecutedJob:
    task_id: uuid.UUID
    task_name: str
    arguments: str
    executed_at: dt.datetime


class Child:
    """A subprocess whose output goes to a log file, shown only if the demo fails."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logs: Path) -> None:
        self.name = name
        self.log_path = logs / f"{name.replace(' ', '-')}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                argv, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise DemoFailed(f"{self.name} exited early with status {self.proc.returncode}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def wait(self) -> int:
        """Wait for the exit that :meth:`terminate` asked for; kill after 10 s."""
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace").rstrip().splitlines()
        return "\n".join(f"    {line}" for line in text[-lines:]) or "    (no output)"


def wait_until(condition: Callable[[], bool], timeout: float, what: str,
               children: Sequence[Child]) -> None:
    """Poll ``condition``; fail when ``timeout`` passes or a child process died."""
    deadline = time.monotonic() + timeout
    while not condition():
        for child in children:
            child.check_alive()
        if time.monotonic() > deadline:
            raise DemoFailed(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def worker_consuming(settings: Settings) -> bool:
    connection = broker(settings)
    try:
        declared = connection.channel().queue_declare(settings.queue, passive=True)
        return int(declared.method.consumer_count) > 0
    finally:
        connection.close()


def drain_active(conn: psycopg.Connection[Any]) -> bool:
    """Does a session hold the drain's advisory lock in this database?"""
    key = config.DEFAULT_LOCK_KEY  # pg_locks shows a bigint key as two 32-bit halves
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND classid = %s::oid AND objid = %s::oid AND objsubid = 1",
        ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF),
    ).fetchone()
    return bool(row and row[0])


# -- what an application does ------------------------------------------------------------


def stage_jobs(conn: psycopg.Connection[Any], queue: str) -> list[StagedJob]:
    """Stage jobs in the same transactions as the rows they are about."""
    jobs: list[StagedJob] = []

    def now() -> dt.datetime:
        return dt.datetime.now(dt.timezone.utc)

    # 1. The usual way: insert the row, stage its job, commit both at once. No queue:
    #    the drain routes it as the app's apply_async would (task_routes).
    for annotation_id, text in ANNOTATIONS.items():
        with conn.transaction():
            conn.execute("INSERT INTO annotation (id, text) VALUES (%s, %s)",
                         (annotation_id, text))
            task_id = drain.stage(conn, "search.index_annotation",
                                  kwargs={"annotation_id": annotation_id})
        jobs.append(StagedJob(task_id, "search.index_annotation",
                              json.dumps({"annotation_id": annotation_id}), "drain.stage", now()))

    # 2. Plain SQL works just as well (psql, other languages, triggers); the
    #    task id defaults to a fresh UUID.
    with conn.transaction():
        conn.execute("INSERT INTO annotation (id, text) VALUES (4, 'Staged with plain SQL.')")
        row = conn.execute(
            "INSERT INTO staged_jobs (task_name, kwargs) "
            "VALUES ('search.index_annotation', %s) RETURNING task_id",
            (json.dumps({"annotation_id": 4}),),
        ).fetchone()
    assert row is not None
    jobs.append(StagedJob(row[0], "search.index_annotation", json.dumps({"annotation_id": 4}),
                          "INSERT INTO staged_jobs", now()))

    # 3. A transaction that fails after staging: its rows and its jobs vanish together.
    with conn.transaction():
        for annotation_id in (101, 102):
            conn.execute("INSERT INTO annotation (id, text) VALUES (%s, 'never committed')",
                         (annotation_id,))
            task_id = drain.stage(conn, "search.index_annotation",
                                  kwargs={"annotation_id": annotation_id})
            jobs.append(StagedJob(task_id, "search.index_annotation",
                                  json.dumps({"annotation_id": annotation_id}), "drain.stage",
                                  None))
        raise psycopg.Rollback  # as if the request failed after staging

    # 4. A sentinel, committed after the rollback. Jobs are published in the order
    #    they were staged, so once the sentinel ran, a rolled-back job would have too.
    #    Its queue is explicit (apply_async(queue=...)): the app has no route for it.
    with conn.transaction():
        task_id = drain.stage(conn, "celery_app.record", ["sentinel"], queue=queue)
    jobs.append(StagedJob(task_id, "celery_app.record", json.dumps(["sentinel"]),
                          "drain.stage", now()))
    return jobs


# -- what the worker did ------------------------------------------------------------------


def executed_jobs(conn: psycopg.Connection[Any]) -> list[ExecutedJob]:
    """Rows of ``executed_jobs``, which celery_app's tasks create on first use."""
    exists = conn.execute("SELECT to_regclass('executed_jobs') IS NOT NULL").fetchone()
    if not exists or not exists[0]:
        return []
    rows = conn.execute(
        "SELECT task_id, task_name, args, kwargs, executed_at FROM executed_jobs ORDER BY seq"
    ).fetchall()
    return [
        ExecutedJob(task_id, name, json.dumps(kwargs or args), executed_at)
        for task_id, name, args, kwargs, executed_at in rows
    ]


def staged_count(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    return int(row[0]) if row else 0


def check(jobs: list[StagedJob], executed: list[ExecutedJob]) -> str:
    """Raise :class:`DemoFailed` unless exactly the committed jobs ran; return a summary."""
    ran = [e.task_id for e in executed]
    committed = [j for j in jobs if j.committed_at is not None]
    rolled_back = [j for j in jobs if j.committed_at is None]
    leaked = [j for j in rolled_back if j.task_id in ran]
    if leaked:
        raise DemoFailed(f"rolled-back job(s) ran: {[str(j.task_id) for j in leaked]}")
    missing = [j for j in committed if j.task_id not in ran]
    if missing:
        raise DemoFailed(f"committed job(s) never ran: {[str(j.task_id) for j in missing]}")
    strangers = {e.task_id for e in executed} - {j.task_id for j in jobs}
    if strangers:
        raise DemoFailed(f"the worker ran job(s) nobody staged: {sorted(map(str, strangers))}")
    repeats = len(ran) - len(set(ran))
    return (
        f"{len(committed)} of {len(committed)} committed jobs ran"
        + (f" ({repeats} more than once: at-least-once, same task id)" if repeats else
           ", each once")
        + f"; 0 of {len(rolled_back)} rolled-back jobs ran; staged_jobs is empty."
    )


# -- the report ---------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [list(map(str, headers)), *[list(map(str, row)) for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        padded = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print(("  " + "  ".join(padded)).rstrip())


def section(title: str) -> None:
    print(f"\n== {title}")


def report_staged(jobs: list[StagedJob]) -> None:
    section("Staged (in the application's transactions)")
    table(
        ["transaction", "how", "task", "arguments", "task id"],
        [
            ["committed" if j.committed_at else "ROLLED BACK", j.how, j.task_name, j.arguments,
             j.task_id]
            for j in jobs
        ],
    )


def report_executed(jobs: list[StagedJob], executed: list[ExecutedJob]) -> None:
    section("Executed by the Celery worker (table executed_jobs, in order)")
    committed_at = {j.task_id: j.committed_at for j in jobs if j.committed_at}
    rows = []
    for e in executed:
        start = committed_at.get(e.task_id)
        latency = f"{(e.executed_at - start).total_seconds() * 1000:.0f} ms" if start else "?"
        rows.append([e.task_name, e.arguments, e.task_id, latency])
    table(["task", "arguments", "task id", "commit to run"], rows)


def report_search_index(conn: psycopg.Connection[Any]) -> None:
    section("search_index (what search.index_annotation wrote)")
    rows = conn.execute(
        "SELECT s.annotation_id, s.times_indexed, a.text FROM search_index s "
        "LEFT JOIN annotation a ON a.id = s.annotation_id ORDER BY s.annotation_id"
    ).fetchall()
    table(["annotation", "times indexed", "annotation text"], rows)


# -- the demo ---------------------------------------------------------------------------


def run_demo(settings: Settings, logs: Path, children: list[Child]) -> str:
    refuse_unless_ours(settings)
    recreate_database(settings)
    reset_queue(settings)
    print(f"\n  recreated database {settings.database}, applied `drain migrate`, "
          f"emptied queue {settings.queue}")

    env = settings.child_env()
    # No --without-heartbeat: the event heartbeat's 2 s timer is what wakes the
    # worker's idle loop; without it the worker notices SIGTERM only ~10 s later.
    children.append(Child("celery worker", [
        sys.executable, "-m", "celery", "-A", "celery_app", "worker", "-Q", settings.queue,
        "-P", "threads", "-c", "1", "--without-gossip", "--without-mingle", "-l", "warning",
    ], env, logs))
    children.append(Child("drain run", [sys.executable, "-m", "drain", "run",
                                        "--app", "celery_app"], env, logs))
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        wait_until(lambda: worker_consuming(settings), START_TIMEOUT, "the worker to consume",
                   children)
        wait_until(lambda: drain_active(conn), START_TIMEOUT, "the drain to take its lock",
                   children)
        for child in children:
            print(f"  started   {child.name} (pid {child.proc.pid})")
        if settings.metrics_port:
            print(f"  serving   the drain's status page on http://127.0.0.1:{settings.metrics_port}/")

        jobs = stage_jobs(conn, settings.queue)
        report_staged(jobs)

        expected = {j.task_id for j in jobs if j.committed_at}
        executed: list[ExecutedJob] = []

        def all_ran() -> bool:
            executed[:] = executed_jobs(conn)
            return expected <= {e.task_id for e in executed} and staged_count(conn) == 0

        try:
            wait_until(all_ran, RUN_TIMEOUT, "the worker to run every committed job", children)
        except DemoFailed as exc:
            ran = len(expected & {e.task_id for e in executed})
            raise DemoFailed(f"{exc}: {ran} of {len(expected)} ran, "
                             f"{staged_count(conn)} row(s) still in staged_jobs") from None
        report_executed(jobs, executed)
        report_search_index(conn)
        return check(jobs, executed)


def stop(children: list[Child]) -> None:
    for child in children:
        child.terminate()
    stopped = [f"{child.name} (exit {child.wait()})" for child in children]
    if stopped:
        print(f"\n  stopped   {', '.join(stopped)}")


def main() -> int:
    try:
        settings = Settings.from_env(os.environ)
    except DemoRefused as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    print("\n".join(first_screen(settings)), flush=True)
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="drain-demo-") as logs:
        try:
            summary = run_demo(settings, Path(logs), children)
        except (DemoFailed, KeyboardInterrupt) as exc:
            sys.stdout.flush()
            reason = str(exc) if isinstance(exc, DemoFailed) else "interrupted"
            print(f"\ndemo FAILED: {reason}", file=sys.stderr)
            for child in children:
                print(f"  last lines of {child.name}:\n{child.log_tail()}", file=sys.stderr)
            return 2 if isinstance(exc, DemoRefused) else 1
        finally:
            stop(children)
            if children:  # they start once the queue was declared: the broker answered
                try:
                    delete_queue(settings)
                    print(f"  deleted   queue {settings.queue} and its exchange; database "
                          f"{settings.database} is left to look at")
                except DemoFailed as exc:
                    print(f"  could not delete queue {settings.queue}: {exc}", file=sys.stderr)
    print(f"\nOK: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

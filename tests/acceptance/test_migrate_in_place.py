"""`drain migrate` upgrades a live database in place: "no queue given" becomes NULL
(staged_jobs.queue_legacy marks the rows staged before), and staged_jobs gets its
embed column (callbacks, chains).

A database from before (``staged_jobs.queue NOT NULL DEFAULT 'celery'``) is
written to by pgbench (4 clients, a job per transaction, no queue given);
`drain migrate` runs in the middle of it, then ``drain run --app
tests.routing_app`` drains it (a drain of this version refuses the older
schema: "run `drain migrate`"). Every job, staged before the upgrade ('celery',
the old default) or after it (NULL), must reach the queue the app routes it
to, once: nothing lost, nothing duplicated, nothing re-routed (to a queue
called celery).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg

import drain
from tests import routing_app, support

RATE = 300  # jobs per second, in all
SECONDS = 12


def test_migrate_under_load_keeps_every_staged_job_and_its_route(
    db_url: str, suffix: str, spawn: Any, tmp_path: Path
) -> None:
    support.as_an_older_schema(db_url)
    env = support.drain_env(db_url, ROUTING_APP_SUFFIX=suffix)
    refused = support.run_cli(db_url, "run", "--app", "tests.routing_app", "--exit-when-empty",
                              env=env)
    assert refused.returncode == 4, refused.stderr
    assert ("(no column queue_legacy or trace in staged_jobs and dead_jobs, or no table "
            "drain_pauses): run `drain migrate`") \
        in refused.stderr
    script = tmp_path / "stage.sql"
    # No queue given: task_default_queue routes orders.process without vip.
    script.write_text("INSERT INTO staged_jobs (task_name, kwargs) "
                      "VALUES ('orders.process', '{\"vip\": false}');\n")
    writers = subprocess.Popen(
        [support.pgbench(), "-n", "-c", "4", "-j", "2", "-R", str(RATE), "-T", str(SECONDS),
         "-f", str(script), db_url],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
    )
    default = routing_app.names(suffix)["default"]
    try:
        support.wait_for(lambda: support.staged_count(db_url) >= 200 or writers.poll() is not None,
                         30, "jobs staged before the upgrade")
        started = time.monotonic()
        migrated = support.run_cli(db_url, "migrate", env=env)
        took = time.monotonic() - started
        assert migrated.returncode == 0, migrated.stderr
        with psycopg.connect(db_url) as conn:
            # Nothing drained them yet: every job staged before the upgrade is still
            # there, marked as staged without a queue.
            marked = conn.execute(
                "SELECT count(*) FROM staged_jobs WHERE queue_legacy").fetchone()
        spawn(support.drain_argv("run", "--app", "tests.routing_app", "--poll-interval", "0.2"),
              env, "drain")
        # The upgrade also added the embed column: a job staged with a callback now
        # is sent with it.
        app = routing_app.create(suffix)
        with psycopg.connect(db_url) as conn:
            linked = drain.stage(conn, app.tasks["orders.process"].s(vip=False).set(
                link=app.tasks["mail.send"].s()))
        app.close()
        out, _ = writers.communicate(timeout=SECONDS + 60)
    finally:
        if writers.poll() is None:
            writers.kill()
            writers.wait(10)
    assert writers.returncode == 0, out
    match = re.search(r"number of transactions actually processed: (\d+)", out)
    assert match, out
    jobs = int(match.group(1))
    latency = re.search(r"latency average = ([0-9.]+) ms", out)

    with psycopg.connect(db_url) as conn:
        mark = conn.execute("SELECT value FROM drain_schema_state "
                            "WHERE key = 'queue_given_from_id'").fetchone()
        nullable = conn.execute("SELECT NOT attnotnull FROM pg_attribute WHERE attrelid = "
                                "'staged_jobs'::regclass AND attname = 'queue'").fetchone()
    assert nullable == (True,)
    assert mark is not None
    before = mark[0] - 1  # ids 1..before were staged before the upgrade ('celery')
    assert 0 < before < jobs, (before, jobs)
    assert marked == (before,)

    support.wait_for(lambda: support.staged_count(db_url) == 0, 60, "the backlog to drain")
    messages = support.drain_queue(default)
    ids = support.task_ids(messages)
    print(f"{jobs} jobs ({before} before the upgrade), migrate took {took:.2f}s, writers' "
          f"latency average {latency.group(1) if latency else '?'} ms")
    assert len(ids) == jobs + 1, f"{len(ids)} messages for {jobs} jobs and the linked one"
    assert len(set(ids)) == jobs + 1, "a job was published twice"
    [body] = [json.loads(body) for _, props, body in messages
              if props.headers["id"] == str(linked)]
    assert [c["task"] for c in body[2]["callbacks"]] == ["mail.send"]
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM dead_jobs").fetchone() == (0,)

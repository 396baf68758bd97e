"""``drain run --app`` of apps that do not send plain JSON: a real ``celery worker``
of the same app runs every job (tests/encoding_app.py).

* A pickle-only app (``task_serializer='pickle'``, ``accept_content=['pickle']``):
  its workers refuse JSON ("Refusing to deserialize untrusted content") and drop
  the message after the drain deleted the row, so every job was lost.
* A gzip app (``task_compression='gzip'``): a compressible 17 MB argument, which
  ``apply_async`` sends as a few KB, was dead-lettered ``too_large``
  (``--max-message-size``, 16 MiB by default, measured the uncompressed body).

Both get args of the types kombu's JSON carries (datetime, UUID, Decimal, date,
time, bytes), staged through ``drain.stage`` and by SQL as kombu's JSON writes
them (its ``__type__`` markers), and the worker must get those types back, as
after ``delay``. An app whose
workers would refuse what drain sends makes ``drain run --app`` exit 2 with one
line, before anything is published.
"""

from __future__ import annotations

import datetime as dt
import decimal
import uuid
from typing import Any

import psycopg
import pytest
from celery import Celery
from kombu.utils.json import dumps as kombu_dumps

import drain
from tests import encoding_app, roles, support

TYPED_ARGS = [dt.datetime(2026, 11, 27, 3, 4, 5, tzinfo=dt.timezone.utc),
              uuid.UUID("12345678-1234-5678-1234-567812345678"), decimal.Decimal("12.50"),
              dt.date(2026, 1, 2), b"\x00\xff"]
TYPED_KWARGS = {"at": dt.time(4, 5, 6)}
#: What the worker's task must see of them (``repr`` of its ``*args`` / ``**kwargs``).
TYPED_REPR = repr(tuple(TYPED_ARGS))
TYPED_KWARGS_REPR = repr(TYPED_KWARGS)
#: Compresses to ~17 KB with gzip; over the default --max-message-size uncompressed.
LARGE = "x" * 17_000_000


def _stage(db_url: str, queue: str, n_plain: int, large: bool, app: Celery) -> list[str]:
    """Stage ``n_plain`` plain jobs with drain.stage, one with the typed args by SQL
    (kombu's markers), a chain of two steps, the typed args through drain.stage, and
    the 17 MB one: their task ids."""
    ids: list[str] = []
    record = app.tasks["enc.record"]
    with psycopg.connect(roles.url(db_url, roles.STAGER)) as conn:
        for i in range(n_plain):
            ids.append(str(drain.stage(conn, "enc.record", [i, f"é{i}"], {"k": i}, queue=queue)))
        row = conn.execute(
            "INSERT INTO staged_jobs (task_name, args, kwargs, queue) VALUES "
            "('enc.record', %s::jsonb, %s::jsonb, %s) RETURNING task_id",
            (kombu_dumps(TYPED_ARGS), kombu_dumps(TYPED_KWARGS), queue)).fetchone()
        assert row is not None
        ids.append(str(row[0]))
        # the embed (the chain's next step) is serialized with the app's serializer too
        ids.append(str(drain.stage(conn, record.s("c1").set(queue=queue)
                                   | record.s("c2").set(queue=queue))))
        ids.append(str(drain.stage(conn, "enc.record", TYPED_ARGS, TYPED_KWARGS, queue=queue)))
        if large:
            ids.append(str(drain.stage(conn, "enc.record", [LARGE], queue=queue)))
    return ids


def _runs(db_url: str, expected: int) -> dict[str, tuple[str, str, int]]:
    with psycopg.connect(db_url) as conn:
        if conn.execute("SELECT to_regclass('encoding_runs')").fetchone() == (None,):
            return {}
        rows = conn.execute("SELECT task_id, args, kwargs, args_size FROM encoding_runs").fetchall()
    return {r[0]: (r[1], r[2], r[3]) for r in rows} if len(rows) >= expected else {}


def _dead(db_url: str) -> list[tuple[str, str]]:
    with psycopg.connect(db_url) as conn:
        return conn.execute("SELECT reason, detail FROM dead_jobs").fetchall()


@pytest.mark.parametrize("name", ["pickle_app", "gzip_app"])
def test_a_worker_of_the_app_runs_every_job_with_its_types(
    db_url: str, queue: str, spawn: Any, name: str
) -> None:
    spec = f"tests.encoding_app:{name}"
    # C_FORCE_ROOT: Celery refuses to run a pickle-accepting worker as root (the tests do).
    env = support.drain_env(db_url, ENCODING_APP_DATABASE_URL=db_url, C_FORCE_ROOT="1")
    worker = spawn([*support.celery_argv(queue)[:3], "-A", spec, "worker", "-Q", queue,
                    "-P", "threads", "-c", "1", "--without-gossip", "--without-mingle",
                    "-l", "info", "-n", f"{queue}@%h"], env, "worker")
    worker.wait_for_output("ready.", timeout=60)
    large = name == "gzip_app"
    ids = _stage(db_url, queue, 20, large, getattr(encoding_app, name))
    spawn(support.drain_argv("run", "--app", spec, "--poll-interval", "0.2"), env, "drain")
    try:
        runs = support.wait_for(lambda: _runs(db_url, len(ids) + 1), 60,
                                f"the worker of {name} to run all {len(ids) + 1} jobs")
    except AssertionError as exc:
        ran = len(_runs(db_url, 0))
        raise AssertionError(f"{exc}: {ran} ran, {support.staged_count(db_url)} still staged, "
                             f"dead: {[reason for reason, _ in _dead(db_url)]}") from None
    assert set(ids) <= set(runs) and len(runs) == len(ids) + 1
    for typed in (runs[ids[20]], runs[ids[22]]):  # by SQL, by drain.stage
        assert typed[:2] == (TYPED_REPR, TYPED_KWARGS_REPR), typed
    assert runs[ids[0]][:2] == ("(0, 'é0')", "{'k': 0}")
    assert runs[ids[21]][0] == "('c1',)"
    assert "(None, 'c2')" in [args for args, _, _ in runs.values()]  # the chain's next step
    if large:
        assert runs[ids[23]][2] == len(repr((LARGE,)))
    assert _dead(db_url) == []
    assert "Refusing to deserialize" not in worker.output()


def test_an_app_whose_workers_would_refuse_the_jobs_is_refused_at_start(db_url: str) -> None:
    """task_serializer='pickle' with Celery's default accept_content=['json']: its
    workers would drop every job; drain refuses to start, exit 2, one line."""
    with psycopg.connect(roles.url(db_url, roles.STAGER)) as conn:
        drain.stage(conn, "enc.record", [1])
    done = support.run_cli(db_url, "run", "--app", "tests.encoding_app:unaccepted_app",
                           "--exit-when-empty")
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if "accept_content" in line]
    assert len(lines) == 1 and "Refusing to deserialize untrusted content" in lines[0], (
        done.stderr)
    assert support.staged_count(db_url) == 1  # nothing published, nothing lost

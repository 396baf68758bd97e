"""What the benchmarks share: fresh databases, queues, staged backlogs, result files.

Every bench runs against the local Postgres (``DRAIN_BENCH_ADMIN_URL``) and
RabbitMQ (``DRAIN_BROKER_URL``), each in a database and queues of its own,
dropped afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import psycopg

import drain
from drain.postgres import store
from drain.settings.urls import broker_parameters

ADMIN_URL = os.environ.get("DRAIN_BENCH_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
BROKER_URL = os.environ.get("DRAIN_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent


def fresh_database(name: str) -> str:
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    url = ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(url) as conn:
        store.migrate(conn)
    return url


def drop_database(name: str) -> None:
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def broker_channel() -> Iterator[Any]:
    """A channel on a connection of its own, closed afterwards."""
    conn = pika.BlockingConnection(broker_parameters(BROKER_URL))
    try:
        yield conn.channel()
    finally:
        conn.close()


def delete_queue(queue: str) -> None:
    with broker_channel() as channel:
        channel.queue_delete(queue)


def declare_queue(queue: str) -> None:
    with broker_channel() as channel:
        channel.queue_declare(queue, durable=True)


def declare_routed(queue: str) -> None:
    """``queue`` behind a durable direct exchange of the same name, bound by its
    name: what a Celery app declares for a queue named in ``task_routes``."""
    with broker_channel() as channel:
        channel.exchange_declare(queue, "direct", durable=True)
        channel.queue_declare(queue, durable=True)
        channel.queue_bind(queue, queue, routing_key=queue)


def delete_routed(queue: str) -> None:
    with broker_channel() as channel:
        channel.queue_delete(queue)
        channel.exchange_delete(queue)


def stage(url: str, n: int, queue: str | None, *, vacuum: bool = False) -> None:
    """``n`` jobs for ``queue`` (None: no queue given, for the app to route);
    ``vacuum``: then VACUUM the table, so that a round does not inherit the dead
    rows of the one before it (each round starts from the same table)."""
    with psycopg.connect(url) as conn:
        drain.stage_many(
            conn,
            (
                drain.Job("bench.index_annotation", [i], {"user": f"user{i % 97}"}, queue=queue)
                for i in range(n)
            ),
        )
    if vacuum:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM (ANALYZE) staged_jobs")


def staged_count(url: str) -> int:
    """Rows in staged_jobs (the benches that wait for a drain to empty it)."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    return int(row[0]) if row else 0


def queue_depth(queue: str) -> int:
    with broker_channel() as channel:
        return int(channel.queue_declare(queue, passive=True).method.message_count)


def write_results(data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{data['name']}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path

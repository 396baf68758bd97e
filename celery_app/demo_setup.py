"""What ``make demo`` creates and removes: its settings, its database, its queue.

The demo reads only ``DRAIN_DEMO_*`` settings. Every other ``DRAIN_*`` (and
``CELERY_APP_*``) variable of the shell is withheld from the processes it starts
and named on its first screen: a shell set up for a real drain
(``DRAIN_DATABASE_URL``, ``DRAIN_BROKER_URL``, ``DRAIN_LOCK_KEY``...) can neither
aim the demo at that drain's database and broker nor change what the demo checks.

* ``DRAIN_DEMO_ADMIN_URL``: a Postgres URL allowed to create databases (default
  ``postgresql://postgres@127.0.0.1:5432/postgres``).
* ``DRAIN_DEMO_DATABASE``: the database the demo drops and creates again
  (default ``drain_demo``). It drops only a database the demo created (it marks
  it with a comment) or one named ``drain_demo``; any other is refused.
* ``DRAIN_DEMO_BROKER_URL``: RabbitMQ (default ``amqp://guest:guest@127.0.0.1:5672//``).
* ``DRAIN_DEMO_QUEUE``: the queue of the demo's worker (default ``drain_demo``),
  emptied first and deleted at the end with its exchange. Another name holding
  messages is refused.
* ``DRAIN_DEMO_METRICS_PORT``: where the demo's drain serves its status page and
  metrics; by default a free port, printed; 0 for none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pika
import psycopg
from psycopg import conninfo, sql

from drain.settings import config, urls

#: Every variable the demo reads (the docs may name these and no other DRAIN_DEMO_*).
SETTINGS = ("DRAIN_DEMO_ADMIN_URL", "DRAIN_DEMO_DATABASE", "DRAIN_DEMO_BROKER_URL",
            "DRAIN_DEMO_QUEUE", "DRAIN_DEMO_METRICS_PORT")
DEFAULT_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_DATABASE = "drain_demo"
DEFAULT_QUEUE = "drain_demo"
#: The comment on a database the demo created: the demo drops only such a one.
MARK = "created by drain's demo (python -m celery_app.demo), which drops it on its next run"
ROOT = Path(__file__).resolve().parent.parent


class DemoFailed(Exception):
    """A check failed, or something the demo needs is missing."""


class DemoRefused(DemoFailed):
    """A setting is malformed, or names something that is not the demo's to delete."""


@dataclasses.dataclass(frozen=True)
class Settings:
    admin_url: str
    broker_url: str
    database: str
    queue: str
    metrics_port: int  # 0: no HTTP server
    ignored: tuple[str, ...]  # the shell's DRAIN_* and CELERY_APP_* variables

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        database = environ.get("DRAIN_DEMO_DATABASE", DEFAULT_DATABASE)
        queue = environ.get("DRAIN_DEMO_QUEUE", DEFAULT_QUEUE)
        for name, value in (("DRAIN_DEMO_DATABASE", database), ("DRAIN_DEMO_QUEUE", queue)):
            if not value.strip():
                raise DemoRefused(f"{name} is empty")
        return cls(
            admin_url=environ.get("DRAIN_DEMO_ADMIN_URL", DEFAULT_ADMIN_URL),
            broker_url=environ.get("DRAIN_DEMO_BROKER_URL", config.DEFAULT_BROKER_URL),
            database=database,
            queue=queue,
            metrics_port=_port(environ.get("DRAIN_DEMO_METRICS_PORT")),
            ignored=tuple(sorted(
                name for name in environ
                if name.startswith(("DRAIN_", "CELERY_APP_")) and not name.startswith("DRAIN_DEMO_")
            )),
        )

    @property
    def database_url(self) -> str:
        return conninfo.make_conninfo(self.admin_url, dbname=self.database)

    def child_env(self) -> dict[str, str]:
        """This environment without DRAIN_* and CELERY_APP_*, plus the demo's settings."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DRAIN_", "CELERY_APP_"))}
        env.update(
            DRAIN_DATABASE_URL=self.database_url,
            DRAIN_BROKER_URL=self.broker_url,
            DRAIN_METRICS_PORT=str(self.metrics_port),
            CELERY_APP_DATABASE_URL=self.database_url,
            # The app routes search.* here (celery_app/app.py's task_routes).
            CELERY_APP_SEARCH_QUEUE=self.queue,
            PYTHONUNBUFFERED="1",
        )
        return env


def _port(value: str | None) -> int:
    if value is None:
        with socket.socket() as s:  # a free port now; the drain binds it a moment later
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise DemoRefused(
            f"DRAIN_DEMO_METRICS_PORT must be a port number, 0 for none: got {value!r}")
    return port


def first_screen(settings: Settings) -> list[str]:
    """What the demo is about to create, and what it leaves behind."""
    page = (f"the drain's status page on http://127.0.0.1:{settings.metrics_port}/"
            if settings.metrics_port else "no status page")
    lines = [
        "drain demo: stages jobs in Postgres, drains them to RabbitMQ, runs them in Celery.",
        "",
        "It creates (DRAIN_DEMO_* settings, see celery_app/demo_setup.py):",
        f"  database   {settings.database} at {urls.mask_database_url(settings.admin_url)}",
        "             (DRAIN_DEMO_DATABASE, DRAIN_DEMO_ADMIN_URL); an earlier demo's is dropped",
        f"  queue      {settings.queue} and its exchange at {urls.mask_url(settings.broker_url)}",
        "             (DRAIN_DEMO_QUEUE, DRAIN_DEMO_BROKER_URL)",
        f"  processes  a celery worker and a drain run, {page}",
        "             (DRAIN_DEMO_METRICS_PORT)",
        f"It leaves behind the database {settings.database}, to look at (DROP DATABASE removes",
        "it). It stops both processes and deletes the queue and its exchange; Celery's shared",
        "exchanges celeryev and celery.pidbox stay, as after any worker.",
    ]
    if settings.ignored:
        lines.append(f"Not passed to its processes: {', '.join(settings.ignored)} (the demo "
                     "reads only DRAIN_DEMO_* settings).")
    return lines


def refuse_unless_ours(settings: Settings) -> None:
    """Raise :class:`DemoRefused`, before anything changed, when the database or the queue
    the settings name is not the demo's to drop or empty."""
    with _admin(settings) as admin:
        row = admin.execute(
            "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = %s",
            (settings.database,),
        ).fetchone()
    if row is not None and row[0] != MARK and settings.database != DEFAULT_DATABASE:
        raise DemoRefused(
            f"database {settings.database} exists and was not created by the demo: it would "
            "drop it. Set DRAIN_DEMO_DATABASE to another name, or drop it yourself")
    if settings.queue == DEFAULT_QUEUE:
        return
    connection = broker(settings)
    try:
        held = connection.channel().queue_declare(settings.queue, passive=True)
    except pika.exceptions.ChannelClosedByBroker:
        return  # no such queue
    finally:
        connection.close()
    if held.method.message_count:
        raise DemoRefused(
            f"queue {settings.queue} holds {held.method.message_count} message(s): not the "
            "demo's to delete. Set DRAIN_DEMO_QUEUE to another name")


# -- the database ---------------------------------------------------------------------------


@contextlib.contextmanager
def _admin(settings: Settings) -> Iterator[psycopg.Connection[Any]]:
    try:
        with psycopg.connect(settings.admin_url, autocommit=True) as admin:
            yield admin
    except psycopg.OperationalError as exc:
        raise DemoFailed(
            f"cannot use Postgres at {urls.mask_database_url(settings.admin_url)}: "
            f"{str(exc).strip().splitlines()[0]} (is it running? try `make services`)"
        ) from None


def recreate_database(settings: Settings) -> None:
    """Drop and create the demo's database (:func:`refuse_unless_ours` first), apply
    drain's schema with ``drain migrate``, add the app's own table."""
    with _admin(settings) as admin:
        name = sql.Identifier(settings.database)
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(name))
        admin.execute(sql.SQL("COMMENT ON DATABASE {} IS {}").format(name, sql.Literal(MARK)))
    migrate = subprocess.run(
        [sys.executable, "-m", "drain", "migrate"], env=settings.child_env(), cwd=ROOT,
        capture_output=True, text=True, timeout=60, check=False,
    )
    if migrate.returncode != 0:
        raise DemoFailed(f"drain migrate exited with {migrate.returncode}: {migrate.stderr}")
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE annotation (id bigint PRIMARY KEY, text text NOT NULL)")


# -- the queue --------------------------------------------------------------------------------


def broker(settings: Settings) -> Any:
    try:
        return pika.BlockingConnection(urls.broker_parameters(settings.broker_url))
    except pika.exceptions.AMQPError as exc:
        raise DemoFailed(
            f"cannot connect to RabbitMQ at {urls.mask_url(settings.broker_url)}: {exc!r} "
            "(is it running? try `make services`)"
        ) from None


def reset_queue(settings: Settings) -> None:
    """Start from an empty queue (:func:`refuse_unless_ours` first), declared as Celery
    declares it (durable, no arguments)."""
    connection = broker(settings)
    try:
        channel = connection.channel()
        channel.queue_delete(settings.queue)
        channel.queue_declare(settings.queue, durable=True)
    finally:
        connection.close()


def delete_queue(settings: Settings) -> None:
    """Delete the queue and the exchange of the same name the worker declared for it."""
    connection = broker(settings)
    try:
        channel = connection.channel()
        channel.queue_delete(settings.queue)
        with contextlib.suppress(pika.exceptions.ChannelClosedByBroker):  # still bound: kept
            channel.exchange_delete(settings.queue, if_unused=True)
    finally:
        connection.close()

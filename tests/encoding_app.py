"""Celery apps that encode their messages otherwise than plain JSON, for ``drain run
--app tests.encoding_app:<name>`` and ``celery -A tests.encoding_app:<name> worker``.

* :data:`pickle_app`: ``task_serializer='pickle'``, ``accept_content=['pickle']``
  (its workers refuse JSON);
* :data:`gzip_app`: JSON, ``task_compression='gzip'``;
* :data:`yaml_app`, :data:`msgpack_app`: those serializers, accepting only them;
* :data:`unaccepted_app`: ``task_serializer='pickle'`` and Celery's default
  ``accept_content=['json']``: ``drain run --app`` refuses to start with it;
* :data:`mixed_app`: JSON, with one task that has its own ``serializer='pickle'``
  and ``compression='bzip2'``, one with its own ``shadow_name``, and the app's
  ``task_repr_maxlevels`` and ``argsrepr_maxsize`` lowered.

Each has the task ``enc.record``, which writes what it was given (the types
included: ``repr`` of the args and kwargs, cut at 2,000 characters, and the
size of the args' ``repr``) to ``encoding_runs`` in the database
``ENCODING_APP_DATABASE_URL`` names.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from celery import Celery, Task

BROKER_URL = os.environ.get("DRAIN_TEST_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")


def _record(task: Task, args: Any, kwargs: Any) -> None:
    url = os.environ.get("ENCODING_APP_DATABASE_URL")
    if not url:
        return
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS encoding_runs (task_id text, task_name text, "
                     "args text, kwargs text, args_size bigint)")
        # a 17 MB argument is recorded by its first 2,000 characters and its size
        text = repr(args)
        conn.execute("INSERT INTO encoding_runs VALUES (%s, %s, %s, %s, %s)",
                     (task.request.id, task.name, text[:2000], repr(kwargs)[:2000], len(text)))


class Shadowed(Task):  # type: ignore[misc]
    """A task whose monitoring name is its first argument's (``shadow_name``)."""

    def shadow_name(self, args: Any, kwargs: Any, options: Any) -> str | None:
        return f"shadow.{args[0]}" if args else None


def create(name: str, **conf: Any) -> Celery:
    app = Celery(f"encoding_{name}", broker=BROKER_URL)
    app.conf.update(worker_hijack_root_logger=False, broker_connection_retry_on_startup=True,
                    **conf)

    @app.task(name="enc.record", bind=True, shared=False)
    def record(self: Task, *args: Any, **kwargs: Any) -> None:
        _record(self, args, kwargs)

    return app


pickle_app = create("pickle", task_serializer="pickle", accept_content=["pickle"])
gzip_app = create("gzip", task_compression="gzip")
yaml_app = create("yaml", task_serializer="yaml", accept_content=["yaml"])
msgpack_app = create("msgpack", task_serializer="msgpack", accept_content=["msgpack"])
unaccepted_app = create("unaccepted", task_serializer="pickle")
mixed_app = create("mixed", task_repr_maxlevels=1, accept_content=["json", "pickle"])
mixed_app.amqp.argsrepr_maxsize = 40


@mixed_app.task(name="enc.pickled", bind=True, shared=False, serializer="pickle",
                compression="bzip2")
def pickled(self: Task, *args: Any, **kwargs: Any) -> None:
    _record(self, args, kwargs)


@mixed_app.task(name="enc.shadowed", bind=True, shared=False, base=Shadowed)
def shadowed(self: Task, *args: Any, **kwargs: Any) -> None:
    _record(self, args, kwargs)

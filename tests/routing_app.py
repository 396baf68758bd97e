"""A Celery app with routing worth testing ``drain run --app`` against.

``celery -A tests.routing_app worker`` and ``drain run --app tests.routing_app``
load :data:`app`, whose queue and exchange names end in the
``ROUTING_APP_SUFFIX`` environment variable, so that each test has its own;
a test builds the same app in-process with :func:`create`. It has:

* ``task_routes`` in three forms: a router function that looks at the kwargs
  (``orders.process`` with ``vip`` goes to the priority queue, priority 7), a
  glob (``mail.*`` to a quorum queue) and a regex (``report.daily|weekly`` to a
  queue bound to a topic exchange, with a routing key of its own);
* a queue with ``x-max-priority`` 10, a quorum queue, a topic exchange;
* a task with its own queue, time limits, priority and ``ignore_result``;
* tasks that record where they ran in ``routing_runs`` (``ROUTING_APP_DATABASE_URL``);
* canvas tasks (``canvas.add``, ``canvas.fail``, the errback
  ``canvas.on_error``, and ``canvas.types``, which records the repr of each
  argument), which record what they were given in ``canvas_runs``:
  chains and callbacks staged through drain must run as after ``apply_async``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import psycopg
from celery import Celery, Task
from kombu.entity import Exchange, Queue

from tests import support

BROKER_URL = os.environ.get("DRAIN_TEST_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
TASKS = ("orders.process", "mail.send", "report.daily", "video.encode")


def names(suffix: str) -> dict[str, str]:
    """The app's queues (by role) and its topic exchange, for ``suffix``."""
    roles = ("default", "priority", "quorum", "reports", "video")
    found = {role: f"rt_{role}_{suffix}" for role in roles}
    found["topic"] = f"rt_topic_{suffix}"
    return found


#: What a worker of an app with a quorum queue declares for Celery's native
#: delayed delivery (Celery 5.5+, celery/worker/consumer/delayed_delivery.py):
#: one quorum queue and topic exchange per level, and the exchange in front.
DELAYED_LEVELS = 28
DELAYED_EXCHANGE = "celery_delayed_delivery"


def delete_entities(suffix: str) -> None:
    """Delete the app's queues and exchanges for ``suffix`` (a test's clean-up), and
    the delayed-delivery queues and exchanges its worker declared (global names,
    declared again by the next such worker)."""
    with support.broker_channel() as ch:
        for role, name in names(suffix).items():
            if role != "topic":
                ch.queue_delete(name)
            ch.exchange_delete(name)
        for level in range(DELAYED_LEVELS):
            ch.queue_delete(f"celery_delayed_{level}")
            ch.exchange_delete(f"celery_delayed_{level}")
        ch.exchange_delete(DELAYED_EXCHANGE)


def create(suffix: str) -> Celery:
    n = names(suffix)
    app = Celery(f"routing_{suffix}", broker=BROKER_URL)
    topic = Exchange(n["topic"], type="topic")

    def vip_router(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                   **_: Any) -> dict[str, Any] | None:
        if name == "orders.process" and kwargs.get("vip"):
            return {"queue": n["priority"], "priority": 7}
        return None

    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        task_default_queue=n["default"],
        task_queues=[
            Queue(n["default"], Exchange(n["default"]), routing_key=n["default"]),
            Queue(n["priority"], Exchange(n["priority"]), routing_key=n["priority"],
                  max_priority=10),
            Queue(n["quorum"], Exchange(n["quorum"]), routing_key=n["quorum"],
                  queue_arguments={"x-queue-type": "quorum"}),
            Queue(n["reports"], topic, routing_key="report.#"),
            Queue(n["video"], Exchange(n["video"]), routing_key=n["video"]),
        ],
        task_routes=[
            vip_router,
            {"mail.*": {"queue": n["quorum"]},
             re.compile(r"^report\.(daily|weekly)$"): {"queue": n["reports"],
                                                      "routing_key": "report.daily.eu"}},
        ],
    )

    def insert(table: str, columns: str, values: tuple[Any, ...]) -> None:
        """A row in ``table`` of the test's database (ROUTING_APP_DATABASE_URL)."""
        url = os.environ.get("ROUTING_APP_DATABASE_URL")
        if not url:
            return
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE IF NOT EXISTS {table} ({columns})")
            conn.execute(f"INSERT INTO {table} VALUES ({', '.join(['%s'] * len(values))})",
                         values)

    def record(task: Task, args: Any, kwargs: Any) -> None:
        info = task.request.delivery_info or {}
        insert("routing_runs", "task_id text, task_name text, exchange text, routing_key text",
               (task.request.id, task.name, info.get("exchange"), info.get("routing_key")))

    def record_canvas(name: str, given: Any, request: Any) -> None:
        insert("canvas_runs",
               "task_id text, task_name text, given jsonb, parent_id text, root_id text",
               (request.id, name, json.dumps(given), request.parent_id, request.root_id))

    @app.task(name="canvas.add", bind=True, shared=False)
    def canvas_add(self: Task, x: int, y: int = 0) -> int:
        record_canvas(self.name, [x, y], self.request)
        return x + y

    @app.task(name="canvas.types", bind=True, shared=False)
    def canvas_types(self: Task, *args: Any, **kwargs: Any) -> None:
        # What the worker was given, type and value: kombu's JSON carries
        # datetimes, Decimals, UUIDs and bytes.
        record_canvas(self.name, {"args": [repr(a) for a in args],
                                  "kwargs": {k: repr(v) for k, v in kwargs.items()}},
                      self.request)

    @app.task(name="canvas.fail", bind=True, shared=False)
    def canvas_fail(self: Task, *args: Any) -> None:
        record_canvas(self.name, list(args), self.request)
        raise ValueError("canvas.fail failed on purpose")

    @app.task(name="canvas.on_error", shared=False)
    def canvas_on_error(request: Any, exc: BaseException, traceback: Any) -> None:
        # A "new style" errback (request, exc, traceback; not bound, or Celery
        # takes it for an old one): the worker calls it at once, with the
        # failed task's request.
        record_canvas("canvas.on_error", [request.id, str(exc)], request)

    @app.task(name="orders.process", bind=True, shared=False)
    def process(self: Task, *args: Any, **kwargs: Any) -> None:
        record(self, args, kwargs)

    @app.task(name="mail.send", bind=True, shared=False)
    def send(self: Task, *args: Any, **kwargs: Any) -> None:
        record(self, args, kwargs)

    @app.task(name="report.daily", bind=True, shared=False)
    def daily(self: Task, *args: Any, **kwargs: Any) -> None:
        record(self, args, kwargs)

    @app.task(name="video.encode", bind=True, shared=False, queue=n["video"], time_limit=60,
              soft_time_limit=50, priority=4, ignore_result=True)
    def encode(self: Task, *args: Any, **kwargs: Any) -> None:
        record(self, args, kwargs)

    return app


app = create(os.environ.get("ROUTING_APP_SUFFIX", "dev"))

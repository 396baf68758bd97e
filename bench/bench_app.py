"""Two Celery apps for bench_throughput's ``drain run --app`` rounds.

Both register ``bench.index_annotation`` and route it, for rows staged
without a queue, to the queue named in ``BENCH_APP_QUEUE`` (set by the bench
before the drain loads the app):

* :data:`static`: ``task_routes`` as a plain mapping, which the drain asks
  once per (task, queue) and caches;
* :data:`function`: a router function that looks at the kwargs, which the
  drain calls for every row, as ``apply_async`` would.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

QUEUE = os.environ.get("BENCH_APP_QUEUE", "bench_app")
BROKER_URL = os.environ.get("DRAIN_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
TASK = "bench.index_annotation"


def _index_annotation(*args: Any, **kwargs: Any) -> None:
    """The bench never runs a worker: the task only has to be registered."""


def _app(name: str, routes: Any) -> Celery:
    app = Celery(name, broker=BROKER_URL, set_as_current=False)
    app.conf.task_routes = routes
    app.task(name=TASK, shared=False)(_index_annotation)
    return app


def by_user(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
            **_: Any) -> dict[str, Any] | None:
    """Routes by the job's kwargs, as a real router function might."""
    if name == TASK and kwargs.get("user"):
        return {"queue": QUEUE}
    return None


static = _app("bench_static", {TASK: {"queue": QUEUE}})
function = _app("bench_function", [by_user])

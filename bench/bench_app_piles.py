"""The Celery app of bench_piles's ``--app`` rounds.

Rows staged without a queue: ``bench.held`` is routed to the queue named in
``BENCH_PILES_HELD`` (which the bench declares first with other arguments, so
the drain's declare is refused, 406), ``bench.good`` to ``BENCH_PILES_GOOD``.
Both names are set by the bench before the drain loads the app. :data:`app`
routes with a plain mapping (the drain holds the refused rows by route),
:data:`by_function` with a router function that routes by name only (held by
route too, once the drain asked it with stand-ins for the arguments).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

BROKER_URL = os.environ.get("DRAIN_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")


def _task(*args: Any, **kwargs: Any) -> None:
    """The bench never runs a worker: the tasks only have to be registered."""


ROUTES = {
    "bench.held": {"queue": os.environ.get("BENCH_PILES_HELD", "bench_piles_held")},
    "bench.good": {"queue": os.environ.get("BENCH_PILES_GOOD", "bench_piles_good")},
}


def route(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
          **_: Any) -> dict[str, Any] | None:
    """The same routes, as a router function (which does not look at the arguments)."""
    return ROUTES.get(name)


def _app(name: str, routes: Any) -> Celery:
    made = Celery(name, broker=BROKER_URL, set_as_current=False)
    made.conf.task_routes = routes
    made.task(name="bench.held", shared=False)(_task)
    made.task(name="bench.good", shared=False)(_task)
    return made


app = _app("bench_piles", ROUTES)
by_function = _app("bench_piles_function", [route])

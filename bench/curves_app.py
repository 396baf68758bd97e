"""The Celery apps of bench_curves' ``--app`` points; ``bench.pile`` goes to a queue
whose declare the broker refuses, ``bench.flowing`` to one that works:

* :data:`app`: plain ``task_routes`` (the drain holds a refused route's rows by
  route), made anew with each point's queues (:func:`route_static`);
* :data:`function`: a router function that routes by the task name only (asked
  with stand-ins for the arguments, drain.celery.stand_in, the drain finds that
  out and holds the rows by route); it reads ``CURVES_PILE_QUEUE`` and
  ``CURVES_GOOD_QUEUE`` at every call;
* :data:`arguments`: the same, but it also looks at the kwargs, as a router by
  tenant would (the drain holds the rows by id: each routed once).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

BROKER_URL = os.environ.get("DRAIN_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
PILE, GOOD = "bench.pile", "bench.flowing"


def _noop(*args: Any, **kwargs: Any) -> None:
    """The bench never runs a worker: the tasks only have to be registered."""


def route(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
          **_: Any) -> dict[str, Any] | None:
    if name == PILE:
        return {"queue": os.environ["CURVES_PILE_QUEUE"]}
    if name == GOOD:
        return {"queue": os.environ["CURVES_GOOD_QUEUE"]}
    return None


def route_by_arguments(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                       **_: Any) -> dict[str, Any] | None:
    if kwargs.get("tenant") is not None:  # never set here: the same routes as route()
        return {"queue": f"tenant_{kwargs['tenant']}"}
    return route(name, args, kwargs, options, task)


def _app(name: str, routes: Any) -> Celery:
    made = Celery(name, broker=BROKER_URL, set_as_current=False)
    made.conf.task_routes = routes
    for task in (PILE, GOOD):
        made.task(name=task, shared=False)(_noop)
    return made


app = _app("bench_curves", {})
function = _app("bench_curves_function", [route])
arguments = _app("bench_curves_arguments", [route_by_arguments])


def route_static(pile_queue: str, good_queue: str) -> None:
    """A new :data:`app` with the next point's routes (an app keeps the router it
    made from its first routes: a new app, not new routes in the old one)."""
    global app  # noqa: PLW0603 (the drain loads curves_app:app by its name)
    app = _app("bench_curves", {PILE: {"queue": pile_queue}, GOOD: {"queue": good_queue}})

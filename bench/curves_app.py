"""The Celery app of bench_curves' ``--app`` points: a router that reads its queues
from the environment at every call (the bench changes them between points, in one
process that imports the app once).

``CURVES_PILE_QUEUE``: where ``bench.pile`` goes (a queue whose declare the broker
refuses); ``CURVES_GOOD_QUEUE``: where ``bench.flowing`` goes.
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


app = Celery("bench_curves", broker=BROKER_URL, set_as_current=False)
app.conf.task_routes = [route]
for _name in (PILE, GOOD):
    app.task(name=_name, shared=False)(_noop)

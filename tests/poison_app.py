"""The Celery app of the poison-row test (tests/acceptance/test_poison_rows.py).

``drain run --app tests.poison_app`` loads :data:`app`, whose names end in the
``POISON_APP_SUFFIX`` environment variable (each test has its own). Two good
queues, ``a`` (the default) and ``b``; and routes the broker refuses:

* ``poison.misrouted``: to queue ``a`` through an exchange nobody declares
  (``404 NOT_FOUND - no exchange`` on publish);
* ``poison.nodeclare``: to a kombu ``Queue(..., no_declare=True)`` on a topic
  exchange nobody declares (deploy order: the consumers declare it later), the
  same 404;
* ``poison.unbound``: to a kombu ``Queue(..., no_declare=True)`` on a direct
  exchange: Celery publishes it through the default exchange, keyed by the
  queue's name, and no such queue exists: unroutable (its rows stay staged);
* ``poison.conflict``: to queue ``c``, declared here with ``x-max-priority``
  while the broker has it with other arguments (the test declares it first):
  the declare is refused (406).
"""

from __future__ import annotations

import os

from celery import Celery
from kombu.entity import Exchange, Queue

from tests import support


def names(suffix: str) -> dict[str, str]:
    return {"a": f"pz_a_{suffix}", "b": f"pz_b_{suffix}", "c": f"pz_c_{suffix}",
            "missing": f"pz_missing_{suffix}", "nodeclare": f"pz_nd_{suffix}",
            "nd_exchange": f"pz_nd_x_{suffix}", "unbound": f"pz_ub_{suffix}"}


def delete_entities(suffix: str, queues: frozenset[str] = frozenset()) -> None:
    """Delete what the drain or the test declared for ``suffix``, and ``queues``
    with their exchanges of the same name (none for an ``amq.*`` name)."""
    n = names(suffix)
    with support.broker_channel() as ch:
        for queue in {n["a"], n["b"], n["c"], *queues}:
            ch.queue_delete(queue)
            if not queue.startswith("amq."):
                ch.exchange_delete(queue)


def create(suffix: str) -> Celery:
    n = names(suffix)
    app = Celery(f"poison_{suffix}", broker=support.BROKER_URL)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=n["a"],
        task_queues=[
            Queue(n["a"], Exchange(n["a"]), routing_key=n["a"]),
            Queue(n["b"], Exchange(n["b"]), routing_key=n["b"]),
            Queue(n["c"], Exchange(n["c"]), routing_key=n["c"],
                  queue_arguments={"x-max-priority": 5}),
        ],
        task_routes={
            "poison.misrouted": {"queue": n["a"], "exchange": n["missing"],
                                 "routing_key": n["a"]},
            "poison.nodeclare": {"queue": Queue(
                n["nodeclare"], Exchange(n["nd_exchange"], "topic", no_declare=True),
                routing_key=n["nodeclare"], no_declare=True)},
            "poison.unbound": {"queue": Queue(
                n["unbound"], Exchange(n["unbound"], no_declare=True),
                routing_key=n["unbound"], no_declare=True)},
            "poison.conflict": {"queue": n["c"]},
        },
    )

    for name in ("poison.ok", "poison.misrouted", "poison.nodeclare", "poison.unbound",
                 "poison.conflict"):
        app.task(name=name, shared=False)(_noop)
    return app


def _noop(*args: object, **kwargs: object) -> None:
    """Every task of the app: the test reads the queues, no worker runs them."""


app = create(os.environ.get("POISON_APP_SUFFIX", "dev"))

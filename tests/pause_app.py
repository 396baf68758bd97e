"""A Celery app whose routes fail one at a time: what a pause is keyed by.

``drain run --app tests.pause_app:app_<suffix>`` (in-process:
``Settings(celery_app=...)``) loads the app built for that suffix by
:func:`create`, so that each test has its own queue and exchange names. Every
task is staged without a queue (its row reads as 'celery') and routed by
``task_routes``:

* ``pause.full`` to a queue with ``x-max-length`` 1 and ``x-overflow:
  reject-publish`` (full once it holds one message: the broker nacks);
  ``pause.healthy`` to a plain queue;
* ``pause.to_a`` and ``pause.to_b`` to two exchanges with no queue in the route
  (nothing declared: the test declares the exchanges and binds B only, so A's
  messages come back unroutable);
* ``pause.via_exchange`` to a queue through its own exchange, which the drain
  declares (and a test deletes behind its back).
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu.entity import Exchange, Queue

from tests import support

#: The queue arguments of the full queue (declared alike by the drain and the test).
FULL_ARGUMENTS = {"x-max-length": 1, "x-overflow": "reject-publish"}


def names(suffix: str) -> dict[str, str]:
    """The app's queues and exchanges, by role, for ``suffix``."""
    roles = ("full", "healthy", "exchange_a", "exchange_b", "bound_a", "bound_b", "via")
    return {role: f"pk_{role}_{suffix}" for role in roles}


def delete_entities(suffix: str) -> None:
    """Delete every queue and exchange of ``suffix`` (a test's clean-up)."""
    with support.broker_channel() as ch:
        for name in names(suffix).values():
            ch.queue_delete(name)
            ch.exchange_delete(name)


def create(suffix: str) -> Celery:
    n = names(suffix)
    app = Celery(f"pause_{suffix}", broker=support.BROKER_URL)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=n["healthy"],
        task_queues=[
            Queue(n["full"], Exchange(n["full"]), routing_key=n["full"],
                  queue_arguments=FULL_ARGUMENTS),
            Queue(n["healthy"], Exchange(n["healthy"]), routing_key=n["healthy"]),
            Queue(n["via"], Exchange(n["via"]), routing_key=n["via"]),
        ],
        task_routes={
            "pause.full": {"queue": n["full"]},
            "pause.healthy": {"queue": n["healthy"]},
            "pause.to_a": {"exchange": n["exchange_a"], "exchange_type": "topic",
                           "routing_key": "a.job"},
            "pause.to_b": {"exchange": n["exchange_b"], "exchange_type": "topic",
                           "routing_key": "b.job"},
            "pause.via_exchange": {"queue": n["via"], "exchange": n["via"],
                                   "routing_key": n["via"]},
        },
    )
    for name in ("pause.full", "pause.healthy", "pause.to_a", "pause.to_b",
                 "pause.via_exchange"):
        app.task(name=name, shared=False)(_noop)
    return app


def _noop(*args: Any) -> None:
    """Never run: the tests read the queues."""


_apps: dict[str, Celery] = {}


def __getattr__(name: str) -> Celery:
    """``app_<suffix>``: the app for that suffix, built once."""
    if not name.startswith("app_"):
        raise AttributeError(name)
    suffix = name[len("app_"):]
    if suffix not in _apps:
        _apps[suffix] = create(suffix)
    return _apps[suffix]

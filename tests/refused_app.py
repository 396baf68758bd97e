"""A Celery app with a route to an exchange that nobody declares.

``drain run --app tests.refused_app`` loads :data:`app`, whose names end in
the ``REFUSED_APP_SUFFIX`` environment variable (each test has its own). Its
task ``refused.ok`` goes to the app's queue; ``refused.misrouted`` is routed to
the same queue through an exchange that does not exist, as a typo in
``task_routes`` would do: ``apply_async`` declares the queue (not that
exchange) and the broker refuses the publish with ``404 NOT_FOUND - no
exchange``, closing the channel.
"""

from __future__ import annotations

import os

from celery import Celery
from kombu.entity import Exchange, Queue

from tests import support


def names(suffix: str) -> dict[str, str]:
    """The app's queue and the exchange that is never declared, for ``suffix``."""
    return {"queue": f"rf_q_{suffix}", "missing": f"rf_missing_{suffix}"}


def delete_entities(suffix: str) -> None:
    """Delete the queue and the exchange the drain declares for ``suffix``."""
    queue = names(suffix)["queue"]
    with support.broker_channel() as ch:
        ch.queue_delete(queue)
        ch.exchange_delete(queue)


def create(suffix: str) -> Celery:
    n = names(suffix)
    app = Celery(f"refused_{suffix}", broker=support.BROKER_URL)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=n["queue"],
        task_queues=[Queue(n["queue"], Exchange(n["queue"]), routing_key=n["queue"])],
        task_routes={"refused.misrouted": {"queue": n["queue"], "exchange": n["missing"],
                                           "routing_key": n["queue"]}},
    )

    @app.task(name="refused.ok", shared=False)
    def ok(*args: object) -> None:
        """Delivered to the app's queue."""

    @app.task(name="refused.misrouted", shared=False)
    def misrouted(*args: object) -> None:
        """Routed through an exchange that does not exist."""

    return app


app = create(os.environ.get("REFUSED_APP_SUFFIX", "dev"))

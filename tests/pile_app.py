"""A Celery app whose ``task_routes`` send one task to a queue the broker refuses.

``drain run --app tests.pile_app`` loads :data:`app`, whose queue names end in
the ``PILE_APP_SUFFIX`` environment variable (each test process has its own).
``pile.held`` is routed to the ``held`` queue, which the test declares first
with other arguments, so the drain's declare gets 406 PRECONDITION_FAILED;
``pile.good`` goes to the app's default queue. Rows staged without a queue
are one staged queue ('celery') for both: only the app tells them apart, so
the drain holds the refused ones by id (drain.daemon.piles).
"""

from __future__ import annotations

import os

from celery import Celery

from tests import support


def names(suffix: str) -> dict[str, str]:
    return {"good": f"pile_good_{suffix}", "held": f"pile_held_{suffix}"}


SUFFIX = os.environ.setdefault("PILE_APP_SUFFIX", support.unique("p"))
NAMES = names(SUFFIX)

app = Celery(f"pile_{SUFFIX}", broker=support.BROKER_URL)
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_default_queue=NAMES["good"],
    task_routes={"pile.held": {"queue": NAMES["held"]}},
)


@app.task(name="pile.held", shared=False)
def held(*args: object) -> None:
    """Routed to the refused queue."""


@app.task(name="pile.good", shared=False)
def good(*args: object) -> None:
    """Routed to the default queue."""

"""A Celery app whose ``task_routes`` send one task to a queue the broker refuses.

``drain run --app tests.pile_app`` loads :data:`app`, whose queue names end in
the ``PILE_APP_SUFFIX`` environment variable (each test process has its own).
``pile.held`` is routed to the ``held`` queue, which the test declares first
with other arguments, so the drain's declare gets 406 PRECONDITION_FAILED;
``pile.good`` goes to the app's default queue. Rows staged without a queue
are one staged queue ('celery') for both: only the app tells them apart.
:data:`app` routes with a plain mapping (static: the drain holds the refused
rows by route), :data:`by_function` with a router function that routes by
name only (held by route too, once asked with stand-ins: drain.celery.stand_in),
:data:`by_arguments` with one that looks at the arguments (held by id;
drain.daemon.piles). :data:`by_flag` routes ``pile.held`` by the module's
:data:`HELD_TO`, which a test changes while the rows are held.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from tests import support


def names(suffix: str) -> dict[str, str]:
    return {"good": f"pile_good_{suffix}", "held": f"pile_held_{suffix}"}


SUFFIX = os.environ.setdefault("PILE_APP_SUFFIX", support.unique("p"))
NAMES = names(SUFFIX)

def _task(*args: object) -> None:
    """Never run: the tests only drain."""


def route(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
          **_: Any) -> dict[str, Any] | None:
    """The router function: the same routes as the mapping."""
    return {"queue": NAMES["held"]} if name == "pile.held" else None


def route_by_arguments(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                       **_: Any) -> dict[str, Any] | None:
    """The same routes, decided by the first argument (every one of them a number)."""
    if name == "pile.held" and args and isinstance(args[0], int):
        return {"queue": NAMES["held"]}
    return None


#: Where :func:`route_by_flag` sends ``pile.held``: a name of :data:`NAMES`.
HELD_TO = "held"


def route_by_flag(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                  **_: Any) -> dict[str, Any] | None:
    """``pile.held`` to the queue :data:`HELD_TO` names, read at each call."""
    return {"queue": NAMES[HELD_TO]} if name == "pile.held" else None


def create(name: str, routes: Any) -> Celery:
    made = Celery(f"{name}_{SUFFIX}", broker=support.BROKER_URL, set_as_current=False)
    made.conf.update(task_serializer="json", accept_content=["json"],
                     task_default_queue=NAMES["good"], task_routes=routes)
    made.task(name="pile.held", shared=False)(_task)
    made.task(name="pile.good", shared=False)(_task)
    return made


app = create("pile", {"pile.held": {"queue": NAMES["held"]}})
by_function = create("pile_function", [route])
by_arguments = create("pile_arguments", [route_by_arguments])
by_flag = create("pile_flag", [route_by_flag])

"""Loading the user's Celery app for ``drain run --app MODULE[:ATTR]``.

The app is found exactly as ``celery -A`` finds it, with Celery's own
:func:`celery.app.utils.find_app`: ``MODULE:ATTR``, or ``MODULE`` alone, in
which case its ``app`` or ``celery`` attribute (or ``MODULE.celery``, or the
one Celery instance in it) is the app. The module is imported from the
current directory and ``PYTHONPATH``, as ``celery -A`` imports it.

Then its tasks are registered the way a worker registers them, with
``app.loader.import_default_modules()`` (the ``imports`` and ``include``
settings, and ``autodiscover_tasks()``), and the app is finalized. Nothing
connects: the drain never uses the app's broker connection, only its
configuration (routes, queues, task options).
"""

from __future__ import annotations

import logging

from celery import Celery
from celery.app.utils import find_app

from drain.errors import ConfigError

log = logging.getLogger(__name__)


def load(spec: str) -> Celery:
    """The Celery app named by ``spec`` (``MODULE:ATTR`` or ``MODULE``), tasks registered.

    Raises :class:`ConfigError` (one line, exit 2) when it cannot be imported
    or is not a Celery app.
    """
    spec = spec.strip()
    if not spec:
        raise ConfigError("--app: give the Celery app as MODULE:ATTR or MODULE")
    try:
        app = find_app(spec)
    except Exception as exc:  # an ImportError, or whatever the app's module raised
        raise ConfigError(f"--app {spec}: cannot load the Celery app: "
                          f"{type(exc).__name__}: {exc}") from None
    if not isinstance(app, Celery):
        raise ConfigError(f"--app {spec}: {type(app).__name__} is not a Celery app")
    try:
        app.loader.import_default_modules()
        app.finalize(auto=True)
        count = sum(1 for name in app.tasks if not name.startswith("celery."))
    except Exception as exc:
        raise ConfigError(f"--app {spec}: importing the app's task modules failed: "
                          f"{type(exc).__name__}: {exc}") from None
    log.info("celery app %s loaded from %s: %d task(s) registered", app.main, spec, count)
    return app

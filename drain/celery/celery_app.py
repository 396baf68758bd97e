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
configuration (routes, queues, task options) and, with
:func:`broker_settings`, its broker settings (drain.broker.broker_options).
"""

from __future__ import annotations

import logging
import os

from celery import Celery
from celery.app.utils import find_app

from drain.broker.broker_options import AppBroker, BrokerOptions
from drain.errors import ConfigError

log = logging.getLogger("drain.celery_app")


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


#: Broker settings read apart from the URL by Celery, not by drain: an app
#: that sets them must put them in its broker URL.
SEPARATE_SETTINGS = ("broker_user", "broker_password", "broker_port", "broker_vhost")


def broker_settings(app: Celery) -> AppBroker:
    """What ``app``'s configuration says about its broker; nothing connects.

    The URLs are those Celery's ``connection_for_write`` uses:
    ``broker_write_url``, else ``broker_url`` (Celery's configuration reads the
    ``CELERY_BROKER_WRITE_URL`` and ``CELERY_BROKER_URL`` variables first).
    ``broker_heartbeat`` and ``broker_connection_timeout`` count only when the
    app sets them; Celery's defaults for them are not the drain's (see
    drain.broker.broker_options). Raises :class:`ConfigError` for a value drain
    cannot honour.
    """
    conf = app.conf
    if os.environ.get("CELERY_BROKER_WRITE_URL"):
        setting = "CELERY_BROKER_WRITE_URL (environment)"
    elif conf.get("broker_write_url"):
        setting = "broker_write_url"
    elif os.environ.get("CELERY_BROKER_URL"):
        setting = "CELERY_BROKER_URL (environment)"
    else:
        setting = "broker_url"
    urls = conf.broker_write_url
    if urls is not None and not isinstance(urls, (str, list, tuple)):
        raise ConfigError(f"the Celery app's {setting} must be a URL or a list of URLs, "
                          f"not {type(urls).__name__}")

    def set_by_app(key: str) -> object:
        return getattr(conf, key) if conf.value_set_for(key) else None

    options = BrokerOptions.of(
        use_ssl=conf.broker_use_ssl,
        login_method=conf.broker_login_method,
        heartbeat=set_by_app("broker_heartbeat"),
        connection_timeout=set_by_app("broker_connection_timeout"),
        failover_strategy=conf.broker_failover_strategy,
    )
    separate = tuple(key for key in SEPARATE_SETTINGS if conf.value_set_for(key))
    return AppBroker(urls=list(urls) if isinstance(urls, tuple) else urls, setting=setting,
                     options=options, separate=separate)

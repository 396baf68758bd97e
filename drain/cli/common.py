"""What every subcommand of the ``drain`` command shares.

The exit codes (:class:`Exit`) and the error that means bad usage; the
options several commands take (``--database-url``, ``--lock-key``, durations)
and the defaults they read from DRAIN_* variables; turning parsed flags into
:class:`drain.settings.config.Settings`; and keeping secrets out of what the command
prints: the logging set-up, the URL check before anything starts and the
passwords to scrub. :mod:`drain.cli.main` builds the command from these, with
:mod:`drain.cli.dead` and :mod:`drain.cli.status`; none of them imports
:mod:`drain.cli.main`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import enum
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from drain.errors import (
    BrokerUnavailable,
    ConfigError,
    DatabaseUnavailable,
    DrainError,
    PartitioningChanged,
    PermissionDenied,
    SchemaMissing,
    SchemaNewer,
    StagingError,
    UsageError,
)
from drain.postgres import dead
from drain.settings import config, options, urls


class Exit(enum.IntEnum):
    OK = 0
    ERROR = 1  #: anything unexpected; rerun with -v for the traceback
    USAGE = 2  #: bad flags, settings or input
    UNAVAILABLE = 3  #: Postgres or RabbitMQ cannot be reached or refused us
    SCHEMA = 4  #: staged_jobs is missing: run `drain migrate`
    PRIVILEGE = 5  #: the database role lacks a grant (docs/running.md, "Database roles")
    PARTITIONING = 6  #: a backfill resume would partition its records differently
    SCHEMA_NEWER = 7  #: a newer drain migrated the schema (`drain migrate --check`)


#: Which exit code an error that ends a command gets: the first that fits.
EXIT_CODES: Sequence[tuple[type[BaseException], Exit]] = (
    (SchemaMissing, Exit.SCHEMA),
    (SchemaNewer, Exit.SCHEMA_NEWER),
    (PartitioningChanged, Exit.PARTITIONING),
    (PermissionDenied, Exit.PRIVILEGE),
    (DatabaseUnavailable, Exit.UNAVAILABLE),
    (BrokerUnavailable, Exit.UNAVAILABLE),
    (ConfigError, Exit.USAGE),
    (UsageError, Exit.USAGE),
    (StagingError, Exit.USAGE),
    (DrainError, Exit.ERROR),
)


def env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


#: What a switch's variable says to leave it off (unset counts as "").
SWITCH_OFF = ("", "0", "false", "no")


def switch(value: str) -> bool:
    """A switch's variable read as the switch: on unless one of SWITCH_OFF."""
    return value not in SWITCH_OFF


def add_database(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        default=env("DRAIN_DATABASE_URL", ""),
        metavar="URL",
        help="Postgres URL or libpq string (env DRAIN_DATABASE_URL; required, unless "
        "libpq's PGHOST, PGDATABASE or PGSERVICE name the database: then those and "
        "PGUSER, PGPORT... apply)",
    )


#: libpq variables that say which database to use: one of them, or a URL, is required.
LIBPQ_TARGETS = ("PGHOST", "PGHOSTADDR", "PGDATABASE", "PGSERVICE")


def require_database(args: argparse.Namespace) -> None:
    """Refuse to guess the database: no URL and no libpq variable naming one would
    fall back to libpq's compiled-in default (the local socket, a database named
    after the OS user), and a command obeyed there (`drain migrate`) would change
    the wrong database."""
    if getattr(args, "database_url", None) == "" and not any(env(v) for v in LIBPQ_TARGETS):
        raise UsageError(
            "no database given: set DRAIN_DATABASE_URL or --database-url (or libpq's "
            "PGHOST / PGDATABASE / PGSERVICE)")


def add_lock_key(parser: argparse.ArgumentParser) -> None:
    options.add(
        parser, "--lock-key", env="DRAIN_LOCK_KEY", default=config.DEFAULT_LOCK_KEY,
        parse=options.INT64, metavar="N",
        help="advisory lock key shared by the drains of one database; only the holder "
        "publishes",
    )


#: Said under every command's options that come from DRAIN_* variables.
ENV_NOTE = (
    "Every setting may come from its DRAIN_* environment variable; a flag wins over it. "
    "A variable set to the empty string counts as unset: the default applies. Numbers are "
    "checked before anything connects, from a flag or a variable alike."
)


def duration(text: str) -> dt.timedelta:
    """An argparse type: 7d, 12h, 90m... (:func:`drain.postgres.dead.parse_duration`)."""
    try:
        return dead.parse_duration(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def settings_of(args: argparse.Namespace, **overrides: Any) -> config.Settings:
    """The settings the parsed flags of any command give (those it has)."""
    values: dict[str, Any] = {"database_url": args.database_url}
    for name in ("broker_url", "batch_size", "pipeline", "poll_interval", "confirm_timeout",
                 "db_timeout", "broker_heartbeat",
                 "queue_declare", "lock_key", "queue_max_priority", "max_message_size",
                 "fetch_strategy", "rescan_interval", "lanes", "lane", "celery_app",
                 "allow_unknown_tasks", "trace_context", "trace_new_after"):
        if hasattr(args, name):
            values[name] = getattr(args, name)
    values.update(overrides)
    return config.Settings(**values)


def configure_logging(verbose: bool, secrets: Sequence[str] = ()) -> None:
    """Log to stderr, every line (tracebacks too) scrubbed of ``secrets`` and of
    the passwords of any URL in it (:class:`drain.settings.urls.ScrubbingFormatter`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(urls.ScrubbingFormatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s", list(secrets)))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    # pika logs every failed attempt at ERROR; drain logs one line per state change.
    logging.getLogger("pika").setLevel(logging.DEBUG if verbose else logging.CRITICAL)


#: URLs of the Spark commands besides --database-url (a jdbc: URL goes to JDBC as it is).
_OTHER_DATABASE_URLS = (("source_url", "--source-url"), ("downstream_url", "--downstream-url"))


def check_urls(args: argparse.Namespace) -> None:
    """Refuse a malformed URL before anything starts (Spark in particular), without
    showing it. The other commands check theirs in :class:`drain.settings.config.Settings`."""
    if args.command not in ("backfill", "reconcile"):
        return
    urls.database_conninfo(getattr(args, "database_url", "") or "")
    for name, flag in _OTHER_DATABASE_URLS:
        url = getattr(args, name, None)
        if url and not url.startswith("jdbc:"):
            try:
                urls.database_conninfo(url)
            except ConfigError as exc:
                raise ConfigError(f"{flag}: {exc}") from None


def secrets_in(args: argparse.Namespace) -> list[str]:
    """Passwords in the URLs given, so that no error message or log line can show them
    (:func:`drain.settings.urls.secrets_of`: malformed URLs too; never raises)."""
    found = urls.secrets_of(getattr(args, "database_url", "") or "",
                              getattr(args, "broker_url", "") or "")
    for name, _ in _OTHER_DATABASE_URLS:
        found += urls.secrets_of(getattr(args, name, None) or "")
    return found

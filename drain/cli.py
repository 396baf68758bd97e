"""The ``drain`` command: migrate, run, stage, status.

Every option can also be set by environment variable (named in ``--help``);
a flag wins over the variable, the variable over the default. Errors print
one line on stderr and exit with a code from :class:`Exit`; ``-v`` adds the
traceback and debug logging.
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from drain import __version__, config, sql, store
from drain.errors import (
    BrokerUnavailable,
    ConfigError,
    DatabaseUnavailable,
    DrainError,
    SchemaMissing,
    StagingError,
)

log = logging.getLogger("drain")


class Exit(enum.IntEnum):
    OK = 0
    ERROR = 1  #: anything unexpected; rerun with -v for the traceback
    USAGE = 2  #: bad flags, settings or input
    UNAVAILABLE = 3  #: Postgres or RabbitMQ cannot be reached or refused us
    SCHEMA = 4  #: staged_jobs is missing: run `drain migrate`


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _add_database(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        default=_env("DRAIN_DATABASE_URL", ""),
        metavar="URL",
        help="Postgres URL or libpq string (env DRAIN_DATABASE_URL; when empty, libpq's "
        "PGHOST, PGDATABASE, PGUSER... apply)",
    )


def _add_lock_key(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lock-key",
        type=int,
        default=int(_env("DRAIN_LOCK_KEY", str(config.DEFAULT_LOCK_KEY)) or 0),
        metavar="N",
        help="advisory lock key shared by the drains of one database; only the holder "
        f"publishes (env DRAIN_LOCK_KEY, default {config.DEFAULT_LOCK_KEY})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="drain",
        description="Stage Celery jobs in your Postgres transaction; drain them to RabbitMQ.",
        epilog="Exit codes: 0 ok, 1 unexpected error, 2 bad usage or input, "
        "3 database or broker unavailable, 4 schema missing (run `drain migrate`).",
    )
    parser.add_argument("--version", action="version", version=f"drain {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="debug logging and tracebacks on errors"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "migrate",
        help="apply staging_schema.sql to the database (idempotent)",
        description="Create or update staged_jobs, its NOTIFY trigger and the drain_stager / "
        "drain_runner roles. Safe to run any number of times.",
    )
    _add_database(p)
    p.add_argument("--print", action="store_true", help="print the schema SQL, apply nothing")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser(
        "run",
        help="run the drain (one active per lock key, others wait as standbys)",
        description="Publish committed staged jobs to RabbitMQ as Celery messages and delete "
        "them once the broker confirmed them. Several copies may run: one holds the "
        "advisory lock and publishes, the others wait and take over within a second "
        "when it dies. SIGTERM or SIGINT finish the current batch and exit 0.",
    )
    _add_database(p)
    p.add_argument(
        "--broker-url",
        default=_env("DRAIN_BROKER_URL", config.DEFAULT_BROKER_URL),
        metavar="URL",
        help="RabbitMQ URL, Celery style: amqp://user:pass@host:5672// ('//' is the vhost "
        f"'/') (env DRAIN_BROKER_URL, default {config.DEFAULT_BROKER_URL})",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=int(_env("DRAIN_BATCH_SIZE", "1000") or 0),
        metavar="N",
        help="rows per transaction, published with pipelined confirms "
        "(env DRAIN_BATCH_SIZE, default 1000)",
    )
    p.add_argument(
        "--poll-interval",
        type=float,
        default=float(_env("DRAIN_POLL_INTERVAL", "1.0") or 0),
        metavar="SECONDS",
        help="when idle, look for rows this often even without a NOTIFY "
        "(env DRAIN_POLL_INTERVAL, default 1.0)",
    )
    p.add_argument(
        "--confirm-timeout",
        type=float,
        default=float(_env("DRAIN_CONFIRM_TIMEOUT", "30") or 0),
        metavar="SECONDS",
        help="abandon a batch (rows stay staged) when the broker has not confirmed it by "
        "then (env DRAIN_CONFIRM_TIMEOUT, default 30)",
    )
    p.add_argument(
        "--queue-declare",
        choices=("celery", "passive"),
        default=_env("DRAIN_QUEUE_DECLARE", "celery"),
        help="'celery': declare each queue durable with no arguments, as Celery does by "
        "default; 'passive': only check it exists (for queues declared with "
        "x-max-priority, quorum...) (env DRAIN_QUEUE_DECLARE, default celery)",
    )
    p.add_argument(
        "--queue-max-priority",
        type=int,
        default=int(_env("DRAIN_QUEUE_MAX_PRIORITY", "0") or 0),
        metavar="N",
        help="declare queues with x-max-priority N, as Celery's task_queue_max_priority "
        "does, and publish row priorities as AMQP priorities 0..N; 0: queues without "
        "priority (env DRAIN_QUEUE_MAX_PRIORITY, default 0)",
    )
    p.add_argument(
        "--max-message-size",
        type=int,
        default=int(_env("DRAIN_MAX_MESSAGE_SIZE", str(16 * 1024 * 1024)) or 0),
        metavar="BYTES",
        help="dead-letter rows whose message body is larger, instead of letting the broker "
        "refuse them: RabbitMQ's max_message_size (env DRAIN_MAX_MESSAGE_SIZE, default "
        "16777216, RabbitMQ 4's default; 3.x allows 134217728)",
    )
    _add_lock_key(p)
    p.add_argument(
        "--exit-when-empty",
        action="store_true",
        help="exit 0 once the backlog is empty (for batch jobs and benchmarks)",
    )
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "stage",
        help="stage one job (for operators; apps stage in their own transaction)",
        description="Insert one row into staged_jobs and commit; prints the task id.",
    )
    _add_database(p)
    p.add_argument("task", help="Celery task name, e.g. search.index_annotation")
    p.add_argument("--args", default="[]", metavar="JSON", help="positional args, a JSON array")
    p.add_argument("--kwargs", default="{}", metavar="JSON", help="keyword args, a JSON object")
    p.add_argument("--queue", default=None, help="Celery queue (default celery)")
    p.add_argument("--task-id", default=None, help="task id (default: a new UUID)")
    p.set_defaults(func=cmd_stage)

    p = sub.add_parser(
        "status",
        help="backlog, oldest staged job, and which drain holds the lock",
        description="Show the backlog and whether a drain is active.",
    )
    _add_database(p)
    _add_lock_key(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_status)
    return parser


def _settings(args: argparse.Namespace, **overrides: Any) -> config.Settings:
    values: dict[str, Any] = {"database_url": args.database_url}
    for name in ("broker_url", "batch_size", "poll_interval", "confirm_timeout",
                 "queue_declare", "lock_key", "queue_max_priority", "max_message_size"):
        if hasattr(args, name):
            values[name] = getattr(args, name)
    values.update(overrides)
    return config.Settings(**values)


def cmd_migrate(args: argparse.Namespace) -> int:
    if args.print:
        sys.stdout.write(sql.schema_text())
        return Exit.OK
    settings = _settings(args)
    with store.connect_plain(settings) as conn:
        store.migrate(conn)
    log.info("schema applied to %s", config.mask_database_url(settings.database_url))
    return Exit.OK


def cmd_run(args: argparse.Namespace) -> int:
    from drain.runner import Drain  # noqa: PLC0415 - pika and celery load only for `run`

    drain = Drain(_settings(args), exit_when_empty=args.exit_when_empty)
    drain.install_signal_handlers()
    drain.run()
    return Exit.OK


def cmd_stage(args: argparse.Namespace) -> int:
    from drain.staging import stage  # noqa: PLC0415

    job_args = _json_arg("--args", args.args)
    job_kwargs = _json_arg("--kwargs", args.kwargs)
    settings = _settings(args)
    with store.connect_plain(settings) as conn:
        task_id = stage(conn, args.task, job_args, job_kwargs,
                        queue=args.queue, task_id=args.task_id)
    print(task_id)
    return Exit.OK


def _json_arg(flag: str, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise StagingError(f"{flag} is not valid JSON: {exc}") from None


def cmd_status(args: argparse.Namespace) -> int:
    settings = _settings(args)
    with store.connect_plain(settings) as conn:
        status = store.status(conn, settings.lock_key)
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return Exit.OK
    age = status["oldest_age_seconds"]
    print(f"backlog: {status['backlog']} staged job(s)"
          + (f", oldest {age:.1f}s old" if age is not None else ""))
    lock = status["lock"]
    if lock["held"]:
        since = f" since {lock['since']}" if lock.get("since") else ""
        print(f"drain: active, pid {lock['pid']} on {lock['host'] or '?'}{since} "
              f"(client {lock['client_addr'] or 'local socket'})")
    else:
        print("drain: none active (no process holds the lock)")
    return Exit.OK


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # pika logs every failed attempt at ERROR; drain logs one line per state change.
    logging.getLogger("pika").setLevel(logging.DEBUG if verbose else logging.CRITICAL)


_EXIT_CODES: Sequence[tuple[type[BaseException], Exit]] = (
    (SchemaMissing, Exit.SCHEMA),
    (DatabaseUnavailable, Exit.UNAVAILABLE),
    (BrokerUnavailable, Exit.UNAVAILABLE),
    (ConfigError, Exit.USAGE),
    (StagingError, Exit.USAGE),
    (DrainError, Exit.ERROR),
)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ValueError as exc:  # a malformed DRAIN_* number in the environment
        print(f"drain: error: bad number in a DRAIN_* environment variable: {exc}",
              file=sys.stderr)
        return int(Exit.USAGE)
    args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return Exit.OK
    except Exception as exc:
        code = next((c for t, c in _EXIT_CODES if isinstance(exc, t)), Exit.ERROR)
        if args.verbose:
            log.exception("drain %s failed", args.command)
        text = str(exc) if isinstance(exc, DrainError) else f"{type(exc).__name__}: {exc}"
        text = config.scrub(text.strip().splitlines()[0] if text.strip() else text,
                            _secrets(args))
        print(f"drain: error: {text}", file=sys.stderr)
        return int(code)


def _secrets(args: argparse.Namespace) -> list[str]:
    """Passwords in the URLs given, so that no error message can show them."""
    try:
        return config.Settings(
            database_url=getattr(args, "database_url", ""),
            broker_url=getattr(args, "broker_url", config.DEFAULT_BROKER_URL),
        ).secrets()
    except DrainError:
        return []


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

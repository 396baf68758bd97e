"""The ``drain`` command: migrate, run, stage, status.

Every option can also be set by environment variable (named in ``--help``);
a flag wins over the variable, the variable over the default. Errors print
one line on stderr and exit with a code from :class:`Exit`; ``-v`` adds the
traceback and debug logging.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import enum
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from drain import __version__, config, dead, options, sql, store, urls
from drain import status as drain_status
from drain.errors import (
    BrokerUnavailable,
    ConfigError,
    DatabaseUnavailable,
    DrainError,
    SchemaMissing,
    StagingError,
)
from drain.spark import cli as spark_cli

log = logging.getLogger("drain")


class UsageError(DrainError):
    """The command cannot go ahead as asked (exit code 2)."""


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


#: /metrics and friends; lane K of a drain split in lanes serves on this + K.
DEFAULT_METRICS_PORT = 9464


def _add_run_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run the drain (one active per lock key, others wait as standbys)",
        description="Publish committed staged jobs to RabbitMQ as Celery messages and delete "
        "them once the broker confirmed them. Several copies may run: one holds the "
        "advisory lock and publishes, the others wait and take over within a second "
        "when it dies. SIGTERM or SIGINT finish the current batch and exit 0.",
        epilog=ENV_NOTE,
    )
    _add_database(p)
    p.add_argument(
        "--broker-url",
        default=_env("DRAIN_BROKER_URL", config.DEFAULT_BROKER_URL),
        metavar="URL",
        help="RabbitMQ URL, Celery style: amqp://user:pass@host:5672// ('//' is the vhost "
        f"'/') (env DRAIN_BROKER_URL, default {config.DEFAULT_BROKER_URL})",
    )
    options.add(
        p, "--batch-size", env="DRAIN_BATCH_SIZE", default=config.DEFAULT_BATCH_SIZE,
        parse=options.COUNT,
        metavar="N",
        help="rows per transaction, published with pipelined confirms",
    )
    options.add(
        p, "--pipeline", env="DRAIN_PIPELINE", default=config.DEFAULT_PIPELINE,
        parse=options.Number(whole=True, low=1, high=config.MAX_PIPELINE),
        metavar="N",
        help=f"batches in flight at once, 1 to {config.MAX_PIPELINE}: the next ones are "
        "fetched and published while the broker confirms the oldest. A crash republishes "
        "at most N x batch size jobs (same task ids); 1 overlaps nothing",
    )
    options.add(
        p, "--poll-interval", env="DRAIN_POLL_INTERVAL", default=1.0,
        parse=options.POSITIVE_SECONDS,
        metavar="SECONDS",
        help="when idle, look for rows this often even without a NOTIFY",
    )
    options.add(
        p, "--confirm-timeout", env="DRAIN_CONFIRM_TIMEOUT", default=30.0,
        parse=options.POSITIVE_SECONDS,
        metavar="SECONDS",
        help="abandon a batch (rows stay staged) when the broker has not confirmed it by then",
    )
    options.add(
        p, "--db-timeout", env="DRAIN_DB_TIMEOUT", default=30.0,
        parse=options.Number(whole=False, low=0.1, high=86400),
        metavar="SECONDS",
        help="Postgres's statement_timeout for the drain's session; a command unanswered "
        "5 s after it (a hung server or pooler) makes the drain abandon the connection, "
        "reconnect and take the lock again or stand by",
    )
    p.add_argument(
        "--queue-declare",
        choices=("celery", "passive"),
        default=_env("DRAIN_QUEUE_DECLARE", "celery"),
        help="'celery': declare each queue durable with no arguments, as Celery does by "
        "default; 'passive': only check it exists (for queues declared with "
        "x-max-priority, quorum...) (env DRAIN_QUEUE_DECLARE, default celery)",
    )
    options.add(
        p, "--queue-max-priority", env="DRAIN_QUEUE_MAX_PRIORITY", default=0,
        parse=options.Number(whole=True, low=0, high=255),
        metavar="N",
        help="declare queues with x-max-priority N (0 to 255), as Celery's "
        "task_queue_max_priority does, and publish row priorities as AMQP priorities "
        "0..N; 0: queues without priority",
    )
    options.add(
        p, "--max-message-size", env="DRAIN_MAX_MESSAGE_SIZE",
        default=config.DEFAULT_MAX_MESSAGE_SIZE, parse=options.COUNT,
        metavar="BYTES",
        help="dead-letter rows whose message body is larger, instead of letting the broker "
        "refuse them: RabbitMQ's max_message_size (16777216 is RabbitMQ 4's default; 3.x "
        "allows 134217728)",
    )
    p.add_argument(
        "--fetch-strategy",
        choices=("keyset", "head"),
        default=_env("DRAIN_FETCH_STRATEGY", "keyset"),
        help="keyset (default): start each priority's scan at a low-water mark, so the "
        "dead rows a long-running transaction keeps from vacuum cost nothing (see "
        "drain/keyset.py); head: scan from the head of the index every batch, only for "
        "comparison (env DRAIN_FETCH_STRATEGY)",
    )
    options.add(
        p, "--rescan-interval", env="DRAIN_RESCAN_INTERVAL", default=300.0,
        parse=options.SECONDS_OR_ZERO,
        metavar="SECONDS",
        help="with the keyset fetch, rescan from the head of the index this often: a "
        "belt-and-braces backstop, which the low-water marks do not rely on; 0: never",
    )
    options.add(
        p, "--lanes", env="DRAIN_LANES", default=1,
        parse=options.Number(whole=True, low=1, high=config.MAX_LANES),
        metavar="N",
        help="split the rows in N lanes by id modulo N, each drained by its own process "
        "with its own lock (and its own standbys); every drain of one lock key must use "
        "the same N",
    )
    options.add(
        p, "--lane", env="DRAIN_LANE", default=0,
        parse=options.INDEX,
        metavar="K",
        help="with --lanes N: the lane this process drains, 0 to N-1",
    )
    options.add(
        p, "--metrics-port", env="DRAIN_METRICS_PORT", default=DEFAULT_METRICS_PORT,
        parse=options.PORT,
        metavar="PORT",
        help="serve /metrics (Prometheus), /healthz, /readyz and a status page on this port; "
        "0: off. Each drain on one host needs its own (lane K of a drain split in lanes "
        "defaults to 9464 + K)",
    )
    p.add_argument(
        "--metrics-host",
        default=_env("DRAIN_METRICS_HOST", "127.0.0.1"),
        metavar="ADDRESS",
        help="address to serve them on; 0.0.0.0 inside a container (env DRAIN_METRICS_HOST, "
        "default 127.0.0.1)",
    )
    options.add(
        p, "--metrics-interval", env="DRAIN_METRICS_INTERVAL", default=15.0,
        parse=options.POSITIVE_SECONDS,
        metavar="SECONDS",
        help="read the backlog, dead jobs and the oldest transaction from the database this "
        "often, on a connection of its own",
    )
    _add_lock_key(p)
    p.add_argument(
        "--exit-when-empty",
        action="store_true",
        help="exit 0 once no staged row is due (delayed rows stay staged; for batch jobs "
        "and benchmarks)",
    )
    p.set_defaults(func=cmd_run)


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

    _add_run_parser(sub)

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
    p.add_argument("--priority", type=options.Number(whole=True, low=-32768, high=32767),
                   default=0, help="higher first, -32768 to 32767 (default 0)")
    p.add_argument("--tag", default=None, help="who staged it, e.g. ops.manual")
    p.add_argument("--countdown", type=options.SECONDS_OR_ZERO, default=None, metavar="SECONDS",
                   help="not before this many seconds from now")
    p.add_argument("--expires", type=options.SECONDS_OR_ZERO, default=None, metavar="SECONDS",
                   help="dead-letter instead of publishing after this many seconds")
    p.set_defaults(func=cmd_stage)

    _add_dead_parsers(sub)
    spark_cli.add_parsers(sub)

    p = sub.add_parser(
        "processed",
        help="the consumers' record of processed task ids (drain.consumer)",
        description="Manage drain_processed, where drain.consumer records the task ids "
        "it has processed.",
    )
    processed_sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = processed_sub.add_parser(
        "purge",
        help="delete records older than --older-than, in batches",
        description="Delete drain_processed rows older than --older-than, 10,000 per "
        "transaction. Keep records longer than any copy of a message can still arrive "
        "(queue backlog, retries, drain downtime). Safe to run from cron.",
    )
    _add_database(q)
    q.add_argument("--older-than", required=True, type=_duration, metavar="DURATION",
                   help="e.g. 7d, 12h, 90m")
    q.set_defaults(func=cmd_processed_purge)

    p = sub.add_parser(
        "status",
        help="backlog, oldest staged job, dead letters, the oldest transaction, and which "
        "drain holds the lock",
        description="Show the backlog by queue, tag and task, how long the oldest due job "
        "has waited, dead letters by reason, the database's oldest open transaction (it "
        "keeps vacuum from removing drained rows) and which drain holds the lock. Above "
        f"{drain_status.ESTIMATE_ABOVE:,} staged rows the counts are estimates, and say so.",
    )
    _add_database(p)
    _add_lock_key(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (with --watch: one per line per refresh)")
    p.add_argument("--watch", nargs="?", const=2.0, type=options.POSITIVE_SECONDS,
                   metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C; on a terminal the "
                   "view is redrawn, otherwise each refresh is printed after a blank line")
    p.set_defaults(func=cmd_status)
    return parser


def _duration(text: str) -> dt.timedelta:
    try:
        return dead.parse_duration(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_dead_filters(parser: argparse.ArgumentParser, *, older_than_required: bool) -> None:
    _add_database(parser)
    parser.add_argument("--reason", help="expired, too_large or invalid")
    parser.add_argument("--task", help="task name")
    parser.add_argument("--tag", help="tag")
    parser.add_argument("--queue", help="queue")
    parser.add_argument("--older-than", type=_duration, metavar="DURATION",
                        required=older_than_required,
                        help="only jobs dead for longer than this, e.g. 7d, 12h"
                        + (" (required; 0s for all)" if older_than_required else ""))


def _add_dead_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "dead",
        help="jobs that will never be published: list, requeue, purge",
        description="dead_jobs holds the jobs the drain set aside with a reason: "
        "'expired' (expires_at passed while staged), 'too_large' (over "
        "--max-message-size), 'invalid' (cannot become a Celery message).",
    )
    dead_sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = dead_sub.add_parser("list", help="show matching dead jobs, newest first")
    _add_dead_filters(q, older_than_required=False)
    q.add_argument("--limit", type=options.COUNT, default=50,
                   help="at most this many (default 50)")
    q.add_argument("--json", action="store_true", help="one JSON object per line")
    q.set_defaults(func=cmd_dead_list)
    q = dead_sub.add_parser(
        "requeue",
        help="move matching dead jobs back into staged_jobs",
        description="Move matching dead jobs back into staged_jobs, with their task id, "
        "due at once, with a fresh expiry (their original time to live, or "
        "--expires-in). Prints the count first; asks unless --yes.",
    )
    _add_dead_filters(q, older_than_required=False)
    q.add_argument("--expires-in", type=_duration, metavar="DURATION",
                   help="expire the requeued jobs this long from now")
    q.add_argument("--yes", action="store_true", help="do not ask (for scripts)")
    q.set_defaults(func=cmd_dead_requeue)
    q = dead_sub.add_parser(
        "purge",
        help="delete matching dead jobs for good",
        description="Delete matching dead jobs. Prints the count first; asks unless --yes.",
    )
    _add_dead_filters(q, older_than_required=True)
    q.add_argument("--yes", action="store_true", help="do not ask (for scripts)")
    q.set_defaults(func=cmd_dead_purge)


def _filters(args: argparse.Namespace) -> dead.Filters:
    return dead.Filters(reason=args.reason, task=args.task, tag=args.tag, queue=args.queue,
                        older_than=args.older_than)


def _confirm(what: str, count: int, filters: dead.Filters, yes: bool) -> bool:
    """Say how many jobs match; go ahead with --yes or an answer of y at a terminal."""
    print(f"{count} dead job(s) match ({filters.describe()})")
    if count == 0:
        return False
    if yes:
        return True
    if not sys.stdin.isatty():
        raise UsageError(f"refusing to {what} without --yes: standard input is not a terminal")
    answer = input(f"{what} them? [y/N] ").strip().lower()
    return answer in ("y", "yes")


def cmd_dead_list(args: argparse.Namespace) -> int:
    filters = _filters(args)
    with store.connect_plain(_settings(args)) as conn:
        total = dead.count(conn, filters)
        found = dead.rows(conn, filters, args.limit)
    if args.json:
        for row in found:
            print(json.dumps(row, default=str, sort_keys=True))
        return Exit.OK
    print(f"{total} dead job(s) match ({filters.describe()})"
          + (f"; the newest {len(found)}:" if found and len(found) < total else ""))
    for row in found:
        print(f"  {row['dead_at']:%Y-%m-%d %H:%M:%S}  {row['reason']:<9}  {row['task_name']}  "
              f"queue={row['queue']} tag={row['tag'] or '-'} task_id={row['task_id']}"
              + (f"\n      {row['detail']}" if row["detail"] else ""))
    return Exit.OK


def _act_on_dead(
    args: argparse.Namespace, what: str, act: Callable[[Any, dead.Filters], int], done: str
) -> int:
    """Count the matching dead jobs, confirm, act, and say how many were affected."""
    filters = _filters(args)
    with store.connect_plain(_settings(args)) as conn:
        if not _confirm(what, dead.count(conn, filters), filters, args.yes):
            return Exit.OK
        print(done.format(act(conn, filters)))
    return Exit.OK


def cmd_dead_requeue(args: argparse.Namespace) -> int:
    return _act_on_dead(
        args, "requeue", lambda conn, f: dead.requeue(conn, f, args.expires_in),
        "requeued {} job(s)",
    )


def cmd_dead_purge(args: argparse.Namespace) -> int:
    return _act_on_dead(args, "purge", dead.purge, "purged {} dead job(s)")


def cmd_processed_purge(args: argparse.Namespace) -> int:
    from drain.consumer import purge  # noqa: PLC0415

    with store.connect_plain(_settings(args)) as conn:
        conn.autocommit = True
        gone = purge(conn, args.older_than)
    print(f"purged {gone} processed task id(s) older than {dead.format_duration(args.older_than)}")
    return Exit.OK


def _settings(args: argparse.Namespace, **overrides: Any) -> config.Settings:
    values: dict[str, Any] = {"database_url": args.database_url}
    for name in ("broker_url", "batch_size", "pipeline", "poll_interval", "confirm_timeout",
                 "db_timeout",
                 "queue_declare", "lock_key", "queue_max_priority", "max_message_size",
                 "fetch_strategy", "rescan_interval", "lanes", "lane"):
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
    log.info("schema applied to %s", urls.mask_database_url(settings.database_url))
    return Exit.OK


def cmd_run(args: argparse.Namespace) -> int:
    from drain.runner import Drain  # noqa: PLC0415 - pika and celery load only for `run`

    settings = _settings(args)
    drain = Drain(settings, exit_when_empty=args.exit_when_empty)
    drain.install_signal_handlers()
    with contextlib.ExitStack() as stack:
        port = args.metrics_port
        if port == DEFAULT_METRICS_PORT and not _env("DRAIN_METRICS_PORT"):
            port += settings.lane  # the lanes of one host each get their own
        if port:
            from drain.metrics import Sampler  # noqa: PLC0415
            from drain.web import Server  # noqa: PLC0415

            sampler = Sampler(settings, drain.metrics, args.metrics_interval,
                              lambda: drain.published)
            server = Server(drain, sampler, args.metrics_host, port)
            sampler.start()
            stack.callback(sampler.stop)
            server.start()
            stack.callback(server.stop)
        drain.run()
    return Exit.OK


def cmd_stage(args: argparse.Namespace) -> int:
    from drain.staging import stage  # noqa: PLC0415

    job_args = _json_arg("--args", args.args)
    job_kwargs = _json_arg("--kwargs", args.kwargs)
    settings = _settings(args)
    with store.connect_plain(settings) as conn:
        task_id = stage(conn, args.task, job_args, job_kwargs,
                        queue=args.queue, task_id=args.task_id, priority=args.priority,
                        tag=args.tag, countdown=args.countdown, expires=args.expires)
    print(task_id)
    return Exit.OK


def _json_arg(flag: str, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise StagingError(f"{flag} is not valid JSON: {exc}") from None


def cmd_status(args: argparse.Namespace) -> int:
    settings = _settings(args)
    try:
        if args.watch is not None:
            return _watch_status(settings, args.json, args.watch)
        with store.connect_plain(settings) as conn:
            status = drain_status.read(conn, settings.lock_key)
        if args.json:
            print(json.dumps(status, indent=2, sort_keys=True))
        else:
            print("\n".join(_status_lines(status)))
        sys.stdout.flush()
    except BrokenPipeError:  # `drain status --watch | head`: the reader is done
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return Exit.OK


def _watch_status(settings: config.Settings, as_json: bool, every: float) -> int:
    """``drain status --watch``: redraw on a terminal, else print a block per refresh.

    A failed refresh (the database restarting, say) is shown and retried at
    the next one; Ctrl-C ends the watch with exit code 0 (in :func:`main`).
    """
    redraw = sys.stdout.isatty() and not as_json
    reader = drain_status.StatusReader(settings)
    # Ctrl-C ends the watch even if it was started with SIGINT ignored, as a
    # background job of a non-interactive shell is (Python then installs no
    # handler of its own).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    first = True
    try:
        while True:
            taken = dt.datetime.now(dt.timezone.utc)
            try:
                status: dict[str, Any] | None = reader.read()
                error = None
            except DrainError as exc:  # shown, and retried at the next refresh
                status, error = None, str(exc)
            if as_json:
                print(json.dumps(status if status is not None else {"error": error},
                                 sort_keys=True))
            else:
                header = (f"drain status at {taken:%Y-%m-%d %H:%M:%S} UTC "
                          f"(every {every:g}s; Ctrl-C to quit)")
                body = _status_lines(status) if status is not None else [f"error: {error}"]
                block = "\n".join([header, "", *body])
                if redraw:
                    print("\x1b[H\x1b[J" + block)
                else:
                    print(("" if first else "\n") + block)
            sys.stdout.flush()
            first = False
            time.sleep(every)
    finally:
        reader.close()


def _status_lines(status: dict[str, Any]) -> list[str]:
    """``drain status`` for people: what :func:`drain.status.read` returns."""
    estimated = status["backlog_estimated"]

    def count(n: int) -> str:
        return f"~{n:,}" if estimated else str(n)

    lines = []
    age = status["oldest_age_seconds"]
    delayed = f" ({count(status['delayed'])} delayed)" if status["delayed"] else ""
    lines.append(f"backlog: {count(status['backlog'])} staged job(s){delayed}"
                 + (f", oldest {_age(age)} old" if age is not None else ""))
    if status["sample"]:
        lines.append(f"  (estimated from the table statistics; groups scaled from a "
                     f"{status['sample']['percent']:g}% sample of its pages)")
    if status["by_group"]:
        lines.append(f"  {'queue':<20} {'tag':<24} {'task':<32} {'count':>9} "
                     f"{'delayed':>8} {'oldest':>8}")
        for g in status["by_group"]:
            oldest = _age(g["oldest_age_seconds"]) if g["oldest_age_seconds"] is not None else "-"
            lines.append(f"  {g['queue']:<20} {g['tag'] or '-':<24} {g['task']:<32} "
                         f"{count(g['count']):>9} {count(g['delayed']):>8} {oldest:>8}")
        shown, groups = len(status["by_group"]), status["group_count"]
        if groups > shown:
            lines.append(f"  ... the {shown} biggest of {groups} groups")
    dead_counts = status["dead_by_reason"]
    lines.append("dead letters: " + (", ".join(f"{reason} {n}" for reason, n in dead_counts.items())
                                     if dead_counts else "none"))
    lines.append(f"dead tuples in staged_jobs: {status['dead_tuples']:,}")
    lines.append("oldest transaction: " + _describe_transaction(status["oldest_transaction"]))
    lock = status["lock"]
    if lock["held"]:
        lines.append(f"drain: active, {_describe_holder(lock)}")
    elif not status["lanes"]:
        lines.append("drain: none active (no process holds the lock)")
    for lane_count, holders in status["lanes"].items():
        for holder in holders:
            what = _describe_holder(holder) if holder["held"] else "none active"
            lines.append(f"drain lane {holder['lane']} of {lane_count}: {what}")
    return lines


def _age(seconds: float) -> str:
    """3.2s, 5m03s, 2h05m, 3d04h."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def _describe_transaction(xact: dict[str, Any] | None) -> str:
    if xact is None:
        return "none open"
    who = f"pid {xact['pid']}" if xact["pid"] is not None else "a prepared transaction"
    app = f", application {xact['application_name']!r}" if xact["application_name"] else ""
    vacuum = "holds back vacuum" if xact["blocks_vacuum"] else "not holding back vacuum now"
    return f"{_age(xact['age_seconds'])} old, {who} ({xact['state'] or '?'}{app}); {vacuum}"


def _describe_holder(lock: dict[str, Any]) -> str:
    since = ""
    if lock.get("since"):
        held = dt.datetime.now(dt.timezone.utc) - dt.datetime.fromisoformat(lock["since"])
        since = f" since {lock['since']} ({_age(max(held.total_seconds(), 0.0))})"
    return (f"pid {lock['pid']} on {lock['host'] or '?'}{since} "
            f"(client {lock['client_addr'] or 'local socket'})")


def _configure_logging(verbose: bool, secrets: Sequence[str] = ()) -> None:
    """Log to stderr, every line (tracebacks too) scrubbed of ``secrets`` and of
    the passwords of any URL in it (:class:`drain.urls.ScrubbingFormatter`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(urls.ScrubbingFormatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s", list(secrets)))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    # pika logs every failed attempt at ERROR; drain logs one line per state change.
    logging.getLogger("pika").setLevel(logging.DEBUG if verbose else logging.CRITICAL)


_EXIT_CODES: Sequence[tuple[type[BaseException], Exit]] = (
    (SchemaMissing, Exit.SCHEMA),
    (DatabaseUnavailable, Exit.UNAVAILABLE),
    (BrokerUnavailable, Exit.UNAVAILABLE),
    (ConfigError, Exit.USAGE),
    (UsageError, Exit.USAGE),
    (StagingError, Exit.USAGE),
    (DrainError, Exit.ERROR),
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options.apply_env(args)
    secrets = _secrets(args)
    _configure_logging(args.verbose, secrets)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        _check_urls(args)
        return func(args)
    except KeyboardInterrupt:
        return Exit.OK
    except Exception as exc:
        code = next((c for t, c in _EXIT_CODES if isinstance(exc, t)), Exit.ERROR)
        if args.verbose:
            log.exception("drain %s failed", args.command)
        text = str(exc) if isinstance(exc, DrainError) else f"{type(exc).__name__}: {exc}"
        text = urls.scrub(text.strip().splitlines()[0] if text.strip() else text, secrets)
        print(f"drain: error: {text}", file=sys.stderr)
        return int(code)


#: URLs of the Spark commands besides --database-url (a jdbc: URL goes to JDBC as it is).
_OTHER_DATABASE_URLS = (("source_url", "--source-url"), ("downstream_url", "--downstream-url"))


def _check_urls(args: argparse.Namespace) -> None:
    """Refuse a malformed URL before anything starts (Spark in particular), without
    showing it. The other commands check theirs in :class:`drain.config.Settings`."""
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


def _secrets(args: argparse.Namespace) -> list[str]:
    """Passwords in the URLs given, so that no error message or log line can show them
    (:func:`drain.urls.secrets_of`: malformed URLs too; never raises)."""
    found = urls.secrets_of(getattr(args, "database_url", "") or "",
                              getattr(args, "broker_url", "") or "")
    for name, _ in _OTHER_DATABASE_URLS:
        found += urls.secrets_of(getattr(args, name, None) or "")
    return found


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

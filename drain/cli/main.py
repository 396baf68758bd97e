"""The ``drain`` command: migrate, run, stage, status.

Every option can also be set by environment variable (named in ``--help``);
a flag wins over the variable, the variable over the default. Errors print
one line on stderr and exit with a code from :class:`Exit`; ``-v`` adds the
traceback and debug logging.

This module builds the parser (:func:`build_parser`), runs a command
(:func:`main`) and has ``migrate``, ``run`` and ``stage``; ``drain dead`` and
``drain processed`` are in :mod:`drain.cli.dead`, ``drain status`` in
:mod:`drain.cli.status`, ``drain backfill`` and ``drain reconcile`` in
:mod:`drain.cli.spark`, and what they all share in :mod:`drain.cli.common`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from drain import version
from drain.cli import dead as cli_dead
from drain.cli import operate as cli_operate
from drain.cli import spark as spark_cli
from drain.cli import staged as cli_staged
from drain.cli import status as cli_status
from drain.cli.common import (
    ENV_NOTE,
    EXIT_CODES,
    Exit,
    add_database,
    add_lock_key,
    check_urls,
    configure_logging,
    env,
    require_database,
    secrets_in,
    settings_of,
    switch,
)
from drain.errors import DrainError, StagingError, UsageError
from drain.postgres import migration, session, sql
from drain.settings import config, options, urls

log = logging.getLogger("drain")

__all__ = [
    "DEFAULT_METRICS_PORT",
    "ENV_NOTE",
    "Exit",
    "UsageError",
    "build_parser",
    "cmd_migrate",
    "cmd_run",
    "cmd_stage",
    "main",
]

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
    add_database(p)
    p.add_argument(
        "--broker-url",
        # None when neither is given: then the app's URL (--app), else the default.
        default=env("DRAIN_BROKER_URL"),
        metavar="URL",
        help="RabbitMQ URL, Celery style: amqp://user:pass@host:5672// ('//' is the vhost "
        "'/'), or a failover list of them separated by ';' as in Celery's broker_url "
        "(quote it in a shell): the drain connects to the first that answers and, when the "
        "one in use fails, to the next (round-robin; with --app, as the app's "
        "broker_failover_strategy says). Given, it wins over the app's broker_url and "
        "broker_write_url; the app's broker_use_ssl, broker_login_method, broker_heartbeat "
        "and broker_connection_timeout apply either way (env DRAIN_BROKER_URL; default: "
        f"with --app the app's broker URL, else {config.DEFAULT_BROKER_URL})",
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
        help=f"batches' worth of messages in flight, 1 to {config.MAX_PIPELINE}: the next "
        "batch is fetched and published while at most N - 1 batches' worth are "
        "unconfirmed. A crash republishes at most N x batch size jobs (same task ids); "
        "1 overlaps nothing",
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
        help="abandon a batch (rows stay staged) when the broker confirms none of it "
             "for this long",
    )
    options.add(
        p, "--broker-heartbeat", env="DRAIN_BROKER_HEARTBEAT", default=30,
        parse=options.Number(whole=True, low=1, high=config.MAX_HEARTBEAT),
        metavar="SECONDS",
        help="the AMQP heartbeat when --app sets no broker_heartbeat or 0 (the app's own "
        f"is cut to {config.MAX_HEARTBEAT}): a broker that dies silently, even while it "
        "blocks publishing, is noticed within 2 x (this + 5) s",
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
        default=env("DRAIN_QUEUE_DECLARE", "celery"),
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
        default=env("DRAIN_FETCH_STRATEGY", "keyset"),
        help="keyset (default): start each priority's scan at a low-water mark, so the "
        "dead rows a long-running transaction keeps from vacuum cost nothing (see "
        "drain/postgres/keyset.py); head: scan from the head of the index every batch, only for "
        "comparison (env DRAIN_FETCH_STRATEGY)",
    )
    options.add(
        p, "--rescan-interval", env="DRAIN_RESCAN_INTERVAL", default=300.0,
        parse=options.SECONDS_OR_ZERO,
        metavar="SECONDS",
        help="with the keyset fetch, rescan from the head of the index this often: a "
        "belt-and-braces backstop, which the low-water marks do not rely on; 0: never",
    )
    p.add_argument(
        "--trace-context",
        choices=("child", "link", "none"),
        default=env("DRAIN_TRACE_CONTEXT", "child"),
        help="OpenTelemetry (docs/tracing.md): child (default): a job's publish span, and "
        "the worker's span after it, join the trace of the code that staged it; link: "
        "they start a new trace linked to it; none: the staging context is not used "
        "(env DRAIN_TRACE_CONTEXT)",
    )
    options.add(
        p, "--trace-new-after", env="DRAIN_TRACE_NEW_AFTER", default=300.0,
        parse=options.POSITIVE_SECONDS,
        metavar="SECONDS",
        help="a job staged longer ago than this (delayed, or kept while the drain or the "
        "broker was down) starts a new trace linked to its staging context, so that no "
        "trace spans hours",
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
        default=env("DRAIN_METRICS_HOST", "127.0.0.1"),
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
    p.add_argument(
        "--app",
        dest="celery_app",
        default=env("DRAIN_CELERY_APP", ""),
        metavar="MODULE[:ATTR]",
        help="your Celery app, as for `celery -A` (imported from the current directory "
        "and PYTHONPATH): each job goes to the exchange, routing key and queue its "
        "apply_async would use (task_routes, task_queues, the task's own options), with "
        "the task's time limits and priority, and queues are declared as the app "
        "declares them; jobs of tasks it does not register go to dead_jobs "
        "('unknown_task'); its broker settings apply too (see --broker-url) "
        "(env DRAIN_CELERY_APP; default: none, every job goes to its "
        "own queue through the default exchange)",
    )
    p.add_argument(
        "--allow-unknown-tasks",
        action="store_true",
        default=switch(env("DRAIN_ALLOW_UNKNOWN_TASKS", "") or ""),
        help="with --app: publish jobs of tasks the app does not register, routed as "
        "its send_task would, instead of dead-lettering them (env DRAIN_ALLOW_UNKNOWN_TASKS)",
    )
    add_lock_key(p)
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
        "3 database or broker unavailable, 4 schema missing (run `drain migrate`), "
        "5 permission denied (the database role lacks a grant), 7 the schema is of a newer "
        "drain (`drain migrate --check`).",
    )
    parser.add_argument("--version", action=version.VersionAction)
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="debug logging and tracebacks on errors"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "migrate",
        help="apply staging_schema.sql to the database (idempotent)",
        description="Create or update staged_jobs, its NOTIFY trigger and this database's "
        "four group roles, PREFIX + stager, runner, operator and consumer (it only ever adds "
        "grants, but for a move to another prefix). Run it as the role that owns the tables. "
        "Safe to run any number of times, also while drains run. It prints the roles' names.",
        epilog="Roles belong to the whole Postgres cluster, grants to one database: each "
        "database gets roles of its own, <database>_drain_* by default, drain_* for a "
        "database an older drain migrated. Roles that already hold privileges in another "
        "database are refused (exit 2). docs/running.md, \"Database roles\".",
    )
    add_database(p)
    p.add_argument(
        "--role-prefix", default=env("DRAIN_ROLE_PREFIX") or None, metavar="PREFIX",
        help="name this database's group roles PREFIX + stager/runner/operator/consumer "
        "(env DRAIN_ROLE_PREFIX; default: the prefix this database has, else "
        "<database name>_drain_). A new prefix moves the grants: the old roles lose them here")
    p.add_argument("--print", action="store_true", help="print the schema SQL, apply nothing")
    p.add_argument("--check", action="store_true",
                   help="apply nothing; exit 0 when the database's schema is this drain's "
                   "version, 4 when it needs `drain migrate`, 7 when a newer drain migrated "
                   "it (one line on stderr, for deploy pipelines)")
    p.set_defaults(func=cmd_migrate)

    _add_run_parser(sub)

    p = sub.add_parser(
        "stage",
        help="stage one job (for operators; apps stage in their own transaction)",
        description="Insert one row into staged_jobs and commit; prints the task id.",
    )
    add_database(p)
    p.add_argument("task", help="Celery task name, e.g. search.index_annotation")
    p.add_argument("--args", default="[]", metavar="JSON", help="positional args, a JSON array")
    p.add_argument("--kwargs", default="{}", metavar="JSON", help="keyword args, a JSON object")
    p.add_argument("--queue", default=None,
                   help="Celery queue (default: none given: `drain run --app` routes the job "
                   "as the app would, a drain without --app sends it to celery)")
    p.add_argument("--task-id", default=None, help="task id (default: a new UUID)")
    p.add_argument("--priority", type=options.Number(whole=True, low=-32768, high=32767),
                   default=0, help="higher first, -32768 to 32767 (default 0)")
    p.add_argument("--tag", default=None, help="who staged it, e.g. ops.manual")
    p.add_argument("--countdown", type=options.SECONDS_OR_ZERO, default=None, metavar="SECONDS",
                   help="not before this many seconds from now")
    p.add_argument("--expires", type=options.SECONDS_OR_ZERO, default=None, metavar="SECONDS",
                   help="dead-letter instead of publishing after this many seconds")
    p.set_defaults(func=cmd_stage)

    cli_dead.add_dead_parser(sub)
    spark_cli.add_parsers(sub)

    cli_dead.add_processed_parser(sub)
    cli_status.add_parser(sub)
    cli_operate.add_parsers(sub)
    cli_staged.add_parser(sub)
    return parser


def cmd_migrate(args: argparse.Namespace) -> int:
    if args.print:
        sys.stdout.write(sql.schema_text())
        return Exit.OK
    if args.role_prefix is not None:
        migration.check_role_prefix(args.role_prefix)  # before connecting
    settings = settings_of(args)
    with session.connect_plain(settings) as conn:
        if args.check:
            log.info("%s: %s", session.connected_to(conn), migration.check(conn))
            return Exit.OK
        prefix = migration.migrate(conn, role_prefix=args.role_prefix)
        log.info("schema applied to %s; its roles: %s", session.connected_to(conn),
                 ", ".join(migration.role_names(prefix)))
    return Exit.OK


def cmd_run(args: argparse.Namespace) -> int:
    from drain.daemon.runner import Drain  # noqa: PLC0415 - pika and celery load only for `run`

    settings = settings_of(args)
    drain = Drain(settings, exit_when_empty=args.exit_when_empty)
    drain.install_signal_handlers()
    fatal: list[DrainError] = []  # what stopped the metrics sampler for good

    def sampler_failed(exc: DrainError) -> None:
        fatal.append(exc)
        drain.stop()

    with contextlib.ExitStack() as stack:
        port = args.metrics_port
        if port == DEFAULT_METRICS_PORT and not env("DRAIN_METRICS_PORT"):
            port += settings.lane  # the lanes of one host each get their own
        if port:
            from drain.daemon.metrics import Sampler  # noqa: PLC0415
            from drain.daemon.web import Server  # noqa: PLC0415

            sampler = Sampler(settings, drain.metrics, args.metrics_interval,
                              lambda: drain.published, on_fatal=sampler_failed)
            server = Server(drain, sampler, args.metrics_host, port)
            sampler.start()
            stack.callback(sampler.stop)
            server.start()
            stack.callback(server.stop)
        drain.run()
    if fatal:  # a grant the sampler lacks: exit code 5
        raise fatal[0]
    return Exit.OK


def cmd_stage(args: argparse.Namespace) -> int:
    from drain.staging import stage  # noqa: PLC0415

    job_args = _json_arg("--args", args.args)
    job_kwargs = _json_arg("--kwargs", args.kwargs)
    settings = settings_of(args)
    with session.connect_plain(settings) as conn:
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


#: What a command's role needs, said when the database refuses it something.
_BACKFILL_GRANT = ("a backfill's role needs INSERT on staged_jobs and SELECT, INSERT, UPDATE "
                   "on drain_backfill_ledger and drain_backfill_attempts, SELECT, INSERT on "
                   "drain_backfills")
_NEEDS = {"run": session.RUNNER_GRANT, "status": session.RUNNER_GRANT,
          "migrate": "run `drain migrate` as the role that owns the tables",
          "backfill": _BACKFILL_GRANT, "reconcile": _BACKFILL_GRANT}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options.apply_env(args)
    secrets = secrets_in(args)
    configure_logging(args.verbose, secrets)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        check_urls(args)
        if not getattr(args, "print", False):  # `drain migrate --print` connects to none
            require_database(args)
        return func(args)
    except KeyboardInterrupt:
        return Exit.OK
    except Exception as exc:
        if isinstance(exc, psycopg.Error):  # the one-shot commands' own queries
            shown = urls.mask_database_url(getattr(args, "database_url", ""))
            needs = _NEEDS.get(args.command, session.OPERATOR_GRANT)
            exc = session.refusal(exc, shown, needs) or exc
        code = next((c for t, c in EXIT_CODES if isinstance(exc, t)), Exit.ERROR)
        if args.verbose:
            log.exception("drain %s failed", args.command)
        text = str(exc) if isinstance(exc, DrainError) else f"{type(exc).__name__}: {exc}"
        text = urls.scrub(text.strip().splitlines()[0] if text.strip() else text, secrets)
        print(f"drain: error: {text}", file=sys.stderr)
        return int(code)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``drain pause``, ``drain resume``, ``drain pauses`` and ``drain audit``.

Publishing paused for a queue or a task, by an operator, in the database
(drain.postgres.pauses): every drain replica obeys it from its next batch,
staging goes on, and the jobs stay staged until ``drain resume``. Each pause
and resume writes its ``drain_audit`` row in its own transaction
(drain.postgres.audit), as ``drain dead requeue`` and ``purge`` do;
``drain audit`` lists them. :func:`add_parsers` registers the commands for
:func:`drain.cli.main.build_parser`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
import uuid
from typing import Any

from drain import redaction
from drain.celery import celery_app, message, routing
from drain.cli.common import Exit, add_database, duration, env, settings_of
from drain.daemon.tracing import Tracing
from drain.errors import UsageError
from drain.postgres import audit, detail, pauses, session
from drain.postgres.rows import StagedRow
from drain.settings import options


def add_actor(parser: argparse.ArgumentParser) -> None:
    """``--actor``: who the audit says acted."""
    parser.add_argument(
        "--actor", default=None, metavar="NAME",
        help="who acts, as drain_audit records it (default: the operating system's "
        "user@host; the database role is recorded as well)")


def add_redact(parser: argparse.ArgumentParser) -> None:
    """``--redact``: the hook that redacts arguments before they are shown."""
    parser.add_argument(
        "--redact", default=env("DRAIN_REDACT") or None, metavar="MODULE:FUNCTION",
        help="show the arguments as redact(task_name, args, kwargs) returns them (env "
        "DRAIN_REDACT; drain.redaction); if it fails, no argument is shown")


def why(text: str) -> str:
    """A ``--why``: some words, not blank."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must say why, in some words (it goes in the audit)")
    return text


def _add_target(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--queue", metavar="QUEUE",
                        help="the queue jobs are declared into (with `drain run --app`, where "
                        "the app routes them)")
    target.add_argument("--task", metavar="TASK", help="the task name, in every queue")


def add_parsers(sub: Any) -> None:
    """Register ``pause``, ``resume``, ``pauses`` and ``audit`` on ``drain``'s subparsers."""
    p = sub.add_parser(
        "pause",
        help="stop publishing a queue's or a task's jobs until `drain resume`",
        description="Pause publishing the jobs of one queue (--queue) or one task (--task): "
        "every drain obeys it from its next batch, staging goes on, and the jobs stay "
        "staged until `drain resume`. Jobs whose expiry passes meanwhile are moved to "
        "dead_jobs ('expired') as usual. The pause and its audit row commit together.",
        epilog="With `drain run --app`, a queue is where the app routes the job; a job "
        "routed to an exchange with no queue declared is paused by its task.",
    )
    add_database(p)
    _add_target(p)
    p.add_argument("--why", required=True, type=why, metavar="TEXT",
                   help="why (required; shown by `drain status` and kept in the audit)")
    add_actor(p)
    p.set_defaults(func=cmd_pause)

    p = sub.add_parser(
        "resume",
        help="publish a paused queue's or task's jobs again",
        description="End a pause of `drain pause`: every drain publishes the jobs again "
        "from its next batch. The resume and its audit row commit together.",
    )
    add_database(p)
    _add_target(p)
    p.add_argument("--why", type=why, metavar="TEXT", help="why (kept in the audit)")
    add_actor(p)
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("pauses", help="list the queues and tasks paused by operators",
                       description="List the pauses of `drain pause`: what, why, by whom, "
                       "since when.")
    add_database(p)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_pauses)

    p = sub.add_parser(
        "audit",
        help="what operators did: pauses, resumes, requeues and purges",
        description="List drain_audit, newest first: each action of `drain pause`, "
        "`resume`, `dead requeue` and `dead purge` (and the console's), with who, the "
        "database role, what, how many rows and why.",
    )
    add_database(p)
    p.add_argument("--action", choices=audit.ACTIONS, help="only this action")
    p.add_argument("--since", type=duration, metavar="DURATION",
                   help="only the last DURATION, e.g. 1d, 12h")
    p.add_argument("--limit", type=options.COUNT, default=50,
                   help="at most this many (default 50)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_audit)


    p = sub.add_parser(
        "show",
        help="one job in full by its task id: every column, and the message it gets",
        description="Show every staged or dead row of a task id: every column, its trace id, "
        "why it died (the broker's reply among them), and the message the drain publishes "
        "for it (a dead one: once requeued): exchange, routing key, headers, properties.",
    )
    add_database(p)
    p.add_argument("task_id", type=task_id, metavar="TASK_ID", help="the task id (a UUID)")
    p.add_argument("--app", default=None, metavar="MODULE:APP",
                   help="route it as `drain run --app` does (default: as a drain without --app)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    add_redact(p)
    p.set_defaults(func=cmd_show)


def task_id(text: str) -> uuid.UUID:
    """A task id argument: a UUID (a usage error if not)."""
    try:
        return uuid.UUID(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a task id (a UUID): {text!r}") from None


def _target(args: argparse.Namespace) -> tuple[str, str]:
    """The ``--queue`` or ``--task`` given (drain.postgres.pauses checks its name)."""
    return ("queue", args.queue) if args.queue is not None else ("task", args.task)


def actor_of(args: argparse.Namespace) -> str:
    return str(args.actor) if args.actor else audit.default_actor()


def cmd_pause(args: argparse.Namespace) -> int:
    kind, name = _target(args)
    with session.connect_plain(settings_of(args)) as conn:
        made = pauses.pause(conn, kind, name, reason=args.why, actor=actor_of(args))
        if made is None:
            now = next(p for p in pauses.current(conn) if (p.kind, p.name) == (kind, name))
            print(f"{kind} {name!r} is already paused, since {now.paused_at:%Y-%m-%d %H:%M:%S %Z} "
                  f"by {now.paused_by}: {now.reason} (nothing changed)")
            return Exit.OK
    print(f"paused {kind} {name!r}: every drain leaves its jobs staged from its next batch "
          f"(`drain resume --{kind} {name}` ends it)")
    return Exit.OK


def cmd_resume(args: argparse.Namespace) -> int:
    kind, name = _target(args)
    with session.connect_plain(settings_of(args)) as conn:
        ended = pauses.resume(conn, kind, name, reason=args.why, actor=actor_of(args))
    if ended is None:
        print(f"{kind} {name!r} was not paused (nothing changed)")
    else:
        print(f"resumed {kind} {name!r} (paused since {ended.paused_at:%Y-%m-%d %H:%M:%S %Z} "
              f"by {ended.paused_by}): every drain publishes its jobs from its next batch")
    return Exit.OK


def cmd_pauses(args: argparse.Namespace) -> int:
    with session.connect_plain(settings_of(args)) as conn:
        found = pauses.current(conn)
    if args.json:
        for pause in found:
            print(json.dumps(pause.as_json(), sort_keys=True))
        return Exit.OK
    if not found:
        print("nothing paused")
    for pause in found:
        print(f"{pause.kind} {pause.name!r}: paused since "
              f"{pause.paused_at:%Y-%m-%d %H:%M:%S %Z} by {pause.paused_by}: {pause.reason}")
    return Exit.OK


def cmd_audit(args: argparse.Namespace) -> int:
    with session.connect_plain(settings_of(args)) as conn:
        found = audit.entries(conn, limit=args.limit, action=args.action, since=args.since)
    if args.json:
        for entry in found:
            print(json.dumps({**entry, "at": entry["at"].isoformat()}, sort_keys=True))
        return Exit.OK
    if not found:
        print("no actions recorded" + (" that match" if args.action or args.since else ""))
    for entry in found:
        target = ", ".join(f"{k}={v}" for k, v in sorted(entry["target"].items())) or "-"
        count = "" if entry["count"] is None else f" {entry['count']} row(s)"
        print(f"{entry['at']:%Y-%m-%d %H:%M:%S %Z}  {entry['action']:<8} {target}{count}  "
              f"by {entry['actor']} (role {entry['db_role']})"
              + (f": {entry['reason']}" if entry["reason"] else ""))
    return Exit.OK


def cmd_show(args: argparse.Namespace) -> int:
    with session.connect_plain(settings_of(args)) as conn:
        found = detail.find(conn, args.task_id)
    if not found:
        raise UsageError(f"no staged or dead job has task id {args.task_id}")
    router = routing.AppRouter(celery_app.load(args.app)) if args.app else None
    redactor = redaction.load(args.redact)
    for job in found:
        # Redacted before anything is shown or built: the headers repeat the arguments.
        job["args"], job["kwargs"] = redaction.shown(redactor, job["task_name"], job["args"],
                                                     job["kwargs"])
        shown: dict[str, Any] = {
            k: v.isoformat() if isinstance(v, dt.datetime) else v for k, v in job.items()}
        shown["trace_id"] = _trace_id(job["trace"])
        shown["message"] = _message(detail.as_staged_row(job), router)
        if args.json:
            print(json.dumps(shown, sort_keys=True, default=str))
            continue
        print(f"{job['state']} job {job['task_id']} (row id {job['id']})")
        for key in ("task_name", "args", "kwargs", "queue", "priority", "tag", "staged_at",
                    "not_before", "expires_at", "embed", "trace_id", "reason", "detail",
                    "dead_at"):
            if key in shown:
                value = shown[key]
                empty = "(none given)" if key == "queue" else "-"
                print(f"  {key:<11} {empty if value is None else value}")
        built: dict[str, Any] = shown["message"]
        if "error" in built:
            print(f"  the message: cannot be built: {built['error']}")
            continue
        print(f"  the message{' once requeued' if job['state'] == 'dead' else ''}: exchange "
              f"{built['exchange']!r}, routing key {built['routing_key']!r}")
        for part in ("headers", "properties"):
            print(f"  {part:<11} {json.dumps(built[part], sort_keys=True, default=str)}")
    return Exit.OK


def _trace_id(trace: str | None) -> str | None:
    """The trace id in a job's staged OpenTelemetry context (its traceparent)."""
    if not trace:
        return None
    parent = json.loads(trace).get("traceparent")
    parts = parent.split("-") if isinstance(parent, str) else []
    return parts[1] if len(parts) == 4 else None


def _message(row: StagedRow, router: routing.AppRouter | None) -> dict[str, Any]:
    """The message the drain publishes for ``row``: where to and with what."""
    try:
        destination = router.destination(row) if router is not None else None
        now = time.time()
        # The trace headers a drain with the default --trace-context sends, without
        # an OpenTelemetry SDK (with one, its own span's instead).
        traced = Tracing().message(row, destination, now)
        built = message.build(row, origin=message.origin(), reply_to="(the drain's own)",
                              destination=destination, now=now,
                              trace=None if traced is None else traced.headers)
    except Exception as exc:  # what the drain would dead-letter as invalid
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"exchange": built.exchange, "routing_key": built.routing_key,
            "headers": built.headers, "properties": built.properties}

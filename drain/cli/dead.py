"""``drain dead ...`` and ``drain processed purge``: the tables drain leaves to clean up.

``drain dead list|requeue|purge`` look at and act on dead_jobs, the jobs the
drain set aside (:mod:`drain.postgres.dead` has the queries); ``drain processed purge``
trims drain_processed, the consumers' record of processed task ids
(:mod:`drain.consumer`). Each registers its parser here
(:func:`add_dead_parser`, :func:`add_processed_parser`) for
:func:`drain.cli.main.build_parser`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Callable
from typing import Any

from drain import redaction
from drain.cli.common import Exit, add_database, duration, settings_of
from drain.cli.operate import actor_of, add_actor, add_redact, task_id, why
from drain.errors import UsageError
from drain.limits import MAX_EXPIRES
from drain.postgres import dead, session
from drain.settings import options

#: Dead jobs a requeue or purge moves per transaction (``--chunk``).
CHUNK = 10_000
#: The most dead jobs one requeue or purge may act on (``--max``).
MAX_ROWS = 1_000_000


def _add_bulk(parser: argparse.ArgumentParser) -> None:
    """The flags of a requeue or purge by filter: dry run, confirmation, chunks, limit."""
    parser.add_argument("--yes", action="store_true", help="do not ask (for scripts)")
    parser.add_argument("--dry-run", action="store_true",
                        help="only count, and print a --confirm token bound to these filters "
                        "and that count")
    parser.add_argument("--confirm", metavar="TOKEN",
                        help="act, without asking, on exactly what the --dry-run that printed "
                        "TOKEN counted (refused if that is no longer so)")
    parser.add_argument("--chunk", type=options.COUNT, default=CHUNK, metavar="N",
                        help=f"move at most N jobs per transaction, each with its audit row "
                        f"(default {CHUNK:,})")
    parser.add_argument("--max", type=options.COUNT, default=MAX_ROWS, metavar="N",
                        help=f"refuse to act on more than N jobs (default {MAX_ROWS:,})")


def _add_dead_filters(parser: argparse.ArgumentParser, *, older_than_required: bool) -> None:
    add_database(parser)
    parser.add_argument("--reason", help="expired, too_large, invalid, unknown_task or refused")
    parser.add_argument("--task", help="task name")
    parser.add_argument("--tag", help="tag")
    parser.add_argument("--queue", help="queue")
    parser.add_argument("--task-id", type=task_id, metavar="UUID", help="task id")
    parser.add_argument("--older-than", type=duration, metavar="DURATION",
                        required=older_than_required,
                        help="only jobs dead for longer than this, e.g. 7d, 12h"
                        + (" (required; 0s for all)" if older_than_required else ""))


def add_dead_parser(sub: Any) -> None:
    """Register ``drain dead`` and its actions on ``drain``'s subparsers."""
    p = sub.add_parser(
        "dead",
        help="jobs that will never be published: list, requeue, purge",
        description="dead_jobs holds the jobs the drain set aside with a reason: "
        "'expired' (expires_at passed while staged), 'too_large' (over "
        "--max-message-size), 'invalid' (cannot become a Celery message), 'unknown_task' "
        "(with --app: the app registers no such task), 'refused' (the broker refused "
        "its publish, e.g. 404 no exchange; the detail is the broker's reply).",
    )
    dead_sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = dead_sub.add_parser("list", help="show matching dead jobs, newest first")
    _add_dead_filters(q, older_than_required=False)
    q.add_argument("--limit", type=options.COUNT, default=50,
                   help="at most this many (default 50)")
    q.add_argument("--json", action="store_true", help="one JSON object per line")
    add_redact(q)
    q.set_defaults(func=cmd_dead_list)
    q = dead_sub.add_parser(
        "requeue",
        help="move matching dead jobs back into staged_jobs",
        description="Move matching dead jobs back into staged_jobs, with their task id, "
        "due at once, with a fresh expiry (their original time to live, or "
        "--expires-in). A job whose expiry was at or before its due time has no time "
        "to live to give again: without --expires-in, such jobs make the requeue refuse "
        "(exit code 2, nothing moved). Prints the count first; asks unless --yes.",
    )
    _add_dead_filters(q, older_than_required=False)
    q.add_argument("--expires-in", type=duration, metavar="DURATION",
                   help="expire the requeued jobs this long from now, at most 3650d (needed "
                   "for jobs that expired at or before they were due)")
    q.add_argument("--new-task-id", action="store_true",
                   help="give each a new task id: it runs again even where a worker that "
                   "dedupes by task id (drain.consumer) already ran it (default: each keeps "
                   "its own, and such a worker skips it)")
    _add_bulk(q)
    q.add_argument("--why", type=why, metavar="TEXT", help="why (kept in the audit)")
    add_actor(q)
    q.set_defaults(func=cmd_dead_requeue)
    q = dead_sub.add_parser(
        "purge",
        help="delete matching dead jobs for good",
        description="Delete matching dead jobs. Prints the count first; asks unless --yes. "
        "The purge and its drain_audit row (`drain audit`) commit together.",
    )
    _add_dead_filters(q, older_than_required=True)
    _add_bulk(q)
    q.add_argument("--why", required=True, type=why, metavar="TEXT",
                   help="why they go (required; kept in the audit)")
    add_actor(q)
    q.set_defaults(func=cmd_dead_purge)


def _filters(args: argparse.Namespace) -> dead.Filters:
    return dead.Filters(reason=args.reason, task=args.task, tag=args.tag, queue=args.queue,
                        older_than=args.older_than, task_id=args.task_id)


def _confirm(what: str, count: int, yes: bool) -> bool:
    """Go ahead (with some jobs) on --yes or an answer of y at a terminal."""
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
    with session.connect_plain(settings_of(args)) as conn:
        total, found = dead.listing(conn, filters, args.limit)
    if args.json:
        redactor = redaction.load(args.redact)
        for row in found:
            row["args"], row["kwargs"] = redaction.shown(redactor, row["task_name"],
                                                         row["args"], row["kwargs"])
            print(_json_line(row))
        return Exit.OK
    many = f"more than {dead.COUNT_CAP:,}" if total > dead.COUNT_CAP else str(total)
    print(f"{many} dead job(s) match ({filters.describe()})"
          + (f"; the newest {len(found)}:" if found and len(found) < total else ""))
    for row in found:
        print(f"  {row['dead_at']:%Y-%m-%d %H:%M:%S}  {row['reason']:<9}  {row['task_name']}  "
              f"queue={row['queue']} tag={row['tag'] or '-'} task_id={row['task_id']}"
              + (f"\n      {row['detail']}" if row["detail"] else ""))
    return Exit.OK


#: Columns :func:`drain.postgres.dead.rows` gives as JSON text, written into the line as they are.
_JSON_TEXT = ("args", "kwargs")


def _json_line(row: dict[str, Any]) -> str:
    """One dead job as a JSON object, sorted keys; args and kwargs as the database's
    JSON text, so no value is lost or refused (a 5,000-digit integer stays one)."""
    return "{" + ", ".join(
        f"{json.dumps(key)}: "
        + (value if key in _JSON_TEXT else json.dumps(value, default=str))
        for key, value in sorted(row.items())
    ) + "}"


def _act_on_dead(
    args: argparse.Namespace, what: str,
    act: Callable[[Any, dead.Filters, int], int], done: str,
) -> int:
    """Count the matching dead jobs, confirm, act on exactly those, and say how many
    were affected. The action is bound to what was shown: the jobs dead-lettered
    while the question was open are left alone (dead.Filters.upto), and if the
    shown ones are no longer all there, nothing is done (dead.ChangedSinceShown).
    No transaction stays open while the operator reads the question."""
    filters = _filters(args)
    with session.connect_plain(settings_of(args)) as conn:
        if what == "requeue" and args.expires_in is None:
            dead.refuse_without_time_to_live(conn, filters)  # before asking
        # The token binds the options that change what the action does, too.
        bound_to = what + (" --new-task-id" if getattr(args, "new_task_id", False) else "")
        if args.confirm is not None:
            count, bound = dead.confirmed(bound_to, filters, args.confirm)
            now, _ = dead.shown(conn, bound)
            dead.exactly(f"{what}d", now, count)
        else:
            count, bound = dead.shown(conn, filters)
        conn.rollback()  # nothing read stays locked or held while the operator answers
        print(f"{count:,} dead job(s) match ({filters.describe()})")
        if what == "requeue" and count:
            print("each gets a new task id: it runs again, even where it already ran"
                  if args.new_task_id else "each keeps its task id: a worker that dedupes by "
                  "task id (drain.consumer) skips one it already processed")
        if count > args.max:
            raise UsageError(f"{count:,} dead jobs match, more than --max {args.max:,}: narrow "
                             "the filters, or raise --max")
        if args.dry_run:
            if count:
                print(f"to {what} exactly these: the same command with --confirm "
                      f"{dead.token(bound_to, bound, count)}")
            return Exit.OK
        if not _confirm(what, count, args.yes or args.confirm is not None):
            return Exit.OK
        if count <= args.chunk:
            print(done.format(act(conn, bound, count)))
            return Exit.OK
        total = 0
        try:
            for chunk, expect in dead.chunks(conn, bound, args.chunk):
                total += act(conn, chunk, expect)
                print(done.format(f"{total:,} of {count:,}"), flush=True)
            dead.exactly(f"{what}d", total, count)
        except dead.ChangedSinceShown as exc:
            raise dead.ChangedSinceShown(
                f"{total:,} of the {count:,} were {what}d, in the chunks before; then {exc}"
            ) from None
    return Exit.OK


def cmd_dead_requeue(args: argparse.Namespace) -> int:
    if args.expires_in is not None and args.expires_in > MAX_EXPIRES:
        raise UsageError(
            f"--expires-in is more than {MAX_EXPIRES.days:,} days: RabbitMQ refuses a message "
            "that expires later (406 PRECONDITION_FAILED); leave it out to keep each job's "
            "own time to live")
    return _act_on_dead(
        args, "requeue", lambda conn, f, shown: dead.requeue(
            conn, f, args.expires_in, shown, act=dead.Act(actor_of(args), args.why),
            new_task_ids=args.new_task_id),
        "requeued {} job(s)",
    )


def cmd_dead_purge(args: argparse.Namespace) -> int:
    return _act_on_dead(args, "purge", lambda conn, f, shown: dead.purge(
        conn, f, shown, act=dead.Act(actor_of(args), args.why)), "purged {} dead job(s)")


def add_processed_parser(sub: Any) -> None:
    """Register ``drain processed purge`` on ``drain``'s subparsers."""
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
    add_database(q)
    q.add_argument("--older-than", required=True, type=_record_age, metavar="DURATION",
                   help="e.g. 7d, 12h, 90m; more than 0s (a record purged while a copy of its "
                   "job can still arrive lets that copy run again, so there is no 'purge all')")
    q.set_defaults(func=cmd_processed_purge)


def _record_age(text: str) -> dt.timedelta:
    """--older-than of ``drain processed purge``: a duration above zero (a usage error if not)."""
    age = duration(text)
    if age <= dt.timedelta(0):
        raise argparse.ArgumentTypeError(
            f"must be more than 0s, got {text!r}: every record would go, and a copy of a "
            "job still in a queue or being retried would run again"
        )
    return age


def cmd_processed_purge(args: argparse.Namespace) -> int:
    from drain.consumer import purge  # noqa: PLC0415

    with session.connect_plain(settings_of(args)) as conn:
        conn.autocommit = True
        gone = purge(conn, args.older_than)
    print(f"purged {gone} processed task id(s) older than {dead.format_duration(args.older_than)}")
    return Exit.OK

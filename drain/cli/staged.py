"""``drain staged list``: the jobs at the head of the backlog, filtered (drain.postgres.staged)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from drain import redaction
from drain.cli.common import Exit, add_database, duration, settings_of
from drain.cli.operate import add_redact
from drain.postgres import session, staged
from drain.settings import options


def _match(text: str) -> str:
    """``--match``: JSON text of an array (args) or an object (kwargs)."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from None
    if not isinstance(value, list | dict):
        raise argparse.ArgumentTypeError(
            f"give a JSON array (args contain it) or object (kwargs contain it), not {text!r}")
    return text


def add_parser(sub: Any) -> None:
    """Register ``drain staged list`` on ``drain``'s subparsers."""
    p = sub.add_parser("staged", help="the jobs waiting in staged_jobs: list",
                       description="Look at the jobs in staged_jobs.")
    staged_sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = staged_sub.add_parser(
        "list",
        help="the matching jobs among the next ones the drain publishes",
        description="Show the matching jobs among the next --scan ready and --scan delayed "
        "jobs, in the order the drain publishes them. It never reads more: staged_jobs has "
        "no index but the drain's, so that staging stays cheap (drain.postgres.staged).",
    )
    add_database(q)
    q.add_argument("--queue", help="queue, as staged")
    q.add_argument("--task", help="task name")
    q.add_argument("--tag", help="tag")
    q.add_argument("--older-than", type=duration, metavar="DURATION",
                   help="only jobs staged longer ago than this, e.g. 10m")
    q.add_argument("--match", type=_match, metavar="JSON",
                   help="a JSON array the args contain, or an object the kwargs contain, "
                   "e.g. '{\"user_id\": 7}'")
    q.add_argument("--limit", type=options.COUNT, default=50,
                   help="at most this many (default 50)")
    q.add_argument("--scan", type=options.COUNT, default=staged.SCAN,
                   help=f"read at most this many ready and as many delayed jobs "
                   f"(default {staged.SCAN:,})")
    q.add_argument("--json", action="store_true", help="one JSON object per line")
    add_redact(q)
    q.set_defaults(func=cmd_staged_list)


def cmd_staged_list(args: argparse.Namespace) -> int:
    filters = staged.Filters(queue=args.queue, task=args.task, tag=args.tag,
                             older_than=args.older_than, match=args.match)
    with session.connect_plain(settings_of(args)) as conn:
        found, more = staged.listing(conn, filters, args.limit, args.scan)
    redactor = redaction.load(args.redact)
    for row in found:
        row["args"], row["kwargs"] = redaction.shown(redactor, row["task_name"], row["args"],
                                                     row["kwargs"])
    if args.json:
        for row in found:
            print(json.dumps(row, sort_keys=True, default=str))
        return Exit.OK
    among = (f"the next {args.scan:,} ready and {args.scan:,} delayed jobs" if more
             else "every staged job")
    print(f"{len(found)} job(s) shown, matching among {among}")
    for row in found:
        due = f" due {row['not_before']:%Y-%m-%d %H:%M:%S}" if row["not_before"] else ""
        print(f"  {row['staged_at']:%Y-%m-%d %H:%M:%S}  {row['task_name']}  "
              f"queue={row['queue'] or '(none given)'} tag={row['tag'] or '-'} "
              f"priority={row['priority']}{due} task_id={row['task_id']}\n"
              f"      args={row['args']} kwargs={row['kwargs']}")
    return Exit.OK

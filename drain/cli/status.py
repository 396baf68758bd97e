"""``drain status``: the backlog, dead letters, the oldest transaction, the lock holder.

:mod:`drain.postgres.status` reads the figures; this module registers the command
(:func:`add_parser`) and shows them: one JSON object, or lines for people
(:func:`_status_lines`), once or every few seconds (``--watch``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import sys
import time
from typing import Any

from drain.cli.common import Exit, add_database, add_lock_key, settings_of
from drain.errors import DrainError
from drain.postgres import session
from drain.postgres import status as drain_status
from drain.settings import config, options


def add_parser(sub: Any) -> None:
    """Register ``drain status`` on ``drain``'s subparsers."""
    p = sub.add_parser(
        "status",
        help="backlog, oldest staged job, dead letters, the oldest transaction, and which "
        "drain holds the lock",
        description="Show the backlog by queue, tag and task, how long the oldest due job "
        "has waited, dead letters by reason, the database's oldest open transaction (it "
        "keeps vacuum from removing drained rows) and which drain holds the lock. Above "
        f"{drain_status.ESTIMATE_ABOVE:,} staged rows (or dead jobs) the counts are "
        "estimates, and say so.",
    )
    add_database(p)
    add_lock_key(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (with --watch: one per line per refresh)")
    p.add_argument("--watch", nargs="?", const=2.0, type=options.POSITIVE_SECONDS,
                   metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C; on a terminal the "
                   "view is redrawn, otherwise each refresh is printed after a blank line")
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    try:
        if args.watch is not None:
            return _watch_status(settings, args.json, args.watch)
        with session.connect_plain(settings) as conn:
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
    the next one; Ctrl-C ends the watch with exit code 0 (in :func:`drain.cli.main.main`).
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
    """``drain status`` for people: what :func:`drain.postgres.status.read` returns."""
    estimated = status["backlog_estimated"]

    def count(n: int) -> str:
        return f"~{n:,}" if estimated else str(n)

    lines = [f"database: {status['database']}"]
    schema = status["schema"]
    if schema["version"] is None:
        lines.append("schema version: none recorded (an older drain's): run `drain migrate`")
    elif schema["version"] != schema["drain"]:
        lines.append(f"schema version: {schema['version']} (this drain's: {schema['drain']}; "
                     + ("run `drain migrate`)" if schema["version"] < schema["drain"]
                        else "a newer drain's)"))
    else:
        lines.append(f"schema version: {schema['version']}")
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
            queue = g["queue"] or "(none given)"
            lines.append(f"  {queue:<20} {g['tag'] or '-':<24} {g['task']:<32} "
                         f"{count(g['count']):>9} {count(g['delayed']):>8} {oldest:>8}")
        shown, groups = len(status["by_group"]), status["group_count"]
        if groups > shown:
            lines.append(f"  ... the {shown} biggest of {groups} groups")
    lines += _pause_lines(status.get("pauses", []))
    dead_counts = status["dead_by_reason"]
    about = "~" if status.get("dead_estimated") else ""
    lines.append("dead letters: " + (", ".join(f"{reason} {about}{n:,}"
                                               for reason, n in dead_counts.items())
                                     if dead_counts else "none"))
    if status.get("dead_sample"):
        lines.append(f"  (estimated from the table statistics; reasons scaled from a "
                     f"{status['dead_sample']['percent']:g}% sample of its pages)")
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


def _pause_lines(pauses: list[dict[str, Any]]) -> list[str]:
    """The operators' pauses (drain.postgres.pauses), one line each."""
    return [f"PAUSED by an operator: {p['kind']} {p['name']!r} since {p['paused_at']} by "
            f"{p['paused_by']}: {p['reason']} (`drain resume --{p['kind']} {p['name']}`)"
            for p in pauses]

"""The record of what operators did: ``drain_audit``, one row per action.

Every action an operator takes (``drain pause``, ``drain resume``, ``drain dead
requeue``, ``drain dead purge``) writes its row with :func:`record` inside the
action's own transaction: the action and its record commit together or not at
all. A row says who (``actor``: whom the tool was told acts; ``db_role``: the
database role that ran it, which the database vouches for), what (``action``
and ``target``: the queue, the task or the filter acted on), how many rows
(``count``), why (``reason``) and when (``at``). ``drain audit`` lists them.
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import socket
from typing import Any

import psycopg

#: The actions drain records.
ACTIONS = ("pause", "resume", "requeue", "purge")


def default_actor() -> str:
    """Who acts when nobody said: the operating system's user at this host."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in the environment nor the password database
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def record(conn: psycopg.Connection[Any], *, actor: str, action: str,
           target: dict[str, Any], count: int | None, reason: str | None) -> None:
    """Write one action's row, in the caller's transaction (which must be open)."""
    if action not in ACTIONS:
        raise ValueError(f"not an audited action: {action!r}")
    conn.execute(
        "INSERT INTO drain_audit (actor, action, target, count, reason) "
        "VALUES (%s, %s, %s::jsonb, %s, %s)",
        (actor, action, json.dumps(target, sort_keys=True, default=str), count, reason),
    )


def entries(conn: psycopg.Connection[Any], *, limit: int, action: str | None = None,
            since: dt.timedelta | None = None) -> list[dict[str, Any]]:
    """The newest actions first: at most ``limit``, of ``action`` only when given,
    from the last ``since`` only when given."""
    cur = conn.execute(
        "SELECT id, at, actor, db_role, action, target, count, reason FROM drain_audit "
        "WHERE (%(action)s::text IS NULL OR action = %(action)s) "
        "AND (%(since)s::interval IS NULL OR at >= now() - %(since)s::interval) "
        "ORDER BY id DESC LIMIT %(limit)s",
        {"action": action, "since": since, "limit": limit},
    )
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

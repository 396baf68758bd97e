"""Postgres primary failover: multi-host URLs, standbys, and what libpq says about them.

A drain must write (it deletes the rows it published), so it needs the primary.
Two ways of getting there, both with nothing cached between connections (every
reconnect reads the URL afresh, and :mod:`drain.broker.reachable` resolves it afresh):

* A libpq **multi-host URL** (``postgresql://h1:5432,h2:5432/db``, or
  ``host=h1,h2``) lets libpq try each server in turn. With
  ``target_session_attrs=read-write`` it skips standbys, so after a failover the
  drain's next connection lands on the new primary. A drain given several hosts
  and no ``target_session_attrs`` gets ``read-write`` by default
  (:func:`client_defaults`): otherwise it would settle on whichever host
  answers first, a standby maybe, while the primary is up. Say
  ``target_session_attrs=any`` to opt out.
* A URL naming **one server that is a hot standby** (in recovery): the drain
  connects, finds out with ``pg_is_in_recovery()`` (drain.postgres.store), says so once
  and waits there as a standby, ready, until that server is promoted. On a hot
  standby Postgres 15 refuses ``LISTEN``, ``NOTIFY``, the wake flag's
  ``setval`` and every ``DELETE`` (SQLSTATE 25006), but grants
  ``pg_try_advisory_lock``: the lock would be the standby's own, seen by no
  drain on the primary, so the drain must not take it there.

When no server is usable libpq reports one failure per server it tried;
:func:`describe` turns that into one line naming each server and its answer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from drain.settings.url_parts import first_line

#: libpq's failure of one server: ``connection to server at "h" (addr), port p
#: failed: reason`` or ``connection to server on socket "path" failed: reason``.
_SERVER_FAILED = re.compile(
    r'connection to server (?:at "(?P<host>[^"]*)"(?: \([^)]*\))?, port (?P<port>\d+)'
    r'|on socket "(?P<socket>[^"]*)") failed: (?P<reason>[^\n]*)'
)
#: psycopg's header before the list of every server's failure.
_ALL_FAILURES = "All failures were:"
#: What a standby answers under ``target_session_attrs`` read-write / primary.
_STANDBY_ANSWERS = ("session is read-only", "server is in hot standby mode")


def host_count(params: Mapping[str, object]) -> int:
    """How many servers libpq parameters name (``host`` or ``hostaddr``, comma-separated)."""
    hosts = str(params.get("host") or params.get("hostaddr") or "")
    return len(hosts.split(",")) if hosts else 0


def client_defaults(params: Mapping[str, object]) -> dict[str, str]:
    """libpq options the drain adds to its URL's own ``params``: ``read-write``
    sessions when the URL names several servers and chooses no session kind."""
    if host_count(params) > 1 and not params.get("target_session_attrs"):
        return {"target_session_attrs": "read-write"}
    return {}


def describe(exc: BaseException) -> str:
    """One line for a driver error: its first line, or, when libpq tried several
    servers, each server with its answer (``127.0.0.1:5432: Connection refused;
    127.0.0.1:5433: session is read-only``)."""
    text = str(exc)
    listed = text.split(_ALL_FAILURES, 1)[1] if _ALL_FAILURES in text else text
    answers: dict[str, str] = {}
    for found in _SERVER_FAILED.finditer(listed):
        server = found["socket"] or f"{found['host']}:{found['port']}"
        answers.setdefault(server, found["reason"].strip())
    if len(answers) <= 1:
        line = first_line(exc)
    else:
        line = "no server accepted the session: " + "; ".join(
            f"{server}: {reason}" for server, reason in answers.items())
    if any(answer in line for answer in _STANDBY_ANSWERS):
        line += " (a standby: waiting for a primary that accepts writes)"
    return line

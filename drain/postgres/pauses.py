"""Publishing paused by an operator: ``drain_pauses``, one row per queue or task.

``drain pause --queue Q`` (or ``--task T``) inserts a row; ``drain resume``
deletes it; each writes its ``drain_audit`` row in the same transaction
(drain.postgres.audit). A trigger notifies the drains of every change
(``staging_schema.sql``), and each drain reads the pauses again in its next
batch's snapshot (drain.daemon.pipeline): from then on it publishes none of
the paused queue's or task's jobs, which stay staged, and once the row is gone
it publishes them again. Staging never notices.

A queue pause is keyed by the queue a job is declared into: the row's queue
without ``--app``, where the app routes it with ``--app`` (a job routed to an
exchange with no queue declared is paused by its task, not by a queue). A
task pause is keyed by ``task_name``, whatever the queue. Expiry goes on while
paused: a job whose ``expires_at`` passes is moved to dead_jobs ('expired').
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import psycopg

from drain.errors import ConfigError
from drain.postgres import audit
from drain.postgres import sql as queries

#: What can be paused: a queue, or a task by name.
KINDS = ("queue", "task")


@dataclasses.dataclass(frozen=True)
class Pause:
    """One pause: what (``kind``, ``name``), why, who and since when."""

    kind: str
    name: str
    reason: str
    paused_by: str
    paused_at: dt.datetime

    def describe(self) -> str:
        return f"{self.kind} {self.name!r}"

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "paused_at": self.paused_at.isoformat()}


def current(conn: psycopg.Connection[Any]) -> list[Pause]:
    """Every pause, by kind and name."""
    return [Pause(*row) for row in conn.execute(queries.query("pauses")).fetchall()]


def pause(conn: psycopg.Connection[Any], kind: str, name: str, *, reason: str,
          actor: str) -> Pause | None:
    """Pause publishing ``kind`` ``name``, with its audit row, in one transaction.
    None when it was paused already (nothing changed, nothing recorded); else
    the new pause."""
    _check(kind, name)
    if not reason.strip():
        raise ValueError("a pause needs a reason")
    with conn.transaction():
        row = conn.execute(
            "INSERT INTO drain_pauses (kind, name, reason, paused_by) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (kind, name) DO NOTHING "
            "RETURNING kind, name, reason, paused_by, paused_at",
            (kind, name, reason, actor)).fetchone()
        if row is None:
            return None
        audit.record(conn, actor=actor, action="pause", target={kind: name}, count=None,
                     reason=reason)
        return Pause(*row)


def resume(conn: psycopg.Connection[Any], kind: str, name: str, *, reason: str | None,
           actor: str) -> Pause | None:
    """Resume publishing ``kind`` ``name``, with its audit row, in one transaction.
    The pause that ended, or None when there was none (nothing recorded)."""
    _check(kind, name)
    with conn.transaction():
        row = conn.execute(
            "DELETE FROM drain_pauses WHERE kind = %s AND name = %s "
            "RETURNING kind, name, reason, paused_by, paused_at", (kind, name)).fetchone()
        if row is None:
            return None
        audit.record(conn, actor=actor, action="resume", target={kind: name}, count=None,
                     reason=reason)
        return Pause(*row)


def _check(kind: str, name: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"cannot pause a {kind!r}: only {' or '.join(KINDS)}")
    if not name or len(name.encode()) > 1024:
        raise ConfigError(f"a {kind} name is 1 to 1,024 bytes, got {len(name.encode()):,}")

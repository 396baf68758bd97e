"""One job in full, by its task id: what ``drain show`` prints (issue 39).

A task id may be staged, dead, or both (a dead job requeued with its own id
while an older copy was set aside again): every row is returned, staged first,
each with every column and, for a dead job, why it died (the broker's reply
among them). :func:`as_staged_row` gives the row as the drain would read it, so
that the caller can build the very message the drain will publish for it
(drain.celery.message).
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import psycopg
import psycopg.errors

from drain.errors import DrainError
from drain.postgres.rows import StagedRow

_COLUMNS = ("id, task_id::text AS task_id, task_name, args::text AS args, "
            "kwargs::text AS kwargs, queue, queue_legacy, priority, tag, not_before, "
            "expires_at, staged_at, embed::text AS embed, trace::text AS trace")


#: How long the lookup may take: staged_jobs has no index on task_id, on purpose.
LOOKUP_TIMEOUT = "30s"


def find(conn: psycopg.Connection[Any], task_id: uuid.UUID) -> list[dict[str, Any]]:
    """Every row of ``task_id``: ``{"state": "staged" | "dead", column: value...}``.

    dead_jobs is looked up by its index (dead_jobs_task_id_idx). staged_jobs has
    none on task_id: every staging commit would pay for it (pgbench, one-row
    INSERTs by 8 clients: 0.94-0.95 x the rate without, in two of three
    alternating rounds), for a lookup an operator makes now and then. So it
    scans the table, within LOOKUP_TIMEOUT (DrainError beyond)."""
    found: list[dict[str, Any]] = []
    for state, query in (
        ("staged", f"SELECT {_COLUMNS}, xact::text AS xact FROM staged_jobs "  # noqa: S608
                   "WHERE task_id = %s ORDER BY id"),
        ("dead", f"SELECT {_COLUMNS}, dead_id, reason, detail, dead_at FROM dead_jobs "  # noqa: S608
                 "WHERE task_id = %s ORDER BY dead_id"),
    ):
        try:
            with conn.transaction():
                conn.execute("SELECT set_config('statement_timeout', %s, true)",
                             (LOOKUP_TIMEOUT,))
                cur = conn.execute(query, (task_id,))
                names = [d.name for d in cur.description or []]
                found += [{"state": state, **dict(zip(names, row, strict=True))}
                          for row in cur.fetchall()]
        except psycopg.errors.QueryCanceled:
            raise DrainError(f"looking up task id {task_id} in {state} jobs took more than "
                             f"{LOOKUP_TIMEOUT}") from None
    return found


def as_staged_row(job: dict[str, Any]) -> StagedRow:
    """``job`` (from :func:`find`) as the drain's fetch reads a staged row: a dead
    job as a requeue would stage it again."""
    queue = job["queue"]
    due = max(job["staged_at"], job["not_before"] or job["staged_at"])
    return StagedRow(
        id=int(job["id"]), task_id=str(job["task_id"]), task_name=str(job["task_name"]),
        args_json=str(job["args"]), kwargs_json=str(job["kwargs"]),
        queue=queue if queue is not None else "celery", priority=int(job["priority"]),
        tag=job["tag"], expires_at=job["expires_at"], ready=job["not_before"] is None,
        unrouted=queue is None or (queue == "celery" and bool(job["queue_legacy"])),
        embed_json=job["embed"], trace_json=job["trace"],
        staged_epoch=_epoch(job["staged_at"]), due_epoch=_epoch(due),
    )


def _epoch(value: dt.datetime | None) -> float | None:
    return None if value is None else value.timestamp()

"""Staged jobs as an operator looks at them: ``drain staged list`` (issue 39).

``staged_jobs`` is the hot table: every staging commit pays for each of its
indexes, so it has only the ones the drain's fetch needs (a task_id index
alone cost 5-6 % of one-row INSERTs under pgbench: drain.postgres.detail). A
listing therefore never scans the whole table for a filter. It reads the head
of the backlog in the drain's own order, ready rows by ``staged_jobs_ready_idx``
(priority, then staging transaction) and delayed ones by
``staged_jobs_delayed_idx`` (due time), at most ``scan`` rows of each, and
filters those: what it shows are the matching jobs among the next ``scan`` the
drain will publish, and it says so when the head held more than it read. Every
statement runs within LIST_TIMEOUT.

The filters: queue (as staged; none given reads as such), task, tag, staged
more than a while ago, and ``match``: a JSON array the job's ``args`` contain,
or a JSON object its ``kwargs`` contain (``@>``, as Postgres compares JSON:
``[7]`` matches ``[1, 7]``, ``{"user": 7}`` matches ``{"user": 7, "x": 1}``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Any

import psycopg
import psycopg.errors
from psycopg import sql

from drain.errors import DrainError
from drain.postgres import sql as queries

#: How many rows of each kind (ready, delayed) a listing reads at most.
SCAN = 100_000
#: How long a listing's statements may take.
LIST_TIMEOUT = "10s"


@dataclasses.dataclass(frozen=True)
class Filters:
    """Which staged jobs a listing shows."""

    queue: str | None = None
    task: str | None = None
    tag: str | None = None
    older_than: dt.timedelta | None = None
    #: JSON text: an array the args contain, or an object the kwargs contain.
    match: str | None = None

    def where(self) -> tuple[sql.Composable, dict[str, Any]]:
        equal, params = queries.equal_to((
            ("queue", self.queue), ("task_name", self.task), ("tag", self.tag)))
        conditions: list[sql.Composable] = [sql.SQL("TRUE"), *equal]
        if self.older_than is not None:
            conditions.append(sql.SQL("staged_at < now() - {}").format(
                sql.Placeholder("older_than")))
            params["older_than"] = self.older_than
        if self.match is not None:
            column = "args" if isinstance(json.loads(self.match), list) else "kwargs"
            conditions.append(sql.SQL("{} @> {}::jsonb").format(
                sql.Identifier(column), sql.Placeholder("match")))
            params["match"] = self.match
        return sql.SQL(" AND ").join(conditions), params


def listing(conn: psycopg.Connection[Any], filters: Filters, limit: int,
            scan: int = SCAN) -> tuple[list[dict[str, Any]], bool]:
    """The first ``limit`` matching jobs among the next ``scan`` ready and ``scan``
    delayed ones, in the drain's order (ready first), and whether the head held
    more than was read (the rest is not looked at)."""
    query, params = listing_query(filters)
    beyond = sql.SQL("SELECT max(c) > {scan} FROM (SELECT part, count(*) AS c FROM ({head}) "
                     "AS h GROUP BY part) AS parts").format(
        scan=sql.Placeholder("scan"), head=HEAD.format(n=sql.Placeholder("read")))
    try:
        with conn.transaction():
            conn.execute("SELECT set_config('statement_timeout', %s, true)", (LIST_TIMEOUT,))
            cur = conn.execute(query, {**params, "scan": scan, "limit": limit})
            names = [d.name for d in cur.description or []]
            found = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
            more = conn.execute(beyond, {"scan": scan, "read": scan + 1}).fetchone()
    except psycopg.errors.QueryCanceled:
        raise DrainError(f"listing the staged jobs took more than {LIST_TIMEOUT}: a smaller "
                         "--scan reads less") from None
    return found, more == (True,)


#: The head of the backlog: the next ``n`` ready jobs in the drain's order
#: (staged_jobs_ready_idx), then the next ``n`` delayed ones by due time
#: (staged_jobs_delayed_idx).
HEAD = sql.SQL(
    "(SELECT s.*, 0 AS part FROM staged_jobs s WHERE not_before IS NULL "
    " ORDER BY priority DESC, xact, id LIMIT {n}) "
    "UNION ALL "
    "(SELECT s.*, 1 AS part FROM staged_jobs s WHERE not_before IS NOT NULL "
    " ORDER BY not_before, id LIMIT {n})")


def listing_query(filters: Filters) -> tuple[sql.Composed, dict[str, Any]]:
    """The listing's query (parameters ``scan`` and ``limit`` to add) and its filters'."""
    where, params = filters.where()
    return sql.SQL(
        "SELECT id, task_id::text, task_name, queue, tag, priority, staged_at, not_before, "
        "expires_at, args::text AS args, kwargs::text AS kwargs FROM ({head}) AS head "
        "WHERE {where} "
        "ORDER BY part, CASE WHEN part = 0 THEN -priority END, "
        "CASE WHEN part = 0 THEN xact END, not_before, id LIMIT {limit}"
    ).format(head=HEAD.format(n=sql.Placeholder("scan")), where=where,
             limit=sql.Placeholder("limit")), params

"""The dead-letter table: listing, requeueing and purging ``dead_jobs``.

The drain moves a row to ``dead_jobs`` when it can never be published
(``expired``, ``too_large``, ``invalid``, ``unknown_task``, ``refused``), in the
same transaction that would have deleted it. Operators inspect them here and
either put them back into ``staged_jobs`` (same task id; a fresh expiry) or
purge them.

Filters combine with AND; each is optional. SQL is composed with
``psycopg.sql`` from fixed fragments: no value is ever pasted into it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg.errors
from psycopg import sql

from drain.errors import ConfigError, DrainError, SchemaMissing, StagingError
from drain.postgres import audit
from drain.postgres import sql as queries

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> dt.timedelta:
    """``"90"``, ``"90s"``, ``"15m"``, ``"12h"``, ``"7d"``, ``"2w"`` -> timedelta."""
    match = _DURATION.match(text)
    if not match:
        raise ConfigError(f"not a duration: {text!r} (use e.g. 90s, 15m, 12h, 7d, 2w)")
    return dt.timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])


def format_duration(value: dt.timedelta) -> str:
    """The shortest spelling :func:`parse_duration` reads back: ``7d``, ``90m``, ``1.5s``."""
    seconds = value.total_seconds()
    for unit in ("d", "h", "m"):
        if seconds >= _UNITS[unit] and seconds % _UNITS[unit] == 0:
            return f"{int(seconds // _UNITS[unit])}{unit}"
    return f"{seconds:g}s"


@dataclasses.dataclass(frozen=True)
class Filters:
    """Which dead jobs an operation applies to."""

    reason: str | None = None
    task: str | None = None
    tag: str | None = None
    queue: str | None = None
    older_than: dt.timedelta | None = None
    task_id: uuid.UUID | None = None
    #: Only dead jobs of a dead_id up to this: the ones that matched when they were
    #: counted and shown (:func:`shown`), not those dead-lettered since.
    upto: int | None = None
    #: Only dead jobs of a dead_id above this: a chunk after the ones before it
    #: (:func:`chunks`).
    after: int | None = None

    def where(self) -> tuple[sql.Composable, dict[str, Any]]:
        conditions: list[sql.Composable] = [sql.SQL("TRUE")]
        params: dict[str, Any] = {}
        if self.upto is not None:
            conditions.append(sql.SQL("dead_id <= {}").format(sql.Placeholder("upto")))
            params["upto"] = self.upto
        if self.after is not None:
            conditions.append(sql.SQL("dead_id > {}").format(sql.Placeholder("after")))
            params["after"] = self.after
        equal, values = queries.equal_to((
            ("reason", self.reason), ("task_name", self.task), ("tag", self.tag),
            ("queue", self.queue), ("task_id", self.task_id)))
        conditions += equal
        params.update(values)
        if self.older_than is not None:
            conditions.append(sql.SQL("dead_at < now() - {}").format(
                sql.Placeholder("older_than")))
            params["older_than"] = self.older_than
        return sql.SQL(" AND ").join(conditions), params

    def as_target(self) -> dict[str, Any]:
        """The filter as drain_audit records it (drain.postgres.audit)."""
        return {name: format_duration(value) if isinstance(value, dt.timedelta)
                else str(value) if isinstance(value, uuid.UUID) else value
                for name, value in dataclasses.asdict(self).items() if value is not None}

    def describe(self) -> str:
        parts = [
            f"{name}={format_duration(value) if isinstance(value, dt.timedelta) else value}"
            for name, value in dataclasses.asdict(self).items()
            if value is not None and name not in ("upto", "after")
        ]
        return ", ".join(parts) if parts else "no filter"


#: ``drain dead list`` counts at most this many matching dead jobs, and says "more than".
COUNT_CAP = 10_000
#: How long a listing's statements may take (``drain dead list``, the console).
LIST_TIMEOUT = "10s"


def count(conn: psycopg.Connection[Any], filters: Filters, cap: int | None = None) -> int:
    """How many dead jobs match; with ``cap``, at most ``cap + 1`` (more than ``cap``:
    a listing says so, without counting millions)."""
    if cap is None:
        return shown(conn, filters)[0]
    where, params = filters.where()
    row = conn.execute(
        sql.SQL("SELECT count(*) FROM (SELECT FROM dead_jobs WHERE {} LIMIT {}) AS c").format(
            where, sql.Placeholder("cap")), {**params, "cap": cap + 1}).fetchone()
    return int(row[0]) if row else 0


def shown(conn: psycopg.Connection[Any], filters: Filters) -> tuple[int, Filters]:
    """How many dead jobs match, and the filters bound to those (``upto``: the
    largest dead_id among them), for an action to move exactly what was shown."""
    where, params = filters.where()
    row = conn.execute(
        sql.SQL("SELECT count(*), max(dead_id) FROM dead_jobs WHERE {}").format(where), params
    ).fetchone()
    found, upto = (int(row[0]), row[1]) if row else (0, None)
    return found, dataclasses.replace(filters, upto=int(upto) if upto is not None else 0)


class ChangedSinceShown(DrainError):
    """An action found another number of matching dead jobs than were shown: a
    drain dead-lettered or someone moved some meanwhile. Nothing was done."""


def exactly(what: str, done: int, expect: int | None) -> int:
    """``done`` when it is what was shown (``expect``; None: not bound), else raise
    ChangedSinceShown (inside the action's transaction, which it rolls back)."""
    if expect is not None and done != expect:
        raise ChangedSinceShown(
            f"{expect} dead job(s) were shown, {done} match now (moved or removed "
            f"meanwhile): nothing was {what}; run it again to see them")
    return done


def listing(conn: psycopg.Connection[Any], filters: Filters, limit: int,
            cap: int = COUNT_CAP) -> tuple[int, list[dict[str, Any]]]:
    """What ``drain dead list`` shows: the count (at most ``cap + 1``) and the newest
    ``limit`` matching dead jobs, each statement within LIST_TIMEOUT (every filter
    has its index: staging_schema.sql)."""
    try:
        with conn.transaction():
            conn.execute("SELECT set_config('statement_timeout', %s, true)", (LIST_TIMEOUT,))
            return count(conn, filters, cap), rows(conn, filters, limit)
    except psycopg.errors.QueryCanceled:
        raise DrainError(f"listing the dead jobs took more than {LIST_TIMEOUT}: narrow it "
                         "with --reason, --task, --queue, --tag, --task-id or --older-than"
                         ) from None


def rows(conn: psycopg.Connection[Any], filters: Filters, limit: int) -> list[dict[str, Any]]:
    """The newest matching dead jobs first. ``args`` and ``kwargs`` are the
    database's JSON text, as stored: valid JSON, whatever it holds (an integer
    of 5,000 digits, which Python's JSON decoder refuses, included)."""
    where, params = filters.where()
    cur = conn.execute(
        sql.SQL(
            "SELECT id, task_id::text, task_name, queue, tag, priority, reason, detail, "
            "dead_at, staged_at, args::text AS args, kwargs::text AS kwargs "
            "FROM dead_jobs WHERE {} "
            "ORDER BY dead_at DESC, dead_id DESC LIMIT {}"
        ).format(where, sql.Placeholder("limit")),
        {**params, "limit": limit},
    )
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


@dataclasses.dataclass(frozen=True)
class Act:
    """Who acts and why, for the action's drain_audit row (drain.postgres.audit)."""

    actor: str
    reason: str | None = None


def token(action: str, filters: Filters, count: int) -> str:
    """What a dry run gives (``--dry-run``) and an action takes back (``--confirm``):
    ``<upto>-<count>-<digest>``, bound to the action, the filters as shown (their
    ``upto``) and the count. The digest only keeps a token from being used with
    other filters or another action by mistake; it is no secret."""
    bound = {**filters.as_target(), "action": action, "count": count}
    digest = hashlib.sha256(json.dumps(bound, sort_keys=True).encode()).hexdigest()[:12]
    return f"{filters.upto or 0}-{count}-{digest}"


def confirmed(action: str, filters: Filters, given: str) -> tuple[int, Filters]:
    """The count and bound filters a ``--confirm`` token stands for, when it was made
    by a dry run of this ``action`` with these ``filters``; ConfigError otherwise."""
    upto, count, _ = [*given.split("-", 2), "", ""][:3]
    if upto.isdigit() and count.isdigit():
        bound = dataclasses.replace(filters, upto=int(upto))
        if token(action, bound, int(count)) == given:
            return int(count), bound
    raise ConfigError(f"--confirm {given!r} was not made by `--dry-run` of this {action} with "
                      "these filters and options: run the dry run again and pass the token it "
                      "prints")


def chunks(conn: psycopg.Connection[Any], filters: Filters,
           size: int) -> Iterator[tuple[Filters, int]]:
    """``filters`` (bound by :func:`shown`) cut in chunks of at most ``size`` dead jobs,
    by dead_id, each with how many it holds now: act on one, then ask for the next."""
    after = 0
    while True:
        chunk = dataclasses.replace(filters, after=after)
        where, params = chunk.where()
        row = conn.execute(
            sql.SQL("SELECT count(*), max(dead_id) FROM (SELECT dead_id FROM dead_jobs "
                    "WHERE {} ORDER BY dead_id LIMIT {}) AS c").format(
                where, sql.Placeholder("size")), {**params, "size": size}).fetchone()
        conn.rollback()  # nothing held between chunks
        if row is None or not row[0]:
            return
        count, last = int(row[0]), int(row[1])
        yield dataclasses.replace(chunk, upto=min(last, filters.upto or last)), count
        after = last


def requeue(
    conn: psycopg.Connection[Any], filters: Filters, expires_in: dt.timedelta | None = None,
    expect: int | None = None, *, act: Act, new_task_ids: bool = False,
) -> int:
    """Move matching dead jobs back into ``staged_jobs``; returns how many. With
    ``expect`` (the count shown), all of them or none: ChangedSinceShown when
    another number matches now. The requeue's drain_audit row (``act``) commits
    with it. ``new_task_ids``: each gets a new task id (a worker that dedupes by
    task id, drain.consumer, runs it even if it ran before); by default it keeps
    its own (such a worker skips a job it already processed).

    They keep their task id, priority, tag, queue, embed (callbacks, a chain's
    next tasks) and ``queue_legacy`` (a job staged without a queue before the
    upgrade is still routed as "no queue given"), and are due at once. Their
    OpenTelemetry context is marked ``drain.link``: the drain starts a new trace
    linked to the staging one, not a trace spanning the days it lay dead
    (drain.daemon.tracing).
    Expiry is fresh: ``expires_in`` from now when given, else the time to live
    the job had when it was staged (expires_at minus its staging or due time),
    else none. Without ``expires_in``, a job whose expiry was at or before its
    start had no time to live to give again (it would expire at once): then
    nothing is requeued and StagingError says so (:func:`no_time_to_live`).
    Raises :class:`SchemaMissing` on a schema `drain migrate` has not upgraded yet.
    """
    where, params = filters.where()
    with conn.transaction():
        if conn.execute(queries.query("newest_columns_present")).fetchone() != (True,):
            raise SchemaMissing("dead_jobs has no queue_legacy or trace column, or there is "
                                "no drain_pauses table (an older "
                                "drain schema): run `drain migrate`")
        if expires_in is None:
            refuse_without_time_to_live(conn, filters)
        query = sql.SQL(
            """
            WITH moved AS (DELETE FROM dead_jobs WHERE {} RETURNING *)
            INSERT INTO staged_jobs (task_id, task_name, args, kwargs, queue, queue_legacy,
                                     priority, tag, not_before, expires_at, embed, trace)
            SELECT CASE WHEN {new_ids}::boolean THEN gen_random_uuid() ELSE task_id END,
                   task_name, args, kwargs, queue, queue_legacy, priority, tag, NULL,
                   CASE WHEN {expires_in}::interval IS NOT NULL THEN now() + {expires_in}
                        WHEN expires_at IS NOT NULL
                            THEN now() + (expires_at - coalesce(not_before, staged_at))
                   END, embed, trace || '{{"drain.link": "requeued"}}'
            FROM moved
            """
        ).format(where, expires_in=sql.Placeholder("expires_in"),
                 new_ids=sql.Placeholder("new_ids"))
        moved = exactly("requeued", conn.execute(
            query, {**params, "expires_in": expires_in, "new_ids": new_task_ids}).rowcount,
            expect)
        target = filters.as_target()
        if expires_in is not None:
            target["expires_in"] = format_duration(expires_in)
        if new_task_ids:
            target["new_task_ids"] = True
        audit.record(conn, actor=act.actor, action="requeue", target=target, count=moved,
                     reason=act.reason)
        return moved


def no_time_to_live(conn: psycopg.Connection[Any], filters: Filters) -> int:
    """How many matching dead jobs expired at or before their start (due time, or
    staging time): requeued with their own time to live, they would expire at once."""
    return _count(conn, filters, "expires_at <= coalesce(not_before, staged_at)")


def infinite_time_to_live(conn: psycopg.Connection[Any], filters: Filters) -> int:
    """How many matching dead jobs have an expiry or a start without a time to live
    to give again: 'infinity', '-infinity' (staged by plain SQL; an interval holds
    neither)."""
    return _count(conn, filters, "expires_at IS NOT NULL AND NOT (isfinite(expires_at) "
                                 "AND isfinite(coalesce(not_before, staged_at)))")


def _count(conn: psycopg.Connection[Any], filters: Filters, condition: str) -> int:
    where, params = filters.where()
    row = conn.execute(sql.SQL("SELECT count(*) FROM dead_jobs WHERE {} AND {}").format(
        where, sql.SQL(condition)), params).fetchone()
    return int(row[0]) if row else 0


def refuse_without_time_to_live(conn: psycopg.Connection[Any], filters: Filters) -> None:
    """StagingError when :func:`no_time_to_live` or :func:`infinite_time_to_live`
    finds any."""
    stuck = no_time_to_live(conn, filters)
    if stuck:
        raise StagingError(
            f"{stuck} matching dead job(s) expired at or before they were due: requeued "
            "with their own time to live they would expire at once. Nothing was requeued; "
            "give them a fresh expiry with --expires-in DURATION, or leave them out "
            "(--task, --tag, --reason ...)")
    endless = infinite_time_to_live(conn, filters)
    if endless:
        raise StagingError(
            f"{endless} matching dead job(s) have an infinite expiry or start time "
            "('infinity', '-infinity'): they have no time to live to give again. Nothing "
            "was requeued; give them a fresh expiry with --expires-in DURATION, or leave "
            "them out (--task, --tag, --reason ...)")


def purge(conn: psycopg.Connection[Any], filters: Filters, expect: int | None = None,
          *, act: Act) -> int:
    """Delete matching dead jobs for good; returns how many. With ``expect`` (the
    count shown), all of them or none (ChangedSinceShown). ``act`` must say why:
    the purge's drain_audit row commits with it."""
    if not (act.reason or "").strip():
        raise ValueError("a purge needs a reason")
    where, params = filters.where()
    with conn.transaction():
        purged = exactly("purged", conn.execute(
            sql.SQL("DELETE FROM dead_jobs WHERE {}").format(where), params
        ).rowcount, expect)
        audit.record(conn, actor=act.actor, action="purge", target=filters.as_target(),
                     count=purged, reason=act.reason)
        return purged

"""The drain's side of Postgres: one session holding the lock, the batches, LISTEN.

The connection itself (settings, commands, a hang) is drain.postgres.session's; this
module adds what the drain does with it.

Everything runs on one connection on purpose. The advisory lock, the
REPEATABLE READ batch transaction and the LISTEN all belong to the same
session, so losing that session ends the batch (it rolls back) and frees the
lock in one stroke: a drain that lost its connection can no longer delete
anything, and a standby taking over cannot overlap with it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import psycopg
import psycopg.errors
from psycopg.pq import TransactionStatus

from drain.errors import (
    BatchConflict,
    LaneConflict,
    ReadOnlyStandby,
    SchemaMissing,
)
from drain.postgres import keyset, sql, wakeup
from drain.postgres.abandoned import lane_class, lane_guard
from drain.postgres.conflicts import Settled, isolate
from drain.postgres.rows import StagedRow
from drain.postgres.session import Session, rolled_back
from drain.settings.config import Settings
from drain.settings.url_parts import first_line
from drain.settings.urls import scrub

log = logging.getLogger("drain.store")

#: A keyed statement's key: a tuple whose first item is the row's id (Store._keyed).
K = TypeVar("K", bound=tuple[Any, ...])
#: How long a keyed statement waits for a lock another transaction holds (a row
#: locked or being updated, the table in SHARE mode) before it asks which of its
#: rows are locked and sets them aside, pending (drain.postgres.conflicts).
KEYED_LOCK_TIMEOUT = "5ms"


class Store(Session):
    """The drain's session: the lock, the batches, the wake flag."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        #: The ``lanes``/``lane`` parameters of every query that reads this lane's rows.
        self._lane: dict[str, int] = {"lanes": settings.lanes, "lane": settings.lane}
        #: This session raised the wake flag (drain.postgres.wakeup): the drain is idle.
        self.armed = False
        self._wake: dict[str, object] = {"class": wakeup.WAKE_CLASS, "key": 0}
        self._joined = False
        #: Connected to a hot standby: no LISTEN, no lock until it is promoted.
        self.in_recovery = False
        #: This batch's transaction has its KEYED_LOCK_TIMEOUT (:meth:`_keyed`).
        self._keyed_lock_timeout_set = False

    def _prepare(self, conn: psycopg.Connection[tuple[object, ...]]) -> None:
        """Check the schema and LISTEN (SchemaMissing when it is not there)."""
        self._joined = False
        present = conn.execute(sql.query("schema_present")).fetchone()
        table, wake_flag = present if present else (None, False)
        if table is None:
            raise SchemaMissing(
                f"database {self._display} has no staged_jobs table: run `drain migrate` first"
            )
        if not wake_flag:
            raise SchemaMissing(
                f"database {self._display} has an older drain schema (no wake flag, "
                "sequence drain_wake): run `drain migrate`"
            )
        if not self._ask("newest_columns_present"):
            raise SchemaMissing(
                f"database {self._display} has an older drain schema (no column "
                "queue_legacy or trace in staged_jobs and dead_jobs, or no table "
                "drain_pauses): run `drain migrate`"
            )
        # A hot standby refuses LISTEN; try_lock waits for its promotion.
        self.in_recovery = self._ask("in_recovery")
        if not self.in_recovery:
            conn.execute(sql.query("listen"))
        self._wake = {"class": wakeup.WAKE_CLASS, "key": table}

    def close(self) -> None:
        """Close the session; this also releases the locks and rolls back a batch."""
        if self.armed and self._conn is not None and not self._conn.closed:
            with contextlib.suppress(Exception):  # or the next leader does it
                self._conn.execute(sql.query("lower_flag"))
        self.armed = False
        super().close()

    def try_lock(self) -> bool:
        """Take the advisory lock (this lane's, with lanes) if it is free (never waits).

        Raises LaneConflict while drains split in another number of lanes run,
        ReadOnlyStandby while the database is a hot standby.
        """
        settings = self._settings
        if self.in_recovery:
            self._promoted()
        if not self._joined:
            guard = lane_guard(settings.lock_key)
            self._execute("join_lanes", {"guard": guard, "lanes": settings.lanes})
            others = [
                count for (count,) in self._execute("lanes_in_use", {"guard": guard}).fetchall()
                if count != settings.lanes
            ]
            self._joined = not others
            if others:
                # Keep (guard, N): the others see us as well, and none of us publishes.
                raise LaneConflict(
                    f"other drains on lock key {settings.lock_key} run with --lanes "
                    f"{', '.join(map(str, others))} (this one: --lanes {settings.lanes}); all "
                    "drains of one lock key must use the same number of lanes"
                )
        if settings.lanes == 1:
            row = self._execute("try_lock", {"key": settings.lock_key}).fetchone()
        else:
            row = self._execute("try_lane_lock", {
                "class": lane_class(settings.lock_key, settings.lanes), "lane": settings.lane,
            }).fetchone()
        self.holds_lock = bool(row and row[0])
        if self.holds_lock:
            name = self.application_name(leader_since=dt.datetime.now(dt.timezone.utc))
            self._execute("set_application_name", {"name": name})
            self._reset_wake_flag()  # a leader that died armed left it raised
        return self.holds_lock

    def _promoted(self) -> None:
        """On a hot standby: raise ReadOnlyStandby until it is promoted, then LISTEN.

        Its advisory locks are its own, unseen on the primary: never lock there.
        """
        if self._ask("in_recovery"):
            raise ReadOnlyStandby(
                f"database {self._display} is a read-only standby (in recovery)")
        self._execute("listen")
        self.in_recovery = False
        log.info("database %s was promoted: it accepts writes now", self._display)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """A REPEATABLE READ transaction; commits on success, rolls back on error."""
        conn = self._require()
        # Rows whose NOTIFY already arrived are visible to this batch's snapshot:
        # forget those notifications, or each would cost an empty cycle later.
        self._notified(conn)
        self._keyed_lock_timeout_set = False  # SET LOCAL: once per batch (_keyed)
        try:
            self.asked_at = time.monotonic()  # BEGIN
            with conn.transaction():
                try:
                    yield
                finally:
                    self.asked_at = time.monotonic()  # COMMIT or ROLLBACK
        except psycopg.Error as exc:
            # A row of the batch updated or deleted by someone else meanwhile
            # (REPEATABLE READ), or a deadlock, rolls the transaction back and
            # leaves the session, with its lock, fine: the next batch starts
            # afresh. Anything else, or a session not back to idle, is lost.
            if (not rolled_back(exc) or conn.closed
                    or conn.info.transaction_status != TransactionStatus.IDLE):
                self.close()
                raise self._unavailable("lost", exc) from None
            raise BatchConflict(
                f"database {self._display}: {scrub(first_line(exc), self._secrets)}"
            ) from None

    def fetch(
        self,
        limit: int,
        exclude: list[int] | None = None,
        paused: list[str] | None = None,
        plan: keyset.FetchPlan | None = None,
        *,
        held_routes: list[str] | None = None,
        paused_tasks: list[str] | None = None,
    ) -> list[StagedRow]:
        """The next ``limit`` due rows, leaving out ``exclude`` (rows in flight),
        the rows of ``paused`` queues and ``paused_tasks`` (drain.postgres.pauses),
        the rows of ``held_routes`` (drain.daemon.piles) and other lanes' rows;
        ``plan`` says where each priority's scan starts (None: from the head)."""
        params = fetch_params(limit, exclude=exclude, paused=paused, plan=plan,
                              held_routes=held_routes, paused_tasks=paused_tasks,
                              **self._lane)
        # Binary results: a batch of 1,000 rows read in ~0.3 ms less.
        cur = self._execute("fetch_batch", params, binary=True)
        return list(map(StagedRow._make, cur.fetchall()))

    def heads(
        self, plan: keyset.FetchPlan, paused: list[str] | None = None,
        held: list[int] | None = None, held_routes: list[str] | None = None,
        paused_tasks: list[str] | None = None,
    ) -> tuple[dict[int, tuple[int, int] | None], int]:
        """For :meth:`keyset.Marks.observe`: each marked priority's smallest staged
        ``(xact, id)`` at or above its mark outside the ``paused`` queues and
        ``paused_tasks`` and the ``held`` rows (held for a paused queue:
        drain.daemon.piles), and this snapshot's xmin."""
        row = self._execute("fetch_heads", {
            "priorities": plan.priorities, "mark_xacts": plan.mark_xacts,
            "mark_ids": plan.mark_ids, "paused": paused or [], "held": held or [],
            "held_routes": held_routes or [], "paused_tasks": paused_tasks or [],
            **self._lane,
        }).fetchone()
        assert row is not None
        xmin, xacts, ids = row
        found: dict[int, tuple[int, int] | None] = {}
        for priority, xact, row_id in zip(plan.priorities, xacts or [], ids or [],  # type: ignore[call-overload]
                                          strict=True):
            found[priority] = None if xact is None else (int(xact), int(row_id))
        return found, int(xmin)  # type: ignore[call-overload]

    def pauses(self) -> list[tuple[str, str, str]] | None:
        """The operators' pauses (drain.postgres.pauses) as ``(kind, name, reason)``,
        read in the batch's snapshot, when they may have changed since the last
        read (a notification, a new session); None otherwise."""
        if not self.pauses_changed:
            return None
        # Cleared first: a notification heard while this reads (for a change after
        # this snapshot) sets it again.
        self.pauses_changed = False
        try:
            rows = self._execute("pauses").fetchall()
        except BaseException:
            self.pauses_changed = True
            raise
        return [(str(kind), str(name), str(reason)) for kind, name, reason, *_ in rows]

    def delete(self, rows: Mapping[int, int], suspects: Collection[int] = ()) -> Settled:
        """Delete the confirmed rows, each only as it was read (``{id: xact}``); a
        row changed since stays staged, a row locked is pending (drain.postgres.conflicts);
        ``suspects`` were locked in an earlier cycle: sorted before the delete."""
        return self._keyed("delete_confirmed", list(rows.items()), lambda keys: {
            "ids": sql.int_array(row_id for row_id, _ in keys),
            "xacts": sql.int_array(xact for _, xact in keys)}, suspects)

    def expire(self, exclude: list[int], limit: int,
               plan: keyset.FetchPlan = keyset.FROM_HEAD) -> tuple[int, Settled]:
        """Move up to ``limit`` of this lane's expired rows to dead_jobs: how many
        were found, and which moved or stayed (changed under the drain). ``plan``
        gives the expiry's low-water mark (drain.postgres.keyset)."""
        found = {int(row_id): int(xact) for row_id, xact in self._execute(  # type: ignore[call-overload]
            "expiring", {
                "exclude": sql.int_array(exclude), "limit": limit,
                "expiring_from": plan.expiring_from, "timed_xact": plan.timed_xact,
                **self._lane,
            }).fetchall()}
        if not found:
            return 0, Settled()
        return len(found), self.bury([(row_id, "expired", None) for row_id in found], found)

    def timed_heads(self, plan: keyset.FetchPlan) -> tuple[str | None, str | None, int]:
        """For :meth:`keyset.Marks.observe_timed`: the smallest staged due time and
        expiry at or above the marks or staged since the last look, and this
        snapshot's xmin."""
        row = self._execute("timed_heads", {
            "delayed_from": plan.delayed_from, "expiring_from": plan.expiring_from,
            "timed_xact": plan.timed_xact,
            **self._lane,
        }).fetchone()
        assert row is not None
        xmin, delayed, expiring = row
        return (None if delayed is None else str(delayed),
                None if expiring is None else str(expiring), int(xmin))  # type: ignore[call-overload]

    def bury(self, doomed: Sequence[tuple[int, str, str | None]],
             versions: Mapping[int, int], suspects: Collection[int] = ()) -> Settled:
        """Move rows to dead_jobs, ``[(id, reason, detail)]``, each only as it was
        read (``versions``: ``{id: xact}``); a row changed since stays staged, a
        row locked is pending (as :meth:`delete`)."""
        keys = [(row_id, versions[row_id], reason, detail)
                for row_id, reason, detail in doomed if row_id in versions]
        settled = self._keyed("bury", keys, lambda group: {
            "ids": [k[0] for k in group], "xacts": [str(k[1]) for k in group],
            "reasons": [k[2] for k in group], "details": [k[3] for k in group]}, suspects)
        settled.left += [row_id for row_id, _, _ in doomed if row_id not in versions]
        return settled

    def _keyed(self, name: str, keys: Sequence[K],
               params: Callable[[Sequence[K]], dict[str, object]],
               suspects: Collection[int] = ()) -> Settled:
        """Run the keyed statement ``name`` (it returns the ids it removed) in the
        batch, so that a row changed after the batch's snapshot costs that row
        only, and a row another transaction holds locked costs no wait and no
        change: each attempt in a savepoint, halved on a serialization failure;
        after a lock wait of more than KEYED_LOCK_TIMEOUT the rows locked now are
        set aside as pending first (drain.postgres.conflicts). Keys are tuples of
        the row's id and its xact, then anything."""
        def attempt(group: Sequence[K]) -> list[int]:
            # One round trip: the lock timeout (the batch's first keyed statement
            # only: SET LOCAL lasts the transaction), a savepoint (a conflict
            # undoes this statement only), the statement, the savepoint released.
            commands: list[tuple[str, dict[str, object] | None]] = []
            if not self._keyed_lock_timeout_set:
                # Before the savepoint: a failure of the statement, rolled back to
                # it, leaves the lock timeout set, and the retries need not send it.
                commands.append(("keyed_lock_timeout", {"timeout": KEYED_LOCK_TIMEOUT}))
                self._keyed_lock_timeout_set = True
            commands += [("keyed_savepoint", None), (name, params(group)),
                         ("keyed_release", None)]
            try:
                cursors = self._execute_all(commands)
            except psycopg.Error:
                # The session is fine (Session._guarded raised the driver's error):
                # the transaction goes on from before the statement.
                self._execute_all([("keyed_rollback", None), ("keyed_release", None)])
                raise
            return [int(row[0]) for row in cursors[-2].fetchall()]  # type: ignore[call-overload]

        def locked_now(group: Sequence[K]) -> set[int]:
            ids = [int(k[0]) for k in group]
            return {int(row[0]) for row in self._execute(  # type: ignore[call-overload]
                "locked_rows", {"ids": ids}).fetchall()}

        return isolate(keys, attempt, conflict=_conflict, key_id=_first, locked=_lock_wait,
                       locked_now=locked_now, suspects=suspects, key_version=_second)

    # -- the wake flag (drain.postgres.wakeup) -------------------------------------------------

    def arm(self, *, announce: bool) -> bool:
        """Raise the wake flag unless a writer may have read it low and is still
        open (then lower it again): True when armed (staging notifies)."""
        self.armed = False
        if not self._ask("take_sentinel", self._wake):
            return False  # another lane's drain is armed
        self._execute("raise_flag")
        if self._ask("silent_writers"):
            self._lower(announce=False)
            return False
        self.armed = True
        if announce:
            self._execute("announce")
        return True

    def disarm(self, *, announce: bool) -> None:
        """Lower the wake flag: staging is silent again."""
        self.armed = False
        self._lower(announce=announce)

    def armed_elsewhere(self) -> bool:
        return self._ask("armed_elsewhere", self._wake)

    def _lower(self, *, announce: bool) -> None:
        # Lowered before the sentinel is released: another lane may raise it next.
        self._execute("lower_flag")
        self._execute("release_sentinel", self._wake)
        if announce:
            self._execute("announce")

    def _reset_wake_flag(self) -> None:
        """On taking the lead: a leader that died armed left the flag raised
        (every staging statement then notifies); lower it unless some drain (a
        lane's) is armed now."""
        if self._ask("wake_flag") and self._ask("take_sentinel", self._wake):
            self._lower(announce=False)


def fetch_params(
    limit: int,
    *,
    exclude: list[int] | None = None,
    paused: list[str] | None = None,
    plan: keyset.FetchPlan | None = None,
    held_routes: list[str] | None = None,
    paused_tasks: list[str] | None = None,
    lanes: int = 1,
    lane: int = 0,
) -> dict[str, object]:
    """The parameters of the ``fetch_batch`` query (no plan: every priority from its head)."""
    plan = plan or keyset.FROM_HEAD
    exclude = exclude or []
    return {
        "limit": limit, "exclude": sql.int_array(exclude), "paused": paused or [],
        # The range of ``exclude`` (none: every id is above it): a row outside it is
        # not compared with each excluded id.
        "exclude_min": min(exclude, default=0),
        "exclude_max": max(exclude, default=sql.BIGINT_MIN),
        "held_routes": held_routes or [], "paused_tasks": paused_tasks or [],
        "priorities": plan.priorities, "mark_xacts": plan.mark_xacts,
        "mark_ids": plan.mark_ids,
        "gap_above": plan.gap_above, "gap_below": plan.gap_below,
        "delayed_from": plan.delayed_from, "timed_xact": plan.timed_xact,
        "lanes": lanes, "lane": lane,
    }


def _conflict(exc: Exception) -> bool:
    """A serialization failure, deadlock or lock timeout: the statement, not the
    session, failed."""
    return isinstance(exc, psycopg.Error) and rolled_back(exc)


def _lock_wait(exc: Exception) -> bool:
    """A lock timeout: a row or the table is locked, nothing changed."""
    return isinstance(exc, psycopg.Error) and exc.sqlstate == "55P03"


def _first(key: tuple[Any, ...]) -> int:
    return int(key[0])


def _second(key: tuple[Any, ...]) -> int:
    return int(key[1])

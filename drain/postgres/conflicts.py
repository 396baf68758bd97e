"""Rows that change under the drain: a conflict costs that row, never its batch.

What an UPDATE of a staged row means
------------------------------------
The schema lets an application update a staged row (make a delayed row due,
change its priority, queue or arguments). The drain publishes a row as it read
it, and removes it (a delete after the broker's confirm, a move to dead_jobs)
only *as it read it*: the same id and the same ``xact``, which the staging
trigger renews on every UPDATE. A row updated after the drain read it is left
staged, and its new version is published again later, with the same task id
(at-least-once): a consumer may see the old version and then the new one, and
the last version delivered is the row's last version. Nothing an UPDATE says
is lost, and nothing the drain did not publish is deleted.

Two ways a row can have changed, each costing that row only:

* updated (or deleted) and committed before the statement's snapshot: the
  ``xact`` no longer matches, the statement skips it;
* updated and committed after the batch's REPEATABLE READ snapshot: Postgres
  refuses the statement ("could not serialize access due to concurrent
  update", SQLSTATE 40001). :func:`isolate` runs each keyed statement in a
  savepoint; on such a failure it rolls back to it (the transaction and its
  snapshot go on) and tries each half of the rows again, down to the single
  rows that conflict: one hot row costs about 2·log2(batch) statements.

A locked row is not a changed row
---------------------------------
Another transaction may hold a row locked without changing it (``SELECT ...
FOR UPDATE``, a foreign key's ``FOR KEY SHARE``, an UPDATE not yet committed),
or hold the whole table in a mode a DELETE waits for (``LOCK TABLE ... IN
SHARE MODE``, a plain ``CREATE INDEX``). Before, the drain waited 50 ms for
such a lock, counted the lock timeout (SQLSTATE 55P03) as a change, halved the
batch and waited again: 2n-1 statements and up to n·50 ms on the loop thread
for n locked rows (77 s for 1,000: the broker dropped the connection on missed
heartbeats, /healthz failed), and every locked row was republished unchanged.
Now a lock costs no wait and no message:

* A keyed statement waits for a lock at most ``KEYED_LOCK_TIMEOUT`` (5 ms,
  drain.postgres.store). When it times out, one query says, without waiting,
  which of its rows are locked now (:func:`isolate`'s ``locked_now``,
  ``locked_rows`` in queries.sql): all of them while another session holds a
  lock on staged_jobs that conflicts with a DELETE (pg_locks); else each row
  whose ``xmax`` is the id of a transaction running now (a locker's or an
  updater's: every transaction holds a lock on its own id in pg_locks). Those
  rows are *pending*; the rest of the group runs again as one statement.
* Only a group that times out again (a lock taken just then, or a row
  locked by several transactions at once, whose ``xmax`` is a multixact id)
  is halved, each half waiting at most the 5 ms; a single row that times out
  is pending too, never changed.
* A pending row whose message the broker confirmed is not republished: it is
  *confirmed, delete pending* (drain.daemon.settle), kept out of the fetch and
  the expiry, and its delete is tried again in each later cycle, its rows
  sorted first (one query, no wait), with the cycle's own deletes in one
  statement, until it is deleted, or until the statement shows its ``xact``
  changed (the lock was an UPDATE, now committed): then it really changed, and
  is left staged and republished as above. A bury (a move to dead_jobs, of an
  expired or invalid row) that meets a lock is pending the same way, with its
  reason.

``FOR UPDATE SKIP LOCKED`` would say the same in the statement itself, but
Postgres requires UPDATE privilege for a row-locking clause, and the runner
role has SELECT and DELETE on staged_jobs only (staging_schema.sql): widening
it would let a drain rewrite jobs. ``xmax`` and pg_locks are readable by any
role. Deleting only as read still holds: a pending row is deleted by its id
and the ``xact`` read with the message the broker confirmed, in a later
transaction whose snapshot is newer; a row that changed meanwhile no longer
matches.

What a lock costs, then: one 5 ms wait and one sorting query in the cycle that
meets it, one sorting query per later cycle while rows are pending, and the
locked rows stay staged (their messages delivered once) until the lock ends.
While the lock lasts nothing on the loop thread waits for it, so the broker
connection is turned and /healthz stays alive as in any cycle.

Hot rows
--------
A row left staged this way would be fetched, published and left staged again
by every batch while it keeps changing. :class:`Cooling` holds such rows out
of the fetch (and the expiry) for a while: 0.1 s after the first conflict,
doubling up to 5 s while they keep conflicting, forgotten once the row is
removed or has been quiet for a minute. The rest of the batch, and every later
batch, flows meanwhile; the hot row's last version is published at most 5 s
after its last update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import TypeVar

#: Seconds a row is held out after its first conflict; doubled per conflict since.
FIRST_HOLD = 0.1
#: The longest hold.
MOST_HOLD = 5.0
#: Seconds after its hold ended after which a row's conflicts are forgotten.
FORGET_AFTER = 60.0

K = TypeVar("K")


@dataclasses.dataclass
class Settled:
    """What a keyed statement did: the ids it removed, the ids it left staged
    because they changed under the drain, and the rows it could not reach
    because another transaction holds them locked (``{id: xact}``: to try again
    later, see "A locked row is not a changed row")."""

    done: list[int] = dataclasses.field(default_factory=list)
    left: list[int] = dataclasses.field(default_factory=list)
    pending: dict[int, int] = dataclasses.field(default_factory=dict)

    def __iadd__(self, other: Settled) -> Settled:
        self.done += other.done
        self.left += other.left
        self.pending.update(other.pending)
        return self


def isolate(keys: Sequence[K], attempt: Callable[[Sequence[K]], list[int]],
            conflict: Callable[[Exception], bool], key_id: Callable[[K], int], *,
            locked: Callable[[Exception], bool] = lambda _exc: False,
            locked_now: Callable[[Sequence[K]], set[int]] | None = None,
            suspects: Collection[int] = (),
            key_version: Callable[[K], int] = lambda _key: 0) -> Settled:
    """Run ``attempt`` (one statement in its own savepoint, returning the ids it
    acted on) on ``keys``; when it raises a ``conflict``, on each half, down to the
    single keys that conflict, which are left. Anything else propagates.

    A conflict that is a lock wait (``locked``) is no change: the keys
    ``locked_now`` names (without waiting) are set aside as pending and the rest
    tried again as one group before any halving; a single key that still times
    out is pending too. The ``suspects`` (rows pending since an earlier cycle)
    are sorted that way before the first attempt."""
    settled = Settled()
    first: list[K] = list(keys)
    sortable = locked_now is not None
    if locked_now is not None and suspects:
        ids = set(suspects)
        held = locked_now([k for k in keys if key_id(k) in ids]) & ids
        settled.pending.update((key_id(k), key_version(k)) for k in keys if key_id(k) in held)
        first = [k for k in keys if key_id(k) not in held]
    todo: list[tuple[Sequence[K], bool]] = [(first, sortable)] if first else []
    while todo:
        group, may_sort = todo.pop()
        try:
            done = attempt(group)
        except Exception as exc:
            if not conflict(exc):
                raise
            is_lock = locked(exc)
            if is_lock and may_sort and locked_now is not None:
                held = locked_now(group)
                if held:
                    settled.pending.update(
                        (key_id(k), key_version(k)) for k in group if key_id(k) in held)
                    rest = [k for k in group if key_id(k) not in held]
                    if rest:
                        todo.append((rest, False))
                    continue
            if len(group) == 1:
                if is_lock:
                    settled.pending[key_id(group[0])] = key_version(group[0])
                else:
                    settled.left.append(key_id(group[0]))
            else:
                half = len(group) // 2
                todo += [(group[half:], False), (group[:half], False)]
            continue
        settled.done += done
        found = set(done)
        settled.left += [key_id(k) for k in group if key_id(k) not in found]
    return settled


class Cooling:
    """Rows held out of the fetch after they changed under the drain (see "Hot rows")."""

    def __init__(self) -> None:
        #: id -> (held until (monotonic), conflicts so far)
        self._rows: dict[int, tuple[float, int]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def struck(self, ids: Sequence[int], now: float) -> list[int]:
        """These rows were left staged: hold each out longer than last time.
        Returns the ones not held before (worth a log line)."""
        new = []
        for row_id in ids:
            _, count = self._rows.get(row_id, (0.0, 0))
            if not count:
                new.append(row_id)
            self._rows[row_id] = (now + min(FIRST_HOLD * 2.0**count, MOST_HOLD), count + 1)
        return new

    def settled(self, ids: Sequence[int]) -> None:
        """These rows are gone (published and deleted, moved to dead_jobs)."""
        if self._rows:
            for row_id in ids:
                self._rows.pop(row_id, None)

    def held(self, now: float) -> list[int]:
        """The rows held out now; forgets the ones quiet for FORGET_AFTER."""
        if not self._rows:
            return []
        for row_id in [r for r, (until, _) in self._rows.items() if until + FORGET_AFTER < now]:
            del self._rows[row_id]
        return [row_id for row_id, (until, _) in self._rows.items() if until > now]

    def clear(self) -> None:
        self._rows.clear()

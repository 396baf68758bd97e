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

Three ways a row can have changed, all costing that row only:

* updated (or deleted) and committed before the statement's snapshot: the
  ``xact`` no longer matches, the statement skips it;
* updated by a transaction still open: the row is locked; the statement waits
  for it at most ``KEYED_LOCK_TIMEOUT`` (50 ms, drain.postgres.store), then the lock
  timeout (SQLSTATE 55P03) counts as a conflict, as below (``FOR UPDATE SKIP
  LOCKED`` would need UPDATE on staged_jobs, which drain_runner has not);
* updated and committed after the batch's REPEATABLE READ snapshot: Postgres
  refuses the statement ("could not serialize access due to concurrent
  update", SQLSTATE 40001). :func:`isolate` runs each keyed statement in a
  savepoint; on such a failure it rolls back to it (the transaction and its
  snapshot go on) and tries each half of the rows again, down to the single
  rows that conflict: one hot row costs about 2·log2(batch) statements.

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
from collections.abc import Callable, Sequence
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
    """What a keyed statement did: the ids it removed, and the ids it left staged
    because they changed under the drain."""

    done: list[int] = dataclasses.field(default_factory=list)
    left: list[int] = dataclasses.field(default_factory=list)

    def __iadd__(self, other: Settled) -> Settled:
        self.done += other.done
        self.left += other.left
        return self


def isolate(keys: Sequence[K], attempt: Callable[[Sequence[K]], list[int]],
            conflict: Callable[[Exception], bool], key_id: Callable[[K], int]) -> Settled:
    """Run ``attempt`` (one statement in its own savepoint, returning the ids it
    acted on) on ``keys``; when it raises a ``conflict``, on each half, down to the
    single keys that conflict, which are left. Anything else propagates."""
    settled = Settled()
    todo: list[Sequence[K]] = [keys] if keys else []
    while todo:
        group = todo.pop()
        try:
            done = attempt(group)
        except Exception as exc:
            if not conflict(exc):
                raise
            if len(group) == 1:
                settled.left.append(key_id(group[0]))
            else:
                half = len(group) // 2
                todo += [group[half:], group[:half]]
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

"""Where the next fetch may start: low-water marks that keep it off dead rows.

The MVCC trap
-------------
The drain deletes every row it publishes. While any session in the database
holds an old snapshot (a forgotten ``BEGIN`` in an analytics tool, a long
report), vacuum cannot remove those deleted rows, and their index entries stay
at the head of the fetch's index. A fetch that starts at the head of the index
steps over every one of them, each time: measured here, 1.7 ms growing to
13.5 ms within 150 s at 1,000 jobs/s, and on without bound.

Keyset fetch
------------
Ready rows are read in ``(priority DESC, id)`` order. For each priority ``p``
the drain has seen it keeps a *low-water mark* ``W[p]``: no row of priority
``p`` that is visible now, or can ever become visible, has an id below it. The
fetch then starts each priority's scan at ``(p, W[p])``, past the dead entries.
Priorities the drain has not seen yet are read from the ranges between the
known ones (``priority > p1``, ``p2 < priority < p1``, ...): a new priority
costs nothing until it appears, and is known from its first batch on.

The rescan rule (late commits)
------------------------------
Ids are handed out when a row is inserted, not when its transaction commits:
a transaction can take id 100, stay open, and commit after id 101 was
published. A mark that simply followed the last id published would skip 100
forever. So a mark only moves to a *candidate* once no transaction that could
still commit a smaller id is running:

1. In each batch (one REPEATABLE READ snapshot ``S``), the candidate for ``p``
   is the smallest id of priority ``p`` still staged and visible at or above
   ``W[p]`` (rows in flight included), or, when there is none, one more than
   the largest id of ``p`` ever fetched. Any row of ``p`` that ``S`` cannot see
   yet belongs to a transaction that had started before ``S``.
2. After ``grace`` seconds (default 1 s), the drain notes the next
   transaction id that is not yet assigned, ``xmax`` of a snapshot then. A
   transaction that took an id before ``S`` had its transaction id assigned
   within that statement (an INSERT assigns it as it writes its first row),
   so it is below that ``xmax``.
3. Once the oldest running transaction is at or past that ``xmax``
   (``pg_snapshot_xmin`` of a later batch's snapshot), every such transaction
   has committed or rolled back. Rows it committed are visible to that later
   batch, so the mark moves to the smaller of the old candidate and the
   later batch's own candidate, never past a late-committed row.

A read-only transaction (the forgotten analytics session) has no transaction
id and does not hold the marks back; only a transaction that has written and
is still open does (in any database of the server: transaction ids are
server-wide), and then the fetch degrades gracefully towards the plain
head-of-index scan until it ends. Waiting only for this database's writers
would need other sessions' ``backend_xid``, which a least-privileged drain
role cannot see. As a backstop for anything step 2 assumes
(a row inserted by a statement paused for more than ``grace`` between taking
its id and writing it, which a user's BEFORE INSERT trigger could do), all
marks go back to the start every ``rescan_interval`` seconds (default 60 s):
at worst such a row waits that long. Candidates count every staged row,
whatever its queue, expiry or flight: rows of a queue the broker refuses for
now, or rows in flight that a broker failure sends back, stay above the mark.

Delayed rows (``not_before``) are read from the head of their own index, by
due time, and do not use marks: a row can be staged with a due time in the
past at any moment, so due time gives no safe low-water mark.

This module is pure bookkeeping; :mod:`drain.store` runs the queries.
"""

from __future__ import annotations

import collections
import dataclasses

#: smallint bounds, widened by one: the open ranges between known priorities.
PRIORITY_BELOW_MIN = -(2**15) - 1
PRIORITY_ABOVE_MAX = 2**15

#: At most this many priorities get their own mark; the rest are read through
#: the ranges between them (from their head: correct, only not dead-row proof).
MAX_KNOWN = 32

#: At most this many candidates wait for a rescan rule check (a stuck writer
#: would otherwise grow the list); dropping one only delays a mark.
MAX_PENDING = 256


@dataclasses.dataclass(frozen=True)
class FetchPlan:
    """The fetch's parameters: marked priorities and the ranges between them."""

    priorities: list[int]
    marks: list[int]
    gap_above: list[int]
    gap_below: list[int]


#: No marks: every priority from the head of the index (the "head" strategy).
FROM_HEAD = FetchPlan([], [], [PRIORITY_BELOW_MIN], [PRIORITY_ABOVE_MAX])


@dataclasses.dataclass
class _Pending:
    taken_at: float
    candidates: dict[int, int]
    #: ``xmax`` of a snapshot taken ``grace`` seconds after ``taken_at``.
    wait_for_xid: int | None = None


class Marks:
    """Low-water marks per priority, advanced by the rescan rule above."""

    def __init__(self, *, enabled: bool = True, grace: float = 1.0,
                 rescan_interval: float = 60.0) -> None:
        self.enabled = enabled
        self.grace = grace
        self.rescan_interval = rescan_interval
        #: priority -> mark (0: from the start of that priority)
        self._marks: dict[int, int] = {}
        #: priority -> largest id ever fetched
        self._max_fetched: dict[int, int] = {}
        #: priority -> when a row of it was last fetched (for MAX_KNOWN)
        self._last_seen: dict[int, float] = {}
        self._pending: collections.deque[_Pending] = collections.deque()
        self._reset_at: float | None = None
        self.rescans = 0

    def reset(self) -> None:
        """Forget every mark (a new session, or a rescan): the next fetch reads from the head."""
        self._marks = dict.fromkeys(self._marks, 0)
        self._pending.clear()
        self._reset_at = None

    def marks(self) -> dict[int, int]:
        return dict(self._marks)

    def plan(self, now: float) -> FetchPlan:
        """The parameters for the next fetch; starts the periodic rescan when due.
        Disabled marks plan every fetch from the head (:data:`FROM_HEAD`)."""
        if not self.enabled:
            return FROM_HEAD
        if self._reset_at is None:
            self._reset_at = now
        elif now - self._reset_at >= self.rescan_interval:
            self.reset()
            self._reset_at = now
            self.rescans += 1
        return self.current()

    def current(self) -> FetchPlan:
        """The marks as they stand, with the open ranges between them."""
        known = sorted(self._marks, reverse=True)
        above, below = [], []
        upper = PRIORITY_ABOVE_MAX
        for priority in [*known, PRIORITY_BELOW_MIN]:
            if upper - priority > 1:  # the open range (priority, upper) holds a smallint
                above.append(priority)
                below.append(upper)
            upper = priority
        return FetchPlan(known, [self._marks[p] for p in known], above, below)

    def fetched(self, rows: list[tuple[int, int]], now: float) -> None:
        """Record the ``(priority, id)`` of the ready rows just fetched."""
        if not self.enabled:
            return
        for priority, row_id in rows:
            if row_id > self._max_fetched.get(priority, 0):
                self._max_fetched[priority] = row_id
            self._last_seen[priority] = now
            if priority not in self._marks:
                self._marks[priority] = 0
        while len(self._marks) > MAX_KNOWN:
            oldest = min(self._marks, key=lambda p: self._last_seen.get(p, 0.0))
            for table in (self._marks, self._max_fetched, self._last_seen):
                table.pop(oldest, None)

    def observe(self, heads: dict[int, int | None], xmin: int, xmax: int, now: float) -> None:
        """Apply the rescan rule after a fetch.

        ``heads``: for each marked priority, the smallest id still staged at
        or above its mark in this batch's snapshot, whatever its queue, expiry
        or flight (None: none); ``xmin``/``xmax``: that snapshot's.
        """
        if not self.enabled:
            return
        current = self._candidates(heads)
        for pending in self._pending:
            if pending.wait_for_xid is None and now - pending.taken_at >= self.grace:
                pending.wait_for_xid = xmax
        while self._pending:
            pending = self._pending[0]
            if pending.wait_for_xid is None or xmin < pending.wait_for_xid:
                break
            self._pending.popleft()
            for priority, candidate in pending.candidates.items():
                if priority in self._marks and priority in current:
                    safe = min(candidate, current[priority])
                    self._marks[priority] = max(self._marks[priority], safe)
        if current and len(self._pending) < MAX_PENDING:
            self._pending.append(_Pending(now, current))

    def _candidates(self, heads: dict[int, int | None]) -> dict[int, int]:
        found: dict[int, int] = {}
        for priority in self._marks:
            head = heads.get(priority)
            if head is not None:
                found[priority] = head
            elif priority in heads and priority in self._max_fetched:
                found[priority] = self._max_fetched[priority] + 1
        return found

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
Ready rows are read in ``(priority DESC, xact, id)`` order, ``xact`` being the
id of the transaction that staged the row (``staging_schema.sql`` sets it,
whatever an INSERT or UPDATE says). For each priority ``p`` the drain has seen
it keeps a *low-water mark* ``W[p]``, a pair ``(xact, id)``: no row of
priority ``p`` that is visible now, or can ever become visible, sorts below
it. The fetch then starts each priority's scan at ``(p, W[p])``, past the dead
entries. Priorities the drain has not seen yet are read from the ranges
between the known ones (``priority > p1``, ``p2 < priority < p1``, ...): a new
priority costs nothing until it appears, and is known from its first batch on.

Why a mark is safe
------------------
Take a batch's REPEATABLE READ snapshot ``S`` and its ``xmin``
(``pg_snapshot_xmin``): every transaction id below ``xmin`` has ended
(committed or rolled back), and every transaction still running, or yet to
start, has an id at or above it. (Postgres leaves running ids at or above the
snapshot's ``xmax`` out of its list, but ``xmin`` is never above them either:
``xmin <= xmax``.) So a ready row of ``p`` that ``S`` cannot see yet, or that
does not exist yet, will carry ``xact >= xmin``:

* an INSERT that commits later runs in a transaction that is still running or
  not yet started: its ``xact`` is that transaction's id, ``>= xmin``;
* an UPDATE (a delayed row made ready, a new priority or queue) gives the row
  the updating transaction's id as its ``xact`` (the trigger), ``>= xmin``;
* a row given an ``xact`` of its own by the INSERT gets the real one instead.

Ids play no part: a sequence reset, an explicit or negative id, an identity
``CACHE`` handing out low ids late, all leave the argument as it is.

In ``S`` the drain also looks up ``H[p]``, the smallest ``(xact, id)`` of
priority ``p`` still staged at or above ``W[p]``, whatever its queue, expiry or
flight (a row in flight may come back: a nack, a return). The new mark is
``min(H[p], (xmin, -inf))``, or ``(xmin, -inf)`` when there is no such row,
and a mark only moves up. Rows below ``H[p]`` are gone for good (published,
deleted, expired); rows that come later sort at or above ``(xmin, -inf)``.
The mark applies at once: no grace period, no waiting for anything.

A read-only transaction (the forgotten analytics session) has no transaction
id and does not hold the marks back; only a transaction that has written and
is still open does (in any database of the server: transaction ids are
server-wide), and then the fetch degrades gracefully towards the plain
head-of-index scan until it ends. Waiting only for this database's writers
would need other sessions' ``backend_xid``, which a least-privileged drain
role cannot see.

Every ``rescan_interval`` seconds (default 300 s; 0: never) all marks go back
to the start. Nothing above relies on it; it is a belt-and-braces backstop,
and the property test runs with it turned off.

Paused queues
-------------
Rows of a queue the broker is refusing for now (a failed declare, messages
returned as unroutable) stay staged, and a mark that stopped at the first of
them would make every fetch step over all of them: 28 ms per batch at 200,000
such rows. So the look at the heads leaves out the queues paused at that
moment, and a mark may pass their rows. Those rows are visible, staged and
known to be wanted again later: the marks remember which queues they skipped
(:attr:`Marks.skipping`), and the moment one of them is no longer paused
every mark goes back to the start, as for a rescan. When a pause runs out,
the drain tries the queue by declaring it again, not by fetching its rows
(drain.daemon.piles, ``try_due``): the marks stay past the pile for as long as the
broker still refuses it, and go back only once it accepts it (is resumed: a
queue whose pause ran out and that is not tried yet still counts as paused
here). With ``--app``, rows held by id for a paused queue (staged without a
queue, routed there) are stepped over by the look too, and that queue counts
among the skipped ones: the marks pass them as well (drain.daemon.piles). Measured (``make
bench-paused``): a fetch of 1,000 rows took a median of 181 ms with
1,000,000 paused rows staged before this, 10.6 ms after (9.2 ms with none);
only the first looks after a start or a rescan step over the pile once.
Only the marked priorities skip: a priority known only through the ranges
between them, and delayed rows, still step over a paused queue's rows.

Delayed and expiring rows
-------------------------
Delayed rows (``not_before``) are read by due time from their own index, and
the expire query reads expiring rows by ``expires_at`` from theirs. Both
indexes collect the same dead entries under a held snapshot, so both reads
start at a low-water mark too: ``D`` (a due time) and ``E`` (an expiry), with
``X``, the ``xmin`` of the look that set them. Due time alone is no safe mark:
a row can be staged, or updated, with a due time in the past at any moment.
But such a row carries the ``xact`` of a transaction that had not ended when
the look's snapshot was taken, so ``xact >= X``; the reads also take the rows
below ``D`` (``E``) with ``xact >= X``, through an index on ``xact`` of the
delayed and expiring rows only (``staged_jobs_timed_xact_idx``), which holds
few entries above a recent ``X``.

The invariant: every delayed row that is staged, or will be, has a due time
``>= D`` or an ``xact >= X`` (the same for expiries and ``E``). A look (every
``HEADS_INTERVAL``, in the batch's snapshot ``S``) sets ``D`` to the smallest
due time among the staged rows with a due time ``>= D`` or ``xact >= X``
(by the invariant, all of them; ``infinity`` when there is none) and ``X`` to
``S``'s ``xmin``: the rows ``S`` sees are at or above the new ``D``, and the
rows it cannot see yet carry ``xact >= xmin``. Unlike the ready marks, ``D``
and ``E`` may move down (a late row below them) and take effect at once. A
rescan sets them back to ``-infinity``.

Only what committed moves a mark
--------------------------------
A look runs inside the batch's transaction, and that transaction may itself
have removed rows the look then no longer sees: expired rows moved to
dead_jobs before the fetch, say. Should the transaction roll back (a
serialization failure, a failed COMMIT), those rows are staged again, below
marks that were moved past them, and only a rescan would find them again
(never, with ``--rescan-interval 0``). So a look only *proposes* new marks:
:meth:`Marks.observe` and :meth:`Marks.observe_timed` record what they saw,
:meth:`Marks.commit` applies it once the batch's COMMIT succeeded and
:meth:`Marks.rollback` drops it (:meth:`Marks.transaction` does both).
Until then the marks stay where the last committed look left them, which is
always safe: a mark that lags only costs dead entries stepped over.

This module is pure bookkeeping; :mod:`drain.postgres.store` runs the queries.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

#: smallint bounds, widened by one: the open ranges between known priorities.
PRIORITY_BELOW_MIN = -(2**15) - 1
PRIORITY_ABOVE_MAX = 2**15

#: The smallest bigint: a mark ``(xact, ID_MIN)`` lets every id of ``xact`` through.
ID_MIN = -(2**63)

#: Where every priority starts: below every row.
START: tuple[int, int] = (0, ID_MIN)

#: Delayed and expiring rows from the start: every due time and expiry, no xmin.
TIMED_START: tuple[str, str, int] = ("-infinity", "-infinity", 0)

#: At most this many priorities get their own mark; the rest are read through
#: the ranges between them (from their head: correct, only not dead-row proof).
MAX_KNOWN = 32


@dataclasses.dataclass(frozen=True)
class FetchPlan:
    """The fetch's parameters: marked priorities and the ranges between them.

    ``marks`` are ``(xact, id)`` pairs, one per priority of ``priorities``.
    """

    priorities: list[int]
    marks: list[tuple[int, int]]
    gap_above: list[int]
    gap_below: list[int]
    #: Delayed and expiring rows (see "Delayed and expiring rows"): the due time
    #: and the expiry to read from (timestamptz text: '-infinity' from the start),
    #: and the xmin of the last look, above which rows below them are found.
    delayed_from: str = "-infinity"
    expiring_from: str = "-infinity"
    timed_xact: int = 0

    @property
    def mark_xacts(self) -> list[int]:
        return [xact for xact, _ in self.marks]

    @property
    def mark_ids(self) -> list[int]:
        return [row_id for _, row_id in self.marks]


#: No marks: every priority from the head of the index (the "head" strategy).
FROM_HEAD = FetchPlan([], [], [PRIORITY_BELOW_MIN], [PRIORITY_ABOVE_MAX])


class Marks:
    """Low-water marks per priority, moved by the rule above."""

    def __init__(self, *, enabled: bool = True, rescan_interval: float = 300.0) -> None:
        self.enabled = enabled
        self.rescan_interval = rescan_interval
        #: priority -> mark (START: from the start of that priority)
        self._marks: dict[int, tuple[int, int]] = {}
        #: priority -> when a row of it was last fetched (for MAX_KNOWN)
        self._last_seen: dict[int, float] = {}
        self._reset_at: float | None = None
        self.rescans = 0
        #: Paused queues whose rows the marks may have passed (see "Paused queues").
        self.skipping: frozenset[str] = frozenset()
        #: (delayed_from, expiring_from, timed_xact): see "Delayed and expiring rows".
        self._timed: tuple[str, str, int] = TIMED_START
        #: Looks of the batch under way, applied only once it committed (see
        #: "Only what committed moves a mark"): (heads, xmin, skipped) for the
        #: ready marks, and the last (delayed, expiring, xmin) for the timed ones.
        self._looks: list[tuple[dict[int, tuple[int, int] | None], int, list[str] | None]] = []
        self._timed_look: tuple[str, str, int] | None = None

    def reset(self) -> None:
        """Forget every mark (a new session, or a rescan): the next fetch reads from the head."""
        self._marks = dict.fromkeys(self._marks, START)
        self._reset_at = None
        self.skipping = frozenset()
        self._timed = TIMED_START
        self.rollback()

    def paused(self, queues: list[str]) -> None:
        """The queues paused now. A skipped queue that is no longer paused sends
        every mark back to the start: its rows are wanted again."""
        if self.skipping and not self.skipping <= set(queues):
            self.reset()

    def marks(self) -> dict[int, tuple[int, int]]:
        return dict(self._marks)

    def plan(self, now: float) -> FetchPlan:
        """The parameters for the next fetch; starts the periodic rescan when due.
        Disabled marks plan every fetch from the head (:data:`FROM_HEAD`)."""
        if not self.enabled:
            return FROM_HEAD
        if self._reset_at is None:
            self._reset_at = now
        elif self.rescan_interval > 0 and now - self._reset_at >= self.rescan_interval:
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
        return FetchPlan(known, [self._marks[p] for p in known], above, below, *self._timed)

    def observe_timed(self, delayed: str | None, expiring: str | None, xmin: int) -> None:
        """Propose the delayed and expiring marks after a look (``timed_heads``):
        the smallest due time and expiry still staged at or above the marks or
        staged by a transaction at or above the last look's xmin (None: none),
        and this look's xmin. They take effect at :meth:`commit`."""
        if self.enabled:
            self._timed_look = (delayed or "infinity", expiring or "infinity", xmin)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Wrap the batch transaction (outside it: enter before BEGIN, leave after
        COMMIT): the looks made inside apply if it committed, else are dropped."""
        self.rollback()
        try:
            yield
        except BaseException:
            self.rollback()
            raise
        self.commit()

    def commit(self) -> None:
        """The batch whose looks were proposed committed: move the marks."""
        looks, timed = self._looks, self._timed_look
        self.rollback()
        for heads, xmin, skipped in looks:
            self._move(heads, xmin, skipped)
        if timed is not None:
            self._timed = timed

    def rollback(self) -> None:
        """The batch rolled back (or never ran): forget what its looks saw."""
        self._looks = []
        self._timed_look = None

    def fetched(self, priorities: list[int], now: float) -> None:
        """Record the priorities of the ready rows just fetched."""
        if not self.enabled:
            return
        for priority in priorities:
            self._last_seen[priority] = now
            if priority not in self._marks:
                self._marks[priority] = START
        while len(self._marks) > MAX_KNOWN:
            oldest = min(self._marks, key=lambda p: self._last_seen.get(p, 0.0))
            self._marks.pop(oldest, None)
            self._last_seen.pop(oldest, None)

    def observe(self, heads: dict[int, tuple[int, int] | None], xmin: int,
                skipped: list[str] | None = None) -> None:
        """Propose moving the marks after a look at the heads (applied at :meth:`commit`).

        ``heads``: for each priority marked when the look was planned, the
        smallest ``(xact, id)`` still staged at or above its mark in the
        batch's snapshot, whatever its expiry or flight, in any queue but the
        ``skipped`` ones (the queues paused then; None: none); ``xmin``: that
        snapshot's ``pg_snapshot_xmin``.
        """
        if self.enabled:
            self._looks.append((dict(heads), xmin, list(skipped) if skipped else None))

    def _move(self, heads: dict[int, tuple[int, int] | None], xmin: int,
              skipped: list[str] | None) -> None:
        if skipped:
            self.skipping |= frozenset(skipped)
        bound = (xmin, ID_MIN)
        for priority, head in heads.items():
            mark = self._marks.get(priority)
            if mark is None:
                continue
            candidate = bound if head is None else min(head, bound)
            if candidate > mark:
                self._marks[priority] = candidate

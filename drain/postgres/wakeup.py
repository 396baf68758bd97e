"""Waking an idle drain without taxing the application's commits.

The cost being avoided
----------------------
A transaction with a pending ``NOTIFY`` takes one database-wide lock at commit
and holds it across its WAL flush (``PreCommit_Notify`` in Postgres's
``async.c``): concurrent writers that each send one can no longer share a
group commit, and their throughput falls as writers are added. Only an idle
drain needs a wake-up; a busy one looks again anyway.

The handshake
-------------
The *wake flag* is the sequence ``drain_wake``: odd while a drain is armed
(idle, sleeping until a ``NOTIFY``), even or never set otherwise.

* A staging statement (the trigger in ``staging_schema.sql``) reads the flag
  in its ``WHEN``: odd, it sends one ``NOTIFY``, delivered at commit; even, it
  sends nothing and no function runs. Reading a sequence locks it
  (``RowExclusiveLock``, which conflicts with nothing staging or the drain
  takes) until the reading transaction ends, and reads its current value, not
  a snapshot's.
* A drain whose looks found nothing :data:`ARM_AFTER` times in a row arms:
  it raises the flag (``setval``), then asks ``pg_locks`` whether any other
  session holds a lock on ``drain_wake``. If none does, it is armed: one more
  fetch in a new snapshot, then it sleeps until a ``NOTIFY`` or
  ``poll_interval``. If one does (a writer that may have read the flag before
  it was raised is still open), it lowers the flag again and looks again
  after a pause (1 ms, doubling up to :data:`MAX_RETRY`).
* A drain whose last look found work does not arm: it looks again soon. The
  pause follows the load: 1 ms after a few rows, longer after many
  (:data:`FILL_RATE`, up to :data:`BUSY_RETRY`, 20 ms), so that under heavy
  staging batches fill up. Under steady staging the drain never arms, the
  flag stays even, and no writer notifies.
* A NOTIFY makes an armed drain lower the flag at once (staging is silent
  again), before the cycle it starts.

Why no commit is missed
-----------------------
Take a row committed by transaction ``T`` while the drain sleeps armed. The
INSERT's ``WHEN`` locked ``drain_wake`` and then read the flag. If that lock
was taken after the drain read ``pg_locks``, the read came after the drain
raised the flag (which it did before reading ``pg_locks``): ``T`` saw it odd
and its NOTIFY wakes the drain. If the lock was taken before, ``pg_locks``
showed it unless ``T`` had already ended; since the drain armed, ``T`` had
ended, committed, before the final fetch took its snapshot, which therefore
sees the row. The flag is not MVCC state, so neither the application's
isolation level nor the drain's REPEATABLE READ matters; a savepoint rolled
back takes its rows with it, and the lock stays until the top transaction
ends. ``tests/integration/test_wakeup.py`` races commits against each step of
going idle.

Staging never waits and never fails for the drain's sake. A drain that dies
armed leaves the flag odd: staging then notifies on every statement (the old
cost, never a lost job) until another drain takes the lead (a hot standby
at once, or the next drain started) and lowers it.

Lanes
-----
Several lane drains share one table and so one flag; only one of them, the
*sentinel*, raises it, holding the advisory lock ``(WAKE_CLASS, the table's
oid)`` while it does. While the flag is odd every writer notifies, and a
NOTIFY reaches every listening drain; another lane that goes idle and finds
the sentinel lock held sleeps on those notifications. So that it misses
nothing, the sentinel announces (one NOTIFY of its own) when it arms, since
writers that were silent have ended and every lane must look once more, and
when it disarms, since writers go silent again and the other lanes must arm
in their turn. A lane drain that dies while it is the sentinel leaves the
others waiting at most ``poll_interval``.
"""

from __future__ import annotations

from typing import Protocol

#: The sentinel lock's class in the two-int advisory keyspace ("drnw"); its
#: second half is the staged_jobs table's oid.
WAKE_CLASS = 1685220983

#: Empty looks in a row before the drain arms: reading pg_locks is not free,
#: and under steady staging a look that finds nothing is usually followed by
#: one that finds something (it looks twice more first, 1 and 2 ms apart).
ARM_AFTER = 3

#: Seconds before the next look of a drain that is not armed: this after the
#: first look that found nothing, doubling after each further one; after a look
#: that found work, at least this and FILL_RATE's worth of the rows it found...
FIRST_RETRY = 0.001
#: ... at FILL_RATE rows per second (a look that found 50 rows waits 10 ms), at
#: most BUSY_RETRY: under heavy staging, batches fill up instead of one look per
#: millisecond for a handful of rows each, which costs the writers' throughput.
FILL_RATE = 5000.0
BUSY_RETRY = 0.02
#: The longest pause between two looks that find nothing while the drain
#: cannot arm (a staging transaction held open for minutes costs one
#: look this often).
MAX_RETRY = 0.05


class WakeFlag(Protocol):
    """The queries the handshake needs (:class:`drain.postgres.store.Store`)."""

    @property
    def armed(self) -> bool: ...

    def arm(self, *, announce: bool) -> bool: ...

    def disarm(self, *, announce: bool) -> None: ...

    def armed_elsewhere(self) -> bool: ...


class Wakeup:
    """Decides how long an idle drain may sleep, arming it first."""

    def __init__(self, lock: WakeFlag, *, lanes: int) -> None:
        self._lock = lock
        self._announce = lanes > 1
        self._retry = 0.0
        self._empty = 0

    def pause(self, found: int, poll_interval: float) -> float:
        """After a cycle that found ``found`` rows, fewer than a batch: seconds
        the drain may sleep before its next cycle (a NOTIFY ends the sleep
        early). 0 means look again at once."""
        lock = self._lock
        if found:
            # Work is coming in: look again soon, without arming (an armed drain
            # makes every writer notify). Under heavy staging, let a batch fill.
            self.busy()
            self._empty = 0
            self._retry = 0.0
            return min(max(found / FILL_RATE, FIRST_RETRY), BUSY_RETRY)
        if lock.armed:
            return poll_interval
        self._empty += 1
        if self._empty >= ARM_AFTER:
            if lock.arm(announce=self._announce):
                self._retry = 0.0
                return 0.0  # one more look, in a snapshot taken after pg_locks
            if self._announce and lock.armed_elsewhere():
                return poll_interval  # another lane's drain is the sentinel
        self._retry = min(max(2 * self._retry, FIRST_RETRY), MAX_RETRY)
        return self._retry

    def busy(self) -> None:
        """The drain has work (a NOTIFY woke it, or a cycle found rows): disarm
        at once, before the next cycle, so that writers stop notifying as soon
        as possible."""
        if self._lock.armed:
            self._lock.disarm(announce=self._announce)

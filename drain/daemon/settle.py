"""The end of a batch's path: remove what the broker confirmed, or what can never
be a message, each row only as the drain read it (drain.postgres.conflicts).

:class:`Settle` remembers the version (``xact``) of every row fetched and still
in flight, removes the confirmed and the doomed rows by ``(id, xact)`` in the
batch's transaction, and, once that committed, counts what went and holds out
of later fetches the rows left staged because they changed under the drain.
drain.daemon.pipeline runs it in each cycle.

A row another transaction holds locked is not changed (drain.postgres.conflicts, "A
locked row is not a changed row"): its delete, or its move to dead_jobs, is
*pending*. Settle keeps it, with the version it was read as (and its reason),
out of the fetch and the expiry, and tries it again with each later cycle's own
deletes and moves, until it goes or proves changed. Pending rows outlive a
lost session or broker connection: each was confirmed (or doomed) as that
version, so removing it later as that version is as safe as it was then.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable

from drain.broker.batches import PublishResult
from drain.daemon.metrics import Metrics
from drain.postgres.conflicts import Cooling, Settled
from drain.postgres.rows import StagedRow
from drain.postgres.store import Store

log = logging.getLogger("drain.settle")

#: A row to move to dead_jobs: (id, reason, detail).
Doomed = tuple[int, str, str]


class Settle:
    """Remove rows as they were read; hold out the ones that keep changing."""

    def __init__(self, store: Store, metrics: Metrics) -> None:
        self._store = store
        self.metrics = metrics
        #: Rows that changed under the drain, held out of the fetch a while.
        self.cooling = Cooling()
        #: id -> xact of the rows fetched and in flight.
        self._versions: dict[int, int] = {}
        #: Confirmed rows whose delete waits for a lock: id -> xact.
        self.pending_delete: dict[int, int] = {}
        #: Rows to move to dead_jobs that are locked: id -> (xact, reason, detail).
        self.pending_bury: dict[int, tuple[int, str, str | None]] = {}

    def forget(self) -> None:
        """The batches in flight were dropped: their rows stay staged."""
        self._versions = {}

    def held(self) -> list[int]:
        """The rows to leave out of the fetch and the expiry now."""
        return [*self.cooling.held(time.monotonic()), *self.pending_delete,
                *self.pending_bury]

    def read(self, rows: Iterable[StagedRow]) -> None:
        """Remember the version of each row fetched."""
        self._versions.update((row.id, row.xact) for row in rows)

    def remove(self, results: list[PublishResult],
               doomed: list[Doomed]) -> tuple[Settled, Settled]:
        """In the batch: delete the confirmed rows and move the doomed ones (and the
        messages the broker refused for good) to dead_jobs, each only as it was read:
        a row changed since stays staged."""
        confirmed = {row_id: self._versions[row_id] for r in results for row_id in r.confirmed}
        confirmed.update(self.pending_delete)  # tried again (drain.postgres.conflicts)
        doomed += [(m.row_id, "refused", refusal.text[:1000]) for r in results
                   for m, refusal in r.refused if refusal.action == "dead"]
        versions, burying = self._versions, list[tuple[int, str, str | None]](doomed)
        if self.pending_bury:  # tried again too
            versions = {**versions, **{i: v for i, (v, _, _) in self.pending_bury.items()}}
            burying += [(i, reason, detail) for i, (_, reason, detail)
                        in self.pending_bury.items()]
        return (self._store.delete(confirmed, self.pending_delete) if confirmed else Settled(),
                self._store.bury(burying, versions, self.pending_bury) if burying else Settled())

    def committed(self, inflight: Iterable[int], expired: Settled, deleted: Settled,
                  buried: Settled, doomed: list[Doomed]) -> None:
        """After the batch committed: keep the versions of the rows still in flight,
        count what went, and hold out the rows left staged because they changed
        under the drain, longer each time they do."""
        self._versions = {row_id: self._versions[row_id] for row_id in inflight}
        if expired.done:
            self.metrics.expired.inc(len(expired.done))
            self.metrics.dead_lettered.labels("expired").inc(len(expired.done))
            log.warning("moved %d expired job(s) to dead_jobs (reason 'expired')",
                        len(expired.done))
        self.metrics.deleted.inc(len(deleted.done))
        reasons = {row_id: (reason, detail) for row_id, (_, reason, detail)
                   in self.pending_bury.items()}
        reasons.update((row_id, (reason, detail)) for row_id, reason, detail in doomed)
        moved = set(buried.done)
        for reason, count in sorted(collections.Counter(
                reasons[row_id][0] for row_id in moved if row_id in reasons).items()):
            if reason == "expired":  # a pending expiry (drain.postgres.conflicts)
                self.metrics.expired.inc(count)
            self.metrics.dead_lettered.labels(reason).inc(count)
            log.warning("moved %d job(s) to dead_jobs (reason %r)", count, reason)
        self._pend(expired, deleted, buried, reasons)
        self.cooling.settled([*expired.done, *deleted.done, *buried.done])
        left = [*expired.left, *deleted.left, *buried.left]
        if left:
            self.metrics.conflicted.inc(len(left))
            if self.cooling.struck(left, time.monotonic()):
                log.info("%d row(s) changed under the drain after it read them (updated): "
                         "left staged, published again as they are now", len(left))

    def _pend(self, expired: Settled, deleted: Settled, buried: Settled,
              reasons: dict[int, tuple[str, str | None]]) -> None:
        """Keep the rows whose removal waits for a lock, forget the ones that went or
        changed, and say when rows start or stop waiting."""
        before = len(self.pending_delete) + len(self.pending_bury)
        if self.pending_delete:
            for row_id in [*deleted.done, *deleted.left]:
                self.pending_delete.pop(row_id, None)
        if self.pending_bury:
            for row_id in [*expired.done, *expired.left, *buried.done, *buried.left]:
                self.pending_bury.pop(row_id, None)
        self.pending_delete.update(deleted.pending)
        for row_id, xact in buried.pending.items():
            self.pending_bury[row_id] = (xact, *reasons[row_id])
        for row_id, xact in expired.pending.items():
            self.pending_bury[row_id] = (xact, "expired", None)
        now = len(self.pending_delete) + len(self.pending_bury)
        self.metrics.delete_pending.set(now)
        if now and not before:
            log.info("%d row(s) held locked by another transaction (SELECT ... FOR UPDATE, "
                     "LOCK TABLE, an UPDATE under way): their messages are delivered, their "
                     "delete waits for the lock, tried again each cycle", now)
        elif before and not now:
            log.info("the rows held locked were deleted: none pending")

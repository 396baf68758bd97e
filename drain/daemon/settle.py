"""The end of a batch's path: remove what the broker confirmed, or what can never
be a message, each row only as the drain read it (drain.postgres.conflicts).

:class:`Settle` remembers the version (``xact``) of every row fetched and still
in flight, removes the confirmed and the doomed rows by ``(id, xact)`` in the
batch's transaction, and, once that committed, counts what went and holds out
of later fetches the rows left staged because they changed under the drain.
drain.daemon.pipeline runs it in each cycle.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable

from drain.broker.publisher import PublishResult
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

    def forget(self) -> None:
        """The batches in flight were dropped: their rows stay staged."""
        self._versions = {}

    def held(self) -> list[int]:
        """The rows to leave out of the fetch and the expiry now."""
        return self.cooling.held(time.monotonic())

    def read(self, rows: Iterable[StagedRow]) -> None:
        """Remember the version of each row fetched."""
        self._versions.update((row.id, row.xact) for row in rows)

    def remove(self, results: list[PublishResult],
               doomed: list[Doomed]) -> tuple[Settled, Settled]:
        """In the batch: delete the confirmed rows and move the doomed ones (and the
        messages the broker refused for good) to dead_jobs, each only as it was read:
        a row changed since stays staged."""
        confirmed = {row_id: self._versions[row_id] for r in results for row_id in r.confirmed}
        doomed += [(m.row_id, "refused", refusal.text[:1000]) for r in results
                   for m, refusal in r.refused if refusal.action == "dead"]
        return (self._store.delete(confirmed) if confirmed else Settled(),
                self._store.bury(doomed, self._versions) if doomed else Settled())

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
        moved = set(buried.done)
        for reason, count in sorted(collections.Counter(
                r for row_id, r, _ in doomed if row_id in moved).items()):
            self.metrics.dead_lettered.labels(reason).inc(count)
            log.warning("moved %d job(s) to dead_jobs (reason %r)", count, reason)
        self.cooling.settled([*expired.done, *deleted.done, *buried.done])
        left = [*expired.left, *deleted.left, *buried.left]
        if left:
            self.metrics.conflicted.inc(len(left))
            if self.cooling.struck(left, time.monotonic()):
                log.info("%d row(s) changed under the drain after it read them (updated, or "
                         "held by another transaction): left staged, published again as "
                         "they are now", len(left))

"""Waiting for the broker's confirms of the batches in flight: the window.

drain.daemon.pipeline publishes a batch per cycle and, before the cycle's
transaction deletes what was confirmed, asks :class:`Confirms` to collect: to
wait until there is room for the next batch, and to report what the broker
answered meanwhile (drain.broker.batches). The window counts messages, not
batches, because RabbitMQ confirms out of order over many queues: a batch
waiting for a slow queue's last few confirms must not hold back the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from drain.broker.batches import Batch, PublishResult
from drain.broker.publisher import Publisher
from drain.daemon.metrics import Metrics
from drain.errors import BrokerBlocked
from drain.settings.config import Settings

#: Seconds the drain waits, with no backlog, for the last confirms of a batch before
#: it goes on without them (a slow queue's: :meth:`Confirms.collect`).
LINGER = 0.25


def owed(inflight: Iterable[Batch]) -> bool:
    """Batches in flight that the next cycle waits for (not only a slow queue's last
    messages, which it collects as they come): the loop does not idle."""
    return any(not batch.lingered for batch in inflight)


class Confirms:
    """Collect the confirms of a leading drain's batches in flight."""

    def __init__(self, settings: Settings, publisher: Publisher, metrics: Metrics) -> None:
        self.settings = settings
        self._publisher = publisher
        self.metrics = metrics

    def collect(self, pending: list[Batch], results: list[PublishResult], *,
                 everything: bool, timeout: float | None) -> None:
        """Wait for confirms, into ``results``: what the broker answered, each message
        reported once (drain.broker.batches), and the batches all of whose messages
        were, out of ``pending``.

        While a backlog lasts, until the window has room for the next batch: at most
        ``(pipeline - 1) x batch_size`` messages unanswered between cycles, so at
        most ``pipeline x batch_size`` once the next batch is out (the bound on
        duplicates per crash), in at most 2 x ``pipeline`` batches. The window
        counts messages, not batches: over many queues RabbitMQ confirms out of
        order, and a batch waiting for its last few confirms does not hold back
        the next, while the rows of its confirmed messages go at once.

        With ``everything`` (no backlog left: nothing would follow to overlap with,
        so a lone job takes one transaction; or publishing failed), until every
        message is answered, except that it waits at most LINGER for the
        last ones of a batch: those are a slow queue's, the batch stays in flight
        and later cycles collect it without waiting for it. A batch out longer than
        the confirm timeout, or once a batch's connection failed, is waited for
        whole (given up after a whole confirm timeout without a confirm for it).
        A broker that blocks publishing ends the wait: the rest stays in flight.
        """
        settings = self.settings
        window = (settings.pipeline - 1) * settings.batch_size
        deadline = time.monotonic() + LINGER

        def roomy() -> bool:
            return sum(batch.unresolved for batch in pending) <= window

        def settled() -> bool:
            return all(batch.lingered or not batch.unresolved for batch in pending)

        while pending:
            oldest = pending[0]
            whole = (any(r.error for r in results) or len(pending) > 2 * settings.pipeline
                     or (everything and timeout is not None)  # stopping
                     or time.monotonic() - oldest.published_at > settings.confirm_timeout)
            if not whole and (settled() if everything else roomy()):
                break
            target = (oldest if whole or not everything else
                      next(b for b in pending if b.unresolved and not b.lingered))
            try:
                if whole:
                    result = self._wait(target, timeout)
                elif everything:
                    result = self._wait(target, timeout, settled,
                                        max(deadline - time.monotonic(), 0.0))
                else:
                    result = self._wait(target, timeout, roomy)
            except BrokerBlocked:
                return  # in flight until the alarm clears: see _blocked
            if result is not None:
                results.append(result)
                pending.remove(target)
            elif everything and not settled():  # out of patience: go on without them
                for batch in pending:
                    batch.lingered = batch.lingered or bool(batch.unresolved)
        for batch in list(pending):  # what came meanwhile, of the batches still out
            result = self._publisher.harvest(batch)
            if result is not None:
                results.append(result)
            if batch.done:
                pending.remove(batch)

    def _wait(self, batch: Batch, timeout: float | None = None,
              enough: Callable[[], bool] | None = None,
              patience: float | None = None) -> PublishResult | None:
        """Wait for a batch's confirms, timed, or only until ``enough()`` or for
        ``patience`` seconds (then None: the batch is still in flight); BrokerBlocked
        if the broker blocks first."""
        started = time.perf_counter()
        try:
            if enough is None:
                return self._publisher.wait(batch, timeout, until_blocked=True)
            return self._publisher.wait_some(batch, enough, timeout, until_blocked=True,
                                             patience=patience)
        finally:
            self.metrics.confirm_seconds.observe(time.perf_counter() - started)

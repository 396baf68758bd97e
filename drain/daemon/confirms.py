"""Waiting for the broker's confirms of the batches in flight: the window.

drain.daemon.pipeline publishes a batch per cycle and, before the cycle's
transaction deletes what was confirmed, asks :class:`Confirms` to collect: to
wait until there is room for the next batch, and to report what the broker
answered meanwhile (drain.broker.batches). The window counts messages, not
batches, because RabbitMQ confirms out of order over many queues: a batch
waiting for a slow queue's last few confirms must not hold back the rest.
"""

from __future__ import annotations

import math
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
#: Seconds one cycle waits for room in the window at most (less with a shorter
#: confirm timeout): its transaction is open meanwhile, holding a snapshot.
COLLECT_BUDGET = 5.0


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

    def room(self, pending: list[Batch]) -> bool:
        """Whether the window has room for another batch: at most
        ``(pipeline - 1) x batch_size`` messages unanswered, in at most
        2 x ``pipeline`` batches."""
        settings = self.settings
        return (len(pending) <= 2 * settings.pipeline
                and sum(batch.unresolved for batch in pending)
                <= (settings.pipeline - 1) * settings.batch_size)

    def collect(self, pending: list[Batch], results: list[PublishResult], *,
                everything: bool, timeout: float | None) -> None:
        """Wait for confirms, into ``results``: what the broker answered, each message
        reported once (drain.broker.batches), and the batches all of whose messages
        were, out of ``pending``.

        While a backlog lasts, until the window has :meth:`room` for the next batch:
        at most ``pipeline x batch_size`` messages unanswered once it is out (the
        bound on duplicates per crash). The window counts messages, not batches:
        over many queues RabbitMQ confirms out of order, and a batch waiting for its
        last few confirms does not hold back the next, while the rows of its
        confirmed messages go at once. A cycle waits at most COLLECT_BUDGET (the
        batch's transaction stays short however slowly the broker confirms); the
        next one then fetches nothing until there is room (drain.daemon.pipeline).

        With ``everything`` (no backlog left: nothing would follow to overlap with,
        so a lone job takes one transaction; or publishing failed), until every
        message is answered, except that it waits at most LINGER for the last ones
        of a batch: those are a slow queue's, the batch stays in flight and later
        cycles collect it without waiting for it.

        A batch with no answer for a whole confirm timeout is given up (its rows
        stay staged; the connection starts afresh); on a new channel that has
        answered nothing at all, after MUTE_WAIT (drain.broker.channels), the
        channel is replaced instead. Stopping (``timeout``), every
        batch is waited for, each up to ``timeout``. A broker that blocks
        publishing ends the wait: the rest stays in flight.
        """
        publisher = self._publisher
        until = time.monotonic() + (LINGER if everything else
                                    min(COLLECT_BUDGET, self.settings.confirm_timeout))

        def room() -> bool:
            return self.room(pending)

        def settled() -> bool:
            return all(batch.lingered or not batch.unresolved for batch in pending)

        goal = settled if everything else room
        try:
            while pending:
                batch = oldest = pending[0]
                oldest.oldest_at = oldest.oldest_at or time.monotonic()
                if timeout is not None or any(r.error for r in results):
                    # Stopping, or the connection failed: what came before the end.
                    result = self._wait(oldest, timeout)
                elif self._silent_for(oldest) > self.settings.confirm_timeout:
                    result = publisher.give_up(oldest)
                elif self._mute_in(oldest) <= 0:
                    # A new channel that never answered: its messages stay staged.
                    publisher.replace_mute(self._silent_for(oldest))
                    continue
                elif goal():
                    break
                elif time.monotonic() >= until:
                    if not everything:
                        break  # the next cycle goes on collecting before it fetches
                    for each in pending:  # out of patience: go on without them
                        each.lingered = each.lingered or bool(each.unresolved)
                    continue
                else:
                    if everything:
                        batch = next(b for b in pending if b.unresolved and not b.lingered)
                    result = self._wait(batch, None, goal, min(
                        until - time.monotonic(),
                        self.settings.confirm_timeout - self._silent_for(oldest),
                        self._mute_in(oldest)))
                if result is not None:
                    results.append(result)
                    pending.remove(batch)
        except BrokerBlocked:
            return  # in flight until the alarm clears: see _blocked
        self._harvest(pending, results)

    def _silent_for(self, oldest: Batch) -> float:
        """Seconds since the broker last answered a message of ``oldest``, or since it
        became the oldest in flight, or since the broker lifted a block, whichever
        came last: the confirm timeout runs from then, as it does for a whole wait
        (drain.broker.publisher, ``Publisher.wait``)."""
        since = max(oldest.oldest_at, oldest.answered_at, self._publisher.unblocked_at)
        return time.monotonic() - since

    def _mute_in(self, oldest: Batch) -> float:
        """Seconds until the channel ``oldest`` went out on counts as mute, if it has
        answered nothing yet (drain.broker.channels, ``replace_mute``);
        infinite once it has."""
        limit = self._publisher.mute_limit(oldest)
        return math.inf if limit is None else limit - self._silent_for(oldest)

    def _harvest(self, pending: list[Batch], results: list[PublishResult]) -> None:
        """What came meanwhile, of the batches still out."""
        for batch in list(pending):
            result = self._publisher.harvest(batch)
            if result is not None:
                results.append(result)
            if batch.done:
                pending.remove(batch)

    def _wait(self, batch: Batch, timeout: float | None = None,
              enough: Callable[[], bool] | None = None,
              patience: float = 0.0) -> PublishResult | None:
        """Wait for a batch's confirms, timed; with ``enough``, only until it holds or
        for ``patience`` seconds (then None: the batch is still in flight);
        BrokerBlocked if the broker blocks first."""
        started = time.perf_counter()
        try:
            if enough is None:
                return self._publisher.wait(batch, timeout, until_blocked=True)
            return self._publisher.wait_some(batch, enough, timeout, until_blocked=True,
                                             patience=max(patience, 0.0))
        finally:
            self.metrics.confirm_seconds.observe(time.perf_counter() - started)

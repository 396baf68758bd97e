"""The batches in flight on one publishing channel, and the broker's answers to them.

:class:`Window` is where :class:`drain.broker.publisher.Publisher` keeps what it
has published and not yet handed back: each batch owns a run of the channel's
delivery tags (they count from 1 per channel), and every ``basic.ack``,
``basic.nack`` and ``basic.return`` is matched here to the messages it is for
(below: how a return is matched).
The publisher writes, turns the I/O loop and decides what to do with a channel;
the window only counts.

A batch carries the generation of the connection it went out on: what the
window holds of an older connection is never answered again (its channel went
with it), and is not matched against the new one's answers.

Matching a return to its publish
--------------------------------
A ``basic.return`` carries no delivery tag, and a task id is no identity:
two staged rows may share one (re-staging a job under its id), and both can
be in flight at once. What the broker does guarantee, on one channel: it
handles publishes in order, sends the return of an unroutable message while
it handles that publish, and confirms a message only after handling it. So
when a return arrives, every ack or nack received so far is for an earlier
publish: the returned message's tag is above the highest tag confirmed so
far. Among the messages in flight above that tag, the return is matched by
task id and routing key; if more than one fits (same task id, same queue,
both still unconfirmed), every one of them counts as returned. Their rows
stay staged and are published again: a duplicate with the same task id at
worst, never a row deleted for a message the broker dropped.
"""

from __future__ import annotations

import contextlib
import time

from drain.broker.batches import Batch
from drain.broker.refusal import ACKED, DROPPED, NACKED, RESOLVED, RETURNED


class Window:
    """The batches in flight, oldest first, and the current channel's tag counters."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []
        #: The delivery tag of the current channel's last message published.
        self.base_tag = 0
        #: The lowest tag a ``multiple`` answer may still cover.
        self.low = 1
        #: The highest delivery tag any ack or nack has named on this channel.
        self.confirmed_up_to = 0
        #: When the current channel first and last answered (monotonic; 0.0: not yet).
        self.first_heard_at = self.heard_at = 0.0

    def open(self, count: int, generation: int) -> Batch:
        """A new batch owning the next ``count`` delivery tags."""
        batch = Batch(base=self.base_tag, status=bytearray(count), generation=generation)
        self.base_tag += count
        self.batches.append(batch)
        return batch

    def sent(self, batch: Batch, sent: int) -> None:
        """Only ``sent`` of the batch's messages went out: the next batch's tags start
        right after them (no answer can have come yet: the I/O loop has not turned)."""
        del batch.status[sent:]
        self.base_tag = batch.base + sent

    def remove(self, batch: Batch) -> None:
        with contextlib.suppress(ValueError):
            self.batches.remove(batch)

    def of(self, generation: int) -> list[Batch]:
        """The batches published on the current connection."""
        return [b for b in self.batches if b.generation == generation]

    def leave_channel(self, generation: int) -> None:
        """The current channel is replaced: its batches (all answered, or given up)
        leave the window, so that none takes an answer of the new channel."""
        self.batches = [b for b in self.batches if b.generation != generation]
        self.base_tag = 0  # tags count from 1 again
        self.low = 1
        self.confirmed_up_to = 0
        self.first_heard_at = self.heard_at = 0.0

    @property
    def heard(self) -> bool:
        """The current channel has answered something (an ack or a nack)."""
        return self.first_heard_at > 0.0

    def answered(self, generation: int) -> bool:
        """Every message published on the current channel was answered."""
        return all(b.resolved >= len(b.status) for b in self.of(generation))

    def drop_unanswered(self, generation: int) -> None:
        """Give up the current channel's messages the broker has not answered:
        DROPPED, their rows stay staged (drain.broker.refusal's statuses)."""
        for batch in self.of(generation):
            for i, status in enumerate(batch.status):
                if not status & RESOLVED:
                    batch.status[i] |= DROPPED
                    batch.resolved += 1

    def on_return(self, task_id: str, routing_key: str, exchange: str,
                  generation: int) -> None:
        """Flag the publish a ``basic.return`` is for (drain.broker.publisher's docstring)."""
        above = self.confirmed_up_to
        for batch in self.batches:
            if batch.generation != generation or batch.base + len(batch.status) <= above:
                continue
            for i in range(max(above - batch.base, 0), len(batch.messages)):
                m = batch.messages[i]
                if (m.task_id == task_id and m.routing_key == routing_key
                        and m.exchange == exchange):
                    batch.status[i] |= RETURNED

    def on_confirm(self, tag: int, multiple: bool, acked: bool) -> None:
        """An ack (``acked``) or a nack for ``tag``, or for every tag up to it."""
        status = ACKED if acked else NACKED
        first = self.low if multiple else tag
        self.confirmed_up_to = max(self.confirmed_up_to, tag)
        now = time.monotonic()
        if not self.first_heard_at:
            self.first_heard_at = now
        self.heard_at = now
        for batch in self.batches:
            size = len(batch.status)
            if batch.base >= tag:
                break
            if batch.base + size < first:
                continue
            statuses = batch.status
            batch.answered_at = now
            start, end = max(first - batch.base - 1, 0), min(tag - batch.base, size)
            if statuses.count(0, start, end) == end - start:
                # None answered nor returned yet (a multiple ack, mostly): all at once.
                statuses[start:end] = bytes((status,)) * (end - start)
                batch.resolved += end - start
                continue
            for i in range(start, end):
                if not statuses[i] & RESOLVED:
                    statuses[i] |= status
                    batch.resolved += 1
        if multiple:
            self.low = max(self.low, tag + 1)

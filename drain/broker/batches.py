"""What became of a published batch: its messages' answers, reported once each.

A :class:`Batch` is the messages :class:`drain.broker.publisher.Publisher` wrote
together, with a status per message (drain.broker.refusal: acked, nacked,
returned, refused). :func:`report` turns the answers that came into a
:class:`PublishResult`, the drain's view (confirmed rows to delete, returned and
nacked rows that stay staged, the pause keys they touch), and marks each
reported message, so that a batch can be reported in parts: the drain deletes
the rows the broker confirmed while other messages of the same batch are still
waiting for theirs (over many queues, RabbitMQ confirms out of order).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable

from drain.broker.outgoing import Message, PauseKey
from drain.broker.refusal import ACKED, NACKED, RESOLVED, RETURNED, Refusal
from drain.errors import BrokerUnavailable

#: A message's status flag once a :class:`PublishResult` reported it.
REPORTED = 16


@dataclasses.dataclass(eq=False)
class Batch:
    """Messages published together; their delivery tags are base+1 .. base+len."""

    base: int
    status: bytearray
    #: Which connection published it; tags mean nothing on another one.
    generation: int = 0
    messages: list[Message] = dataclasses.field(default_factory=list)
    resolved: int = 0
    #: Messages the broker refused (drain.broker.refusal), by index.
    refusals: dict[int, Refusal] = dataclasses.field(default_factory=dict)
    #: Messages already reported (:func:`report`): their rows are no longer in flight.
    reported: int = 0
    #: When it became the oldest in flight (the confirms of one channel come in
    #: order, mostly: a batch waits its turn; drain.daemon.confirms), and when the
    #: broker last answered one of its messages (time.monotonic()).
    oldest_at: float = 0.0
    answered_at: float = 0.0
    #: A wait for it ran out of patience (drain.daemon.pipeline): its last messages
    #: are slow to be answered, and the drain goes on without waiting for them.
    lingered: bool = False

    #: :attr:`row_ids`, kept while neither the messages nor the reported ones change.
    _row_ids: tuple[tuple[int, int], list[int]] | None = dataclasses.field(
        default=None, repr=False)

    @property
    def row_ids(self) -> list[int]:
        """The rows still in flight: published and not reported yet (each cycle
        asks twice for every batch in flight; the list must not be changed)."""
        key = (self.reported, len(self.messages))
        if self._row_ids is not None and self._row_ids[0] == key:
            return self._row_ids[1]
        if not self.reported:
            ids = [m.row_id for m in self.messages]
        else:
            status = self.status
            ids = [m.row_id for i, m in enumerate(self.messages) if not status[i] & REPORTED]
        self._row_ids = (key, ids)
        return ids

    @property
    def unresolved(self) -> int:
        """Messages the broker has not answered yet."""
        return len(self.status) - self.resolved

    @property
    def done(self) -> bool:
        """Every message reported."""
        return self.reported >= len(self.messages)


@dataclasses.dataclass
class PublishResult:
    """What became of one batch, or of the part of it reported at once."""

    #: Row ids whose messages the broker confirmed (acked, not returned).
    confirmed: list[int]
    #: Row ids whose messages came back unroutable (``mandatory``, no queue bound).
    returned: list[int]
    #: Number of messages the broker nacked.
    nacked: int
    #: Set when the batch ended early (connection lost, confirm timeout);
    #: the confirmed rows are still safe to delete.
    error: BrokerUnavailable | None = None
    #: What the returned messages pause (drain.daemon.holds): their declared queue,
    #: or their exchange and routing key when nothing is declared for them.
    returned_keys: set[PauseKey] = dataclasses.field(default_factory=set)
    #: The pause keys of the confirmed messages: a confirm resumes them.
    confirmed_keys: set[PauseKey] = dataclasses.field(default_factory=set)
    #: Row id -> the pause key of its returned message.
    returned_to: dict[int, PauseKey] = dataclasses.field(default_factory=dict)
    #: Messages the broker refused by closing the channel, and what becomes of
    #: their rows (drain.broker.refusal).
    refused: list[tuple[Message, Refusal]] = dataclasses.field(default_factory=list)
    #: The pause keys of the nacked messages: the drain pauses these.
    nacked_keys: set[PauseKey] = dataclasses.field(default_factory=set)

    @property
    def returned_declared(self) -> set[str]:
        """The queues declared for the returned messages: declared again next time."""
        return {key.queue for key in self.returned_to.values() if key.queue}


def report(batch: Batch, error: BrokerUnavailable | None = None, *,
           answered_only: bool = False) -> PublishResult:
    """The messages of ``batch`` not reported yet, as a result, each marked reported.

    ``answered_only``: only those the broker answered (acked, nacked or refused);
    the others stay in flight for a later report. Otherwise the batch is over:
    every message is reported, and one that was never answered is in no list
    (its row stays staged)."""
    status, messages = batch.status, batch.messages
    picked = [i for i in range(len(messages)) if not status[i] & REPORTED
              and (not answered_only or status[i] & RESOLVED)]
    confirmed = [i for i in picked if status[i] == ACKED]
    returned = [messages[i] for i in picked if status[i] & RETURNED]
    nacked = [i for i in picked if status[i] & NACKED]
    refusals = batch.refusals
    result = PublishResult(
        [messages[i].row_id for i in confirmed],
        [m.row_id for m in returned],
        len(nacked),
        error,
        returned_keys={m.pause_key for m in returned},
        confirmed_keys=_keys(messages[i] for i in confirmed),
        returned_to={m.row_id: m.pause_key for m in returned},
        refused=[(messages[i], refusals[i]) for i in picked if i in refusals],
        nacked_keys=_keys(messages[i] for i in nacked),
    )
    for i in picked:
        status[i] |= REPORTED
    batch.reported += len(picked)
    return result


#: Where a message goes: what its pause key is made of (:attr:`Message.pause_key`).
_WHERE = operator.attrgetter("queue", "exchange", "routing_key")


def _keys(messages: Iterable[Message]) -> set[PauseKey]:
    """The pause keys of ``messages``: thousands of messages, a few keys, each made once."""
    return {PauseKey.of(queue or routing_key, exchange, routing_key)
            for queue, exchange, routing_key in set(map(_WHERE, messages))}

"""Publishing batches to RabbitMQ with pipelined publisher confirms.

pika's ``BlockingConnection`` waits one round trip per confirmed message
(~1,100 msg/s here). This publisher drives a ``SelectConnection`` from the
calling thread instead: :meth:`Publisher.start` writes a whole batch with
``mandatory=True`` and returns at once; :meth:`Publisher.wait` runs the I/O
loop until every delivery tag of that batch is acked or nacked, the
connection dies, or the confirm timeout passes. Several batches can be in
flight, so the drain publishes the next batch while the broker confirms the
previous ones; :meth:`Publisher.wait_some` waits only until enough of them
are answered, and :meth:`Publisher.harvest` reports the answers of a batch
still in flight (drain.broker.batches), so that one queue's slow confirms
hold back only its own rows (drain.daemon.confirms). The frames of a batch
are joined into a few large writes before the loop turns (pika would send
each frame with its own system call), through the corkable transport of
drain.broker.corked. Nothing runs in the background: the I/O loop only turns
inside ``connect``, the waits and ``pump`` (which the drain calls while idle,
so heartbeats keep flowing).

The connection's life (opening, closing, turning the I/O loop, the broker's
alarms, error texts) is :class:`drain.broker.amqp_link.AmqpLink`'s, and declaring the
queues before a batch goes to them is
:class:`drain.broker.queue_declare.QueueDeclaringLink`'s; :class:`Publisher` builds
on both and owns what happens to a batch: publishing it, and matching the
broker's acks, nacks and returns to its messages.

A message counts as delivered only when its ``basic.ack`` arrived and no
``basic.return`` came before it. Anything else (nack, return, timeout, a
connection lost mid-batch) leaves it undelivered and its row stays staged. A
publish the broker refuses by closing the channel (``404 NOT_FOUND - no
exchange``) costs that message alone: drain.broker.refusal finds it among the
unconfirmed ones on a new channel, and the connection and the rest are kept. A
``basic.return`` carries no delivery tag: drain.broker.window says how it is
matched to its publish.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pika

from drain.broker.amqp import EncodedProperties
from drain.broker.batches import Batch, PublishResult, report
from drain.broker.broker_list import BrokerList
from drain.broker.channels import ChannelKeepingLink
from drain.broker.outgoing import Message
from drain.broker.queue_declare import QueueSpec
from drain.broker.refusal import ACKED, RESOLVED, RETURNED, Refusal
from drain.errors import BrokerBlocked, BrokerUnavailable, QueueDeclareRefused

log = logging.getLogger("drain.publisher")


class Publisher(ChannelKeepingLink):
    """One AMQP connection and one confirm-mode channel."""

    def __init__(
        self,
        parameters: pika.ConnectionParameters | BrokerList,
        *,
        display_url: str,
        declare: str = "celery",
        confirm_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        secrets: list[str] | None = None,
        queue_max_priority: int = 0,
        specs: Callable[[str], QueueSpec] | None = None,
    ) -> None:
        super().__init__(parameters, display_url=display_url, declare=declare,
                         confirm_timeout=confirm_timeout, connect_timeout=connect_timeout,
                         secrets=secrets, queue_max_priority=queue_max_priority, specs=specs)
        #: Called while a wait for confirms goes on past the confirm timeout because
        #: confirms still come (:meth:`wait`): the drain's loop is not stuck.
        self.on_progress: Callable[[], None] | None = None
        #: The broker closed the publishing channel (drain.broker.refusal): its reply.
        self._refusal: str | None = None

    # -- connection (drain.broker.amqp_link opens, closes and turns it) -----------------

    def _new_connection(self) -> None:
        super()._new_connection()
        self._refusal = None

    def _prepare_channel(self, channel: Any) -> None:
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(ack_nack_callback=self._on_confirm,
                                 callback=self._on_channel_ready)

    # -- publishing -----------------------------------------------------------

    def start(self, messages: Iterable[Message], *, queues: set[str], count: int) -> Batch:
        """Publish a batch without waiting for its confirms; see :meth:`wait`.

        ``messages`` may be a lazy iterable, built as it is published. Their
        frames are held back while the batch is written and sent in a few large
        writes when it is done (drain.broker.corked), before the I/O loop turns
        again. Several batches may be in flight at once.

        Raises :class:`BrokerUnavailable` when nothing could be published (not
        connected, a queue declare refused). A failure after publishing began
        is reported by :meth:`wait` instead, so that the caller can still
        delete the rows confirmed before it.
        """
        self._raise_if_failed()
        if not self.connected:
            raise BrokerUnavailable(f"broker at {self._display_url}: not connected")
        if self._refusal is not None:
            self._recover()  # the new batch's tags count on the new channel
            self._raise_if_failed()
            self.declare(queues)  # a queue it forgot (drain.broker.refusal, "retry")
        if self._nacked:
            self._renew()
            self._raise_if_failed()
        undeclared = queues - self._declared
        if undeclared:
            raise BrokerUnavailable(f"queues not declared yet: {sorted(undeclared)}")
        # Delivery tags count up from 1 per channel; this batch owns the next `count`.
        batch = self._window.open(count, self._generation)
        channel = self._channel
        # pika sends each frame with its own send(): hold the batch's frames back and
        # write them joined into a few chunks (drain.broker.corked).
        transport = self.transport
        if transport is not None:
            transport.cork()
        try:
            for m in messages:
                batch.messages.append(m)
                channel.basic_publish(
                    exchange=m.exchange,
                    routing_key=m.routing_key,
                    body=m.body,
                    properties=EncodedProperties(m.encoded_properties),
                    mandatory=True,
                )
        except Exception as exc:
            self._failure = self._failure or self._text(exc)
        finally:
            if transport is not None:
                transport.uncork()
        sent = len(batch.messages)
        if sent < count:
            # Fewer went out than announced (``messages`` skipped some, or the
            # channel failed).
            self._window.sent(batch, sent)
        # pika only writes when its I/O loop turns: send the batch now, not when
        # the next cycle waits for confirms (measured: ~2 ms of latency per job).
        if sent:
            self._turn(0.0)
        return batch

    def forget_inflight(self) -> None:
        """Drop the batches nobody will wait for (their rows stay staged).

        Late confirms for them are ignored: delivery tags are never reused.
        """
        self._window.batches = []

    def wait(
        self, batch: Batch, timeout: float | None = None, *, until_blocked: bool = False
    ) -> PublishResult:
        """Wait for ``batch``'s confirms and report them: up to ``timeout``, or by
        default until a whole confirm timeout passes without a confirm for the
        batch (a slow broker's batch is kept as long as its confirms come; one
        that stopped confirming it is given up).

        With ``until_blocked``, a broker that blocks the connection (a resource
        alarm) ends the wait early with :class:`BrokerBlocked` and leaves the batch
        in flight: the broker has stopped reading, not lost anything, and its
        confirms come once the alarm clears. The confirm timeout counts from the
        next wait, so a long alarm never makes the drain abandon the batch.

        What was reported of the batch before (:meth:`harvest`) is not reported
        again."""
        return self._end(batch, self._await(batch, timeout, until_blocked, None, None))

    def wait_some(self, batch: Batch, enough: Callable[[], bool], timeout: float | None = None,
                  *, until_blocked: bool = False,
                  patience: float | None = None) -> PublishResult | None:
        """:meth:`wait`, except that it also ends once ``enough()`` holds (checked as
        confirms come), or after ``patience`` seconds: then None, and the batch stays
        in flight."""
        error = self._await(batch, timeout, until_blocked, enough, patience)
        if error is None and batch.resolved < len(batch.status):
            return None
        return self._end(batch, error)

    def harvest(self, batch: Batch) -> PublishResult | None:
        """Without waiting: the messages of ``batch`` the broker answered since its
        last report (None if none). Once every message was, the batch is over."""
        if batch.resolved <= batch.reported:
            return None
        result = report(batch, answered_only=True)
        if batch.done:
            self._window.remove(batch)
        return result

    def give_up(self, batch: Batch) -> PublishResult:
        """End ``batch`` without the confirms still missing, after a whole confirm
        timeout without one (drain.daemon.confirms): its unanswered rows stay staged."""
        return self._end(batch, self._abandon(batch, self._confirm_timeout))

    def _abandon(self, batch: Batch, waited: float) -> BrokerUnavailable:
        """No confirm for ``batch`` for ``waited`` seconds: the connection starts
        afresh, so that no late ack is ever taken for another batch's."""
        self._failure = self._failure or "abandoned a batch after the confirm timeout"
        return BrokerUnavailable(
            f"broker at {self._display_url} confirmed {batch.resolved} of "
            f"{len(batch.status)} messages, then none for {waited:g}s")

    def _await(self, batch: Batch, timeout: float | None, until_blocked: bool,
               enough: Callable[[], bool] | None,
               patience: float | None) -> BrokerUnavailable | None:
        """Turn the I/O loop until ``batch`` is answered (or ``enough()``, or
        ``patience`` ran out); the error that ended it early, if any (see :meth:`wait`)."""
        n = len(batch.status)
        limit = self._confirm_timeout if timeout is None else min(timeout, self._confirm_timeout)
        if patience is not None:
            limit = min(limit, patience)
        current = batch.generation == self._generation and self._conn is not None

        def done() -> bool:
            return (batch.resolved >= n or self._failure is not None
                    or self._refusal is not None or (until_blocked and self.blocked is not None)
                    or (enough is not None and enough()) or self._nacked)

        def turn() -> bool:
            finished = self._run_until(done, limit)
            if (self._nacked and batch.resolved < n and self._failure is None
                    and self._refusal is None):
                # A channel that nacks may hold the rest for seconds each (a quorum
                # queue it met without a leader): it goes now, not after the window.
                self._renew()
                finished = batch.resolved >= n or self._run_until(done, limit)
            return finished

        seen = batch.resolved
        finished = current and turn()
        # A broker that confirms slowly has not stopped (thousands of queues, each
        # writing its own messages, confirm a few dozen a second): the batch is given
        # up only after a whole confirm timeout without a confirm for it.
        while (current and not finished and timeout is None and patience is None
               and batch.resolved > seen and self._failure is None and self._refusal is None):
            seen = batch.resolved
            if self.on_progress is not None:
                self.on_progress()
            finished = turn()
        if current and self._refusal is not None:
            self._recover()  # resolves every message published on the refused channel
            finished = batch.resolved >= n or self._run_until(done, limit)
        if (until_blocked and current and self.blocked is not None
                and batch.resolved < n and self._failure is None):
            raise BrokerBlocked(self.blocked)
        if not current:
            return BrokerUnavailable(
                f"broker at {self._display_url}: connection lost before the batch was confirmed"
            )
        if self._failure is not None:
            return BrokerUnavailable(
                f"broker at {self._display_url} lost mid-batch: {self._failure}"
            )
        if not finished and patience is not None:
            return None  # still in flight: the caller goes on without it
        return None if finished else self._abandon(batch, limit)

    def _end(self, batch: Batch, error: BrokerUnavailable | None) -> PublishResult:
        """The batch is over: what was not reported yet (drain.broker.batches)."""
        self._window.remove(batch)
        return report(batch, error)

    def publish(self, messages: Sequence[Message]) -> PublishResult:
        """Declare, publish a batch and wait for its confirms (for tools and tests)."""
        queues = {m.declared_queue for m in messages}
        refused = self.declare(queues)
        if refused:
            queue, reason = next(iter(refused.items()))
            raise QueueDeclareRefused(queue, reason, self._declare_mode)
        batch = self.start(messages, queues=queues, count=len(messages))
        return self.wait(batch)

    # -- pika callbacks ----------------------------------------------------------

    def _on_return(self, _channel: Any, method: Any, properties: Any, _body: bytes) -> None:
        self._window.on_return(str(properties.correlation_id), method.routing_key,
                               method.exchange, self._generation)

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        acked = isinstance(method, pika.spec.Basic.Ack)
        self._heard(acked)
        self._window.on_confirm(method.delivery_tag, method.multiple, acked)
        self._wake()

    # -- a publish the broker refused (drain.broker.refusal) ------------------------------

    @property
    def refusal(self) -> str | None:
        """The broker's reply when it closed the publishing channel on a refused
        publish, until the next start or wait sorts the unconfirmed messages out."""
        return self._refusal

    def _channel_refused(self, exc: BaseException) -> bool:
        conn = self._conn
        if (not isinstance(exc, pika.exceptions.ChannelClosedByBroker) or conn is None
                or not conn.is_open or self._failure is not None):
            return False
        self._refusal = self._text(exc)
        self._channel = None
        self._wake()
        return True

    def _recover(self) -> None:
        """The broker closed the publishing channel: find the refused messages among
        the unconfirmed ones (drain.broker.refusal), then open a new publishing channel.

        Every message of the old channel ends resolved (acked, nacked, returned or
        refused), unless the connection fails meanwhile (then ``_failure`` is set
        and the unresolved ones stay staged, as when a connection is lost)."""
        reply, self._refusal = self._refusal, None
        batches = self._window.of(self._generation)
        suspects: list[tuple[Batch, int]] = []
        for batch in batches:
            for i in range(len(batch.messages)):
                if batch.status[i] & RESOLVED:
                    continue
                if batch.status[i] & RETURNED:
                    # Handled (unroutable) before the close; its ack was lost with it.
                    batch.status[i] |= ACKED
                    batch.resolved += 1
                else:
                    suspects.append((batch, i))
        log.warning("broker at %s refused a publish: %s (the channel closed); publishing "
                    "the %d unconfirmed message(s) again one at a time to find it",
                    self._display_url, reply, len(suspects))

        def resolve(index: int, status: int, refusal: Refusal | None) -> None:
            batch, i = suspects[index]
            batch.status[i] |= status
            batch.resolved += 1
            if refusal is not None:
                batch.refusals[i] = refusal

        self.probe([batch.messages[i] for batch, i in suspects], resolve)
        self._reopen("no new channel in time after a refused publish")

"""A publish the broker refuses: finding the one message, keeping the rest.

RabbitMQ answers some publishes by closing the channel (not the connection):
``404 NOT_FOUND - no exchange 'x'`` (a route to an exchange nobody declared),
``406 PRECONDITION_FAILED`` (a message over the broker's ``max_message_size``),
``403 ACCESS_REFUSED`` (no write permission on the exchange). The broker then
drops every later publish on that channel, and the confirms of the earlier
ones that had not arrived yet are lost with it. Which message it was, the
close does not say.

So every message published on that channel and not confirmed yet is a
*suspect*. :meth:`RefusalProbingLink.probe` publishes the suspects again, one
at a time in their publish order, on a channel of its own, each waiting for
its confirm: the one whose publish closes the channel is the refused one (the
*culprit*); the channel is opened anew and the probe goes on with the next.
The connection is kept. A suspect published before the culprit on the first
channel may have been enqueued then and is enqueued again now: a duplicate
with the same task id, never a loss.

What becomes of a culprit (:func:`verdict`):

* ``dead``: refused for what it is (404 on an exchange nobody declares, 406):
  no retry can change that; its row goes to dead_jobs, reason ``refused``,
  with the broker's reply text.
* ``retry``: a 404 on an exchange the drain declares itself for the message's
  queue (deleted behind its back): every queue declared with that exchange is
  forgotten, so it is declared again (exchange, queue and binding) before the
  next publish to it, and the row stays staged. Every time, not only the first
  on a connection: what a redeclare cures is never dead-lettered. What keeps
  that from becoming a loop (an exchange deleted again and again) is the
  drain's backoff (drain.daemon.holds): a retry that comes again before a
  message to that queue was confirmed pauses it, longer each time.
* ``hold``: anything else (403 ACCESS_REFUSED is the drain's permission, not
  the row's): the row stays staged, its pause key (drain.broker.outgoing.PauseKey)
  is paused with backoff and the error is logged.

The other suspects to the exchange of a ``retry`` or ``hold`` are resolved
alike unprobed (they would be refused alike, each at the cost of a channel).

Every refused publish counts in ``drain_publish_refused_total{code}``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import pika
import pika.exceptions

from drain.broker.amqp import EncodedProperties
from drain.broker.outgoing import Message
from drain.broker.queue_declare import QueueDeclaringLink

#: A message's status in its batch: pending until acked or nacked; RETURNED is
#: a flag set by a basic.return (before the ack that resolves it); REFUSED: its
#: publish closed the channel (see :class:`Refusal`); DROPPED: it went out on a
#: channel the publisher gave up before the broker answered (its row stays
#: staged, as when a connection is lost; drain.broker.channels).
#: 16 is drain.broker.batches' REPORTED.
PENDING, ACKED, NACKED, RETURNED, REFUSED, DROPPED = 0, 1, 2, 4, 8, 32
RESOLVED = ACKED | NACKED | REFUSED | DROPPED

#: Reply codes that say what is wrong with the message itself: dead-lettered.
DEAD_CODES = frozenset({404, 406})


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why the broker refused one message, and what becomes of its row."""

    #: The AMQP reply code (404, 406, 403...).
    code: int
    #: The broker's reply, as ``404 NOT_FOUND - no exchange 'x' in vhost '/'``.
    text: str
    #: ``dead`` (to dead_jobs), ``retry`` (staged; queue declared again) or
    #: ``hold`` (staged; its pause key paused).
    action: str


def verdict(code: int, *, redeclare: bool) -> str:
    """What becomes of a refused message: see the module's docstring.
    ``redeclare``: a 404 that declaring its queue again cures (an exchange the
    drain declares itself)."""
    if code == 404 and redeclare:
        return "retry"
    return "dead" if code in DEAD_CODES else "hold"


class RefusalProbingLink(QueueDeclaringLink):
    """A :class:`QueueDeclaringLink` that can find which suspects the broker refuses."""

    _confirm_timeout: float

    def probe(self, suspects: Sequence[Message],
              resolve: Callable[[int, int, Refusal | None], None]) -> None:
        """Publish ``suspects`` one at a time; ``resolve(index, status, refusal)`` each.

        Stops early (the rest unresolved) when the connection fails or a
        confirm does not come within the confirm timeout: then ``_failure``
        says why, as for any batch.
        """
        channel: _ProbeChannel | None = None
        held: dict[str, Refusal] = {}
        try:
            for index, m in enumerate(suspects):
                if m.exchange in held:
                    resolve(index, REFUSED, held[m.exchange])
                    continue
                if channel is None:
                    channel = self._probe_channel()
                    if channel is None:
                        return
                status, closed = self._probe_one(channel, m)
                if closed is None:
                    if not status & RESOLVED:
                        return
                    resolve(index, status, None)
                    continue
                channel = None
                refusal = self._judge(m, closed)
                if refusal.action != "dead":
                    held[m.exchange] = refusal
                resolve(index, REFUSED, refusal)
        finally:
            if channel is not None and channel.closed is None:
                channel.channel.close()

    def _judge(self, m: Message, exc: pika.exceptions.ChannelClosedByBroker) -> Refusal:
        ours = (exc.reply_code == 404 and self._declare_mode != "passive"
                and self._declares_exchange(m.declared_queue, m.exchange))
        action = verdict(exc.reply_code, redeclare=ours)
        if action == "retry":
            # The exchange went, and every binding to it with it: declare again
            # each queue declared with it, not only this message's.
            for queue in {m.declared_queue} | self._declared:
                if self._declares_exchange(queue, m.exchange):
                    self.forget(queue)
        return Refusal(exc.reply_code, self._text(exc), action)

    def _declares_exchange(self, queue: str, exchange: str) -> bool:
        """Whether declaring ``queue`` declares ``exchange`` (never ``''``)."""
        return bool(exchange) and any(b.exchange.name == exchange and b.declare_exchange
                                      for b in self._specs(queue).bindings)

    def _probe_channel(self) -> _ProbeChannel | None:
        """A new confirm-mode channel, or None when the connection failed."""
        conn = self._conn
        if conn is None or self._failure is not None:
            return None
        probe = _ProbeChannel(self._wake)
        conn.channel(on_open_callback=probe.on_open)
        if not self._run_until(lambda: probe.ready or self._failure is not None,
                               self._connect_timeout):
            self._failure = self._failure or "no channel in time to find a refused publish"
        return probe if probe.ready and self._failure is None else None

    def _probe_one(self, probe: _ProbeChannel, m: Message
                   ) -> tuple[int, pika.exceptions.ChannelClosedByBroker | None]:
        """Publish ``m`` alone and wait: (its status, the close if the broker refused it).

        A status without RESOLVED and no close: the connection failed or the
        confirm timed out (``_failure`` says so)."""
        probe.status = PENDING
        probe.channel.basic_publish(
            exchange=m.exchange, routing_key=m.routing_key, body=m.body,
            properties=EncodedProperties(m.encoded_properties), mandatory=True,
        )
        finished = self._run_until(
            lambda: bool(probe.status & RESOLVED) or probe.closed is not None
            or self._failure is not None, self._confirm_timeout)
        closed = probe.closed
        if isinstance(closed, pika.exceptions.ChannelClosedByBroker):
            return probe.status, closed
        if not finished or closed is not None:
            self._failure = self._failure or (
                f"no confirm within {self._confirm_timeout:g}s while finding a refused publish"
                if closed is None else self._text(closed))
        return probe.status, None


class _ProbeChannel:
    """A confirm-mode channel with one message in flight at a time: whatever is
    confirmed, returned or closes it is about that message."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self.channel: Any = None
        self.ready = False
        self.status = PENDING
        self.closed: BaseException | None = None

    def on_open(self, channel: Any) -> None:
        self.channel = channel
        channel.add_on_close_callback(self.on_close)
        channel.add_on_return_callback(self.on_return)
        channel.confirm_delivery(ack_nack_callback=self.on_confirm, callback=self.on_ready)

    def on_ready(self, _frame: Any) -> None:
        self.ready = True
        self._wake()

    def on_confirm(self, frame: Any) -> None:
        self.status |= ACKED if isinstance(frame.method, pika.spec.Basic.Ack) else NACKED
        self._wake()

    def on_return(self, *_args: Any) -> None:
        self.status |= RETURNED

    def on_close(self, _channel: Any, exc: BaseException) -> None:
        self.closed = exc
        self._wake()

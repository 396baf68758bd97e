"""Publishing batches to RabbitMQ with pipelined publisher confirms.

pika's ``BlockingConnection`` waits one round trip per confirmed message
(~1,100 msg/s here). This publisher drives a ``SelectConnection`` from the
calling thread instead: :meth:`Publisher.start` writes a whole batch with
``mandatory=True`` and returns at once; :meth:`Publisher.wait` runs the I/O
loop until every delivery tag of that batch is acked or nacked, the
connection dies, or the confirm timeout passes. Two batches can be in flight,
so the drain publishes the next batch while the broker confirms the previous
one. The frames of a batch are joined into a few large writes before the loop
turns (pika would send each frame with its own system call: +10 % msg/s
measured). Nothing runs in the background: the I/O loop only turns inside
``connect``, ``wait`` and ``pump`` (which the drain calls while idle, so
heartbeats keep flowing).

A message counts as delivered only when its ``basic.ack`` arrived and no
``basic.return`` came before it. Anything else (nack, return, timeout, a
connection lost mid-batch) leaves it undelivered and its row stays staged.

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

import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pika
import pika.exceptions
from pika.adapters.select_connection import SelectConnection

from drain.amqp import EncodedProperties
from drain.errors import BrokerBlocked, BrokerRefused, BrokerUnavailable, QueueDeclareRefused
from drain.message import Message
from drain.urls import scrub

log = logging.getLogger(__name__)

#: A message's status in its batch: pending until acked or nacked; _RETURNED is
#: a flag set by a basic.return (before the ack that resolves it).
_PENDING, _ACKED, _NACKED, _RETURNED = 0, 1, 2, 4
_RESOLVED = _ACKED | _NACKED

#: pika queues each AMQP frame on its own and sends each with its own send()
#: call: three per message. Before the I/O loop turns, the frames of a batch
#: are joined into chunks of up to this many bytes (drain.publisher.coalesce).
COALESCE_BYTES = 128 * 1024


def coalesce(conn: object, limit: int = COALESCE_BYTES) -> None:
    """Join the frames pika has queued for sending into chunks of up to ``limit`` bytes.

    The bytes and their order stay the same (the first buffer may be the rest of
    a partial send; it stays first), and so does pika's count of buffered bytes;
    only the number of send() calls drops, from three per message to a few per
    batch. This reaches into pika's transport: where it is not what pika 1.3 and
    1.4 have, nothing is done.
    """
    buffers = getattr(getattr(conn, "_transport", None), "_tx_buffers", None)
    if not isinstance(buffers, collections.deque) or len(buffers) < 2:
        return
    chunks: list[bytes] = []
    part: list[bytes] = []
    size = 0
    for data in buffers:
        part.append(data)
        size += len(data)
        if size >= limit:
            chunks.append(b"".join(part))
            part, size = [], 0
    if part:
        chunks.append(b"".join(part))
    buffers.clear()
    buffers.extend(chunks)


@dataclasses.dataclass(eq=False)
class Batch:
    """Messages published together; their delivery tags are base+1 .. base+len."""

    base: int
    status: bytearray
    #: Which connection published it; tags mean nothing on another one.
    generation: int = 0
    messages: list[Message] = dataclasses.field(default_factory=list)
    resolved: int = 0

    @property
    def row_ids(self) -> list[int]:
        return [m.row_id for m in self.messages]


@dataclasses.dataclass
class PublishResult:
    """What became of one batch."""

    #: Row ids whose messages the broker confirmed (acked, not returned).
    confirmed: list[int]
    #: Row ids whose messages came back unroutable (``mandatory``, no queue bound).
    returned: list[int]
    #: Number of messages the broker nacked.
    nacked: int
    #: Set when the batch ended early (connection lost, confirm timeout);
    #: the confirmed rows are still safe to delete.
    error: BrokerUnavailable | None = None
    #: The queues of the returned messages.
    returned_queues: set[str] = dataclasses.field(default_factory=set)
    #: The queues of the acked messages.
    confirmed_queues: set[str] = dataclasses.field(default_factory=set)


class Publisher:
    """One AMQP connection and one confirm-mode channel."""

    def __init__(
        self,
        parameters: pika.ConnectionParameters,
        *,
        display_url: str,
        declare: str = "celery",
        confirm_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        secrets: list[str] | None = None,
        queue_max_priority: int = 0,
    ) -> None:
        self._parameters = parameters
        self._secrets = secrets or []
        self._display_url = display_url
        self._declare_mode = declare
        self._confirm_timeout = confirm_timeout
        self._connect_timeout = connect_timeout
        self._conn: SelectConnection | None = None
        self._channel: Any = None
        self._ready = False
        self._failure: str | None = None
        self._refused = False
        self._declared: set[str] = set()
        self._declare_channel: Any = None
        self._declare_refusal: str | None = None
        self._queue_arguments = (
            {"x-max-priority": queue_max_priority} if queue_max_priority else None
        )
        self._done: Callable[[], bool] = lambda: True
        # Batches published and not yet waited for, oldest first.
        self._inflight: list[Batch] = []
        self._generation = 0
        self._base_tag = 0
        self._low = 1
        #: The highest delivery tag any ack or nack has named on this channel.
        self._confirmed_up_to = 0
        #: Why the broker blocks this connection (a resource alarm), or None.
        self.blocked: str | None = None
        self._blocked_since = 0.0

    # -- connection -----------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._ready and self._failure is None

    def connect(self) -> None:
        """Open the connection and a confirm-mode channel, or raise BrokerUnavailable."""
        self.close()
        self._ready = False
        self._failure = None
        self._refused = False
        self._declared.clear()
        self._inflight = []
        self._base_tag = 0
        self._low = 1
        self._confirmed_up_to = 0
        self._generation += 1
        self.blocked = None  # a new connection starts unblocked; the broker says if not
        try:
            self._conn = SelectConnection(
                self._parameters,
                on_open_callback=self._on_connection_open,
                on_open_error_callback=self._on_connection_open_error,
                on_close_callback=self._on_connection_closed,
            )
            self._conn.add_on_connection_blocked_callback(self._on_blocked)
            self._conn.add_on_connection_unblocked_callback(self._on_unblocked)
        except Exception as exc:
            raise BrokerUnavailable(f"broker at {self._display_url}: {self._text(exc)}") from None
        finished = self._run_until(
            lambda: self._ready or self._failure is not None, self._connect_timeout
        )
        if not self._ready:
            reason = self._failure or ("timed out" if not finished else "closed")
            refused = self._refused
            self.close()
            if refused:
                raise BrokerRefused(f"broker at {self._display_url} refused us: {reason}")
            raise BrokerUnavailable(f"broker at {self._display_url} unreachable: {reason}")

    def close(self) -> None:
        """Close the connection (if any); never raises."""
        conn, self._conn = self._conn, None
        self._channel = None
        self._declare_channel = None
        self._ready = False
        if conn is None:
            return
        try:
            if conn.is_open:
                conn.close()
                deadline = time.monotonic() + 2.0
                while not conn.is_closed and time.monotonic() < deadline:
                    handle = conn.ioloop.call_later(0.05, conn.ioloop.stop)
                    conn.ioloop.start()
                    conn.ioloop.remove_timeout(handle)
        except Exception:
            log.debug("error while closing the broker connection", exc_info=True)
        try:
            conn.ioloop.close()
        except Exception:
            log.debug("error while closing the broker I/O loop", exc_info=True)

    def pump(self, seconds: float = 0.0) -> None:
        """Turn the I/O loop for up to ``seconds``: heartbeats, close notices."""
        if self._conn is None:
            return
        self._turn(seconds)
        self._raise_if_failed()

    # -- publishing -----------------------------------------------------------

    def start(self, messages: Iterable[Message], *, queues: set[str], count: int) -> Batch:
        """Publish a batch without waiting for its confirms; see :meth:`wait`.

        ``messages`` may be a lazy iterable: each message goes out as soon as it
        is built, so the broker is already storing the first ones while the rest
        are being built. Several batches may be in flight at once.

        Raises :class:`BrokerUnavailable` when nothing could be published (not
        connected, a queue declare refused). A failure after publishing began
        is reported by :meth:`wait` instead, so that the caller can still
        delete the rows confirmed before it.
        """
        self._raise_if_failed()
        if not self.connected:
            raise BrokerUnavailable(f"broker at {self._display_url}: not connected")
        undeclared = queues - self._declared
        if undeclared:
            raise BrokerUnavailable(f"queues not declared yet: {sorted(undeclared)}")
        # Delivery tags count up from 1 per channel; this batch owns the next `count`.
        batch = Batch(base=self._base_tag, status=bytearray(count), generation=self._generation)
        self._base_tag += count
        self._inflight.append(batch)
        channel = self._channel
        try:
            for m in messages:
                batch.messages.append(m)
                channel.basic_publish(
                    exchange="",
                    routing_key=m.routing_key,
                    body=m.body,
                    properties=EncodedProperties(m.encoded_properties),
                    mandatory=True,
                )
        except Exception as exc:
            self._failure = self._failure or self._text(exc)
        sent = len(batch.messages)
        if sent < count:
            # Fewer went out than announced (``messages`` skipped some, or the
            # channel failed): the next batch's tags start right after these.
            # No confirm can have arrived yet: the I/O loop has not turned.
            del batch.status[sent:]
            self._base_tag = batch.base + sent
        # pika only writes when its I/O loop turns: send the batch now, not when
        # the next cycle waits for confirms (measured: ~2 ms of latency per job).
        if sent:
            coalesce(self._conn)
            self._turn(0.0)
        return batch

    def forget_inflight(self) -> None:
        """Drop the batches nobody will wait for (their rows stay staged).

        Late confirms for them are ignored: delivery tags are never reused.
        """
        self._inflight = []

    def wait(
        self, batch: Batch, timeout: float | None = None, *, until_blocked: bool = False
    ) -> PublishResult:
        """Wait for ``batch``'s confirms (up to ``timeout``, default the confirm
        timeout) and report them.

        With ``until_blocked``, a broker that blocks the connection (a resource
        alarm) ends the wait early with :class:`BrokerBlocked` and leaves the batch
        in flight: the broker has stopped reading, not lost anything, and its
        confirms come once the alarm clears. The confirm timeout counts from the
        next wait, so a long alarm never makes the drain abandon the batch."""
        n = len(batch.status)
        limit = self._confirm_timeout if timeout is None else min(timeout, self._confirm_timeout)
        current = batch.generation == self._generation and self._conn is not None
        finished = current and self._run_until(
            lambda: (batch.resolved >= n or self._failure is not None
                     or (until_blocked and self.blocked is not None)), limit
        )
        if (until_blocked and current and self.blocked is not None
                and batch.resolved < n and self._failure is None):
            raise BrokerBlocked(self.blocked)
        error: BrokerUnavailable | None = None
        if not current:
            error = BrokerUnavailable(
                f"broker at {self._display_url}: connection lost before the batch was confirmed"
            )
        elif self._failure is not None:
            error = BrokerUnavailable(
                f"broker at {self._display_url} lost mid-batch: {self._failure}"
            )
        elif not finished:
            error = BrokerUnavailable(
                f"broker at {self._display_url} confirmed {batch.resolved} of {n} messages "
                f"within {limit:g}s"
            )
            # Late acks must never be mistaken for another batch's: start afresh.
            self._failure = "abandoned a batch after the confirm timeout"
        with contextlib.suppress(ValueError):
            self._inflight.remove(batch)
        status = batch.status
        returned = [m for i, m in enumerate(batch.messages) if status[i] & _RETURNED]
        confirmed_queues = {
            m.routing_key for i, m in enumerate(batch.messages) if status[i] & _ACKED
        }
        confirmed = [m.row_id for i, m in enumerate(batch.messages) if status[i] == _ACKED]
        nacked = sum(1 for value in status if value & _NACKED)
        return PublishResult(
            confirmed, [m.row_id for m in returned], nacked, error,
            {m.routing_key for m in returned}, confirmed_queues,
        )

    def publish(self, messages: Sequence[Message]) -> PublishResult:
        """Declare, publish a batch and wait for its confirms (for tools and tests)."""
        queues = {m.routing_key for m in messages}
        refused = self.declare(queues)
        if refused:
            queue, reason = next(iter(refused.items()))
            raise QueueDeclareRefused(queue, reason, self._declare_mode)
        batch = self.start(messages, queues=queues, count=len(messages))
        return self.wait(batch)

    def declare(self, queues: set[str]) -> dict[str, str]:
        """Declare (or, passively, check) the queues not declared yet on this connection.

        Returns the refused queues with the broker's reason (406 for a queue that
        exists with other arguments, 404 for a missing queue in passive mode).
        Declares go through a channel of their own, which a refusal closes, so
        the publishing channel and the batches in flight are not disturbed.
        Raises :class:`BrokerUnavailable` when the connection itself fails, and
        :class:`BrokerBlocked` when the broker blocks it before answering.
        """
        refused: dict[str, str] = {}
        for queue in sorted(queues - self._declared):
            self._raise_if_failed()
            channel = self._declare_channel_open()
            answer: dict[str, str] = {}

            def on_declared(_frame: Any, answer: dict[str, str] = answer) -> None:
                answer["ok"] = ""
                self._wake()

            channel.queue_declare(
                queue,
                passive=self._declare_mode == "passive",
                durable=True,
                arguments=self._queue_arguments,
                callback=on_declared,
            )
            def answered(answer: dict[str, str] = answer) -> bool:
                return (bool(answer) or self._declare_channel is None
                        or self._failure is not None or self.blocked is not None)

            self._run_until(answered, self._connect_timeout)
            if not answer and self._failure is None and self.blocked is not None:
                raise BrokerBlocked(self.blocked)  # the answer comes after the alarm
            if "ok" in answer:
                self._declared.add(queue)
            elif self._failure is not None:
                self._raise_if_failed()
            elif self._declare_channel is None:
                refused[queue] = self._declare_refusal or "refused"
            else:
                raise BrokerUnavailable(
                    f"broker at {self._display_url} did not answer a queue declare in time"
                )
        return refused

    def forget(self, queue: str) -> None:
        """Declare ``queue`` again before the next publish to it (it went missing)."""
        self._declared.discard(queue)

    def _declare_channel_open(self) -> Any:
        if self._declare_channel is None:
            conn = self._conn
            if conn is None:
                raise BrokerUnavailable(f"broker at {self._display_url}: not connected")
            opened: list[Any] = []

            def on_open(channel: Any) -> None:
                channel.add_on_close_callback(self._on_declare_channel_closed)
                opened.append(channel)
                self._wake()

            conn.channel(on_open_callback=on_open)
            self._run_until(lambda: bool(opened) or self._failure is not None,
                            self._connect_timeout)
            self._raise_if_failed()
            if not opened:
                raise BrokerUnavailable(f"broker at {self._display_url}: no channel in time")
            self._declare_channel = opened[0]
            self._declare_refusal = None
        return self._declare_channel

    def _on_declare_channel_closed(self, _channel: Any, exc: BaseException) -> None:
        self._declare_channel = None
        self._declare_refusal = self._text(exc)
        self._wake()

    # -- pika callbacks ----------------------------------------------------------

    def _on_connection_open(self, conn: SelectConnection) -> None:
        conn.channel(on_open_callback=self._on_channel_open)

    def _on_connection_open_error(self, _conn: SelectConnection, exc: BaseException) -> None:
        self._failure = self._text(exc)
        self._refused = _is_refusal(exc)
        self._wake()

    def _on_connection_closed(self, _conn: SelectConnection, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = self._text(exc)
        self._ready = False
        self._wake()

    def _on_blocked(self, _conn: Any, frame: Any) -> None:
        self._set_blocked(str(getattr(frame.method, "reason", "") or "a resource alarm"))
        self._wake()

    def _on_unblocked(self, _conn: Any, _frame: Any) -> None:
        self._set_blocked(None)
        self._wake()

    def _set_blocked(self, reason: str | None) -> None:
        """Note (and say once) that the broker blocks or unblocks this connection."""
        if reason is not None and self.blocked is None:
            self._blocked_since = time.monotonic()
            log.warning("broker at %s blocks publishing: %s (a resource alarm); waiting for "
                        "it to clear, jobs stay staged", self._display_url, reason)
        elif reason is None and self.blocked is not None:
            log.warning("broker at %s unblocked after %.1fs: publishing again",
                        self._display_url, time.monotonic() - self._blocked_since)
        self.blocked = reason

    def _on_channel_open(self, channel: Any) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(ack_nack_callback=self._on_confirm, callback=self._on_confirm_ok)

    def _on_confirm_ok(self, _frame: Any) -> None:
        self._ready = True
        self._wake()

    def _on_channel_closed(self, _channel: Any, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = self._text(exc)
        self._ready = False
        self._wake()

    def _on_return(self, _channel: Any, method: Any, properties: Any, _body: bytes) -> None:
        """Flag the publish this return is for (see the module's docstring)."""
        task_id = str(properties.correlation_id)
        routing_key = method.routing_key
        above = self._confirmed_up_to
        for batch in self._inflight:
            if batch.generation != self._generation or batch.base + len(batch.status) <= above:
                continue
            for i in range(max(above - batch.base, 0), len(batch.messages)):
                m = batch.messages[i]
                if m.task_id == task_id and m.routing_key == routing_key:
                    batch.status[i] |= _RETURNED

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        tag = method.delivery_tag
        status = _ACKED if isinstance(method, pika.spec.Basic.Ack) else _NACKED
        first = self._low if method.multiple else tag
        self._confirmed_up_to = max(self._confirmed_up_to, tag)
        for batch in self._inflight:
            size = len(batch.status)
            if batch.base >= tag:
                break
            if batch.base + size < first:
                continue
            statuses = batch.status
            for i in range(max(first - batch.base - 1, 0), min(tag - batch.base, size)):
                if not statuses[i] & _RESOLVED:
                    statuses[i] |= status
                    batch.resolved += 1
        if method.multiple:
            self._low = max(self._low, tag + 1)
        self._wake()

    # -- the I/O loop ------------------------------------------------------------

    def _wake(self) -> None:
        if self._done() and self._conn is not None:
            self._conn.ioloop.stop()

    def _turn(self, seconds: float) -> None:
        """Turn the I/O loop once (writes, confirms, heartbeats), for up to ``seconds``."""
        self._run_until(lambda: self._failure is not None, seconds, run_once=True)

    def _run_until(
        self, done: Callable[[], bool], timeout: float, *, run_once: bool = False
    ) -> bool:
        """Turn the I/O loop until ``done()`` or ``timeout``; True when done."""
        conn = self._conn
        if conn is None:
            return done()
        self._done = done
        ioloop = conn.ioloop
        deadline = time.monotonic() + timeout
        try:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0 and not run_once:
                    return False
                handle = ioloop.call_later(max(remaining, 0.0), ioloop.stop)
                try:
                    ioloop.start()
                finally:
                    ioloop.remove_timeout(handle)
                if run_once:
                    break
            return done()
        finally:
            self._done = lambda: True

    def _text(self, exc: BaseException) -> str:
        return scrub(_describe(exc), self._secrets)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            failure = self._failure
            self.close()
            self._failure = None
            raise BrokerUnavailable(f"broker at {self._display_url}: {failure}")


def _innermost(exc: BaseException) -> BaseException:
    """The error pika's connection workflow wrapped: the last attempt's cause."""
    nested = getattr(exc, "exceptions", None)  # AMQPConnectionWorkflowFailed
    if nested:
        return _innermost(nested[-1])
    inner = getattr(exc, "exception", None)  # AMQPConnector*Error
    if isinstance(inner, BaseException):
        return _innermost(inner)
    return exc


def _is_refusal(exc: BaseException) -> bool:
    """A login or vhost refusal, as opposed to a network problem."""
    return isinstance(
        _innermost(exc),
        (pika.exceptions.ProbableAuthenticationError, pika.exceptions.ProbableAccessDeniedError),
    )


def _describe(exc: BaseException) -> str:
    """A short description of a pika error (callers scrub secrets from it)."""
    exc = _innermost(exc)
    if isinstance(
        exc, (pika.exceptions.ChannelClosedByBroker, pika.exceptions.ConnectionClosedByBroker)
    ):
        return f"{exc.reply_code} {exc.reply_text}"
    if isinstance(exc, pika.exceptions.ProbableAuthenticationError):
        return "login refused (check the user name and password)"
    if isinstance(exc, pika.exceptions.ProbableAccessDeniedError):
        return "access refused (check the vhost and the user's permissions)"
    if isinstance(exc, pika.exceptions.AMQPConnectionError) and exc.args:
        inner = exc.args[0]
        if isinstance(inner, BaseException):
            return _describe(inner)
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]

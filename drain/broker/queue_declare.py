"""Declaring the queues a batch goes to, on a channel of their own.

:class:`QueueDeclaringLink` adds to :class:`drain.broker.amqp_link.AmqpLink` the
queue declares that come before publishing: each queue is declared (durable,
as Celery does, or only checked with ``passive``) once per connection, the
first time a batch goes to it, and again after :meth:`QueueDeclaringLink.forget`
(it went missing). The declares go through channels of their own, several
queues at once (DECLARE_CHANNELS), and the broker closes the channel of a
declare it refuses, so the publishing channel and the batches in flight on it
are not disturbed. :class:`drain.broker.publisher.Publisher` builds
on this.

What a queue is declared as is a :class:`QueueSpec`: by default a durable
classic queue (``x-max-priority`` with ``--queue-max-priority``), as Celery
declares one by default; with ``--app``, the app's own kombu entities
(drain.celery.routing): their exchange, its type and binding, the queue's arguments
(``x-queue-type: quorum``, ``x-max-priority``...) and extra bindings, declared
in the order kombu's ``Queue.declare`` declares them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions

from drain.broker.amqp_link import AmqpLink
from drain.broker.broker_list import BrokerList
from drain.errors import BrokerBlocked, BrokerUnavailable

#: A declare's callback, given the broker's answer.
Done = Callable[[Any], None]
#: One declare or bind, sent on the channel given; ``done`` is called with the answer.
Step = Callable[[Any, Done], None]


@dataclasses.dataclass(frozen=True)
class ExchangeSpec:
    """An exchange as kombu declares it (never the default exchange ``''``)."""

    name: str
    type: str = "direct"
    durable: bool = True
    auto_delete: bool = False
    arguments: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class BindingSpec:
    """The queue bound to ``exchange`` with ``routing_key``."""

    exchange: ExchangeSpec
    routing_key: str
    arguments: dict[str, Any] | None = None
    #: Declare the exchange before binding (False: kombu's ``no_declare``).
    declare_exchange: bool = True


@dataclasses.dataclass(frozen=True)
class QueueSpec:
    """A queue, with the exchanges and bindings declared along with it."""

    name: str
    durable: bool = True
    exclusive: bool = False
    auto_delete: bool = False
    arguments: dict[str, Any] | None = None
    bindings: tuple[BindingSpec, ...] = ()
    #: kombu's ``no_declare``: the app never declares it; neither does the drain.
    no_declare: bool = False


def classic(max_priority: int = 0) -> Callable[[str], QueueSpec]:
    """Celery's default declaration: durable, no arguments (or ``x-max-priority``)."""
    arguments = {"x-max-priority": max_priority} if max_priority else None
    return lambda name: QueueSpec(name, arguments=arguments)


class QueueDeclaringLink(AmqpLink):
    """An :class:`AmqpLink` that declares queues, each once per connection."""

    def __init__(
        self,
        parameters: pika.ConnectionParameters | BrokerList,
        *,
        display_url: str,
        declare: str = "celery",
        connect_timeout: float = 10.0,
        secrets: list[str] | None = None,
        queue_max_priority: int = 0,
        specs: Callable[[str], QueueSpec] | None = None,
    ) -> None:
        super().__init__(parameters, display_url=display_url,
                         connect_timeout=connect_timeout, secrets=secrets)
        self._declare_mode = declare
        self._declared: set[str] = set()
        #: The declare channels (at most DECLARE_CHANNELS), and those with nothing to do.
        self._lanes: list[_Lane] = []
        self._idle: list[_Lane] = []
        #: What the lanes take their queues from: the latest declare() call's.
        self._work: _Declares | None = None
        #: Queues being declared, and refusals not returned yet (queue: the reason).
        self._in_flight: set[str] = set()
        self._refusals: dict[str, str] = {}
        self._answered_at = 0.0
        #: How each queue is declared (drain.celery.routing gives the app's entities).
        self._specs = specs or classic(queue_max_priority)

    def _new_connection(self) -> None:
        super()._new_connection()
        self._declared.clear()
        self._forget_lanes()

    def close(self) -> None:
        """Close the connection (if any); never raises."""
        self._forget_lanes()
        super().close()

    def _forget_lanes(self) -> None:
        """The declare channels belong to their connection."""
        self._lanes, self._idle, self._work = [], [], None
        self._in_flight.clear()
        self._refusals.clear()

    def declare(self, queues: set[str], *, until: float | None = None) -> dict[str, str]:
        """Declare (or, passively, check) the queues not declared yet on this connection.

        Returns the refused queues with the broker's reason (406 for a queue that
        exists with other arguments, 404 for a missing queue in passive mode).
        Declares go through channels of their own, which a refusal closes, so
        the publishing channel and the batches in flight are not disturbed; up to
        DECLARE_CHANNELS queues are declared at once, one per channel (a queue's own
        steps, exchanges, queue, bindings, stay in order on its channel).

        ``until`` (monotonic): start no declare after it, and return by then with
        the rest undeclared (:meth:`undeclared`) for a later call; the declares
        under way go on meanwhile, and a refusal among them is returned by the
        call that next asks for its queue. Without it, every queue is answered
        before it returns.

        Raises :class:`BrokerUnavailable` when the connection fails, when the
        broker answers no declare for ``connect_timeout`` (without ``until``), or
        leaves one unanswered for DECLARE_PATIENCE; :class:`BrokerBlocked` when the
        broker blocks the connection before answering.
        """
        asked = queues - self._declared
        if not asked:
            return {}
        self._raise_if_failed()
        if self._conn is None:
            raise BrokerUnavailable(f"broker at {self._display_url}: not connected")
        self._work = work = _Declares(
            sorted(asked - self._refusals.keys() - self._in_flight), until)
        self._answered_at = time.monotonic()  # quiet: since this call or the last answer
        self._start_lanes()

        def answered() -> bool:
            return not work.more() and not asked & self._in_flight

        while not answered():
            now = time.monotonic()
            oldest = min((lane.since for lane in self._lanes if lane.queue is not None),
                         default=now)
            if now - oldest >= DECLARE_PATIENCE or (
                    until is None and now - self._answered_at >= self._connect_timeout):
                raise BrokerUnavailable(
                    f"broker at {self._display_url} did not answer a queue declare in time")
            wait = min(oldest + DECLARE_PATIENCE,
                       self._answered_at + self._connect_timeout if until is None else until)
            self._run_until(lambda: (answered() or self._failure is not None
                                     or self.blocked is not None), wait - now)
            if answered():
                break
            self._raise_if_failed()
            if self.blocked is not None:
                raise BrokerBlocked(self.blocked)  # the answers come after the alarm
            if until is not None and time.monotonic() >= until:
                break
        return {queue: self._refusals.pop(queue) for queue in asked & self._refusals.keys()}

    def _start_lanes(self) -> None:
        """Set the idle lanes to work, and open lanes up to DECLARE_CHANNELS while
        there are queues left for them."""
        work = self._work
        while work is not None and work.more() and self._idle:
            self._next_declare(self._idle.pop())
        while work is not None and work.more() and len(self._lanes) < self._lane_limit():
            lane = _Lane()
            self._lanes.append(lane)
            self._open_lane(lane)
            if lane not in self._lanes:
                break  # the connection is going

    def _lane_limit(self) -> int:
        """DECLARE_CHANNELS, within the connection's channel_max (as the broker and
        the URL negotiated it): two channels stay for publishing, the channel and
        its replacement while a refused one closes (drain.broker.refusal)."""
        most = self._conn.params.channel_max if self._conn is not None else 0
        return max(1, min(DECLARE_CHANNELS, most - 2)) if most else DECLARE_CHANNELS

    def _open_lane(self, lane: _Lane) -> None:
        """Open a channel for ``lane``, which then declares the next queue."""
        conn = self._conn

        def on_open(channel: Any) -> None:
            lane.channel = channel
            channel.add_on_close_callback(lambda _ch, exc: self._lane_closed(lane, exc))
            self._next_declare(lane)

        lane.queue, lane.since = "", time.monotonic()  # busy opening
        if conn is None or not conn.is_open:
            self._lane_gone(lane)  # the connection went: declare() raises its failure
            return
        try:
            conn.channel(on_open_callback=on_open)
        except pika.exceptions.AMQPError:  # the connection is closing: the same
            self._lane_gone(lane)

    def _next_declare(self, lane: _Lane) -> None:
        """Declare the next queue on ``lane``'s channel, its steps one after the other;
        with none left, the lane is idle."""
        while True:
            queue = self._work.take() if self._work is not None else None
            if queue is None:
                lane.queue = None
                self._idle.append(lane)
                self._wake()
                return
            spec = self._specs(queue)
            if not spec.no_declare:
                break
            self._declared.add(queue)  # the app never declares it; neither does the drain
        lane.queue, lane.since = queue, time.monotonic()
        self._in_flight.add(queue)
        steps = _steps(spec, passive=self._declare_mode == "passive")
        channel = lane.channel

        def advance(_frame: Any = None) -> None:
            if lane.channel is not channel:
                return  # closed meanwhile: _lane_closed took it in hand
            if not steps:
                self._in_flight.discard(queue)
                self._declared.add(queue)
                self._answered_at = time.monotonic()
                self._next_declare(lane)
                return
            try:
                steps.pop(0)(channel, advance)
            except pika.exceptions.AMQPError:  # the channel or connection is closing
                self._in_flight.discard(queue)
                self._lane_gone(lane)

        advance()

    def _lane_closed(self, lane: _Lane, exc: BaseException) -> None:
        """A declare channel closed: the broker refused its queue (the lane reopens
        and goes on), or the connection went (the lane ends)."""
        lane.channel = None
        queue = lane.queue
        if queue:
            self._in_flight.discard(queue)
        if queue and isinstance(exc, pika.exceptions.ChannelClosedByBroker):
            self._refusals[queue] = self._text(exc)
            self._answered_at = time.monotonic()
            self._wake()
            self._open_lane(lane)
            return
        self._lane_gone(lane)

    def _lane_gone(self, lane: _Lane) -> None:
        lane.queue = None
        if lane in self._idle:
            self._idle.remove(lane)
        if lane in self._lanes:
            self._lanes.remove(lane)
        self._wake()

    @property
    def in_flight(self) -> frozenset[str]:
        """The queues being declared now."""
        return frozenset(self._in_flight)

    def undeclared(self, queues: set[str]) -> set[str]:
        """Those of ``queues`` not declared on this connection yet."""
        return queues - self._declared

    def forget(self, queue: str) -> None:
        """Declare ``queue`` again before the next publish to it (it went missing)."""
        self._declared.discard(queue)


#: Queues declared at once, each on a channel of its own. RabbitMQ creates queues
#: on different channels in parallel: 2,000 new durable queues took 4.1 s one after
#: the other on one channel (with or without ``nowait``), 1.7 s on 4 channels and
#: 1.0 s on 16, on the 2-core machine; a refused declare closes only its own channel.
#: At 10,000 queues 64 did better than 16: the drain's 20,000 jobs over them in
#: 13.1-14.3 s against 15.1 s (bench_curves queues: 0.85 x -> 0.92 x raw pika, which
#: declares over as many channels); 1,000 refused queues 0.76 x -> 0.82 x.
DECLARE_CHANNELS = 64
#: Seconds one declare may go unanswered before the connection is given up. A broker
#: that is busy (creating thousands of queues while writing messages to them) can
#: take seconds per declare; one that answers heartbeats but never a declare is
#: stuck, and a new connection is the way out.
DECLARE_PATIENCE = 60.0


@dataclasses.dataclass(eq=False)
class _Lane:
    """One declare channel: the queue it declares ('' while the channel opens,
    None when idle) and since when."""

    channel: Any = None
    queue: str | None = None
    since: float = 0.0


class _Declares:
    """The queues one :meth:`QueueDeclaringLink.declare` call starts, in order."""

    def __init__(self, queues: list[str], until: float | None) -> None:
        self.todo = queues
        self.next = 0
        self.until = until

    def more(self) -> bool:
        """Queues left to start: the budget not spent (at least one is started)."""
        return self.next < len(self.todo) and (
            self.until is None or not self.next or time.monotonic() <= self.until)

    def take(self) -> str | None:
        """The next queue to declare, or None."""
        if not self.more():
            return None
        self.next += 1
        return self.todo[self.next - 1]


def _steps(spec: QueueSpec, *, passive: bool) -> list[Step]:
    """A queue's declare steps, in the order kombu's Queue.declare takes them: the
    exchanges, the queue, then its bindings (kombu declares an extra binding's exchange
    just before that binding, which comes to the same). Passive: the queue only."""
    steps: list[Step] = []
    if not passive:
        steps += [_exchange_step(b.exchange) for b in spec.bindings if b.declare_exchange]
    steps.append(_queue_step(spec, passive=passive))
    if not passive:
        steps += [_bind_step(spec.name, b) for b in spec.bindings]
    return steps


def _exchange_step(exchange: ExchangeSpec) -> Step:
    def step(channel: Any, done: Done) -> None:
        channel.exchange_declare(
            exchange.name, exchange_type=exchange.type, durable=exchange.durable,
            auto_delete=exchange.auto_delete, arguments=exchange.arguments, callback=done)
    return step


def _bind_step(queue: str, binding: BindingSpec) -> Step:
    def step(channel: Any, done: Done) -> None:
        channel.queue_bind(queue, binding.exchange.name, routing_key=binding.routing_key,
                           arguments=binding.arguments, callback=done)
    return step


def _queue_step(spec: QueueSpec, *, passive: bool) -> Step:
    def step(channel: Any, done: Done) -> None:
        channel.queue_declare(spec.name, passive=passive, durable=spec.durable,
                              exclusive=spec.exclusive, auto_delete=spec.auto_delete,
                              arguments=spec.arguments, callback=done)
    return step

"""Declaring the queues a batch goes to, on a channel of their own.

:class:`QueueDeclaringLink` adds to :class:`drain.broker.amqp_link.AmqpLink` the
queue declares that come before publishing: each queue is declared (durable,
as Celery does, or only checked with ``passive``) once per connection, the
first time a batch goes to it, and again after :meth:`QueueDeclaringLink.forget`
(it went missing). The declares go through a second channel, which the
broker closes when it refuses one, so the publishing channel and the batches
in flight on it are not disturbed. :class:`drain.broker.publisher.Publisher` builds
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

from drain.broker.amqp_link import AmqpLink
from drain.broker.broker_list import BrokerList
from drain.errors import BrokerBlocked, BrokerUnavailable


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
        self._declare_channel: Any = None
        self._declare_refusal: str | None = None
        #: How each queue is declared (drain.celery.routing gives the app's entities).
        self._specs = specs or classic(queue_max_priority)

    def _new_connection(self) -> None:
        super()._new_connection()
        self._declared.clear()

    def close(self) -> None:
        """Close the connection (if any); never raises."""
        self._declare_channel = None
        super().close()

    def declare(self, queues: set[str], *, until: float | None = None) -> dict[str, str]:
        """Declare (or, passively, check) the queues not declared yet on this connection.

        Returns the refused queues with the broker's reason (406 for a queue that
        exists with other arguments, 404 for a missing queue in passive mode).
        ``until`` (monotonic): start no declare after it, leaving the rest
        undeclared (:meth:`undeclared`) for a later call; at least one is tried.
        Declares go through a channel of their own, which a refusal closes, so
        the publishing channel and the batches in flight are not disturbed.
        Raises :class:`BrokerUnavailable` when the connection itself fails, and
        :class:`BrokerBlocked` when the broker blocks it before answering.
        """
        refused: dict[str, str] = {}
        for n, queue in enumerate(sorted(queues - self._declared)):
            if until is not None and n and time.monotonic() > until:
                break
            spec = self._specs(queue)
            if spec.no_declare:
                self._declared.add(queue)
                continue
            passive = self._declare_mode == "passive"
            # The exchanges first, then the queue, then its bindings: what kombu's
            # Queue.declare does (it declares an extra binding's exchange just before
            # that binding, which comes to the same).
            steps: list[Callable[[Any, Callable[[Any], None]], None]] = []
            if not passive:
                steps += [_exchange_step(b.exchange) for b in spec.bindings
                          if b.declare_exchange]
            steps.append(_queue_step(spec, passive=passive))
            if not passive:
                steps += [_bind_step(spec.name, b) for b in spec.bindings]
            for step in steps:
                reason = self._declare_step(step)
                if reason is not None:
                    refused[queue] = reason
                    break
            else:
                self._declared.add(queue)
        return refused

    def _declare_step(self, step: Callable[[Any, Callable[[Any], None]], None]) -> str | None:
        """One declare or bind on the declare channel: None when the broker agreed,
        else its reason (the channel is then closed, and opened anew for the next)."""
        self._raise_if_failed()
        channel = self._declare_channel_open()
        answer: dict[str, str] = {}

        def on_done(_frame: Any, answer: dict[str, str] = answer) -> None:
            answer["ok"] = ""
            self._wake()

        step(channel, on_done)

        def answered(answer: dict[str, str] = answer) -> bool:
            return (bool(answer) or self._declare_channel is None
                    or self._failure is not None or self.blocked is not None)

        self._run_until(answered, self._connect_timeout)
        if not answer and self._failure is None and self.blocked is not None:
            raise BrokerBlocked(self.blocked)  # the answer comes after the alarm
        if "ok" in answer:
            return None
        if self._failure is not None:
            self._raise_if_failed()
        if self._declare_channel is None:
            return self._declare_refusal or "refused"
        raise BrokerUnavailable(
            f"broker at {self._display_url} did not answer a queue declare in time"
        )

    def undeclared(self, queues: set[str]) -> set[str]:
        """Those of ``queues`` not declared on this connection yet."""
        return queues - self._declared

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


def _exchange_step(exchange: ExchangeSpec) -> Callable[[Any, Callable[[Any], None]], None]:
    def step(channel: Any, done: Callable[[Any], None]) -> None:
        channel.exchange_declare(
            exchange.name, exchange_type=exchange.type, durable=exchange.durable,
            auto_delete=exchange.auto_delete, arguments=exchange.arguments, callback=done)
    return step


def _bind_step(queue: str, binding: BindingSpec) -> Callable[[Any, Callable[[Any], None]], None]:
    def step(channel: Any, done: Callable[[Any], None]) -> None:
        channel.queue_bind(queue, binding.exchange.name, routing_key=binding.routing_key,
                           arguments=binding.arguments, callback=done)
    return step


def _queue_step(spec: QueueSpec, *, passive: bool) -> Callable[[Any, Callable[[Any], None]], None]:
    def step(channel: Any, done: Callable[[Any], None]) -> None:
        channel.queue_declare(spec.name, passive=passive, durable=spec.durable,
                              exclusive=spec.exclusive, auto_delete=spec.auto_delete,
                              arguments=spec.arguments, callback=done)
    return step

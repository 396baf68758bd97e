"""An AMQP message ready to publish: what the broker layer sends, confirms and,
when the broker refuses it, judges (drain.broker.publisher, drain.broker.refusal).

It is bytes and properties with the staged row's id; what they mean (Celery's
protocol) is drain.celery.message's business, which builds them. Where it goes
is also what a pause is keyed by (:class:`PauseKey`, drain.daemon.holds).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pika

#: The declaration key (:attr:`Message.queue`) of a message for which nothing is
#: declared (with ``--app``: a ``Broadcast`` route, a route with an exchange and no
#: queue; drain.celery.routing). RabbitMQ refuses queue names starting with ``amq.``
#: to clients, so no queue of the app can have it.
NOTHING_DECLARED = "amq.drain: nothing declared"


class PauseKey(NamedTuple):
    """What a pause is keyed by: what failed (drain.daemon.holds).

    The declared queue (its declaration key) when one is declared for the
    message; else, for a route to an exchange with nothing declared, that
    exchange and routing key. A tuple, not a dataclass: the holds look one up
    per held row and per cycle (100,000 held rows: 100,000 lookups), and a
    tuple's hash and equality are the interpreter's, not a Python method's.
    """

    #: The declaration key ("": nothing declared; see ``exchange``).
    queue: str = ""
    exchange: str = ""
    routing_key: str = ""

    @classmethod
    def of(cls, declared: str, exchange: str, routing_key: str) -> PauseKey:
        """The key of messages declared as ``declared`` and sent to ``exchange``
        with ``routing_key``."""
        if declared and declared != NOTHING_DECLARED:
            return cls(declared)
        return cls("", exchange, routing_key)

    def __str__(self) -> str:
        if self.queue:
            return f"queue {self.queue!r}"
        return f"exchange {self.exchange!r} routing key {self.routing_key!r}"


class Message(NamedTuple):
    """A ready-to-publish AMQP message for one staged row.

    A tuple: the drain builds one per row it publishes, and a tuple is the
    cheapest object to make. Its headers and properties exist only in wire
    form (``encoded_properties``, drain.broker.amqp), which is what the broker
    gets; :attr:`headers` and :attr:`properties` decode them for whoever wants
    to look (tests, tools)."""

    row_id: int
    task_id: str
    routing_key: str
    body: bytes
    #: The AMQP content header's properties, headers included, in wire form.
    encoded_properties: bytes
    exchange: str = ""
    #: The queue declared for it ("": ``routing_key``, the row's queue).
    queue: str = ""

    @property
    def headers(self) -> dict[str, Any]:
        """The message's headers, decoded from :attr:`encoded_properties`."""
        return dict(_decoded(self.encoded_properties).headers or {})

    @property
    def properties(self) -> dict[str, Any]:
        """Its other properties that are set (content type and encoding, delivery
        mode, priority, correlation id, reply-to, expiration), by pika's names."""
        decoded = _decoded(self.encoded_properties)
        return {name: getattr(decoded, name) for name in _PROPERTY_NAMES
                if getattr(decoded, name) is not None}

    @property
    def declared_queue(self) -> str:
        return self.queue or self.routing_key

    @property
    def pause_key(self) -> PauseKey:
        """What a nack, return or refusal of this message pauses."""
        return PauseKey.of(self.declared_queue, self.exchange, self.routing_key)


#: The properties :attr:`Message.properties` shows, in the order the drain sets them.
_PROPERTY_NAMES = ("content_type", "content_encoding", "delivery_mode", "priority",
                   "correlation_id", "reply_to", "expiration")


def _decoded(encoded: bytes) -> Any:
    properties = pika.BasicProperties()
    properties.decode(encoded)
    return properties

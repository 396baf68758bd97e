"""An AMQP message ready to publish: what the broker layer sends, confirms and,
when the broker refuses it, judges (drain.broker.publisher, drain.broker.refusal).

It is bytes and properties with the staged row's id; what they mean (Celery's
protocol) is drain.celery.message's business, which builds them.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """A ready-to-publish AMQP message for one staged row."""

    row_id: int
    task_id: str
    routing_key: str
    headers: dict[str, Any]
    properties: dict[str, Any]
    body: bytes
    #: ``headers`` and ``properties`` in AMQP wire form (see drain.broker.amqp).
    encoded_properties: bytes
    exchange: str = ""
    #: The queue declared for it ("": ``routing_key``, the row's queue).
    queue: str = ""
    #: The row's ``queue`` column: the unit the drain pauses ("": ``routing_key``).
    staged_queue: str = ""

    @property
    def declared_queue(self) -> str:
        return self.queue or self.routing_key

    @property
    def pause_key(self) -> str:
        return self.staged_queue or self.routing_key

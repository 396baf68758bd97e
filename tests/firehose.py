"""Throwaway RabbitMQ vhosts whose every publish is recorded (the firehose tracer).

With ``rabbitmqctl trace_on``, the broker copies every message published in a
vhost to ``amq.rabbitmq.trace``, routed or not, with the exchange and routing
keys it was published with and its properties. :func:`traced_vhost` makes a
vhost of its own (so that names never collide with another test's, and
deleting the vhost deletes every queue and exchange declared in it), turns
tracing on and binds a capture queue; :class:`Tap` reads what was published;
:func:`entities` lists what was declared there.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlsplit

import pika

from drain.settings.urls import broker_parameters
from tests import support
from tests.machine import rabbitmqctl

CAPTURE = "firehose_capture"
CATCH_ALL = "firehose_catch_all"

#: One traced publish: (exchange, routing keys, properties with their headers, body).
Published = tuple[str, list[str], dict[str, Any], bytes]


def url(vhost: str) -> str:
    """The test broker's URL, in ``vhost``."""
    parts = urlsplit(support.BROKER_URL)
    return f"{parts.scheme}://{parts.netloc}/{quote(vhost, safe='')}"


@contextlib.contextmanager
def traced_vhost(prefix: str, *, catch_all: bool = False) -> Iterator[str]:
    """A new vhost (guest may do anything there) with tracing on; deleted afterwards.

    ``catch_all``: every exchange's unroutable messages go to the queue
    :data:`CATCH_ALL` (an alternate exchange by policy), so a ``mandatory``
    publish to an exchange without a matching binding is not returned.
    """
    vhost = f"{prefix}_{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", vhost)
    try:
        rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        rabbitmqctl("trace_on", "-p", vhost)
        with Tap(vhost) as tap:
            tap.channel.queue_declare(CAPTURE)
            tap.channel.queue_bind(CAPTURE, "amq.rabbitmq.trace", "publish.#")
            if catch_all:
                # Whatever an exchange cannot route goes to the catch-all queue (a
                # policy: it changes no exchange's declared arguments).
                tap.channel.exchange_declare(CATCH_ALL, exchange_type="fanout")
                tap.channel.queue_declare(CATCH_ALL)
                tap.channel.queue_bind(CATCH_ALL, CATCH_ALL)
                rabbitmqctl("set_policy", "-p", vhost, "--apply-to", "exchanges", CATCH_ALL,
                            r"^(?!amq\.).+", json.dumps({"alternate-exchange": CATCH_ALL}))
        yield vhost
    finally:
        rabbitmqctl("delete_vhost", vhost)


class Tap:
    """A connection to ``vhost`` that reads the traced publishes."""

    def __init__(self, vhost: str) -> None:
        self.vhost = vhost
        parameters = broker_parameters(url(vhost))
        parameters.heartbeat = 0  # idle while the test waits on a drain: never cut
        self.connection = pika.BlockingConnection(parameters)
        self.channel = self.connection.channel()

    def __enter__(self) -> Tap:
        return self

    def __exit__(self, *_: object) -> None:
        with contextlib.suppress(Exception):
            self.connection.close()

    def read(self) -> list[Published]:
        """Every publish traced since the last read."""
        found: list[Published] = []
        while True:
            method, props, body = self.channel.basic_get(CAPTURE, auto_ack=True)
            if method is None:
                return found
            headers = props.headers or {}
            found.append((str(headers["exchange_name"]), list(headers["routing_keys"]),
                          dict(headers["properties"]), body))

    def declare_exchange(self, name: str, kind: str) -> None:
        self.channel.exchange_declare(name, exchange_type=kind, durable=True)

    def forget_celery(self) -> None:
        """Delete Celery's default queue and exchange (``celery``), for an app that
        declares them otherwise than the one before (another type, arguments)."""
        self.channel.queue_delete("celery")
        self.channel.exchange_delete("celery")


def entities(vhost: str) -> dict[str, list[Any]]:
    """The queues, exchanges and bindings of ``vhost``, sorted."""
    def listing(what: str, *columns: str) -> list[Any]:
        rows = json.loads(rabbitmqctl(what, "-p", vhost, *columns, "--formatter", "json") or "[]")
        return sorted(json.dumps(row, sort_keys=True) for row in rows)

    return {
        "queues": listing("list_queues", "name", "durable", "auto_delete", "exclusive",
                          "arguments"),
        "exchanges": listing("list_exchanges", "name", "type", "durable", "auto_delete",
                             "internal", "arguments"),
        "bindings": listing("list_bindings", "source_name", "destination_name",
                            "destination_kind", "routing_key", "arguments"),
    }

"""Sending a batch's frames in a few large writes, through pika's public I/O services.

pika hands its transport each AMQP frame on its own (three per message: method,
header, body), and the transport sends each with its own ``send()`` call. On a
batch of 1,000 messages that is 3,000 system calls and as many TCP segments for
RabbitMQ to read, where a few 128 KB writes carry the same bytes.

``SelectConnection(custom_ioloop=...)`` accepts any
``nbio_interface.AbstractIOServices``; :class:`CorkingIOServices` is pika's own
select-based one, except that the transport it gives the connection is a
:class:`CorkedTransport`: a thin layer in front of pika's, which passes every
write straight through, except between :meth:`CorkedTransport.cork` and
:meth:`CorkedTransport.uncork`. Then it keeps the writes and, at ``uncork``,
hands them on joined into chunks of up to :data:`COALESCE_BYTES`, in the same
order. The publisher corks the transport while it writes a batch (the I/O loop
does not turn meanwhile, so nothing would have been sent anyway) and uncorks it
before the loop turns.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable
from typing import Any

from pika.adapters.select_connection import IOLoop
from pika.adapters.utils.nbio_interface import (
    AbstractIOReference,
    AbstractStreamProtocol,
    AbstractStreamTransport,
)
from pika.adapters.utils.selector_ioloop_adapter import SelectorIOServicesAdapter

#: The largest write a batch's frames are joined into.
COALESCE_BYTES = 128 * 1024


def coalesce(frames: list[bytes], limit: int = COALESCE_BYTES) -> list[bytes]:
    """``frames`` joined into chunks of up to ``limit`` bytes, in order.

    A chunk closes as soon as it reaches ``limit``, so it may exceed it by one
    frame; a frame larger than ``limit`` is never split."""
    chunks: list[bytes] = []
    part: list[bytes] = []
    size = 0
    for data in frames:
        part.append(data)
        size += len(data)
        if size >= limit:
            chunks.append(b"".join(part))
            part, size = [], 0
    if part:
        chunks.append(b"".join(part))
    return chunks


class CorkedTransport(AbstractStreamTransport):  # type: ignore[misc]
    """pika's transport, with writes held back between :meth:`cork` and :meth:`uncork`."""

    def __init__(self, transport: Any, protocol: Any) -> None:
        self._transport = transport
        self._protocol = protocol
        self._held: list[bytes] | None = None
        self._held_bytes = 0
        #: Writes handed to pika's transport (for tests and benchmarks).
        self.writes = 0
        #: Why :meth:`drop` cut the connection: what the connection is told it lost.
        self.dropped: BaseException | None = None

    def cork(self) -> None:
        """Hold every write back until :meth:`uncork`."""
        if self._held is None:
            self._held = []

    def uncork(self, limit: int = COALESCE_BYTES) -> int:
        """Write what was held, joined; the number of frames that were held."""
        held, self._held, self._held_bytes = self._held, None, 0
        if not held:
            return 0
        for chunk in coalesce(held, limit):
            self.write(chunk)
        return len(held)

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            held.append(data)
            self._held_bytes += len(data)
            return
        self.writes += 1
        self._transport.write(data)

    def abort(self) -> None:
        self._held, self._held_bytes = None, 0
        self._transport.abort()

    def drop(self, reason: BaseException) -> None:
        """Close the socket now, without a close handshake: the connection learns it
        lost its stream for ``reason`` (pika's own ``abort`` tells it no reason, which
        an open connection does not expect)."""
        self.dropped = reason
        self.abort()

    def get_protocol(self) -> Any:
        return self._protocol

    def get_write_buffer_size(self) -> int:
        return int(self._transport.get_write_buffer_size()) + self._held_bytes


class _Protocol(AbstractStreamProtocol):  # type: ignore[misc]
    """Puts a :class:`CorkedTransport` between pika's transport and its connection."""

    def __init__(self, inner: Any, made: Callable[[CorkedTransport], None]) -> None:
        self.inner = inner
        self._made = made
        self._corked: CorkedTransport | None = None

    def connection_made(self, transport: Any) -> None:
        corked = self._corked = CorkedTransport(transport, self.inner)
        self._made(corked)
        self.inner.connection_made(corked)

    def connection_lost(self, error: BaseException | None) -> None:
        if error is None and self._corked is not None:
            error = self._corked.dropped
        self.inner.connection_lost(error)

    def eof_received(self) -> Any:
        return self.inner.eof_received()

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)


class CorkingIOServices(SelectorIOServicesAdapter):  # type: ignore[misc]
    """pika's select-based I/O services on a new ``IOLoop``, whose connection's
    transport is :attr:`transport`, a :class:`CorkedTransport` (None until connected)."""

    def __init__(self) -> None:
        super().__init__(IOLoop())
        self.transport: CorkedTransport | None = None

    def create_streaming_connection(
        self,
        protocol_factory: Callable[[], Any],
        sock: socket.socket,
        on_done: Callable[[Any], None],
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> AbstractIOReference:
        made: list[_Protocol] = []

        def factory() -> _Protocol:
            made.append(_Protocol(protocol_factory(), self._connected))
            return made[-1]

        def done(result: Any) -> None:
            # The connection workflow goes on with pika's own protocol object.
            if not isinstance(result, BaseException) and made:
                result = (result[0], made[-1].inner)
            on_done(result)

        return super().create_streaming_connection(
            factory, sock, done, ssl_context=ssl_context, server_hostname=server_hostname)

    def _connected(self, transport: CorkedTransport) -> None:
        self.transport = transport

"""Fast AMQP 0-9-1 encoding of the message properties drain sends.

pika encodes ``BasicProperties`` in pure Python through several layers of
helpers; for a Celery message with its 19 headers that was the largest
client-side cost of publishing (~100 us per message under the profiler, on a
machine where the drain shares two cores with RabbitMQ and Postgres). This
module produces the same bytes with straight-line code, and
:class:`EncodedProperties` hands them to pika, which writes them unchanged.

``tests/unit/test_amqp.py`` checks the output byte for byte against pika's
own encoder; values of types this encoder does not special-case go through
pika's ``encode_value`` so that they are, by construction, identical too.
"""

from __future__ import annotations

import functools
import struct
from typing import Any

import pika
from pika import data as pika_data

_CONTENT_TYPE = 1 << 15
_CONTENT_ENCODING = 1 << 14
_HEADERS = 1 << 13
_DELIVERY_MODE = 1 << 12
_PRIORITY = 1 << 11
_CORRELATION_ID = 1 << 10
_REPLY_TO = 1 << 9
_EXPIRATION = 1 << 8

#: The header carrying a row's tag (Celery passes unknown headers through).
TAG_HEADER = "drain_tag"

_pack_I = struct.Struct(">I").pack
_pack_i = struct.Struct(">i").pack
_pack_q = struct.Struct(">q").pack
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class EncodedProperties(pika.BasicProperties):  # type: ignore[misc]
    """Properties whose wire form was computed by :func:`encode_properties`.

    pika only calls :meth:`encode` on the properties it publishes, so the
    attribute-per-field constructor of the parent is skipped on purpose.
    """

    def __init__(self, encoded: bytes) -> None:
        self._encoded = encoded

    def encode(self) -> list[bytes]:
        return [self._encoded]

    def __repr__(self) -> str:
        return f"<EncodedProperties {len(self._encoded)} bytes>"


def encode_properties(
    *,
    content_type: str,
    content_encoding: str,
    headers: dict[str, Any],
    delivery_mode: int,
    priority: int | None,
    correlation_id: str,
    reply_to: str,
    expiration: str | None = None,
) -> bytes:
    """The bytes ``pika.BasicProperties(...).encode()`` would produce for these fields
    (``priority`` None: no priority property, as ``apply_async`` of a task without one)."""
    flags = (
        _CONTENT_TYPE | _CONTENT_ENCODING | _HEADERS | _DELIVERY_MODE
        | (_PRIORITY if priority is not None else 0)
        | _CORRELATION_ID | _REPLY_TO | (_EXPIRATION if expiration is not None else 0)
    )
    return b"".join(
        (
            struct.pack(">H", flags),
            shortstr(content_type),
            shortstr(content_encoding),
            table(headers),
            bytes((delivery_mode,) if priority is None else (delivery_mode, priority)),
            shortstr(correlation_id),
            shortstr(reply_to),
            shortstr(expiration) if expiration is not None else b"",
        )
    )


def shortstr(value: str) -> bytes:
    raw = value.encode()
    if len(raw) > 255:
        raise pika.exceptions.ShortStringTooLong(raw)
    return bytes((len(raw),)) + raw


def table(values: dict[str, Any]) -> bytes:
    inner = b"".join([shortstr(k) + field(v) for k, v in values.items()])
    return _pack_I(len(inner)) + inner


def field(value: Any) -> bytes:
    """One AMQP field value, typed exactly as pika types it."""
    kind = type(value)
    if kind is str:
        raw: bytes = value.encode()
        return b"S" + _pack_I(len(raw)) + raw
    if value is None:
        return b"V"
    if kind is int:
        if _INT32_MIN <= value <= _INT32_MAX:
            return b"I" + _pack_i(value)
        return b"l" + _pack_q(value)
    if kind is bool:
        return b"t\x01" if value else b"t\x00"
    if kind is list:
        inner = b"".join([field(v) for v in value])
        return b"A" + _pack_I(len(inner)) + inner
    if kind is dict:
        return b"F" + table(value)
    pieces: list[bytes] = []
    pika_data.encode_value(pieces, value)
    return b"".join(pieces)


class CeleryPropertiesEncoder:
    """Encodes the properties of drain's Celery messages from a precomputed template.

    Of the 19 headers and 6 or 7 properties, only the task name, the task id
    (three times), ``expires``, ``argsrepr``, ``kwargsrepr``, the optional
    ``drain_tag`` header, the priority and the optional ``expiration`` change
    from message to message; ``origin`` and ``reply_to`` are fixed per process.
    Everything else is encoded once here. The result equals :func:`encode_properties` of the
    same fields (``tests/unit/test_message.py`` checks it against pika).
    """

    def __init__(self, *, origin: str, reply_to: str) -> None:
        self.origin = origin
        self.reply_to = reply_to

        def k(name: str) -> bytes:
            return shortstr(name)

        self._c0 = k("lang") + field("py") + k("task")
        self._c1 = k("id")
        self._c2 = k("shadow") + b"V" + k("eta") + b"V" + k("expires")
        self._c2_shadow = k("shadow")
        self._c2_after_shadow = k("eta") + b"V" + k("expires")
        self._c2b = (
            k("group") + b"V" + k("group_index") + b"V" + k("retries") + field(0)
            + k("timelimit")
        )
        self._no_timelimit = field([None, None])
        self._c2c = k("root_id")
        self._c3 = k("parent_id") + b"V" + k("argsrepr")
        self._c4 = k("kwargsrepr")
        self._c5 = k("origin") + field(origin) + k("ignore_result")
        self._c5b = (
            k("replaced_task_nesting") + field(0) + k("stamped_headers") + b"V"
            + k("stamps") + field({})
        )
        self._tag_key = k(TAG_HEADER)
        self._compression_key = k("compression")
        #: OpenTelemetry's headers: each key with its string type marker.
        self._trace_keys = {name: k(name) + b"S" for name in
                            ("traceparent", "tracestate", "baggage")}
        #: (content type, content encoding) -> the four property prefixes (see below).
        self._prefixes: dict[tuple[str, str], tuple[bytes, bytes, bytes, bytes]] = {}
        flags = (
            _CONTENT_TYPE | _CONTENT_ENCODING | _HEADERS | _DELIVERY_MODE | _PRIORITY
            | _CORRELATION_ID | _REPLY_TO
        )
        self._flags = flags
        (self._prefix, self._prefix_expiring, self._prefix_unprioritised,
         self._prefix_unprioritised_expiring) = self._content_prefixes(
             ("application/json", "utf-8"))
        self._reply_to = shortstr(reply_to)
        #: The headers up to the task id's value, for a task name (kept: names repeat).
        self._head = functools.lru_cache(maxsize=4096)(
            lambda task: self._c0 + field(task) + self._c1)

    def _content_prefixes(self, content: tuple[str, str]) -> tuple[bytes, bytes, bytes, bytes]:
        """The flags and content type and encoding, for: a priority, a priority and
        an expiration, neither, an expiration only."""
        found = self._prefixes.get(content)
        if found is None:
            rest = shortstr(content[0]) + shortstr(content[1])
            flags, unprioritised = self._flags, self._flags & ~_PRIORITY
            found = self._prefixes[content] = (
                struct.pack(">H", flags) + rest,
                struct.pack(">H", flags | _EXPIRATION) + rest,
                struct.pack(">H", unprioritised) + rest,
                struct.pack(">H", unprioritised | _EXPIRATION) + rest,
            )
        return found

    def _trace_fields(self, trace: dict[str, str]) -> bytes:
        keys = self._trace_keys
        fields = []
        for name, value in trace.items():
            raw = value.encode()
            key = keys.get(name)
            fields.append((shortstr(name) + b"S" if key is None else key)
                          + _pack_I(len(raw)) + raw)
        return b"".join(fields)

    def matches(self, origin: str, reply_to: str) -> bool:
        return origin == self.origin and reply_to == self.reply_to

    def encode(
        self,
        *,
        task: str,
        task_id: str,
        argsrepr: str,
        kwargsrepr: str,
        expires: str | None = None,
        tag: str | None = None,
        priority: int | None = 0,
        expiration: str | None = None,
        timelimit: list[Any] | None = None,
        ignore_result: bool | None = None,
        shadow: str | None = None,
        content: tuple[str, str] | None = None,
        compression: str | None = None,
        trace: dict[str, str] | None = None,
    ) -> bytes:
        """``timelimit`` None is ``[None, None]``; ``priority`` None leaves the
        priority property out (what ``apply_async`` of a task without one sends);
        ``content`` (content type, content encoding) None is JSON; ``compression``
        is the last header, as kombu adds it; ``trace`` (OpenTelemetry's string
        headers) comes before it."""
        task_id_field = field(task_id)
        inner = b"".join(
            (
                self._head(task), task_id_field,
                self._c2 if shadow is None
                else self._c2_shadow + field(shadow) + self._c2_after_shadow,
                field(expires),
                self._c2b, self._no_timelimit if timelimit is None else field(timelimit),
                self._c2c, task_id_field, self._c3, field(argsrepr), self._c4,
                field(kwargsrepr), self._c5, field(ignore_result), self._c5b,
                b"" if tag is None else self._tag_key + field(tag),
                b"" if not trace else self._trace_fields(trace),
                b"" if compression is None else self._compression_key + field(compression),
            )
        )
        if content is not None:
            prefixes = self._content_prefixes(content)
            if priority is None:
                prefix = prefixes[2] if expiration is None else prefixes[3]
            else:
                prefix = prefixes[0] if expiration is None else prefixes[1]
        elif priority is None:
            prefix = (self._prefix_unprioritised if expiration is None
                      else self._prefix_unprioritised_expiring)
        else:
            prefix = self._prefix if expiration is None else self._prefix_expiring
        fixed = b"\x02" if priority is None else bytes((2, priority))
        return b"".join(
            (
                prefix, _pack_I(len(inner)), inner, fixed, shortstr(task_id),
                self._reply_to, b"" if expiration is None else shortstr(expiration),
            )
        )

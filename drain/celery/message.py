"""Staged row -> Celery message protocol v2, byte-compatible with ``send_task``.

The drain is a Celery client that sends tasks it does not know, exactly like
``app.send_task(name, args, kwargs, queue=...)``. The message it builds has
the same properties, the same headers in the same order, and the same JSON
body; ``tests/integration/test_message_compat.py`` compares them field by
field with what the installed Celery publishes.

Building is on the drain's hot path, so the body is assembled from the JSON
text Postgres already has (``args::text``, ``kwargs::text``) instead of being
decoded and re-encoded. ``argsrepr`` and ``kwargsrepr``, which Celery shows in
logs and monitoring tools, are read off that text too for plain arguments
(:func:`json_repr`); others are decoded once for them.

With ``--app`` the app's serializer, compression, repr limits and a task's
``shadow_name`` count too (drain.celery.encoding): a JSON app keeps the fast path,
any other serializer encodes the decoded arguments through kombu.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any

from celery.utils.saferepr import saferepr

from drain.broker import amqp
from drain.broker.outgoing import Message
from drain.celery import encoding
from drain.celery.encoding import JSON, Encoding
from drain.postgres.rows import StagedRow

#: Celery's defaults: ``app.amqp.argsrepr_maxsize`` and ``task_repr_maxlevels``.
REPR_MAXSIZE = 1024
REPR_MAXLEVELS = 3

_EMBED = '{"callbacks": null, "errbacks": null, "chain": null, "chord": null}'


@dataclasses.dataclass(frozen=True, slots=True)
class Destination:
    """Where, and with which task options, the user's Celery app sends a task
    (drain.celery.routing works it out as ``apply_async`` does); without an app the
    drain sends every row through the default exchange to its own queue."""

    #: The exchange and routing key to publish with.
    exchange: str
    routing_key: str
    #: The app's queue the message is meant for: declared before publishing.
    queue: str
    #: The AMQP priority ``apply_async`` sends (the task's, the route's or the
    #: app's default); None: no priority property.
    priority: int | None = None
    #: The queue's ``x-max-priority`` (0: none). A row's own priority above 0 is
    #: sent instead of ``priority``, as ``apply_async(priority=...)`` sends it, on
    #: such a queue or not (RabbitMQ treats more than the maximum as the maximum).
    max_priority: int = 0
    #: The ``timelimit`` header, ``[hard, soft]`` (the task's time limits).
    timelimit: tuple[int | float | None, int | float | None] = (None, None)
    #: The ``ignore_result`` header (the task's own).
    ignore_result: bool | None = None
    #: The app's (or the task's) serializer and compression (drain.celery.encoding).
    encoding: Encoding = JSON
    #: ``argsrepr`` / ``kwargsrepr``: the app's ``amqp.argsrepr_maxsize``,
    #: ``amqp.kwargsrepr_maxsize`` and ``task_repr_maxlevels``.
    repr_limits: tuple[int, int, int] = (1024, 1024, 3)
    #: The task's own ``shadow_name(args, kwargs, options)`` (None: Celery's,
    #: which gives no shadow).
    shadow: Callable[[Any, Any, dict[str, Any]], Any] | None = None


def origin() -> str:
    """Celery's ``anon_nodename()``: the sender's node name, ``gen<pid>@<host>``."""
    return f"gen{os.getpid()}@{socket.gethostname()}"


class Builder:
    """Builds the messages of one drain process (fixed ``origin`` and ``reply_to``)."""

    def __init__(self, *, origin: str, reply_to: str, max_priority: int = 0) -> None:
        self.origin = origin
        self.reply_to = reply_to
        self.max_priority = max_priority
        self._encoder = amqp.CeleryPropertiesEncoder(origin=origin, reply_to=reply_to)

    def build(self, row: StagedRow, now: float | None = None,
              destination: Destination | None = None,
              trace: dict[str, str] | None = None) -> Message:
        return _build(row, self._encoder, self.max_priority, now, destination, trace=trace)


def amqp_priority(priority: int, max_priority: int) -> int:
    """A row's priority as the AMQP message priority: clamped to 0..max_priority.

    Without ``max_priority`` (queues declared without ``x-max-priority``) every
    message gets 0, as ``send_task`` sends by default.
    """
    return min(max(priority, 0), max_priority) if max_priority > 0 else 0


def build(
    row: StagedRow,
    *,
    origin: str,
    reply_to: str,
    max_priority: int = 0,
    now: float | None = None,
    encoder: amqp.CeleryPropertiesEncoder | None = None,
    destination: Destination | None = None,
    trace: dict[str, str] | None = None,
) -> Message:
    """What ``send_task(name, args, kwargs, task_id=..., queue=..., expires=...)`` sends.

    A row's ``expires_at`` becomes Celery's ``expires`` header (ISO 8601, UTC)
    and the AMQP ``expiration`` property (milliseconds left, at ``now``), as
    Celery 5.2+ sends them; its ``tag`` the extra ``drain_tag`` header.
    Its ``embed`` (a signature's callbacks, a chain's next tasks) is the body's
    third part, as Celery sends it; without one every part is null.

    With a ``destination`` (the user's app, drain.celery.routing), the message is what
    that app's ``task.apply_async(args, kwargs, task_id=...)`` sends: to its
    exchange and routing key, with the task's time limits, ``ignore_result``
    and default priority (a row's own non-zero priority wins, on a priority queue).

    ``trace``: OpenTelemetry's headers (``traceparent``, ``tracestate``,
    ``baggage``; drain.daemon.tracing), after the others, where Celery's
    instrumentation puts them in ``apply_async``.
    """
    if encoder is None or not encoder.matches(origin, reply_to):
        encoder = amqp.CeleryPropertiesEncoder(origin=origin, reply_to=reply_to)
    return _build(row, encoder, max_priority, now, destination, trace=trace)


def _build(row: StagedRow, encoder: amqp.CeleryPropertiesEncoder, max_priority: int,
           now: float | None, destination: Destination | None, *,
           trace: dict[str, str] | None) -> Message:
    """:func:`build`, with the encoder of its origin and reply-to (a Builder's own)."""
    task_id = str(row.task_id)
    argsrepr, kwargsrepr, args, kwargs = _reprs(row, destination)
    expires: str | None = None
    expiration: str | None = None
    if row.expires_at is not None:
        expires = row.expires_at.astimezone(dt.timezone.utc).isoformat()
        left = row.expires_at.timestamp() - (time.time() if now is None else now)
        expiration = str(int(max(left, 0.0) * 1000))
    timelimit: list[Any] | None = None  # [None, None]
    ignore_result: bool | None = None  # "whatever the task says", as with send_task()
    priority: int | None
    shadow: str | None = None
    body_encoding = JSON
    if destination is None:
        priority = amqp_priority(row.priority, max_priority)
    else:
        if destination.timelimit != (None, None):
            timelimit = list(destination.timelimit)
        ignore_result = destination.ignore_result
        body_encoding = destination.encoding
        # apply_async(priority=p) sends p whatever the queue; the row's priority 0
        # (the column's default) cannot tell "none" from 0, and a negative one
        # only orders the drain's fetch: both send the app's.
        priority = min(row.priority, 255) if row.priority > 0 else destination.priority
        if destination.shadow is not None:
            shadow = _shadow(destination.shadow, row, args, kwargs)
    plain_json = body_encoding.serializer == "json"
    if plain_json:
        embed = _EMBED if row.embed_json is None else ascii_json(row.embed_json)
        body = f"[{ascii_json(row.args_json)}, {ascii_json(row.kwargs_json)}, {embed}]".encode()
    else:
        body = encoding.serialize(body_encoding, row.args_json, row.kwargs_json, row.embed_json)
    compression: str | None = None
    if body_encoding.compression is not None:
        body, compression = encoding.compress(body, body_encoding.compression)
    return Message(
        row.id, task_id,
        row.queue if destination is None else destination.routing_key,
        body,
        encoder.encode(
            task=row.task_name, task_id=task_id, argsrepr=argsrepr, kwargsrepr=kwargsrepr,
            expires=expires, tag=row.tag, priority=priority, expiration=expiration,
            timelimit=timelimit, ignore_result=ignore_result, shadow=shadow,
            content=(None if plain_json and compression is None else
                     (body_encoding.content_type, body_encoding.content_encoding)),
            compression=compression, trace=trace,
        ),
        "" if destination is None else destination.exchange,
        "" if destination is None else destination.queue,
    )


_REPR_LIMITS = (REPR_MAXSIZE, REPR_MAXSIZE, REPR_MAXLEVELS)


def _reprs(row: StagedRow, destination: Destination | None) -> tuple[str, str, Any, Any]:
    """``argsrepr``, ``kwargsrepr``, and the decoded args and kwargs where something
    needs them: the reprs :func:`json_repr` cannot read off the text, or the task's
    ``shadow_name`` (None, None otherwise)."""
    limits = _REPR_LIMITS if destination is None else destination.repr_limits
    # Celery sends ``args or ()``: empty args show as "()", as the worker logs them.
    argsrepr = "()" if row.args_json == "[]" else json_repr(row.args_json, limits[0], limits[2])
    kwargsrepr = json_repr(row.kwargs_json, limits[1], limits[2])
    shadowed = destination is not None and destination.shadow is not None
    if argsrepr is not None and kwargsrepr is not None and not shadowed:
        return argsrepr, kwargsrepr, None, None
    # As the worker decodes them: kombu's type markers as the types they stand for.
    args = encoding.decode(row.args_json)
    kwargs = encoding.decode(row.kwargs_json)
    if argsrepr is None:
        argsrepr = task_repr(args, limits[0], limits[2]) if args else "()"
    if kwargsrepr is None:
        kwargsrepr = task_repr(kwargs, limits[1], limits[2])
    return argsrepr, kwargsrepr, args, kwargs


def _shadow(shadow_name: Callable[[Any, Any, dict[str, Any]], Any], row: StagedRow,
            args: Any, kwargs: Any) -> str | None:
    """The task's ``shadow_name(args, kwargs, options)``, with the options
    ``apply_async`` would have been given for the row (its queue, priority and
    expiry, when it has them)."""
    options: dict[str, Any] = {}
    if not row.unrouted:
        options["queue"] = row.queue
    if row.priority > 0:
        options["priority"] = row.priority
    if row.expires_at is not None:
        options["expires"] = row.expires_at
    name = shadow_name(args, kwargs, options)
    return None if name is None else str(name)


_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code > 0xFFFF:  # a surrogate pair, as json.dumps writes it
        code -= 0x10000
        return f"\\u{0xD800 | (code >> 10):04x}\\u{0xDC00 | (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


def ascii_json(text: str) -> str:
    """Postgres prints jsonb as UTF-8; kombu's JSON escapes non-ASCII as ``\\uXXXX``.

    Non-ASCII characters can only occur inside JSON strings, where the escape
    means the same character, so this keeps the body byte-identical to what
    Celery would send.
    """
    return text if text.isascii() else _NON_ASCII.sub(_escape, text)


#: JSON as Postgres prints a jsonb of plain values: strings with nothing escaped,
#: integers, and the punctuation (jsonb's own spacing, ", " and ": ", is repr()'s).
#: A number is taken whole (the lookahead): one way to match, never a backtrack
#: that splits its digits.
_PLAIN_JSON = re.compile(r'(?:"[^"\\]*"|-?(?:0|[1-9][0-9]*)(?![0-9])|[\[\]{},: ])*')


#: The characters of a jsonb's text of integers in lists and empty objects (no
#: strings: any other object has string keys), whose repr is the text itself.
_INTEGER_LISTS = "[]{}0123456789, -"


def json_repr(text: str, maxsize: int = REPR_MAXSIZE,
              maxlevels: int = REPR_MAXLEVELS) -> str | None:
    """``task_repr`` of the value the JSON ``text`` (a jsonb's text) decodes to, read
    off the text itself, or None where that would take decoding.

    For the common arguments (lists and objects of integers and plain strings,
    nested no deeper than ``maxlevels``) the repr is the text with single quotes
    for double ones: jsonb prints ", " and ": " as repr() does, and keeps an
    object's keys in the order decoding gives them. Floats (jsonb keeps their
    digits, repr() its own), true, false and null, escapes, quotes, kombu's
    type markers, text longer than ``maxsize`` and deeper nesting (counted by
    every opening bracket, those inside strings too) go the slow way: None.
    """
    if len(text) > maxsize or text.count("[") + text.count("{") > maxlevels:
        return None
    if not text.strip(_INTEGER_LISTS):
        # Integers in lists (and empty objects: any other has string keys; the
        # text is valid JSON): the repr is the text.
        return text
    return _plain_repr(text)


@functools.lru_cache(maxsize=4096)  # arguments repeat: the same kwargs job after job
def _plain_repr(text: str) -> str | None:
    """:func:`json_repr` of a text within its limits: the text with single quotes,
    if it is plain JSON as json_repr reads it, else None."""
    if ("'" in text or encoding.MARKER in text or not text.isprintable()
            or not _PLAIN_JSON.fullmatch(text)):
        return None
    return text.replace('"', "'")


def task_repr(value: Any, maxsize: int = REPR_MAXSIZE, maxlevels: int = REPR_MAXLEVELS) -> str:
    """Celery's ``saferepr(value, maxsize, maxlevels=maxlevels)`` (its defaults: 1024
    and 3), fast for plain values.

    ``saferepr`` costs tens of microseconds per call. For the common case (small
    structures of numbers, booleans, None and plain strings) it equals
    ``repr()``, which costs well under one; anything else goes to ``saferepr``.
    """
    if _plain(value, 1, maxlevels):
        text = repr(value)
        if len(text) <= maxsize:
            return text
    return str(saferepr(value, maxsize, maxlevels=maxlevels))


def _plain(value: Any, level: int, maxlevels: int) -> bool:
    """True when ``repr(value)`` is exactly what ``saferepr`` would print."""
    if isinstance(value, list):
        return level <= maxlevels and all(_plain(v, level + 1, maxlevels) for v in value)
    if isinstance(value, dict):
        return level <= maxlevels and all(
            _plain_str(k) and _plain(v, level + 1, maxlevels) for k, v in value.items()
        )
    if isinstance(value, str):
        return _plain_str(value)
    return value is None or isinstance(value, (bool, int, float))


def _plain_str(value: Any) -> bool:
    # saferepr prints strings as '...' with only single quotes escaped;
    # repr() agrees as long as there is nothing to escape at all.
    return (
        isinstance(value, str)
        and value.isprintable()
        and "'" not in value
        and '"' not in value
        and "\\" not in value
    )

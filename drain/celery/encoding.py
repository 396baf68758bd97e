"""How a message body is encoded: the app's serializer and compression, through kombu.

Without ``--app``, and for a JSON app, the body is the JSON text Postgres
already has (drain.celery.message's fast path, byte-identical to kombu's JSON). With
an app whose ``task_serializer`` (or a task's own ``serializer``) is another
one, the body is what Celery's ``send_task_message`` hands to kombu's
``Producer.publish``: the tuple ``(args, kwargs, embed)`` encoded by kombu's
serialization registry (``kombu.serialization.dumps``), the arguments decoded
first with kombu's own JSON decoder (``kombu.utils.json.loads``), so that the
values kombu's JSON carries as ``{"__type__": ..., "__value__": ...}`` markers
(datetime, date, time, Decimal, UUID, bytes) reach the serializer as the
types they stand for. ``task_compression`` (or a task's ``compression``) then
compresses it with ``kombu.compression.compress`` and names the method in the
``compression`` header, as kombu's ``Producer`` does.

:func:`check_app` refuses to start (``ConfigError``) an app whose workers would
drop what the drain sends, or which requires what the drain cannot do:
message signing (the ``auth`` serializer of ``app.setup_security()``), a
serializer or compression kombu does not have (msgpack without the msgpack
package, say), or a serializer whose content type the app's ``accept_content``
does not list (its workers would refuse every message: "Refusing to
deserialize untrusted content").
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kombu import compression as kombu_compression
from kombu import serialization
from kombu.exceptions import SerializerNotInstalled
from kombu.utils import json as kombu_json

from drain.errors import ConfigError

#: The serializer of ``app.setup_security()`` (message signing).
SIGNING = "auth"

#: What ``as_task_v2`` sends as the body's third part when nothing is embedded.
EMPTY_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}

#: kombu's JSON marks the values it carries beyond JSON with this key (as jsonb
#: prints it).
MARKER = '"__type__"'


@dataclasses.dataclass(frozen=True, slots=True)
class Encoding:
    """A serializer (kombu's registry name) and its content type and encoding, and
    an optional compression (as the app names it: 'gzip', 'bzip2', ...)."""

    serializer: str = "json"
    content_type: str = "application/json"
    content_encoding: str = "utf-8"
    compression: str | None = None


JSON = Encoding()


def decode(text: str) -> Any:
    """A staged JSON value as the worker would get it from kombu's JSON: with the
    types behind kombu's markers (plain ``json.loads`` when there are none)."""
    if MARKER in text:
        return kombu_json.loads(text)  # type: ignore[no-untyped-call]
    return json.loads(text)


def serialize(encoding: Encoding, args_json: str, kwargs_json: str,
              embed_json: str | None) -> bytes:
    """The body kombu's ``Producer`` makes of ``(args, kwargs, embed)`` with the
    encoding's serializer (not compressed)."""
    embed = EMPTY_EMBED if embed_json is None else decode(embed_json)
    body = (decode(args_json), decode(kwargs_json), embed)
    payload = serialization.dumps(body, serializer=encoding.serializer)[2]  # type: ignore[no-untyped-call]
    if isinstance(payload, str):
        return payload.encode(encoding.content_encoding or "utf-8")
    return bytes(payload)


def compress(body: bytes, method: str) -> tuple[bytes, str]:
    """``kombu.compression.compress``: the compressed body and the ``compression``
    header's value (the method's content type)."""
    compressed, content_type = kombu_compression.compress(body, method)  # type: ignore[no-untyped-call]
    return bytes(compressed), str(content_type)


def of(app: Any, serializer: Any = None, method: Any = None) -> Encoding:
    """What ``send_task_message`` of ``app`` encodes with, given the routed options'
    ``serializer`` and ``compression`` (a task's own, or a route's): those, else
    the app's ``task_serializer`` and ``task_compression``.

    Raises ``ValueError`` for one the app's workers would refuse or kombu lacks
    (:func:`check_app` refuses the app's and its tasks' at start; a route's is
    met here: its rows are dead-lettered rather than dropped by the workers).
    """
    serializer = serializer or app.conf.task_serializer or "json"
    method = method or app.conf.task_compression or None
    if serializer == "json" and method is None:
        return JSON
    problem = _problem(app, str(serializer), None if method is None else str(method))
    if problem:
        raise ValueError(f"the route's {problem}")
    content_type, content_encoding = _content(str(serializer))
    return Encoding(str(serializer), content_type, content_encoding,
                    None if method is None else str(method))


def _content(serializer: str) -> tuple[str, str]:
    """The content type and encoding kombu sends with ``serializer`` (raises
    ``SerializerNotInstalled`` when kombu has no encoder for it)."""
    probe: tuple[Any, ...] = ((), {}, EMPTY_EMBED)
    content_type, content_encoding, _ = serialization.dumps(probe, serializer=serializer)  # type: ignore[no-untyped-call]
    return str(content_type), str(content_encoding or "utf-8")


def check_app(app: Any) -> None:
    """Raise :class:`ConfigError` (one line) when ``app``'s workers could not take
    what the drain would send them, or the app requires what it cannot do."""
    accept = app.conf.accept_content
    try:
        accepted = serialization.prepare_accept_content(accept)  # type: ignore[no-untyped-call]
    except SerializerNotInstalled as exc:
        raise ConfigError(f"the Celery app's accept_content {list(accept)!r}: {exc}") from None
    uses: dict[tuple[str, str | None], str] = {}
    uses[(str(app.conf.task_serializer or "json"), app.conf.task_compression or None)] = ""
    for name, task in sorted(app.tasks.items()):
        serializer = getattr(task, "serializer", None) or app.conf.task_serializer or "json"
        method = getattr(task, "compression", None) or app.conf.task_compression or None
        uses.setdefault((str(serializer), None if method is None else str(method)),
                        f"task {name}")
    for (serializer, method), task_name in uses.items():
        problem = _problem(app, serializer, method, accepted)
        if problem:
            owner = f"{task_name}'s " if task_name else "task_"
            raise ConfigError(f"the Celery app's {owner}{problem}")


def _problem(app: Any, serializer: str, method: str | None,
             accepted: set[str] | None = None) -> str:
    """What the app's workers could not take, or drain cannot do, with ``serializer``
    and compression ``method`` ("serializer 'x' ..."; "": nothing)."""
    if accepted is None:
        accepted = serialization.prepare_accept_content(  # type: ignore[no-untyped-call]
            app.conf.accept_content)
    if serializer == SIGNING:
        return (f"serializer {SIGNING!r} signs the messages (app.setup_security()); "
                "drain cannot sign them")
    try:
        content_type, _ = _content(serializer)
    except SerializerNotInstalled as exc:
        return f"serializer {serializer!r} is not available to drain: {exc}"
    except Exception as exc:
        return (f"serializer {serializer!r} cannot encode a message: "
                f"{type(exc).__name__}: {exc}")
    if accepted is not None and content_type not in accepted:
        return (f"serializer {serializer!r} sends {content_type}, which the app's "
                f"accept_content {sorted(accepted)!r} does not list: its workers would refuse "
                "those messages (\"Refusing to deserialize untrusted content\")")
    if method is not None:
        try:
            kombu_compression.get_encoder(method)  # type: ignore[no-untyped-call]
        except KeyError:
            known = ", ".join(kombu_compression.encoders())  # type: ignore[no-untyped-call]
            return f"compression {method!r} is not available to drain (kombu has {known})"
    return ""

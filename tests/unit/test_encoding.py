"""``--app`` encodes as the app encodes: serializers, compression, repr limits, shadow
names (drain.celery.encoding, drain.celery.message with a destination of drain.celery.routing).

What the worker decodes is checked with kombu's own decoding (``kombu.serialization
.loads`` after ``kombu.compression.decompress``), as a Celery worker decodes.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import uuid
from typing import Any

import pika
import pytest
from celery import Celery
from celery.utils.saferepr import saferepr
from kombu import compression, serialization
from kombu.utils.json import dumps as kombu_dumps

from drain.broker.outgoing import Message
from drain.celery import encoding, message, routing
from drain.errors import ConfigError
from drain.postgres.rows import StagedRow
from tests import encoding_app

#: The types kombu's JSON carries, as the staging API stores them (kombu's markers).
TYPED_ARGS = [dt.datetime(2026, 11, 27, 3, 4, 5, 6, tzinfo=dt.timezone.utc),
              uuid.UUID("12345678-1234-5678-1234-567812345678"), decimal.Decimal("12.50"),
              dt.date(2026, 1, 2), "é☃", [1, 2.5, None]]
TYPED_KWARGS = {"at": dt.time(4, 5, 6), "n": 3}
EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def _row(task: str = "enc.record", args: Any = None, kwargs: Any = None,
         **overrides: Any) -> StagedRow:
    fields: dict[str, Any] = {
        "id": 1, "task_id": uuid.UUID(int=7), "task_name": task,
        "args_json": kombu_dumps(TYPED_ARGS if args is None else args),
        "kwargs_json": kombu_dumps(TYPED_KWARGS if kwargs is None else kwargs),
        "queue": "q_enc",
    }
    fields.update(overrides)
    return StagedRow(**fields)


def _build(app: Celery, row: StagedRow) -> Message:
    destination = routing.AppRouter(app, allow_unknown=True).destination(row)
    built = message.Builder(origin="gen1@h", reply_to="r").build(row, destination=destination)
    # the fast properties encoder gives pika's bytes, whatever the encoding
    assert built.encoded_properties == b"".join(
        pika.BasicProperties(headers=built.headers, **built.properties).encode())
    return built


def _worker_decodes(built: Message) -> Any:
    body = built.body
    if "compression" in built.headers:
        body = compression.decompress(body, built.headers["compression"])
    return serialization.loads(body, built.properties["content_type"],
                               built.properties["content_encoding"],
                               accept=[built.properties["content_type"]])


@pytest.mark.parametrize("app", [encoding_app.pickle_app, encoding_app.gzip_app],
                         ids=["pickle", "gzip"])
def test_the_worker_gets_the_types_back(app: Celery) -> None:
    built = _build(app, _row())
    args, kwargs, embed = _worker_decodes(built)
    assert list(args) == TYPED_ARGS and kwargs == TYPED_KWARGS and embed == EMBED
    assert built.headers["argsrepr"] == saferepr(TYPED_ARGS, 1024, maxlevels=3)
    assert built.headers["kwargsrepr"] == saferepr(TYPED_KWARGS, 1024, maxlevels=3)


@pytest.mark.parametrize("app", [encoding_app.pickle_app, encoding_app.yaml_app,
                                 encoding_app.msgpack_app, encoding_app.gzip_app],
                         ids=["pickle", "yaml", "msgpack", "gzip"])
def test_body_is_what_kombu_encodes(app: Celery) -> None:
    args, kwargs = [1, "é☃", {"b": [1, 2.5, None]}], {"k": "v"}
    built = _build(app, _row(args=args, kwargs=kwargs))
    content_type, content_encoding, payload = serialization.dumps(
        (args, kwargs, EMBED), serializer=app.conf.task_serializer)
    if isinstance(payload, str):
        payload = payload.encode(content_encoding)
    expected_headers = list(message.Builder(origin="o", reply_to="r").build(_row()).headers)
    if app.conf.task_compression:
        payload, method = compression.compress(payload, app.conf.task_compression)
        assert built.headers["compression"] == method == "application/x-gzip"
        expected_headers.append("compression")  # last, as kombu's Producer adds it
    assert list(built.headers) == expected_headers
    assert built.body == payload
    assert (built.properties["content_type"], built.properties["content_encoding"]) == (
        content_type, content_encoding)


def test_a_plain_json_app_keeps_the_fast_path_bytes() -> None:
    app = Celery("plain")
    row = _row(args_json='[1, "é", {"a": 1}]', kwargs_json='{"k": null}')
    fast = _build(app, row)
    without_app = message.build(row, origin="gen1@h", reply_to="r")
    assert fast.body == without_app.body == (
        b'[[1, "\\u00e9", {"a": 1}], {"k": null}, {"callbacks": null, "errbacks": null, '
        b'"chain": null, "chord": null}]')
    assert routing.AppRouter(app, allow_unknown=True).destination(row).encoding is encoding.JSON


def test_a_tasks_own_serializer_compression_shadow_and_the_apps_repr_limits() -> None:
    app = encoding_app.mixed_app
    pickled = _build(app, _row("enc.pickled"))
    assert pickled.properties["content_type"] == "application/x-python-serialize"
    assert pickled.headers["compression"] == "application/x-bz2"
    assert list(_worker_decodes(pickled)[0]) == TYPED_ARGS
    # task_repr_maxlevels=1 and argsrepr_maxsize=40, as apply_async shows them
    assert pickled.headers["argsrepr"] == saferepr(TYPED_ARGS, 40, maxlevels=1)
    assert pickled.headers["kwargsrepr"] == saferepr(TYPED_KWARGS, 1024, maxlevels=1)
    plain = _build(app, _row("enc.record", args=[[1, [2]]], kwargs={}))
    assert plain.headers["argsrepr"] == saferepr([[1, [2]]], 40, maxlevels=1)
    assert plain.properties["content_type"] == "application/json"
    assert plain.headers["shadow"] is None
    shadowed = _build(app, _row("enc.shadowed", args=["abc"], kwargs={}))
    assert shadowed.headers["shadow"] == "shadow.abc"


def test_priority_as_apply_async_sends_it() -> None:
    """apply_async(priority=p) sends p, on a priority queue or not; a row's 0 or
    negative priority (no priority given, or a backfill's ordering) sends the app's."""
    app = Celery("prio")
    app.conf.task_default_priority = 3

    @app.task(name="enc.record", shared=False)
    def record() -> None:  # pragma: no cover - never runs
        pass

    for staged, sent in [(5, 5), (0, 3), (-4, 3), (300, 255)]:
        assert _build(app, _row(priority=staged)).properties["priority"] == sent


def test_decode_is_plain_json_without_markers() -> None:
    assert encoding.decode('[1, {"a": "b"}]') == [1, {"a": "b"}]
    assert encoding.decode(kombu_dumps([uuid.UUID(int=1)])) == [uuid.UUID(int=1)]
    assert json.loads(kombu_dumps([uuid.UUID(int=1)]))[0]["__type__"] == "uuid"


def test_what_the_yaml_serializer_cannot_encode_is_an_error_per_row() -> None:
    """apply_async raises for a Decimal with yaml; the drain's build raises too, which
    the pipeline dead-letters as 'invalid' with the cause."""
    with pytest.raises(Exception, match=r"Decimal|represent"):
        _build(encoding_app.yaml_app, _row())


@pytest.mark.parametrize(("conf", "says"), [
    ({"task_serializer": "pickle"}, "accept_content ['application/json'] does not list"),
    ({"task_serializer": "auth"}, "'auth' signs the messages"),
    ({"task_serializer": "nope", "accept_content": ["json"]}, "'nope' is not available"),
    ({"task_compression": "snappy"}, "task_compression 'snappy' is not available"),
    ({"accept_content": ["json", "nothing"]}, "No encoder/decoder installed for nothing"),
])
def test_refused_at_start(conf: dict[str, Any], says: str) -> None:
    app = Celery("refused")
    app.conf.update(**conf)
    with pytest.raises(ConfigError, match=r"^the Celery app") as raised:
        routing.AppRouter(app)
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_a_tasks_serializer_the_workers_refuse_is_refused_at_start() -> None:
    app = Celery("refused_task")

    @app.task(name="t.pickled", serializer="pickle", shared=False)
    def pickled() -> None:  # pragma: no cover - never runs
        pass

    with pytest.raises(ConfigError, match=r"task t\.pickled's serializer 'pickle' sends "):
        encoding.check_app(app)


def test_a_routes_serializer_the_workers_refuse_costs_its_rows() -> None:
    """A route's own serializer (it counts where the task has none: a task the app
    does not register, with --allow-unknown-tasks) is met per row: routing raises,
    and the pipeline dead-letters the row 'invalid' (its workers would drop it)."""
    app = Celery("routed_pickle")
    app.conf.task_routes = {"enc.*": {"queue": "q_enc", "serializer": "pickle"}}
    with pytest.raises(ValueError, match=r"^the route's serializer 'pickle' sends "):
        routing.AppRouter(app, allow_unknown=True).destination(_row(unrouted=True))


@pytest.mark.parametrize("conf", [
    {"task_serializer": "yaml", "accept_content": ["application/x-yaml"]},
    {"task_compression": "zlib"}, {"task_compression": "lzma"}, {"accept_content": None},
])
def test_accepted_at_start(conf: dict[str, Any]) -> None:
    app = Celery("accepted")
    app.conf.update(**conf)
    encoding.check_app(app)

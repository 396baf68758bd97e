"""The drain's messages are the messages Celery itself publishes.

Both are fetched back from RabbitMQ and compared field by field: every AMQP
property, every header (in order), the body, and the routing. Without an app
(``send_task``, ``apply_async`` of a JSON app), and with ``--app`` of apps that
serialize with pickle, yaml or msgpack, compress, shadow a task's name or lower
the repr limits (tests/encoding_app.py).
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import re
import uuid
from typing import Any

import pytest
from celery import Celery
from kombu.utils.json import dumps as kombu_dumps

import drain
from drain.daemon.runner import Drain
from drain.settings.config import Settings
from tests import encoding_app, roles, support

ARGS = [1, "a", {"nested": [1, 2.5, None]}, "it's \"quoted\"\n", "é☃", 2**40]
# jsonb keeps object keys sorted (shorter first, then bytewise), so the worker
# sees kwargs in that order whatever order the app used; written in that order
# here so that the bodies can be compared byte for byte.
KWARGS = {"deep": {"a": {"b": {"c": {"d": 1}}}}, "flag": True, "none": None, "text": "x" * 2000}
PROPERTY_NAMES = (
    "content_type", "content_encoding", "headers", "delivery_mode", "priority",
    "correlation_id", "reply_to", "expiration", "message_id", "timestamp", "type",
    "user_id", "app_id", "cluster_id",
)
ORIGIN = re.compile(r"^gen\d+@.+$")


def _get_one(queue: str) -> tuple[Any, Any, bytes]:
    messages = support.wait_for(
        lambda: support.drain_queue(queue, timeout=0.5), 10, f"a message in {queue}"
    )
    assert len(messages) == 1, f"expected one message, got {len(messages)}"
    first: tuple[Any, Any, bytes] = messages[0]
    return first


def _drain_message(db_url: str, queue: str, task_id: uuid.UUID) -> tuple[Any, Any, bytes]:
    with support.connect(db_url) as conn:
        drain.stage(conn, "search.index_annotation", ARGS, KWARGS, queue=queue, task_id=task_id)
    Drain(Settings(database_url=roles.url(db_url, roles.RUNNER), broker_url=support.BROKER_URL),
          exit_when_empty=True).run()
    return _get_one(queue)


@pytest.fixture
def celery_app() -> Any:
    app = Celery("compat", broker=support.BROKER_URL)
    yield app
    app.close()


def _compare(
    ours: tuple[Any, Any, bytes], theirs: tuple[Any, Any, bytes], allowed: set[str],
    json_body: bool = True,
) -> None:
    (m1, p1, b1), (m2, p2, b2) = ours, theirs
    assert (m1.exchange, m1.routing_key) == (m2.exchange, m2.routing_key)
    differences = []
    for name in PROPERTY_NAMES:
        if name == "headers":
            continue
        if getattr(p1, name) != getattr(p2, name):
            differences.append(f"property {name}: {getattr(p1, name)!r} != {getattr(p2, name)!r}")
    assert list(p1.headers) == list(p2.headers), "header names or order differ"
    for key in p1.headers:
        if p1.headers[key] != p2.headers[key]:
            differences.append(f"header {key}: {p1.headers[key]!r} != {p2.headers[key]!r}")
    unexpected = [d for d in differences if d.split(":")[0].split()[-1] not in allowed]
    assert not unexpected, "\n".join(unexpected)
    if json_body:
        assert json.loads(b1) == json.loads(b2)
    assert b1 == b2, "bodies decode equal but differ as bytes"
    for props in (p1, p2):
        assert ORIGIN.match(props.headers["origin"]), props.headers["origin"]
        uuid.UUID(props.reply_to)


def test_same_as_send_task(
    db_url: str, queue: str, celery_app: Any
) -> None:
    task_id = uuid.uuid4()
    ours = _drain_message(db_url, queue, task_id)
    celery_app.send_task(
        "search.index_annotation", args=ARGS, kwargs=KWARGS, queue=queue, task_id=str(task_id)
    )
    theirs = _get_one(queue)
    # origin names the sending process and reply_to its result oid: per process by design.
    _compare(ours, theirs, allowed={"origin", "reply_to"})
    assert ours[1].headers["id"] == ours[1].correlation_id == str(task_id)
    assert ours[1].headers["root_id"] == str(task_id)


def test_same_as_apply_async(db_url: str, queue: str, celery_app: Any) -> None:
    @celery_app.task(name="search.index_annotation")
    def index_annotation(*args: Any, **kwargs: Any) -> None:  # pragma: no cover - never runs
        pass

    task_id = uuid.uuid4()
    ours = _drain_message(db_url, queue, task_id)
    index_annotation.apply_async(args=ARGS, kwargs=KWARGS, queue=queue, task_id=str(task_id))
    theirs = _get_one(queue)
    # apply_async on a task the sender knows also fills in that task's own
    # ignore_result (False) and leaves priority unset; the drain, like
    # send_task, sends ignore_result=None ("as the task says") and priority 0.
    _compare(ours, theirs, allowed={"origin", "reply_to", "ignore_result", "priority"})
    assert ours[1].headers["ignore_result"] is None
    assert theirs[1].headers["ignore_result"] is False


# -- apps that encode otherwise than plain JSON (tests/encoding_app.py) -----------------

#: The types kombu's JSON carries, staged as kombu's JSON writes them. The kwargs in
#: jsonb's key order (shorter keys first), so that the bodies can be compared byte
#: for byte.
TYPED_ARGS = [dt.datetime(2026, 11, 27, 3, 4, 5, 6, tzinfo=dt.timezone.utc),
              uuid.UUID("12345678-1234-5678-1234-567812345678"), decimal.Decimal("12.50"),
              dt.date(2026, 1, 2), "é☃", [1, 2.5, None], b"\x00\xff"]
TYPED_KWARGS = {"n": 3, "at": dt.time(4, 5, 6)}
PLAIN_ARGS = [1, "é☃", {"nested": [1, 2.5, None]}, "x" * 300]


def _app_drain_message(db_url: str, queue: str, *, spec: str, task: str, args: Any,
                       kwargs: Any, task_id: uuid.UUID, **columns: Any) -> tuple[Any, Any, bytes]:
    """Stage by SQL (kombu's markers as kombu_dumps writes them), then ``drain run --app``."""
    names = ["task_id", "task_name", "args", "kwargs", "queue", *columns]
    with support.connect(roles.url(db_url, roles.STAGER)) as conn:  # as the app stages
        conn.execute(f"INSERT INTO staged_jobs ({', '.join(names)}) VALUES "
                     f"(%s, %s, %s::jsonb, %s::jsonb, %s{', %s' * len(columns)})",
                     [task_id, task, kombu_dumps(args), kombu_dumps(kwargs), queue,
                      *columns.values()])
    Drain(Settings(database_url=roles.url(db_url, roles.RUNNER), broker_url=support.BROKER_URL,
                   celery_app=spec), exit_when_empty=True).run()
    return _get_one(queue)


@pytest.mark.parametrize("case", [
    ("pickle_app", "enc.record", TYPED_ARGS, TYPED_KWARGS),
    ("gzip_app", "enc.record", TYPED_ARGS, TYPED_KWARGS),
    ("yaml_app", "enc.record", PLAIN_ARGS, {"k": "v"}),
    ("msgpack_app", "enc.record", PLAIN_ARGS, {"k": "v"}),
    ("mixed_app", "enc.pickled", TYPED_ARGS, TYPED_KWARGS),
    ("mixed_app", "enc.shadowed", ["abc", *TYPED_ARGS], TYPED_KWARGS),
    ("mixed_app", "enc.record", [[[1, [2, [3]]]], "y" * 100], {}),
])
def test_same_as_apply_async_of_an_app_that_encodes_otherwise(
    db_url: str, queue: str, case: tuple[str, str, Any, Any]
) -> None:
    """Properties, headers (shadow, compression, argsrepr with the app's limits) and
    the body bytes (serialized, compressed) are those of the app's apply_async."""
    name, task, args, kwargs = case
    spec = f"tests.encoding_app:{name}"
    app = getattr(encoding_app, name)
    task_id = uuid.uuid4()
    ours = _app_drain_message(db_url, queue, spec=spec, task=task, args=args, kwargs=kwargs,
                              task_id=task_id)
    app.tasks[task].apply_async(args=args, kwargs=kwargs, queue=queue, task_id=str(task_id))
    theirs = _get_one(queue)
    _compare(ours, theirs, allowed={"origin", "reply_to"}, json_body=False)
    if task == "enc.shadowed":
        assert ours[1].headers["shadow"] == "shadow.abc"


def test_priority_of_a_row_as_apply_async_sends_it(db_url: str, queue: str) -> None:
    """apply_async(priority=5) to a queue without x-max-priority sends 5 (the
    worker's delivery_info['priority']); so does a row staged with priority 5.
    Before: 0."""
    task_id = uuid.uuid4()
    ours = _app_drain_message(db_url, queue, spec="tests.encoding_app:gzip_app",
                              task="enc.record", args=[1], kwargs={}, task_id=task_id,
                              priority=5)
    encoding_app.gzip_app.tasks["enc.record"].apply_async(
        args=[1], kwargs={}, queue=queue, task_id=str(task_id), priority=5)
    theirs = _get_one(queue)
    _compare(ours, theirs, allowed={"origin", "reply_to"}, json_body=False)
    assert ours[1].priority == theirs[1].priority == 5

"""The drain's messages are the messages Celery itself publishes.

Both are fetched back from RabbitMQ and compared field by field: every AMQP
property, every header (in order), the body, and the routing.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest
from celery import Celery

import drain
from drain.config import Settings
from drain.runner import Drain
from tests import roles, support

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
    ours: tuple[Any, Any, bytes], theirs: tuple[Any, Any, bytes], allowed: set[str]
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

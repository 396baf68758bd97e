"""Building Celery protocol v2 messages from staged rows (pure logic)."""

from __future__ import annotations

import datetime as dt
import json
import random
import uuid
from typing import Any

import pika
import pytest
from celery.utils.saferepr import saferepr

from drain.broker import amqp
from drain.broker.outgoing import PauseKey
from drain.celery import encoding, message
from drain.postgres.rows import StagedRow

HEADER_ORDER = [
    "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
    "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
    "replaced_task_nesting", "stamped_headers", "stamps",
]


def _row(args: Any = (1, "a"), kwargs: Any = None, **overrides: Any) -> StagedRow:
    fields: dict[str, Any] = {
        "id": 7,
        "task_id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "task_name": "search.index_annotation",
        "args_json": json.dumps(list(args)),
        "kwargs_json": json.dumps(kwargs or {"annotation_id": 42}),
        "queue": "celery",
    }
    fields.update(overrides)
    return StagedRow(**fields)


def test_protocol_v2_shape() -> None:
    m = message.build(_row(), origin="gen1@host", reply_to="r")
    assert list(m.headers) == HEADER_ORDER
    assert m.headers["id"] == m.headers["root_id"] == "12345678-1234-5678-1234-567812345678"
    assert m.headers["task"] == "search.index_annotation"
    assert m.headers["timelimit"] == [None, None]
    assert m.properties["correlation_id"] == m.task_id
    assert m.properties["content_type"] == "application/json"
    assert m.properties["delivery_mode"] == 2
    body = json.loads(m.body)
    assert body == [[1, "a"], {"annotation_id": 42},
                    {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    assert m.routing_key == "celery"
    assert m.row_id == 7


def test_body_is_bytes_for_bytes_what_kombu_would_send() -> None:
    from kombu.utils.json import dumps

    args, kwargs = [1, "é☃\U0001f600\u2028", [2.5, None]], {"b": True, "a": {"x": []}}
    row = _row(args_json=json.dumps(args, ensure_ascii=False),  # as Postgres prints jsonb
               kwargs_json=json.dumps(kwargs, ensure_ascii=False))
    m = message.build(row, origin="o", reply_to="r")
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    assert m.body == dumps([args, kwargs, embed]).encode()
    assert json.loads(m.body) == [args, kwargs, embed]


def _random_value(rng: random.Random, depth: int) -> Any:
    pick = rng.randrange(9 if depth < 5 else 6)
    alphabet = "abc xyz'\"\\\né☃\t"
    if pick == 0:
        return rng.randrange(-(2**40), 2**40)
    if pick == 1:
        return rng.random() * 1000
    if pick == 2:
        return rng.choice([True, False, None])
    if pick in (3, 4, 5):
        length = rng.randrange(0, 8 if pick < 5 else 700)
        return "".join(rng.choice(alphabet) for _ in range(length))
    if pick in (6, 7):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {
        "".join(rng.choice(alphabet) for _ in range(3)): _random_value(rng, depth + 1)
        for _ in range(rng.randrange(0, 4))
    }


def test_task_repr_equals_celery_saferepr() -> None:
    rng = random.Random(20261122)
    for _ in range(3000):
        value: Any = (
            [_random_value(rng, 1) for _ in range(rng.randrange(0, 4))]
            if rng.random() < 0.5
            else {f"k{i}": _random_value(rng, 1) for i in range(rng.randrange(0, 4))}
        )
        value = json.loads(json.dumps(value))  # exactly what comes out of jsonb
        assert message.task_repr(value) == saferepr(value, 1024, maxlevels=3), value
        # an app's own limits (task_repr_maxlevels, amqp.argsrepr_maxsize)
        maxsize, maxlevels = rng.choice([8, 40, 200, 1024]), rng.randrange(0, 5)
        assert message.task_repr(value, maxsize, maxlevels) == saferepr(
            value, maxsize, maxlevels=maxlevels), (value, maxsize, maxlevels)


@pytest.mark.parametrize(
    "value",
    [[], {}, [1, "a"], {"a": {"b": {"c": {"d": 1}}}}, ["x" * 5000], ["it's"], ["\n"]],
)
def test_task_repr_edge_cases(value: Any) -> None:
    assert message.task_repr(value) == saferepr(value, 1024, maxlevels=3)


def test_encoded_properties_match_pika_byte_for_byte() -> None:
    rng = random.Random(7)
    for i in range(300):
        args = [_random_value(rng, 1) for _ in range(rng.randrange(0, 3))]
        kwargs = {"n": rng.randrange(-(2**63), 2**63), "i": i, "x": _random_value(rng, 1)}
        m = message.build(
            _row(args, kwargs, task_name=f"t.{i}é"), origin=f"gen{i}@h", reply_to=str(uuid.uuid4())
        )
        reference = pika.BasicProperties(headers=m.headers, **m.properties).encode()
        assert m.encoded_properties == b"".join(reference)


def test_encoded_properties_refuse_long_short_strings() -> None:
    with pytest.raises(pika.exceptions.ShortStringTooLong):
        amqp.shortstr("x" * 256)


def test_origin_names_this_process() -> None:
    import os

    assert message.origin().startswith(f"gen{os.getpid()}@")


def test_builder_template_matches_generic_encoding() -> None:
    rng = random.Random(11)
    builder = message.Builder(origin="gen42@host.example", reply_to=str(uuid.uuid4()),
                              max_priority=rng.choice([0, 10]))
    now = 1_800_000_000.0
    for i in range(300):
        row = _row(
            [_random_value(rng, 1)], {"k": _random_value(rng, 1)}, task_name=f"t.é{i}",
            task_id=uuid.uuid4(), priority=rng.randrange(-20, 20),
            tag=rng.choice([None, "api.create", "backfill.é"]),
            expires_at=rng.choice([None, dt.datetime.fromtimestamp(now + rng.random() * 1e5,
                                                                   dt.timezone.utc)]),
        )
        trace = rng.choice([None, {}, {"traceparent": f"00-{i:032x}-{i + 1:016x}-01"},
                            {"traceparent": f"00-{i + 7:032x}-{i + 1:016x}-00",
                             "tracestate": "vendor=é,x=1", "baggage": "user=42"}])
        fast = builder.build(row, now=now, trace=trace)
        slow = message.build(row, origin=builder.origin, reply_to=builder.reply_to,
                             max_priority=builder.max_priority, now=now, trace=trace)
        assert fast.encoded_properties == slow.encoded_properties
        if trace:
            assert list(fast.headers)[-len(trace):] == list(trace)
        assert fast.encoded_properties == b"".join(
            pika.BasicProperties(headers=fast.headers, **fast.properties).encode()
        )


def test_expiry_tag_and_priority_as_celery_sends_them() -> None:
    expires_at = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    row = _row(priority=7, tag="api.create_annotation", expires_at=expires_at)
    m = message.build(row, origin="o", reply_to="r", max_priority=5,
                      now=expires_at.timestamp() - 90.5)
    assert m.headers["expires"] == "2030-01-01T10:00:00+00:00"
    assert m.properties["expiration"] == "90500"  # kombu: str(int(seconds * 1000))
    assert m.properties["priority"] == 5  # clamped to the queue's x-max-priority
    assert m.headers["drain_tag"] == "api.create_annotation"
    assert list(m.headers)[-1] == "drain_tag"
    late = message.build(row, origin="o", reply_to="r", now=expires_at.timestamp() + 5)
    assert late.properties["expiration"] == "0"
    assert late.properties["priority"] == 0  # queues without x-max-priority


@pytest.mark.parametrize(
    ("priority", "max_priority", "expected"),
    [(0, 0, 0), (9, 0, 0), (-5, 10, 0), (3, 10, 3), (300, 10, 10), (300, 255, 255)],
)
def test_amqp_priority(priority: int, max_priority: int, expected: int) -> None:
    assert message.amqp_priority(priority, max_priority) == expected


def test_destination_options_encode_as_pika_does() -> None:
    """With an app's destination: time limits, ignore_result and no priority property."""
    rng = random.Random(13)
    builder = message.Builder(origin="gen42@host.example", reply_to=str(uuid.uuid4()))
    for i in range(200):
        destination = message.Destination(
            exchange=rng.choice(["", "topic"]), routing_key=f"rk.{i}", queue=f"q{i}",
            priority=rng.choice([None, 0, 4]), max_priority=rng.choice([0, 10]),
            timelimit=rng.choice([(None, None), (60, 50), (None, 30)]),
            ignore_result=rng.choice([None, True, False]),
            encoding=rng.choice([encoding.JSON, encoding.Encoding(compression="gzip"),
                                 encoding.Encoding("pickle", "application/x-python-serialize",
                                                   "binary", rng.choice([None, "bzip2"]))]),
            shadow=rng.choice([None, lambda args, kwargs, options: f"s{args[0]}"]),
        )
        row = _row([i], {"k": i}, priority=rng.randrange(-3, 20), tag=rng.choice([None, "t"]))
        fast = builder.build(row, now=1_800_000_000.0, destination=destination)
        slow = message.build(row, origin=builder.origin, reply_to=builder.reply_to,
                             now=1_800_000_000.0, destination=destination)
        assert fast.encoded_properties == slow.encoded_properties
        assert fast.encoded_properties == b"".join(
            pika.BasicProperties(headers=fast.headers, **fast.properties).encode()
        )
        assert (fast.exchange, fast.routing_key, fast.declared_queue, fast.pause_key) == (
            destination.exchange, f"rk.{i}", f"q{i}", PauseKey(f"q{i}"))
        assert fast.headers["timelimit"] == list(destination.timelimit)
        assert fast.headers["ignore_result"] is destination.ignore_result
        if row.priority > 0:  # the row's own, as apply_async(priority=...) sends it
            assert fast.properties["priority"] == row.priority
        else:
            assert fast.properties.get("priority") == destination.priority


def test_empty_args_show_as_celery_shows_them() -> None:
    assert message.build(_row([], {}), origin="o", reply_to="r").headers["argsrepr"] == "()"

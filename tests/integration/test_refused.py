"""A publish the broker refuses by closing the channel, against the real RabbitMQ
(drain.broker.refusal): the refused message is found among the unconfirmed ones and
costs only itself; the connection is kept and its next batches flow.

* 404 on an exchange nobody declares, across two batches in flight;
* 406, a message over RabbitMQ's ``max_message_size`` (128 MiB on 3.x);
* 403, a user without write permission on one exchange: held, not dead;
* 404 on an exchange the drain declares for the queue, deleted behind its
  back: declared again every time, never dead-lettered;
* a nack (a full queue with ``x-overflow: reject-publish``): that row is
  published again with backoff, not in a loop.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import pika
import pika.exceptions
import psycopg
import pytest

import drain
from drain.broker.batches import PublishResult
from drain.broker.outgoing import Message, PauseKey
from drain.broker.publisher import Publisher
from drain.broker.queue_declare import BindingSpec, ExchangeSpec, QueueSpec
from drain.celery import message
from drain.celery.message import Destination
from drain.postgres.rows import StagedRow
from drain.settings.config import Settings
from drain.settings.urls import broker_parameters
from tests import roles, support
from tests.integration.conftest import Running
from tests.machine import rabbitmqctl

BUILDER = message.Builder(origin="gen1@test", reply_to=str(uuid.uuid4()))


@pytest.fixture
def exchange() -> Iterator[str]:
    name = support.unique("drain_refused_x")
    yield name
    with support.broker_channel() as ch:
        ch.exchange_delete(name)


def _message(row_id: int, queue: str, exchange: str = "", size: int = 0) -> Message:
    args = f'["{"x" * size}"]' if size else f"[{row_id}]"
    row = StagedRow(row_id, uuid.uuid4(), "t.refused", args, "{}", queue)
    where = Destination(exchange=exchange, routing_key=queue, queue=queue) if exchange else None
    return BUILDER.build(row, destination=where)


def _publish(pub: Publisher, queue: str, *messages: Message) -> PublishResult:
    batch = pub.start(iter(messages), queues={queue}, count=len(messages))
    return pub.wait(batch)


def _refused(result: PublishResult) -> list[tuple[int, int, str]]:
    return [(m.row_id, r.code, r.action) for m, r in result.refused]


def test_a_missing_exchange_costs_its_message_across_batches_in_flight(
    queue: str, exchange: str
) -> None:
    pub = support.publisher()
    try:
        assert pub.declare({queue}) == {}
        first = pub.start(iter([_message(1, queue), _message(2, queue, exchange),
                                _message(3, queue)]), queues={queue}, count=3)
        second = pub.start(iter([_message(i, queue) for i in (4, 5, 6)]),
                           queues={queue}, count=3)
        result_1, result_2 = pub.wait(first), pub.wait(second)
        # The next batch goes out on the new channel, its tags counted from 1 again.
        result_3 = _publish(pub, queue, *(_message(i, queue) for i in (7, 8)))
        assert pub.connected
    finally:
        pub.close()
    assert result_1.error is None and result_2.error is None and result_3.error is None
    assert sorted(result_1.confirmed) == [1, 3]
    assert _refused(result_1) == [(2, 404, "dead")]
    assert f"404 NOT_FOUND - no exchange '{exchange}'" in result_1.refused[0][1].text
    assert sorted(result_2.confirmed) == [4, 5, 6] and result_2.refused == []
    assert sorted(result_3.confirmed) == [7, 8]
    copies = support.task_ids(support.drain_queue(queue))
    assert len(set(copies)) == 7 and len(copies) <= 7 + 1  # row 1 at most twice


def test_a_message_over_the_brokers_max_size_costs_only_itself(queue: str) -> None:
    big = 129 * 1024 * 1024  # RabbitMQ 3.x refuses more than 128 MiB (406)
    pub = support.publisher()
    try:
        assert pub.declare({queue}) == {}
        result = _publish(pub, queue, _message(1, queue), _message(2, queue, size=big),
                          _message(3, queue))
        after = _publish(pub, queue, _message(4, queue))
    finally:
        pub.close()
    assert result.error is None and after.error is None
    assert sorted(result.confirmed) == [1, 3] and after.confirmed == [4]
    assert _refused(result) == [(2, 406, "dead")]
    assert "PRECONDITION_FAILED" in result.refused[0][1].text
    assert "larger than configured max size" in result.refused[0][1].text


def _logs_in(url: str) -> bool:
    try:
        pika.BlockingConnection(broker_parameters(url)).close()
    except pika.exceptions.AMQPError:
        return False
    return True


@contextlib.contextmanager
def _user(write: str) -> Iterator[tuple[str, str]]:
    """A broker user that may configure and read anything, and write where ``write``
    matches: (its name, its URL)."""
    user, password = support.unique("drain_refused_u"), uuid.uuid4().hex
    rabbitmqctl("add_user", user, password)
    try:
        rabbitmqctl("set_permissions", "-p", support.BROKER_VHOST, user, ".*", write, ".*")
        url = support.broker_url(user=user, password=password)
        support.wait_for(lambda: _logs_in(url), 30, f"{user} to be let in")
        yield user, url
    finally:
        with contextlib.suppress(RuntimeError):
            rabbitmqctl("delete_user", user)


@pytest.fixture
def writer_without(exchange: str) -> Iterator[str]:
    """A broker URL whose user may write anywhere but to ``exchange``."""
    with _user(f"^(?!{exchange}$).*") as (_, url):
        yield url


def test_a_permission_refusal_holds_the_rows_of_that_exchange(
    queue: str, exchange: str, writer_without: str
) -> None:
    with support.broker_channel() as ch:
        ch.exchange_declare(exchange, durable=True)
    pub = support.publisher(writer_without)
    try:
        assert pub.declare({queue}) == {}
        result = _publish(pub, queue, _message(1, queue), _message(2, queue, exchange),
                          _message(3, queue, exchange), _message(4, queue))
    finally:
        pub.close()
    assert result.error is None
    assert sorted(result.confirmed) == [1, 4]
    # Held (not dead-lettered); the second one is not probed: it would be refused alike.
    assert _refused(result) == [(2, 403, "hold"), (3, 403, "hold")]
    assert "ACCESS_REFUSED" in result.refused[0][1].text


def test_an_exchange_deleted_behind_the_drains_back_is_declared_again_every_time(
    queue: str, exchange: str
) -> None:
    def spec(name: str) -> QueueSpec:
        return QueueSpec(name, bindings=(BindingSpec(ExchangeSpec(exchange), name),))

    def delete_exchange() -> None:
        with support.broker_channel() as ch:
            ch.exchange_delete(exchange)

    pub = support.publisher(specs=spec)
    try:
        assert pub.declare({queue}) == {}
        delete_exchange()
        refused = _publish(pub, queue, _message(1, queue, exchange),
                           _message(2, queue, exchange))
        assert pub.declare({queue}) == {}  # forgotten: declared again, exchange and all
        flowing = _publish(pub, queue, _message(1, queue, exchange),
                           _message(2, queue, exchange))
        delete_exchange()
        again = _publish(pub, queue, _message(3, queue, exchange))
        assert pub.declare({queue}) == {}  # forgotten again: declared a second time
        with support.broker_channel() as ch:
            ch.exchange_declare(exchange, passive=True)
        after = _publish(pub, queue, _message(3, queue, exchange))
    finally:
        pub.close()
    assert _refused(refused) == [(1, 404, "retry"), (2, 404, "retry")]
    assert refused.confirmed == []
    assert sorted(flowing.confirmed) == [1, 2]
    # Every time, not once per connection: what a redeclare cures is never
    # dead-lettered (the drain's backoff keeps it from a loop: drain.daemon.holds).
    assert _refused(again) == [(3, 404, "retry")]
    assert after.confirmed == [3]


def test_a_drain_without_write_permission_holds_its_rows_and_says_so(
    db_url: str, queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    """403 is the drain's permission, not the rows': they stay staged (their queue
    paused, drain_publish_refused_total counts it, one log line says why) and are
    delivered once the permission is granted; the drain keeps its connection."""
    with _user("^(?!amq\\.default$).*") as (user, url):
        with psycopg.connect(db_url) as conn:
            for i in range(10):
                drain.stage(conn, "t.refused", [i], queue=queue)
        running = Running(Settings(database_url=roles.url(db_url, roles.RUNNER),
                                   broker_url=url, poll_interval=0.2, max_backoff=0.5))
        try:
            metrics = running.drain.metrics.registry
            support.wait_for(lambda: metrics.get_sample_value(
                "drain_publish_refused_total", {"code": "403"}), 30, "a refused publish")
            assert support.staged_count(db_url) == 10
            # Paused once per batch, not once per row (that made it 2**10 s, capped
            # at 30 s), and longer each time until a message to it is confirmed.
            assert running.drain.pipeline.paused[PauseKey(queue)][1] <= 3
            assert metrics.get_sample_value("drain_dead_lettered_total",
                                            {"reason": "refused"}) == 0
            rabbitmqctl("set_permissions", "-p", support.BROKER_VHOST, user, ".*", ".*", ".*")
            support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                             "the rows once the drain may write")
            assert running.drain.metrics.registry.get_sample_value(
                "drain_reconnects_total", {"target": "broker"}) == 0
        finally:
            running.stop()
    assert len(support.drain_queue(queue)) == 10
    said = [r.getMessage() for r in caplog.records if "ACCESS_REFUSED" in r.getMessage()]
    assert any("its rows stay staged" in line for line in said), said


def test_a_nacked_row_is_retried_with_backoff_not_in_a_loop(
    db_url: str, queue: str, other_queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A full queue (x-overflow reject-publish) nacks its row; the other rows flow,
    the nacked one is published again with backoff (before: in a loop, ~235
    nacks and log lines a second) and delivered once there is room."""
    with support.broker_channel() as ch:
        ch.queue_declare(queue, durable=True,
                         arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
        ch.basic_publish("", queue, b"filler")
        ch.queue_declare(other_queue, durable=True)
    with psycopg.connect(db_url) as conn:
        drain.stage(conn, "t.nacked", [0], queue=queue)
        for i in range(5):
            drain.stage(conn, "t.flowing", [i], queue=other_queue)
    running = Running(Settings(database_url=roles.url(db_url, roles.RUNNER),
                               broker_url=support.BROKER_URL, poll_interval=0.2, max_backoff=0.5,
                               queue_declare="passive"))
    try:
        metrics = running.drain.metrics.registry
        support.wait_for(lambda: metrics.get_sample_value("drain_nacked_total"), 30, "a nack")
        support.wait_for(lambda: support.staged_count(db_url) == 1, 30, "the other rows")
        assert PauseKey(queue) in running.drain.pipeline.paused
        delivered = support.drain_queue(queue)  # room: the row may follow at once
        assert delivered[0][2] == b"filler"
        support.wait_for(lambda: support.staged_count(db_url) == 0, 60, "the nacked row")
        nacks = metrics.get_sample_value("drain_nacked_total")
    finally:
        running.stop()
    assert len(delivered[1:] + support.drain_queue(queue)) == 1
    assert len(support.drain_queue(other_queue)) == 5
    # 1, 2, 4... s apart: a handful, whatever the machine's speed.
    assert nacks is not None and nacks <= 5, nacks


def test_a_refusal_noticed_between_batches_is_sorted_out_before_the_next_one(
    queue: str, exchange: str
) -> None:
    """The close comes while the drain is idle (pump); the next start finds the
    refused message, declares the queue it forgot, and publishes its own batch on
    the new channel."""
    def spec(name: str) -> QueueSpec:
        return QueueSpec(name, bindings=(BindingSpec(ExchangeSpec(exchange), name),))

    pub = support.publisher(specs=spec)
    try:
        assert pub.declare({queue}) == {}
        with support.broker_channel() as ch:
            ch.exchange_delete(exchange)
        first = pub.start(iter([_message(1, queue, exchange), _message(2, queue)]),
                          queues={queue}, count=2)
        def closed() -> str | None:
            pub.pump(0.05)
            return pub.refusal

        support.wait_for(closed, 30, "the close")
        second = pub.start(iter([_message(3, queue, exchange), _message(4, queue)]),
                           queues={queue}, count=2)
        result_1, result_2 = pub.wait(first), pub.wait(second)
    finally:
        pub.close()
    assert result_1.error is None and result_2.error is None
    assert result_1.confirmed == [2] and _refused(result_1) == [(1, 404, "retry")]
    assert sorted(result_2.confirmed) == [3, 4] and result_2.refused == []

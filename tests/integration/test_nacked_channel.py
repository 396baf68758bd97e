"""After a nack, the next batch goes out on a new channel (drain.broker.channels,
``ChannelKeepingLink._renew``; issue 37).

On a RabbitMQ cluster, a channel that first published to a quorum queue while
its leader was being elected gets every later publish to it nacked, 5 s each,
until the old leader's node returns, while a new channel gets acks at once
(tests/rabbit_cluster shows it on three nodes). Here, on one node, a full queue
(``x-overflow: reject-publish``) makes the nacks: the publisher opens a new
publishing channel for the next batch, closes the old one, stays connected,
and the next batch's confirms are counted on the new channel.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from drain.broker.publisher import Publisher
from drain.celery import message
from drain.postgres.rows import StagedRow
from drain.settings.urls import broker_parameters
from tests import support

BUILDER = message.Builder(origin="gen1@test", reply_to=str(uuid.uuid4()))


@pytest.fixture
def full_queue() -> Iterator[str]:
    name = support.unique("nacked_channel")
    with support.broker_channel() as channel:
        channel.queue_declare(name, durable=True, arguments={
            "x-max-length": 1, "x-overflow": "reject-publish"})
    yield name
    support.delete_queue(name)


def _batch(pub: Publisher, queue: str, first: int, n: int) -> object:
    rows = [StagedRow(i, uuid.uuid4(), "t.nack", "[]", "{}", queue)
            for i in range(first, first + n)]
    return pub.start((BUILDER.build(r) for r in rows), queues={queue}, count=n)


def test_a_nack_puts_the_next_batch_on_a_new_channel(full_queue: str) -> None:
    pub = Publisher(broker_parameters(support.BROKER_URL), display_url="broker",
                    declare="passive")
    pub.connect()
    try:
        assert pub.declare({full_queue}) == {}
        first_channel = pub._channel  # our own class: which channel publishes
        result = pub.wait(_batch(pub, full_queue, 1, 3))  # type: ignore[arg-type]
        assert (len(result.confirmed), result.nacked, result.error) == (1, 2, None)
        support.drain_queue(full_queue)  # room again
        result = pub.wait(_batch(pub, full_queue, 4, 1))  # type: ignore[arg-type]
        assert pub._channel is not first_channel
        assert first_channel.is_closed
        assert pub.connected
        # Counted on the new channel, whose delivery tags start at 1 again.
        assert (result.confirmed, result.nacked, result.error) == ([4], 0, None)
        # No nack since: the channel stays.
        second_channel = pub._channel
        support.drain_queue(full_queue)
        result = pub.wait(_batch(pub, full_queue, 5, 1))  # type: ignore[arg-type]
        assert pub._channel is second_channel and result.confirmed == [5]
    finally:
        pub.close()

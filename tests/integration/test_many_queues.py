"""Many queues (issue 36), against the real RabbitMQ: the queues a batch goes to
are declared with one synchronous wait per batch, not one round trip per queue
(drain.broker.queue_declare), each once per connection; a refused queue among
many costs only itself.
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from drain.broker.outgoing import Message
from drain.broker.publisher import Publisher
from drain.broker.queue_declare import QueueSpec, classic
from drain.celery import message
from drain.postgres.rows import StagedRow
from drain.settings.urls import broker_parameters
from tests import support

BUILDER = message.Builder(origin="gen1@test", reply_to=str(uuid.uuid4()))
QUEUES = 300


class CountingPublisher(Publisher):
    """Counts the synchronous waits on the declare channel."""

    waits = 0

    def _declare_step(self, *args: Any, **kwargs: Any) -> str | None:
        self.waits += 1
        return super()._declare_step(*args, **kwargs)


@pytest.fixture
def queues() -> Iterator[list[str]]:
    prefix = support.unique("drain_many")
    names = [f"{prefix}_{i:03d}" for i in range(QUEUES)]
    yield names
    for name in names:
        support.delete_queue(name)


def _publisher(declared: collections.Counter[str]) -> CountingPublisher:
    specs = classic()

    def counting(name: str) -> QueueSpec:
        declared[name] += 1
        return specs(name)

    pub = CountingPublisher(broker_parameters(support.BROKER_URL), display_url="broker",
                            confirm_timeout=30, specs=counting)
    pub.connect()
    return pub


def _messages(queues: list[str], first_id: int) -> list[Message]:
    return [BUILDER.build(StagedRow(first_id + i, uuid.uuid4(), "t.many", "[]", "{}", q))
            for i, q in enumerate(queues)]


def test_many_queues_are_declared_once_each_with_one_wait_per_batch(
    queues: list[str],
) -> None:
    declared: collections.Counter[str] = collections.Counter()
    pub = _publisher(declared)
    try:
        results = []
        for n, half in enumerate((queues[: QUEUES // 2], queues)):  # the second adds 150
            assert pub.declare(set(half)) == {}
            msgs = _messages(half, 1000 * n)
            batch = pub.start(iter(msgs), queues=set(half), count=len(msgs))
            results.append(pub.wait(batch))
        assert pub.connected
    finally:
        pub.close()
    assert all(r.error is None and r.refused == [] for r in results)
    assert len(results[0].confirmed) == QUEUES // 2 and len(results[1].confirmed) == QUEUES
    assert set(declared) == set(queues) and set(declared.values()) == {1}
    assert pub.waits <= 2  # one per batch that had new queues (the old code: 300)
    assert sum(support.queue_depth(q) for q in queues) == QUEUES + QUEUES // 2


def test_a_refused_queue_among_many_costs_only_itself(queues: list[str]) -> None:
    bad = queues[QUEUES // 2]
    with support.broker_channel() as ch:  # exists with other arguments: 406
        ch.queue_declare(bad, durable=True, arguments={"x-max-priority": 7})
    declared: collections.Counter[str] = collections.Counter()
    pub = _publisher(declared)
    try:
        refused = pub.declare(set(queues))
        good = [q for q in queues if q != bad]
        msgs = _messages(good, 0)
        result = pub.wait(pub.start(iter(msgs), queues=set(good), count=len(msgs)))
        again = pub.declare(set(good))  # declared on this connection: nothing to do
        assert pub.connected
    finally:
        pub.close()
    assert list(refused) == [bad] and "406" in refused[bad]
    assert result.error is None and len(result.confirmed) == QUEUES - 1
    assert again == {}
    assert support.queue_depth(bad) == 0
    assert sum(support.queue_depth(q) for q in good) == QUEUES - 1

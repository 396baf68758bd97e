"""Queue declares over several channels at once, against the real RabbitMQ
(drain.broker.queue_declare): many queues, some refused, are each answered for
themselves; a refusal costs only its own channel; a declare call with a budget
returns by it, and what it left under way is answered to the next call."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pika
import pytest

from drain.broker import queue_declare
from drain.broker.publisher import Publisher
from drain.celery import message
from drain.postgres.rows import StagedRow
from tests import support

COUNT = 60
REFUSED = (3, 17, 41)


@pytest.fixture
def names() -> Iterator[list[str]]:
    prefix = support.unique("drain_lanes")
    made = [f"{prefix}_{i}" for i in range(COUNT)]
    with support.broker_channel() as ch:
        for i in REFUSED:  # declared with an argument the drain does not give: 406
            ch.queue_declare(made[i], durable=True, arguments={"x-max-length": 1})
    yield made
    with support.broker_channel() as ch:
        for name in made:
            ch.queue_delete(name)


def _exists(name: str) -> bool:
    with support.broker_channel() as ch:
        ch.queue_declare(name, passive=True)
    return True


def test_many_queues_with_refusals_among_them_are_each_answered(names: list[str]) -> None:
    pub = support.publisher()
    try:
        refused = pub.declare(set(names))
        assert sorted(refused) == sorted(names[i] for i in REFUSED)
        assert all(reason.startswith("406") for reason in refused.values()), refused
        assert pub.undeclared(set(names)) == set(refused)
        assert all(_exists(name) for name in names)
        # The refusals closed only their own channels: the publishing channel and
        # the connection are fine, and another declare goes through at once.
        assert pub.connected
        assert pub.declare({names[0]}) == {}
        again = pub.declare({names[REFUSED[0]]})
        assert list(again) == [names[REFUSED[0]]]
    finally:
        pub.close()


@pytest.fixture
def most_at_once(monkeypatch: pytest.MonkeyPatch) -> Callable[[Publisher], list[int]]:
    """Counts, as each queue declare is sent, how many are under way at once: the
    list's one number is the most seen so far."""
    def watch(pub: Publisher) -> list[int]:
        most = [0]
        real = queue_declare._queue_step

        def counting(spec: queue_declare.QueueSpec, *, passive: bool) -> queue_declare.Step:
            step = real(spec, passive=passive)

            def counted(channel: object, done: queue_declare.Done) -> None:
                most[0] = max(most[0], len(pub.in_flight))
                step(channel, done)
            return counted

        monkeypatch.setattr(queue_declare, "_queue_step", counting)
        return most
    return watch


def test_the_declares_run_side_by_side(
        names: list[str], most_at_once: Callable[[Publisher], list[int]]) -> None:
    """Each queue's declare on a channel of its own, up to DECLARE_CHANNELS at once."""
    pub = support.publisher()
    most = most_at_once(pub)
    try:
        pub.declare(set(names))
        assert 1 < most[0] <= queue_declare.DECLARE_CHANNELS
    finally:
        pub.close()


def test_a_budget_spent_leaves_the_rest_for_the_next_call(names: list[str]) -> None:
    pub = support.publisher()
    try:
        # A budget already spent: the declares that start at once (one per channel)
        # are under way when it returns, the others not started.
        first = pub.declare(set(names), until=time.monotonic() - 1)
        left = pub.undeclared(set(names))
        assert left, "nothing left for the next call"
        assert len(set(names) - left) + len(first) <= queue_declare.DECLARE_CHANNELS
        # The next call answers every queue: the refusals of the first call's
        # declares under way included, each returned once.
        second = pub.declare(set(names))
        assert sorted({**first, **second}) == sorted(names[i] for i in REFUSED)
        assert not set(first) & set(second)
        assert pub.undeclared(set(names)) == {names[i] for i in REFUSED}
    finally:
        pub.close()


def test_the_lanes_keep_within_the_channel_max(
        names: list[str], most_at_once: Callable[[Publisher], list[int]]) -> None:
    """A connection allowed 4 channels: the declares take 2 (the publishing channel
    and its replacement keep theirs), and a batch still publishes after them."""
    pub = support.publisher(pika.URLParameters(f"{support.BROKER_URL}?channel_max=4"))
    most = most_at_once(pub)
    try:
        refused = pub.declare(set(names))
        assert sorted(refused) == sorted(names[i] for i in REFUSED)
        assert most[0] == 2
        row = StagedRow(1, uuid.uuid4(), "t.lanes", "[1]", "{}", names[0])
        result = pub.publish([message.Builder(origin="gen1@test", reply_to="r").build(row)])
        assert result.confirmed == [1]
    finally:
        pub.close()

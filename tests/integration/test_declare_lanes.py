"""Queue declares over several channels at once, against the real RabbitMQ
(drain.broker.queue_declare): many queues, some refused, are each answered for
themselves; a refusal costs only its own channel; a declare call with a budget
returns by it, and what it left under way is answered to the next call."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from drain.broker import queue_declare
from drain.broker.publisher import Publisher
from drain.settings.urls import broker_parameters
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


def _publisher() -> Publisher:
    pub = Publisher(broker_parameters(support.BROKER_URL), display_url="broker",
                    confirm_timeout=10)
    pub.connect()
    return pub


def _exists(name: str) -> bool:
    with support.broker_channel() as ch:
        ch.queue_declare(name, passive=True)
    return True


def test_many_queues_with_refusals_among_them_are_each_answered(names: list[str]) -> None:
    pub = _publisher()
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


def test_the_declares_run_side_by_side(names: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each queue's declare on a channel of its own, up to DECLARE_CHANNELS at once:
    the most under way at one time is counted as they are sent."""
    pub = _publisher()
    most = 0
    real = queue_declare._queue_step

    def counting(spec: queue_declare.QueueSpec, *, passive: bool) -> queue_declare.Step:
        step = real(spec, passive=passive)

        def counted(channel: object, done: queue_declare.Done) -> None:
            nonlocal most
            most = max(most, len(pub.in_flight))
            step(channel, done)
        return counted

    monkeypatch.setattr(queue_declare, "_queue_step", counting)
    try:
        pub.declare(set(names))
        assert most > 1
        assert most <= queue_declare.DECLARE_CHANNELS
    finally:
        pub.close()


def test_a_budget_spent_leaves_the_rest_for_the_next_call(names: list[str]) -> None:
    pub = _publisher()
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

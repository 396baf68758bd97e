"""A new channel that answers nothing is replaced after MUTE_WAIT, not after the
confirm timeout (drain.broker.channels, ``ChannelKeepingLink.replace_mute``, called by
drain.daemon.confirms; issue 37).

On a RabbitMQ cluster, when the drain's own node was cut off and it went on through
another node, that node answered nothing on the drain's new channel for 17 s
(tests/rabbit_cluster shows it on three nodes); and a channel opened on that
connection meanwhile did not open either. Here, on one node, against the real
RabbitMQ, a cycle of the drain collects the confirms of a full window published
on a channel that has answered nothing yet:

* **a queue that answers nothing** (its Erlang process suspended): the channel
  is replaced after MUTE_WAIT on the same connection, its messages given up
  (their rows stay staged), the next mute channel given twice as long, and an
  ack brings it back to MUTE_WAIT;
* **a connection that answers nothing** (a proxy holds every reply back): the
  new channel does not open within MUTE_OPEN_WAIT, the connection is dropped
  at once, without a close handshake, and the next one publishes.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from drain.broker.batches import Batch, PublishResult
from drain.broker.channels import MUTE_OPEN_WAIT, MUTE_WAIT
from drain.broker.publisher import Publisher
from drain.celery import message
from drain.daemon.confirms import Confirms
from drain.daemon.metrics import Metrics
from drain.errors import BrokerUnavailable
from drain.postgres.rows import StagedRow
from drain.settings.config import Settings
from tests import support
from tests.integration.conftest import queue_process

BUILDER = message.Builder(origin="gen1@test", reply_to=str(uuid.uuid4()))
COUNT = 20
#: Far beyond what a test waits: only the mute channel's own bound can end a wait.
CONFIRM_TIMEOUT = 120.0


def _start(pub: Publisher, queue: str, first: int) -> Batch:
    rows = [StagedRow(i, uuid.uuid4(), "t.mute", "[]", "{}", queue)
            for i in range(first, first + COUNT)]
    return pub.start((BUILDER.build(r) for r in rows), queues={queue}, count=COUNT)


def _collect_full_window(pub: Publisher, queue: str) -> list[PublishResult]:
    """Publish two batches on the channel (a full window at pipeline 2) and collect
    their confirms as a drain cycle does until none is in flight."""
    settings = Settings(database_url="postgresql://unused", broker_url=support.BROKER_URL,
                        batch_size=COUNT, pipeline=2, confirm_timeout=CONFIRM_TIMEOUT)
    confirms = Confirms(settings, pub, Metrics())
    pending = [_start(pub, queue, 1), _start(pub, queue, 1 + COUNT)]
    assert pub.mute_limit(pending[0]) == MUTE_WAIT  # nothing answered on it yet
    results: list[PublishResult] = []
    deadline = time.monotonic() + 60
    while pending:
        assert time.monotonic() < deadline, "the cycles did not give the mute channel up"
        confirms.collect(pending, results, everything=False, timeout=None)
    return results


def _given_up(results: list[PublishResult]) -> None:
    """No message was confirmed, and none was given up by the confirm timeout."""
    assert [i for r in results for i in r.confirmed] == []
    assert not any("then none for" in str(r.error) for r in results), results


def _replaced_when_silent(pub: Publisher, queue: str, silence: Callable[[str], None],
                         caplog: pytest.LogCaptureFixture) -> Any:
    """Silence ``queue``, collect a full window on the publishing channel, and check
    that the channel was given up as mute and replaced on the same connection: the
    old channel."""
    silence(queue)
    mute = pub._channel  # our own class: which channel publishes
    with caplog.at_level(logging.WARNING, "drain.publisher"):
        results = _collect_full_window(pub, queue)
    _given_up(results)
    assert f"answered nothing on a new channel for {MUTE_WAIT:.1f}s" in caplog.text
    assert pub.connected and pub._channel is not mute
    return mute


def test_a_queue_that_answers_nothing_on_a_new_channel_costs_that_channel(
        queue: str, silence: Callable[[str], None], caplog: pytest.LogCaptureFixture) -> None:
    pub = support.publisher(support.BROKER_URL, confirm_timeout=CONFIRM_TIMEOUT)
    try:
        assert pub.declare({queue}) == {}
        mute = _replaced_when_silent(pub, queue, silence, caplog)
        assert mute.is_closed  # the same connection goes on, on a new channel
        batch = _start(pub, queue, 100)
        assert pub.mute_limit(batch) == 2 * MUTE_WAIT  # the next mute channel: longer
        queue_process(queue, "resume")
        result = pub.wait(batch)
        assert (len(result.confirmed), result.error) == (COUNT, None)
        assert pub.mute_limit(_start(pub, queue, 200)) is None  # it answered
        assert pub._mute_limit == MUTE_WAIT  # an ack: back to the first bound
    finally:
        pub.close()


def test_after_a_failover_a_new_channel_that_answered_then_fell_silent_is_mute(
        queue: str, silence: Callable[[str], None], caplog: pytest.LogCaptureFixture) -> None:
    """On a connection after the first (the drain failed over), a channel's first
    answers do not make it trusted: one that then answers nothing for MUTE_WAIT,
    before it has answered for that long, is replaced (drain.broker.channels,
    ``_settled``). On the first connection an answer is enough."""
    pub = support.publisher(support.BROKER_URL, confirm_timeout=CONFIRM_TIMEOUT)
    try:
        assert pub.declare({queue}) == {}
        assert len(pub.wait(_start(pub, queue, 1)).confirmed) == COUNT
        assert pub.mute_limit(_start(pub, queue, 1000)) is None  # first connection: trusted
        pub.connect()  # a new connection, as after a failover
        assert pub.declare({queue}) == {}
        assert len(pub.wait(_start(pub, queue, 2000)).confirmed) == COUNT
        _replaced_when_silent(pub, queue, silence, caplog)
    finally:
        pub.close()


def test_a_connection_that_answers_nothing_is_dropped_at_once(
        queue: str, proxy: support.TcpProxy, caplog: pytest.LogCaptureFixture) -> None:
    pub = support.publisher(support.broker_url(proxy.port), confirm_timeout=CONFIRM_TIMEOUT)
    try:
        assert pub.declare({queue}) == {}
        proxy.stall(new_connections=False, replies_only=True)
        with caplog.at_level(logging.WARNING, "drain.publisher"):
            results = _collect_full_window(pub, queue)
        _given_up(results)
        assert "answered nothing on a new channel" in caplog.text
        assert not pub.connected
        stuck = pub._conn  # our own class: the connection that answers nothing
        assert stuck is not None
        with pytest.raises(BrokerUnavailable, match=f"no new channel within {MUTE_OPEN_WAIT:g}s "
                                                    "after a mute one"):
            _start(pub, queue, 100)
        # Dropped without a close handshake, whose close-ok the proxy would hold back
        # too (a close waits up to 2 s for it, and leaves it closing); then a new
        # connection publishes.
        assert stuck.is_closed
        pub.connect()
        assert pub.declare({queue}) == {}
        result = pub.wait(_start(pub, queue, 100))
        assert (len(result.confirmed), result.error) == (COUNT, None)
    finally:
        proxy.resume()
        pub.close()

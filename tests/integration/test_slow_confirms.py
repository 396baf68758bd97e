"""A broker that confirms slowly is not a broker that stopped (drain.broker.publisher,
``Publisher.wait``): against the real RabbitMQ behind a slow link, a batch whose
confirms keep coming is kept past the confirm timeout, every message confirmed once;
a batch that gets no confirm for a whole confirm timeout is still given up; and a
drain cycle waits for room in its window only so long (drain.daemon.confirms)."""

from __future__ import annotations

import time
import uuid

from drain.broker.batches import PublishResult
from drain.broker.outgoing import Message
from drain.celery import message
from drain.daemon.confirms import Confirms
from drain.daemon.metrics import Metrics
from drain.postgres.rows import StagedRow
from drain.settings.config import Settings
from tests import support

BUILDER = message.Builder(origin="gen1@test", reply_to=str(uuid.uuid4()))
CONFIRM_TIMEOUT = 1.0
COUNT = 60
#: Each message about 2.5 KB on the wire: at 20 KB/s the batch reaches the broker over
#: ~7 s, a piece every 50 ms, so its confirms come over several confirm timeouts,
#: never far apart.
SIZE = 900
RATE = 20_000


def _batch(queue: str) -> list[Message]:
    return [BUILDER.build(StagedRow(i, uuid.uuid4(), "t.slow", f'["{"x" * SIZE}"]', "{}", queue))
            for i in range(1, COUNT + 1)]


def test_a_batch_whose_confirms_keep_coming_is_kept(
        queue: str, proxy: support.TcpProxy) -> None:
    pub = support.publisher(support.broker_url(proxy.port),
                            confirm_timeout=CONFIRM_TIMEOUT)
    progressed = []
    pub.on_progress = lambda: progressed.append(time.monotonic())
    try:
        assert pub.declare({queue}) == {}
        proxy.throttle(RATE)
        messages = _batch(queue)
        batch = pub.start(iter(messages), queues={queue}, count=COUNT)
        result = pub.wait(batch)
        assert result.error is None, result.error
        assert sorted(result.confirmed) == [m.row_id for m in messages]
        # The wait outlived the confirm timeout (the link is that slow), and said so.
        assert progressed, "the confirms came within one confirm timeout: slow the link down"
    finally:
        proxy.throttle(0)
        pub.close()
    delivered = support.drain_queue(queue, timeout=0.5)
    assert sorted(support.task_ids(delivered)) == sorted(m.task_id for m in messages)


def test_a_batch_without_a_confirm_for_a_whole_timeout_is_given_up(
        queue: str, proxy: support.TcpProxy) -> None:
    pub = support.publisher(support.broker_url(proxy.port),
                            confirm_timeout=CONFIRM_TIMEOUT)
    try:
        assert pub.declare({queue}) == {}
        proxy.stall()
        batch = pub.start(iter(_batch(queue)), queues={queue}, count=COUNT)
        result = pub.wait(batch)
        assert result.error is not None
        assert f"confirmed 0 of {COUNT} messages, then none for {CONFIRM_TIMEOUT:g}s" in str(
            result.error)
        assert result.confirmed == []
    finally:
        proxy.resume()
        pub.close()


def test_a_cycle_waits_for_room_in_the_window_at_most_its_budget(
        queue: str, proxy: support.TcpProxy) -> None:
    """A broker that confirms slowly but steadily: a cycle's wait for room in the
    window ends after COLLECT_BUDGET (here the confirm timeout, 2.5 s) with the window
    still full, and nothing given up, so that the batch transaction it runs in stays
    short (before, it waited for room inside one transaction as long as confirms
    came: at 10,000 queues, past the session's idle-in-transaction timeout). The
    confirm timeout is longer than the others' here: at the end of a stream the
    broker may hold its last confirm back ~1 s (its flush timer)."""
    timeout = 2.5
    pub = support.publisher(support.broker_url(proxy.port), confirm_timeout=timeout)
    settings = Settings(database_url="postgresql://unused", broker_url=support.BROKER_URL,
                        batch_size=COUNT, pipeline=2, confirm_timeout=timeout)
    confirms = Confirms(settings, pub, Metrics())
    try:
        assert pub.declare({queue}) == {}
        proxy.throttle(RATE)
        messages = _batch(queue)
        pending = [pub.start(iter(messages[:COUNT // 2]), queues={queue}, count=COUNT // 2),
                   pub.start(iter(messages[COUNT // 2:]), queues={queue}, count=COUNT // 2)]
        pending.append(pub.start(iter(_batch(queue)), queues={queue}, count=COUNT))
        results: list[PublishResult] = []
        confirms.collect(pending, results, everything=False, timeout=None)
        assert not confirms.room(pending), "the window had room within the budget: slow the link"
        assert all(r.error is None for r in results), [r.error for r in results]
        # The next cycles go on collecting (they fetch nothing meanwhile) until it has.
        cycles = 1
        while not confirms.room(pending):
            confirms.collect(pending, results, everything=False, timeout=None)
            cycles += 1
        results += [pub.wait(batch) for batch in pending]  # the rest: what was not reported
        assert cycles > 2
        assert [r.error for r in results if r.error] == []
        confirmed = sorted(i for r in results for i in r.confirmed)
        assert len(confirmed) == 2 * COUNT
    finally:
        proxy.throttle(0)
        pub.close()

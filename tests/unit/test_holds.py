"""What a pause is keyed by, and its backoff (drain.daemon.holds)."""

from __future__ import annotations

import logging
import uuid

import pytest

from drain.broker.outgoing import NOTHING_DECLARED, PauseKey
from drain.celery import message
from drain.celery.message import Destination
from drain.daemon import holds
from drain.postgres.rows import StagedRow

BUILDER = message.Builder(origin="gen1@test", reply_to=str(uuid.uuid4()))


def _message(destination: Destination | None, queue: str = "celery") -> PauseKey:
    row = StagedRow(1, uuid.uuid4(), "t.key", "[]", "{}", queue)
    return BUILDER.build(row, destination=destination).pause_key


def test_a_pause_is_keyed_by_the_declared_queue_or_the_exchange_and_routing_key() -> None:
    # Without --app: the row's queue, which is also the declared one.
    assert _message(None, "q") == PauseKey("q")
    # With --app: the declared queue, whatever the row was staged with.
    assert _message(Destination(exchange="", routing_key="full", queue="full")) == (
        PauseKey("full"))
    # Nothing declared: the exchange and routing key, one key per route.
    to_a = _message(Destination(exchange="a", routing_key="a.job", queue=NOTHING_DECLARED))
    to_b = _message(Destination(exchange="b", routing_key="b.job", queue=NOTHING_DECLARED))
    assert (to_a, to_b) == (PauseKey("", "a", "a.job"), PauseKey("", "b", "b.job"))
    assert (str(PauseKey("full")), str(to_a)) == (
        "queue 'full'", "exchange 'a' routing key 'a.job'")


def _run_out(held: holds.Holds, *keys: PauseKey) -> None:
    """As if the keys' pauses had run out: their rows are published again."""
    for key in keys:
        if key in held.paused:
            _until, times, reason = held.paused[key]
            held.paused[key] = (0.0, times, reason)


def test_a_confirm_resets_the_backoff_of_its_key_only() -> None:
    held = holds.Holds()
    full, other = PauseKey("full"), PauseKey("", "x", "k")
    for _ in range(3):
        held.hold(full, "nacked")
        held.hold(other, "refused")
        _run_out(held, full, other)
    held.resume({full})
    held.confirmed({full})
    held.hold(full, "nacked")
    held.hold(other, "refused")
    assert held.paused[full][1] == 1  # 1 s, as the first time
    assert held.paused[other][1] == 4  # 8 s: still growing
    assert held.held == {full: 1, other: 4}


def test_a_retry_publishes_again_at_once_then_backs_off_until_a_confirm(
        caplog: pytest.LogCaptureFixture) -> None:
    held = holds.Holds()
    key = PauseKey("q")
    with caplog.at_level(logging.WARNING, logger="drain.pipeline"):
        held.retry(key, "no exchange 'q'")
    assert held.paused == {} and held.held == {key: 1}
    assert "declaring queue 'q' again" in caplog.text
    held.retry(key, "no exchange 'q'")  # again before a confirm: paused 1 s
    _run_out(held, key)
    held.retry(key, "no exchange 'q'")  # and longer
    assert held.paused[key][1] == 2
    held.resume({key})
    held.confirmed({key})
    held.retry(key, "no exchange 'q'")
    assert held.paused == {} and held.held == {key: 1}


def test_answers_for_what_was_in_flight_before_a_pause_do_not_lengthen_it() -> None:
    """A queue that nacks a whole window at once (a quorum queue whose leader just
    died: issue 37) is paused once, for 1 s, not doubled per batch to 30 s."""
    held = holds.Holds()
    key = PauseKey("quorum")
    for _ in range(6):  # six batches in flight, each nacked
        held.hold(key, "nacked")
    assert held.paused[key][1] == 1 and held.held == {key: 1}
    _run_out(held, key)
    held.hold(key, "nacked")  # published again after the pause, nacked again
    assert held.paused[key][1] == 2 and held.held == {key: 2}


def test_rows_held_for_one_key_never_hold_back_another() -> None:
    held = holds.Holds()
    held.hold(PauseKey("full"), "nacked")
    held.rows.update({1: PauseKey("full"), 2: PauseKey("healthy")})
    assert held.held_rows() == [1]
    assert held.rows == {1: PauseKey("full")}  # a row whose key is not paused is forgotten

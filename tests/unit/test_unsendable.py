"""Rows the broker could never accept (drain.celery.unsendable), timestamps Python cannot
hold (drain.postgres.timestamps) and held queues said once (drain.daemon.holds)."""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid

import pytest

from drain.broker.outgoing import PauseKey
from drain.celery import unsendable
from drain.daemon import holds
from drain.limits import MAX_EXPIRES
from drain.postgres import timestamps
from drain.postgres.rows import StagedRow

NOW = time.time()


def _row(expires_at: dt.datetime | None, row_id: int = 1) -> StagedRow:
    return StagedRow(row_id, uuid.uuid4(), "t", "[]", "{}", "q", expires_at=expires_at)


def _at(delta: dt.timedelta) -> dt.datetime:
    return dt.datetime.fromtimestamp(NOW, dt.timezone.utc) + delta


def test_an_expiry_within_3650_days_is_sent() -> None:
    assert unsendable.problem(_row(None), NOW) is None
    assert unsendable.problem(_row(_at(MAX_EXPIRES - dt.timedelta(seconds=1))), NOW) is None
    assert unsendable.problem(_row(_at(-dt.timedelta(days=1))), NOW) is None  # 'expired' elsewhere


def test_an_expiry_beyond_3650_days_is_invalid_with_the_cause() -> None:
    row = _row(dt.datetime(2099, 1, 1, tzinfo=dt.timezone.utc))
    assert unsendable.problem(row, NOW) == (
        "expires_at 2099-01-01T00:00:00+00:00 is more than 3650 days ahead: RabbitMQ "
        "refuses a message expiration above 315360000000 ms")


@pytest.mark.parametrize("text", ["infinity", "10000-01-01 00:00:00+00"])
def test_an_unreadable_expiry_is_invalid_and_named(text: str) -> None:
    why = unsendable.problem(_row(timestamps.Unreadable(text)), NOW)
    assert why is not None and why.startswith(f"expires_at {text!r} cannot be read")


def test_screen_keeps_the_rest_of_the_batch() -> None:
    rows = [_row(None, 1), _row(timestamps.Unreadable("infinity"), 2), _row(None, 3)]
    doomed: list[tuple[int, str, str]] = []
    assert [r.id for r in unsendable.screen(rows, doomed, NOW)] == [1, 3]
    assert [(i, reason) for i, reason, _ in doomed] == [(2, "invalid")]


@pytest.mark.parametrize(("text", "bound"), [
    ("infinity", dt.datetime.max), ("12000-01-01 00:00:00+00", dt.datetime.max),
    ("-infinity", dt.datetime.min), ("0044-03-15 00:00:00+00 BC", dt.datetime.min),
])
def test_an_unreadable_timestamp_is_the_nearest_datetime_and_shows_its_text(
        text: str, bound: dt.datetime) -> None:
    value = timestamps.Unreadable(text)
    assert value == bound.replace(tzinfo=dt.timezone.utc)
    assert str(value) == text and timestamps.unreadable(value) == text
    assert timestamps.unreadable(bound) is None


CELERY = PauseKey("celery")


def test_a_cause_is_said_once_however_often_the_queue_is_paused(
        caplog: pytest.LogCaptureFixture) -> None:
    held = holds.Holds()
    with caplog.at_level(logging.WARNING, logger="drain.pipeline"):
        for _ in range(5):
            held.pause(CELERY, "broker refused to declare queue 'c': 406")
            held.resume({CELERY})
        held.pause(CELERY, "messages to queue 'u' came back unroutable")
    assert [r.getMessage().split(";")[0] for r in caplog.records] == [
        "broker refused to declare queue 'c': 406",
        "messages to queue 'u' came back unroutable"]


def test_rows_are_held_out_while_their_queue_is_paused() -> None:
    held = holds.Holds()
    held.pause(PauseKey("c"), "refused")
    held.rows.update({1: PauseKey("c"), 2: PauseKey("c")})
    assert sorted(held.held_rows()) == [1, 2]
    held.resume({PauseKey("c")})
    assert held.held_rows() == [] and held.rows == {}

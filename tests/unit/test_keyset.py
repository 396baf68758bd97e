"""The low-water marks' bookkeeping (drain.postgres.keyset), without a database."""

from __future__ import annotations

import pytest

from drain.postgres import keyset
from drain.postgres.keyset import ID_MIN, PRIORITY_ABOVE_MAX, PRIORITY_BELOW_MIN, START, Marks


def test_without_marks_one_open_range_covers_every_priority() -> None:
    plan = Marks().plan(0.0)
    assert plan == keyset.FROM_HEAD
    assert plan.priorities == [] and plan.marks == []
    assert list(zip(plan.gap_above, plan.gap_below, strict=True)) == [
        (PRIORITY_BELOW_MIN, PRIORITY_ABOVE_MAX)
    ]


def test_known_priorities_get_marks_and_the_ranges_between_them_stay_open() -> None:
    marks = Marks()
    marks.fetched([10, 0, 1, -32768, 32767], now=0.0)
    plan = marks.current()
    assert plan.priorities == [32767, 10, 1, 0, -32768]
    assert plan.marks == [START] * 5
    # Between 1 and 0 there is no smallint, so no range; 32767 and -32768 close the ends.
    assert list(zip(plan.gap_above, plan.gap_below, strict=True)) == [
        (10, 32767), (1, 10), (-32768, 0)
    ]


def test_a_mark_stops_at_the_oldest_running_transaction() -> None:
    marks = Marks()
    marks.fetched([0], now=0.0)
    # The smallest staged row of priority 0 is (xact 90, id 7); xid 50 is still
    # running and may yet commit a row: the mark stops below anything xid 50 writes.
    marks.observe({0: (90, 7)}, xmin=50)
    marks.commit()
    assert marks.marks() == {0: (50, ID_MIN)}
    # xid 50 and everything below 95 ended: the mark moves to the head row itself.
    marks.observe({0: (90, 7)}, xmin=95)
    marks.commit()
    assert marks.marks() == {0: (90, 7)}


def test_a_mark_never_passes_a_staged_row_whatever_its_id() -> None:
    marks = Marks()
    marks.fetched([0], now=0.0)
    # A row with a huge explicit id, then one with a negative id in a later
    # transaction: ids do not order anything, the transactions do.
    marks.observe({0: (100, 10**12)}, xmin=200)
    marks.commit()
    assert marks.marks() == {0: (100, 10**12)}
    marks.observe({0: (150, -5)}, xmin=200)
    marks.commit()
    assert marks.marks() == {0: (150, -5)}


def test_with_no_row_left_the_mark_is_the_oldest_running_transaction() -> None:
    marks = Marks()
    marks.fetched([5], now=0.0)
    marks.observe({5: None}, xmin=12)
    marks.commit()
    assert marks.marks() == {5: (12, ID_MIN)}


def test_a_mark_never_moves_back() -> None:
    marks = Marks()
    marks.fetched([0], now=0.0)
    marks.observe({0: None}, xmin=40)
    marks.commit()
    marks.observe({0: (30, 1)}, xmin=35)  # an older look, answered late
    marks.commit()
    assert marks.marks() == {0: (40, ID_MIN)}


def test_a_rescan_puts_every_mark_back_to_the_start() -> None:
    marks = Marks(rescan_interval=60.0)
    marks.plan(0.0)
    marks.fetched([0], now=0.0)
    marks.observe({0: (11, 3)}, xmin=20)
    marks.commit()
    assert marks.plan(59.0).marks == [(11, 3)]
    assert marks.plan(60.0).marks == [START]
    assert marks.rescans == 1


def test_a_rescan_interval_of_zero_never_rescans() -> None:
    marks = Marks(rescan_interval=0.0)
    marks.plan(0.0)
    marks.fetched([0], now=0.0)
    marks.observe({0: (11, 3)}, xmin=20)
    marks.commit()
    assert marks.plan(10.0**9).marks == [(11, 3)]
    assert marks.rescans == 0


def test_disabled_marks_never_record_anything() -> None:
    marks = Marks(enabled=False)
    marks.fetched([0], now=0.0)
    marks.observe({0: (11, 1)}, xmin=5)
    marks.commit()
    assert marks.marks() == {}


def test_only_the_most_recently_seen_priorities_keep_marks() -> None:
    marks = Marks()
    for p in range(keyset.MAX_KNOWN + 5):
        marks.fetched([p], now=float(p))
    kept = marks.marks()
    assert len(kept) == keyset.MAX_KNOWN
    assert min(kept) == 5, "the priorities seen longest ago are dropped first"


def test_a_skipped_queue_that_is_no_longer_paused_sends_every_mark_back() -> None:
    marks = Marks(rescan_interval=0)
    marks.fetched([0, 5], now=0.0)
    marks.paused(["a", "b"])
    marks.observe({0: (50, 7), 5: None}, xmin=90, skipped=["a", "b"])
    marks.commit()
    assert marks.skipping == {"a", "b"} and marks.marks() == {0: (50, 7), 5: (90, ID_MIN)}
    marks.paused(["b", "a", "c"])  # still paused (more now): the marks stand
    assert marks.marks() == {0: (50, 7), 5: (90, ID_MIN)}
    marks.paused(["b"])  # "a" runs again: its rows lie somewhere behind the marks
    assert marks.marks() == {0: START, 5: START} and marks.skipping == frozenset()
    assert marks.rescans == 0


def test_a_look_without_paused_queues_skips_nothing() -> None:
    marks = Marks(rescan_interval=0)
    marks.fetched([0], now=0.0)
    marks.observe({0: (50, 7)}, xmin=90)
    marks.commit()
    marks.paused([])
    assert marks.skipping == frozenset() and marks.marks() == {0: (50, 7)}


def test_the_delayed_and_expiring_marks_follow_each_look_and_reset_with_the_rest() -> None:
    marks = Marks(rescan_interval=0)
    plan = marks.current()
    assert (plan.delayed_from, plan.expiring_from, plan.timed_xact) == keyset.TIMED_START
    marks.observe_timed("2026-11-23 10:00:00+00", None, xmin=700)
    marks.commit()
    plan = marks.current()
    assert (plan.delayed_from, plan.expiring_from, plan.timed_xact) == (
        "2026-11-23 10:00:00+00", "infinity", 700)
    # A late row below the mark: the next look may move it down.
    marks.observe_timed("2026-11-23 09:00:00+00", "2026-11-23 12:00:00+00", xmin=705)
    marks.commit()
    assert marks.current().delayed_from == "2026-11-23 09:00:00+00"
    marks.reset()
    plan = marks.current()
    assert (plan.delayed_from, plan.expiring_from, plan.timed_xact) == keyset.TIMED_START


def test_disabled_marks_read_delayed_and_expiring_rows_from_the_start() -> None:
    marks = Marks(enabled=False)
    marks.observe_timed("2026-11-23 10:00:00+00", "2026-11-23 10:00:00+00", xmin=700)
    marks.commit()
    plan = marks.plan(0.0)
    assert (plan.delayed_from, plan.expiring_from, plan.timed_xact) == keyset.TIMED_START


def test_a_look_moves_the_marks_only_once_its_batch_committed() -> None:
    """A batch that expired rows no longer sees them: should it roll back, they
    are staged again and the marks must not have passed them (issue 24, item 4)."""
    marks = Marks(rescan_interval=0)
    marks.fetched([0], now=0.0)
    with marks.transaction():
        marks.observe({0: (50, 7)}, xmin=90)
        marks.observe_timed("2026-11-23 10:00:00+00", None, xmin=90)
        # Not yet: the batch has not committed.
        assert marks.marks() == {0: START}
        assert marks.current().expiring_from == "-infinity"
    assert marks.marks() == {0: (50, 7)}
    assert marks.current().expiring_from == "infinity"


def test_a_rolled_back_batch_leaves_the_marks_where_they_were() -> None:
    marks = Marks(rescan_interval=0)
    marks.fetched([0], now=0.0)
    marks.observe({0: (20, 1)}, xmin=30)
    marks.commit()
    before = marks.current()
    with pytest.raises(RuntimeError), marks.transaction():
        marks.observe({0: None}, xmin=500, skipped=["paused"])
        marks.observe_timed("infinity", "infinity", xmin=500)
        raise RuntimeError("serialization failure")
    assert marks.current() == before and marks.skipping == frozenset()
    # A later batch that commits starts from a clean slate: nothing of the dropped look.
    with marks.transaction():
        marks.observe({0: (25, 2)}, xmin=40)
    assert marks.marks() == {0: (25, 2)}
    assert marks.current().expiring_from == "-infinity"


def test_a_reset_during_a_batch_drops_its_looks() -> None:
    marks = Marks(rescan_interval=0)
    marks.fetched([0], now=0.0)
    with marks.transaction():
        marks.observe({0: (50, 7)}, xmin=90)
        marks.reset()
    assert marks.marks() == {0: START}

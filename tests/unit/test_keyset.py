"""The low-water marks' bookkeeping (drain.keyset), without a database."""

from __future__ import annotations

from drain import keyset
from drain.keyset import PRIORITY_ABOVE_MAX, PRIORITY_BELOW_MIN, Marks


def test_without_marks_one_open_range_covers_every_priority() -> None:
    plan = Marks().plan(0.0)
    assert plan == keyset.FROM_HEAD
    assert plan.priorities == [] and plan.marks == []
    assert list(zip(plan.gap_above, plan.gap_below, strict=True)) == [
        (PRIORITY_BELOW_MIN, PRIORITY_ABOVE_MAX)
    ]


def test_known_priorities_get_marks_and_the_ranges_between_them_stay_open() -> None:
    marks = Marks()
    marks.fetched([(10, 5), (0, 7), (1, 9), (-32768, 11), (32767, 12)], now=0.0)
    plan = marks.current()
    assert plan.priorities == [32767, 10, 1, 0, -32768]
    assert plan.marks == [0, 0, 0, 0, 0]
    # Between 1 and 0 there is no smallint, so no range; 32767 and -32768 close the ends.
    assert list(zip(plan.gap_above, plan.gap_below, strict=True)) == [
        (10, 32767), (1, 10), (-32768, 0)
    ]


def test_a_mark_moves_only_once_every_transaction_older_than_its_candidate_ended() -> None:
    marks = Marks(grace=1.0)
    marks.fetched([(0, 100)], now=0.0)
    # Snapshot 1 (t=0): smallest staged id of priority 0 is 101; xids 50..59 running.
    marks.observe({0: 101}, xmin=50, xmax=60, now=0.0)
    # Within the grace period nothing moves, whatever xmin does.
    marks.observe({0: 150}, xmin=1000, xmax=1001, now=0.5)
    assert marks.marks() == {0: 0}
    # t=1.2: the candidate of t=0 now waits for xid 70 (this snapshot's xmax).
    marks.observe({0: 180}, xmin=55, xmax=70, now=1.2)
    assert marks.marks() == {0: 0}
    marks.observe({0: 190}, xmin=69, xmax=75, now=1.3)
    assert marks.marks() == {0: 0}, "xid 69 may still commit a row below 101"
    # xid 69 ended; its late row 95 is visible now: the mark must not pass it.
    marks.observe({0: 95}, xmin=70, xmax=75, now=1.4)
    assert marks.marks() == {0: 95}


def test_a_mark_moves_to_the_old_candidate_when_nothing_committed_late() -> None:
    marks = Marks(grace=1.0)
    marks.fetched([(0, 100)], now=0.0)
    marks.observe({0: 101}, xmin=50, xmax=60, now=0.0)
    marks.observe({0: 300}, xmin=55, xmax=70, now=1.0)
    marks.observe({0: 300}, xmin=70, xmax=80, now=1.1)
    assert marks.marks() == {0: 101}


def test_with_no_row_left_the_candidate_is_past_the_last_fetched_id() -> None:
    marks = Marks(grace=0.0)
    marks.fetched([(5, 40), (5, 41)], now=0.0)
    marks.observe({5: None}, xmin=10, xmax=11, now=0.0)
    marks.observe({5: None}, xmin=11, xmax=12, now=0.1)
    marks.observe({5: None}, xmin=12, xmax=13, now=0.2)
    assert marks.marks() == {5: 42}


def test_a_rescan_puts_every_mark_back_to_the_start() -> None:
    marks = Marks(grace=0.0, rescan_interval=60.0)
    marks.plan(0.0)
    marks.fetched([(0, 10)], now=0.0)
    marks.observe({0: 11}, xmin=1, xmax=2, now=0.0)
    marks.observe({0: 11}, xmin=2, xmax=3, now=0.1)
    marks.observe({0: 11}, xmin=3, xmax=4, now=0.2)
    assert marks.plan(59.0).marks == [11]
    assert marks.plan(60.0).marks == [0]
    assert marks.rescans == 1


def test_disabled_marks_never_record_anything() -> None:
    marks = Marks(enabled=False)
    marks.fetched([(0, 10)], now=0.0)
    marks.observe({0: 11}, xmin=5, xmax=6, now=9.0)
    assert marks.marks() == {}


def test_only_the_most_recently_seen_priorities_keep_marks() -> None:
    marks = Marks()
    for p in range(keyset.MAX_KNOWN + 5):
        marks.fetched([(p, p + 1)], now=float(p))
    kept = marks.marks()
    assert len(kept) == keyset.MAX_KNOWN
    assert min(kept) == 5, "the priorities seen longest ago are dropped first"

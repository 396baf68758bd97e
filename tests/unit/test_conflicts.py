"""Rows that change under the drain (drain.postgres.conflicts), without a database."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from drain.postgres import conflicts
from drain.postgres.conflicts import Cooling, isolate


class Conflict(Exception):
    pass


Attempt = Callable[[Sequence[tuple[int, str]]], list[int]]


def _statement(hot: set[int], gone: frozenset[int] = frozenset()
               ) -> tuple[list[list[int]], Attempt]:
    """A keyed statement that fails while it holds a ``hot`` row, and skips ``gone`` rows."""
    calls: list[list[int]] = []

    def attempt(group: Sequence[tuple[int, str]]) -> list[int]:
        ids = [row_id for row_id, _ in group]
        calls.append(ids)
        if hot & set(ids):
            raise Conflict
        return [row_id for row_id in ids if row_id not in gone]

    return calls, attempt


def _isolate(keys: list[tuple[int, str]], attempt: Attempt) -> conflicts.Settled:
    return isolate(keys, attempt, conflict=lambda e: isinstance(e, Conflict),
                   key_id=lambda k: k[0])


def test_without_a_conflict_the_whole_batch_is_one_statement() -> None:
    calls, attempt = _statement(set())
    settled = _isolate([(i, "x") for i in range(100)], attempt)
    assert sorted(settled.done) == list(range(100)) and settled.left == []
    assert len(calls) == 1


def test_one_hot_row_costs_that_row_and_a_few_statements() -> None:
    """A conflict on one row must cost that row, not its batch (issue 24, item 5)."""
    calls, attempt = _statement({37})
    settled = _isolate([(i, "x") for i in range(1000)], attempt)
    assert sorted(settled.done) == [i for i in range(1000) if i != 37]
    assert settled.left == [37]
    assert len(calls) <= 2 * 10 + 1  # about 2·log2(1000)


def test_rows_the_statement_skipped_are_left_too() -> None:
    """Changed before the snapshot (xact differs) or locked now: skipped, not failed."""
    _, attempt = _statement({3}, gone=frozenset({5, 8}))
    settled = _isolate([(i, "x") for i in range(10)], attempt)
    assert sorted(settled.left) == [3, 5, 8]
    assert sorted(settled.done) == [0, 1, 2, 4, 6, 7, 9]


def test_anything_but_a_conflict_propagates() -> None:
    def attempt(_group: Sequence[tuple[int, str]]) -> list[int]:
        raise ValueError("connection lost")

    with pytest.raises(ValueError, match="connection lost"):
        _isolate([(1, "x")], attempt)


def test_nothing_to_do_runs_nothing() -> None:
    calls, attempt = _statement(set())
    assert _isolate([], attempt) == conflicts.Settled()
    assert calls == []


def test_a_hot_row_is_held_out_longer_each_time_up_to_the_most() -> None:
    cooling = Cooling()
    assert cooling.struck([7], now=0.0) == [7]  # new: worth a log line
    assert cooling.held(0.05) == [7] and cooling.held(0.11) == []
    holds = []
    now = 0.2
    for _ in range(10):
        assert cooling.struck([7], now) == []  # not new any more
        until = now
        while cooling.held(until):
            until += 0.01
        holds.append(round(until - now, 1))
        now = until
    assert holds[:3] == [0.2, 0.4, 0.8]
    assert max(holds) == conflicts.MOST_HOLD


def test_a_row_gone_or_quiet_is_forgotten() -> None:
    cooling = Cooling()
    cooling.struck([1, 2], now=0.0)
    cooling.settled([1])
    assert cooling.held(0.0) == [2]
    assert cooling.held(conflicts.FIRST_HOLD + conflicts.FORGET_AFTER + 1) == []
    assert len(cooling) == 0
    assert cooling.struck([2], now=100.0) == [2], "a fresh start"


class LockWait(Exception):
    pass


def _locking(locked: set[int], table: bool = False
             ) -> tuple[list[list[int]], list[list[int]], Attempt, Callable[..., set[int]]]:
    """A keyed statement that times out on a lock while it holds a ``locked`` row (any
    row, with a ``table`` lock), and the query that names the rows locked now."""
    calls: list[list[int]] = []
    sorts: list[list[int]] = []

    def attempt(group: Sequence[tuple[int, str]]) -> list[int]:
        ids = [row_id for row_id, _ in group]
        calls.append(ids)
        if table or locked & set(ids):
            raise LockWait
        return ids

    def locked_now(group: Sequence[tuple[int, str]]) -> set[int]:
        ids = [row_id for row_id, _ in group]
        sorts.append(ids)
        return set(ids) if table else locked & set(ids)

    return calls, sorts, attempt, locked_now


def _isolate_locks(keys: list[tuple[int, str]], attempt: Attempt,
                   locked_now: Callable[..., set[int]] | None,
                   suspects: frozenset[int] = frozenset()) -> conflicts.Settled:
    return isolate(keys, attempt, conflict=lambda e: isinstance(e, (Conflict, LockWait)),
                   key_id=lambda k: k[0], locked=lambda e: isinstance(e, LockWait),
                   locked_now=locked_now, suspects=suspects, key_version=lambda k: 7)


def test_locked_rows_are_pending_not_changed_and_cost_three_statements() -> None:
    """300 rows of 1,000 locked: one wait, one sorting query, one delete of the rest
    (before: 2n-1 statements with a lock wait each, the rows counted as changed)."""
    locked = set(range(0, 1000, 3)) - {999}
    calls, sorts, attempt, locked_now = _locking(locked)
    settled = _isolate_locks([(i, "x") for i in range(1000)], attempt, locked_now)
    assert settled.left == []
    assert settled.pending == {i: 7 for i in locked}
    assert sorted(settled.done) == sorted(set(range(1000)) - locked)
    assert len(calls) == 2 and len(sorts) == 1


def test_a_table_lock_makes_every_row_pending_at_once() -> None:
    calls, sorts, attempt, locked_now = _locking(set(), table=True)
    settled = _isolate_locks([(i, "x") for i in range(300)], attempt, locked_now)
    assert settled.done == [] and settled.left == []
    assert sorted(settled.pending) == list(range(300))
    assert len(calls) == 1 and len(sorts) == 1


def test_pending_rows_are_sorted_before_they_are_tried_again() -> None:
    """Rows pending from an earlier cycle cost no wait while they stay locked."""
    calls, sorts, attempt, locked_now = _locking({1, 2})
    settled = _isolate_locks([(i, "x") for i in range(10)], attempt, locked_now,
                             suspects=frozenset({1, 2, 3}))
    assert sorted(settled.pending) == [1, 2]
    assert sorted(settled.done) == [0, *range(3, 10)]
    assert calls == [[0, *range(3, 10)]] and sorts == [[1, 2, 3]]


def test_a_lock_the_query_cannot_see_is_halved_and_still_pending() -> None:
    """A multixact's lock, or one taken just after the query: halved, never changed."""
    calls, _, attempt, _ = _locking({37})
    settled = _isolate_locks([(i, "x") for i in range(100)], attempt, lambda _group: set())
    assert settled.pending == {37: 7} and settled.left == []
    assert len(settled.done) == 99
    assert len(calls) <= 2 * 7 + 1

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

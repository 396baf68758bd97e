"""drain.daemon.piles.HeldKeys.held_out: the held rows the marks passed are set aside,
so a cycle looks only at the rows held since, and come back when a mark goes back."""

from __future__ import annotations

import uuid

from drain.broker.outgoing import PauseKey
from drain.daemon.holds import Holds
from drain.daemon.piles import HeldKeys
from drain.postgres import keyset
from drain.postgres.keyset import FetchPlan
from drain.postgres.rows import StagedRow

KEY = PauseKey("refused")
XACT = 7


def _marked(row_id: int) -> FetchPlan:
    """Priority 0 marked at row ``row_id`` (rows below it were passed)."""
    return FetchPlan([0], [(XACT, row_id)], [0], [keyset.PRIORITY_ABOVE_MAX])


def _held(ids: range) -> tuple[Holds, HeldKeys]:
    holds, piles = Holds(), HeldKeys()
    holds.pause(KEY, "refused")
    for row_id in ids:
        _hold(holds, piles, row_id)
    return holds, piles


def _hold(holds: Holds, piles: HeldKeys, row_id: int) -> None:
    row = StagedRow(row_id, uuid.uuid4(), "t", "[]", "{}", "celery", xact=XACT)
    holds.rows[row_id] = KEY  # as the pipeline holds it
    piles.hold(row, KEY)


def test_rows_the_marks_passed_are_set_aside_and_not_looked_at_again() -> None:
    holds, piles = _held(range(1, 6))
    assert piles.held_out(holds, _marked(3)) == [3, 4, 5]
    assert set(piles.passed) == {1, 2}
    assert set(holds.rows) == {3, 4, 5}
    _hold(holds, piles, 6)
    assert piles.held_out(holds, _marked(5)) == [5, 6]
    assert set(piles.passed) == {1, 2, 3, 4}


def test_a_mark_that_goes_back_brings_them_back() -> None:
    holds, piles = _held(range(1, 6))
    piles.held_out(holds, _marked(4))
    assert piles.held_out(holds, keyset.FROM_HEAD) == [4, 5, 1, 2, 3]
    assert not piles.passed
    assert set(holds.rows) == {1, 2, 3, 4, 5}


def test_a_resumed_key_drops_them() -> None:
    holds, piles = _held(range(1, 6))
    piles.held_out(holds, _marked(4))
    holds.resume({KEY})
    assert piles.held_out(holds, keyset.FROM_HEAD) == []
    assert not piles.passed
    assert not holds.rows

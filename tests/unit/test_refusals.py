"""Many queues refused alike are one warning, however the refusals arrive
(drain.daemon.piles.Refusals): all at once, or one declare call at a time, as a
busy machine's declares come back within a batch's budget."""

from __future__ import annotations

import logging

import pytest

from drain.broker.outgoing import PauseKey
from drain.daemon.holds import Holds
from drain.daemon.piles import Refusals

REPLY = "406 PRECONDITION_FAILED - inequivalent arg 'x-max-length'"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _refusals() -> tuple[Holds, Refusals]:
    holds = Holds()
    return holds, Refusals(holds, lambda queue, reply: f"queue {queue!r} refused: {reply}")


@pytest.mark.parametrize("per_call", [200, 1, 2], ids=["at-once", "one-by-one", "two-by-two"])
def test_many_queues_refused_alike_are_one_warning(
        per_call: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="drain")
    holds, refusals = _refusals()
    names = [f"q{i:03}" for i in range(200)]
    for start in range(0, len(names), per_call):
        refusals.pause(dict.fromkeys(names[start:start + per_call], REPLY))
    said = _warnings(caplog)
    # One queue refused on its own is said on its own; from the second one
    # refused alike, they are one cause, said once (before: one warning per
    # declare call that came back with a single refusal).
    grouped = [text for text in said if "refused to declare" in text and "queues (406)" in text]
    assert len(grouped) == 1, said
    assert len(said) == (1 if per_call > 1 else 2), said
    if per_call == 1:
        assert "2 queues (406): 'q000', 'q001'" in grouped[0]
    assert all(PauseKey(name) in holds.paused for name in names)
    # Refused again, each stays under its cause: no new warning.
    refusals.pause(dict.fromkeys(names, REPLY))
    assert len(_warnings(caplog)) == len(said)


def test_one_queue_refused_again_and_again_is_its_own_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="drain")
    holds, refusals = _refusals()
    for _ in range(3):
        refusals.pause({"only": REPLY})
    said = _warnings(caplog)
    assert len(said) == 1 and "'only'" in said[0] and "queues (" not in said[0], said
    assert holds.paused[PauseKey("only")][1] == 3

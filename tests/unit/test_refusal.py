"""What becomes of a message the broker refuses (drain.broker.refusal.verdict)."""

from __future__ import annotations

import pytest

from drain.broker.refusal import verdict


@pytest.mark.parametrize(("code", "redeclare", "expected"), [
    (404, False, "dead"),    # no exchange 'x': a route to an exchange nobody declares
    (404, True, "retry"),    # an exchange the drain declares, deleted behind its back
    (406, False, "dead"),    # over max_message_size, or another precondition of the message
    (406, True, "dead"),     # declaring again cures nothing but a 404
    (403, False, "hold"),    # the drain's permission, not the row's
    (403, True, "hold"),
    (530, False, "hold"),    # anything else: held, never dead-lettered on a guess
])
def test_verdict(code: int, redeclare: bool, expected: str) -> None:
    assert verdict(code, redeclare=redeclare) == expected

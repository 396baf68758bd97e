"""drain.daemon.watchdog.stuck_after: when /healthz and the watchdog call the loop stuck."""

from __future__ import annotations

import dataclasses

import pytest

from drain.daemon.watchdog import ANSWER_GRACE, answer_bound, stuck_after
from drain.settings.config import Settings

BASE = Settings(database_url="postgresql://drain@127.0.0.1/drain")


def test_by_default_a_confirm_wait_and_the_statement_timeout() -> None:
    assert stuck_after(BASE) == BASE.confirm_timeout + 30 + ANSWER_GRACE


def test_a_command_is_given_up_past_the_statement_timeout() -> None:
    assert answer_bound(BASE) == 30 + ANSWER_GRACE
    assert answer_bound(dataclasses.replace(BASE, db_timeout=2.0)) == 2 + ANSWER_GRACE
    assert stuck_after(dataclasses.replace(BASE, db_timeout=2.0)) == 30 + 2 + ANSWER_GRACE


@pytest.mark.parametrize("field", ["poll_interval", "standby_interval", "max_backoff",
                                   "confirm_timeout"])
def test_a_long_configured_wait_is_not_a_stuck_loop(field: str) -> None:
    # A drain polling every 2 minutes waits that long between turns when idle: a
    # liveness probe must not restart it for that.
    settings = dataclasses.replace(BASE, **{field: 120.0})  # type: ignore[arg-type]
    assert stuck_after(settings) == 150 + ANSWER_GRACE

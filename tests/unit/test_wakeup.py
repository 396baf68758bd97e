"""drain.postgres.wakeup's decisions, against a scripted wake lock (the queries are
tested against Postgres in tests/integration/test_wakeup.py)."""

from __future__ import annotations

from drain.postgres.wakeup import ARM_AFTER, BUSY_RETRY, FILL_RATE, FIRST_RETRY, MAX_RETRY, Wakeup

POLL = 5.0


class ScriptedLock:
    """A wake flag whose arm() answers come from a script; records every call."""

    def __init__(self, arms: list[bool], elsewhere: bool = False) -> None:
        self.armed = False
        self._arms = arms
        self._elsewhere = elsewhere
        self.calls: list[str] = []

    def arm(self, *, announce: bool) -> bool:
        self.calls.append(f"arm{'+announce' if announce else ''}")
        self.armed = self._arms.pop(0)
        return self.armed

    def disarm(self, *, announce: bool) -> None:
        self.calls.append(f"disarm{'+announce' if announce else ''}")
        self.armed = False

    def armed_elsewhere(self) -> bool:
        self.calls.append("elsewhere")
        return self._elsewhere


def _looks_before_arming(wakeup: Wakeup) -> list[float]:
    """The pauses after the empty looks that do not try to arm yet."""
    return [wakeup.pause(0, POLL) for _ in range(ARM_AFTER - 1)]


def test_an_idle_drain_looks_a_few_times_then_arms_and_looks_once_more() -> None:
    lock = ScriptedLock([True])
    wakeup = Wakeup(lock, lanes=1)
    assert _looks_before_arming(wakeup) == [FIRST_RETRY * 2**i for i in range(ARM_AFTER - 1)]
    assert lock.calls == []  # pg_locks is not read after every empty look
    assert wakeup.pause(0, POLL) == 0.0  # armed: one more look, at once
    assert wakeup.pause(0, POLL) == POLL  # that look found nothing: sleep
    assert wakeup.pause(0, POLL) == POLL  # a wake-up that found nothing: still armed
    assert lock.calls == ["arm"]


def test_a_look_that_finds_work_starts_the_count_again() -> None:
    lock = ScriptedLock([True])
    wakeup = Wakeup(lock, lanes=1)
    _looks_before_arming(wakeup)
    assert wakeup.pause(1, POLL) == FIRST_RETRY
    assert wakeup.pause(0, POLL) == FIRST_RETRY  # the backoff starts over too
    assert lock.calls == []


def test_an_armed_drain_disarms_when_woken_and_does_not_arm_while_work_comes() -> None:
    lock = ScriptedLock([True, True])
    wakeup = Wakeup(lock, lanes=1)
    _looks_before_arming(wakeup)
    wakeup.pause(0, POLL)
    wakeup.busy()  # a NOTIFY: writers go silent before the cycle starts
    assert not lock.armed
    assert wakeup.pause(3, POLL) == FIRST_RETRY  # found work: look again, unarmed
    _looks_before_arming(wakeup)
    assert wakeup.pause(0, POLL) == 0.0  # found nothing: arm, one more look
    assert lock.calls == ["arm", "disarm", "arm"]


def test_a_poll_that_finds_work_disarms() -> None:
    lock = ScriptedLock([True])
    wakeup = Wakeup(lock, lanes=1)
    _looks_before_arming(wakeup)
    wakeup.pause(0, POLL)
    assert wakeup.pause(2, POLL) == FIRST_RETRY  # e.g. a delayed row came due
    assert lock.calls == ["arm", "disarm"] and not lock.armed


def test_an_open_writer_makes_the_drain_look_again_soon_not_sleep() -> None:
    lock = ScriptedLock([False] * 12 + [True])
    wakeup = Wakeup(lock, lanes=1)
    pauses = _looks_before_arming(wakeup) + [wakeup.pause(0, POLL) for _ in range(12)]
    assert pauses[0] == FIRST_RETRY
    assert pauses == sorted(pauses) and pauses[-1] == MAX_RETRY  # backs off, bounded
    assert wakeup.pause(0, POLL) == 0.0  # armed at last: one more look
    assert wakeup.pause(0, POLL) == POLL
    assert "elsewhere" not in lock.calls  # one lane: nobody else could be armed


def test_lanes_announce_and_sleep_on_another_lanes_sentinel() -> None:
    lock = ScriptedLock([False], elsewhere=True)
    wakeup = Wakeup(lock, lanes=2)
    _looks_before_arming(wakeup)
    assert wakeup.pause(0, POLL) == POLL
    assert lock.calls == ["arm+announce", "elsewhere"]

    lock = ScriptedLock([True, False], elsewhere=False)
    wakeup = Wakeup(lock, lanes=4)
    _looks_before_arming(wakeup)
    wakeup.pause(0, POLL)
    wakeup.busy()
    retry = wakeup.pause(0, POLL)  # the count of empty looks went on while armed
    assert lock.calls == ["arm+announce", "disarm+announce", "arm+announce", "elsewhere"]
    assert retry == FIRST_RETRY  # an open writer, no sentinel


def test_under_heavy_staging_the_pause_lets_a_batch_fill() -> None:
    lock = ScriptedLock([])
    wakeup = Wakeup(lock, lanes=1)
    assert wakeup.pause(3, POLL) == FIRST_RETRY  # a few rows: look again within 1 ms
    assert wakeup.pause(50, POLL) == 50 / FILL_RATE  # more rows, a longer pause
    assert wakeup.pause(900, POLL) == BUSY_RETRY  # never more than BUSY_RETRY
    assert lock.calls == []  # while work comes in, the drain never arms

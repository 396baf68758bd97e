"""drain.postgres.command_watch.Watch: the broker is served while a command waits, and
never while the loop's thread could be using it."""

from __future__ import annotations

import threading
import time

from drain.postgres.command_watch import SERVE_EVERY, Watch


def test_a_command_that_waits_is_served_and_a_quick_one_is_not() -> None:
    served: list[float] = []
    watch = Watch(lambda: served.append(time.monotonic()))
    try:
        with watch.command():
            pass  # answers at once
        time.sleep(2 * SERVE_EVERY)
        assert served == []
        started = time.monotonic()
        with watch.command():
            time.sleep(5 * SERVE_EVERY)
        ended = time.monotonic()
        assert 2 <= len(served) <= 5, served
        assert all(started + SERVE_EVERY <= t <= ended for t in served)
        count = len(served)
        time.sleep(2 * SERVE_EVERY)
        assert len(served) == count  # none once the command ended
    finally:
        watch.stop()


def test_serve_never_runs_outside_a_command_and_a_command_waits_for_it() -> None:
    """The loop's thread leaves a command only once a serve() in progress returned."""
    inside = threading.Event()
    overlaps: list[str] = []

    def serve() -> None:
        if not inside.is_set():
            overlaps.append("served outside a command")
        time.sleep(SERVE_EVERY / 2)  # a slow turn of the broker's loop
        if not inside.is_set():
            overlaps.append("the command ended during serve()")

    watch = Watch(serve)
    try:
        deadline = time.monotonic() + 8 * SERVE_EVERY
        while time.monotonic() < deadline:
            with watch.command():
                inside.set()
                time.sleep(1.3 * SERVE_EVERY)
            # Still under the lock's protection until command() returned: clear after.
            inside.clear()
            time.sleep(0.01)
        assert overlaps == []
    finally:
        watch.stop()


def test_the_thread_ends_with_stop() -> None:
    watch = Watch(lambda: None)
    assert any(t.name == "drain-command-watch" for t in threading.enumerate())
    watch.stop()
    assert not watch._thread.is_alive()


def test_a_serve_that_raises_does_not_end_the_watch() -> None:
    calls: list[int] = []

    def serve() -> None:
        calls.append(1)
        raise RuntimeError("boom")

    watch = Watch(serve)
    try:
        with watch.command():
            time.sleep(4 * SERVE_EVERY)
        assert len(calls) >= 2
    finally:
        watch.stop()

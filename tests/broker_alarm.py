"""A real RabbitMQ memory alarm for tests, always cleared afterwards.

``rabbitmqctl set_vm_memory_high_watermark`` to a tiny fraction makes the broker
raise its memory alarm at once: it blocks every connection that publishes
(``connection.blocked``) until the watermark is raised again. The alarm is
broker-wide, so a test must never leave it behind: :func:`memory_alarm` clears
it in a ``finally``, and the ``broker_alarm`` fixture (tests/conftest.py) clears
it again after the test whatever happened. A test with that fixture holds the
broker lock (tests/broker_lock.py) exclusively, so no other test talks to the
broker while the alarm is up; under pytest, :func:`raise_alarm` refuses to run
without it. Clearing restores the watermark the broker is *configured* with
(``application:get_env``), not the one in force when the test began, so a run
killed mid-alarm is mended by the next one.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

from tests import broker_lock, support
from tests.machine import rabbitmqctl

#: A fraction of the machine's memory the broker is always above.
TINY = "0.000001"


def alarms() -> str:
    """The broker's alarms now, as Erlang terms ("[]" when none)."""
    return rabbitmqctl("eval", "rabbit_alarm:get_alarms().")


def configured_watermark() -> str:
    """The watermark of the broker's configuration (0.4 unless configured)."""
    text = rabbitmqctl("eval", "application:get_env(rabbit, vm_memory_high_watermark).")
    match = re.fullmatch(r"\{ok,\s*([0-9.]+)\}", text)
    return match.group(1) if match else "0.4"


def raise_alarm() -> None:
    if os.environ.get("PYTEST_CURRENT_TEST") and not broker_lock.holds_exclusive():
        raise AssertionError("a test that raises the broker's memory alarm must ask for the "
                             "broker_alarm fixture: it keeps every other broker test out")
    rabbitmqctl("set_vm_memory_high_watermark", TINY)
    support.wait_for(lambda: "memory" in alarms(), 30, "the broker's memory alarm")


def clear_alarm() -> None:
    rabbitmqctl("set_vm_memory_high_watermark", configured_watermark())
    support.wait_for(lambda: "memory" not in alarms(), 30, "the memory alarm to clear")


@contextlib.contextmanager
def memory_alarm() -> Iterator[None]:
    """A memory alarm for the ``with`` block, cleared on the way out."""
    raise_alarm()
    try:
        yield
    finally:
        clear_alarm()

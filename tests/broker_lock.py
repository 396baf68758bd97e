"""One lock that keeps a broker-wide memory alarm away from every other broker test.

A memory alarm (tests/broker_alarm.py) blocks *every* publisher on the broker,
so a test that raises one must not overlap any other test that talks to
RabbitMQ: not in this run's other pytest-xdist workers, nor in another test run
on the same machine. Every test outside tests/unit and tests/spark (there: the
ones marked ``broker``) holds this lock shared for its whole run
(tests/conftest.py) and a test that asks for the ``broker_alarm``
fixture holds it exclusively; :func:`tests.broker_alarm.raise_alarm` refuses to
raise an alarm without it.

The lock is a ``flock`` on a file in the system's temporary directory (one per
machine, so separate runs share it too; flock locks die with their process,
so a killed run leaves nothing held). ``flock`` lets new shared holders in
while an exclusive one waits, which with several busy workers could starve the
alarm test forever; a second file is a turnstile that every taker passes
through and that a waiting exclusive taker keeps shut, so it waits only for
the tests already running.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

_DIR = Path(tempfile.gettempdir())
LOCK = _DIR / "drain-tests-broker.lock"
TURNSTILE = _DIR / "drain-tests-broker.turnstile"

#: Whether this process holds the lock exclusively now.
_exclusive = False


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)


@contextlib.contextmanager
def held(*, exclusive: bool) -> Iterator[None]:
    """Hold the broker lock, shared or exclusively, for the ``with`` block."""
    global _exclusive  # noqa: PLW0603 -- one flag per process, read by holds_exclusive()
    lock, turnstile = _open(LOCK), _open(TURNSTILE)
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        _exclusive = exclusive
        try:
            yield
        finally:
            _exclusive = False
            fcntl.flock(lock, fcntl.LOCK_UN)
    finally:
        os.close(turnstile)
        os.close(lock)


def holds_exclusive() -> bool:
    return _exclusive

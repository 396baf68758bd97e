"""The loop's watchdog: give up a database connection that stopped answering;
say when the loop stops turning, and when it turns again.

Every wait of the drain's loop has a bound but one: a Postgres (or a pooler in
front of it) that keeps the connection open and never answers. Postgres's own
timeouts cannot help when the command never reached it, and TCP keepalives pass
while the other end is up. The statement timeout bounds every command the drain
sends, so a command unanswered ANSWER_GRACE seconds after it is given up
(Store.abandon): the loop sees a lost connection, reconnects, ends the abandoned
backend if it lives on behind the hang as this drain's (holding its lock and that
session's token: drain.postgres.abandoned), and takes the lock again or stands by.
Anything else that stops the loop is only reported (and /healthz fails, and
DrainStalled pages).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from drain.postgres.session import Session
from drain.settings.config import Settings

log = logging.getLogger("drain.watchdog")

#: Seconds between two looks of the watchdog at the loop (Watchdog).
WATCH_INTERVAL = 0.5
#: Seconds past the statement timeout after which a command's answer will not
#: come: the connection is abandoned (Watchdog, Store.abandon).
ANSWER_GRACE = 5.0


def answer_bound(settings: Settings) -> float:
    """Seconds a command may go unanswered before its connection is abandoned:
    the session's statement timeout (``--db-timeout``) plus ANSWER_GRACE."""
    return settings.db_timeout + ANSWER_GRACE


def stuck_after(settings: Settings) -> float:
    """Seconds without a turn of the loop after which it counts as stuck (/healthz,
    the watchdog): the longest single wait it is configured for (a confirm wait,
    the idle poll, the standby interval or a retry's backoff), plus the longest
    a database command may take (:func:`answer_bound`)."""
    longest = max(settings.confirm_timeout, settings.poll_interval,
                  settings.standby_interval, settings.max_backoff)
    return longest + answer_bound(settings)


class Watchdog:
    """Looks at one drain loop every WATCH_INTERVAL from a thread of its own."""

    def __init__(self, settings: Settings, store: Session, *,
                 heartbeat: Callable[[], float], state: Callable[[], str]) -> None:
        self._settings = settings
        self._store = store
        self._heartbeat = heartbeat
        self._state = state
        self.stuck_after = stuck_after(settings)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="drain-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        bound = answer_bound(self._settings)
        stuck_since: float | None = None
        while not self._done.wait(WATCH_INTERVAL):
            waited = self._store.abandon(bound)
            if waited is not None:
                log.error("Postgres has not answered a command for %.1fs (statement timeout "
                          "%gs + %gs): abandoning the connection; the batch's rows stay "
                          "staged", waited, self._settings.db_timeout, ANSWER_GRACE)
            beat = self._heartbeat()
            if stuck_since is None and time.monotonic() - beat >= self.stuck_after:
                stuck_since = beat
                what = ("Postgres has not answered a command"
                        if self._store.waiting else "a call has not returned")
                log.error("the drain loop has not turned for %.0fs (%s, state %s); "
                          "nothing is published until it does", time.monotonic() - beat,
                          what, self._state())
            elif stuck_since is not None and beat != stuck_since:
                log.warning("the drain loop turns again after %.0fs", beat - stuck_since)
                stuck_since = None

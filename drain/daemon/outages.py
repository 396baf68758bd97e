"""How the drain lives through outages: each failure logged once, backoff, retries.

The drain loop (drain.daemon.runner) reports what fails and what works again; this
module keeps, per target ("database" or "broker"), what is going wrong
(:class:`Trouble`): a failure is logged once, not per attempt, and followed by
one "... back" line when the work succeeds again; a cycle that keeps failing
backs off exponentially (up to ``max_backoff``) rather than spin; connecting is
retried with exponential backoff and jitter, and the wait ends early when a
server that was not listening listens again (drain.broker.reachable).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import tenacity

from drain.broker import reachable
from drain.daemon.metrics import Metrics
from drain.errors import BrokerRefused, DatabaseRefused

log = logging.getLogger("drain.outages")


@dataclasses.dataclass
class Trouble:
    """What is going wrong with one target ("database" or "broker")."""

    #: The last error logged (an identical one is not logged again).
    error: str | None = None
    #: Whether it came from a cycle, rather than from connecting.
    in_cycle: bool = False
    #: Consecutive failures.
    failures: int = 0


class Outages:
    """The failures of one drain's targets, and its retries.

    ``sleep`` waits (returning early when the drain stops), ``stopping`` says
    whether it does, ``clean`` turns an exception into a line safe to log,
    ``down`` is told which target went down, ``knock`` gives the addresses to
    watch for each target while it is down.
    """

    def __init__(
        self, metrics: Metrics, max_backoff: float,
        knock: dict[str, Callable[[], list[reachable.Address]]], *,
        sleep: Callable[[float], None], stopping: Callable[[], bool],
        clean: Callable[[BaseException | None], str], down: Callable[[str], None],
    ) -> None:
        self._metrics = metrics
        self._max_backoff = max_backoff
        self._knock = knock
        self._sleep = sleep
        self._stopping = stopping
        self._clean = clean
        self._down = down
        self._connected_once: set[str] = set()
        self._trouble = {"database": Trouble(), "broker": Trouble()}

    def in_cycle(self, what: str) -> bool:
        """The last failure of ``what`` came from a cycle, not from connecting."""
        return self._trouble[what].in_cycle

    def failed(self, what: str, text: str, *, in_cycle: bool) -> None:
        """Log a failure unless it repeats the last one; back off when it keeps failing."""
        trouble = self._trouble[what]
        trouble.failures += 1
        trouble.in_cycle = in_cycle
        if text != trouble.error:
            trouble.error = text
            log.warning("%s", text)
        if in_cycle and trouble.failures > 1:
            # Connecting works but the work itself keeps failing: do not spin.
            self._sleep(min(0.1 * 2 ** (trouble.failures - 1), self._max_backoff))

    def recovered(self, what: str) -> None:
        trouble = self._trouble[what]
        if trouble.error is not None and trouble.in_cycle:
            log.info("%s back: working again after %d failure(s)", what, trouble.failures)
        self._trouble[what] = Trouble()

    def retry(self, attempt: Callable[[], None], errors: type[Exception], what: str) -> bool:
        """Call ``attempt`` until it succeeds or the drain stops; True on success.

        A refusal (bad password, unknown role, database or vhost) on the very
        first connection is a configuration error: it is raised, and the CLI
        exits with code 3. Later, it is retried like an outage: credentials may
        be rotating.
        """
        failures = 0

        def first_refusal(exc: BaseException) -> bool:
            refused = isinstance(exc, (DatabaseRefused, BrokerRefused))
            return refused and what not in self._connected_once

        def before_sleep(state: tenacity.RetryCallState) -> None:
            nonlocal failures
            failures += 1
            exc = state.outcome.exception() if state.outcome else None
            self._down(what)
            if failures == 1:
                self.failed(
                    what,
                    f"{self._clean(exc)}; retrying with backoff (up to {self._max_backoff:g}s)",
                    in_cycle=False,
                )

        watch = reachable.Watch(self._knock[what])

        def sleep(seconds: float) -> None:
            self._sleep_until_back(seconds, watch, what)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(
                lambda exc: isinstance(exc, errors) and not first_refusal(exc)
            ),
            wait=tenacity.wait_exponential(multiplier=0.1, max=self._max_backoff)
            + tenacity.wait_random(0, 0.2),
            stop=lambda _state: self._stopping(),
            sleep=sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            retrying(attempt)
        except errors as exc:
            if first_refusal(exc):
                raise
            return False
        if what in self._connected_once:
            self._metrics.reconnects.labels(what).inc()
        self._connected_once.add(what)
        return True

    def _sleep_until_back(self, seconds: float, watch: reachable.Watch, what: str) -> None:
        """Back off for ``seconds``, but end the wait as soon as a server that
        was not listening listens again (drain.broker.reachable)."""
        deadline = time.monotonic() + seconds
        while not self._stopping():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._sleep(min(left, reachable.INTERVAL))
            if watch.came_back():
                log.info("%s is accepting connections again: reconnecting now", what)
                return

"""The drain loop: lock, fetch, publish, confirm, delete, commit, repeat.

States and the one log line each change gets:

* connecting to Postgres ("database unreachable ..." once, "database connected");
* standby: another drain holds the advisory lock ("standby: ...");
* active: this process holds the lock ("active: took the drain lock");
* broker down while active ("broker unreachable ...", "broker connected").

Each cycle runs one REPEATABLE READ transaction on the lock's own session:
fetch up to ``batch_size`` rows, publish them with pipelined confirms, delete
exactly the rows whose messages were confirmed, commit (drain.daemon.pipeline, which
also says how consecutive batches overlap). A crash anywhere leaves each row either
staged or confirmed by the broker (at-least-once, same task id). When a cycle
finds fewer rows than a batch, the drain arms its wake-up (drain.postgres.wakeup) and
sleeps until a NOTIFY, a signal, or ``poll_interval``.

A failure repeated identically (a queue the broker refuses to declare, a
statement that keeps timing out) is logged once, retried with exponential
backoff, and followed by one "... back" line when a cycle succeeds again.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import select
import signal
import time
from collections.abc import Callable
from types import FrameType

from drain import trace_context
from drain.broker import broker_list, reachable
from drain.broker.publisher import Publisher
from drain.celery import celery_app, routing
from drain.daemon import outages
from drain.daemon.metrics import Metrics
from drain.daemon.pipeline import Pipeline
from drain.daemon.watchdog import Watchdog
from drain.errors import (
    BatchConflict,
    BrokerRefused,
    BrokerUnavailable,
    ConfigError,
    DatabaseRefused,
    DatabaseUnavailable,
    DrainError,
    LaneConflict,
    PermissionDenied,
    ReadOnlyStandby,
    SchemaMissing,
)
from drain.postgres import keyset, wakeup
from drain.postgres.store import Store
from drain.settings.config import Settings
from drain.settings.urls import scrub

log = logging.getLogger("drain.runner")

#: Seconds between two looks at a broker that blocks publishing (Drain._blocked).
BLOCKED_LOOK = 0.25
#: Errors that end ``drain run``: no retry can fix them (a missing grant, a bad
#: setting, a schema `drain migrate` must bring up to date, a refused first login:
#: see drain.daemon.outages). Any other DrainError in the loop costs the session, not the drain.
FATAL = (PermissionDenied, ConfigError, SchemaMissing, DatabaseRefused, BrokerRefused)


class State(enum.Enum):
    STARTING = "starting"
    DB_DOWN = "database down"
    STANDBY = "standby"
    ACTIVE = "active"
    BROKER_DOWN = "broker down"
    BROKER_BLOCKED = "broker blocked"
    STOPPING = "stopping"


class Drain:
    """One drain process. :meth:`run` returns when asked to stop."""

    def __init__(
        self,
        settings: Settings,
        *,
        exit_when_empty: bool = False,
        on_cycle: Callable[[int, int], None] | None = None,
        on_fetch: Callable[[float, int], None] | None = None,
        on_expire: Callable[[float, int], None] | None = None,
    ) -> None:
        self.settings = settings
        self.exit_when_empty = exit_when_empty
        self.state = State.STARTING
        self.metrics = Metrics()
        self.metrics.lanes.set(settings.lanes)
        self._heartbeat = time.monotonic()
        self._secrets = settings.secrets()
        self._store = Store(settings)
        self._wakeup = wakeup.Wakeup(self._store, lanes=settings.lanes)
        #: The user's Celery app's routing, with --app (drain.celery.routing).
        self.router = routing.of_settings(settings)
        #: The brokers, in failover order: the app's with --app and no --broker-url.
        self.brokers = broker_list.of_settings(
            settings, celery_app.broker_settings(self.router.app) if self.router else None)
        #: Where to knock while waiting to reconnect (drain.broker.reachable), resolved
        #: when an outage begins.
        knock: dict[str, Callable[[], list[reachable.Address]]] = {
            "database": functools.partial(reachable.addresses, settings.database_url),
            "broker": self.brokers.addresses,
        }
        self._publisher = Publisher(
            self.brokers,
            display_url=self.brokers.current.shown,
            declare=settings.queue_declare,
            confirm_timeout=settings.confirm_timeout,
            secrets=self._secrets,
            queue_max_priority=settings.queue_max_priority,
            specs=self.router.spec if self.router else None,
        )
        # Heartbeats and confirms go on while a Postgres command waits (a lock).
        self._store.while_waiting = self._publisher.serve
        # A wait for a slow broker's confirms that goes on while they come is a loop
        # that goes round (/healthz, the watchdog).
        self._publisher.on_progress = self._beat
        # Read from the publisher when scraped: nothing to keep up to date per cycle.
        publisher = self._publisher
        self.metrics.broker_blocked.set_function(
            lambda: 0.0 if publisher.blocked is None else 1.0)
        tracer = trace_context.configured_tracer()
        if tracer is not None:
            log.info("tracing: a span per message (OTEL_* settings), trace context %s, "
                     "a new trace after %gs", settings.trace_context, settings.trace_new_after)
        #: The data path while this drain leads (drain.daemon.pipeline).
        self.pipeline = Pipeline(settings, self._store, self._publisher, self.metrics,
                                 on_cycle=on_cycle, on_fetch=on_fetch, on_expire=on_expire,
                                 router=self.router, tracer=tracer)
        self._watchdog = Watchdog(settings, self._store, heartbeat=lambda: self._heartbeat,
                                  state=lambda: self.state.value)
        self._stopping = False
        self._lane_conflict: str | None = None
        #: Each failure logged once, backoff and retries (drain.daemon.outages).
        self._outages = outages.Outages(
            self.metrics, settings.max_backoff, knock, sleep=self._sleep,
            stopping=lambda: self._stopping, clean=self._clean, down=self._down)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @property
    def marks(self) -> keyset.Marks:
        """The fetch's low-water marks (drain.postgres.keyset)."""
        return self.pipeline.marks

    @property
    def published(self) -> int:
        """Rows the broker confirmed in this process's lifetime."""
        return self.pipeline.published

    # -- lifecycle ----------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to stop after the current batch (signal-safe)."""
        self._stopping = True
        with contextlib.suppress(OSError):  # pipe full: a wake-up is already pending
            os.write(self._wake_w, b"x")

    def install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: FrameType | None) -> None:
            log.info("received %s: finishing the current batch and exiting",
                     signal.Signals(signum).name)
            self.stop()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def health(self) -> dict[str, object]:
        """For /healthz and /readyz: alive (the loop went round lately), ready, role, state."""
        return {
            "alive": time.monotonic() - self._heartbeat < self._watchdog.stuck_after,
            "ready": self._store.connected,
            "role": "leader" if self._store.holds_lock else "standby",
            "state": self.state.value,
        }

    def run(self) -> None:
        log.info("drain starting: %s", self.settings.describe())
        self.metrics.up.set(1)
        self._watchdog.start()
        try:
            while not self._stopping or self.pipeline.inflight:
                self._heartbeat = time.monotonic()
                self.metrics.holding_lock(self._store.holds_lock)
                if self._stopping:
                    self._settle()
                    break
                if not self._store.connected:
                    self._connect_database()
                    continue
                try:
                    self._turn()
                except FATAL:
                    raise
                except DrainError as exc:
                    self._unexpected(exc)
        finally:
            self._watchdog.stop()
            self.metrics.up.set(0)
            self.metrics.holding_lock(False)
            self._set_state(State.STOPPING, "drain stopping (published %d this run)",
                            self.published)
            self._publisher.close()
            self._store.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    # -- states ---------------------------------------------------------------------

    def _turn(self) -> None:
        """One turn of the loop on a connected session."""
        if not self._store.holds_lock:
            self._try_lead()
        elif not self._publisher.connected:
            # Lost between cycles (noticed while serving the connection, or while a
            # batch was written): said once, naming the broker that went, through the
            # one broker-lost path (its batches go with it, their rows stay staged),
            # before the next broker is tried.
            try:
                self._publisher.pump(0.0)
            except BrokerUnavailable as exc:
                self._broker_lost(exc)
                return
            self.pipeline.forget()
            self._connect_broker()
        else:
            self._step()

    def _connect_database(self) -> None:
        def attempt() -> None:
            self._store.connect()

        connected = self._outages.retry(attempt, DatabaseUnavailable, "database")
        if connected and not self._outages.in_cycle("database"):
            log.info("database connected")

    def _try_lead(self) -> None:
        try:
            if self._store.try_lock():
                self.pipeline.marks.reset()  # others drained meanwhile: start from the head
                self._lane_conflict = None
                lane = (f", lane {self.settings.lane} of {self.settings.lanes}"
                        if self.settings.lanes > 1 else "")
                self._set_state(State.ACTIVE, "active: took the drain lock (key %d%s)",
                                self.settings.lock_key, lane)
                return
        except DatabaseUnavailable as exc:
            self._database_lost(exc)
            return
        except (LaneConflict, ReadOnlyStandby) as exc:
            self._standing_by(exc)
            return
        self._outages.recovered("database")
        what = (f"lane {self.settings.lane} of {self.settings.lanes}"
                if self.settings.lanes > 1 else "the lock")
        self._set_state(State.STANDBY,
                        "standby: another drain holds %s (key %d); waiting to take over",
                        what, self.settings.lock_key)
        self._sleep(self.settings.standby_interval)

    def _standing_by(self, exc: LaneConflict | ReadOnlyStandby) -> None:
        if str(exc) != self._lane_conflict:  # said once, not per attempt
                self._lane_conflict = str(exc)
                log.warning("standby: %s; waiting %s", exc, "until they stop"
                            if isinstance(exc, LaneConflict) else "for it to be promoted")
        self.state = State.STANDBY
        self._sleep(self.settings.standby_interval)

    def _connect_broker(self) -> None:
        if self._outages.retry(self._publisher.connect, BrokerUnavailable, "broker"):
            if not self._outages.in_cycle("broker"):
                log.info("broker connected")
            self.state = State.ACTIVE

    def _step(self) -> None:
        if self._blocked():
            return
        started = time.perf_counter()
        try:
            count = self.pipeline.cycle()
        except DatabaseUnavailable as exc:
            self._database_lost(exc)
            return
        except BatchConflict as exc:
            self._conflict(exc)
            return
        except BrokerUnavailable as exc:
            self._broker_lost(exc)
            return
        self.metrics.cycle_seconds.observe(time.perf_counter() - started)
        self.metrics.last_cycle.set(time.time())
        self._outages.recovered("database")
        self._outages.recovered("broker")
        if count < self.settings.batch_size and not self.pipeline.owed:
            if count == 0 and self.exit_when_empty and not self.pipeline.inflight:
                log.info("backlog empty: exiting (--exit-when-empty)")
                self._stopping = True
                return
            self._idle(count)
            return
        try:
            # A backlog found by a poll, not a NOTIFY (delayed rows came due,
            # say): writers need not notify while the drain works through it.
            self._wakeup.busy()
        except DatabaseUnavailable as exc:
            self._database_lost(exc)

    def _blocked(self) -> bool:
        """While the broker blocks publishing (a resource alarm), publish nothing
        new and keep listening to it; True while blocked.

        The batches in flight stay in flight: the broker stopped reading, it did
        not lose them, and their confirms come when the alarm clears. Waiting
        outside any transaction keeps the lock and holds no snapshot; the loop
        keeps turning (``/healthz`` stays alive) and there is no reconnecting,
        so the broker sees no storm. ``drain_broker_blocked`` says why nothing
        is published; publishing resumes within ``BLOCKED_LOOK`` of the alarm
        clearing.
        """
        if self._publisher.blocked is None:
            if self.state is State.BROKER_BLOCKED:
                self.state = State.ACTIVE
            return False
        self.state = State.BROKER_BLOCKED
        try:
            self._publisher.pump(BLOCKED_LOOK)
        except BrokerUnavailable as exc:
            self._broker_lost(exc)
        return True

    def _settle(self) -> None:
        """On the way out: wait for the batches in flight and delete what was confirmed."""
        if not (self._store.connected and self._store.holds_lock):
            self.pipeline.forget()
            return
        try:
            self.pipeline.cycle(stopping=True)
        except DrainError as exc:
            log.warning("could not settle the last batches (%s); their rows stay staged",
                        self._clean(exc))
        self.pipeline.forget()

    def _idle(self, found: int) -> None:
        """After a cycle that found ``found`` rows, fewer than a batch: arm the
        wake-up (drain.postgres.wakeup) and wait for a NOTIFY, a stop request or the
        pause it allows; keep the broker alive."""
        try:
            pause = self._wakeup.pause(found, self.settings.poll_interval)
            if pause > 0 and self._store.wait(pause, extra_fds=(self._wake_r,)):
                self._wakeup.busy()
        except DatabaseUnavailable as exc:
            self._database_lost(exc)
            return
        self._drain_wake_pipe()
        try:
            self._publisher.pump(0.0)
        except BrokerUnavailable as exc:
            self._broker_lost(exc)

    # -- failures ---------------------------------------------------------------------

    def _database_lost(self, exc: DatabaseUnavailable) -> None:
        was_active = self.state is State.ACTIVE
        self.pipeline.forget()  # its rows stay staged and will be published again
        self._publisher.forget_inflight()
        self._store.close()
        self.state = State.DB_DOWN
        suffix = "; lock released, batch rolled back" if was_active else ""
        self._outages.failed("database", self._clean(exc) + suffix, in_cycle=True)

    def _unexpected(self, exc: DrainError) -> None:
        """Any other error of a cycle or of taking the lead: the session goes, with
        its batch and the lock, and the drain connects again, backing off while it
        repeats."""
        self._database_lost(DatabaseUnavailable(f"{self._clean(exc)}; reconnecting"))

    def _conflict(self, exc: BatchConflict) -> None:
        """A concurrent change made the batch fail (a row updated or deleted
        under it): it rolled back, the session and the lock are kept, and the
        next cycle fetches afresh."""
        self.pipeline.forget()
        self._outages.failed("database", str(exc) + "; batch rolled back, rows stay staged",
                     in_cycle=True)

    def _broker_lost(self, exc: BrokerUnavailable) -> None:
        self.pipeline.forget()  # lost with the connection; its rows stay staged
        self._publisher.close()
        self.state = State.BROKER_DOWN
        self._outages.failed("broker", self._clean(exc) + "; rows stay staged", in_cycle=True)

    # -- helpers ---------------------------------------------------------------------

    def _set_state(self, state: State, msg: str, *args: object) -> None:
        if state is self.state and state is not State.STOPPING:
            return
        self.state = state
        level = logging.WARNING if state in (State.DB_DOWN, State.BROKER_DOWN) else logging.INFO
        log.log(level, msg, *args)

    def _down(self, what: str) -> None:
        self.state = State.DB_DOWN if what == "database" else State.BROKER_DOWN

    def _clean(self, exc: BaseException | None) -> str:
        # DrainErrors are built from masked URLs and scrubbed driver text already;
        # scrubbing again would also mask a user name that equals the password.
        if exc is None:
            return "unknown error"
        return str(exc) if isinstance(exc, DrainError) else scrub(str(exc), self._secrets)

    def _beat(self) -> None:
        self._heartbeat = time.monotonic()

    def _sleep(self, seconds: float) -> None:
        """Sleep, but return at once when asked to stop."""
        if self._stopping:
            return
        self._heartbeat = time.monotonic()
        select.select([self._wake_r], [], [], seconds)
        self._drain_wake_pipe()

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except (BlockingIOError, OSError):
            pass


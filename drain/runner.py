"""The drain loop: lock, fetch, publish, confirm, delete, commit, repeat.

States and the one log line each change gets:

* connecting to Postgres ("database unreachable ..." once, "database connected");
* standby: another drain holds the advisory lock ("standby: ...");
* active: this process holds the lock ("active: took the drain lock");
* broker down while active ("broker unreachable ...", "broker connected").

Each cycle runs one REPEATABLE READ transaction on the lock's own session:
fetch up to ``batch_size`` rows, publish them with pipelined confirms, delete
exactly the rows whose messages were confirmed, commit (see :meth:`Drain._cycle`
for how consecutive batches overlap). A crash anywhere leaves each row either
staged or confirmed by the broker (at-least-once, same task id). When a cycle
finds fewer rows than a batch, the drain arms its wake-up (drain.wakeup) and
sleeps until a NOTIFY, a signal, or ``poll_interval``.

A failure repeated identically (a queue the broker refuses to declare, a
statement that keeps timing out) is logged once, retried with exponential
backoff, and followed by one "... back" line when a cycle succeeds again.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import functools
import logging
import os
import select
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from types import FrameType

import tenacity

from drain import keyset, message, reachable, wakeup
from drain.config import Settings
from drain.errors import (
    BatchConflict,
    BrokerBlocked,
    BrokerRefused,
    BrokerUnavailable,
    DatabaseRefused,
    DatabaseUnavailable,
    DrainError,
    LaneConflict,
    QueueDeclareRefused,
    ReadOnlyStandby,
)
from drain.message import StagedRow
from drain.metrics import Metrics
from drain.publisher import Batch, Publisher, PublishResult
from drain.store import Store
from drain.urls import broker_parameters, mask_url, scrub

log = logging.getLogger(__name__)

#: Seconds a stopping drain waits for its last batch's confirms.
SETTLE_TIMEOUT = 3.0
#: Seconds between two looks at the marked priorities' heads (drain.keyset).
HEADS_INTERVAL = 0.25
#: Seconds between two looks for expired rows while none are found.
EXPIRE_INTERVAL = 1.0
#: Seconds between two looks at a broker that blocks publishing (Drain._blocked).
BLOCKED_LOOK = 0.25
#: Seconds between two looks of the watchdog at the loop (Drain._watch).
WATCH_INTERVAL = 0.5
#: Seconds past the statement timeout after which a command's answer will not
#: come: the connection is abandoned (Drain._watch, Store.abandon).
ANSWER_GRACE = 5.0
#: A batch fetched longer ago than this (the process was paused, a declare
#: hung) is published only after one round trip proves the session, and so the
#: lock, is still there: a standby may have taken over meanwhile.
STALE_FETCH = 1.0


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


class State(enum.Enum):
    STARTING = "starting"
    DB_DOWN = "database down"
    STANDBY = "standby"
    ACTIVE = "active"
    BROKER_DOWN = "broker down"
    BROKER_BLOCKED = "broker blocked"
    STOPPING = "stopping"


@dataclasses.dataclass
class Trouble:
    """What is going wrong with one target ("database" or "broker")."""

    #: The last error logged (an identical one is not logged again).
    error: str | None = None
    #: Whether it came from a cycle, rather than from connecting.
    in_cycle: bool = False
    #: Consecutive failures.
    failures: int = 0


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
        self.published = 0
        self._on_cycle = on_cycle
        self._on_fetch = on_fetch
        self._on_expire = on_expire
        self.metrics = Metrics()
        self.metrics.lanes.set(settings.lanes)
        self._heartbeat = time.monotonic()
        self.stuck_after = stuck_after(settings)
        self._heads_at = 0.0
        self._expired_at = 0.0
        self._marks = keyset.Marks(enabled=settings.fetch_strategy == "keyset",
                                   rescan_interval=settings.rescan_interval)
        self._fetched_at = 0.0
        self._secrets = settings.secrets()
        self._store = Store(settings)
        self._wakeup = wakeup.Wakeup(self._store, lanes=settings.lanes)
        broker = broker_parameters(settings.broker_url)
        #: Where to knock while waiting to reconnect (drain.reachable), resolved
        #: when an outage begins.
        self._knock: dict[str, Callable[[], list[reachable.Address]]] = {
            "database": functools.partial(reachable.addresses, settings.database_url),
            "broker": functools.partial(reachable.tcp_addresses, broker.host, broker.port),
        }
        self._publisher = Publisher(
            broker,
            display_url=mask_url(settings.broker_url),
            declare=settings.queue_declare,
            confirm_timeout=settings.confirm_timeout,
            secrets=self._secrets,
            queue_max_priority=settings.queue_max_priority,
        )
        self._builder = message.Builder(
            origin=message.origin(), reply_to=str(uuid.uuid4()),
            max_priority=settings.queue_max_priority,
        )
        self._stopping = False
        self._lane_conflict: str | None = None
        #: Batches published and not yet settled, oldest first (at most
        #: ``settings.pipeline - 1`` between cycles).
        self._inflight: list[Batch] = []
        self._connected_once: set[str] = set()
        #: queue -> (paused until (monotonic), times paused, last reason logged)
        self._paused: dict[str, tuple[float, int, str]] = {}
        self._trouble = {"database": Trouble(), "broker": Trouble()}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @property
    def marks(self) -> keyset.Marks:
        """The fetch's low-water marks (drain.keyset)."""
        return self._marks

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
            "alive": time.monotonic() - self._heartbeat < self.stuck_after,
            "ready": self._store.connected,
            "role": "leader" if self._store.holds_lock else "standby",
            "state": self.state.value,
        }

    def run(self) -> None:
        log.info("drain starting: %s", self.settings.describe())
        self.metrics.up.set(1)
        done = threading.Event()
        watchdog = threading.Thread(target=self._watch, args=(done,), name="drain-watchdog",
                                    daemon=True)
        watchdog.start()
        try:
            while not self._stopping or self._inflight:
                self._heartbeat = time.monotonic()
                self.metrics.holding_lock(self._store.holds_lock)
                if self._stopping:
                    self._settle()
                    break
                if not self._store.connected:
                    self._connect_database()
                    continue
                if not self._store.holds_lock:
                    self._try_lead()
                    continue
                if not self._publisher.connected:
                    self._connect_broker()
                    continue
                self._step()
        finally:
            done.set()
            self.metrics.up.set(0)
            self.metrics.holding_lock(False)
            self._set_state(State.STOPPING, "drain stopping (published %d this run)",
                            self.published)
            self._publisher.close()
            self._store.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _watch(self, done: threading.Event) -> None:
        """Abandon a database connection that stopped answering; say when the loop
        stops turning, and when it turns again.

        Every wait of the loop has a bound but one: a Postgres (or a pooler in
        front of it) that keeps the connection open and never answers. Postgres's
        own timeouts cannot help when the command never reached it, and TCP
        keepalives pass while the other end is up. The statement timeout bounds
        every command the drain sends, so a command unanswered ANSWER_GRACE
        seconds after it is given up (Store.abandon): the loop sees a lost
        connection, reconnects, ends the abandoned backend if it lives on behind
        the hang, and takes the lock again or stands by. Anything else that stops
        the loop is only reported (and /healthz fails, and DrainStalled pages).
        """
        bound = answer_bound(self.settings)
        stuck_since: float | None = None
        while not done.wait(WATCH_INTERVAL):
            waited = self._store.abandon(bound)
            if waited is not None:
                log.error("Postgres has not answered a command for %.1fs (statement timeout "
                          "%gs + %gs): abandoning the connection; the batch's rows stay "
                          "staged", waited, self.settings.db_timeout, ANSWER_GRACE)
            beat = self._heartbeat
            if stuck_since is None and time.monotonic() - beat >= self.stuck_after:
                stuck_since = beat
                what = ("Postgres has not answered a command"
                        if self._store.waiting else "a call has not returned")
                log.error("the drain loop has not turned for %.0fs (%s, state %s); "
                          "nothing is published until it does", time.monotonic() - beat,
                          what, self.state.value)
            elif stuck_since is not None and beat != stuck_since:
                log.warning("the drain loop turns again after %.0fs", beat - stuck_since)
                stuck_since = None

    # -- states ---------------------------------------------------------------------

    def _connect_database(self) -> None:
        def attempt() -> None:
            self._store.connect()

        connected = self._retry(attempt, DatabaseUnavailable, "database")
        if connected and not self._trouble["database"].in_cycle:
            log.info("database connected")

    def _try_lead(self) -> None:
        try:
            if self._store.try_lock():
                self._marks.reset()  # others drained meanwhile: start from the head
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
            if str(exc) != self._lane_conflict:  # said once, not per attempt
                self._lane_conflict = str(exc)
                log.warning("standby: %s; waiting %s", exc, "until they stop"
                            if isinstance(exc, LaneConflict) else "for it to be promoted")
            self.state = State.STANDBY
            self._sleep(self.settings.standby_interval)
            return
        self._recovered("database")
        what = (f"lane {self.settings.lane} of {self.settings.lanes}"
                if self.settings.lanes > 1 else "the lock")
        self._set_state(State.STANDBY,
                        "standby: another drain holds %s (key %d); waiting to take over",
                        what, self.settings.lock_key)
        self._sleep(self.settings.standby_interval)

    def _connect_broker(self) -> None:
        if self._retry(self._publisher.connect, BrokerUnavailable, "broker"):
            if not self._trouble["broker"].in_cycle:
                log.info("broker connected")
            self.state = State.ACTIVE

    def _step(self) -> None:
        if self._blocked():
            return
        started = time.perf_counter()
        try:
            count = self._cycle()
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
        self._recovered("database")
        self._recovered("broker")
        if count < self.settings.batch_size and not self._inflight:
            if count == 0 and self.exit_when_empty:
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
        blocked = self._publisher.blocked is not None
        self.metrics.broker_blocked.set(1 if blocked else 0)
        if not blocked:
            if self.state is State.BROKER_BLOCKED:
                self.state = State.ACTIVE
            return False
        self.state = State.BROKER_BLOCKED
        try:
            self._publisher.pump(BLOCKED_LOOK)
        except BrokerUnavailable as exc:
            self._broker_lost(exc)
        return True

    def _cycle(self) -> int:
        """One transaction: publish a new batch, settle the oldest one in flight.

        With ``pipeline`` P, the batch published in transaction k is confirmed
        while transactions k+1 .. k+P-1 fetch and publish the next ones, so the
        broker never waits for Postgres: transaction k+P-1 then deletes the rows
        of batch k that the broker confirmed. Rows still in flight are excluded
        from the fetch. A part batch (nothing left behind it to overlap with)
        settles everything in flight, itself included, in its own transaction:
        the latency of a lone job is one transaction, not P. In the same
        transaction, expired rows and rows that can never become a message move
        to dead_jobs. Returns how many rows were fetched or expired.
        """
        pending, self._inflight = self._inflight, []
        start_error: BrokerUnavailable | None = None
        results: list[PublishResult] = []
        doomed: list[tuple[int, str, str]] = []
        rows: list[StagedRow] = []
        limit = self.settings.batch_size
        expired = 0
        try:
            with self._store.batch():
                if not self._stopping:
                    expired, rows = self._expire_and_fetch(
                        [row_id for batch in pending for row_id in batch.row_ids], limit)
                if rows:
                    self.metrics.batch_rows.observe(len(rows))
                    publishing = time.perf_counter()
                    try:
                        current = self._start(rows, doomed)
                    except BrokerUnavailable as exc:
                        start_error = exc
                    except BrokerBlocked:
                        pass  # nothing published: the rows stay staged (see _blocked)
                    else:
                        if current is not None:
                            pending.append(current)
                    self.metrics.publish_seconds.observe(time.perf_counter() - publishing)
                # On the way out, do not keep a stalled broker's batch for the whole
                # confirm timeout: abandoning it is safe (its rows stay staged).
                self._collect(pending, results, everything=len(rows) < limit or bool(start_error),
                              timeout=SETTLE_TIMEOUT if self._stopping else None)
                confirmed = [row_id for r in results for row_id in r.confirmed]
                deleted = self._store.delete(confirmed) if confirmed else 0
                if doomed:
                    self._store.bury(doomed)
        except (DatabaseUnavailable, BatchConflict):
            # Rolled back: every row stays staged, the ones the broker confirmed
            # too. They are published again, with the same task ids: count them.
            self.metrics.unsettled.inc(sum(len(r.confirmed) for r in results))
            self._publisher.forget_inflight()
            raise
        if expired:
            self.metrics.expired.inc(expired)
            self.metrics.dead_lettered.labels("expired").inc(expired)
            log.warning("moved %d expired job(s) to dead_jobs (reason 'expired')", expired)
        # Committed: the confirmed rows are gone, everything else stays staged.
        self._inflight = pending
        self.metrics.deleted.inc(deleted)
        for reason, count in sorted(collections.Counter(r for _, r, _ in doomed).items()):
            self.metrics.dead_lettered.labels(reason).inc(count)
            log.warning("moved %d job(s) to dead_jobs (reason %r)", count, reason)
        for result in results:
            self._account(result)
        error = start_error or next((r.error for r in results if r.error), None)
        if error is not None:
            raise error
        return max(len(rows), expired)

    def _collect(self, pending: list[Batch], results: list[PublishResult], *,
                 everything: bool, timeout: float | None) -> None:
        """Wait for the oldest batches' confirms, into ``results``.

        Down to pipeline - 1 batches in flight; all of them with ``everything``
        (no backlog left: nothing would follow to overlap with, so a lone job
        takes one transaction; or publishing failed) or once a batch's
        connection failed (collect what was confirmed before that). A broker
        that blocks publishing ends the wait: the rest stays in flight.
        """
        while pending and (everything or len(pending) >= self.settings.pipeline
                           or any(r.error for r in results)):
            try:
                results.append(self._wait(pending[0], timeout))
            except BrokerBlocked:
                return  # in flight until the alarm clears: see _blocked
            pending.pop(0)

    def _expire_and_fetch(self, exclude: list[int], limit: int) -> tuple[int, list[StagedRow]]:
        """Move expired rows to dead_jobs (when due), then fetch the next batch."""
        expired = 0
        if self._expire_due():
            started = time.perf_counter()
            expired = self._store.expire(exclude, limit, self._marks.current())
            if self._on_expire is not None:
                self._on_expire(time.perf_counter() - started, expired)
            self._expired_at = time.monotonic() if expired < limit else 0.0
        # A full batch expired: more expired rows may remain, which the fetch
        # would have to skip one by one. Move them first (the next cycle follows
        # at once) and fetch once they are gone.
        if expired >= limit:
            return expired, []
        self._try_paused()  # a broker round trip: not part of the fetch's time
        return expired, self._fetch(limit, exclude)

    def _wait(self, batch: Batch, timeout: float | None = None) -> PublishResult:
        """Wait for a batch's confirms, timed; BrokerBlocked if the broker blocks first."""
        started = time.perf_counter()
        try:
            return self._publisher.wait(batch, timeout, until_blocked=True)
        finally:
            self.metrics.confirm_seconds.observe(time.perf_counter() - started)

    def _expire_due(self) -> bool:
        """Look for expired rows at most every EXPIRE_INTERVAL while there are none
        (the fetch leaves them out meanwhile), at once while a batch of them remains."""
        return time.monotonic() - self._expired_at >= EXPIRE_INTERVAL

    def _fetch(self, limit: int, exclude: list[int]) -> list[StagedRow]:
        """Fetch the next batch and move the low-water marks (drain.keyset)."""
        started = time.perf_counter()
        marks = self._marks  # with --fetch-strategy head they plan from the head, keep none
        paused = self._paused_queues()
        marks.paused(paused)
        rows = self._store.fetch(limit, exclude, paused, marks.plan(time.monotonic()))
        now = time.monotonic()
        marks.fetched([row.priority for row in rows if row.ready], now)
        # The marks move on a look at the heads now and then, not per batch:
        # spare the round trip on most fetches.
        if now - self._heads_at >= HEADS_INTERVAL and marks.enabled:
            self._heads_at = now
            current = marks.current()
            if current.priorities:
                heads, xmin = self._store.heads(current, paused)
                marks.observe(heads, xmin, paused)
            marks.observe_timed(*self._store.timed_heads(current))
        self._fetched_at = now
        elapsed = time.perf_counter() - started
        self.metrics.fetch_seconds.observe(elapsed)
        if self._on_fetch is not None:
            self._on_fetch(elapsed, len(rows))
        return rows

    def _start(self, rows: list[StagedRow], doomed: list[tuple[int, str, str]]) -> Batch | None:
        """Declare the rows' queues and publish the rows whose queues were accepted."""
        refused = self._publisher.declare({row.queue for row in rows})
        for queue, reason in refused.items():
            refusal = QueueDeclareRefused(queue, reason, self.settings.queue_declare)
            self._pause(queue, str(refusal))
        publishable = [row for row in rows if row.queue not in refused]
        if not publishable:
            return None
        self._prove_lock()
        return self._publisher.start(
            self._messages(publishable, doomed),
            queues={row.queue for row in publishable},
            count=len(publishable),
        )

    def _prove_lock(self) -> None:
        """Before publishing a batch fetched a while ago, prove the lock is still ours.

        A leader paused (SIGSTOP, a frozen VM, a hung declare) between its fetch
        and its publish may have lost its session meanwhile, and a standby taken
        over and published the same rows. Publishing them now would only make
        duplicates: drop the batch instead (its rows stay staged for the new
        leader) and count it in ``drain_stale_batches_total``. A pause that falls
        after this check is not caught; it costs duplicates at worst
        (``drain_unsettled_rows_total``).
        """
        if time.monotonic() - self._fetched_at <= STALE_FETCH:
            return
        try:
            self._store.alive()
        except DatabaseUnavailable:
            self.metrics.stale_batches.inc()
            log.warning("a batch fetched %.1fs ago was not published: the database session "
                        "(and the lock) did not survive the pause",
                        time.monotonic() - self._fetched_at)
            raise

    def _messages(
        self, rows: list[StagedRow], doomed: list[tuple[int, str, str]]
    ) -> Iterator[message.Message]:
        """Build each row's message; a row that can never be one goes to ``doomed``."""
        now = time.time()
        limit = self.settings.max_message_size
        for row in rows:
            try:
                built = self._builder.build(row, now=now)
            except Exception as exc:
                doomed.append((row.id, "invalid", f"{type(exc).__name__}: {exc}"[:1000]))
                continue
            if len(built.body) > limit:
                doomed.append((row.id, "too_large",
                               f"message body of {len(built.body)} bytes exceeds "
                               f"max_message_size ({limit} bytes)"))
                continue
            yield built

    # -- queues the broker refuses ----------------------------------------------------

    def _paused_queues(self) -> list[str]:
        now = time.monotonic()
        return [queue for queue, (until, _, _) in self._paused.items() if until > now]

    def _try_paused(self) -> None:
        """Declare again the paused queues whose pause ran out: resume the ones the
        broker accepts now, pause the others for longer.

        Trying a queue by declaring it, not by fetching its rows, keeps the marks
        past those rows (drain.keyset, "Paused queues") while the broker still
        refuses it: a fetch never steps over the pile just to find that out.
        """
        now = time.monotonic()
        due = {queue for queue, (until, _, _) in self._paused.items() if until <= now}
        if not due:
            return
        try:
            refused = self._publisher.declare(due)
        except BrokerBlocked:
            return  # tried again after the alarm
        for queue in sorted(due):
            if queue in refused:
                refusal = QueueDeclareRefused(queue, refused[queue], self.settings.queue_declare)
                self._pause(queue, str(refusal))
        self._resume(due - set(refused))

    def _pause(self, queue: str, reason: str) -> None:
        """Leave ``queue``'s rows staged for a while (doubling up to 30 s) and say why once."""
        _, count, last = self._paused.get(queue, (0.0, 0, ""))
        delay = min(2.0**count, 30.0)
        self._paused[queue] = (time.monotonic() + delay, count + 1, reason)
        if reason != last:
            log.warning("%s; retrying queue %r with backoff, up to %gs apart", reason, queue, 30.0)

    def _resume(self, queues: set[str]) -> None:
        for queue in queues & set(self._paused):
            del self._paused[queue]
            log.info("queue %r: publishing again", queue)

    def _account(self, result: PublishResult) -> None:
        self.published += len(result.confirmed)
        self.metrics.published.inc(len(result.confirmed))
        self.metrics.unroutable.inc(len(result.returned))
        self.metrics.nacked.inc(result.nacked)
        self._resume(result.confirmed_queues - result.returned_queues)
        for queue in sorted(result.returned_queues):
            # Unroutable: nothing bound to it (deleted behind our back?). Declare
            # it again next time; meanwhile its rows stay staged.
            self._publisher.forget(queue)
            self._pause(queue, f"messages to queue {queue!r} came back unroutable (no queue "
                               "bound); their rows stay staged")
        if result.nacked:
            log.warning("broker nacked %d message(s); their rows stay staged", result.nacked)
        if self._on_cycle is not None:
            self._on_cycle(len(result.confirmed) + len(result.returned) + result.nacked,
                           len(result.confirmed))

    def _settle(self) -> None:
        """On the way out: wait for the batches in flight and delete what was confirmed."""
        if not (self._store.connected and self._store.holds_lock):
            self._inflight = []
            return
        try:
            self._cycle()
        except (DatabaseUnavailable, BrokerUnavailable) as exc:
            log.warning("could not settle the last batches (%s); their rows stay staged",
                        self._clean(exc))
        self._inflight = []

    def _idle(self, found: int) -> None:
        """After a cycle that found ``found`` rows, fewer than a batch: arm the
        wake-up (drain.wakeup) and wait for a NOTIFY, a stop request or the
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
        self._inflight = []  # its rows stay staged and will be published again
        self._publisher.forget_inflight()
        self._store.close()
        self.state = State.DB_DOWN
        suffix = "; lock released, batch rolled back" if was_active else ""
        self._failed("database", self._clean(exc) + suffix, in_cycle=True)

    def _conflict(self, exc: BatchConflict) -> None:
        """A concurrent change made the batch fail (a row updated or deleted
        under it): it rolled back, the session and the lock are kept, and the
        next cycle fetches afresh."""
        self._inflight = []
        self._failed("database", str(exc) + "; batch rolled back, rows stay staged",
                     in_cycle=True)

    def _broker_lost(self, exc: BrokerUnavailable) -> None:
        self._inflight = []  # lost with the connection; its rows stay staged
        self._publisher.close()
        self.state = State.BROKER_DOWN
        self._failed("broker", self._clean(exc) + "; rows stay staged", in_cycle=True)

    def _failed(self, what: str, text: str, *, in_cycle: bool) -> None:
        """Log a failure unless it repeats the last one; back off when it keeps failing."""
        trouble = self._trouble[what]
        trouble.failures += 1
        trouble.in_cycle = in_cycle
        if text != trouble.error:
            trouble.error = text
            log.warning("%s", text)
        if in_cycle and trouble.failures > 1:
            # Connecting works but the work itself keeps failing: do not spin.
            delay = min(0.1 * 2 ** (trouble.failures - 1), self.settings.max_backoff)
            self._sleep(delay)

    def _recovered(self, what: str) -> None:
        trouble = self._trouble[what]
        if trouble.error is not None and trouble.in_cycle:
            log.info("%s back: working again after %d failure(s)", what, trouble.failures)
        self._trouble[what] = Trouble()

    def _retry(self, attempt: Callable[[], None], errors: type[Exception], what: str) -> bool:
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
            self.state = State.DB_DOWN if what == "database" else State.BROKER_DOWN
            if failures == 1:
                self._failed(
                    what,
                    f"{self._clean(exc)}; retrying with backoff "
                    f"(up to {self.settings.max_backoff:g}s)",
                    in_cycle=False,
                )

        watch = reachable.Watch(self._knock[what])

        def sleep(seconds: float) -> None:
            self._sleep_until_back(seconds, watch, what)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(
                lambda exc: isinstance(exc, errors) and not first_refusal(exc)
            ),
            wait=tenacity.wait_exponential(multiplier=0.1, max=self.settings.max_backoff)
            + tenacity.wait_random(0, 0.2),
            stop=lambda _state: self._stopping,
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
            self.metrics.reconnects.labels(what).inc()
        self._connected_once.add(what)
        return True

    # -- helpers ---------------------------------------------------------------------

    def _set_state(self, state: State, msg: str, *args: object) -> None:
        if state is self.state and state is not State.STOPPING:
            return
        self.state = state
        level = logging.WARNING if state in (State.DB_DOWN, State.BROKER_DOWN) else logging.INFO
        log.log(level, msg, *args)

    def _clean(self, exc: BaseException | None) -> str:
        # DrainErrors are built from masked URLs and scrubbed driver text already;
        # scrubbing again would also mask a user name that equals the password.
        if exc is None:
            return "unknown error"
        return str(exc) if isinstance(exc, DrainError) else scrub(str(exc), self._secrets)

    def _sleep(self, seconds: float) -> None:
        """Sleep, but return at once when asked to stop."""
        if self._stopping:
            return
        self._heartbeat = time.monotonic()
        select.select([self._wake_r], [], [], seconds)
        self._drain_wake_pipe()

    def _sleep_until_back(self, seconds: float, watch: reachable.Watch, what: str) -> None:
        """Back off for ``seconds``, but end the wait as soon as a server that
        was not listening listens again (drain.reachable)."""
        deadline = time.monotonic() + seconds
        while not self._stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._sleep(min(left, reachable.INTERVAL))
            if watch.came_back():
                log.info("%s is accepting connections again: reconnecting now", what)
                return

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except (BlockingIOError, OSError):
            pass


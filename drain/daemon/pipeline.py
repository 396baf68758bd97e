"""The batches between Postgres and the broker: one transaction per cycle.

A :class:`Pipeline` is the drain's data path while it leads. Each
:meth:`Pipeline.cycle` is one REPEATABLE READ transaction on the lock's own
session: move expired rows to dead_jobs (when due), fetch up to ``batch_size``
rows from the low-water marks (drain.postgres.keyset), build and publish them (a row
that can never become a message goes to dead_jobs), and delete exactly the rows
whose messages the broker confirmed, up to ``pipeline`` batches later. It also
keeps paused what the broker refuses, keyed by what failed (drain.daemon.holds,
drain.daemon.answers: their rows stay staged) and counts what was published.
Connections, the lock, failures and idling are the loop's business
(drain.daemon.runner); the pipeline only raises.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from drain.broker.batches import Batch, PublishResult
from drain.broker.outgoing import Message, PauseKey
from drain.broker.publisher import Publisher
from drain.celery import message, unsendable
from drain.celery.message import Destination
from drain.celery.routing import AppRouter, UnknownTask
from drain.daemon import confirms, operators, piles
from drain.daemon.answers import Answers
from drain.daemon.holds import Holds
from drain.daemon.metrics import Metrics
from drain.daemon.settle import Settle
from drain.daemon.tracing import Tracing
from drain.errors import (
    BatchConflict,
    BrokerBlocked,
    BrokerUnavailable,
    DatabaseUnavailable,
)
from drain.postgres import keyset
from drain.postgres.conflicts import Settled
from drain.postgres.rows import StagedRow
from drain.postgres.store import Store
from drain.settings.config import Settings

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

log = logging.getLogger("drain.pipeline")

#: Seconds a stopping drain waits for its last batch's confirms.
SETTLE_TIMEOUT = 3.0
#: Seconds between two looks at the marked priorities' heads (drain.postgres.keyset).
HEADS_INTERVAL = 0.25
#: Seconds between two looks for expired rows while none are found.
EXPIRE_INTERVAL = 1.0
#: A batch fetched longer ago than this (the process was paused, a declare
#: hung) is published only after one round trip proves the session, and so the
#: lock, is still there: a standby may have taken over meanwhile.
STALE_FETCH = 1.0


class Pipeline:
    """Fetch, publish and settle batches for one leading drain."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        publisher: Publisher,
        metrics: Metrics,
        *,
        on_cycle: Callable[[int, int], None] | None = None,
        on_fetch: Callable[[float, int], None] | None = None,
        on_expire: Callable[[float, int], None] | None = None,
        router: AppRouter | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.settings = settings
        #: What becomes of each job's OpenTelemetry context (drain.daemon.tracing); with
        #: ``tracer`` (the SDK's, drain.trace_context.configured_tracer) a span per message.
        self.tracing = Tracing(settings.trace_context, settings.trace_new_after, tracer)
        #: The user's Celery app's routing (drain.celery.routing), with ``--app``.
        self.router = router
        self.metrics = metrics
        self._store = store
        self._publisher = publisher
        self._on_cycle = on_cycle
        self._on_fetch = on_fetch
        self._on_expire = on_expire
        #: The fetch's low-water marks (drain.postgres.keyset).
        self.marks = keyset.Marks(enabled=settings.fetch_strategy == "keyset",
                                  rescan_interval=settings.rescan_interval)
        self.builder = message.Builder(
            origin=message.origin(), reply_to=str(uuid.uuid4()),
            max_priority=settings.queue_max_priority,
        )
        #: Batches published and not yet settled, oldest first (at most
        #: ``settings.pipeline - 1`` batches' worth of messages unconfirmed between
        #: cycles: drain.daemon.confirms).
        self.inflight: list[Batch] = []
        #: What stays staged for a while, keyed by what failed, and why (drain.daemon.holds).
        self.holds = Holds()
        #: What the broker's refusals, nacks and returns do to the holds.
        self.answers = Answers(self.holds, metrics, declare_mode=settings.queue_declare,
                               forget=publisher.forget)
        #: Which held rows the marks passed (drain.daemon.piles).
        self.piles = piles.HeldKeys()
        #: Many queues refused alike are one warning (drain.daemon.piles).
        self.refusals = piles.Refusals(self.holds, self.answers.refused_reason)
        #: What operators paused (drain.daemon.operators).
        self.operators = operators.OperatorPauses(self.holds)
        #: Rows the broker confirmed, this process's lifetime.
        self.published = 0
        #: Waits for the confirms of the batches in flight (drain.daemon.confirms).
        self.confirms = confirms.Confirms(settings, publisher, metrics)
        #: Removes rows only as they were read; holds out the ones that keep changing.
        self.settle = Settle(store, metrics)
        self._heads_at = 0.0
        self._expired_at = 0.0
        self._fetched_at = 0.0
        self._deferred = False

    def forget(self) -> None:
        """Drop the batches in flight: their rows stay staged, published again later."""
        self.inflight = []
        self.settle.forget()

    def cycle(self, *, stopping: bool = False) -> int:
        """One transaction: publish a new batch, settle what the broker confirmed.

        With ``pipeline`` P, the batch published in transaction k is confirmed
        while transactions k+1 .. k+P-1 fetch and publish the next ones, so the
        broker never waits for Postgres: each transaction deletes the rows whose
        messages the broker confirmed since the last one, and waits only while
        more than P-1 batches' worth are unconfirmed (drain.daemon.confirms).
        Rows still in flight are excluded from the fetch. A part batch (nothing
        left behind it to overlap with) settles everything in flight, itself
        included, in its own transaction: the latency of a lone job is one
        transaction, not P (except a slow queue's last messages, which later
        cycles collect as they come). In the same transaction, expired rows and
        rows that can never become a message move to dead_jobs. Returns how many
        rows were fetched or expired.

        ``stopping``: fetch nothing new, and give the batches in flight at most
        SETTLE_TIMEOUT to be confirmed (abandoning them is safe: their rows stay
        staged).
        """
        if not stopping:  # outside the batch's transaction (drain.daemon.piles)
            piles.try_due(self.holds, self.refusals, self._publisher)
        pending, self.inflight = self.inflight, []
        self._deferred = False
        start_error: BrokerUnavailable | None = None
        results: list[PublishResult] = []
        doomed: list[tuple[int, str, str]] = []
        rows: list[StagedRow] = []
        limit = self.settings.batch_size
        expired = Settled()
        # The last cycle ran out of time before the window had room (a broker that
        # confirms slowly): collect, fetch nothing (drain.daemon.confirms).
        full = bool(pending) and not self.confirms.room(pending)
        # Left out of the fetch and the expiry: the rows in flight, and the rows
        # held out after they changed under the drain (drain.postgres.conflicts), and the
        # rows held for a paused queue that the marks did not pass (drain.daemon.piles).
        exclude = [row_id for batch in pending for row_id in batch.row_ids]
        if self.router is not None and self.piles.recheck(self.router, self.holds):
            self.marks.reset()  # a route let go: its rows are fetched again
        exclude += self.settle.held() + self.piles.held_out(self.holds, self.marks.current())
        try:
            # The marks move only once the batch committed (drain.postgres.keyset, "Only what
            # committed moves a mark"): a rolled-back batch's expired rows come back.
            with self.marks.transaction(), self._store.batch():
                self._obey_operators()
                if not (stopping or full):
                    expired, rows = self._expire_and_fetch(exclude, limit)
                    self.settle.read(rows)
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
                self.confirms.collect(pending, results, everything=not full and (
                                          len(rows) < limit or bool(start_error)),
                                      timeout=SETTLE_TIMEOUT if stopping else None)
                deleted, buried = self.settle.remove(results, doomed)
        except (DatabaseUnavailable, BatchConflict):
            # Rolled back: every row stays staged, the ones the broker confirmed
            # too. They are published again, with the same task ids: count them.
            self.metrics.unsettled.inc(sum(len(r.confirmed) for r in results))
            self._publisher.forget_inflight()
            raise
        # Committed: the confirmed rows are gone, everything else stays staged.
        self.inflight = pending
        self.settle.committed([i for batch in pending for i in batch.row_ids],
                              expired, deleted, buried, doomed)
        for result in results:
            self._account(result)
        error = start_error or next((r.error for r in results if r.error), None)
        if error is not None:
            raise error
        if self._deferred:
            return limit  # queues left undeclared: no idling before the next batch
        return max(len(rows), len(expired.done) + len(expired.left))

    @property
    def owed(self) -> bool:
        """Batches in flight that the next cycle waits for (not only a slow queue's
        last messages, which it collects as they come): the loop does not idle."""
        return confirms.owed(self.inflight)

    def _obey_operators(self) -> None:
        """Read the operators' pauses (drain.postgres.pauses) when they changed, in
        this batch's snapshot: a queue or task paused before it began is not
        published by it, nor by any batch after, until it is resumed."""
        pauses = self._store.pauses()
        if pauses is not None:
            self.operators.apply(pauses)

    def _expire_and_fetch(self, exclude: list[int],
                          limit: int) -> tuple[Settled, list[StagedRow]]:
        """Move expired rows to dead_jobs (when due), then fetch the next batch."""
        found, expired = 0, Settled()
        if self._expire_due():
            started = time.perf_counter()
            found, expired = self._store.expire(exclude, limit, self.marks.current())
            if self._on_expire is not None:
                self._on_expire(time.perf_counter() - started, len(expired.done))
            self._expired_at = time.monotonic() if found < limit else 0.0
        # A full batch expired: more expired rows may remain, which the fetch
        # would have to skip one by one. Move them first (the next cycle follows
        # at once) and fetch once they are gone.
        if found >= limit:
            return expired, []
        return expired, self._fetch(limit, exclude)

    def _expire_due(self) -> bool:
        """Look for expired rows at most every EXPIRE_INTERVAL while there are none
        (the fetch leaves them out meanwhile), at once while a batch of them remains."""
        return time.monotonic() - self._expired_at >= EXPIRE_INTERVAL

    def _fetch(self, limit: int, exclude: list[int]) -> list[StagedRow]:
        """Fetch the next batch and move the low-water marks (drain.postgres.keyset)."""
        started = time.perf_counter()
        marks = self.marks  # with --fetch-strategy head they plan from the head, keep none
        now_paused = self.holds.now_paused()
        # Without --app a paused queue is also the staged queue: left out by name too.
        names = ([] if self.router is not None else
                 sorted(key.queue for key in now_paused if key.queue))
        # The marks skip the paused keys' rows (by name, by route, held by id), and go
        # back to the start once one is resumed, not the moment its pause runs out: a
        # declare tries it first (drain.daemon.piles.try_due).
        # The tasks an operator paused are left out by name, and skipped alike.
        tasks = self.operators.task_names()
        skipped_tasks = self.operators.skipped()
        skipped = sorted(key.queue or str(key) for key in now_paused) + skipped_tasks
        marks.paused(sorted(key.queue or str(key) for key in self.holds.paused)
                     + skipped_tasks)
        rows = self._store.fetch(limit, exclude, names, marks.plan(time.monotonic()),
                                 held_routes=self.piles.held_routes, paused_tasks=tasks)
        now = time.monotonic()
        marks.fetched([row.priority for row in rows if row.ready], now)
        # The marks move on a look at the heads now and then, not per batch:
        # spare the round trip on most fetches.
        if now - self._heads_at >= HEADS_INTERVAL and marks.enabled:
            self._heads_at = now
            current = marks.current()
            if current.priorities:
                heads, xmin = self._store.heads(current, names, self.piles.above,
                                                self.piles.held_routes, tasks)
                marks.observe(heads, xmin, skipped)
            marks.observe_timed(*self._store.timed_heads(current))
        self._fetched_at = now
        elapsed = time.perf_counter() - started
        self.metrics.fetch_seconds.observe(elapsed)
        if self._on_fetch is not None:
            self._on_fetch(elapsed, len(rows))
        return rows

    def _start(self, rows: list[StagedRow], doomed: list[tuple[int, str, str]]) -> Batch | None:
        """Declare the rows' queues and publish the rows whose keys are not paused.

        With an app, each row goes where the app routes it; a refused declare
        pauses that queue's key (drain.daemon.holds), and the rows routed to a
        paused key are held out of the fetch by id. A row the broker could never
        accept is not even routed (drain.celery.unsendable)."""
        rows = unsendable.screen(rows, doomed, time.time())
        destinations = self._route(rows, doomed) if self.router is not None else {}
        # Each row with the queue declared for it and its pause key, worked out once
        # (one key per queue: a batch has thousands of rows and a few queues).
        targets: list[tuple[StagedRow, str, PauseKey]] = []
        keys: dict[str, PauseKey] = {}
        for row in rows:
            if self.router is None:
                queue = row.queue
                key = keys.get(queue)
                if key is None:
                    key = keys[queue] = PauseKey(queue)
                targets.append((row, queue, key))
            elif row.id in destinations:
                where = destinations[row.id]
                targets.append((row, where.queue,
                                PauseKey.of(where.queue, where.exchange, where.routing_key)))
        paused = set(self.holds.now_paused())
        wanted = {queue for _, queue, key in targets if key not in paused}
        refused = self._publisher.declare(wanted, until=time.monotonic() + piles.DECLARE_BUDGET)
        self.refusals.pause(refused)
        # Queues left for the next batches (drain.daemon.piles): their rows stay staged,
        # and the next cycle follows at once (cycle()).
        later = self._publisher.undeclared(wanted) - set(refused)
        self._deferred = bool(later)
        paused = set(self.holds.now_paused())
        router = self.router
        # The routes whose rows all go to one paused key whatever their arguments are
        # held whole (drain.daemon.piles, uniform_routes); a router function's answer
        # is asked again while they are.
        whole = (piles.uniform_routes(router, targets, paused)
                 if router is not None and paused
                 and any(key in paused for _, _, key in targets) else set())
        asked = router is not None and not router.static
        held = self.holds.rows
        if held or paused:  # else nothing to forget or to hold: spare a pass per row
            for row, _, key in targets:
                held.pop(row.id, None)
                if key in paused:
                    held[row.id] = key  # out of the fetch while it is paused
                    self.piles.hold(row, key, asked=asked, by_route=bool(whole)
                                    and piles.route_key(row) in whole)
                    self._heads_at = 0.0  # the next look lets the marks pass it
        publishable = [(row, queue) for row, queue, key in targets
                       if key not in paused and queue not in later]
        if not publishable:
            return None
        self._prove_lock()
        sending = [row for row, _ in publishable]
        tracing = self.tracing
        tracing.begin_batch(sending)
        try:
            return self._publisher.start(
                self._messages(sending, doomed, destinations),
                queues={queue for _, queue in publishable},
                count=len(publishable),
            )
        finally:
            tracing.end_batch(len(publishable), self.metrics.job_wait_seconds)

    def _route(self, rows: list[StagedRow],
               doomed: list[tuple[int, str, str]]) -> dict[int, Destination]:
        """Each row's destination in the app (drain.celery.routing); a task the app does
        not know goes to ``doomed`` as 'unknown_task', a row it cannot route as
        'invalid'."""
        router = self.router
        assert router is not None
        found: dict[int, Destination] = {}
        for row in rows:
            try:
                found[row.id] = router.destination(row)
            except UnknownTask as exc:
                doomed.append((row.id, "unknown_task", str(exc)[:1000]))
            except Exception as exc:
                doomed.append((row.id, "invalid",
                               f"routing: {type(exc).__name__}: {exc}"[:1000]))
        return found

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
        self, rows: list[StagedRow], doomed: list[tuple[int, str, str]],
        destinations: dict[int, Destination],
    ) -> Iterator[Message]:
        """Build each row's message; a row that can never be one goes to ``doomed``."""
        now = time.time()
        limit = self.settings.max_message_size
        tracing = self.tracing
        traced_batch = tracing.batch_traced  # else no row is: spare a call per row
        build = self.builder.build
        for row in rows:
            destination = destinations.get(row.id) if destinations else None
            traced = tracing.message(row, destination, now) if traced_batch else None
            try:
                built = build(row, now=now, destination=destination,
                              trace=None if traced is None else traced.headers)
            except Exception as exc:
                if traced is not None:
                    tracing.failed(traced, exc)
                doomed.append((row.id, "invalid", f"{type(exc).__name__}: {exc}"[:1000]))
                continue
            if len(built.body) > limit:
                detail = (f"message body of {len(built.body)} bytes exceeds "
                          f"max_message_size ({limit} bytes)")
                if traced is not None:
                    tracing.failed(traced, ValueError(detail))
                doomed.append((row.id, "too_large", detail))
                continue
            if traced is not None:
                tracing.sent(traced, len(built.body))
            yield built

    # -- what the broker refuses (drain.daemon.holds, drain.daemon.answers) ----------------

    @property
    def paused(self) -> dict[PauseKey, tuple[float, int, str]]:
        """key -> (paused until (monotonic), times paused, last reason)."""
        return self.holds.paused

    def _account(self, result: PublishResult) -> None:
        self.published += len(result.confirmed)
        self.metrics.published.inc(len(result.confirmed))
        self.metrics.unroutable.inc(len(result.returned))
        self.metrics.nacked.inc(result.nacked)
        self.answers.settle(result)
        if self._on_cycle is not None:
            self._on_cycle(len(result.confirmed) + len(result.returned) + result.nacked,
                           len(result.confirmed))

"""The drain's Prometheus metrics, and the sampler that reads the database for them.

Two kinds of numbers, and what they cost:

* **Counted by the loop** (counters, histograms, the lock gauges): updated in
  memory as batches go by; reading them costs the database nothing.
* **Sampled** (backlog, oldest staged age, dead jobs, the oldest open
  transaction, dead tuples): read every ``interval`` seconds (15 s by default)
  by :class:`Sampler` on its own short-lived connection, never per batch. The
  backlog is an exact count only while the table is small; above
  ``drain.postgres.status.ESTIMATE_ABOVE`` rows (by ``n_live_tup``) the total is
  ``n_live_tup`` and the groups are scaled from a ``TABLESAMPLE`` of the table,
  and ``drain_backlog_estimated`` says so.

Every drain process (the leader and its standbys) exposes all of them; only
the leader's counters move. Each :class:`Metrics` has its own registry, so
several drains in one process (tests) do not collide.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from drain.errors import ConfigError, DrainError, PermissionDenied
from drain.postgres import status as drain_status
from drain.settings.config import Settings

log = logging.getLogger("drain.metrics")

#: Backlog groups exported with their own labels; the rest add up under "other".
MAX_GROUPS = 20
#: History kept for the status page: one point per sample.
HISTORY_SECONDS = 20 * 60

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            10.0, 30.0)
_WAIT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
         900.0, 3600.0)
_ROWS = (1, 10, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
#: The reasons a row is dead-lettered for (staging_schema.sql, dead_jobs).
DEAD_REASONS = ("expired", "too_large", "invalid", "unknown_task", "refused")
#: The reply codes a broker refuses a publish with (drain.broker.refusal): 404 no
#: exchange, 406 a precondition (a message the queue refuses), 403 no permission.
PUBLISH_REFUSED_CODES = ("403", "404", "406")
#: ... and a queue declaration with: 406 other arguments, 405 an exclusive queue of
#: another connection, 403 an amq.* name or no permission; "other" for the rest.
DECLARE_REFUSED_CODES = ("403", "405", "406", "other")


class Metrics:
    """Every metric of one drain process, on a registry of its own."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=registry)

        # Counted by the loop.
        self.published = counter("drain_published", "Rows the broker confirmed (counted).")
        self.deleted = counter(
            "drain_deleted", "Rows deleted from staged_jobs after the broker confirmed them.")
        self.dead_lettered = counter(
            "drain_dead_lettered",
            "Rows moved to dead_jobs by this process, by reason (expired, too_large, invalid, "
            "unknown_task, refused).",
            ("reason",))
        self.expired = counter(
            "drain_expired", "Rows that expired before publishing (also in dead_lettered).")
        self.unroutable = counter(
            "drain_unroutable", "Messages the broker returned unroutable (no queue bound); "
            "their rows stay staged.")
        self.nacked = counter(
            "drain_nacked", "Messages the broker nacked; their rows stay staged.")
        self.publish_refused = counter(
            "drain_publish_refused",
            "Publishes the broker refused by closing the channel, by reply code (404 no "
            "exchange, 406, 403...): dead-lettered ('refused') or held.", ("code",))
        self.declare_refused = counter(
            "drain_declare_refused",
            "Queue declarations the broker refused, by reply code (406: the queue exists "
            "with other arguments; 403: an amq.* name, or no configure permission): the "
            "rows routed there stay staged, their queue paused.", ("code",))
        self.unsettled = counter(
            "drain_unsettled_rows", "Rows whose messages the broker confirmed but whose "
            "delete was rolled back (session lost, a conflicting change): they are published "
            "again with the same task id, duplicates a consumer must expect.")
        self.conflicted = counter(
            "drain_conflicted_rows", "Rows the drain left staged because they changed under "
            "it (updated after it read them; a row only locked is pending, not changed): published "
            "again as they are now, with the same task id; held out of the fetch a while.")
        self.stale_batches = counter(
            "drain_stale_batches", "Batches not published because, after a pause between "
            "fetch and publish, the session (and the lock) could not be proved alive.")
        self.reconnects = counter(
            "drain_reconnects", "Successful reconnections after a lost connection, by target "
            "(database, broker).", ("target",))
        self.batch_rows = histogram("drain_batch_rows", "Rows fetched per batch.", _ROWS)
        self.cycle_seconds = histogram(
            "drain_cycle_seconds", "Wall time of one cycle (one transaction).", _SECONDS)
        self.fetch_seconds = histogram(
            "drain_fetch_seconds", "Wall time of a batch's fetch queries.", _SECONDS)
        self.publish_seconds = histogram(
            "drain_publish_seconds", "Wall time to build and publish a batch.", _SECONDS)
        self.job_wait_seconds = histogram(
            "drain_job_wait_seconds",
            "How long the longest-waiting job of each published batch waited in staged_jobs "
            "(since it was staged, or became due), its trace id as the exemplar when it was "
            "sampled (OpenMetrics).", _WAIT)
        self.confirm_seconds = histogram(
            "drain_confirm_seconds",
            "Wall time spent waiting for the previous batch's confirms.", _SECONDS)
        self.lock_held = gauge(
            "drain_lock_held", "1 if this process holds its lock (its lane's, with lanes).")
        self.lock_held_seconds = gauge(
            "drain_lock_held_seconds", "Seconds since this process took its lock (0: not held).")
        self.delete_pending = gauge(
            "drain_delete_pending_rows", "Rows the drain published (or is moving to dead_jobs) "
            "whose delete waits for a lock another transaction holds (SELECT ... FOR UPDATE, "
            "LOCK TABLE): delivered once, kept out of the fetch, deleted once the lock ends.")
        self.lanes = gauge("drain_lanes", "The number of lanes this drain is split in (1: none).")
        self.last_cycle = gauge(
            "drain_last_cycle_timestamp_seconds",
            "Unix time of the last successful cycle (0: none yet).")
        self.up = gauge("drain_up", "1 while the drain loop runs.")
        self.broker_blocked = gauge(
            "drain_broker_blocked", "1 while the broker blocks this drain's publishing "
            "(a RabbitMQ memory or disk alarm); jobs stay staged meanwhile.")
        # Sampled.
        self.backlog = gauge(
            "drain_backlog_rows", "Staged rows (sampled; an estimate when "
            "drain_backlog_estimated is 1).")
        self.backlog_estimated = gauge(
            "drain_backlog_estimated", "1 if drain_backlog_rows and the groups are estimates.")
        self.backlog_groups = gauge(
            "drain_backlog_group_rows", f"Staged rows by queue and tag (sampled; the "
            f"{MAX_GROUPS} largest groups, the rest as other/other; scaled from a table "
            "sample when drain_backlog_estimated is 1).", ("queue", "tag"))
        self.oldest_age = gauge(
            "drain_backlog_oldest_age_seconds",
            "How long the oldest due row has waited: since it was staged, or since its "
            "not_before for delayed rows (sampled; 0 when nothing is due).")
        self.dead_jobs = gauge(
            "drain_dead_jobs_rows", "Rows in dead_jobs now, by reason (sampled; scaled from a "
            "table sample above 100,000 rows, as the backlog).", ("reason",))
        self.paused = gauge(
            "drain_operator_paused", f"1 for each queue or task whose publishing an "
            f"operator paused (`drain pause`; sampled; the first {MAX_GROUPS}, the rest "
            "as other/other with their count).", ("kind", "name"))
        self.oldest_transaction = gauge(
            "drain_oldest_transaction_age_seconds",
            "Age of the oldest open transaction in the database (sampled; other roles' "
            "sessions need pg_read_all_stats). It keeps vacuum from removing drained rows.")
        self.dead_tuples = gauge(
            "drain_staged_jobs_dead_tuples",
            "Dead tuples in staged_jobs (sampled from pg_stat_user_tables, an estimate).")
        self.sampled_at = gauge(
            "drain_sample_timestamp_seconds", "Unix time of the last successful sample.")
        # Labelled series of known label values exist from the start (at 0), so
        # that rate() and increase() see their first step (a series born at 1 would
        # look like no increase) and a dashboard shows 0, not "No data". A reply code
        # not listed gets its series when it first happens.
        for reason in DEAD_REASONS:
            self.dead_lettered.labels(reason)
            self.dead_jobs.labels(reason)
        for target in ("database", "broker"):
            self.reconnects.labels(target)
        for code in PUBLISH_REFUSED_CODES:
            self.publish_refused.labels(code)
        for code in DECLARE_REFUSED_CODES:
            self.declare_refused.labels(code)
        self._lock_since: float | None = None
        self.lock_held_seconds.set_function(
            lambda: time.time() - self._lock_since if self._lock_since is not None else 0.0)

    def holding_lock(self, held: bool) -> None:
        if held and self._lock_since is None:
            self._lock_since = time.time()
        elif not held:
            self._lock_since = None
        self.lock_held.set(1 if held else 0)

    def set_sample(self, status: dict[str, Any]) -> None:
        """Set the sampled gauges from a :func:`drain.postgres.status.read` result."""
        self.backlog.set(status["backlog"])
        self.backlog_estimated.set(1 if status["backlog_estimated"] else 0)
        groups: collections.Counter[tuple[str, str]] = collections.Counter()
        for group in status["by_group"]:
            groups[(group["queue"], group["tag"] or "")] += group["count"]
        self.backlog_groups.clear()
        for rank, ((queue, tag), count) in enumerate(groups.most_common()):
            key = (queue, tag) if rank < MAX_GROUPS else ("other", "other")
            self.backlog_groups.labels(*key).inc(count)
        self.oldest_age.set(status["oldest_age_seconds"] or 0)
        self.dead_jobs.clear()
        for reason in DEAD_REASONS:  # 0, not absent, when there are none
            self.dead_jobs.labels(reason)
        for reason, count in status["dead_by_reason"].items():
            self.dead_jobs.labels(reason).set(count)
        self.paused.clear()
        for rank, pause in enumerate(status.get("pauses", [])):
            key = (pause["kind"], pause["name"]) if rank < MAX_GROUPS else ("other", "other")
            self.paused.labels(*key).inc()
        oldest = status["oldest_transaction"]  # None: no other transaction is open
        self.oldest_transaction.set(oldest["age_seconds"] if oldest else 0)
        self.dead_tuples.set(status["dead_tuples"])
        self.sampled_at.set(time.time())


class Sampler:
    """Reads :func:`drain.postgres.status.read` every ``interval`` seconds in a thread.

    Keeps the last result and a short history (backlog, published counter) for
    the status page. A failure is logged once, and the next sample retries;
    but a permission the role lacks (PermissionDenied) is kept in :attr:`fatal`
    and ``on_fatal`` is called: no retry would fix it (``drain run`` exits 5).
    """

    def __init__(self, settings: Settings, metrics: Metrics, interval: float,
                 published: Callable[[], int],
                 on_fatal: Callable[[DrainError], None] | None = None) -> None:
        if not (math.isfinite(interval) and interval > 0):
            raise ConfigError(f"metrics interval must be positive, got {interval}")
        self._metrics = metrics
        self._interval = interval
        self._published = published
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drain-sampler", daemon=True)
        self._lock = threading.Lock()
        self._reader = drain_status.StatusReader(settings, application_name="drain metrics")
        self._error: str | None = None
        self._on_fatal = on_fatal
        #: The error that stopped the sampling for good (a missing grant).
        self.fatal: DrainError | None = None
        self.last: dict[str, Any] | None = None
        self.sampled_at: float | None = None
        self.history: collections.deque[dict[str, float]] = collections.deque(
            maxlen=max(2, int(HISTORY_SECONDS / interval) + 1))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._reader.close()

    def snapshot(self) -> tuple[dict[str, Any] | None, float | None, list[dict[str, float]]]:
        with self._lock:
            return self.last, self.sampled_at, list(self.history)

    def sample(self) -> None:
        """Take one sample now (the thread calls this every interval)."""
        try:
            status = self._reader.read()
        except PermissionDenied as exc:
            self._give_up(exc)
            return
        except DrainError as exc:
            if str(exc) != self._error:
                log.warning("metrics sample failed: %s; retrying every %gs", exc, self._interval)
                self._error = str(exc)
            return
        if self._error is not None:
            log.info("metrics sample working again")
            self._error = None
        self._metrics.set_sample(status)
        now = time.time()
        with self._lock:
            self.last = status
            self.sampled_at = now
            self.history.append(
                {"t": now, "backlog": status["backlog"], "published": self._published()})

    def _give_up(self, exc: PermissionDenied) -> None:
        log.error("metrics sample failed: %s; no retry can fix it", exc)
        self.fatal = exc
        self._stop.set()
        if self._on_fatal is not None:
            self._on_fatal(exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self._interval)


"""Postgres primary failover, on a real streaming replica (tests/replication.py).

* Under a steady producer and a real Celery worker, the primary stops
  (immediate shutdown: a crash) and its replica is promoted: the drain, given
  a multi-host URL with ``target_session_attrs=read-write``, finds the new
  primary by itself and every job the new primary holds is executed. Jobs the
  old primary acknowledged but never shipped to the replica are the database's
  loss (asynchronous replication), counted apart.
* A drain pointed at a standby alone says so once, stays connected and ready
  as a standby, and leads once the standby is promoted.
* With ``target_session_attrs=read-write`` and only a standby, libpq refuses
  every connection: one clear line, attempts spaced by the backoff.

The figures are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import drain
from tests import pg_server, replication, roles, support

#: How long the primary is gone before the replica is promoted (a failover
#: manager's detection time, kept short here).
DETECTION = 1.0
#: Seconds the producer goes on staging on the new primary.
AFTER_PROMOTION = 3.0
#: Seconds a drain is watched for reconnects while it waits on a standby.
WATCH = 3.0

_SUCCEEDED = re.compile(r"Task celery_app\.record\[([0-9a-f-]{36})\] succeeded")

#: Never set: waiting on it is an interruptible pause for deliberately timed faults.
_FAULT_CLOCK = threading.Event()


def _fault_pause(seconds: float) -> None:
    """Let a fault last: the fault itself, not a synchronisation."""
    _FAULT_CLOCK.wait(max(seconds, 0.0))


@pytest.fixture
def pair() -> Iterator[replication.Pair]:
    with replication.replicated_pair() as running:
        yield running


class Producer(threading.Thread):
    """An application staging one job per transaction at a steady rate through a
    multi-host URL, reconnecting whenever its connection fails.

    With each job it writes a row of its own table, ``produced``: the jobs a
    database kept are exactly its ``produced`` rows. A transaction whose COMMIT
    failed is in doubt (it may or may not have committed).
    """

    def __init__(self, url: str, queue: str, rate: float) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.queue = queue
        self.rate = rate
        #: task id -> time.monotonic() of its acknowledged commit
        self.committed: dict[str, float] = {}
        self.in_doubt: set[str] = set()
        self.failures = 0
        self.errors: list[BaseException] = []
        self._halt = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        n = 0
        next_at = time.monotonic()
        try:
            while not self._halt.is_set():
                task_id = str(uuid.uuid4())
                committing = False
                try:
                    if conn is None or conn.closed:
                        conn = psycopg.connect(self.url, autocommit=True, connect_timeout=2)
                        next_at = time.monotonic()  # no burst after an outage
                    with conn.transaction():
                        drain.stage(conn, "celery_app.record", [n], {"i": n},
                                    queue=self.queue, task_id=task_id)
                        conn.execute("INSERT INTO produced (task_id, n) VALUES (%s, %s)",
                                     (task_id, n))
                        committing = True
                    with self._lock:
                        self.committed[task_id] = time.monotonic()
                except psycopg.OperationalError:
                    self.failures += 1
                    if committing:
                        self.in_doubt.add(task_id)
                    if conn is not None:
                        conn.close()
                    conn = None
                    self._halt.wait(0.05)  # reconnect pacing (the workload, not a sync)
                n += 1
                next_at += 1 / self.rate
                self._halt.wait(max(next_at - time.monotonic(), 0.0))
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            if conn is not None:
                conn.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(30)
        assert not self.is_alive(), "the producer did not stop"
        assert not self.errors, f"staging failed: {self.errors[0]!r}"

    def committed_count(self) -> int:
        with self._lock:
            return len(self.committed)


def _ids(url: str, query: str) -> collections.Counter[str]:
    with psycopg.connect(url, connect_timeout=5) as conn:
        return collections.Counter(str(r[0]) for r in conn.execute(query))


def _executed(url: str) -> collections.Counter[str]:
    """Task ids in celery_app's executed_jobs (the worker creates it on its first task)."""
    return collections.Counter(row["task_id"] for row in support.executed(url))


def _published(port: int) -> float:
    """The drain's drain_published_total, from its /metrics."""
    status, body = support.http_get(port, "/metrics")
    assert status == 200
    found = re.search(r"^drain_published_total (\S+)$", body, re.MULTILINE)
    assert found, "no drain_published_total in /metrics"
    return float(found.group(1))


def _connections(server: pg_server.Server, pid: int) -> int:
    """Sessions the drain process ``pid`` opened on ``server`` (log_connections)."""
    return server.log.read_text(errors="replace").count(
        f"connection authorized: user={roles.RUNNER} database={replication.DBNAME} "
        f"application_name=drain pid={pid} ")


def _start_drain(spawn: Any, url: str) -> tuple[support.Process, int]:
    """``drain run`` on ``url``, with its metrics port (returned with it)."""
    port = support.free_port()
    proc: support.Process = spawn(support.drain_argv("run", "--poll-interval", "0.2"),
                                  support.drain_env(url, DRAIN_METRICS_PORT=str(port)), "drain")
    return proc, port


def _promote_and_drain(pair: replication.Pair, queue: str, proc: support.Process,
                       jobs: int) -> tuple[dict[str, int], float, float]:
    """Stage ``jobs`` on the primary, let the replica replay them, stop the primary
    and promote the replica; the drain must lead and publish them. Returns what was
    staged and how long after the promotion the drain led and had drained."""
    staged = support.stage_backlog(pair.primary.url(), queue, jobs)
    support.wait_for(pair.caught_up, 30, "the replica to replay the staged jobs")
    pair.primary.stop("fast")
    pair.replica.promote()
    promoted_at = time.monotonic()
    proc.wait_for_output("active: took the drain lock", timeout=30)
    led = time.monotonic() - promoted_at
    support.wait_for(lambda: support.staged_count(pair.replica.url()) == 0, 30,
                     "the drain to publish the staged jobs")
    return staged, led, time.monotonic() - promoted_at


def _readyz(port: int) -> tuple[int, dict[str, Any]]:
    status, body = support.http_get(port, "/readyz")
    return status, json.loads(body)


# -- 1. the primary crashes, the replica is promoted -----------------------------------------


def test_primary_failover_under_load(
    pair: replication.Pair, queue: str, spawn: Any
) -> None:
    url = pair.both_url(target_session_attrs="read-write")
    worker = spawn(support.celery_argv(queue), support.drain_env(url), "worker")
    proc, port = _start_drain(spawn, url)
    worker.wait_for_output("ready.", timeout=60)
    proc.wait_for_output("broker connected", timeout=30)
    producer = Producer(url, queue, rate=100)
    producer.start()
    try:
        support.wait_for(lambda: sum(_executed(pair.primary.url()).values()) >= 200, 60,
                         "jobs to flow through the old primary")
        mark = len(proc.output())
        stopped_at = time.monotonic()
        pair.primary.stop("immediate")  # a crash: no shutdown checkpoint, sessions cut
        proc.wait_for_output("lock released, batch rolled back", timeout=30, after=mark)
        published_at_loss = _published(port)
        support.wait_for(pair.replayed_all_received, 30,
                         "the replica to replay all the WAL it received")
        with psycopg.connect(pair.replica.url(), connect_timeout=5) as conn:
            replicated = {str(r[0]) for r in conn.execute("SELECT task_id FROM produced")}
        _fault_pause(DETECTION - (time.monotonic() - stopped_at))
        promoting_at = time.monotonic()
        pair.replica.promote()
        promoted_at = time.monotonic()
        proc.wait_for_output("active: took the drain lock", timeout=60, after=mark)
        led_at = time.monotonic()
        support.wait_for(lambda: _published(port) > published_at_loss, 60,
                         "the drain to publish through the new primary", interval=0.01)
        resumed_at = time.monotonic()
        _fault_pause(AFTER_PROMOTION)
    finally:
        producer.stop()
    new = pair.replica.url()
    held = set(_ids(new, "SELECT task_id FROM produced"))
    # Acknowledged before the promotion began: by the old primary; after: by the new one.
    before = {t for t, at in producer.committed.items() if at < promoting_at}
    after_promotion = set(producer.committed) - before

    def delivered() -> set[str]:
        return set(_executed(new)) | set(_SUCCEEDED.findall(worker.output()))

    support.wait_for(lambda: support.staged_count(new) == 0 and held <= delivered(), 90,
                     "every job the new primary holds to be executed")
    executions = collections.Counter(_SUCCEEDED.findall(worker.output()))
    done = delivered()
    acked = set(producer.committed)
    assert held <= acked | producer.in_doubt, "the new primary holds a job never committed"
    assert done <= acked | producer.in_doubt, "a job never committed was executed"
    assert held <= done
    lost = acked - held  # acknowledged by the old primary, never replicated
    assert lost <= before, "a job committed on the new primary went missing"
    out = proc.output()[mark:]
    assert proc.proc.poll() is None, "the drain exited"
    lines = [x for x in out.splitlines() if "drain.outages" in x and "unreachable" in x]
    assert len(lines) == 1, "one line for the outage, not one per attempt"
    assert "Traceback" not in out
    line = lines[0]
    duplicates = sum(count - 1 for count in executions.values())
    print(f"\n[failover] {len(acked)} jobs committed ({len(before)} before the crash, "
          f"{len(after_promotion)} after the promotion, {len(producer.in_doubt)} in doubt, "
          f"{producer.failures} staging failures); replica promoted "
          f"{promoted_at - stopped_at:.2f}s after the primary stopped; the drain led "
          f"{led_at - stopped_at:.2f}s and published through the new primary "
          f"{resumed_at - stopped_at:.2f}s after the stop ({resumed_at - promoted_at:.2f}s "
          f"after the promotion); lost by the database (acknowledged, never replicated): "
          f"{len(lost)} ({len(lost & done)} of them executed before the crash); "
          f"{len(replicated & before)} of {len(before)} pre-crash commits on the "
          f"replica; {duplicates} duplicate executions; log: {line.split(': ', 1)[-1]}")


# -- 2. a drain pointed at a standby ------------------------------------------------------------


def test_a_drain_on_a_standby_waits_ready_and_leads_once_promoted(
    pair: replication.Pair, queue: str, spawn: Any
) -> None:
    proc, port = _start_drain(spawn, pair.replica.url())
    proc.wait_for_output("is a read-only standby (in recovery)", timeout=30)
    support.wait_for(lambda: _readyz(port)[0] == 200, 10, "/readyz to answer")
    _fault_pause(WATCH)  # six standby intervals
    out = proc.output()
    status, ready = _readyz(port)
    assert proc.proc.poll() is None, "the drain exited"
    assert (status, ready["role"], ready["state"]) == (200, "standby", "standby")
    masked = roles.url(pair.replica.url(), roles.RUNNER)  # the drain's role
    assert out.count(f"standby: database {masked} is a read-only standby (in recovery); "
                     "waiting for it to be promoted") == 1
    assert "unreachable" not in out and " failed: " not in out and "Traceback" not in out
    assert _connections(pair.replica, proc.pid) == 1, "the drain reconnected"
    assert "took the drain lock" not in out

    staged, led, drained = _promote_and_drain(pair, queue, proc, 50)
    copies = support.check_at_least_once(support.drain_queue(queue), staged)
    assert _connections(pair.replica, proc.pid) == 1, "promotion needs no new session"
    assert proc.output().count("was promoted: it accepts writes now") == 1
    print(f"\n[standby] one log line and one session over {WATCH:.0f}s as a ready standby; "
          f"took the lock {led:.2f}s after the promotion, published {len(staged)} jobs "
          f"{drained:.2f}s after it ({sum(copies.values()) - len(copies)} duplicates)")


def test_read_write_url_with_only_a_standby_retries_with_backoff(
    pair: replication.Pair, queue: str, spawn: Any
) -> None:
    url = pair.replica.url(target_session_attrs="read-write")
    proc, port = _start_drain(spawn, url)
    proc.wait_for_output("retrying with backoff", timeout=30)
    started = time.monotonic()
    _fault_pause(2 * WATCH)
    watched = time.monotonic() - started
    out = proc.output()
    attempts = _connections(pair.replica, proc.pid)
    status, ready = _readyz(port)
    assert proc.proc.poll() is None, "the drain exited"
    assert (status, ready["state"]) == (503, "database down")
    lines = [x for x in out.splitlines() if "drain.outages" in x and "unreachable" in x]
    assert len(lines) == 1, "one line, not one per attempt"
    line = lines[0]
    assert f"database {roles.url(url, roles.RUNNER)} unreachable" in line
    assert "session is read-only" in line and "waiting for a primary" in line
    # Backoff from 0.1 s, doubling: about 7 attempts in 6 s. A storm would be hundreds.
    assert 3 <= attempts <= 12, f"{attempts} connection attempts in {watched:.1f}s"

    staged, led, _ = _promote_and_drain(pair, queue, proc, 20)
    support.check_at_least_once(support.drain_queue(queue), staged)
    print(f"\n[read-write, standby only] {attempts} connection attempts in {watched:.1f}s, one "
          f"log line; led {led:.2f}s after the promotion (backoff up to 10 s); "
          f"log: {line.split(': ', 1)[-1]}")

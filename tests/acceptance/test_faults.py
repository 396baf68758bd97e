"""The fault matrix: what the drain does when the broker, the network or Postgres fail.

Each test injects one kind of fault with a TCP proxy (the shared Postgres and
RabbitMQ are never touched) or a signal, and fails if a committed job is
lost, an uncommitted one is published, or the drain wedges. Time bounds from
the reliability issue are asserted with generous deadlines; the measured
figures are printed (``pytest -s`` shows them).

Every drain here runs with a password in its database URL (trust
authentication ignores it) and ``guest:guest`` in its broker URL; an autouse
fixture scans the output of every drain process of every test for them.
"""

from __future__ import annotations

import functools
import json
import random
import re
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import drain
from tests import roles, support

#: The password in every drain's database URL; it must never reach a log.
DB_SECRET = "s3cr3t-db"

#: Never set: waiting on it is an interruptible pause for deliberately timed faults.
_FAULT_CLOCK = threading.Event()

Messages = list[tuple[Any, Any, bytes]]


def _fault_pause(seconds: float) -> None:
    """Let a fault last (or wait before injecting one): the fault itself, not a sync."""
    _FAULT_CLOCK.wait(max(seconds, 0.0))


def _secret_db_url(db_url: str, port: int = support.PG_PORT) -> str:
    dbname = db_url.rsplit("/", 1)[1]
    return f"postgresql://{roles.RUNNER}:{DB_SECRET}@127.0.0.1:{port}/{dbname}"


def _run_drain(
    spawn: Any, db_url: str, *flags: str, db_port: int = support.PG_PORT,
    broker_port: int = support.BROKER_PORT,
    name: str = "drain", verbose: bool = False,
) -> support.Process:
    env = support.drain_env(_secret_db_url(db_url, db_port),
                            DRAIN_BROKER_URL=support.broker_url(broker_port))
    argv = support.drain_argv(*(["-v"] if verbose else []), "run", "--poll-interval", "0.2",
                              *flags)
    proc: support.Process = spawn(argv, env, name)
    return proc


@pytest.fixture(autouse=True)
def _no_secrets_in_drain_logs(processes: list[support.Process]) -> Iterator[None]:
    """After each test: stop its drains, then scan everything they printed."""
    yield
    lines = 0
    for proc in processes:
        proc.stop()
        out = proc.output()
        lines += out.count("\n")
        assert DB_SECRET not in out, f"database password in the output of {proc.log_path}"
        assert "guest:guest" not in out, f"broker password in the output of {proc.log_path}"
    if processes:
        print(f"[secrets] scanned {len(processes)} drain log(s), {lines} lines: no password")


# -- staging and checking ------------------------------------------------------------


def _staged_ids(db_url: str) -> set[str]:
    with psycopg.connect(db_url) as conn:
        return {str(r[0]) for r in conn.execute("SELECT task_id FROM staged_jobs")}


def _drain_backends(db_url: str) -> list[tuple[int, str]]:
    """(backend pid, application_name) of the drain sessions on this test's database."""
    dbname = db_url.rsplit("/", 1)[1]
    with psycopg.connect(support.ADMIN_URL, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid, application_name FROM pg_stat_activity "
            "WHERE datname = %s AND application_name LIKE 'drain pid=%%'", (dbname,)
        ).fetchall()
    return [(int(r[0]), str(r[1])) for r in rows]


def _lock_holder(db_url: str) -> int | None:
    """The OS pid of the drain that holds the lock (its application_name has since=)."""
    for _, name in _drain_backends(db_url):
        match = re.match(r"drain pid=(\d+) since=", name)
        if match:
            return int(match.group(1))
    return None


class Producer(threading.Thread):
    """An application staging jobs at a steady rate in small transactions.

    Each transaction stages 1..``per_txn`` jobs with :func:`drain.stage`; a share
    of them is rolled back on purpose. Records which task ids were committed and
    which were rolled back, and how long each transaction took.
    """

    def __init__(
        self, db_url: str, queue: str, *, rate: float, per_txn: int = 1,
        rollback_share: float = 0.0, seed: int | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.db_url = db_url
        self.queue = queue
        self.rate = rate
        self.per_txn = per_txn
        self.rollback_share = rollback_share
        self.rng = random.Random(seed)
        self.committed: dict[str, int] = {}
        self.rolled_back: set[str] = set()
        self.latencies: list[float] = []
        self.errors: list[BaseException] = []
        self._halt = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            with psycopg.connect(self.db_url, autocommit=True) as conn:
                n = 0
                next_at = time.monotonic()
                while not self._halt.is_set():
                    count = self.rng.randint(1, self.per_txn)
                    rollback = self.rng.random() < self.rollback_share
                    jobs: dict[str, int] = {}
                    began = time.monotonic()
                    with conn.transaction(force_rollback=rollback):
                        for _ in range(count):
                            task_id = drain.stage(conn, "celery_app.record", [n], {"i": n},
                                                  queue=self.queue)
                            jobs[str(task_id)] = n
                            n += 1
                    elapsed = time.monotonic() - began
                    with self._lock:
                        self.latencies.append(elapsed)
                        if rollback:
                            self.rolled_back.update(jobs)
                        else:
                            self.committed.update(jobs)
                    # Pacing to the target rate (the workload, not a synchronisation).
                    next_at += count / self.rate
                    self._halt.wait(max(next_at - time.monotonic(), 0.0))
        except BaseException as exc:
            self.errors.append(exc)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)
        assert not self.is_alive(), "the producer did not stop"
        assert not self.errors, f"staging failed: {self.errors[0]!r}"

    def committed_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.committed)


def _latency_figures(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (f"{len(ordered)} staging transactions: median {statistics.median(ordered) * 1000:.1f} "
            f"ms, p99 {p99 * 1000:.1f} ms, max {ordered[-1] * 1000:.1f} ms")


# -- 1. the broker away for a long while -------------------------------------------------


def test_broker_down_for_a_long_while_app_keeps_staging(
    db_url: str, queue: str, spawn: Any
) -> None:
    proxy = support.TcpProxy(support.BROKER_PORT).start()
    try:
        proc = _run_drain(spawn, db_url, broker_port=proxy.port)
        before = support.stage_backlog(db_url, queue, 10)
        support.wait_for(lambda: support.staged_count(db_url) == 0, 30,
                         "the drain to publish the first jobs")
        support.check_at_least_once(support.drain_queue(queue, timeout=0.5), before)

        producer = Producer(db_url, queue, rate=100)
        producer.start()
        proxy.refuse()  # RabbitMQ goes away: connections cut, port closed
        down_at = time.monotonic()
        mark = len(proc.output())
        proc.wait_for_output("rows stay staged", timeout=30, after=mark)
        _fault_pause(12 - (time.monotonic() - down_at))  # the outage lasts 12 s
        outage = time.monotonic() - down_at
        during = producer.committed_snapshot()
        assert support.queue_depth(queue) == 0, "published while the broker was away"
        assert support.staged_count(db_url) >= len(during) > 0

        proxy.restart()
        back_at = time.monotonic()
        producer.stop()
        staged = producer.committed_snapshot()
        support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                         "the backlog to drain once the broker is back")
        caught_up = time.monotonic() - back_at
        out = proc.output()[mark:]  # before stop(), which cuts once more
    finally:
        proxy.stop()
    copies = support.check_at_least_once(support.drain_queue(queue), staged)
    assert not producer.rolled_back
    assert out.count("broker connected") + out.count("broker back") >= 1
    assert out.count("unreachable") <= 1, "one line for the outage, not one per retry"
    worst = max(producer.latencies)
    print(f"\n[broker down] outage {outage:.1f}s, {len(during)} jobs staged meanwhile; "
          f"{_latency_figures(producer.latencies)}; backlog of {len(staged)} delivered "
          f"{caught_up:.1f}s after the broker came back "
          f"({sum(copies.values()) - len(copies)} duplicates)")
    assert worst < 5.0, f"a staging transaction took {worst:.2f}s while the broker was away"


# -- 2. the broker connection cut mid-batch, again and again -------------------------------


def _cut_until_drained(proxy: support.TcpProxy, db_url: str, what: str) -> int:
    """Cut every connection through ``proxy`` until the backlog is gone (120 s at most);
    returns how many cuts it took.

    Each cut waits for the drain to be back at work (a new connection accepted and rows
    deleted since the last cut), then lets it run a random 0-0.2 s. Cutting on a clock
    instead let a fast drain empty the backlog between two cuts; tied to progress, every
    cut hits a working drain and the number of cuts grows with the backlog."""
    rng = random.Random()
    cuts = 0
    deadline = time.monotonic() + 120
    left = support.staged_count(db_url)
    accepted = 0  # the connections in place before the first cut count
    while left > 0:
        def working(accepted: int = accepted, left: int = left) -> bool:
            rows = support.staged_count(db_url)
            return rows == 0 or (proxy.accepted > accepted and rows < left)
        support.wait_for(working, max(deadline - time.monotonic(), 0.1),
                         f"the drain to work again under {what} cuts")
        if support.staged_count(db_url) == 0:
            break
        _fault_pause(rng.uniform(0.0, 0.2))
        accepted = proxy.accepted
        proxy.cut()
        cuts += 1
        left = support.staged_count(db_url)
    return cuts


def test_broker_connection_cut_mid_batch_repeatedly(
    db_url: str, queue: str, spawn: Any
) -> None:
    staged = support.stage_backlog(db_url, queue, 20_000)
    proxy = support.TcpProxy(support.BROKER_PORT).start()
    try:
        proc = _run_drain(spawn, db_url, "--batch-size", "500", broker_port=proxy.port)
        proc.wait_for_output("broker connected", timeout=30)
        cuts = _cut_until_drained(proxy, db_url, "broker")
        connections = proxy.accepted
    finally:
        proxy.stop()
    copies = support.check_at_least_once(support.drain_queue(queue), staged)
    out = proc.output()
    mid_batch = out.count("lost mid-batch") + out.count("connection lost before the batch")
    print(f"\n[broker cuts] {cuts} cuts, {connections} broker connections, {mid_batch} batches "
          f"lost mid-way, {sum(copies.values()) - len(copies)} duplicates of {len(staged)} jobs")
    assert cuts >= 3, "the backlog drained before enough cuts happened; stage more"
    assert mid_batch >= 1, "no cut hit a batch in flight"


# -- 3. the broker stalls: nothing answers, nothing closes --------------------------------


def test_broker_stall_is_noticed_and_the_batch_abandoned(
    db_url: str, queue: str, spawn: Any
) -> None:
    staged = support.stage_backlog(db_url, queue, 20_000)
    proxy = support.TcpProxy(support.BROKER_PORT).start()
    try:
        proc = _run_drain(spawn, db_url, "--batch-size", "500", "--confirm-timeout", "3",
                          broker_port=proxy.port)
        support.wait_for(lambda: support.staged_count(db_url) < len(staged), 60,
                         "the drain to make progress")
        mark = len(proc.output())
        proxy.stall()  # no byte goes through, no socket closes, new connections hang too
        stalled_at = time.monotonic()
        proc.wait_for_output("none for 3s", timeout=60, after=mark)
        noticed = time.monotonic() - stalled_at
        # Abandoned without deleting: every row gone from staged_jobs is in the queue.
        remaining = _staged_ids(db_url)
        assert remaining, "the backlog drained before the stall; stage more"
        early = support.drain_queue(queue, timeout=0.5)
        assert set(staged) - remaining <= set(support.task_ids(early)), (
            "rows of an unconfirmed batch were deleted")
        notice = next(line for line in proc.output()[mark:].splitlines() if "none for 3s" in line)
        assert "rows stay staged" in notice
        proxy.resume()
        resumed_at = time.monotonic()
        support.wait_for(lambda: support.staged_count(db_url) == 0, 90,
                         "the drain to deliver everything after the stall")
        recovered = time.monotonic() - resumed_at
        connections = proxy.accepted
    finally:
        proxy.stop()
    copies = support.check_at_least_once(early + support.drain_queue(queue), staged)
    assert connections >= 2, "the drain never reconnected"
    print(f"\n[broker stall] noticed {noticed:.2f}s after the stall (confirm timeout 3s); "
          f"delivered the rest {recovered:.1f}s after the broker answered again "
          f"({connections} connections); "
          f"{sum(copies.values()) - len(copies)} duplicates; log: {notice.strip()}")
    assert noticed < 30


# -- 4. the broker nacks --------------------------------------------------------------------


def test_broker_nacks_leave_rows_staged_until_there_is_room(
    db_url: str, queue: str, spawn: Any
) -> None:
    with support.broker_channel() as ch:
        ch.queue_declare(queue, durable=True,
                         arguments={"x-max-length": 5, "x-overflow": "reject-publish"})
    proc = _run_drain(spawn, db_url, "--queue-declare", "passive")
    proc.wait_for_output("broker connected", timeout=30)
    staged = support.stage_backlog(db_url, queue, 12)
    support.wait_for(lambda: support.staged_count(db_url) == 7 and "nacked" in proc.output(),
                     30, "5 jobs delivered, 7 nacked and still staged")
    assert support.queue_depth(queue) == 5
    assert "broker nacked 7 message(s); their rows stay staged" in proc.output()
    delivered: Messages = []
    rounds = 0  # a consumer pass takes what is there, and what the drain sends meanwhile
    while len(delivered) < len(staged):
        support.wait_for(lambda: support.queue_depth(queue) > 0, 30,
                         "the drain to publish the nacked jobs again")
        delivered += support.drain_queue(queue, timeout=0.3)
        rounds += 1
        assert rounds <= 10
    nacks = proc.output().count("broker nacked")
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "staged_jobs to empty")
    delivered += support.drain_queue(queue, timeout=0.3)
    copies = support.check_at_least_once(delivered, staged)
    assert sorted(copies.values()) == [1] * 12, "a nacked message must not have been enqueued"
    assert "broker back" not in proc.output() and proc.output().count("broker connected") == 1
    print(f"\n[nacks] 12 jobs delivered through a queue of length 5 in {rounds} consumer "
          f"pass(es); {nacks} nack line(s) in the log")


# -- 5. the Postgres connection cut mid-batch ------------------------------------------------


def test_postgres_connection_cut_mid_batch_repeatedly(
    db_url: str, queue: str, spawn: Any
) -> None:
    staged = support.stage_backlog(db_url, queue, 20_000)
    proxy = support.TcpProxy(support.PG_PORT).start()
    try:
        proc = _run_drain(spawn, db_url, "--batch-size", "500", db_port=proxy.port)
        proc.wait_for_output("broker connected", timeout=30)
        cuts = _cut_until_drained(proxy, db_url, "Postgres")
        # The last cut may have come after the last batch: the drain leads again. The
        # lock shows in pg_locks a moment before the drain logs that it took it, so
        # wait for both.
        support.wait_for(
            lambda: _lock_holder(db_url) == proc.pid and _retook_every_time(proc.output()),
            30, "the drain to take the lock back and say so")
        out = proc.output()  # before stop(), which cuts once more
    finally:
        proxy.stop()
    copies = support.check_at_least_once(support.drain_queue(queue), staged)
    lost = out.count("lock released, batch rolled back")
    took = out.count("active: took the drain lock")
    print(f"\n[postgres cuts] {cuts} cuts: lost the lock {lost} times, took it {took} times; "
          f"{sum(copies.values()) - len(copies)} duplicates of {len(staged)} jobs")
    assert cuts >= 3, "the backlog drained before enough cuts happened; stage more"
    assert lost >= 1, "the drain never said it lost the lock"
    assert took >= lost + 1, "the drain did not take the lock back after losing it"


def _retook_every_time(out: str) -> bool:
    return (out.count("active: took the drain lock")
            > out.count("lock released, batch rolled back"))


# -- 6. Postgres restarts ------------------------------------------------------------------


def test_postgres_restart_drain_reconnects_and_resumes(
    db_url: str, queue: str, spawn: Any
) -> None:
    staged = support.stage_backlog(db_url, queue, 20_000)
    proxy = support.TcpProxy(support.PG_PORT).start()
    try:
        proc = _run_drain(spawn, db_url, "--batch-size", "500", db_port=proxy.port)
        support.wait_for(lambda: support.staged_count(db_url) < len(staged), 60,
                         "the drain to make progress")
        mark = len(proc.output())
        proxy.refuse()  # "Postgres restarts": sessions cut, connections refused for 5 s
        down_at = time.monotonic()
        support.wait_for(lambda: not _drain_backends(db_url), 30,
                         "the drain's old session to end")
        during = support.staged_count(db_url)
        assert during > 0, "the backlog drained before the restart; stage more"
        _fault_pause(5 - (time.monotonic() - down_at))
        assert support.staged_count(db_url) == during, "deleted rows without a session"
        proxy.restart()
        back_at = time.monotonic()
        support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                         "the drain to resume after the restart")
        resumed = time.monotonic() - back_at
        out = proc.output()[mark:]  # before stop(), which cuts once more
    finally:
        proxy.stop()
    copies = support.check_at_least_once(support.drain_queue(queue), staged)
    assert "lock released, batch rolled back" in out
    assert "active: took the drain lock" in out
    assert out.count("unreachable") == 1, "one line for the outage, not one per retry"
    print(f"\n[postgres restart] drained the remaining {during} jobs {resumed:.1f}s after "
          f"Postgres accepted connections again; "
          f"{sum(copies.values()) - len(copies)} duplicates")


# -- 7. split brain ------------------------------------------------------------------------


def test_split_brain_the_cut_off_drain_cannot_delete_and_the_standby_finishes(
    db_url: str, queue: str, spawn: Any
) -> None:
    proxy = support.TcpProxy(support.PG_PORT).start()
    try:
        a = _run_drain(spawn, db_url, "--batch-size", "500", db_port=proxy.port, name="a")
        a.wait_for_output("active: took the drain lock", timeout=30)
        a.wait_for_output("broker connected", timeout=30)
        b = _run_drain(spawn, db_url, "--batch-size", "500", name="b")
        b.wait_for_output("standby: another drain holds the lock", timeout=30)
        staged = support.stage_backlog(db_url, queue, 20_000)
        support.wait_for(lambda: support.staged_count(db_url) < len(staged), 60,
                         "drain A to make progress")
        proxy.refuse()  # A is cut off from Postgres, and stays cut off
        cut_at = time.monotonic()
        b.wait_for_output("active: took the drain lock", timeout=30)
        took_over = time.monotonic() - cut_at
        assert support.staged_count(db_url) > 0, "the backlog drained before the cut; stage more"
        assert _lock_holder(db_url) == b.pid
        support.wait_for(
            lambda: not [n for _, n in _drain_backends(db_url)
                         if n.startswith(f"drain pid={a.pid} ")],
            10, "drain A's session to be gone")
        support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                         "drain B to finish the backlog")
        a.wait_for_output("lock released, batch rolled back", timeout=30)
        assert a.output().count("active: took the drain lock") == 1, (
            "A took the lock back while cut off")
        assert a.proc.poll() is None, "A must keep retrying, not exit"
    finally:
        proxy.stop()
    messages = support.drain_queue(queue)
    copies = support.check_at_least_once(messages, staged)
    origins = Counter(p.headers["origin"].split("@")[0] for _, p, _ in messages)
    assert set(origins) == {f"gen{a.pid}", f"gen{b.pid}"}
    print(f"\n[split brain] B took the lock {took_over:.2f}s after A was cut off; messages by "
          f"A {origins[f'gen{a.pid}']}, by B {origins[f'gen{b.pid}']}; "
          f"{sum(copies.values()) - len(copies)} duplicates of {len(staged)} jobs")


# -- 8. kill -9 at random moments while the app keeps staging ------------------------------


def _led_by(db_url: str, pids: set[int]) -> int | None:
    """The pid of the drain among ``pids`` that holds the lock, if one does."""
    holder = _lock_holder(db_url)
    return holder if holder in pids else None


def test_kill_9_at_random_moments_under_steady_staging(
    db_url: str, queue: str, spawn: Any
) -> None:
    rng = random.Random()
    producer = Producer(db_url, queue, rate=200, per_txn=4, rollback_share=0.2)
    drains = [_run_drain(spawn, db_url, "--batch-size", "200", name="d") for _ in range(2)]
    support.wait_for(lambda: any("broker connected" in d.output() for d in drains), 30,
                     "one of the drains to lead")
    producer.start()
    kills = active_kills = 0
    started = time.monotonic()
    while kills < 24:
        _fault_pause(rng.uniform(0.5, 1.5))
        alive = [d for d in drains if d.proc.poll() is None]
        # A loaded machine can take longer than the pause for a new leader to take the
        # lock: wait for one, so that the share of kills that hit it does not depend on load.
        holder = support.wait_for(functools.partial(_led_by, db_url, {d.pid for d in alive}),
                                  60, "a drain to hold the lock")
        victim = next((d for d in alive if d.pid == holder), None)
        if victim is None or rng.random() < 0.15:
            victim = rng.choice(alive)
        else:
            active_kills += 1
        victim.kill(signal.SIGKILL)
        victim.wait(10)
        kills += 1
        drains.remove(victim)
        drains.append(_run_drain(spawn, db_url, "--batch-size", "200", name="d"))
    producer.stop()
    elapsed = time.monotonic() - started
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                     "the surviving drains to publish every committed job")
    for d in drains:
        d.stop()
    messages = support.drain_queue(queue)
    delivered = set(support.task_ids(messages))
    leaked = delivered & producer.rolled_back
    assert not leaked, f"{len(leaked)} rolled-back job(s) were published"
    copies = support.check_at_least_once(messages, producer.committed)
    print(f"\n[kill -9] {kills} kills ({active_kills} of the lock holder) in {elapsed:.1f}s; "
          f"{len(producer.committed)} jobs committed, {len(producer.rolled_back)} rolled back "
          f"({len(producer.committed) / elapsed:.0f} committed jobs/s); "
          f"{sum(copies.values()) - len(copies)} duplicates")
    assert active_kills >= 10, "too few kills hit the active drain"


# -- 9. SIGTERM in the middle of a large backlog -------------------------------------------


def test_sigterm_during_a_large_backlog(db_url: str, queue: str, spawn: Any) -> None:
    staged = support.stage_backlog(db_url, queue, 30_000)
    proc = _run_drain(spawn, db_url, "--batch-size", "1000")
    support.wait_for(lambda: support.staged_count(db_url) < len(staged), 60,
                     "the drain to make progress")
    _fault_pause(random.uniform(0.0, 0.5))
    sent = time.monotonic()
    proc.kill(signal.SIGTERM)
    code = proc.wait(30)
    exit_time = time.monotonic() - sent
    assert code == 0
    assert "drain stopping" in proc.output()
    support.wait_for(lambda: not _drain_backends(db_url), 10, "the drain's session to end")
    remaining = _staged_ids(db_url)
    assert remaining, "the whole backlog drained before SIGTERM; stage more"
    messages = support.drain_queue(queue)
    published = set(support.task_ids(messages))
    support.check_at_least_once(messages, {t: i for t, i in staged.items() if t in published})
    # Nothing half-done: rows that are gone were published; every job is in one place.
    assert set(staged) - remaining <= published
    assert set(staged) == remaining | published
    assert not remaining & published, "a settled batch left published rows staged"
    print(f"\n[SIGTERM] exited 0 {exit_time:.2f}s after SIGTERM with {len(remaining)} of "
          f"{len(staged)} jobs still staged")
    assert exit_time < 30


# -- 10. a long-lived snapshot elsewhere ---------------------------------------------------


def test_long_snapshot_elsewhere_drain_transactions_stay_short(
    db_url: str, queue: str, spawn: Any
) -> None:
    dbname = db_url.rsplit("/", 1)[1]
    holder = psycopg.connect(db_url)
    holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    holder.execute("SELECT count(*) FROM staged_jobs").fetchone()  # the snapshot now exists
    holder_pid = holder.info.backend_pid
    samples: list[tuple[float | None, float | None]] = []
    done = threading.Event()
    errors: list[BaseException] = []

    def sample() -> None:
        try:
            with psycopg.connect(support.ADMIN_URL, autocommit=True) as conn:
                while not done.is_set():
                    rows = conn.execute(
                        "SELECT pid, application_name, "
                        "EXTRACT(EPOCH FROM clock_timestamp() - xact_start)::float8 "
                        "FROM pg_stat_activity WHERE datname = %s", (dbname,)
                    ).fetchall()
                    drain_age = max((r[2] for r in rows if str(r[1]).startswith("drain pid=")
                                     and r[2] is not None), default=None)
                    other_age = next((r[2] for r in rows if r[0] == holder_pid), None)
                    samples.append((drain_age, other_age))
                    done.wait(0.05)  # the sampling period
        except BaseException as exc:
            errors.append(exc)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        staged = support.stage_backlog(db_url, queue, 20_000)
        sampler.start()
        _run_drain(spawn, db_url, "--batch-size", "500")
        support.wait_for(lambda: support.staged_count(db_url) == 0, 120,
                         "the drain to finish under a long snapshot")
        done.set()
        sampler.join(10)
    finally:
        done.set()
        holder.close()
    assert not errors, errors
    copies = support.check_at_least_once(support.drain_queue(queue), staged)
    drain_ages = [d for d, _ in samples if d is not None]
    other_ages = [o for _, o in samples if o is not None]
    assert len(drain_ages) >= 5, "too few samples of the drain's transactions"
    assert other_ages[-1] > other_ages[0], "the other session's snapshot was not held"
    print(f"\n[long snapshot] {len(samples)} samples; the drain's transaction age: max "
          f"{max(drain_ages):.3f}s, median {statistics.median(drain_ages):.3f}s; the other "
          f"session's snapshot age grew to {max(other_ages):.1f}s; "
          f"{sum(copies.values()) - len(copies)} duplicates")
    assert max(drain_ages) < 5.0, "the drain held a long transaction"
    assert max(other_ages) > max(drain_ages)


# -- 11. bad input -------------------------------------------------------------------------


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_bad_input_is_delivered_intact_or_dead_lettered(
    db_url: str, queue: str, spawn: Any
) -> None:
    # Python 3.11 refuses to parse integers over 4,300 digits by default: the
    # test must be able to check a body that carries one, if the drain sends it.
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        expected: dict[str, Any] = {}  # task id -> the args as staged
        cases: dict[str, str] = {}  # task id -> case name
        skipped: list[str] = []
        staged_via_api: dict[str, list[Any]] = {
            "5 MB string": ["x" * 5_000_000],
            "depth 200": [_nested(200)],
            "text": ["h\u00e9llo \u2603 \U0001f600 \u0627\u0644\u0639\u0631\u0628\u064a\u0629",
                     "\x01\x02\x1f\x7f\t\n\r \"\\/ \u2028\u2029 \ufeff \ud7ff\ue000\uffff",
                     {"k\u00e9y \U0001f511": "\x1b[31mred\x1b[0m"}],
            "int64+": [2**70, -(2**70), 2**63, -(2**63) - 1],
            "18 MB of escapes": ["\x01" * 3_000_000],
        }
        with psycopg.connect(db_url) as conn:
            for name, args in staged_via_api.items():
                task_id = str(drain.stage(conn, "celery_app.record", args, queue=queue))
                expected[task_id], cases[task_id] = args, name
        # Built in SQL: values drain.stage() cannot produce. {name: (jsonb SQL, args)}
        by_sql: dict[str, tuple[str, Any]] = {
            "5,000-digit integer": ("('[' || repeat('9', 5000) || ']')", [int("9" * 5000)]),
            "depth 5,000": ("(repeat('[', 5000) || repeat(']', 5000))", [_nested(4999)]),
            "depth 100,000": ("(repeat('[', 100000) || repeat(']', 100000))",
                              [_nested(99_999)]),
        }
        with psycopg.connect(db_url, autocommit=True) as conn:
            for name, (value_sql, args) in by_sql.items():
                try:
                    row = conn.execute(
                        "INSERT INTO staged_jobs (task_name, args, queue) "
                        f"VALUES ('celery_app.record', {value_sql}::jsonb, %s) RETURNING task_id",
                        (queue,),
                    ).fetchone()
                except psycopg.Error as exc:
                    skipped.append(f"{name}: Postgres refuses it ({_first_line(exc)})")
                    continue
                assert row is not None
                expected[str(row[0])], cases[str(row[0])] = args, name
        proc = _run_drain(spawn, db_url)
        support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                         "staged_jobs to empty")
        messages = support.drain_queue(queue)
        with psycopg.connect(db_url) as conn:
            dead = {str(r[0]): (str(r[1]), str(r[2] or "")) for r in conn.execute(
                "SELECT task_id, reason, detail FROM dead_jobs")}
        outcome: dict[str, str] = {}
        for _, props, body in messages:
            task_id = str(props.headers["id"])
            assert task_id in expected, f"an unexpected message {task_id}"
            try:
                args, kwargs, _embed = json.loads(body)
            except RecursionError:
                # Sent on, though Python cannot decode it: neither lost nor a crash.
                outcome[task_id] = "delivered (too deep for Python's json)"
                continue
            assert args == expected[task_id], f"{cases[task_id]}: arguments changed in transit"
            assert kwargs == {}
            outcome[task_id] = "delivered intact"
        for task_id, (reason, detail) in dead.items():
            assert task_id not in outcome, f"{cases[task_id]}: both delivered and dead"
            assert reason and detail, f"{cases[task_id]}: dead without a reason"
            outcome[task_id] = f"dead: {reason} ({detail[:60]})"
        missing = {cases[t] for t in expected if t not in outcome}
        assert not missing, f"lost: {missing}"
        out = proc.output()
        assert out.count("broker connected") == 1, "the drain reconnected: a crash loop?"
        assert "broker back" not in out and "Traceback" not in out
        assert proc.proc.poll() is None, "the drain exited"
    finally:
        sys.set_int_max_str_digits(limit)
    print("\n[bad input] " + "; ".join(f"{cases[t]}: {outcome[t]}" for t in outcome)
          + "".join(f"; skipped {s}" for s in skipped))


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0]


# -- 12. secrets stay out of the logs ----------------------------------------------------


def test_passwords_never_reach_the_logs_even_verbose(
    db_url: str, queue: str, spawn: Any
) -> None:
    """Every failure path a drain logs, with -v (debug logs, tracebacks): no password.

    (The autouse fixture scans every drain of this module the same way.)
    """
    pg = support.TcpProxy(support.PG_PORT)  # not started: the database is unreachable at first
    amqp = support.TcpProxy(support.BROKER_PORT)  # likewise the broker
    try:
        proc = _run_drain(spawn, db_url, db_port=pg.port, broker_port=amqp.port, verbose=True)
        proc.wait_for_output("retrying with backoff", timeout=30)
        pg.start()
        proc.wait_for_output("active: took the drain lock", timeout=60)
        proc.wait_for_output(f"broker at {support.broker_url(amqp.port, password='***')} "
                             "unreachable", timeout=60)
        amqp.start()
        proc.wait_for_output("broker connected", timeout=60)
        staged = support.stage_backlog(db_url, queue, 3_000)
        support.wait_for(lambda: support.staged_count(db_url) < len(staged), 60, "progress")
        amqp.cut()
        pg.cut()
        support.wait_for(lambda: support.staged_count(db_url) == 0, 60, "the backlog")
        stop = time.monotonic()
        proc.kill(signal.SIGTERM)
        assert proc.wait(30) == 0
        print(f"\n[secrets] verbose drain exited {time.monotonic() - stop:.2f}s after SIGTERM")
    finally:
        pg.stop()
        amqp.stop()
    support.check_at_least_once(support.drain_queue(queue), staged)
    out = proc.output()
    assert DB_SECRET not in out and "guest:guest" not in out
    assert f"postgresql://{roles.RUNNER}:***@127.0.0.1:{pg.port}/" in out
    assert support.broker_url(amqp.port, password="***") in out
    assert "DEBUG" in out, "ran without debug logging"
    # Nor in another spelling (URL-encoded, libpq key=value, a bytes repr).
    for spelling in ("s3cr3t%2Ddb", "password=s3cr3t", "password='s3cr3t", "b's3cr3t"):
        assert spelling not in out


# -- bugs found by the matrix --------------------------------------------------------------


def test_postgres_losses_do_not_leak_in_flight_batches(db_url: str, queue: str) -> None:
    from drain.daemon.runner import Drain
    from drain.settings.config import Settings

    staged = support.stage_backlog(db_url, queue, 20_000)
    proxy = support.TcpProxy(support.PG_PORT).start()
    settings = Settings(database_url=_secret_db_url(db_url, proxy.port),
                        broker_url=support.BROKER_URL, batch_size=500, poll_interval=0.2,
                        max_backoff=0.5)
    running = Drain(settings)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    rng = random.Random()
    cuts = 0
    try:
        # A bounded number of cuts (not a time: a loaded machine drains slower), each
        # while the drain is busy, then the drain finishes the backlog on its own.
        while cuts < 12 and support.staged_count(db_url) > 0:
            _fault_pause(rng.uniform(0.2, 0.6))
            proxy.cut()
            cuts += 1
        # Idle again: nothing is in flight, so the publisher should hold no batch.
        support.wait_for(lambda: _lock_holder(db_url) is not None and not running.pipeline.inflight
                         and support.staged_count(db_url) == 0, 300,
                         "an idle, leading drain after the Postgres cuts")
        held = list(running._publisher._window.batches)
    finally:
        running.stop()
        thread.join(30)
        proxy.stop()
    support.check_at_least_once(support.drain_queue(queue), staged)
    print(f"\n[leak] after {cuts} Postgres cuts the publisher still holds {len(held)} "
          f"batch(es), {sum(len(b.messages) for b in held)} messages")
    assert cuts >= 3
    assert not held, f"{len(held)} abandoned batch(es) still held by the publisher"

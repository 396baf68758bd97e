"""The idle handshake (drain/postgres/wakeup.py) against the real Postgres and RabbitMQ.

Staging sends a NOTIFY only while a drain is idle and armed; a drain going
idle arms only once every silent staging transaction has ended, then looks
once more. The drains here poll every 60 s: a lost wake-up shows as a job that
does not arrive within DEADLINE, and fails the test.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pika
import psycopg
import pytest

import drain
from drain.postgres import sql
from drain.postgres.migration import migrate
from drain.postgres.store import Store
from drain.postgres.wakeup import ARM_AFTER, WAKE_CLASS
from drain.settings.config import Settings
from drain.settings.urls import broker_parameters
from tests import roles, support
from tests.integration.conftest import Running

#: A wake-up lost would leave a job for the 60 s poll; everything else is fast.
POLL = 60.0
DEADLINE = 15.0
#: Commits raced against the drain going idle (more in `make soak`).
RACES = int(os.environ.get("DRAIN_WAKEUP_RACES", "3000"))

OLD_TRIGGER = """
CREATE OR REPLACE TRIGGER staged_jobs_notify AFTER INSERT ON staged_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION staged_jobs_notify();
"""


def _wake_flag(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute(sql.query("wake_flag")).fetchone()
    assert row is not None
    return bool(row[0])


def _stage(db_url: str, queue: str, marker: str, **connect: Any) -> None:
    with psycopg.connect(db_url, **connect) as conn:
        drain.stage(conn, "t.wake", [marker], queue=queue)


def test_staging_notifies_only_while_a_drain_is_armed(db_url: str, queue: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute("LISTEN drain_staged_jobs")
        _stage(db_url, queue, "silent")  # no drain armed: no NOTIFY
        with support.wake_flag_raised(db_url):
            _stage(db_url, queue, "loud")
        got = [n for n in listener.notifies(timeout=DEADLINE, stop_after=1)]
        got += list(listener.notifies(timeout=0))
    # Notifications arrive in commit order: had the first commit sent one, it
    # would be here before the second's.
    assert len(got) == 1


def test_staging_never_waits_for_the_drain(db_url: str, queue: str) -> None:
    with support.wake_flag_raised(db_url) as drain_session, drain_session.transaction():
        # The drain's own statements on the flag, in a transaction still open.
        drain_session.execute(sql.query("silent_writers"))
        drain_session.execute(sql.query("lower_flag"))
        drain_session.execute(sql.query("raise_flag"))
        # lock_timeout would turn any wait on a lock into an error.
        _stage(db_url, queue, "x", options="-c lock_timeout=50ms")
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM staged_jobs").fetchone() == (1,)


def test_a_drain_arms_only_when_no_silent_staging_transaction_is_open(
    db_url: str, queue: str
) -> None:
    store = Store(Settings(database_url=roles.url(db_url, roles.RUNNER),
                           broker_url=support.BROKER_URL))
    store.connect()
    try:
        with psycopg.connect(db_url, autocommit=True) as probe:
            with psycopg.connect(db_url) as writer:
                drain.stage(writer, "t.wake", ["open"], queue=queue)  # read the flag low
                assert not store.arm(announce=False)
                assert not store.armed
                assert not _wake_flag(probe), "a failed arm must lower the flag again"
            with psycopg.connect(db_url) as reader:
                # An open transaction that only looked at the sequence (a
                # monitoring query, pg_dump) is not a writer.
                reader.execute("SELECT last_value FROM drain_wake")
                assert store.arm(announce=False)  # the writer committed
            assert _wake_flag(probe)
            assert probe.execute(sql.query("armed_elsewhere"),
                                 support.sentinel(probe)).fetchone() == (True,)
            assert not store.armed_elsewhere()  # its own sentinel lock does not count
            store.disarm(announce=False)
            assert not _wake_flag(probe)
            with support.wake_flag_raised(db_url):
                assert store.armed_elsewhere()
                assert not store.arm(announce=False)  # one sentinel at a time
    finally:
        store.close()


def test_a_drain_that_died_armed_leaves_staging_loud_until_another_leads(
    db_url: str, queue: str
) -> None:
    settings = Settings(database_url=roles.url(db_url, roles.RUNNER), broker_url=support.BROKER_URL)
    leader, standby = Store(settings), Store(settings)
    leader.connect()
    standby.connect()  # connected before the leader dies, as a hot standby is
    try:
        with psycopg.connect(db_url, autocommit=True) as probe:
            assert leader.try_lock() and not standby.try_lock()
            assert leader.arm(announce=False)
            pids = probe.execute(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND "
                "objsubid = 2 AND classid = %s::int::oid AND database = (SELECT oid FROM "
                "pg_database WHERE datname = current_database())", (WAKE_CLASS,)).fetchall()
            assert len(pids) == 1
            probe.execute("SELECT pg_terminate_backend(%s)", pids[0])
            support.wait_for(lambda: probe.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", pids[0]).fetchone()
                == (0,), 10, "the armed leader's session to end")
            assert _wake_flag(probe)  # staging notifies: costly, never a lost job
            assert standby.try_lock()
            assert not _wake_flag(probe), "the new leader must lower the flag"
    finally:
        leader.close()
        standby.close()


class Deliveries:
    """Consumes ``queue`` on its own thread; records when each marker arrived."""

    def __init__(self, queue: str) -> None:
        self.arrived: dict[str, float] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        with support.broker_channel() as ch:
            ch.queue_declare(queue, durable=True)
        self._thread = threading.Thread(target=self._run, args=(queue,), daemon=True)
        self._thread.start()

    def _run(self, queue: str) -> None:
        conn = pika.BlockingConnection(broker_parameters(support.BROKER_URL))
        try:
            ch = conn.channel()
            for method, _props, body in ch.consume(queue, auto_ack=True, inactivity_timeout=0.1):
                if self._stop.is_set():
                    break
                if method is None:
                    continue
                marker = body.decode().split('"', 2)[1]  # args[0] of [[marker], {}, ...]
                with self._cond:
                    self.arrived.setdefault(marker, time.monotonic())
                    self._cond.notify_all()
        finally:
            with contextlib.suppress(Exception):
                conn.close()

    def wait(self, markers: list[str], timeout: float = DEADLINE) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not all(m in self.arrived for m in markers):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [m for m in markers if m not in self.arrived]
                    raise AssertionError(f"lost wake-up: {missing[:5]} not delivered "
                                         f"within {timeout}s (the drain polls every {POLL}s)")
                self._cond.wait(left)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def deliveries(queue: str) -> Iterator[Deliveries]:
    d = Deliveries(queue)
    yield d
    d.close()


def _report(what: str, latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p99 = ordered[int(0.99 * (len(ordered) - 1))]
    text = (f"{what}: {len(ordered)} commits, latency commit -> delivery p50 "
            f"{1000 * statistics.median(ordered):.1f} ms, p99 {1000 * p99:.1f} ms, "
            f"worst {1000 * ordered[-1]:.1f} ms")
    print(text)
    return text


@pytest.mark.slow  # RACES commits one after another, a minute or more: not in make test-fast
@pytest.mark.timeout(300 + RACES // 10)  # make soak races 30,000
def test_commits_raced_against_the_drain_going_idle_are_never_missed(
    db_url: str, queue: str, deliveries: Deliveries,
    start_active_drain: Callable[..., Running],
) -> None:
    """Each commit lands at a random point of the drain's way to sleep: right
    after the previous job (while it publishes, disarms, arms, looks once
    more), from a transaction held open across the arm, or from inside the
    drain's own final look (the fetch hook: after its snapshot, before it
    sleeps)."""
    rng = random.Random(11)
    committed: dict[str, float] = {}
    hook_conn = psycopg.connect(db_url, autocommit=True)
    injected = [0]

    def on_fetch(_elapsed: float, count: int) -> None:
        if count == 0 and rng.random() < 0.2:
            marker = f"hook{injected[0]}"
            injected[0] += 1
            drain.stage(hook_conn, "t.wake", [marker], queue=queue)
            committed[marker] = time.monotonic()

    start_active_drain(db_url, poll_interval=POLL, on_fetch=on_fetch)
    try:
        with psycopg.connect(db_url) as writer:
            for i in range(RACES):
                marker = f"w{i}"
                drain.stage(writer, "t.wake", [marker], queue=queue)
                if rng.random() < 0.2:  # held open while the drain tries to arm
                    time.sleep(rng.uniform(0, 0.004))
                writer.commit()
                committed[marker] = time.monotonic()
                deliveries.wait([m for m in list(committed) if m not in deliveries.arrived])
                time.sleep(rng.uniform(0, 0.002))  # the jitter is the point: not a sync
        deliveries.wait(list(committed))
    finally:
        hook_conn.close()
    assert injected[0] > 0
    latencies = [deliveries.arrived[m] - t for m, t in committed.items()]
    _report(f"wake-up race ({injected[0]} from the final look)", latencies)
    assert max(latencies) < DEADLINE


def test_a_writer_open_while_the_drain_arms_is_not_missed(
    db_url: str, queue: str, deliveries: Deliveries,
    start_active_drain: Callable[..., Running],
) -> None:
    """The step that makes the handshake safe, on its own: a staging
    transaction reads the flag low (from the drain's fetch hook, right after
    a fetch that found work, so the drain is surely not armed), stays open
    while the drain runs out of work and tries to arm, and commits only after
    the drain's looks (armed or not) have all missed its row."""
    looked = threading.Condition()
    looks = [0]
    staged_at: list[int | None] = [None]
    marker = [""]
    writer = psycopg.connect(db_url)

    def on_fetch(_elapsed: float, count: int) -> None:
        with looked:
            looks[0] += 1
            if count and marker[0] and staged_at[0] is None:
                drain.stage(writer, "t.wake", [marker[0]], queue=queue)  # not committed
                staged_at[0] = looks[0]
            looked.notify_all()

    def enough_looks() -> bool:
        # Enough empty looks to go idle (ARM_AFTER) and the final one: a drain
        # that armed regardless sleeps after them.
        return staged_at[0] is not None and looks[0] >= staged_at[0] + ARM_AFTER + 1

    start_active_drain(db_url, poll_interval=POLL, on_fetch=on_fetch)
    latencies = []
    try:
        for i in range(10):
            with looked:
                marker[0], staged_at[0] = f"open{i}", None
            _stage(db_url, queue, f"kick{i}")  # wakes the drain; its fetch stages open{i}
            with looked:
                assert looked.wait_for(enough_looks, DEADLINE)
            writer.commit()
            committed = time.monotonic()
            deliveries.wait([f"kick{i}", f"open{i}"])
            latencies.append(deliveries.arrived[f"open{i}"] - committed)
    finally:
        writer.close()
    _report("writer open across the arm", latencies)


def test_a_backlog_found_by_a_poll_disarms_the_drain(
    db_url: str, queue: str, start_active_drain: Callable[..., Running],
) -> None:
    """Rows that arrive without a NOTIFY (here: the trigger disabled, as for
    delayed rows coming due) are found by the poll; while the drain works
    through them in full batches, writers must not be made to notify."""
    flags: list[bool] = []
    last = [0]
    probe = psycopg.connect(db_url, autocommit=True)

    def on_fetch(_elapsed: float, count: int) -> None:
        if last[0] == 10:  # the cycle after a full batch
            flags.append(_wake_flag(probe))
        last[0] = count

    start_active_drain(db_url, poll_interval=0.5, batch_size=10, on_fetch=on_fetch)
    try:
        support.wait_for(lambda: _wake_flag(probe), DEADLINE, "the idle drain to arm")
        with psycopg.connect(db_url) as conn:
            conn.execute("ALTER TABLE staged_jobs DISABLE TRIGGER staged_jobs_notify")
            conn.execute("INSERT INTO staged_jobs (task_name, queue) "
                         "SELECT 't.wake', %s FROM generate_series(1, 100)", (queue,))
            conn.execute("ALTER TABLE staged_jobs ENABLE TRIGGER staged_jobs_notify")
        support.wait_for(lambda: support.staged_count(db_url) == 0, DEADLINE, "the backlog")
    finally:
        probe.close()
    assert flags and not any(flags), flags


def test_lanes_wake_each_other(
    db_url: str, queue: str, deliveries: Deliveries,
    start_active_drain: Callable[..., Running],
) -> None:
    """Two lanes share one wake flag: whichever is the sentinel, a row of the
    other lane is never left for the poll."""
    for lane in (0, 1):
        start_active_drain(db_url, poll_interval=POLL, lanes=2, lane=lane)
    rng = random.Random(12)
    latencies = []
    with psycopg.connect(db_url, autocommit=True) as writer:
        for i in range(300):
            marker = f"l{i}"
            lane_of_row = rng.randrange(2)
            writer.execute(
                "INSERT INTO staged_jobs (id, task_name, args, queue) OVERRIDING SYSTEM VALUE "
                "VALUES (%s, 't.wake', %s, %s)",
                (10_000 + 2 * i + lane_of_row, f'["{marker}"]', queue))
            committed = time.monotonic()
            deliveries.wait([marker])
            latencies.append(deliveries.arrived[marker] - committed)
            time.sleep(rng.uniform(0, 0.003))
    _report("two lanes", latencies)


@contextlib.contextmanager
def _writing(db_url: str, queue: str, prefix: str, every: float) -> Iterator[list[str]]:
    """A writer thread staging one job per ``every`` seconds until the block
    ends; yields the markers staged so far (a list that keeps growing)."""
    stop = threading.Event()
    markers: list[str] = []

    def write() -> None:
        with psycopg.connect(db_url, autocommit=True) as conn:
            while not stop.is_set():
                marker = f"{prefix}{len(markers)}"
                drain.stage(conn, "t.wake", [marker], queue=queue)
                markers.append(marker)
                time.sleep(every)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        yield markers
    finally:
        stop.set()
        writer.join()


def test_a_standby_taking_over_misses_no_commit(
    db_url: str, queue: str, deliveries: Deliveries,
    start_drain: Callable[..., Running],
) -> None:
    """Writers keep staging while the leader's session is killed (its locks go
    with it; if it was armed, the standby lowers the flag) and the standby
    takes over."""
    first = start_drain(db_url, poll_interval=POLL)
    support.wait_for(lambda: first.drain.state.value == "active", 30, "a leader")
    start_drain(db_url, poll_interval=POLL)
    with _writing(db_url, queue, "s", 0.005) as markers:
        support.wait_for(lambda: len(deliveries.arrived) >= 50, DEADLINE, "jobs flowing")
        with psycopg.connect(db_url, autocommit=True) as admin:
            killed = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_locks WHERE locktype = "
                "'advisory' AND objsubid = 1 AND granted AND database = "
                "(SELECT oid FROM pg_database WHERE datname = current_database())").fetchone()
        assert killed == (1,)
        seen = len(deliveries.arrived)
        support.wait_for(lambda: len(deliveries.arrived) >= seen + 200, DEADLINE,
                         "jobs flowing after the takeover")
    deliveries.wait(list(markers))


def test_drain_migrate_on_a_live_database_keeps_every_job_flowing(
    db_url: str, queue: str, deliveries: Deliveries,
    start_active_drain: Callable[..., Running],
) -> None:
    """From the old trigger (a NOTIFY per statement) to the wake flag while a
    drain runs and a writer stages; then the drain still wakes for each job."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(OLD_TRIGGER)
    start_active_drain(db_url, poll_interval=POLL)
    with _writing(db_url, queue, "m", 0.002) as markers:
        support.wait_for(lambda: len(deliveries.arrived) >= 20, DEADLINE, "jobs flowing")
        with psycopg.connect(db_url, autocommit=True) as conn:
            migrate(conn)
            body = conn.execute("SELECT pg_get_triggerdef(oid) FROM pg_trigger "
                                "WHERE tgname = 'staged_jobs_notify'").fetchone()
        assert body is not None and "pg_sequence_last_value" in body[0]
        seen = len(deliveries.arrived)
        support.wait_for(lambda: len(deliveries.arrived) >= seen + 50, DEADLINE,
                         "jobs flowing after the migration")
    deliveries.wait(list(markers))
    # And one by one, each woken for, with the new trigger.
    for i in range(20):
        _stage(db_url, queue, f"after{i}")
        deliveries.wait([f"after{i}"])

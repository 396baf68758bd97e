"""PgBouncer in front of Postgres (issue 14): applications stage through a
transaction pool, the drain runs through a session pool and refuses the others.

Every test runs a real PgBouncer (tests/pgbouncer.py) on a free port in front of
the real Postgres, and real drains publishing to the real RabbitMQ.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import conninfo

import drain
from drain.errors import DatabaseUnavailable, PoolWithoutSession
from drain.postgres import session_probe, sql
from tests import roles, support
from tests.pgbouncer import PgBouncer

#: The drains' --poll-interval here: a job published sooner than this after a
#: commit was woken by the NOTIFY, not found by a poll.
POLL = 60.0
#: How long a woken drain may take to publish (a loaded machine; typically ms).
WOKEN_WITHIN = 15.0
PASSWORD = "pgb-Secret-Pw-93"

Start = Callable[..., PgBouncer]


@pytest.fixture
def bouncers() -> Iterator[Start]:
    """Start PgBouncers in a given pool mode; all are stopped at teardown."""
    started: list[PgBouncer] = []

    def start(pool_mode: str, **settings: str | int) -> PgBouncer:
        bouncer = PgBouncer(pool_mode, **settings)
        started.append(bouncer)
        return bouncer.start()

    yield start
    for bouncer in started:
        bouncer.stop()


class Arrivals:
    """The task ids that reached ``queue`` so far (consumed and acked as they come)."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.messages: list[tuple[Any, Any, bytes]] = []

    def have(self, task_ids: list[str]) -> bool:
        self.messages += support.drain_queue(self.queue, timeout=0.2)
        return set(task_ids) <= set(support.task_ids(self.messages))


def _armed(db_url: str) -> bool:
    """The drain sleeps armed (drain.postgres.wakeup): only a NOTIFY wakes it before POLL."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(sql.query("wake_flag")).fetchone()
    return bool(row and row[0])


def _advisory_locks(db_url: str) -> int:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())").fetchone()
    return int(row[0]) if row else 0


def _plain_sql(conn: psycopg.Connection[Any], queue: str) -> list[str]:
    row = conn.execute(
        "INSERT INTO staged_jobs (task_name, args, kwargs, queue) "
        "VALUES ('celery_app.record', '[4]', '{\"i\": 4}', %s) RETURNING task_id::text",
        (queue,),
    ).fetchone()
    assert row is not None
    return [str(row[0])]


def test_applications_stage_through_a_transaction_pool(
    db_url: str, queue: str, spawn: Any, bouncers: Start
) -> None:
    """stage(), stage_many() (COPY) and plain SQL through a transaction pool; a drain
    connected directly, sleeping armed, is woken by each commit's NOTIFY."""
    pool = bouncers("transaction")
    proc = spawn(support.drain_argv("run", "--poll-interval", str(POLL)),
                 support.drain_env(db_url), "drain")
    proc.wait_for_output("broker connected", timeout=30)
    arrivals = Arrivals(queue)
    ways: dict[str, Callable[[psycopg.Connection[Any]], list[str]]] = {
        "stage": lambda conn: [str(drain.stage(conn, "celery_app.record", [0], {"i": 0},
                                               queue=queue))],
        "stage_many": lambda conn: [str(task_id) for task_id in drain.stage_many(conn, (
            drain.Job("celery_app.record", [i], {"i": i}, queue=queue) for i in (1, 2, 3)))],
        "plain SQL": lambda conn: _plain_sql(conn, queue),
    }
    # prepare_threshold=None: psycopg's server-side prepared statements do not
    # survive a transaction pool (docs/pgbouncer.md).
    with psycopg.connect(pool.url(db_url), prepare_threshold=None) as app:
        pooled = app.execute("SELECT pg_backend_pid()").fetchone()
        assert pooled is not None and pooled[0] != app.info.backend_pid, "not through a pool"
        app.commit()
        for way, stage in ways.items():
            support.wait_for(lambda: _armed(db_url), 30, "the drain to sleep armed")
            task_ids = stage(app)
            app.commit()
            committed = time.monotonic()
            support.wait_for(functools.partial(arrivals.have, task_ids), WOKEN_WITHIN,
                             f"the jobs staged by {way} through the pool to be published")
            assert time.monotonic() - committed < POLL
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the rows to be deleted")
    staged = {task_id: i for i, task_id in enumerate(support.task_ids(arrivals.messages))}
    assert len(staged) == 5
    for _, props, body in arrivals.messages:
        assert props.headers["task"] == "celery_app.record"
        assert body.startswith(b"[[")


def test_drain_runs_through_a_session_pool(
    db_url: str, queue: str, spawn: Any, bouncers: Start
) -> None:
    """Through a session pool the drain publishes, deletes, keeps the lock from a
    second drain, and is woken by NOTIFY."""
    pool = bouncers("session")
    staged = support.stage_backlog(db_url, queue, 300)
    env = support.drain_env(pool.url(roles.url(db_url, roles.RUNNER), password=PASSWORD))
    argv = support.drain_argv("run", "--poll-interval", str(POLL), "--batch-size", "100")
    leader = spawn(argv, env, "drain")
    leader.wait_for_output("active: took the drain lock", timeout=30)
    standby = spawn(argv, env, "standby")
    standby.wait_for_output("standby: another drain holds the lock", timeout=30)
    arrivals = Arrivals(queue)
    support.wait_for(lambda: arrivals.have(list(staged)), 60, "the backlog to be published")
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the rows to be deleted")
    # Idle, armed: a job staged now is published on its NOTIFY.
    support.wait_for(lambda: _armed(db_url), 30, "the drain to sleep armed")
    with psycopg.connect(pool.url(db_url)) as app:
        late = str(drain.stage(app, "celery_app.record", [300], {"i": 300}, queue=queue))
    support.wait_for(lambda: arrivals.have([late]), WOKEN_WITHIN, "the late job")
    staged[late] = 300
    support.check_at_least_once(arrivals.messages, staged)
    assert support.staged_count(db_url) == 0
    for proc in (leader, standby):
        out = proc.output()
        assert "pool that does not keep a session" not in out
        assert PASSWORD not in out
    assert "active: took the drain lock" not in standby.output()


@pytest.mark.parametrize("pool_mode", ["transaction", "statement"])
def test_drain_refuses_a_pool_that_does_not_keep_sessions(
    pool_mode: str, db_url: str, queue: str, bouncers: Start
) -> None:
    """One line, exit code 2, no retry loop, no password; every row stays staged."""
    pool = bouncers(pool_mode)
    staged = support.stage_backlog(db_url, queue, 5)
    url = pool.url(roles.url(db_url, roles.RUNNER), password=PASSWORD)
    started = time.monotonic()
    result = support.run_cli(db_url, "run", "--poll-interval", "0.5",
                             env=support.drain_env(url), timeout=60)
    elapsed = time.monotonic() - started
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("drain: error: ")]
    assert errors == [lines[-1]], out
    assert errors[0].startswith(
        f"drain: error: database postgresql://{roles.RUNNER}:***@127.0.0.1:{pool.port}/"), out
    assert "is reached through a pool that does not keep a session" in errors[0]
    assert "connect it directly or through a session-mode pool" in errors[0]
    assert PASSWORD not in out
    assert "Traceback" not in out and "retrying" not in out, out
    assert "took the drain lock" not in out
    assert elapsed < 30, f"refusing took {elapsed:.1f}s"
    # Nothing published, nothing lost, and no lock left behind on a pooled backend.
    assert support.staged_count(db_url) == len(staged)
    assert support.queue_depth(queue) == 0
    assert _advisory_locks(db_url) == 0


# -- the probe itself (drain.postgres.session_probe) -----------------------------------------------


def _probe(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return session_probe.check(conn, url, "<db>", [])


def _server_pid(url: str) -> tuple[int, int]:
    """(the pid a connection was told at startup, its server backend's pid)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        return conn.info.backend_pid, int(row[0])


def test_probe_passes_sessions_of_their_own(db_url: str, bouncers: Start) -> None:
    """Direct, through a TCP proxy, through a session pool: passes, and returns the
    server backend's pid (a pool hands out a key of its own)."""
    proxy = support.TcpProxy(support.PG_PORT).start()
    try:
        proxied = support.via_proxy(db_url, proxy.port)
        for url in (db_url, proxied):
            told, actual = _server_pid(url)
            assert told == actual
            assert _probe(url) > 0
    finally:
        proxy.stop()
    pooled = bouncers("session").url(db_url)
    told, actual = _server_pid(pooled)
    assert told != actual
    for _ in range(20):
        assert _probe(pooled) > 0


@pytest.mark.parametrize("round_robin", [0, 1])
def test_probe_is_not_fooled_by_other_clients(
    round_robin: int, db_url: str, bouncers: Start
) -> None:
    """A transaction pool busy with other clients' statements and transactions
    is still refused, whichever order it hands out server connections in."""
    url = bouncers("transaction", server_round_robin=round_robin).url(db_url)
    stop = threading.Event()

    def traffic(transactions: bool) -> None:
        with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
            while not stop.is_set():
                if transactions:
                    with conn.transaction():
                        conn.execute("SELECT 1").fetchone()
                        conn.execute("SELECT 2").fetchone()
                else:
                    conn.execute("SELECT 1").fetchone()

    threads = [threading.Thread(target=traffic, args=(i % 2 == 1,)) for i in range(3)]
    for thread in threads:
        thread.start()
    refused = 0
    try:
        for _ in range(40):
            with pytest.raises(PoolWithoutSession):
                _probe(url)
            refused += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert refused == 40


def test_probe_on_a_full_session_pool_is_an_outage(db_url: str, bouncers: Start) -> None:
    """No server connection free for the second look: retried as an outage after
    TIMEOUT, never a pass and never a hang."""
    url = bouncers("session", default_pool_size=1).url(db_url)
    with psycopg.connect(url, autocommit=True) as conn:
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable, match="pool full"):
            session_probe.check(conn, url, "<db>", [])
        assert time.monotonic() - started < session_probe.TIMEOUT + 2


def test_probe_looks_where_the_first_connection_went(db_url: str) -> None:
    """A multi-host URL: the second connection is pinned to the host and port reached."""
    params = conninfo.conninfo_to_dict(db_url)
    dead = support.free_port()
    url = conninfo.make_conninfo(db_url, host="127.0.0.1,127.0.0.1",
                                 port=f"{dead},{support.PG_PORT}", target_session_attrs="any")
    with psycopg.connect(url, autocommit=True) as conn:
        pinned = conninfo.conninfo_to_dict(session_probe._same_place(conn, url))
    assert pinned["port"] == str(support.PG_PORT) and pinned["host"] == "127.0.0.1"
    assert pinned["dbname"] == params["dbname"]
    assert "target_session_attrs" not in pinned

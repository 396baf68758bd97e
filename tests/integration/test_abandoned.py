"""The watchdog ends only a backend that is provably this drain's (issue 24, item 3).

A drain session whose path hangs is abandoned (``Session.abandon``, as the
watchdog does) and its backend is ended at the next connect if it lives on.
Through a session-mode PgBouncer (a real one, tests/pgbouncer.py) the drain's
former server connection is released once the hung path lets go of it, and
PgBouncer hands the most recently released one to the next client that asks:
an application, a standby drain, or the drain's own new session. None of them
may be ended. A backend frozen behind the hang, still holding the lock, must
be ended (through PgBouncer and directly), so that the drain leads again.

The hang is a TCP proxy (tests/support.py) between the drain and PgBouncer or
Postgres: ``stall(replies_only=True)`` holds the answers back while the
drain's own close still goes through (PgBouncer then sees a clean client go
and pools its server connection); a full stall keeps the backend frozen.

Also here: through PgBouncer, the drain's own announcements (drain.postgres.wakeup,
lanes) must not wake it: the pid psycopg reports is PgBouncer's, not the
server's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import psycopg
import pytest

from drain.errors import DatabaseUnavailable
from drain.postgres.store import Store
from drain.settings.config import Settings
from tests import pgbouncer, roles, support


@pytest.fixture
def bouncer() -> Iterator[pgbouncer.PgBouncer]:
    with pgbouncer.running("session") as running:
        yield running


@pytest.fixture
def proxies() -> Iterator[list[support.TcpProxy]]:
    started: list[support.TcpProxy] = []
    yield started
    for proxy in started:
        proxy.stop()


def _through(proxies: list[support.TcpProxy], url: str, port: int) -> str:
    """``url`` (to 127.0.0.1:``port``) through a new TcpProxy."""
    proxy = support.TcpProxy(port).start()
    proxies.append(proxy)
    proxied = url.replace(f"@127.0.0.1:{port}/", f"@127.0.0.1:{proxy.port}/")
    assert proxied != url, url
    return proxied


def _store(url: str, **settings: object) -> Store:
    # As the drain's least-privileged role (tests/roles.py): it may end only its own
    # sessions, as a drain in production.
    store = Store(Settings(database_url=roles.url(url, roles.RUNNER), **settings))  # type: ignore[arg-type]
    store.connect()
    return store


def _hang(store: Store, proxy: support.TcpProxy, *, replies_only: bool) -> int:
    """Hang the store's path under a command, abandon the session as the watchdog
    does, and return its backend's pid."""
    pid = store.server_pid
    proxy.stall(new_connections=False, replies_only=replies_only)
    lost: list[BaseException] = []

    def ask() -> None:
        try:
            store.alive()
        except DatabaseUnavailable as exc:
            lost.append(exc)

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    support.wait_for(lambda: store.waiting, 10, "the command to be sent")
    if replies_only:
        # Served, its answer held back: a pool has its server connection back
        # (ready) before the drain's close reaches it.
        support.wait_for(lambda: proxy.held > 0, 10, "the answer to reach the proxy")
    assert store.abandon(0.0) is not None
    asking.join(10)
    assert lost, "the abandoned command did not fail"
    return pid


def _locks_of(db_url: str, pid: int) -> int:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                           "AND pid = %s", [pid]).fetchone()
    return int(row[0]) if row else 0


def _alive(db_url: str, pid: int) -> bool:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                           [pid]).fetchone()
    return row == (1,)


def _released(db_url: str, pid: int) -> None:
    """Wait until PgBouncer took the abandoned server connection back (its reset
    dropped the advisory locks) and keeps it for the next client."""
    support.wait_for(lambda: _locks_of(db_url, pid) == 0, 30,
                     "PgBouncer to release the abandoned server connection")
    assert _alive(db_url, pid), "PgBouncer closed the server connection instead of pooling it"


def _pooled_leader(db_url: str, bouncer: pgbouncer.PgBouncer,
                   proxies: list[support.TcpProxy]) -> tuple[Store, int]:
    """A leading drain through a proxy in front of PgBouncer whose path hung and
    was abandoned, its former backend back in the pool: (store, that pid)."""
    store = _store(_through(proxies, bouncer.url(db_url), bouncer.port))
    assert store.try_lock()
    ghost = _hang(store, proxies[-1], replies_only=True)
    _released(db_url, ghost)
    return store, ghost


def test_an_application_handed_the_former_backend_is_not_ended(
    db_url: str, bouncer: pgbouncer.PgBouncer, proxies: list[support.TcpProxy],
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, ghost = _pooled_leader(db_url, bouncer, proxies)
    try:
        # PgBouncer pools by user: a client of the drain's role gets its backend.
        with psycopg.connect(bouncer.url(roles.url(db_url, roles.RUNNER)),
                             autocommit=True) as app:
            pid = app.execute("SELECT pg_backend_pid()").fetchone()
            assert pid == (ghost,), "PgBouncer did not hand the application that backend"
            store.connect()  # through the proxy, flowing again for new connections
            assert store.server_pid != ghost
            assert app.execute("SELECT 1").fetchone() == (1,), "the application was ended"
            assert store.try_lock(), "the drain does not lead again"
        assert f"left backend pid {ghost} alone" in caplog.text
        assert "ended this drain's abandoned session" not in caplog.text
    finally:
        store.close()


def test_the_drains_own_new_session_on_the_former_backend_is_not_ended(
    db_url: str, bouncer: pgbouncer.PgBouncer, proxies: list[support.TcpProxy],
) -> None:
    store, ghost = _pooled_leader(db_url, bouncer, proxies)
    try:
        store.connect()
        assert store.server_pid == ghost, "PgBouncer did not hand the drain its former backend"
        store.alive()
        assert store.try_lock(), "the drain does not lead again"
    finally:
        store.close()


def test_a_standby_handed_the_former_backend_is_not_ended(
    db_url: str, bouncer: pgbouncer.PgBouncer, proxies: list[support.TcpProxy],
) -> None:
    store, ghost = _pooled_leader(db_url, bouncer, proxies)
    standby = _store(bouncer.url(db_url))
    try:
        assert standby.server_pid == ghost, "PgBouncer did not hand the standby that backend"
        assert standby.try_lock()  # the lock came free: the standby leads, on that backend
        store.connect()
        assert not store.try_lock()
        standby.alive()
        assert standby.try_lock(), "the standby lost its lock"
    finally:
        standby.close()
        store.close()


@pytest.mark.parametrize("path", ["pgbouncer", "direct", "direct, lane 1 of 2"])
def test_a_frozen_backend_holding_the_lock_is_ended_and_the_drain_leads_again(
    path: str, db_url: str, bouncer: pgbouncer.PgBouncer, proxies: list[support.TcpProxy],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A silent cut neither Postgres nor PgBouncer sees: the backend lives on,
    holding the lock, until the drain ends it."""
    url = (_through(proxies, bouncer.url(db_url), bouncer.port) if path == "pgbouncer"
           else _through(proxies, db_url, support.PG_PORT))
    lanes = {"lanes": 2, "lane": 1} if "lane" in path else {}
    store = _store(url, **lanes)
    standby = _store(db_url, **lanes)
    try:
        assert store.try_lock()
        ghost = _hang(store, proxies[-1], replies_only=False)
        assert _alive(db_url, ghost) and _locks_of(db_url, ghost) >= 2  # lock and token
        assert not standby.try_lock(), "the lock came free by itself"
        store.connect()  # the hung link stays open; new connections flow
        support.wait_for(lambda: not _alive(db_url, ghost), 30, "the frozen backend to end")
        assert store.try_lock(), "the drain does not lead again"
        assert f"ended this drain's abandoned session (backend pid {ghost})" in caplog.text
    finally:
        standby.close()
        store.close()


def test_own_announcements_do_not_wake_the_drain_through_pgbouncer(
    db_url: str, bouncer: pgbouncer.PgBouncer,
) -> None:
    """A lane drain announces when it arms and disarms (drain.postgres.wakeup); only the
    others' notifications may wake it."""
    store = _store(bouncer.url(db_url), lanes=2, lane=0)
    try:
        assert store.try_lock()
        conn = store._require()
        assert store.server_pid != conn.info.backend_pid, "not through a pool"
        for _ in range(20):
            assert store.arm(announce=True)
            assert store.wait(0.0) is False, "its own announcement woke it (arming)"
            store.disarm(announce=True)
            assert store.wait(0.0) is False, "its own announcement woke it (disarming)"
        with psycopg.connect(db_url, autocommit=True) as other:
            other.execute("NOTIFY drain_staged_jobs")
        support.wait_for(lambda: store.wait(0.05), 10, "another session's NOTIFY to wake it")
    finally:
        with contextlib.suppress(DatabaseUnavailable):
            store.close()

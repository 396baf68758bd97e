"""drain.broker.reachable: the addresses a connection string names, and the knock that
ends a reconnect wait (against real sockets on 127.0.0.1)."""

from __future__ import annotations

import socket

import pytest

from drain.broker import reachable


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        ("postgresql://u:p@127.0.0.1:6543/db", [(socket.AF_INET, ("127.0.0.1", 6543))]),
        ("postgresql://127.0.0.1/db", [(socket.AF_INET, ("127.0.0.1", 5432))]),
        ("host=127.0.0.1,127.0.0.2 port=5433,5434 dbname=x",
         [(socket.AF_INET, ("127.0.0.1", 5433)), (socket.AF_INET, ("127.0.0.2", 5434))]),
        ("host=127.0.0.1,127.0.0.2 port=5433", [(socket.AF_INET, ("127.0.0.1", 5433)),
                                                (socket.AF_INET, ("127.0.0.2", 5433))]),
        ("host=/var/run/postgresql port=5433",
         [(socket.AF_UNIX, "/var/run/postgresql/.s.PGSQL.5433")]),
        ("hostaddr=127.0.0.3 host=db.example port=7000", [(socket.AF_INET, ("127.0.0.3", 7000))]),
        ("host=no-such-host.invalid", []),
        ("not a conninfo ===", []),
    ],
)
def test_addresses(dsn: str, expected: list[reachable.Address],
                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGHOST", raising=False)
    monkeypatch.delenv("PGPORT", raising=False)
    assert reachable.addresses(dsn) == expected


def test_addresses_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGHOST", "127.0.0.1")
    monkeypatch.setenv("PGPORT", "6000")
    assert reachable.addresses("") == [(socket.AF_INET, ("127.0.0.1", 6000))]
    monkeypatch.delenv("PGHOST")
    assert reachable.addresses("") == []  # libpq's compiled-in socket: nothing to knock on


def test_a_watch_fires_once_when_a_server_that_was_down_listens_again() -> None:
    port = _free_port()
    watch = reachable.Watch(lambda: reachable.tcp_addresses("127.0.0.1", port))
    assert not watch.came_back()  # nothing listens yet: seen down
    with socket.create_server(("127.0.0.1", port)):
        assert watch.came_back()
        assert not watch.came_back()  # up all along now: retries keep their backoff
    assert not watch.came_back()
    with socket.create_server(("127.0.0.1", port)):
        assert watch.came_back()


def test_a_server_that_never_went_away_never_ends_a_wait_early() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        watch = reachable.Watch(lambda: reachable.tcp_addresses("127.0.0.1", port))
        assert [watch.came_back() for _ in range(5)] == [False] * 5


def test_nothing_to_knock_on_never_fires() -> None:
    watch = reachable.Watch(list)
    assert not watch.came_back()

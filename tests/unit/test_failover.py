"""drain.postgres.failover: the libpq options added for multi-host URLs, and one line for
libpq's connection failures (texts as psycopg 3.3 / libpq 18 print them)."""

from __future__ import annotations

import pytest
from psycopg import conninfo

from drain.postgres import failover

TWO_HOSTS = (
    'connection failed: connection to server at "127.0.0.1", port 5433 failed: session is '
    "read-only\nMultiple connection attempts failed. All failures were:\n- host: '127.0.0.1', "
    "port: '5432', hostaddr: '127.0.0.1': connection failed: connection to server at "
    '"127.0.0.1", port 5432 failed: Connection refused\n\tIs the server running on that host '
    "and accepting TCP/IP connections?\n- host: '127.0.0.1', port: '5433', hostaddr: "
    "'127.0.0.1': connection failed: connection to server at \"127.0.0.1\", port 5433 failed: "
    "session is read-only"
)


@pytest.mark.parametrize(
    ("url", "added"),
    [
        ("postgresql://u@h1:5432,h2:5433/db", {"target_session_attrs": "read-write"}),
        ("host=h1,h2 dbname=db", {"target_session_attrs": "read-write"}),
        ("hostaddr=10.0.0.1,10.0.0.2 dbname=db", {"target_session_attrs": "read-write"}),
        ("postgresql://u@h1,h2/db?target_session_attrs=any", {}),
        ("postgresql://u@h1,h2/db?target_session_attrs=primary", {}),
        ("postgresql://u@h1:5432/db", {}),
        ("dbname=db", {}),
    ],
)
def test_read_write_by_default_with_several_hosts(url: str, added: dict[str, str]) -> None:
    assert failover.client_defaults(conninfo.conninfo_to_dict(url)) == added


def test_several_servers_are_each_named_with_their_answer() -> None:
    assert failover.describe(Exception(TWO_HOSTS)) == (
        "no server accepted the session: 127.0.0.1:5432: Connection refused; "
        "127.0.0.1:5433: session is read-only (a standby: waiting for a primary that "
        "accepts writes)"
    )


def test_one_server_keeps_libpq_first_line() -> None:
    refused = ('connection failed: connection to server at "127.0.0.1", port 5432 failed: '
               "Connection refused\n\tIs the server running on that host?")
    assert failover.describe(Exception(refused)) == refused.splitlines()[0]
    standby = ('connection failed: connection to server at "127.0.0.1", port 5433 failed: '
               "server is in hot standby mode")
    assert failover.describe(Exception(standby)) == (
        standby + " (a standby: waiting for a primary that accepts writes)")
    assert failover.describe(Exception("cannot execute LISTEN during recovery")) == (
        "cannot execute LISTEN during recovery")


def test_sockets_and_resolved_addresses() -> None:
    text = ('connection to server on socket "/run/pg/.s.PGSQL.5432" failed: No such file\n'
            'connection to server at "db.example" (10.0.0.7), port 5433 failed: timeout expired')
    assert failover.describe(Exception(text)) == (
        "no server accepted the session: /run/pg/.s.PGSQL.5432: No such file; "
        "db.example:5433: timeout expired")

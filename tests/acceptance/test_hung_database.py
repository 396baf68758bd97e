"""A Postgres path that hangs under the leader while a standby waits.

The leader reaches Postgres through a TCP proxy; the standby connects directly.
Mid-backlog the proxy stops forwarding on the leader's connection and keeps it
open (a hung server, pooler or middlebox: no error, no close, keepalives pass),
while new connections through it flow. 5 s past its statement timeout the
leader abandons that connection, reconnects, ends its abandoned backend (which
lives on behind the hang, holding the lock), and the lock goes to whichever
drain asks first. Nothing is lost; the batches in flight are published again.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from tests import support

DB_TIMEOUT = 1.0


def _backend_pid(db_url: str, drain_pid: int) -> int | None:
    """The pid of the backend serving the drain process ``drain_pid``."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s",
            [f"drain pid={drain_pid} %"]).fetchone()
    return int(row[0]) if row else None


def _backend_alive(db_url: str, pid: int) -> bool:
    with psycopg.connect(db_url, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                            [pid]).fetchone() == (1,)


def _drain(spawn: Any, url: str, name: str) -> support.Process:
    proc: support.Process = spawn(
        support.drain_argv("run", "--poll-interval", "0.2", "--batch-size", "500",
                           "--db-timeout", str(DB_TIMEOUT)),
        support.drain_env(url), name)
    return proc


def test_a_hung_leader_connection_is_given_up_and_jobs_flow_again(
    db_url: str, queue: str, spawn: Any
) -> None:
    staged = support.stage_backlog(db_url, queue, 60_000)
    proxy = support.TcpProxy(support.PG_PORT).start()
    try:
        proxied = support.via_proxy(db_url, proxy.port)
        leader = _drain(spawn, proxied, "leader")
        leader.wait_for_output("took the drain lock", timeout=30)
        standby = _drain(spawn, db_url, "standby")
        standby.wait_for_output("standby:", timeout=30)
        support.wait_for(lambda: support.staged_count(db_url) < len(staged), 60,
                         "the leader to make progress")
        ghost = _backend_pid(db_url, leader.pid)
        assert ghost is not None

        proxy.stall(new_connections=False)  # this link hangs; new ones flow
        hung_at = time.monotonic()
        held = support.staged_count(db_url)
        assert held > 0, "the backlog drained before the hang; stage more"
        support.wait_for(lambda: support.staged_count(db_url) < held, 60,
                         "jobs to flow again after the hang")
        flowing = time.monotonic() - hung_at
        leader.wait_for_output("abandoning the connection", timeout=30)
        support.wait_for(lambda: not _backend_alive(db_url, ghost), 30,
                         "the abandoned backend to end")
        support.wait_for(lambda: support.staged_count(db_url) == 0, 120, "the backlog to drain")
        new_leader = "standby" if "took the drain lock" in standby.output() else "leader"
        # Usually the drain ends its abandoned backend when it reconnects; under load
        # the hung link can also close by itself first (the backend then ends alone).
        ended = "ended this drain's abandoned session" in leader.output()
    finally:
        proxy.stop()
    copies = support.check_at_least_once(support.drain_queue(queue), staged)
    duplicates = sum(copies.values()) - len(copies)
    print(f"\n[hung database] statement timeout {DB_TIMEOUT:g}s: jobs flowed again "
          f"{flowing:.2f}s after the hang (the {new_leader} leads; abandoned backend "
          f"{'ended by the drain' if ended else 'gone by itself'}); 0 lost, "
          f"{duplicates} duplicates of {len(staged)} jobs")
    # At most the batches in flight when the connection hung: pipeline 4 x 500.
    assert duplicates <= 4 * 500

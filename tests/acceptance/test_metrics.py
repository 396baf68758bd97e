"""/metrics, /healthz, /readyz and /status.json of a real `drain run`."""

from __future__ import annotations

import json
import re
import socket
from typing import Any

import psycopg

import drain
from drain.postgres import pauses
from tests import roles, support
from tests.deploy import common

_get = support.http_get


def _metric(text: str, name: str, labels: str = "") -> float | None:
    """One sample's value from the Prometheus text format (None: not there)."""
    pattern = ("^" + re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "")
               + r" (\S+)$")
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else None


def _value(port: int, name: str, labels: str = "") -> float | None:
    status, text = _get(port, "/metrics")
    assert status == 200
    return _metric(text, name, labels)


def _start(spawn: Any, db_url: str, port: int, name: str, *flags: str,
           **env: str) -> support.Process:
    proc: support.Process = spawn(
        support.drain_argv("run", "--poll-interval", "0.2", "--metrics-port", str(port),
                           "--metrics-interval", "0.3", *flags),
        support.drain_env(db_url, **env), name)
    support.wait_for(lambda: _reachable(port), 30, f"{name}'s metrics port")
    return proc


def _reachable(port: int) -> bool:
    try:
        _get(port, "/healthz")
    except OSError:
        return False
    return True


def test_the_leader_counts_what_it_publishes_and_dead_letters(
    db_url: str, queue: str, spawn: Any
) -> None:
    port = support.free_port()
    _start(spawn, db_url, port, "leader")
    support.wait_for(lambda: _value(port, "drain_lock_held") == 1, 30, "the lock")
    support.stage_backlog(db_url, queue, 250)
    with psycopg.connect(db_url) as conn:
        for _ in range(3):
            drain.stage(conn, "t.gone", [], queue=queue, countdown=3600, expires=0.3)
    support.wait_for(lambda: _value(port, "drain_published_total") == 250, 30, "the counter")
    support.wait_for(lambda: _value(port, "drain_expired_total") == 3, 30, "the expiries")
    _, text = _get(port, "/metrics")
    assert _metric(text, "drain_deleted_total") == 250
    assert _metric(text, "drain_dead_lettered_total", 'reason="expired"') == 3
    assert _metric(text, "drain_batch_rows_count") is not None
    assert (_metric(text, "drain_batch_rows_sum") or 0) >= 250
    for name in ("drain_cycle_seconds_count", "drain_fetch_seconds_count",
                 "drain_publish_seconds_count", "drain_confirm_seconds_count"):
        assert (_metric(text, name) or 0) > 0, name
    assert (_metric(text, "drain_last_cycle_timestamp_seconds") or 0) > 0
    assert (_metric(text, "drain_lock_held_seconds") or 0) > 0
    assert _metric(text, "drain_up") == 1
    # The sampler sees the dead jobs and the (now empty) backlog.
    support.wait_for(
        lambda: _value(port, "drain_dead_jobs_rows", 'reason="expired"') == 3
        and _value(port, "drain_backlog_rows") == 0, 30, "a sample after the drain")
    status, body = _get(port, "/healthz")
    assert (status, body) == (200, "ok\n")
    status, body = _get(port, "/readyz")
    assert status == 200 and json.loads(body) == {"ready": True, "role": "leader",
                                                   "state": "active"}


def test_the_sampled_backlog_and_oldest_transaction_match_the_database(
    db_url: str, queue: str, spawn: Any
) -> None:
    port = support.free_port()
    with psycopg.connect(db_url) as conn:
        # Delayed rows stay staged: a backlog that holds still.
        for i in range(7):
            drain.stage(conn, "t.later", [i], queue=queue, tag="report", countdown=3600)
        pauses.pause(conn, "task", "t.later", reason="a test", actor="tester")
    with psycopg.connect(db_url) as idle:
        idle.execute("SELECT 1")  # an open transaction, idle: what vacuum waits for
        _start(spawn, db_url, port, "leader")
        # The sampler runs from the start, whatever the role: wait for the lock too, which
        # a loaded machine can take after the first sample.
        support.wait_for(lambda: _value(port, "drain_lock_held") == 1, 30, "the lock")
        support.wait_for(lambda: _value(port, "drain_backlog_rows") == 7, 30, "the backlog")
        support.wait_for(lambda: (_value(port, "drain_oldest_transaction_age_seconds") or 0) > 0,
                         30, "the oldest transaction")
        _, text = _get(port, "/metrics")
        assert _metric(text, "drain_backlog_group_rows", f'queue="{queue}",tag="report"') == 7
        assert _metric(text, "drain_backlog_estimated") == 0
        assert _metric(text, "drain_operator_paused", 'kind="task",name="t.later"') == 1
        # Every row is delayed an hour: none is due, none has waited.
        assert _metric(text, "drain_backlog_oldest_age_seconds") == 0
        assert _metric(text, "drain_staged_jobs_dead_tuples") is not None
        status, body = _get(port, "/status.json")
        assert status == 200
        page: dict[str, Any] = json.loads(body)
        assert page["role"] == "leader" and page["lanes"] == 1
        assert page["status"]["backlog"] == 7
        assert page["history"] and page["history"][-1]["backlog"] == 7
        idle.rollback()


def test_a_standby_is_ready_but_does_not_hold_the_lock(
    db_url: str, spawn: Any
) -> None:
    first, second = support.free_port(), support.free_port()
    leader = _start(spawn, db_url, first, "leader")
    support.wait_for(lambda: _value(first, "drain_lock_held") == 1, 30, "the leader")
    _start(spawn, db_url, second, "standby")
    # The role reads "standby" from the start, before the database is connected: wait for both.
    support.wait_for(lambda: _get(second, "/readyz")[0] == 200, 30, "the standby to be ready")
    assert json.loads(_get(second, "/readyz")[1])["role"] == "standby"
    assert _value(second, "drain_lock_held") == 0
    assert _value(second, "drain_lock_held_seconds") == 0
    leader.kill()
    support.wait_for(lambda: _value(second, "drain_lock_held") == 1, 30, "the takeover")
    assert json.loads(_get(second, "/readyz")[1])["role"] == "leader"


def test_a_drain_that_cannot_reach_its_database_is_alive_but_not_ready(spawn: Any) -> None:
    port = support.free_port()
    unreachable = f"postgresql://drain@127.0.0.1:{support.free_port()}/nowhere"
    _start(spawn, unreachable, port, "lonely")
    support.wait_for(lambda: _get(port, "/readyz")[0] == 503, 30, "not ready")
    assert json.loads(_get(port, "/readyz")[1])["ready"] is False
    assert _get(port, "/healthz")[0] == 200


def test_a_drain_whose_database_hangs_gives_the_connection_up_and_recovers_losing_nothing(
    db_url: str, queue: str, spawn: Any
) -> None:
    """Postgres accepts connections but never answers (the proxy holds every byte,
    new connections too): 5 s past its statement timeout the leader abandons the
    connection and says so; it cannot reconnect, so it is not ready, but it is
    alive (the loop turns). When Postgres answers again it reconnects, leads
    again, and the jobs staged meanwhile are delivered."""
    proxy = support.TcpProxy(support.PG_PORT).start()
    try:
        port = support.free_port()
        proxied = support.via_proxy(db_url, proxy.port)
        leader = _start(spawn, proxied, port, "leader", "--db-timeout", "1")
        support.wait_for(lambda: _value(port, "drain_lock_held") == 1, 30, "the lock")
        before = support.stage_backlog(db_url, queue, 200)
        support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the first jobs")

        proxy.stall()
        during = support.stage_backlog(db_url, queue, 300)  # straight to Postgres
        leader.wait_for_output("abandoning the connection", timeout=60)
        support.wait_for(lambda: _get(port, "/readyz")[0] == 503, 30, "/readyz to fail")
        assert _value(port, "drain_lock_held") == 0
        assert _get(port, "/healthz")[0] == 200, "a drain waiting to reconnect is alive"
        assert support.staged_count(db_url) == len(during), "nothing drains while it hangs"

        proxy.resume()
        support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                         "the jobs staged during the hang")
        support.wait_for(lambda: _value(port, "drain_lock_held") == 1, 30, "the lock again")
    finally:
        proxy.stop()
    support.check_at_least_once(support.drain_queue(queue), {**before, **during})


def test_no_password_reaches_the_metrics_or_the_status(
    db_url: str, spawn: Any
) -> None:
    port = support.free_port()
    secret = "s3cr3t-Pa55"
    # Trust authentication: the server ignores the password, the drain must still hide it.
    drain_role = roles.url(db_url, roles.RUNNER)
    with_password = drain_role.replace(f"{roles.RUNNER}@", f"{roles.RUNNER}:{secret}@")
    assert secret in with_password
    _start(spawn, with_password, port, "leader")
    support.wait_for(lambda: _get(port, "/status.json")[1].count('"backlog"') > 0, 30,
                     "a sample")
    for path in ("/metrics", "/status.json", "/readyz", "/"):
        assert secret not in _get(port, path)[1], path


def test_a_metrics_port_in_use_is_a_one_line_error(db_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = support.run_cli(db_url, "run", "--metrics-port", str(port), timeout=30)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("drain: error: cannot serve metrics on 127.0.0.1:")
    assert "--metrics-port" in lines[-1]


#: Series whose label values are data (a queue, a tag), not known in advance: a
#: drain with an empty backlog has none of them, and says so by their absence.
DATA_LABELLED = {"drain_backlog_group_rows", "drain_operator_paused"}


def test_a_fresh_drain_exports_every_series_the_dashboard_and_alerts_query(
    db_url: str, spawn: Any
) -> None:
    """Issue 35, item 4: before any fault, a drain's /metrics already has a series
    for every name the dashboard and the alerts query (a labelled counter at 0
    for each label value known in advance), so a panel shows 0 and an alert on
    rate() or increase() sees the first event. Before: drain_declare_refused_total
    and drain_publish_refused_total were absent until their first increment."""
    port = support.free_port()
    _start(spawn, db_url, port, "leader")
    support.wait_for(lambda: (_value(port, "drain_sample_timestamp_seconds") or 0) > 0, 30,
                     "the first sample")
    _, text = _get(port, "/metrics")
    exported = set(re.findall(r"^(drain_[a-z_]+)(?:\{| )", text, re.MULTILINE))
    queried = common.queried_metrics()
    assert len(queried) >= 20, sorted(queried)  # the reading of the files found them
    missing = {name: sorted(where) for name, where in queried.items()
               if name not in exported and name not in DATA_LABELLED}
    assert not missing, missing
    for code in ("403", "404", "406"):
        assert _metric(text, "drain_publish_refused_total", f'code="{code}"') == 0
    assert _metric(text, "drain_declare_refused_total", 'code="406"') == 0
    assert _metric(text, "drain_dead_jobs_rows", 'reason="expired"') == 0


def test_a_staged_at_of_minus_infinity_or_bc_does_not_poison_the_wait_histogram(
    db_url: str, queue: str, spawn: Any
) -> None:
    """Issue 36, item 4: one row staged by hand with staged_at '-infinity' (or a
    date BC) is published, but drain_job_wait_seconds_sum was +Inf (or 6.7e10)
    for the rest of the process. Such a row's wait is left out; the others' are
    still observed."""
    port = support.free_port()
    _start(spawn, db_url, port, "leader")
    support.wait_for(lambda: _value(port, "drain_lock_held") == 1, 30, "the lock")
    with psycopg.connect(db_url) as conn:
        for staged_at in ("-infinity", "0044-03-15 12:00:00+00 BC"):
            conn.execute("INSERT INTO staged_jobs (task_name, queue, staged_at) "
                         "VALUES ('t.odd', %s, %s)", (queue, staged_at))
            conn.commit()
            support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the odd row")
    support.stage_backlog(db_url, queue, 5)
    support.wait_for(lambda: _value(port, "drain_published_total") == 7, 30, "every row")
    _, text = _get(port, "/metrics")
    total = _metric(text, "drain_job_wait_seconds_sum")
    assert total is not None and 0 <= total < 60, total
    assert (_metric(text, "drain_job_wait_seconds_count") or 0) >= 1
    assert len(support.drain_queue(queue)) == 7

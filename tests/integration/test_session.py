"""The drain's own Postgres session: its settings, and the user's URL options kept."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from drain.postgres import sql
from drain.postgres.store import Store, fetch_params
from drain.settings.config import Settings
from tests import roles


def test_session_settings_and_user_options(db_url: str) -> None:
    url = db_url + "?options=-c%20search_path%3Dpublic,pg_catalog&keepalives_idle=9"
    store = Store(Settings(database_url=roles.url(url, roles.RUNNER), confirm_timeout=10))
    store.connect()
    try:
        assert store.try_lock()
        with psycopg.connect(db_url) as conn:
            row = conn.execute(
                "SELECT application_name FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name LIKE 'drain pid=%%'"
            ).fetchone()
        assert row is not None and " since=" in row[0]
        conn2 = store._require()
        settings: dict[str, str] = {str(k): str(v) for k, v in conn2.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN ("
            "'synchronous_commit', 'statement_timeout', 'idle_in_transaction_session_timeout',"
            "'search_path', 'tcp_keepalives_idle', 'enable_seqscan', 'enable_bitmapscan', "
            "'plan_cache_mode')"
        ).fetchall()}
        assert settings["synchronous_commit"] == "off"
        assert settings["statement_timeout"] == "30000"
        assert settings["idle_in_transaction_session_timeout"] == "40000"  # confirm + 30 s
        assert settings["search_path"] == "public,pg_catalog"  # the user's options survive
        # Plans that walk the indexes and stop at LIMIT, whatever the statistics say.
        assert settings["enable_seqscan"] == settings["enable_bitmapscan"] == "off"
        assert settings["plan_cache_mode"] == "force_custom_plan"
        assert conn2.info.get_parameters()["keepalives_idle"] == "9"
    finally:
        store.close()


def test_fetch_walks_the_index_on_a_table_the_planner_knows_nothing_about(db_url: str) -> None:
    """A fresh backlog (no ANALYZE yet) must not be read whole and sorted per batch."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (task_name, args) "
            "SELECT 't', jsonb_build_array(g) FROM generate_series(1, 40000) g"
        )
    store = Store(Settings(database_url=roles.url(db_url, roles.RUNNER)))
    store.connect()
    try:
        conn = store._require()
        rows = conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + sql.query("fetch_batch"),
            fetch_params(1000, exclude=list(range(1, 1001))),
        ).fetchone()
        assert rows is not None
        explained: Any = rows[0]
        plan = json.dumps(explained)
        assert "Seq Scan" not in plan and "Bitmap Heap Scan" not in plan
        assert '"Index Name": "staged_jobs_ready_idx"' in plan
        # The scan stops after the rows it needs: 1,000 in flight skipped + 1,000 fetched.
        scanned = [node for node in _nodes(explained[0]["Plan"])
                   if node.get("Index Name") == "staged_jobs_ready_idx"]
        assert scanned and scanned[0]["Actual Rows"] + scanned[0].get(
            "Rows Removed by Filter", 0) <= 2000
    finally:
        store.close()


def test_fetch_leaves_out_exactly_the_rows_in_flight(db_url: str) -> None:
    """The rows in flight are left out by their range, then by a hash of their ids
    (not compared one by one, nor estimated one by one by the planner): whatever
    their ids, exactly they are left out."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        ids = [r[0] for r in conn.execute(
            "INSERT INTO staged_jobs (task_name, args) "
            "SELECT 't', jsonb_build_array(g) FROM generate_series(1, 3000) g RETURNING id")]
    # Below, inside (scattered: every third id of the middle) and at both ends.
    in_flight = [ids[0], *ids[1000:2000:3], ids[-1]]
    store = Store(Settings(database_url=roles.url(db_url, roles.RUNNER)))
    store.connect()
    try:
        conn = store._require()
        params = fetch_params(5000, exclude=in_flight)
        fetched = [int(str(r[0])) for r in conn.execute(sql.query("fetch_batch"), params)]
        assert sorted(fetched) == sorted(set(ids) - set(in_flight))
        explained = conn.execute("EXPLAIN (FORMAT JSON) " + sql.query("fetch_batch"),
                                 params).fetchone()
        assert explained is not None
        assert '"Subplan Name": "SubPlan' in json.dumps(explained[0])
        assert "hashed SubPlan" in json.dumps(explained[0])
        # Nothing in flight: every row.
        assert len(conn.execute(sql.query("fetch_batch"), fetch_params(5000)).fetchall()) == 3000
    finally:
        store.close()


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    found = [node]
    for child in node.get("Plans", []):
        found += _nodes(child)
    return found


def test_a_wait_takes_every_queued_notification_at_once(db_url: str) -> None:
    """One NOTIFY per staging commit piles up in psycopg while the drain is busy;
    a wait must take them all, or each would cost an empty cycle later (and the
    queue would grow without bound under a steady load)."""
    store = Store(Settings(database_url=roles.url(db_url, roles.RUNNER)))
    store.connect()
    try:
        assert store.arm(announce=False)  # idle: staging notifies (drain.postgres.wakeup)
        with psycopg.connect(db_url, autocommit=True) as app:
            for i in range(100):
                app.execute("INSERT INTO staged_jobs (task_name, args) VALUES ('t', %s)",
                            [json.dumps([i])])
        # The notifications arrive while the drain runs a query of its own.
        conn = store._require()
        conn.execute("SELECT pg_sleep(0.2)")
        assert store.wait(0.0) is True
        assert store.wait(0.0) is False, "notifications were left queued"
    finally:
        store.close()


def test_a_batch_forgets_the_notifications_of_rows_it_can_already_see(db_url: str) -> None:
    store = Store(Settings(database_url=roles.url(db_url, roles.RUNNER)))
    store.connect()
    try:
        assert store.arm(announce=False)  # idle: staging notifies (drain.postgres.wakeup)
        with psycopg.connect(db_url, autocommit=True) as app:
            for _ in range(20):
                app.execute("INSERT INTO staged_jobs (task_name) VALUES ('t')")
        store._require().execute("SELECT pg_sleep(0.2)")
        with store.batch():
            assert len(store.fetch(100)) == 20
        assert store.wait(0.0) is False
    finally:
        store.close()


def test_commands_skipped_after_an_error_in_one_round_trip_still_run_later(db_url: str) -> None:
    """Session._execute_all (psycopg's pipeline mode), as Store._keyed uses it: a
    command the server skipped because an earlier one failed must not be taken
    for prepared by psycopg (with auto-preparation, the release skipped on the
    run that was to prepare it said 'prepared statement "_pg3_N" does not exist'
    on its next run, and the session was lost)."""
    store = Store(Settings(database_url=roles.url(db_url, roles.RUNNER)))
    store.connect()
    try:
        with store.batch():
            for attempt in range(12):
                timeout = "never" if attempt % 6 == 5 else "5ms"  # fails on the 6th and 12th
                try:
                    cursors = store._execute_all([
                        ("keyed_savepoint", None), ("keyed_lock_timeout", {"timeout": timeout}),
                        ("keyed_release", None)])
                except psycopg.errors.InvalidParameterValue:
                    store._execute_all([("keyed_rollback", None), ("keyed_release", None)])
                else:
                    assert cursors[1].fetchall() == [("5ms",)]
    finally:
        store.close()

"""The staging schema on a real Postgres does what staging_schema.sql promises.

* ``migrate`` is idempotent: a second run leaves the catalog (columns,
  constraints, triggers, function, grants, comment) and the staged rows as
  they were, on a migrated database and on an empty one alike.
* The CHECK constraints refuse, in the inserting transaction, rows that could
  never become a Celery message, and a plain SQL INSERT gets the defaults.
* While a drain is idle (it raised the wake flag, drain/wakeup.py), the NOTIFY
  trigger sends one notification per committed INSERT or COPY statement,
  nothing before the commit and nothing for a rollback (without an idle drain
  it sends none: tests/integration/test_wakeup.py).
* drain_stager may only INSERT; drain_runner may only SELECT and DELETE, and
  set the wake flag.
* The wheel carries a byte-identical copy of the schema.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import psycopg.errors
import psycopg.types.json
import pytest

import drain
from drain import dead, sql, store
from drain.config import Settings
from drain.message import StagedRow
from drain.store import EVERY_CELERY_ROW, fetch_params, migrate, queue_given_from
from tests import support

CHANNEL = "drain_staged_jobs"
VALID_INSERT = (
    "INSERT INTO staged_jobs (task_name, kwargs) "
    """VALUES ('search.index_annotation', '{"annotation_id": 42}')"""
)

# -- migrate --------------------------------------------------------------------------

CATALOG_QUERIES = {
    "relations": """
        SELECT c.relname, c.relkind FROM pg_class c
        WHERE c.relnamespace = 'public'::regnamespace ORDER BY c.relname
    """,
    "columns": """
        SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               a.attidentity, pg_get_expr(d.adbin, d.adrelid)
        FROM pg_attribute a
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE a.attrelid = 'staged_jobs'::regclass AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY a.attnum
    """,
    "constraints": """
        SELECT conname, contype, pg_get_constraintdef(oid) FROM pg_constraint
        WHERE conrelid = 'staged_jobs'::regclass ORDER BY conname
    """,
    "indexes": """
        SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid) FROM pg_index
        WHERE indrelid = 'staged_jobs'::regclass ORDER BY 1
    """,
    "triggers": """
        SELECT tgname, tgenabled, pg_get_triggerdef(oid) FROM pg_trigger
        WHERE tgrelid = 'staged_jobs'::regclass AND NOT tgisinternal ORDER BY tgname
    """,
    "functions": """
        SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid) FROM pg_proc p
        WHERE p.pronamespace = 'public'::regnamespace ORDER BY 1
    """,
    # REVOKE + GRANT may reorder the aclitems, which is no change: compare them sorted.
    "grants": """
        SELECT c.relname::text, coalesce(r.rolname, 'PUBLIC'), acl.privilege_type,
               acl.is_grantable
        FROM pg_class c, aclexplode(c.relacl) acl
        LEFT JOIN pg_roles r ON r.oid = acl.grantee
        WHERE c.oid IN ('staged_jobs'::regclass, 'dead_jobs'::regclass, 'drain_processed'::regclass)
        ORDER BY 1, 2, 3
    """,
    "comment": "SELECT obj_description('staged_jobs'::regclass, 'pg_class')",
    "roles": """
        SELECT rolname, rolcanlogin FROM pg_roles
        WHERE rolname IN ('drain_stager', 'drain_runner') ORDER BY rolname
    """,
}


def catalog(url: str) -> dict[str, list[tuple[Any, ...]]]:
    with psycopg.connect(url) as conn:
        return {name: conn.execute(q).fetchall() for name, q in CATALOG_QUERIES.items()}


def apply_migrate(url: str) -> None:
    with psycopg.connect(url) as conn:
        store.migrate(conn)


def test_catalog_snapshot_is_the_schema(db_url: str) -> None:
    """Guards the idempotency tests: the snapshot they compare is not empty or blind."""
    snap = catalog(db_url)
    assert {name for name, _, _ in snap["constraints"]} == {
        "staged_jobs_pkey",
        "staged_jobs_task_name_not_blank",
        "staged_jobs_task_name_length",
        "staged_jobs_args_is_array",
        "staged_jobs_kwargs_is_object",
        "staged_jobs_queue_length",
        "staged_jobs_tag_length",
        "staged_jobs_embed_is_embed",
    }
    (notify, n_enabled, n_def), (xact, x_enabled, x_def) = snap["triggers"]
    assert (notify, n_enabled) == ("staged_jobs_notify", "O")
    assert "AFTER INSERT ON public.staged_jobs FOR EACH STATEMENT" in n_def
    assert "WHEN (((pg_sequence_last_value('drain_wake'::regclass) % (2)::bigint) = 1))" in n_def
    assert (xact, x_enabled) == ("staged_jobs_xact", "O")
    assert "BEFORE INSERT OR UPDATE ON public.staged_jobs FOR EACH ROW" in x_def
    assert {
        (table, role, priv) for table, role, priv, _ in snap["grants"] if role.startswith("drain_")
    } == {
        ("staged_jobs", "drain_stager", "INSERT"),
        ("staged_jobs", "drain_runner", "SELECT"),
        ("staged_jobs", "drain_runner", "DELETE"),
        ("dead_jobs", "drain_runner", "INSERT"),
    }
    assert snap["roles"] == [("drain_runner", False), ("drain_stager", False)]
    assert [c[0] for c in snap["columns"]] == [
        "id", "task_id", "task_name", "args", "kwargs", "queue", "staged_at", "priority",
        "tag", "not_before", "expires_at", "xact", "embed",
    ]


def test_migrate_again_changes_nothing(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        drain.stage(conn, "t.before", [1])
    before = catalog(db_url)

    apply_migrate(db_url)

    assert catalog(db_url) == before
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT task_name, args FROM staged_jobs").fetchall()
    assert rows == [("t.before", [1])]


def test_migrate_empty_database_twice(db_url: str, empty_db_url: str) -> None:
    apply_migrate(empty_db_url)
    first = catalog(empty_db_url)
    apply_migrate(empty_db_url)

    assert catalog(empty_db_url) == first
    # ...and it is the same schema the template (and every other test) got.
    assert first == catalog(db_url)


# -- CHECK constraints -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("column", "value", "constraint"),
    [
        ("args", "{}", "staged_jobs_args_is_array"),
        ("args", "1", "staged_jobs_args_is_array"),
        ("args", '"[1]"', "staged_jobs_args_is_array"),
        ("args", "null", "staged_jobs_args_is_array"),
        ("kwargs", "[]", "staged_jobs_kwargs_is_object"),
        ("kwargs", '"x"', "staged_jobs_kwargs_is_object"),
        ("task_name", "", "staged_jobs_task_name_not_blank"),
        ("task_name", "   ", "staged_jobs_task_name_not_blank"),
        ("task_name", "\t\n", "staged_jobs_task_name_not_blank"),
        ("task_name", "t" * 1025, "staged_jobs_task_name_length"),
        ("queue", "", "staged_jobs_queue_length"),
        ("queue", "q" * 256, "staged_jobs_queue_length"),
        # 128 characters but 256 bytes: the limit is on bytes, as for AMQP.
        ("queue", "é" * 128, "staged_jobs_queue_length"),
        ("embed", "[]", "staged_jobs_embed_is_embed"),
        ("embed", '{"chain": [], "link": []}', "staged_jobs_embed_is_embed"),
    ],
)
def test_check_constraints_refuse_bad_rows(
    db_url: str, column: str, value: str, constraint: str
) -> None:
    row = {"task_name": "t.ok", "args": "[]", "kwargs": "{}", "queue": "celery", "embed": None,
           column: value}
    with psycopg.connect(db_url) as conn:
        with pytest.raises(psycopg.errors.CheckViolation) as refused:
            conn.execute(
                "INSERT INTO staged_jobs (task_name, args, kwargs, queue, embed) VALUES "
                "(%(task_name)s, %(args)s::jsonb, %(kwargs)s::jsonb, %(queue)s, %(embed)s::jsonb)",
                row,
            )
        assert refused.value.diag.constraint_name == constraint
        conn.rollback()
    assert support.staged_count(db_url) == 0


def test_plain_sql_insert_gets_defaults(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute(VALID_INSERT)
        # The byte limits are inclusive: 255 bytes of queue, 1024 of task name.
        conn.execute(
            "INSERT INTO staged_jobs (task_name, queue) VALUES (%s, %s)",
            ("ü" * 512, "é" * 127 + "q"),
        )
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT task_id, task_name, args, kwargs, queue, staged_at IS NOT NULL "
            "FROM staged_jobs ORDER BY id"
        ).fetchall()
    assert len(rows) == 2
    task_id, task_name, args, kwargs, queue, has_staged_at = rows[0]
    assert isinstance(task_id, uuid.UUID)
    assert (task_name, args, kwargs, queue, has_staged_at) == (
        "search.index_annotation", [], {"annotation_id": 42}, None, True,
    )  # no queue given: NULL, routed by the drain (--app) or sent to celery
    assert rows[1][0] != task_id


# -- NOTIFY ------------------------------------------------------------------------------


@pytest.fixture
def listener(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A session that listens and raises the wake flag, as an idle drain does."""
    with support.wake_flag_raised(db_url) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        yield conn


def notifier_pids_until_sentinel(listener: psycopg.Connection[Any], db_url: str) -> list[int]:
    """Backend pids of the notifications received before a sentinel INSERT's.

    The sentinel commits from a new session after everything the test did, and
    Postgres delivers notifications in commit order, so once the sentinel's
    arrives every earlier notification has arrived too: no waiting window.
    """
    with psycopg.connect(db_url) as sentinel:
        sentinel.execute(VALID_INSERT)
        sentinel_pid = sentinel.info.backend_pid
    pids: list[int] = []
    for notify in listener.notifies(timeout=10):
        assert notify.channel == CHANNEL
        if notify.pid == sentinel_pid:
            return pids
        pids.append(notify.pid)
    raise AssertionError(f"no notification for the sentinel INSERT; got {pids}")


def test_one_notification_for_a_multi_row_insert(
    db_url: str, listener: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (task_name, args) "
            "SELECT 't.multi', jsonb_build_array(i) FROM generate_series(1, 100) i"
        )
        pid = conn.info.backend_pid
    assert support.staged_count(db_url) == 100
    assert notifier_pids_until_sentinel(listener, db_url) == [pid]


def test_one_notification_for_stage_many_copy(
    db_url: str, listener: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(db_url) as conn:
        drain.stage_many(conn, [drain.Job("t.copy", [i]) for i in range(1000)])
        pid = conn.info.backend_pid
    assert support.staged_count(db_url) == 1000
    assert notifier_pids_until_sentinel(listener, db_url) == [pid]


def test_notification_only_after_commit(db_url: str, listener: psycopg.Connection[Any]) -> None:
    with psycopg.connect(db_url) as conn:
        drain.stage(conn, "t.pending")
        pid = conn.info.backend_pid
        # Transaction still open: a bounded window, and a later commit, see nothing from it.
        assert list(listener.notifies(timeout=0.3)) == []
        assert notifier_pids_until_sentinel(listener, db_url) == []

        conn.commit()
        [notify] = list(listener.notifies(timeout=10, stop_after=1))
        assert (notify.channel, notify.pid) == (CHANNEL, pid)
    assert notifier_pids_until_sentinel(listener, db_url) == []


def test_no_notification_for_a_rollback(db_url: str, listener: psycopg.Connection[Any]) -> None:
    with psycopg.connect(db_url) as conn:
        drain.stage_many(conn, [drain.Job("t.rolled_back", [i]) for i in range(10)])
        conn.execute(VALID_INSERT)
        conn.rollback()
    assert list(listener.notifies(timeout=0.3)) == []
    assert notifier_pids_until_sentinel(listener, db_url) == []
    assert support.staged_count(db_url) == 1  # the sentinel


# -- grants -------------------------------------------------------------------------------


@pytest.fixture
def login_roles(db_url: str) -> Iterator[tuple[str, str]]:
    """(app_role, drain_role): throwaway LOGIN roles holding drain_stager / drain_runner."""
    app_role, drain_role = support.unique("drain_app"), support.unique("drain_run")
    with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{app_role}" LOGIN')
        admin.execute(f'CREATE ROLE "{drain_role}" LOGIN')
        admin.execute(f'GRANT drain_stager TO "{app_role}"')
        admin.execute(f'GRANT drain_runner TO "{drain_role}"')
    try:
        yield app_role, drain_role
    finally:
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(f'DROP OWNED BY "{app_role}", "{drain_role}"')
        with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
            for role in (app_role, drain_role):
                admin.execute(f'DROP ROLE IF EXISTS "{role}"')


def assert_refused(conn: psycopg.Connection[Any], statement: str) -> None:
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(statement)


def test_grants(db_url: str, login_roles: tuple[str, str]) -> None:
    app_role, drain_role = login_roles
    with psycopg.connect(db_url, autocommit=True) as owner:
        # An application table: the drain's role must not be able to touch it.
        owner.execute("CREATE TABLE annotation (id int PRIMARY KEY, text text)")
        owner.execute("INSERT INTO annotation VALUES (1, 'secret')")

    with psycopg.connect(db_url, user=app_role, autocommit=True) as app:
        assert app.info.user == app_role
        app.execute(VALID_INSERT)
        staged = drain.stage(app, "t.app", [1])
        drain.stage_many(app, [drain.Job("t.app_many", [2]), drain.Job("t.app_many", [3])])
        assert_refused(app, "SELECT count(*) FROM staged_jobs")
        assert_refused(app, "DELETE FROM staged_jobs")
        assert_refused(app, "UPDATE staged_jobs SET queue = 'other'")
        assert_refused(app, sql.query("raise_flag"))  # only the drain sets the wake flag
        with support.wake_flag_raised(db_url):
            drain.stage(app, "t.app_while_idle", [4])  # it reads it, and notifies
    assert support.staged_count(db_url) == 5

    with psycopg.connect(db_url, user=drain_role, autocommit=True) as runner:
        assert runner.info.user == drain_role
        assert_refused(runner, VALID_INSERT)
        assert_refused(runner, "UPDATE staged_jobs SET queue = 'other'")
        # The drain's own queries are enough with drain_runner alone.
        params = store.fetch_params(10)
        rows = runner.execute(sql.query("fetch_batch"), params).fetchall()
        assert len(rows) == 5
        [app_row] = [r for r in rows if r[1] == staged]
        cur = runner.execute(sql.query("delete_confirmed"), {"ids": [app_row[0]]})
        assert cur.rowcount == 1
        assert runner.execute("SELECT count(*) FROM staged_jobs").fetchone() == (4,)
        assert runner.execute("DELETE FROM staged_jobs").rowcount == 4
        # The wake-up handshake (drain.wakeup).
        for name in ("raise_flag", "silent_writers", "wake_flag", "lower_flag"):
            runner.execute(sql.query(name))
        # It can set rows aside in dead_jobs, but nothing else of the application's.
        runner.execute(
            "INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, priority, "
            "staged_at, reason) VALUES (1, gen_random_uuid(), 't', '[]', '{}', 'q', 0, now(), "
            "'invalid')"
        )
        assert_refused(runner, "SELECT * FROM dead_jobs")
        assert_refused(runner, "SELECT * FROM annotation")
        assert_refused(runner, "DELETE FROM annotation")
        assert_refused(runner, "UPDATE annotation SET text = 'x'")
        assert_refused(runner, "INSERT INTO annotation VALUES (2, 'x')")
    assert support.staged_count(db_url) == 0


# -- packaging --------------------------------------------------------------------------


def test_wheel_carries_the_schema(tmp_path: Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path), str(support.ROOT)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    [wheel] = tmp_path.glob("drain-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert {"drain/staging_schema.sql", "drain/queries.sql", "drain/py.typed"} <= names
        packaged = zf.read("drain/staging_schema.sql")
        queries = zf.read("drain/queries.sql")
    assert packaged == (support.ROOT / "staging_schema.sql").read_bytes()
    assert queries == (support.ROOT / "drain" / "queries.sql").read_bytes()



# -- "no queue given" --------------------------------------------------------------------


def _read(db_url: str) -> list[tuple[str, str, bool]]:
    """What the drain reads of every row: (task, queue, staged without a queue)."""
    with psycopg.connect(db_url) as conn:
        params = fetch_params(100, queue_given_from=queue_given_from(conn))
        embed = conn.execute(sql.query("embed_present")).fetchone() == (True,)
        rows = [StagedRow(*r) for r in conn.execute(sql.query("fetch_batch", embed=embed),
                                                      params)]
    return [(r.task_name, r.queue, r.unrouted) for r in sorted(rows, key=lambda r: r.id)]


def test_no_queue_is_null_and_an_upgraded_database_keeps_its_old_rows_routing(
    db_url: str,
) -> None:
    # A new database: every row staged since the schema was applied says what it gave.
    with psycopg.connect(db_url) as conn:
        assert queue_given_from(conn) == 1
    support.as_an_older_schema(db_url)
    with psycopg.connect(db_url) as conn:
        assert queue_given_from(conn) == EVERY_CELERY_ROW
        conn.execute("INSERT INTO staged_jobs (task_name) VALUES ('old.default')")
        conn.execute("INSERT INTO staged_jobs (task_name, queue) VALUES ('old.q1', 'q1')")
    assert _read(db_url) == [("old.default", "celery", True), ("old.q1", "q1", False)]

    with psycopg.connect(db_url) as conn:
        migrate(conn)  # in place: no row rewritten
        conn.commit()
        assert conn.execute(
            "SELECT attnotnull, pg_get_expr(adbin, adrelid) FROM pg_attribute "
            "LEFT JOIN pg_attrdef ON adrelid = attrelid AND adnum = attnum "
            "WHERE attrelid = 'staged_jobs'::regclass AND attname = 'queue'"
        ).fetchone() == (False, None)
        drain.stage(conn, "new.none")
        drain.stage(conn, "new.celery", queue="celery")
        conn.execute("INSERT INTO staged_jobs (task_name) VALUES ('new.sql')")
        migrate(conn)  # again: the mark stays where the upgrade put it
        assert queue_given_from(conn) == 3
    assert _read(db_url) == [
        ("old.default", "celery", True),  # gave no queue then: still routed as before
        ("old.q1", "q1", False),
        ("new.none", "celery", True),
        ("new.celery", "celery", False),  # an explicit celery is apply_async(queue='celery')
        ("new.sql", "celery", True),
    ]


# -- the embed column (callbacks, chains) ---------------------------------------------------

_EMBED: dict[str, Any] = {"callbacks": [{"task": "t.next", "args": [], "kwargs": {}, "options": {},
                         "subtask_type": None, "immutable": False}],
          "errbacks": None, "chain": None, "chord": None}


def _stage_with_embed(db_url: str, task: str, **columns: Any) -> None:
    with psycopg.connect(db_url) as conn:
        names = ["task_name", "embed", *columns]
        conn.execute(f"INSERT INTO staged_jobs ({', '.join(names)}) VALUES "
                     f"({', '.join(['%s'] * len(names))})",
                     [task, psycopg.types.json.Jsonb(_EMBED), *columns.values()])


def test_a_drain_on_a_schema_from_before_the_embed_column_reads_it_once_it_is_added(
    db_url: str,
) -> None:
    """The drain looks for the column at the start of each batch, under the batch's
    snapshot: a row staged with an embed is never read without it."""
    support.as_an_older_schema(db_url)
    with psycopg.connect(db_url) as conn:
        drain.stage(conn, "old.job")
    drainer = store.Store(Settings(database_url=db_url))
    drainer.connect()
    try:
        with drainer.batch():
            [old] = drainer.fetch(10)
            drainer.bury([(old.id, "invalid", "moved without an embed column")])
        assert old.embed_json is None
        with psycopg.connect(db_url) as conn:
            migrate(conn)
        _stage_with_embed(db_url, "new.with_callbacks")
        with drainer.batch():
            [new] = drainer.fetch(10)
            drainer.bury([(new.id, "invalid", "moved with its embed")])
        assert new.task_name == "new.with_callbacks"
        assert new.embed_json is not None and json.loads(new.embed_json) == _EMBED
    finally:
        drainer.close()
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT task_name, embed FROM dead_jobs ORDER BY dead_id").fetchall(
        ) == [("old.job", None), ("new.with_callbacks", _EMBED)]


def test_an_expired_job_keeps_its_embed_in_dead_jobs_and_gets_it_back_on_requeue(
    db_url: str,
) -> None:
    _stage_with_embed(db_url, "t.expired", expires_at="2000-01-01T00:00:00Z")
    drainer = store.Store(Settings(database_url=db_url))
    drainer.connect()
    try:
        with drainer.batch():
            assert drainer.expire([], 10) == 1
    finally:
        drainer.close()
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT embed FROM dead_jobs").fetchone() == (_EMBED,)
        assert dead.requeue(conn, dead.Filters(reason="expired")) == 1
        assert conn.execute("SELECT task_name, embed FROM staged_jobs").fetchall() == [
            ("t.expired", _EMBED)]

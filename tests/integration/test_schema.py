"""The staging schema on a real Postgres does what staging_schema.sql promises.

* ``migrate`` is idempotent: a second run leaves the catalog (columns,
  constraints, triggers, function, grants, comment) and the staged rows as
  they were, on a migrated database and on an empty one alike.
* The CHECK constraints refuse, in the inserting transaction, rows that could
  never become a Celery message, and a plain SQL INSERT gets the defaults.
* While a drain is idle (it raised the wake flag, drain/postgres/wakeup.py), the NOTIFY
  trigger sends one notification per committed INSERT or COPY statement,
  nothing before the commit and nothing for a rollback (without an idle drain
  it sends none: tests/integration/test_wakeup.py).
* the stager role may only INSERT; the runner may only SELECT and DELETE, and
  set the wake flag.
* The wheel carries a byte-identical copy of the schema.
"""

from __future__ import annotations

import datetime as dt
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
from drain.errors import SchemaMissing
from drain.postgres import dead, migration, sql, store
from drain.postgres.migration import migrate
from drain.postgres.rows import StagedRow
from drain.postgres.store import fetch_params
from drain.settings.config import Settings
from tests import roles, support

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
        WHERE c.oid IN ('staged_jobs'::regclass, 'dead_jobs'::regclass, 'drain_processed'::regclass,
                        'drain_schema_state'::regclass, 'drain_wake'::regclass)
        ORDER BY 1, 2, 3
    """,
    "column_grants": """
        SELECT a.attrelid::regclass::text, a.attname::text, r.rolname, acl.privilege_type
        FROM pg_attribute a, aclexplode(a.attacl) acl
        JOIN pg_roles r ON r.oid = acl.grantee
        WHERE a.attrelid = 'staged_jobs'::regclass
        ORDER BY 1, 2, 3, 4
    """,
    "comment": "SELECT obj_description('staged_jobs'::regclass, 'pg_class')",
    "roles": """
        SELECT rolname, rolcanlogin FROM pg_roles
        WHERE rolname IN (SELECT value || kind FROM drain_settings,
                                 unnest(ARRAY['stager', 'runner', 'operator', 'consumer']) kind
                          WHERE key = 'role_prefix')
        ORDER BY rolname
    """,
}


def catalog(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """The catalog of ``url``'s drain objects, its group roles' names shown as
    ``<prefix>stager``... (each database has its own)."""
    prefix = roles.prefix_of(url)

    def generic(value: Any) -> Any:
        return (f"<prefix>{value.removeprefix(prefix)}"
                if isinstance(value, str) and value.startswith(prefix) else value)

    with psycopg.connect(url) as conn:
        return {name: [tuple(map(generic, row)) for row in conn.execute(q).fetchall()]
                for name, q in CATALOG_QUERIES.items()}


def apply_migrate(url: str) -> None:
    with psycopg.connect(url) as conn:
        migration.migrate(conn)


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
        "staged_jobs_trace_is_object",
    }
    (notify, n_enabled, n_def), (xact, x_enabled, x_def) = snap["triggers"]
    assert (notify, n_enabled) == ("staged_jobs_notify", "O")
    assert "AFTER INSERT ON public.staged_jobs FOR EACH STATEMENT" in n_def
    assert "WHEN (((pg_sequence_last_value('drain_wake'::regclass) % (2)::bigint) = 1))" in n_def
    assert (xact, x_enabled) == ("staged_jobs_xact", "O")
    assert "BEFORE INSERT OR UPDATE ON public.staged_jobs FOR EACH ROW" in x_def
    assert roles.prefix_of(db_url).endswith("_drain_")  # the template's: <its name>_drain_
    assert {
        (table, role.removeprefix("<prefix>"), priv) for table, role, priv, _ in snap["grants"]
        if role.startswith("<prefix>")
    } == {
        ("staged_jobs", "stager", "INSERT"),
        ("staged_jobs", "runner", "SELECT"),
        ("staged_jobs", "runner", "DELETE"),
        ("dead_jobs", "runner", "SELECT"),
        ("dead_jobs", "runner", "INSERT"),
        ("drain_schema_state", "runner", "SELECT"),
        ("drain_wake", "runner", "UPDATE"),
        ("staged_jobs", "operator", "INSERT"),
        ("staged_jobs", "operator", "SELECT"),
        ("dead_jobs", "operator", "SELECT"),
        ("dead_jobs", "operator", "DELETE"),
        ("drain_processed", "operator", "SELECT"),
        ("drain_processed", "operator", "DELETE"),
        ("drain_processed", "consumer", "SELECT"),
        ("drain_processed", "consumer", "INSERT"),
    }
    # RETURNING task_id (and drain_stage(), which returns it): that column only.
    assert snap["column_grants"] == [("staged_jobs", "task_id", "<prefix>stager", "SELECT")]
    assert snap["roles"] == [("<prefix>consumer", False), ("<prefix>operator", False),
                             ("<prefix>runner", False), ("<prefix>stager", False)]
    assert [c[0] for c in snap["columns"]] == [
        "id", "task_id", "task_name", "args", "kwargs", "queue", "queue_legacy", "staged_at",
        "priority",
        "tag", "not_before", "expires_at", "xact", "embed", "trace",
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


def assert_refused(conn: psycopg.Connection[Any], statement: str) -> None:
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(statement)


def test_grants(db_url: str) -> None:
    """Each role of tests/roles.py (the recipe in docs/running.md) can do what its commands
    need, and nothing else."""
    urls = roles.of(db_url)
    with psycopg.connect(db_url, autocommit=True) as owner:
        # An application table: the drain's roles must not be able to touch it.
        owner.execute("CREATE TABLE annotation (id int PRIMARY KEY, text text)")
        owner.execute("INSERT INTO annotation VALUES (1, 'secret')")

    with psycopg.connect(urls.stager, autocommit=True) as app:
        assert app.info.user == roles.STAGER
        app.execute(VALID_INSERT)
        staged = drain.stage(app, "t.app", [1])
        drain.stage_many(app, [drain.Job("t.app_many", [2]), drain.Job("t.app_many", [3])])
        # Every documented way to stage from SQL, the task id returned.
        returned = app.execute(VALID_INSERT + " RETURNING task_id").fetchone()
        assert returned is not None and isinstance(returned[0], uuid.UUID)
        by_function = app.execute("SELECT drain_stage('t.fn', kwargs => '{\"a\": 1}')").fetchone()
        assert by_function is not None and isinstance(by_function[0], uuid.UUID)
        assert_refused(app, "SELECT args FROM staged_jobs")
        assert_refused(app, "SELECT * FROM staged_jobs")
        assert_refused(app, "DELETE FROM staged_jobs")
        assert_refused(app, "UPDATE staged_jobs SET queue = 'other'")
        assert_refused(app, "SELECT * FROM dead_jobs")
        assert_refused(app, "SELECT * FROM drain_processed")
        assert_refused(app, sql.query("raise_flag"))  # only the drain sets the wake flag
        with support.wake_flag_raised(db_url):
            drain.stage(app, "t.app_while_idle", [4])  # it reads it, and notifies
    assert support.staged_count(db_url) == 7

    with psycopg.connect(urls.runner, autocommit=True) as runner:
        assert runner.info.user == roles.RUNNER
        assert_refused(runner, VALID_INSERT)
        assert_refused(runner, "UPDATE staged_jobs SET queue = 'other'")
        # The drain's own queries are enough with drain_runner alone.
        params = store.fetch_params(10)
        rows = runner.execute(sql.query("fetch_batch"), params).fetchall()
        assert len(rows) == 7
        [app_row] = [r for r in rows if r[1] == str(staged)]
        other = next(r for r in rows if r[1] != str(staged))
        cur = runner.execute(sql.query("delete_confirmed"),
                             {"ids": [app_row[0]], "xacts": [str(app_row[-1])]})
        assert cur.rowcount == 1
        assert runner.execute("SELECT count(*) FROM staged_jobs").fetchone() == (6,)
        runner.execute(sql.query("keyed_lock_timeout"), {"timeout": "50ms"})
        cur = runner.execute(sql.query("bury"), {
            "ids": [other[0]], "xacts": [str(other[-1])], "reasons": ["invalid"],
            "details": ["x"]})
        assert cur.rowcount == 1
        assert runner.execute("DELETE FROM staged_jobs").rowcount == 5
        # The wake-up handshake (drain.postgres.wakeup).
        for name in ("raise_flag", "silent_writers", "wake_flag", "lower_flag"):
            runner.execute(sql.query(name))
        # `drain status` and the metrics read dead_jobs, but cannot change it.
        assert runner.execute(sql.query("dead_by_reason")).fetchall() == [("invalid", 1)]
        assert_refused(runner, "DELETE FROM dead_jobs")
        assert_refused(runner, "SELECT * FROM drain_processed")
        assert_refused(runner, "SELECT * FROM annotation")
        assert_refused(runner, "DELETE FROM annotation")
        assert_refused(runner, "UPDATE annotation SET text = 'x'")
        assert_refused(runner, "INSERT INTO annotation VALUES (2, 'x')")
    assert support.staged_count(db_url) == 0

    with psycopg.connect(urls.operator, autocommit=True) as operator:
        assert dead.count(operator, dead.Filters()) == 1
        assert dead.requeue(operator, dead.Filters(), act=dead.Act("test")) == 1
        drain.stage(operator, "t.by_hand", [5])
        # It reads staged jobs (`drain show`), never changes or removes them.
        assert operator.execute("SELECT count(*) FROM staged_jobs").fetchone() == (2,)
        assert_refused(operator, "UPDATE staged_jobs SET priority = 1")
        assert_refused(operator, "DELETE FROM staged_jobs")
        assert_refused(operator, "SELECT * FROM annotation")
    with psycopg.connect(urls.consumer, autocommit=True) as consumer:
        consumer.execute("INSERT INTO drain_processed (task_id) VALUES (gen_random_uuid()) "
                         "ON CONFLICT (task_id) DO NOTHING RETURNING task_id")
        assert_refused(consumer, "DELETE FROM drain_processed")
        assert_refused(consumer, "SELECT * FROM staged_jobs")
    with psycopg.connect(urls.operator, autocommit=True) as operator:
        operator.execute("DELETE FROM drain_processed")
    assert support.staged_count(db_url) == 2


# -- packaging --------------------------------------------------------------------------


def test_wheel_carries_the_schema(tmp_path: Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path), str(support.ROOT)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    [wheel] = tmp_path.glob("drain_outbox-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert {"drain/staging_schema.sql", "drain/postgres/queries.sql", "drain/py.typed"} <= names
        packaged = zf.read("drain/staging_schema.sql")
        queries = zf.read("drain/postgres/queries.sql")
    assert packaged == (support.ROOT / "staging_schema.sql").read_bytes()
    assert queries == (support.ROOT / "drain" / "postgres" / "queries.sql").read_bytes()



# -- "no queue given" --------------------------------------------------------------------


def _read(db_url: str) -> list[tuple[str, str, bool]]:
    """What the drain reads of every row: (task, queue, staged without a queue)."""
    with psycopg.connect(db_url) as conn:
        rows = [StagedRow(*r) for r in conn.execute(sql.query("fetch_batch"), fetch_params(100))]
    return [(r.task_name, r.queue, r.unrouted) for r in sorted(rows, key=lambda r: r.id)]


def _insert(conn: psycopg.Connection[Any], task: str, queue: str | None = None,
            row_id: int | None = None) -> None:
    """A plain INSERT, with the column left out when ``queue`` is None, and the
    row's own ``row_id`` when given."""
    columns: list[str] = ["task_name"]
    values: list[Any] = [task]
    if queue is not None:
        columns.append("queue")
        values.append(queue)
    if row_id is not None:
        columns.append("id")
        values.append(row_id)
    conn.execute(f"INSERT INTO staged_jobs ({', '.join(columns)}) OVERRIDING SYSTEM VALUE "
                 f"VALUES ({', '.join(['%s'] * len(values))})", values)


def _file_node(conn: psycopg.Connection[Any], table: str) -> int:
    row = conn.execute("SELECT pg_relation_filenode(%s::regclass)", [table]).fetchone()
    assert row is not None
    return int(row[0])


def test_no_queue_is_null_and_an_upgraded_database_keeps_its_old_rows_routing(
    db_url: str,
) -> None:
    support.as_an_older_schema(db_url)
    with psycopg.connect(db_url) as conn:
        _insert(conn, "old.default")
        _insert(conn, "old.q1", "q1")
        _insert(conn, "old.negative", row_id=-7)
        files = (_file_node(conn, "staged_jobs"), _file_node(conn, "dead_jobs"))
        conn.commit()
        migrate(conn)
        conn.commit()
        # In place: the tables were not rewritten (no row touched).
        assert (_file_node(conn, "staged_jobs"), _file_node(conn, "dead_jobs")) == files
        assert conn.execute(
            "SELECT attname, attnotnull, pg_get_expr(adbin, adrelid) FROM pg_attribute "
            "LEFT JOIN pg_attrdef ON adrelid = attrelid AND adnum = attnum "
            "WHERE attrelid = 'staged_jobs'::regclass AND attname IN ('queue', 'queue_legacy') "
            "ORDER BY attname"
        ).fetchall() == [("queue", False, None), ("queue_legacy", True, "false")]
        drain.stage(conn, "new.none")
        drain.stage(conn, "new.celery", queue="celery")
        _insert(conn, "new.sql")
        # Ids are not monotonic: a row given its own (negative) id, and rows staged
        # after the identity was restarted below every id staged so far.
        _insert(conn, "new.negative.celery", "celery", row_id=-5)
        _insert(conn, "new.negative.none", row_id=-4)
        conn.execute("DELETE FROM staged_jobs WHERE task_name = 'old.default'")
        conn.execute("ALTER TABLE staged_jobs ALTER COLUMN id RESTART WITH 1")
        drain.stage(conn, "new.restarted.celery", queue="celery")
        migrate(conn)  # again: changes nothing
    assert _read(db_url) == [
        ("old.negative", "celery", True),  # gave no queue then: still routed as before
        ("new.negative.celery", "celery", False),
        ("new.negative.none", "celery", True),
        ("new.restarted.celery", "celery", False),  # id 1: explicit all the same
        ("old.q1", "q1", False),
        ("new.none", "celery", True),
        ("new.celery", "celery", False),  # an explicit celery is apply_async(queue='celery')
        ("new.sql", "celery", True),
    ]


def test_a_database_upgraded_by_an_older_drain_marks_its_old_rows_from_the_recorded_id(
    db_url: str,
) -> None:
    """An older drain's `drain migrate` recorded queue_given_from_id instead: the
    rows still staged or dead with 'celery' below it get queue_legacy."""
    with psycopg.connect(db_url) as conn:
        for task in ("old.default", "old.q", "new.celery", "new.none"):
            _insert(conn, task, {"old.q": "q", "new.none": None}.get(task, "celery"))
        conn.execute("INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, "
                     "priority, staged_at, reason) SELECT id, task_id, task_name, args, kwargs, "
                     "queue, priority, staged_at, 'invalid' FROM staged_jobs")
    support.as_upgraded_by_an_older_drain(db_url, mark=3)
    with psycopg.connect(db_url) as conn:
        migrate(conn)
        conn.commit()
        flags = "SELECT task_name, queue_legacy FROM {} ORDER BY id"
        assert conn.execute(flags.format("staged_jobs")).fetchall() == conn.execute(
            flags.format("dead_jobs")).fetchall() == [
            ("old.default", True), ("old.q", False), ("new.celery", False), ("new.none", False)]
    assert _read(db_url) == [("old.default", "celery", True), ("old.q", "q", False),
                             ("new.celery", "celery", False), ("new.none", "celery", True)]


def test_a_job_staged_before_the_upgrade_without_a_queue_is_requeued_as_such(
    db_url: str,
) -> None:
    """Dead-lettered (here by a drain of this version) and requeued after
    `drain migrate`, under a new id: still "no queue given"."""
    support.as_an_older_schema(db_url)
    with psycopg.connect(db_url) as conn:
        _insert(conn, "old.default")
        _insert(conn, "old.celery.dead.later")
        conn.commit()
        migrate(conn)
        conn.commit()
        # A job staged by the application after the upgrade, with queue celery.
        drain.stage(conn, "new.celery", queue="celery")
    drainer = store.Store(Settings(database_url=roles.url(db_url, roles.RUNNER)))
    drainer.connect()
    try:
        with drainer.batch():
            rows = drainer.fetch(10)
            drainer.bury([(row.id, "unknown_task", "not deployed yet") for row in rows],
                         {row.id: row.xact for row in rows})
    finally:
        drainer.close()
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT task_name, queue, queue_legacy FROM dead_jobs "
                            "ORDER BY id").fetchall() == [
            ("old.default", "celery", True), ("old.celery.dead.later", "celery", True),
            ("new.celery", "celery", False)]
        assert dead.requeue(conn, dead.Filters(reason="unknown_task"), act=dead.Act("test")) == 3
    assert sorted(_read(db_url)) == [("new.celery", "celery", False),
                                     ("old.celery.dead.later", "celery", True),
                                     ("old.default", "celery", True)]


def test_a_drain_on_a_schema_from_before_queue_legacy_says_run_drain_migrate(
    db_url: str,
) -> None:
    support.as_upgraded_by_an_older_drain(db_url, mark=1)
    drainer = store.Store(Settings(database_url=roles.url(db_url, roles.RUNNER)))
    with pytest.raises(SchemaMissing, match=r"queue_legacy or trace in staged_jobs and "
                                            r"dead_jobs, or no table drain_pauses\): run "
                                            r"`drain migrate`"):
        drainer.connect()
    drainer.close()
    with psycopg.connect(db_url) as conn, pytest.raises(SchemaMissing, match="drain migrate"):
        dead.requeue(conn, dead.Filters(), act=dead.Act("test"))


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


def test_an_expired_job_keeps_its_embed_in_dead_jobs_and_gets_it_back_on_requeue(
    db_url: str,
) -> None:
    _stage_with_embed(db_url, "t.expired", expires_at="2000-01-01T00:00:00Z")
    drainer = store.Store(Settings(database_url=roles.url(db_url, roles.RUNNER)))
    drainer.connect()
    try:
        with drainer.batch():
            found, moved = drainer.expire([], 10)
            assert found == 1 and len(moved.done) == 1 and moved.left == []
    finally:
        drainer.close()
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT embed FROM dead_jobs").fetchone() == (_EMBED,)
        # It expired before it was staged: it needs a fresh expiry to be requeued.
        assert dead.requeue(conn, dead.Filters(reason="expired"), dt.timedelta(hours=1),
                            act=dead.Act("test")) == 1
        assert conn.execute("SELECT task_name, embed FROM staged_jobs").fetchall() == [
            ("t.expired", _EMBED)]

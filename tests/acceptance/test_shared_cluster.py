"""Two applications' databases on one Postgres server (issue 35, item 2).

Postgres roles belong to the cluster, grants to a database. Each database gets
group roles of its own (docs/running.md, "Database roles"): a login granted a
role to work on one database must be refused everything in the other.

* The matrix: two databases, ``a`` and ``b``, each owned by a role of its own
  that is no superuser and migrated by ``drain migrate`` as that owner; each
  with an application, a drain, an operator and a worker login, granted their
  database's roles as the docs' recipe does. Every login runs every probe (SQL
  and ``drain`` commands) in both databases: in its own, what its role may do
  succeeds and the rest is refused; in the other, everything is refused. Each
  database's drain then delivers its own application's jobs.
* The upgrade: two databases an older drain migrated (the schema of git
  history, whose roles drain_stager... both share) are refused by the new
  ``drain migrate`` in one line; the docs' move to a prefix of its own for one
  of them, and the other keeps drain_* with its logins working throughout.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psycopg
import psycopg.errors
import pytest

import drain
from drain import consumer
from tests import roles, support
from tests.docs import blocks

#: What each kind of login may do in its own database: {probe: allowed kinds}.
SQL_PROBES: dict[str, tuple[str, frozenset[str]]] = {
    # It returns task_id: INSERT and that column (ops may read staged jobs: drain show).
    "drain_stage()": ("SELECT drain_stage('billing.refund_all')", frozenset({"app", "ops"})),
    "INSERT staged_jobs": ("INSERT INTO staged_jobs (task_name) VALUES ('billing.refund_all')",
                           frozenset({"app", "ops"})),
    "read staged args": ("SELECT args FROM staged_jobs", frozenset({"drain", "ops"})),
    "DELETE staged_jobs": ("DELETE FROM staged_jobs WHERE false", frozenset({"drain"})),
    "read dead_jobs": ("SELECT * FROM dead_jobs", frozenset({"drain", "ops"})),
    "DELETE dead_jobs": ("DELETE FROM dead_jobs WHERE false", frozenset({"ops"})),
    "INSERT drain_processed": (f"INSERT INTO drain_processed VALUES ('{uuid.UUID(int=0)}') "
                               "ON CONFLICT DO NOTHING", frozenset({"worker"})),
    "read drain_processed": ("SELECT * FROM drain_processed", frozenset({"worker", "ops"})),
    "read drain_pauses": ("SELECT * FROM drain_pauses", frozenset({"drain", "ops"})),
    "DELETE drain_pauses": ("DELETE FROM drain_pauses WHERE false", frozenset({"ops"})),
    "INSERT drain_audit": ("INSERT INTO drain_audit (actor, action) VALUES ('t', 'probe')",
                           frozenset({"ops"})),
}
#: The ``drain`` commands, each with the kind of login whose commands they are.
CLI_PROBES: dict[str, tuple[tuple[str, ...], str]] = {
    "drain status": (("status",), "drain"),
    "drain stage": (("stage", "billing.refund_all", "--queue", "{queue}"), "ops"),
    "drain dead list": (("dead", "list"), "ops"),
    "drain dead requeue": (("dead", "requeue", "--task", "nothing.here", "--yes"), "ops"),
    "drain dead purge": (("dead", "purge", "--older-than", "0s", "--yes", "--why", "t"), "ops"),
    "drain pause": (("pause", "--task", "nothing.here", "--why", "a probe"), "ops"),
    "drain audit": (("audit",), "ops"),
}
KINDS = ("app", "drain", "ops", "worker")
#: The recipe's login of each kind (docs/running.md), and the group role it is granted.
RECIPE = {"app": "my_app", "drain": "my_drain", "ops": "my_ops", "worker": "my_worker"}
PERMISSION_DENIED = 5


@dataclass
class Database:
    """One application's database, its owner (no superuser) and its logins, each
    named after it."""

    name: str
    #: The kinds of login it has (their names: ``<kind>_<database name>``).
    kinds: tuple[str, ...] = KINDS
    queue: str = field(default_factory=lambda: support.unique("shared"))

    @property
    def owner(self) -> str:
        return f"owner_{self.name}"

    @property
    def logins(self) -> dict[str, str]:
        return {kind: f"{kind}_{self.name}" for kind in self.kinds}

    def url(self, user: str) -> str:
        return roles.url(support.database_url(self.name), user)

    def login_url(self, kind: str) -> str:
        return self.url(self.logins[kind])

    def create(self) -> None:
        with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'CREATE ROLE "{self.owner}" LOGIN CREATEROLE')
            admin.execute(f'CREATE DATABASE "{self.name}" OWNER "{self.owner}"')

    def drop(self) -> None:
        """The database, its roles (support.drop_roles_of), logins and owner; its queue."""
        with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
            support.drop_roles_of(admin, self.name)
            for role in (*self.logins.values(), self.owner):
                admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        support.delete_queue(self.queue)


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``drain ARGS`` as the URL's user."""
    return support.run_cli(url, *args, env=support.drain_env(url, roles.ADMIN), timeout=90)


def _recipe(db: Database, prefix: str) -> str:
    """The docs' roles recipe, for this database's roles and logins."""
    text = blocks.block_after(support.ROOT / "docs" / "running.md", "## Database roles", "sql")
    text = text.replace("app_drain_", prefix).replace("'...'", "NULL")
    for kind, name in RECIPE.items():
        text = text.replace(name, db.logins[kind])
    return text


@pytest.fixture(scope="module")
def two_databases() -> Iterator[tuple[Database, Database]]:
    """Databases ``a_<hex>`` and ``b_<hex>``, migrated, with the recipe's logins."""
    suffix = uuid.uuid4().hex[:8]
    dbs = (Database(f"a_{suffix}"), Database(f"b_{suffix}"))
    try:
        for db in dbs:
            db.create()
        # Both migrate at once, as two deploy jobs may.
        with ThreadPoolExecutor(2) as pool:
            done = list(pool.map(lambda db: _cli(db.url(db.owner), "migrate"), dbs))
        for db, ran in zip(dbs, done, strict=True):
            assert ran.returncode == 0, ran.stderr
            prefix = f"{db.name}_drain_"
            assert f"its roles: {prefix}stager, {prefix}runner" in ran.stderr, ran.stderr
            with psycopg.connect(db.url(db.owner), autocommit=True) as owner:
                owner.execute(_recipe(db, prefix))
        yield dbs
    finally:
        for db in dbs:
            db.drop()


def _sql_outcome(url: str, statement: str) -> str:
    """"ok" or the refusal's class ("InsufficientPrivilege")."""
    try:
        with psycopg.connect(url) as conn:
            conn.execute(statement)
            conn.rollback()
    except psycopg.Error as exc:
        return type(exc).__name__
    return "ok"


def test_each_login_acts_in_its_own_database_only(
    two_databases: tuple[Database, Database],
) -> None:
    a, b = two_databases
    seen: dict[tuple[str, str, str, str], str] = {}
    for home, other in ((a, b), (b, a)):
        for kind in KINDS:
            for where, db in (("own", home), ("other", other)):
                url = db.url(home.logins[kind])
                for probe, (statement, allowed) in SQL_PROBES.items():
                    seen[(home.name, kind, where, probe)] = _sql_outcome(url, statement)
                    want = "ok" if where == "own" and kind in allowed else "InsufficientPrivilege"
                    assert seen[(home.name, kind, where, probe)] == want, (
                        f"{kind} of {home.name} in {db.name}: {probe}")
    assert len(seen) == 2 * len(KINDS) * 2 * len(SQL_PROBES)

    # The application's drain.stage() and the worker's drain.consumer, in both.
    for home, other in ((a, b), (b, a)):
        with psycopg.connect(home.login_url("app")) as conn:
            drain.stage(conn, "t.home", queue=home.queue)
        with psycopg.connect(other.url(home.logins["app"])) as conn, pytest.raises(
                psycopg.errors.InsufficientPrivilege):
            drain.stage(conn, "t.elsewhere", queue=home.queue)
        with psycopg.connect(home.login_url("worker")) as conn:
            assert consumer.claim(conn, uuid.uuid4())
        with psycopg.connect(other.url(home.logins["worker"])) as conn, pytest.raises(
                psycopg.errors.InsufficientPrivilege):
            consumer.claim(conn, uuid.uuid4())


def test_each_command_runs_in_its_own_database_only(
    two_databases: tuple[Database, Database],
) -> None:
    a, b = two_databases
    cases = [(home, db, name, args, kind)
             for home, other in ((a, b), (b, a))
             for name, (args, kind) in CLI_PROBES.items()
             for db in (home, other)]

    def run(case: tuple[Database, Database, str, tuple[str, ...], str]) -> Any:
        home, db, _name, args, kind = case
        filled = tuple(arg.replace("{queue}", home.queue) for arg in args)
        return _cli(db.url(home.logins[kind]), *filled)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, cases))
    for (home, db, name, _args, kind), ran in zip(cases, results, strict=True):
        what = f"{name} as {kind} of {home.name} in {db.name}"
        if db is home:
            assert ran.returncode == 0, f"{what}: {ran.stderr}"
        else:
            assert ran.returncode == PERMISSION_DENIED, f"{what}: {ran.stderr}"
            [line] = [ln for ln in ran.stderr.splitlines() if ln.startswith("drain: error:")]
            assert "permission denied" in line, what

    # Each database's drain delivers its own application's jobs (and a drain of
    # the other database is refused at its first query: exit 5).
    for home, other in ((a, b), (b, a)):
        with psycopg.connect(home.login_url("app")) as conn:
            task = str(drain.stage(conn, "t.delivered", queue=home.queue))
        refused = _cli(other.url(home.logins["drain"]), "run", "--exit-when-empty")
        assert refused.returncode == PERMISSION_DENIED, refused.stderr
        ran = _cli(home.login_url("drain"), "run", "--exit-when-empty")
        assert ran.returncode == 0, ran.stderr
        assert task in support.task_ids(support.drain_queue(home.queue))


# -- an upgrade from a version whose roles were the cluster's ----------------------------

#: The last commit whose staging_schema.sql named the roles drain_* in every database.
LEGACY_COMMIT = "5cbe618"
LEGACY_ROLES = ("drain_stager", "drain_runner", "drain_operator", "drain_consumer")


def _legacy_schema() -> str:
    shown = subprocess.run(["git", "show", f"{LEGACY_COMMIT}:staging_schema.sql"],
                           capture_output=True, text=True, check=False, cwd=support.ROOT)
    if shown.returncode != 0:
        pytest.fail(f"git show {LEGACY_COMMIT}:staging_schema.sql (the schema before "
                    f"prefixes, from the project's history): {shown.stderr.strip()}")
    return shown.stdout


@pytest.fixture
def legacy_pair() -> Iterator[tuple[Database, Database]]:
    """Two databases migrated by the older schema, sharing drain_*, each with an
    application login granted drain_stager (the old recipe)."""
    suffix = uuid.uuid4().hex[:8]
    dbs = (Database(f"old1_{suffix}", ("app", "drain")),
           Database(f"old2_{suffix}", ("app", "drain")))
    schema = _legacy_schema()
    try:
        for db in dbs:
            db.create()
            with psycopg.connect(db.url(db.owner), autocommit=True) as owner:
                owner.execute(schema)
                owner.execute(f'CREATE ROLE "{db.logins["app"]}" LOGIN; '
                              f'GRANT drain_stager TO "{db.logins["app"]}"; '
                              f'CREATE ROLE "{db.logins["drain"]}" LOGIN; '
                              f'GRANT drain_runner TO "{db.logins["drain"]}"')
        yield dbs
    finally:
        for db in dbs:
            db.drop()
        with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
            admin.execute("DROP ROLE IF EXISTS " + ", ".join(LEGACY_ROLES))


def test_an_upgrade_of_databases_sharing_the_old_roles_is_refused_until_one_moves(
    legacy_pair: tuple[Database, Database],
) -> None:
    one, two = legacy_pair
    # The hole this closes: the old roles reach across.
    assert _sql_outcome(two.url(one.logins["app"]), SQL_PROBES["INSERT staged_jobs"][0]) == "ok"

    refused = _cli(one.url(one.owner), "migrate")
    assert refused.returncode == 2, refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith("drain: error: drain migrate: the roles drain_* already hold "
                           f"privileges in database {two.name}"), line
    assert f"--role-prefix {one.name}_drain_" in line

    # The docs' move, for database two: its logins get the new roles first.
    prefix = f"{two.name}_drain_"
    with psycopg.connect(two.url(two.owner), autocommit=True) as owner:
        for kind, login in (("stager", two.logins["app"]), ("runner", two.logins["drain"])):
            owner.execute(f'CREATE ROLE "{prefix}{kind}" NOLOGIN; '
                          f'GRANT "{prefix}{kind}" TO "{login}"')
    moved = _cli(two.url(two.owner), "migrate", "--role-prefix", prefix)
    assert moved.returncode == 0, moved.stderr
    # Now database one upgrades in place, keeping drain_* and its logins' grants.
    upgraded = _cli(one.url(one.owner), "migrate")
    assert upgraded.returncode == 0, upgraded.stderr
    assert "its roles: drain_stager, drain_runner" in upgraded.stderr
    # ... and the moved database's logins give up the old roles, which are one's now.
    with psycopg.connect(two.url(two.owner), autocommit=True) as owner:
        owner.execute(f'REVOKE drain_stager FROM "{two.logins["app"]}"; '
                      f'REVOKE drain_runner FROM "{two.logins["drain"]}"')

    for home, other in ((one, two), (two, one)):
        assert _sql_outcome(home.login_url("app"), SQL_PROBES["INSERT staged_jobs"][0]) == "ok"
        assert _sql_outcome(other.url(home.logins["app"]),
                            SQL_PROBES["INSERT staged_jobs"][0]) == "InsufficientPrivilege"
        ran = _cli(home.login_url("drain"), "status")
        assert ran.returncode == 0, ran.stderr
        ran = _cli(other.url(home.logins["drain"]), "status")
        assert ran.returncode == PERMISSION_DENIED, ran.stderr
    # A migrate again changes nothing, and names each database's roles.
    again = _cli(two.url(two.owner), "migrate")
    assert again.returncode == 0 and f"its roles: {prefix}stager" in again.stderr


def test_a_staging_helper_refused_elsewhere_is_callable_here(
    two_databases: tuple[Database, Database],
) -> None:
    """The matrix's probes are not blind: as the owner, each one runs."""
    a, _ = two_databases
    for probe, (statement, _allowed) in SQL_PROBES.items():
        assert _sql_outcome(a.url(a.owner), statement) == "ok", probe


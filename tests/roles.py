"""Least-privileged login roles for the tests: docs/running.md, "Database roles".

``drain migrate`` creates four group roles of the database's own, named with
its role prefix (``<database>_drain_stager``...), and grants them, in that
database, what their commands need (staging_schema.sql). Postgres roles belong
to the whole cluster, so the login roles here are created once and serve every
test database: :func:`ensure` grants each the group role of its kind of a
migrated database (the ``template_db`` fixture calls it for the template, whose
copies, the per-test databases, keep its roles), as docs/running.md shows:

=====================  ==========================================  =======================
login role             granted, in a database whose prefix is P    runs
=====================  ==========================================  =======================
drain_test_stager      P + stager                                   an application staging
drain_test_runner      P + runner, pg_read_all_stats                ``drain run``, ``status``
drain_test_operator    P + operator                                 ``drain stage``, ``dead``,
                                                                    ``processed purge``,
                                                                    ``pause``, ``resume``,
                                                                    ``pauses``, ``audit``
drain_test_consumer    P + consumer                                 drain.consumer
=====================  ==========================================  =======================

How to use them (``db_url`` is a test database's URL, the superuser's):

* ``roles.url(db_url, roles.RUNNER)``: the same database as that role (any
  URL whose user is the test superuser; other URLs are returned unchanged).
  ``roles.of(db_url)`` has all four (``.stager``, ``.runner``, ...).
* ``roles.for_command(db_url, "dead")``: as the role that runs that ``drain``
  command (``migrate``, ``backfill`` and ``reconcile``: the owner, i.e. the
  superuser that owns the test tables).
* ``support.drain_env(db_url)`` sets ``DRAIN_DATABASE_URL`` to the runner's
  URL; ``support.run_cli`` runs each command as its role; the in-process
  drains of tests/integration/conftest.py (``start_drain``) run as the runner.
  Pass ``role=roles.ADMIN`` to any of them where a test needs the superuser.
* In a test, connect as an application with
  ``psycopg.connect(roles.url(db_url, roles.STAGER))``.

:func:`census_note` records each drain or ``drain`` command a test starts as
the superuser; tests/conftest.py reports how many tests did at the end of the
run (the least-privilege census).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import psycopg
import psycopg.errors
from psycopg import conninfo

ADMIN = "admin"
STAGER = "drain_test_stager"
RUNNER = "drain_test_runner"
OPERATOR = "drain_test_operator"
CONSUMER = "drain_test_consumer"

#: Each login role: the kind of group role it is granted, and what else (the recipe in
#: docs/running.md).
GRANTS = {
    STAGER: ("stager", ""),
    RUNNER: ("runner", "pg_read_all_stats"),
    OPERATOR: ("operator", ""),
    CONSUMER: ("consumer", ""),
}

#: Which role runs each ``drain`` command (docs/running.md, "Database roles").
COMMAND_ROLES = {
    "run": RUNNER, "status": RUNNER,
    "stage": OPERATOR, "dead": OPERATOR, "processed": OPERATOR,
    "pause": OPERATOR, "resume": OPERATOR, "pauses": OPERATOR, "audit": OPERATOR,
    "show": OPERATOR, "staged": OPERATOR,
    "migrate": ADMIN, "backfill": ADMIN, "reconcile": ADMIN,
}


class Urls(NamedTuple):
    admin: str
    stager: str
    runner: str
    operator: str
    consumer: str


#: The test superuser's URL (tests.support re-exports it): it owns the test tables.
ADMIN_URL = os.environ.get("DRAIN_TEST_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


def _admin_user() -> str:
    return str(conninfo.conninfo_to_dict(ADMIN_URL).get("user") or "postgres")


def prefix_of(db_url: str) -> str:
    """The role prefix of a migrated database (``drain migrate`` recorded it)."""
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT value FROM drain_settings WHERE key = 'role_prefix'"
                           ).fetchone()
    assert row is not None, f"{db_url}: not migrated (no role prefix recorded)"
    return str(row[0])


def ensure(db_url: str) -> None:
    """Create the login roles unless done already, and grant each its group role of
    the migrated database ``db_url``. Concurrent calls (xdist workers) may race on
    the roles: an advisory lock in the cluster's ``postgres`` database orders them."""
    prefix = prefix_of(db_url)
    admin_url = conninfo.make_conninfo(url(db_url, ADMIN), dbname="postgres")
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute("SELECT pg_advisory_lock(hashtext('drain test roles'))")
        try:
            for role, (kind, extra) in GRANTS.items():
                exists = admin.execute(
                    "SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
                if not exists:
                    admin.execute(f'CREATE ROLE "{role}" LOGIN')
                granted = ", ".join(filter(None, (f'"{prefix}{kind}"', extra)))
                admin.execute(f'GRANT {granted} TO "{role}"')
        finally:
            admin.execute("SELECT pg_advisory_unlock(hashtext('drain test roles'))")


def url(db_url: str, role: str) -> str:
    """``db_url`` as ``role`` (:data:`ADMIN`: unchanged). Only a URL whose user is
    the test superuser, without a password, is changed: a test that chose its
    own user keeps it."""
    if role == ADMIN:
        return db_url
    admin = _admin_user()
    try:
        params = conninfo.conninfo_to_dict(db_url)
    except psycopg.ProgrammingError:
        return db_url  # a malformed URL (a test of the URL checks) stays as it is
    if params.get("password") or params.get("user", admin) != admin:
        return db_url
    for scheme in ("postgresql://", "postgres://"):
        if db_url.startswith(f"{scheme}{admin}@"):
            return f"{scheme}{role}@{db_url[len(scheme) + len(admin) + 1:]}"
    if db_url.startswith(("postgresql:", "postgres:")):
        return db_url  # a URL spelled otherwise: left alone rather than guessed at
    return conninfo.make_conninfo(db_url, user=role)


def of(db_url: str) -> Urls:
    return Urls(db_url, *(url(db_url, role) for role in (STAGER, RUNNER, OPERATOR, CONSUMER)))


def command_of(args: tuple[str, ...] | list[str]) -> str:
    """The ``drain`` subcommand in ``args`` (its first word that is not a flag)."""
    return next((a for a in args if not a.startswith("-")), "")


def for_command(db_url: str, *args: str) -> str:
    """``db_url`` as the role that runs ``drain ARGS`` (the runner when unsure)."""
    return url(db_url, COMMAND_ROLES.get(command_of(args), RUNNER))


def user_of(db_url: str) -> str:
    """The user a URL logs in as (the test superuser when it names none)."""
    try:
        return str(conninfo.conninfo_to_dict(db_url).get("user") or _admin_user())
    except psycopg.ProgrammingError:
        return ""


# -- the census --------------------------------------------------------------------------

#: {test node id: {(what it ran, as the superuser?)}}, filled while tests run: every
#: drain (in-process or ``drain run``) and ``drain`` command a test starts, and each
#: ``drain.stage`` / ``drain.stage_many`` call ("app staging").
RUNS: dict[str, set[tuple[str, bool]]] = {}
APP_STAGING = "app staging"


def _record(what: str, as_superuser: bool) -> None:
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    if test:
        RUNS.setdefault(test, set()).add((what, as_superuser))


def census_note(db_url: str | None, what: str) -> None:
    """Record that the current test runs ``what`` (``drain run``, ``drain dead``,
    an in-process drain...) on ``db_url``, and whether as the superuser. The
    owner's commands (``drain migrate``...) are left out: the superuser owns the
    test tables."""
    if COMMAND_ROLES.get(what.removeprefix("drain ")) == ADMIN or not db_url:
        return
    _record(what, user_of(db_url) == _admin_user())


def census_staging(conn: object) -> None:
    """Record that the current test stages jobs on ``conn`` (a psycopg connection or
    cursor; others are not counted), and whether as the superuser."""
    info = getattr(getattr(conn, "connection", conn), "info", None)
    user = getattr(info, "user", None)
    if isinstance(user, str):
        _record(APP_STAGING, user == _admin_user())


def census_export() -> dict[str, list[list[object]]]:
    """:data:`RUNS` as plain data an xdist worker can send to the controller."""
    return {test: [[what, su] for what, su in sorted(runs)] for test, runs in RUNS.items()}


def census_import(runs: dict[str, list[list[object]]]) -> None:
    """Add another process's :func:`census_export` to :data:`RUNS`."""
    for test, pairs in runs.items():
        RUNS.setdefault(test, set()).update((str(what), bool(su)) for what, su in pairs)


def census() -> dict[str, tuple[int, int, dict[str, list[str]]]]:
    """For drains and commands, and for app staging: (tests that did it, those that
    did it as the superuser, {such a test: what it ran as the superuser})."""
    out = {}
    for kind, wanted in (("drains and drain commands", lambda w: w != APP_STAGING),
                         (APP_STAGING, lambda w: w == APP_STAGING)):
        runs = {t: {(w, su) for w, su in r if wanted(w)} for t, r in RUNS.items()}
        runs = {t: r for t, r in runs.items() if r}
        su = {t: sorted(w for w, admin in r if admin) for t, r in runs.items()
              if any(admin for _, admin in r)}
        out[kind] = (len(runs), len(su), su)
    return out

"""drain's schema through the application's own migration tool (issue 38,
docs/migration_tools.md): a real Django project's ``manage.py migrate`` with
``drain.postgres.django`` installed, and a real Alembic environment (``alembic init``)
whose revision calls ``drain.postgres.alembic.upgrade``, each run as a subprocess.

Each must leave what ``drain migrate`` leaves: ``drain migrate --check`` exits 0,
the schema is the one ``drain migrate`` makes (``pg_dump --schema-only``, the
same), the group roles exist with the database's prefix and serve a login (a
job staged with ``drain.stage()`` as the stager), running it again and then
``drain migrate`` changes nothing of that.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo
from psycopg import sql as psql

import drain
from drain.postgres import migration
from tests import pg_server, roles, support

MANAGE_PY = """\
import sys

from django.core.management import execute_from_command_line

if __name__ == "__main__":
    import os

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
    execute_from_command_line(sys.argv)
"""


def _env(*paths: Path) -> dict[str, str]:
    """The tools' environment: none of the run's DRAIN_* or libpq settings, drain
    importable (a checkout's) and the project's own directory."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DRAIN_", "PG", "DJANGO_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in paths] + [str(support.ROOT)])
    return env


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=_env(cwd), capture_output=True, text=True,
                          timeout=120, check=False, stdin=subprocess.DEVNULL)


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


# -- a Django project ------------------------------------------------------------------


def _django_project(tmp: Path, databases: str, **extra: str) -> Path:
    """A project with ``manage.py`` and ``proj/settings.py`` whose INSTALLED_APPS has
    Django's auth and drain.postgres.django; ``databases`` is the DATABASES setting's source."""
    (tmp / "proj").mkdir()
    (tmp / "proj" / "__init__.py").write_text("")
    lines = [
        'SECRET_KEY = "not a secret: a test project"',
        "INSTALLED_APPS = ['django.contrib.contenttypes', 'django.contrib.auth', "
        "'drain.postgres.django']",
        f"DATABASES = {databases}",
        "USE_TZ = True",
        *(f"{name} = {value!r}" for name, value in extra.items()),
    ]
    (tmp / "proj" / "settings.py").write_text("\n".join(lines) + "\n")
    (tmp / "manage.py").write_text(MANAGE_PY)
    return tmp


def _postgres(db_url: str) -> str:
    params = conninfo.conninfo_to_dict(db_url)
    default = {"ENGINE": "django.db.backends.postgresql", "NAME": params["dbname"],
               "USER": params.get("user") or "postgres", "HOST": params.get("host"),
               "PORT": str(params.get("port") or support.PG_PORT)}
    return repr({"default": default})


def _manage(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "manage.py", *args], project)


# -- an Alembic environment ------------------------------------------------------------

#: The application's revisions around drain's: a table before, a column after (a
#: revision after drain's runs in a transaction again, its DDL kept).
APP_BEFORE = """\
def upgrade() -> None:
    op.create_table("annotation", sa.Column("id", sa.Integer, primary_key=True))


def downgrade() -> None:
    op.drop_table("annotation")
"""
DRAIN = """\
def upgrade() -> None:
    drain_schema.upgrade(op{prefix})


def downgrade() -> None:
    drain_schema.downgrade(op)
"""
APP_AFTER = """\
def upgrade() -> None:
    op.add_column("annotation", sa.Column("task_id", sa.Uuid))


def downgrade() -> None:
    op.drop_column("annotation", "task_id")
"""


def _alembic_env(tmp: Path, db_url: str, role_prefix: str | None = None) -> Path:
    """``alembic init``, the URL set (psycopg 3), and three revisions made with
    ``alembic revision`` whose bodies are replaced: APP_BEFORE, DRAIN, APP_AFTER."""
    _ok(_run([sys.executable, "-m", "alembic", "init", "alembic"], tmp))
    params = conninfo.conninfo_to_dict(db_url)
    url = (f"postgresql+psycopg://{params.get('user') or 'postgres'}@{params.get('host')}:"
           f"{params.get('port') or support.PG_PORT}/{params['dbname']}")
    ini = tmp / "alembic.ini"
    text, count = re.subn(r"(?m)^sqlalchemy\.url = .*$", f"sqlalchemy.url = {url}",
                          ini.read_text())
    assert count == 1, text
    ini.write_text(text)
    prefix = f", role_prefix={role_prefix!r}" if role_prefix else ""
    for rev, body in (("app1", APP_BEFORE), ("drain1", DRAIN.format(prefix=prefix)),
                      ("app2", APP_AFTER)):
        _ok(_run([sys.executable, "-m", "alembic", "revision", "-m", rev, "--rev-id", rev],
                 tmp))
        (path,) = (tmp / "alembic" / "versions").glob(f"{rev}_*.py")
        source = path.read_text()
        head = source[:source.index("def upgrade(")]
        assert "from alembic import op" in head, source
        head = head.replace("from alembic import op", "from alembic import op\n\n"
                            "from drain.postgres import alembic as drain_schema")
        if "import sqlalchemy as sa" not in head:
            head = "import sqlalchemy as sa\n" + head
        path.write_text(head + body)
    return tmp


def _alembic(env_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "alembic", *args], env_dir)


# -- what drain migrate leaves ---------------------------------------------------------


def _prefix(db_url: str) -> str:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT value FROM drain_settings WHERE key = 'role_prefix'").fetchone()
    assert row, "no role prefix recorded"
    return str(row[0])


def _roles(prefix: str) -> list[str]:
    with psycopg.connect(support.ADMIN_URL) as conn:
        rows = conn.execute("SELECT rolname FROM pg_roles WHERE rolname = ANY(%s) "
                            "ORDER BY rolname", (migration.role_names(prefix),)).fetchall()
    return [str(r[0]) for r in rows]


#: The tables of the test projects' own (Django's apps, the Alembic revisions').
THEIRS = ("auth_*", "django_*", "annotation*", "alembic_version")


def _schema(db_url: str) -> str:
    """The database's schema as pg_dump prints it: without owners, privileges
    (they name the database's roles), blank lines, pg_dump's comments or the tables
    of the tools and the test projects (THEIRS)."""
    params = conninfo.conninfo_to_dict(db_url)
    result = subprocess.run(
        [str(pg_server.PG_BIN / "pg_dump"), "--schema-only", "--no-owner", "--no-privileges",
         *(f"--exclude-table={pattern}" for pattern in THEIRS),
         "-h", str(params.get("host")), "-p", str(params.get("port") or support.PG_PORT),
         "-U", str(params.get("user") or "postgres"), str(params["dbname"])],
        capture_output=True, text=True, timeout=60, check=True)
    return "\n".join(line for line in result.stdout.splitlines()
                     if line and not line.startswith(("--", "\\restrict", "\\unrestrict")))


def _same_schema(db_url: str, reference: str) -> None:
    schema = _schema(db_url)
    assert schema == reference, "\n".join(difflib.unified_diff(
        reference.splitlines(), schema.splitlines(), "drain migrate", "the tool's", lineterm=""))


def _drain_check(db_url: str) -> None:
    result = support.run_cli(db_url, "migrate", "--check")
    assert result.returncode == 0, result.stderr
    assert f"schema version {migration.SCHEMA_VERSION}: current" in result.stderr


def _stage(db_url: str) -> str:
    """A job staged with drain.stage() as an application's login (the stager group
    role of the database granted to it, tests/roles.py); its task id."""
    roles.ensure(db_url)
    with psycopg.connect(roles.url(db_url, roles.STAGER)) as conn:
        return str(drain.stage(conn, "tasks.add", (1, 2), queue="migration_tools"))


def _staged(db_url: str) -> list[str]:
    with psycopg.connect(db_url) as conn:
        return [str(r[0]) for r in conn.execute("SELECT task_id FROM staged_jobs")]


def _as_drain_migrate_leaves(db_url: str, prefix: str, reference: str) -> str:
    """Assert all that; return the task id of the job staged."""
    _drain_check(db_url)
    assert _prefix(db_url) == prefix
    assert _roles(prefix) == sorted(migration.role_names(prefix))
    _same_schema(db_url, reference)
    task_id = _stage(db_url)
    assert _staged(db_url) == [task_id]
    return task_id


@pytest.fixture(scope="module")
def reference_schema() -> Iterator[str]:
    """The schema ``drain migrate`` makes in a new database."""
    with support.database(support.unique("drain_ref")) as url:
        result = support.run_cli(url, "migrate")
        assert result.returncode == 0, result.stderr
        yield _schema(url)


@contextlib.contextmanager
def _roles_dropped(prefix: str) -> Iterator[str]:
    """Yield ``prefix``; afterwards (its database dropped) DROP its group roles."""
    try:
        yield prefix
    finally:
        with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
            admin.execute(psql.SQL("DROP ROLE IF EXISTS {}").format(psql.SQL(", ").join(
                psql.Identifier(r) for r in migration.role_names(prefix))))


@pytest.fixture
def prefixed_db() -> Iterator[tuple[str, str]]:
    """A new database, and a role prefix of its own (roles dropped after it)."""
    with (_roles_dropped(f"{support.unique('mt')}_") as prefix,
          support.database(support.unique("drain_mt")) as url):
        yield url, prefix


def _default_prefix(db_url: str) -> str:
    return f"{conninfo.conninfo_to_dict(db_url)['dbname']}_drain_"


# -- Django ----------------------------------------------------------------------------


def test_manage_py_migrate_applies_the_schema_as_drain_migrate_does(
        empty_db_url: str, tmp_path: Path, reference_schema: str) -> None:
    project = _django_project(tmp_path, _postgres(empty_db_url))
    out = _ok(_manage(project, "migrate"))
    assert "Applying drain.0001_schema_version_1... OK" in out, out
    prefix = _default_prefix(empty_db_url)
    task_id = _as_drain_migrate_leaves(empty_db_url, prefix, reference_schema)

    # Again: nothing to apply. Backwards leaves the schema and the job; forwards
    # again applies the schema once more, which changes nothing.
    assert "No migrations to apply" in _ok(_manage(project, "migrate"))
    _ok(_manage(project, "migrate", "drain", "zero"))
    assert _staged(empty_db_url) == [task_id]
    _drain_check(empty_db_url)
    _ok(_manage(project, "migrate"))
    assert _staged(empty_db_url) == [task_id]
    _same_schema(empty_db_url, reference_schema)

    # drain migrate afterwards: the same prefix, roles, schema and job.
    assert support.run_cli(empty_db_url, "migrate").returncode == 0
    assert _prefix(empty_db_url) == prefix and _staged(empty_db_url) == [task_id]
    _same_schema(empty_db_url, reference_schema)
    assert "[X] 0001_schema_version_1" in _ok(_manage(project, "showmigrations", "drain"))


def test_drain_role_prefix_names_the_roles(
        prefixed_db: tuple[str, str], tmp_path: Path, reference_schema: str) -> None:
    url, prefix = prefixed_db
    project = _django_project(tmp_path, _postgres(url), DRAIN_ROLE_PREFIX=prefix)
    _ok(_manage(project, "migrate"))
    _as_drain_migrate_leaves(url, prefix, reference_schema)
    assert _roles(_default_prefix(url)) == []  # no roles of the default prefix made


def test_a_database_drain_migrate_made_keeps_its_prefix_and_jobs(
        db_url: str, tmp_path: Path) -> None:
    before = _prefix(db_url)
    task_id = _stage(db_url)
    _ok(_manage(_django_project(tmp_path, _postgres(db_url)), "migrate"))
    assert _prefix(db_url) == before and _staged(db_url) == [task_id]
    _drain_check(db_url)


def test_a_bad_prefix_and_another_database_are_refused_in_one_line(
        empty_db_url: str, tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    project = _django_project(tmp_path / "bad", _postgres(empty_db_url),
                              DRAIN_ROLE_PREFIX="Bad-Prefix")
    result = _manage(project, "migrate", "drain")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "CommandError: DRAIN_ROLE_PREFIX 'Bad-Prefix': give 1 to 55"), result.stderr
    assert support.run_cli(empty_db_url, "migrate", "--check").returncode == 4

    sqlite = repr({"default": {"ENGINE": "django.db.backends.sqlite3",
                               "NAME": str(tmp_path / "app.sqlite3")}})
    (tmp_path / "lite").mkdir()
    result = _manage(_django_project(tmp_path / "lite", sqlite), "migrate")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "CommandError: drain.postgres.django: database 'default' is sqlite; drain's schema needs "
        "PostgreSQL (route the drain app to a PostgreSQL database: docs/migration_tools.md)")


# -- Alembic ---------------------------------------------------------------------------


def _alembic_version(db_url: str) -> str:
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    return str(row[0]) if row else ""


def test_alembic_upgrade_applies_the_schema_as_drain_migrate_does(
        empty_db_url: str, tmp_path: Path, reference_schema: str) -> None:
    env_dir = _alembic_env(tmp_path, empty_db_url)
    _ok(_alembic(env_dir, "upgrade", "head"))
    assert _alembic_version(empty_db_url) == "app2"
    with psycopg.connect(empty_db_url) as conn:  # the application's revisions, both
        conn.execute("SELECT id, task_id FROM annotation")
    prefix = _default_prefix(empty_db_url)
    task_id = _as_drain_migrate_leaves(empty_db_url, prefix, reference_schema)

    # Down to base and up again: drain's downgrade leaves the schema and the job,
    # its upgrade changes nothing.
    _ok(_alembic(env_dir, "downgrade", "base"))
    assert _staged(empty_db_url) == [task_id]
    _ok(_alembic(env_dir, "upgrade", "head"))
    assert _staged(empty_db_url) == [task_id] and _prefix(empty_db_url) == prefix
    _same_schema(empty_db_url, reference_schema)
    assert support.run_cli(empty_db_url, "migrate").returncode == 0
    _drain_check(empty_db_url)
    assert _staged(empty_db_url) == [task_id]
    assert _roles(prefix) == sorted(migration.role_names(prefix))
    _same_schema(empty_db_url, reference_schema)


def test_alembic_role_prefix_and_offline_mode(
        prefixed_db: tuple[str, str], tmp_path: Path) -> None:
    url, prefix = prefixed_db
    env_dir = _alembic_env(tmp_path, url, role_prefix=prefix)
    result = _alembic(env_dir, "upgrade", "head", "--sql")
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(  # "FAILED: " or a log's prefix
        " drain.postgres.alembic: offline mode (--sql) cannot run drain's migrate; "
        "`drain migrate --print` prints the schema"), result.stderr
    _ok(_alembic(env_dir, "upgrade", "head"))
    _drain_check(url)
    assert _prefix(url) == prefix
    assert _roles(prefix) == sorted(migration.role_names(prefix))
    assert _stage(url) in _staged(url)

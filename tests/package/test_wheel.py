"""drain as a user gets it: the wheel and sdist ``python -m build`` made, installed in a
clean venv (tests/package/installed.py), and its commands run from an empty directory."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import roles, support
from tests.package.installed import DISTRIBUTION, Installed, checked

#: What the runtime reads from the package directory besides its modules.
DATA_FILES = ("staging_schema.sql", "daemon/status.html", "postgres/queries.sql", "py.typed")


def _version_of_the_checkout() -> str:
    """The version a build of this checkout gets: hatch-vcs's, from its git tags
    (pyproject.toml, [tool.hatch.version]), computed as the build computes it."""
    done = subprocess.run([sys.executable, "-m", "hatchling", "version"], cwd=support.ROOT,
                          capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_version_comes_from_git_tags_not_pyproject() -> None:
    import tomllib

    with (support.ROOT / "pyproject.toml").open("rb") as f:
        pyproject = tomllib.load(f)
    assert pyproject["project"]["name"] == DISTRIBUTION
    assert "version" not in pyproject["project"]
    assert pyproject["project"]["dynamic"] == ["version"]
    assert pyproject["tool"]["hatch"]["version"]["source"] == "vcs"
    assert any(r.startswith("hatch-vcs") for r in pyproject["build-system"]["requires"])
    # A release, a dev version of the next one, or (no git at all) the fallback.
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+)?(\+[\w.]+)?", _version_of_the_checkout())


def test_wheel_holds_the_package_data_and_the_command(installed: Installed) -> None:
    version = _version_of_the_checkout()
    assert installed.wheel.name == f"drain_outbox-{version}-py3-none-any.whl"
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
        for name in DATA_FILES:
            assert f"drain/{name}" in names, name
        schema = wheel.read("drain/staging_schema.sql")
        entry_points = wheel.read(f"drain_outbox-{version}.dist-info/entry_points.txt")
    assert schema == (support.ROOT / "staging_schema.sql").read_bytes()
    assert "drain = drain.cli.main:main" in entry_points.decode()
    assert "[pytest11]\ndrain = drain.pytest_plugin" in entry_points.decode()
    assert "drain/spark/backfill.py" in names
    assert not {n for n in names if n.startswith(("tests/", "celery_app/", "bench/"))}


def test_sdist_holds_what_a_build_needs_and_no_more(installed: Installed) -> None:
    with tarfile.open(installed.sdist) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "CHANGELOG.md", "staging_schema.sql", "PKG-INFO"
            } <= names
    # The schema is at the top (the wheel's build copies it into drain/).
    assert {f"drain/{name}" for name in DATA_FILES if name != "staging_schema.sql"} <= names
    assert not {n for n in names if n.startswith(("tests/", "bench/", "deploy/", "docs/"))}
    # Its version, for the wheel built from it without .git (hatch-vcs reads PKG-INFO).
    with tarfile.open(installed.sdist) as sdist:
        (pkg_info,) = [m for m in sdist.getmembers() if m.name.count("/") == 1
                       and m.name.endswith("/PKG-INFO")]
        meta = sdist.extractfile(pkg_info)
        assert meta is not None
        assert f"\nVersion: {_version_of_the_checkout()}\n" in meta.read().decode()


def test_installed_drain_says_its_version(installed: Installed) -> None:
    env = installed.env("postgresql://unused@127.0.0.1/unused", roles.ADMIN)
    metadata = installed.run(
        [installed.python, "-c",
         f"import importlib.metadata as m; print(m.version({DISTRIBUTION!r}))"], env)
    assert metadata.stdout.strip() == _version_of_the_checkout()
    done = installed.run([installed.drain, "--version"], env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"drain {metadata.stdout.strip()} ({DISTRIBUTION})"
    assert done.stderr == ""


def test_installed_drain_warns_of_the_other_drain_beside_it(
    installed: Installed, tmp_path: Path
) -> None:
    """pip install drain (the unrelated 0.0.6), then pip install drain-outbox: both write
    drain/ and bin/drain. Its metadata on the path is what drain --version notices."""
    info = tmp_path / "drain-0.0.6.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: drain\nVersion: 0.0.6\n")
    env = installed.env("postgresql://unused@127.0.0.1/unused", roles.ADMIN)
    env["PYTHONPATH"] = str(tmp_path)  # only the other drain's metadata: nothing to import
    done = installed.run([installed.drain, "--version"], env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("drain ") and "(drain-outbox)" in done.stdout
    assert done.stderr == (
        "warning: the package drain 0.0.6 (not this drain) is installed here too and shares "
        "the drain/ directory and the drain command: pip uninstall drain, then pip install "
        "--force-reinstall drain-outbox\n")


def test_installed_drain_migrates_stages_and_drains(
    installed: Installed, installed_db: str, queue: str
) -> None:
    stager = installed.env(installed_db, roles.STAGER)
    # The application's side: the installed package, imported from the venv.
    staged = installed.run([installed.python, "-c", (
        "import json, os, sys, psycopg, drain\n"
        "assert drain.__file__.startswith(sys.prefix), drain.__file__\n"
        "with psycopg.connect(os.environ['DRAIN_DATABASE_URL']) as conn:\n"
        "    ids = [drain.stage(conn, 'celery_app.record', [i], queue=sys.argv[1])\n"
        "           for i in range(2)]\n"
        "print(json.dumps([str(i) for i in ids]))\n"
    ), queue], stager)
    assert staged.returncode == 0, staged.stderr
    task_ids = json.loads(staged.stdout)

    runner = installed.env(installed_db, roles.RUNNER)
    roles.census_note(runner["DRAIN_DATABASE_URL"], "drain run")
    done = installed.run([installed.drain, "run", "--exit-when-empty"], runner)
    assert done.returncode == 0, done.stderr
    assert sorted(support.task_ids(support.drain_queue(queue))) == sorted(task_ids)
    assert support.staged_count(installed_db) == 0


def test_installed_drain_gives_pytest_its_fixtures(
    installed: Installed, installed_db: str, tmp_path: Path
) -> None:
    """Installing drain-outbox is all a project needs for drain's pytest fixtures (the
    pytest11 entry point; docs/testing.md), and a session whose tests use none of them
    imports nothing heavy for them."""
    env = installed.env(installed_db, roles.ADMIN)
    checked([sys.executable, "-m", "pip", "--python", installed.python, "install",
              "--quiet", f"pytest=={pytest.__version__}"], env=env)
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_user.py").write_text(
        "import sys\n"
        "import drain\n\n"
        "def test_nothing_heavy_before_a_fixture_is_used():\n"
        "    plugin = sys.modules['drain.pytest_plugin']\n"
        "    assert plugin.__file__.startswith(sys.prefix), plugin.__file__\n"
        "    heavy = {'celery', 'kombu', 'pika', 'psycopg', 'drain.testing'} & set(sys.modules)\n"
        "    assert not heavy, heavy\n\n"
        "def test_staged(drain_connection, staged_jobs):\n"
        "    drain.stage(drain_connection, 'app.welcome', [7])\n"
        "    staged_jobs.assert_staged('app.welcome', args=[7])\n"
        "    assert staged_jobs.clear() == 1\n")
    done = subprocess.run(
        [installed.python, "-m", "pytest", "-p", "no:cacheprovider", "-q",
         "-o", f"drain_database_url={env['DRAIN_DATABASE_URL']}"],
        env=env, cwd=project, capture_output=True, text=True, timeout=300, check=False,
        stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 passed" in done.stdout


def test_installed_drain_serves_its_status_page(
    installed: Installed, installed_db: str, spawn: Callable[..., support.Process],
) -> None:
    port = support.free_port()
    env = installed.env(installed_db, roles.RUNNER, DRAIN_METRICS_PORT=str(port))
    roles.census_note(env["DRAIN_DATABASE_URL"], "drain run")
    runner = spawn([installed.drain, "run"], env, "installed-drain", cwd=installed.cwd)
    runner.wait_for_output("broker connected", timeout=60)
    status, body = support.http_get(port, "/")
    assert status == 200
    assert body == (support.ROOT / "drain" / "daemon" / "status.html").read_text()


def test_installed_drain_without_spark_says_how_to_add_it(
    installed: Installed, installed_db: str
) -> None:
    done = installed.run(
        [installed.drain, "backfill", "--source", "parquet:/nonexistent", "--task", "t.x",
         "--tag", "test", "--id", "without-spark"],
        installed.env(installed_db, roles.ADMIN))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "drain: error: pyspark is not installed: pip install 'drain-outbox[spark]' (Spark "
        "also needs a Java 17+ runtime; see docs/spark.md)")

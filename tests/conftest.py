"""Fixtures: a database per test (cloned from a migrated template), queues per test.

The suite runs in parallel under pytest-xdist (``make test``); what the workers
share is ordered here: every test outside tests/unit holds the broker lock
(tests/broker_lock.py) shared, and exclusively with the ``broker_alarm``
fixture; the least-privilege census is gathered from the workers. ``make test``
hands out whole files (``--dist loadgroup``; PER_TEST_DIRS test by test), so a
module's tests share a worker. Tests are sorted into the fast tier (``make
test-fast``, marker ``fast``), given their group and put in the order the
workers get them at collection: :func:`pytest_collection_modifyitems`.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import drain
from drain.postgres import migration, session
from tests import broker_alarm as alarm
from tests import broker_lock, roles, support

_TESTS = Path(__file__).resolve().parent
#: Every Spark JVM of the tests (a worker's session, each driver a test starts, and
#: their subprocesses inherit it) compiles with C1 only and collects with one
#: thread: they live for seconds, where C2's compiler and parallel GC threads cost
#: the other workers CPU (tests/spark/test_csv.py, alternating on a loaded machine:
#: 64 and 74 s without, 57 and 39 s with). No behaviour under test depends on it.
os.environ.setdefault("SPARK_SUBMIT_OPTS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")

#: The directories of the fast tier: no services (unit) or in-process drains (integration).
FAST_DIRS = (_TESTS / "unit", _TESTS / "integration")
#: Fixtures that start subprocesses a test waits for (a celery worker, a ``drain run``):
#: a test that asks for one is not in the fast tier.
SUBPROCESS_FIXTURES = frozenset({"spawn", "processes", "start_pipeline"})



#: Directories whose tests go to pytest-xdist workers one by one (make test's --dist
#: loadgroup): they share no module-scoped fixture, and their files are the longest
#: (tests/spark's resume file alone is minutes). Every other test file is one group,
#: sent whole to one worker, as --dist loadfile would.
PER_TEST_DIRS = (_TESTS / "spark", _TESTS / "bench")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the fast tier and each test's xdist group (PER_TEST_DIRS), and order
    the tests for the workers (:func:`_schedule_rank`).

    ``fast``: a test in tests/unit or tests/integration that starts no
    subprocess through :data:`SUBPROCESS_FIXTURES` and is not marked ``slow``
    (mark a test ``slow`` by hand when it takes long without one)."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if (any(item.path.is_relative_to(d) for d in FAST_DIRS)
                and not fixtures & SUBPROCESS_FIXTURES
                and item.get_closest_marker("slow") is None):
            item.add_marker(pytest.mark.fast)
        if not any(item.path.is_relative_to(d) for d in PER_TEST_DIRS):
            item.add_marker(pytest.mark.xdist_group(str(item.path.relative_to(_TESTS))))
    items.sort(key=_schedule_rank)


#: The order pytest-xdist hands work out in: the collection order, as make test
#: runs it with --no-loadscope-reorder (xdist's default sorts the groups by their
#: number of tests, which put three 17-second alarm tests and a one-minute test
#: in the middle of the run). The files that go whole to a worker first, the ones
#: of subprocess-heavy directories before the rest, and the tests dealt one by
#: one (PER_TEST_DIRS) last, where they fill the workers evenly instead of
#: leaving one busy with a long file at the end.
_RANK = {"acceptance": 0, "package": 0, "integration": 1, "docs": 1, "deploy": 2, "unit": 2}


def _schedule_rank(item: pytest.Item) -> tuple[int, int]:
    """(the directory's rank, then within it):

    * the broker alarm tests join the last rank, first: they hold the broker lock
      alone, and the tests of tests/spark the other workers are given then need
      none (:func:`pytest_runtest_protocol`), so nobody waits for them;
    * a ``slow`` test (tens of seconds, e.g. a JVM of its own) before the others,
      and with it the rest of its file: a long one never starts last.
    """
    top = item.path.relative_to(_TESTS).parts[0]
    if "broker_alarm" in getattr(item, "fixturenames", ()):
        return 3, 0
    return _RANK.get(top, 3), 1 if item.get_closest_marker("slow") else 2


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """The broker lock (tests/broker_lock.py) for the whole test, setup and teardown
    included: exclusively for a test that raises a memory alarm (``broker_alarm``),
    shared for the others. tests/unit talk to no broker and take none, nor do the
    tests of tests/spark unless marked ``broker`` (the backfills write to Postgres
    only). Taken outside pytest-timeout's watch: a test's time limit is for the
    test, not for the wait for an alarm test elsewhere to end."""
    if item.path.is_relative_to(FAST_DIRS[0]) or (
            item.path.is_relative_to(_TESTS / "spark")
            and item.get_closest_marker("broker") is None):
        yield
        return
    with broker_lock.held(exclusive="broker_alarm" in getattr(item, "fixturenames", ())):
        yield


@pytest.fixture(scope="session")
def template_db() -> Iterator[str]:
    """A migrated database that per-test databases are cloned from."""
    name = f"drain_tpl_{os.getpid()}"
    with support.database(name) as url:
        with psycopg.connect(url) as conn:
            migration.migrate(conn)
        roles.ensure(url)  # the login roles that hold its group roles
        yield name


@pytest.fixture(autouse=True)
def _census_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The least-privilege census (tests/roles.py) counts in-process drains and
    their sessions (drain.postgres.session.Session: a Drain's, a Store used directly), and
    the staging through ``drain.stage`` / ``drain.stage_many`` too."""
    real = session.Session.__init__

    def init(self: session.Session, settings: Any) -> None:
        roles.census_note(settings.database_url, "in-process drain session")
        real(self, settings)

    monkeypatch.setattr(session.Session, "__init__", init)
    for name in ("stage", "stage_many"):
        monkeypatch.setattr(drain, name, _counted(getattr(drain, name)))


def _counted(stage: Any) -> Any:
    def counted(conn: Any, *args: Any, **kwargs: Any) -> Any:
        roles.census_staging(conn)
        return stage(conn, *args, **kwargs)

    return counted


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker sends its part of the census to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["drain_census"] = roles.census_export()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """The controller adds a finished xdist worker's census to its own."""
    roles.census_import(getattr(node, "workeroutput", {}).get("drain_census", {}))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The least-privilege census: how many tests ran a drain or a ``drain`` command,
    or staged through drain.stage / stage_many, as the superuser (tests/roles.py);
    the tests too with DRAIN_ROLE_CENSUS=1. Under xdist, the workers' censuses
    added up (:func:`pytest_testnodedown`)."""
    for kind, (ran, as_superuser, which) in roles.census().items():
        if not ran:
            continue
        terminalreporter.write_line(
            f"least-privilege census, {kind}: {as_superuser} of {ran} tests did it as "
            "the superuser")
        if os.environ.get("DRAIN_ROLE_CENSUS"):
            for test, what in sorted(which.items()):
                terminalreporter.write_line(f"  {test}: {', '.join(what)}")


@pytest.fixture
def db_url(template_db: str) -> Iterator[str]:
    """A fresh, migrated database for this test only."""
    with support.database(support.unique("drain_t"), template_db) as url:
        yield url


@pytest.fixture
def empty_db_url() -> Iterator[str]:
    """A fresh database without the staging schema."""
    with support.database(support.unique("drain_e")) as url:
        yield url


@pytest.fixture
def queue() -> Iterator[str]:
    """A queue name for this test only; deleted afterwards."""
    name = support.unique("drain_test")
    yield name
    support.delete_queue(name)


@pytest.fixture
def other_queue() -> Iterator[str]:
    """A second queue name for this test only (an unrelated queue); deleted afterwards."""
    name = support.unique("drain_test_other")
    yield name
    support.delete_queue(name)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[list[support.Process]]:
    """Started processes are registered here and always stopped at teardown."""
    started: list[support.Process] = []
    yield started
    for proc in started:
        proc.stop()


@pytest.fixture
def spawn(processes: list[support.Process], tmp_path: Path):  # type: ignore[no-untyped-def]
    counter = iter(range(1000))

    def _spawn(argv: list[str], env: dict[str, str], name: str = "proc",
               cwd: Path = support.ROOT) -> support.Process:
        # An idle Celery worker can take ~10 s to honour SIGTERM or SIGQUIT here;
        # a test's worker is only a consumer of a queue deleted at teardown: kill it.
        stop_signal = signal.SIGKILL if "celery" in argv else signal.SIGTERM
        proc = support.Process(argv, env, tmp_path / f"{name}-{next(counter)}.log", stop_signal,
                               cwd)
        processes.append(proc)
        return proc

    return _spawn


@pytest.fixture
def start_pipeline(spawn):  # type: ignore[no-untyped-def]
    """Start a celery worker on ``queue`` and a ``drain run`` on ``db_url``; wait for both."""

    def _start(db_url: str, queue: str) -> tuple[support.Process, support.Process]:
        env = support.drain_env(db_url)
        worker = spawn(support.celery_argv(queue), env, "worker")
        runner = spawn(support.drain_argv("run", "--poll-interval", "0.5"), env, "drain")
        worker.wait_for_output("ready.", timeout=60)
        runner.wait_for_output("broker connected", timeout=30)
        return runner, worker

    return _start


@pytest.fixture
def broker_alarm() -> Iterator[None]:
    """For tests that raise a RabbitMQ memory alarm (tests/broker_alarm.py): the
    alarm is broker-wide, so clear it after the test whatever happened."""
    try:
        yield
    finally:
        alarm.clear_alarm()


@pytest.fixture(scope="session")
def django_db(template_db: str) -> Iterator[str]:
    """Django configured on a migrated database (settings are per process, so one per session)."""
    import django
    from django.conf import settings

    if settings.configured:
        pytest.fail("Django settings were already configured outside this fixture")
    name = support.unique("drain_dj")
    with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": name,
                "USER": "postgres",
                "HOST": "127.0.0.1",
                "PORT": str(support.PG_PORT),
            }
        },
        INSTALLED_APPS=[],
        USE_TZ=True,
    )
    django.setup()
    try:
        yield support.database_url(name)
    finally:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

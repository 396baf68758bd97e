"""drain's pytest plugin: fixtures for testing code that stages jobs (docs/testing.md).

Registered through the ``pytest11`` entry point, so installing drain is
enough. pytest loads it in every session of a project where drain is
installed: it imports nothing but pytest until a test uses one of its fixtures.

* ``drain_connection``: the connection the code under test stages on, which
  the fixtures read (and delete) staged rows on. Override it to return yours
  (a psycopg connection, Django's ``django.db.connection``, a SQLAlchemy
  ``Connection`` or ``Session``). By default: a psycopg connection in
  autocommit mode to ``drain_database_url``.
* ``drain_database_url``: the test database, for the default connection and
  for the drain ``drain_jobs.publish()`` runs. Default: the
  ``drain_database_url`` ini option; without one, ``publish()`` reads it off
  ``drain_connection``. Session-scoped, so that a session fixture can set the
  database up with it (an override may have any scope).
* ``drain_broker_url``: the broker ``publish()`` publishes to. Default: the
  ``drain_broker_url`` ini option (session-scoped too).
* ``staged_jobs``: what was staged (drain.testing.StagedJobs).
* ``drain_jobs``: publish the staged jobs, or run them eagerly (drain.testing.DrainJobs).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from drain.testing import DrainJobs, StagedJobs

_NO_DATABASE = (
    "drain's fixtures need the connection your code stages on: override the "
    "drain_connection fixture to return it (a psycopg connection, Django's "
    "django.db.connection, a SQLAlchemy Connection or Session), or give the test "
    "database's URL (the drain_database_url ini option, or a drain_database_url fixture)"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("drain_database_url",
                  "drain's fixtures: the test database (a libpq URL), where the "
                  "drain_database_url fixture is not overridden", default="")
    parser.addini("drain_broker_url",
                  "drain's fixtures: the broker drain_jobs.publish() publishes to, where the "
                  "drain_broker_url fixture is not overridden", default="")


@pytest.fixture(scope="session")
def drain_database_url(pytestconfig: pytest.Config) -> str | None:
    """The test database's URL (libpq), or None: read off drain_connection."""
    return str(pytestconfig.getini("drain_database_url")) or None


@pytest.fixture(scope="session")
def drain_broker_url(pytestconfig: pytest.Config) -> str | None:
    """The broker drain_jobs.publish() publishes to, or None: its own default."""
    return str(pytestconfig.getini("drain_broker_url")) or None


@pytest.fixture
def drain_connection(drain_database_url: str | None) -> Iterator[Any]:
    """The connection the code under test stages on; override it to return yours."""
    if not drain_database_url:
        pytest.fail(_NO_DATABASE, pytrace=False)
    import psycopg  # noqa: PLC0415 - only once a test uses the fixture

    from drain.settings.urls import mask_database_url  # noqa: PLC0415

    try:
        conn = psycopg.connect(drain_database_url, autocommit=True)
    except psycopg.Error as exc:
        pytest.fail(f"drain_connection: cannot connect to "
                    f"{mask_database_url(drain_database_url)}: {str(exc).strip()}",
                    pytrace=False)
    with conn:
        yield conn


@pytest.fixture
def staged_jobs(drain_connection: Any) -> StagedJobs:
    """What the code under test staged, read from ``staged_jobs`` on drain_connection."""
    from drain.testing import StagedJobs  # noqa: PLC0415 - only once a test uses it

    return StagedJobs(drain_connection)


@pytest.fixture
def drain_jobs(drain_connection: Any, drain_database_url: str | None,
               drain_broker_url: str | None) -> DrainJobs:
    """Empties ``staged_jobs``: ``.publish()`` through the real drain to the broker,
    or ``.run_eagerly(app)`` with your Celery app."""
    from drain.testing import DrainJobs  # noqa: PLC0415 - only once a test uses it

    return DrainJobs(drain_connection, drain_database_url, drain_broker_url)

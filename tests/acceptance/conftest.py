"""Fixtures of the tests that run against tests/routing_app.py's Celery app, and of
those that run the previous release beside this one (tests/skew.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from tests import pg_server, routing_app, services, skew


@pytest.fixture
def suffix() -> Iterator[str]:
    """This test's suffix for the routing app's queue and exchange names; they are
    deleted afterwards."""
    value = uuid.uuid4().hex[:10]
    yield value
    routing_app.delete_entities(value)


@pytest.fixture
def app(suffix: str) -> Iterator[Celery]:
    """The routing app, built in this process with this test's names."""
    built = routing_app.create(suffix)
    yield built
    built.close()


@pytest.fixture(scope="module")
def own_cluster() -> Iterator[pg_server.Server]:
    """A Postgres cluster of the module's own (tests/skew.py says why)."""
    with services.own_cluster() as server:
        yield server


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> skew.Releases:
    """The previous release, built (tests/previous.py), and this one."""
    return skew.releases(tmp_path_factory.mktemp("releases"))

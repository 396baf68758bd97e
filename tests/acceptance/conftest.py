"""Fixtures of the tests that run against tests/routing_app.py's Celery app."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from tests import routing_app


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

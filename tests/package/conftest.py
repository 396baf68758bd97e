"""Fixtures of tests/package: one build and venv of drain-outbox per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import roles
from tests.package.installed import Installed, build_and_install


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """drain-outbox from its wheel in a clean venv (tests/package/installed.py)."""
    return build_and_install(tmp_path_factory.mktemp("package"))


@pytest.fixture
def installed_db(installed: Installed, empty_db_url: str) -> Iterator[str]:
    """A database migrated by the installed ``drain migrate`` (as its owner)."""
    done = installed.run([installed.drain, "migrate"], installed.env(empty_db_url, roles.ADMIN))
    assert done.returncode == 0, done.stderr
    roles.ensure(empty_db_url)  # the tests' login roles, granted its group roles
    yield empty_db_url



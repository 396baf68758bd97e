"""Two releases side by side: this checkout ("current") and the previous release.

Helpers of tests/acceptance/test_version_skew.py and test_rolling_deploy.py. Each
command of either release runs as a subprocess of its own interpreter, in a
directory outside the repository (``import drain`` finds that release's package,
tests/previous.py), on a Postgres cluster made for the module: the previous
release's roles are ``drain_*`` in every database (roles are the cluster's), so
its databases live apart from the run's others (tests/acceptance/test_shared_cluster.py
counts which databases ``drain_*`` hold privileges in).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from tests import pg_server, previous, support
from tests.package.installed import Installed

#: The two releases of every skew.
PREVIOUS = "previous"
CURRENT = "current"
VERSIONS = (PREVIOUS, CURRENT)
#: The application's script (tests/skew_app.py).
APP = str(support.ROOT / "tests" / "skew_app.py")


@dataclass(frozen=True)
class Releases:
    """How to run each release's interpreter and ``drain``, and where."""

    previous: Installed
    cwd: Path

    def python(self, version: str) -> str:
        return self.previous.python if version == PREVIOUS else sys.executable

    def drain(self, version: str, *args: str) -> list[str]:
        if version == PREVIOUS:
            return [self.previous.drain, *args]
        return [sys.executable, "-m", "drain", *args]


def releases(tmp: Path) -> Releases:
    tmp.mkdir(parents=True, exist_ok=True)
    return Releases(previous.build(), tmp)


@contextlib.contextmanager
def database(server: pg_server.Server) -> Iterator[str]:
    """A new, empty database on ``server``, dropped afterwards."""
    name = support.unique("skew")
    with psycopg.connect(server.url(), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield server.url(name)
    finally:
        with psycopg.connect(server.url(), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def env(url: str, **extra: str) -> dict[str, str]:
    """A process of either release on ``url`` (the worker's tasks write there too)."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("DRAIN_", "PG", "OTEL_")) or k.startswith("DRAIN_TEST_")}
    base.update(DRAIN_DATABASE_URL=url, DRAIN_BROKER_URL=support.BROKER_URL,
                CELERY_APP_DATABASE_URL=url, DRAIN_METRICS_PORT="0", PYTHONUNBUFFERED="1")
    base.pop("PYTHONPATH", None)
    base.update(extra)
    return base


def run(rel: Releases, version: str, url: str, *args: str,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``drain ARGS`` of that release, to completion."""
    return subprocess.run(rel.drain(version, *args), env=env(url), capture_output=True,
                          text=True, timeout=timeout, cwd=rel.cwd, check=False,
                          stdin=subprocess.DEVNULL)


def migrate(rel: Releases, version: str, url: str) -> subprocess.CompletedProcess[str]:
    done = run(rel, version, url, "migrate")
    assert done.returncode == 0, f"drain migrate ({version}): {done.stderr}"
    return done


def stage_once(rel: Releases, version: str, url: str, queue: str, marker: str, *,
               span: bool = False) -> tuple[dict[str, Any], str]:
    """tests/skew_app.py ``once`` with that release: (its JSON, its stderr)."""
    argv = [rel.python(version), APP, "once", url, queue, marker, *(["--span"] if span else [])]
    done = subprocess.run(argv, env=env(url), capture_output=True, text=True, timeout=120,
                          cwd=rel.cwd, check=False, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"staging with the {version} release failed:\n{done.stderr}"
    return json.loads(done.stdout), done.stderr


def load_argv(rel: Releases, version: str, url: str, queue: str, *, marker: str,
              rate: float, stop: Path) -> list[str]:
    """tests/skew_app.py ``load`` with that release."""
    return [rel.python(version), APP, "load", url, queue, marker, str(rate), str(stop)]


def body(raw: bytes) -> list[Any]:
    """A Celery protocol 2 JSON body: [args, kwargs, embed]."""
    decoded = json.loads(raw)
    assert isinstance(decoded, list) and len(decoded) == 3, decoded
    return decoded

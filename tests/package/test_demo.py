"""``make demo``: a runtime-only venv, its own names and port, polite about what it deletes.

The demo runs through the Makefile's own target, with ``DEMO_VENV`` naming the
session's clean venv (drain-outbox's runtime dependencies only, no pytest, mypy or
pyspark: tests/package/installed.py) so that no second venv is built here; what the
target would install is checked with ``make -n``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pika
import psycopg
import pytest

from celery_app import demo_setup
from tests import support
from tests.package.installed import Installed

#: drain run's default metrics port: a drain already serving it broke the demo.
DEFAULT_DRAIN_PORT = 9464


@contextlib.contextmanager
def port_taken(port: int) -> Iterator[None]:
    """``port`` is in use on 127.0.0.1 throughout (by this socket, or by whoever had it)."""
    sock = socket.socket()
    try:
        with contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", port))
            sock.listen()
        yield
    finally:
        sock.close()


@pytest.fixture
def demo_names() -> Iterator[tuple[str, str]]:
    """A database and a queue name for this test's demo; both removed afterwards."""
    database, queue = support.unique("drain_demo_t"), support.unique("drain_demo_q")
    yield database, queue
    with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    support.delete_queue(queue)


def demo_env(database: str, queue: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DRAIN_", "CELERY_APP_")) and k != "PYTHONPATH"}
    env.update(DRAIN_DEMO_ADMIN_URL=support.ADMIN_URL, DRAIN_DEMO_BROKER_URL=support.BROKER_URL,
               DRAIN_DEMO_DATABASE=database, DRAIN_DEMO_QUEUE=queue, **extra)
    return env


def run_demo(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "celery_app.demo"], env=env, cwd=support.ROOT,
                          capture_output=True, text=True, timeout=300, check=False,
                          stdin=subprocess.DEVNULL)


def exists(queue: str, kind: str) -> bool:
    with support.broker_channel() as channel:
        try:
            if kind == "queue":
                channel.queue_declare(queue, passive=True)
            else:
                channel.exchange_declare(queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker:
            return False
        return True


def test_make_demo_runs_in_a_runtime_venv_beside_a_drain_on_its_port(
    installed: Installed, demo_names: tuple[str, str]
) -> None:
    database, queue = demo_names
    (installed.venv / ".installed").touch()  # make's stamp: this venv is the demo's
    # A shell set up for a real drain: its port taken, its database elsewhere.
    env = demo_env(database, queue, DRAIN_METRICS_PORT=str(DEFAULT_DRAIN_PORT),
                   DRAIN_DATABASE_URL="postgresql://app:s3cret@127.0.0.1:1/production")
    with port_taken(DEFAULT_DRAIN_PORT):
        done = subprocess.run(
            ["make", "--no-print-directory", "demo", f"DEMO_VENV={installed.venv}"],
            env=env, cwd=support.ROOT, capture_output=True, text=True, timeout=600, check=False,
            stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "OK: 5 of 5 committed jobs ran, each once" in done.stdout
    first_screen = done.stdout.split("recreated database")[0]
    assert f"database   {database} at " in first_screen
    assert f"queue      {queue} and its exchange at " in first_screen
    assert f"It leaves behind the database {database}" in first_screen
    assert "Not passed to its processes: DRAIN_DATABASE_URL, DRAIN_METRICS_PORT" in first_screen
    assert "status page on http://127.0.0.1:" in first_screen
    assert f"127.0.0.1:{DEFAULT_DRAIN_PORT}/" not in done.stdout
    assert "s3cret" not in done.stdout + done.stderr
    # Left behind: the database (marked as the demo's); the queue and its exchange are gone.
    with psycopg.connect(support.database_url(database)) as conn:
        mark = conn.execute(
            "SELECT shobj_description(oid, 'pg_database') FROM pg_database "
            "WHERE datname = current_database()").fetchone()
        assert mark == (demo_setup.MARK,)
        assert conn.execute("SELECT count(*) FROM search_index").fetchone() == (4,)
    assert not exists(queue, "queue") and not exists(queue, "exchange")


def test_make_demo_installs_the_runtime_only(tmp_path: Path) -> None:
    venv = f"{tmp_path}/venv-demo"
    done = subprocess.run(["make", "-n", "--no-print-directory", "demo", f"DEMO_VENV={venv}"],
                          cwd=support.ROOT, capture_output=True, text=True, check=True)
    installs = [line for line in done.stdout.splitlines() if "pip install" in line]
    assert len(installs) == 1 and installs[0].endswith(" -e ."), done.stdout
    assert f"{venv}/bin/python -m celery_app.demo" in done.stdout
    assert "/.venv/" not in done.stdout


def test_the_demo_drops_no_database_it_did_not_create(demo_names: tuple[str, str]) -> None:
    database, queue = demo_names
    with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{database}"')
    with psycopg.connect(support.database_url(database), autocommit=True) as conn:
        conn.execute("CREATE TABLE precious (id int)")
    done = run_demo(demo_env(database, queue))
    assert done.returncode == 2, done.stdout + done.stderr
    assert (f"demo FAILED: database {database} exists and was not created by the demo: it "
            "would drop it. Set DRAIN_DEMO_DATABASE to another name, or drop it yourself"
            ) in done.stderr
    with psycopg.connect(support.database_url(database)) as conn:
        assert conn.execute("SELECT to_regclass('precious') IS NOT NULL").fetchone() == (True,)


def test_the_demo_empties_no_queue_holding_messages(demo_names: tuple[str, str]) -> None:
    database, queue = demo_names
    with support.broker_channel() as channel:
        channel.queue_declare(queue, durable=True)
        channel.basic_publish("", queue, b"not the demo's")
    done = run_demo(demo_env(database, queue))
    assert done.returncode == 2, done.stdout + done.stderr
    assert (f"demo FAILED: queue {queue} holds 1 message(s): not the demo's to delete. Set "
            "DRAIN_DEMO_QUEUE to another name") in done.stderr
    assert support.queue_depth(queue) == 1


@pytest.mark.parametrize("port", ["abc", "70000", "-1"])
def test_a_bad_demo_port_is_one_line_and_exit_2(port: str) -> None:
    done = run_demo(demo_env("unused", "unused", DRAIN_DEMO_METRICS_PORT=port))
    assert done.returncode == 2
    assert done.stderr == (
        f"demo: DRAIN_DEMO_METRICS_PORT must be a port number, 0 for none: got {port!r}\n")
    assert done.stdout == ""

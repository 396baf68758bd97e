"""The drain under the least-privileged roles of docs/running.md (tests/roles.py).

* A drain whose role is granted the database's runner role takes the lock and delivers,
  its metrics sampler and ``drain status`` read what they need.
* A grant that is missing is a fatal error with exit code 5 and one line,
  never a retry: for ``drain run`` (also ``--exit-when-empty``), its metrics
  sampler, ``drain status`` and the one-shot commands.
* Any other error of a cycle costs the session, never the drain: it connects
  again and goes on delivering.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import drain
from drain import errors
from drain.daemon.runner import State
from tests import roles, support

PERMISSION_DENIED = 5


@pytest.fixture
def bare_role(db_url: str) -> Iterator[str]:
    """A login role granted none of drain's roles: ``db_url`` as that role."""
    name = support.unique("drain_bare")
    with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{name}" LOGIN')
    try:
        yield roles.url(db_url, name)
    finally:
        with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP ROLE IF EXISTS "{name}"')


def _stage(db_url: str, queue: str, task: str = "celery_app.record") -> str:
    with psycopg.connect(roles.url(db_url, roles.STAGER)) as conn:
        return str(drain.stage(conn, task, [1], queue=queue))


def test_a_drain_as_drain_runner_delivers(db_url: str, queue: str) -> None:
    """Before: "permission denied for table drain_schema_state; retrying with
    backoff", forever, even with --exit-when-empty."""
    task_id = _stage(db_url, queue)
    ran = support.run_cli(db_url, "run", "--exit-when-empty", env=support.drain_env(db_url))
    assert ran.returncode == 0, ran.stderr
    assert support.task_ids(support.drain_queue(queue)) == [task_id]
    status = support.run_cli(db_url, "status", "--json")
    assert status.returncode == 0, status.stderr
    assert f"{roles.RUNNER}@" in status.stdout  # the database it read, as connected to


@pytest.mark.parametrize("args", [("run", "--exit-when-empty"), ("run",), ("status",),
                                  ("dead", "list"), ("stage", "t.x"),
                                  ("processed", "purge", "--older-than", "1d")])
def test_a_missing_grant_is_one_line_and_exit_code_5(
    db_url: str, bare_role: str, args: tuple[str, ...]
) -> None:
    ran = support.run_cli(db_url, *args, env=support.drain_env(bare_role, roles.ADMIN),
                          timeout=60)
    assert ran.returncode == PERMISSION_DENIED, ran.stderr
    [line] = [ln for ln in ran.stderr.splitlines() if "drain: error:" in ln]
    assert "permission denied for" in line and "Database roles" in line, line
    assert "retrying" not in ran.stderr


def test_the_wrong_role_for_a_command_is_told_which_it_needs(db_url: str) -> None:
    ran = support.run_cli(db_url, "dead", "purge", "--older-than", "0s", "--yes", "--why", "test",
                          env=support.drain_env(db_url, roles.RUNNER) | {
                              "DRAIN_DATABASE_URL": roles.url(db_url, roles.STAGER)})
    assert ran.returncode == PERMISSION_DENIED, ran.stderr
    assert "need this database's operator role" in ran.stderr


def test_the_metrics_sampler_refused_a_table_ends_the_drain_with_exit_code_5(
    db_url: str, queue: str, spawn: Callable[..., support.Process],
) -> None:
    """Before: "metrics sample failed: permission denied for table dead_jobs;
    retrying", every interval, for ever."""
    with psycopg.connect(db_url, autocommit=True) as admin:
        admin.execute(f'REVOKE SELECT ON dead_jobs FROM "{roles.prefix_of(db_url)}runner"')
    env = support.drain_env(db_url, DRAIN_METRICS_PORT=str(support.free_port()),
                            DRAIN_METRICS_INTERVAL="0.2")
    proc = spawn(support.drain_argv("run"), env, "drain")
    assert proc.wait(60) == PERMISSION_DENIED, proc.output()
    assert "permission denied for table dead_jobs" in proc.output()


def test_an_unexpected_error_in_a_cycle_costs_the_session_not_the_drain(
    db_url: str, queue: str, start_active_drain: Any,
) -> None:
    """Before: the DrainError left Drain.run, and `drain run` exited 1."""
    raised: list[str] = []

    def once(_elapsed: float, found: int) -> None:
        if found and not raised:
            raised.append("x")
            raise errors.DrainError("an error no part of the drain expects")

    running = start_active_drain(db_url, on_fetch=once)
    first = _stage(db_url, queue)
    support.wait_for(lambda: raised, 30, "the injected error")
    second = _stage(db_url, queue)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "both jobs delivered")
    assert running.thread.is_alive() and running.drain.state is State.ACTIVE
    assert set(support.task_ids(support.drain_queue(queue))) == {first, second}

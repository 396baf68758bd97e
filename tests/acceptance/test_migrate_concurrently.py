"""``drain migrate`` beside other migrates, on a Postgres cluster created for the test
(issue 35, item 1).

Roles belong to the cluster: two migrates of two new databases used to race on
``CREATE ROLE drain_stager`` (UniqueViolation on pg_authid_rolname_index), which
failed one of them on every fresh server, the test suite's own included (4 of 4
pytest-xdist workers migrating their templates at once). Each database now has
roles of its own, and a role another migrate created meanwhile is taken as
existing. A cluster made here by ``initdb`` has never seen drain, as a new
machine's has not.

* Databases migrated at once, each with its own roles: every migrate succeeds,
  in every round.
* Databases migrated at once with the same ``--role-prefix``: exactly one
  succeeds; the others are refused in one line (the roles serve another
  database now), never a UniqueViolation.
* A real error still fails loudly, beside migrates that succeed: a role that may
  not create tables gets its permission error (exit 5).
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from drain.errors import RolesShared
from drain.postgres import migration
from tests import pg_server, roles, services, support

#: Rounds of concurrent in-process migrates (the CLI's round is one more).
ROUNDS = 10
#: Migrates started together in a round.
AT_ONCE = 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[pg_server.Server]:
    """A cluster of its own, made as the run's is (tests/services.py)."""
    with services.own_cluster() as server:
        yield server


def _cli_migrates(urls: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """``drain migrate`` of each URL, as that URL's user, all at once."""
    with ThreadPoolExecutor(len(urls)) as pool:
        return list(pool.map(lambda url: support.run_cli(
            url, "migrate", env=support.drain_env(url, roles.ADMIN), timeout=90), urls))


def _databases(server: pg_server.Server, count: int, owner: str = "postgres") -> list[str]:
    names = [support.unique("mig") for _ in range(count)]
    with psycopg.connect(server.url(), autocommit=True) as admin:
        for name in names:
            admin.execute(f'CREATE DATABASE "{name}" OWNER "{owner}"')
    return names


def _at_once(server: pg_server.Server, names: list[str],
             prefix: str | None = None) -> list[str]:
    """migration.migrate() of each database, all started at one barrier: each one's
    outcome, "ok", "shared" (RolesShared) or the exception's repr."""
    barrier = threading.Barrier(len(names))

    def one(name: str) -> str:
        with psycopg.connect(server.url(name)) as conn:
            barrier.wait(30)
            try:
                migration.migrate(conn, role_prefix=prefix)
            except RolesShared:
                return "shared"
            except Exception as exc:  # reported as the outcome
                return repr(exc)
        return "ok"

    with ThreadPoolExecutor(len(names)) as pool:
        return list(pool.map(one, names))


def test_migrates_of_new_databases_at_once_all_succeed(cluster: pg_server.Server) -> None:
    outcomes = [_at_once(cluster, _databases(cluster, AT_ONCE)) for _ in range(ROUNDS)]
    assert outcomes == [["ok"] * AT_ONCE] * ROUNDS
    # ...and each database has roles of its own, none in another database.
    with psycopg.connect(cluster.url(), autocommit=True) as admin:
        shared = admin.execute("""
            SELECT r.rolname, count(DISTINCT s.dbid) FROM pg_shdepend s
            JOIN pg_roles r ON r.oid = s.refobjid
            WHERE s.refclassid = 'pg_authid'::regclass AND r.rolname LIKE 'mig%'
            GROUP BY 1 HAVING count(DISTINCT s.dbid) > 1""").fetchall()
    assert shared == []


def test_the_cli_migrates_of_new_databases_at_once_all_succeed(
    cluster: pg_server.Server,
) -> None:
    names = _databases(cluster, AT_ONCE)
    for name, ran in zip(names, _cli_migrates([cluster.url(n) for n in names]), strict=True):
        assert ran.returncode == 0, ran.stderr
        assert f"its roles: {name}_drain_stager, {name}_drain_runner" in ran.stderr


def test_migrates_at_once_with_one_prefix_give_it_to_one_and_refuse_the_others(
    cluster: pg_server.Server,
) -> None:
    for _ in range(ROUNDS // 2):
        prefix = support.unique("same").lower() + "_"
        outcomes = _at_once(cluster, _databases(cluster, AT_ONCE), prefix)
        assert sorted(outcomes) == ["ok"] + ["shared"] * (AT_ONCE - 1), outcomes


def test_a_real_error_fails_loudly_beside_migrates_that_succeed(
    cluster: pg_server.Server,
) -> None:
    """A role that may not create tables in the database (no CREATE on schema
    public: PUBLIC's default since Postgres 15) gets its error; the others migrate."""
    with psycopg.connect(cluster.url(), autocommit=True) as admin:
        admin.execute("CREATE ROLE mig_powerless LOGIN")
    names = _databases(cluster, AT_ONCE)
    urls = [cluster.url(n) for n in names]
    urls[0] = urls[0].replace("postgres@", "mig_powerless@")
    results = [(ran.returncode, ran.stderr) for ran in _cli_migrates(urls)]
    code, err = results[0]
    assert code == 5, err
    [line] = err.strip().splitlines()
    assert "permission denied for schema public" in line, line
    assert [code for code, _ in results[1:]] == [0] * (AT_ONCE - 1), results

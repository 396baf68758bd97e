"""``drain migrate --check`` for deploy pipelines, and the schema version that
``drain status`` shows (issue 38).

``drain migrate`` records the schema's version in drain_settings; ``--check``
applies nothing and exits 0 when the database's schema is this drain's
version, 4 when it needs ``drain migrate`` (none at all, none recorded, or an
older one), 7 when a newer drain migrated it, each with one line on stderr. An
older drain's migrate never lowers a newer version.
"""

from __future__ import annotations

import json

import psycopg

from drain.postgres.migration import SCHEMA_VERSION
from tests import roles, support


def _check(url: str) -> tuple[int, list[str]]:
    result = support.run_cli(url, "migrate", "--check")
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, lines


def _set_version(url: str, value: str | None) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        if value is None:
            conn.execute("DELETE FROM drain_settings WHERE key = 'schema_version'")
        else:
            conn.execute("UPDATE drain_settings SET value = %s WHERE key = 'schema_version'",
                         [value])


def test_check_says_what_the_database_needs_in_one_line(empty_db_url: str) -> None:
    code, lines = _check(empty_db_url)
    assert code == 4 and len(lines) == 1 and "run `drain migrate`" in lines[0], lines
    assert support.run_cli(empty_db_url, "migrate").returncode == 0
    code, lines = _check(empty_db_url)
    assert code == 0 and f"schema version {SCHEMA_VERSION}: current" in lines[-1], lines

    _set_version(empty_db_url, str(SCHEMA_VERSION - 1))
    code, lines = _check(empty_db_url)
    assert code == 4 and len(lines) == 1, lines
    assert (f"schema version {SCHEMA_VERSION - 1}, this drain's is {SCHEMA_VERSION}: "
            "run `drain migrate`") in lines[0]

    _set_version(empty_db_url, None)  # as a database an older drain migrated
    code, lines = _check(empty_db_url)
    assert code == 4 and len(lines) == 1 and "records no version" in lines[0], lines
    assert support.run_cli(empty_db_url, "migrate").returncode == 0
    assert _check(empty_db_url)[0] == 0

    _set_version(empty_db_url, str(SCHEMA_VERSION + 1))  # a newer drain's
    code, lines = _check(empty_db_url)
    assert code == 7 and len(lines) == 1, lines
    assert f"schema version {SCHEMA_VERSION + 1} is newer than this drain's" in lines[0]
    # This drain's migrate leaves the newer version as it is.
    assert support.run_cli(empty_db_url, "migrate").returncode == 0
    assert _check(empty_db_url)[0] == 7


def test_status_shows_the_schema_version(empty_db_url: str) -> None:
    assert support.run_cli(empty_db_url, "migrate").returncode == 0
    roles.ensure(empty_db_url)
    result = support.run_cli(empty_db_url, "status", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["schema"] == {"version": SCHEMA_VERSION,
                                                   "drain": SCHEMA_VERSION}
    result = support.run_cli(empty_db_url, "status")
    assert f"schema version: {SCHEMA_VERSION}\n" in result.stdout, result.stdout
    _set_version(empty_db_url, None)
    result = support.run_cli(empty_db_url, "status")
    assert "schema version: none recorded (an older drain's): run `drain migrate`" in (
        result.stdout), result.stdout

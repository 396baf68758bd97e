"""The query file parser and the set of queries (pure logic)."""

from __future__ import annotations

import pytest

from drain.postgres import sql


def test_parse() -> None:
    text = "-- intro\n-- name: a\nSELECT 1;\n\n-- name: b\n-- comment\nSELECT 2;\n"
    assert sql.parse(text) == {"a": "SELECT 1;", "b": "SELECT 2;"}


def test_compact_keeps_the_code_and_its_literals() -> None:
    query = "-- what it does\nSELECT a,  -- the id\n    'x -- y''s' AS b, -- more\n\nFROM t;"
    assert sql.compact(query) == "SELECT a,\n'x -- y''s' AS b,\nFROM t;"
    # A literal over lines keeps its lines as they are.
    query = "SELECT 'one\n  -- two' AS c -- gone\n  FROM t;"
    assert sql.compact(query) == "SELECT 'one\n  -- two' AS c \n  FROM t;"


def test_every_query_stays_within_what_psycopg_keeps_converted() -> None:
    """A longer query would be parsed again at each execution: the fetch, once per batch."""
    long = {name: len(q) for name, q in sql.queries().items()
            if len(q) > sql.PSYCOPG_CACHED_LENGTH}
    assert not long, long


@pytest.mark.parametrize(
    ("text", "message"),
    [("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;", "twice"), ("-- name: a\n\n", "empty")],
)
def test_parse_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sql.parse(text)


def test_query_names() -> None:
    assert set(sql.queries()) == {
        "schema_present", "try_lock", "try_lane_lock", "join_lanes", "listen", "lane_holders",
        "fetch_batch", "fetch_heads", "timed_heads", "delete_confirmed", "locked_rows",
        "backlog_estimate",
        "backlog_groups_sample", "backlog_oldest", "oldest_transaction", "lock_holder",
        "lanes_in_use", "set_application_name", "backlog_groups", "dead_by_reason",
        "dead_estimate", "dead_by_reason_sample",
        "bury", "expiring", "keyed_lock_timeout", "keyed_savepoint", "keyed_release",
        "keyed_rollback", "alive", "take_sentinel", "release_sentinel",
        "wake_flag", "raise_flag", "lower_flag", "silent_writers", "announce", "armed_elsewhere",
        "in_recovery", "take_token", "end_abandoned", "newest_columns_present",
        "testing_staged", "testing_delete", "testing_dead_mark", "testing_dead_since",
        "schema_tables", "schema_version", "pauses", "pauses_present",
    }


def _code(text: str) -> str:
    """A query without its comments."""
    return "\n".join(line.split("--")[0] for line in text.splitlines())


def test_a_job_moved_to_dead_jobs_keeps_its_embed_and_queue_legacy() -> None:
    # Expired rows move through bury too (Store.expire: expiring, then bury).
    code = _code(sql.query("bury"))
    assert code.count("queue_legacy") == 2 and code.count("embed") == 2


def test_packaged_schema_is_the_canonical_file() -> None:
    assert sql.schema_text() == sql.schema_path().read_text("utf-8")

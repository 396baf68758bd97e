"""The query file parser and the set of queries (pure logic)."""

from __future__ import annotations

import pytest

from drain import sql


def test_parse() -> None:
    text = "-- intro\n-- name: a\nSELECT 1;\n\n-- name: b\n-- comment\nSELECT 2;\n"
    assert sql.parse(text) == {"a": "SELECT 1;", "b": "-- comment\nSELECT 2;"}


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
        "fetch_batch", "fetch_heads", "timed_heads", "delete_confirmed", "backlog_estimate",
        "backlog_groups_sample", "backlog_oldest", "oldest_transaction", "lock_holder",
        "lanes_in_use", "set_application_name", "backlog_groups", "dead_by_reason",
        "bury", "expire", "alive", "take_sentinel", "release_sentinel",
        "wake_flag", "raise_flag", "lower_flag", "silent_writers", "announce", "armed_elsewhere",
        "in_recovery", "backend_identity", "end_abandoned", "schema_state_present",
        "queue_given_from", "embed_present",
    }


def _code(text: str) -> str:
    """A query without its comments."""
    return "\n".join(line.split("--")[0] for line in text.splitlines())


def test_only_the_queries_of_staged_rows_and_dead_rows_use_the_embed_column() -> None:
    assert {name for name in sql.queries()
            if sql.query(name, embed=False) != sql.query(name)} == {
        "fetch_batch", "expire", "bury"}


@pytest.mark.parametrize("name", ["fetch_batch", "expire", "bury"])
def test_without_embed_a_query_names_no_embed_column(name: str) -> None:
    """On a schema from before the column, the fetch reads it as NULL and the
    moves to dead_jobs leave it out; every other mention of it is gone."""
    code = _code(sql.query(name, embed=False))
    assert code.replace("NULL::text AS embed", "").count("embed") == 0
    assert "embed" in _code(sql.query(name))
    if name == "fetch_batch":
        assert "NULL::text AS embed" in code


def test_packaged_schema_is_the_canonical_file() -> None:
    assert sql.schema_text() == sql.schema_path().read_text("utf-8")

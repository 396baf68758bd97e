"""The SQL drain runs: ``queries.sql`` by name, and the staging schema."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from psycopg import sql as psql

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


#: The longest query psycopg (3.x) keeps converted (its ``%(name)s`` placeholders to
#: ``$n``); a longer one is parsed again at every execution (~0.3 ms for the fetch).
PSYCOPG_CACHED_LENGTH = 4096


def parse(text: str) -> dict[str, str]:
    """Split a ``-- name: x`` file into ``{name: query}``, each :func:`compact`."""
    parts = _HEADER.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        query = compact(body)
        if not query:
            raise ValueError(f"query {name!r} is empty")
        queries[name] = query
    return queries


def compact(query: str) -> str:
    """``query`` without its comments, indentation and blank lines: what the file
    explains is for its readers, and a shorter text stays within what psycopg
    keeps converted (PSYCOPG_CACHED_LENGTH). Quoted literals are kept whole; with
    one that goes on over lines, the lines keep their indentation."""
    code = _COMMENT_OR_LITERAL.sub(lambda m: m.group(1) or "", query)
    if any("\n" in literal for literal in _LITERAL.findall(code)):
        return code.strip()
    return "\n".join(line.strip() for line in code.splitlines() if line.strip())


#: A quoted literal (kept) or a ``--`` comment to the end of its line (dropped).
_COMMENT_OR_LITERAL = re.compile(r"('(?:[^']|'')*')|--[^\n]*")
_LITERAL = re.compile(r"'(?:[^']|'')*'")


@functools.cache
def queries() -> dict[str, str]:
    return parse(resources.files("drain.postgres").joinpath("queries.sql").read_text("utf-8"))


def query(name: str) -> str:
    """The query ``name``."""
    return queries()[name]


def schema_text() -> str:
    """The staging schema: the wheel's copy, or the repository's canonical file."""
    packaged = resources.files("drain").joinpath("staging_schema.sql")
    if packaged.is_file():
        return packaged.read_text("utf-8")
    return schema_path().read_text("utf-8")


def schema_path() -> Path:
    """The top-level ``staging_schema.sql`` of a source checkout."""
    return Path(__file__).resolve().parent.parent.parent / "staging_schema.sql"


#: The smallest bigint.
BIGINT_MIN = -(2**63)


def int_array(values: Iterable[int]) -> str:
    """``values`` as a Postgres array literal (``{1,2,3}``), for a parameter the
    query casts (``%(ids)s::bigint[]``). psycopg dumps a list of ints one Python
    call at a time: 3.5 ms for the 7,000 ids a fetch leaves out at
    pipeline 8, against 0.6 ms joined here, per batch of 1,000 rows."""
    return "{" + ",".join(map(str, values)) + "}"


def equal_to(pairs: Iterable[tuple[str, object]]) -> tuple[list[psql.Composable], dict[str, Any]]:
    """``column = %(column)s`` for each ``(column, value)`` whose value is not None, and
    its parameters: the equality filters of the operators' listings
    (drain.postgres.dead, drain.postgres.staged)."""
    given = {column: value for column, value in pairs if value is not None}
    return [psql.SQL("{} = {}").format(psql.Identifier(column), psql.Placeholder(column))
            for column in given], given

"""Helpers for the Spark tests: run the commands in-process, read what they staged."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from drain.cli import spark as cli


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``drain ARGV`` (the Spark commands) in this process, on the test's SparkSession."""
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    """Run with --json; the command must succeed; its output parsed."""
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    parsed: dict[str, Any] = json.loads(out)
    return parsed


def staged(db_url: str, tag: str | None = None) -> list[dict[str, Any]]:
    """staged_jobs rows (of ``tag``), as dicts, in id order."""
    with psycopg.connect(db_url) as conn:
        cur = conn.execute(
            "SELECT task_id::text, task_name, args, kwargs, queue, priority, tag, not_before, "
            "expires_at FROM staged_jobs WHERE %(tag)s::text IS NULL OR tag = %(tag)s "
            "ORDER BY id",
            {"tag": tag},
        )
        names = [c.name for c in cur.description or ()]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def ledger(db_url: str, backfill_id: str) -> dict[int, int]:
    """``{partition: rows}`` committed for ``backfill_id``."""
    with psycopg.connect(db_url) as conn:
        exists = conn.execute("SELECT to_regclass('drain_backfill_ledger')").fetchone()
        if not exists or exists[0] is None:
            return {}
        rows = conn.execute(
            "SELECT partition, rows FROM drain_backfill_ledger WHERE backfill_id = %s",
            (backfill_id,),
        ).fetchall()
        return {int(p): int(n) for p, n in rows}


def execute(db_url: str, *statements: str) -> None:
    with psycopg.connect(db_url) as conn:
        for statement in statements:
            conn.execute(statement)


def on_first_commit(db_url: str, partition: int, action: str) -> None:
    """At the COMMIT of ``partition``'s first attempt (in any backfill), run ``action``:
    a deferred constraint trigger on the ledger, and a sequence (which no rollback
    undoes) so that it acts once."""
    execute(
        db_url,
        "CREATE SEQUENCE first_attempt",
        f"""CREATE FUNCTION on_first_commit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.partition = {partition} AND nextval('first_attempt') = 1 THEN
                {action};
            END IF;
            RETURN NULL;
        END $$""",
        "CREATE CONSTRAINT TRIGGER on_first_commit AFTER INSERT ON drain_backfill_ledger "
        "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION on_first_commit()",
    )


def attempts(db_url: str, run_id: str, partition: int) -> list[dict[str, Any]]:
    """``partition``'s rows in drain_backfill_attempts, in the order they started."""
    with psycopg.connect(db_url) as conn:
        cur = conn.execute(
            "SELECT attempt, task_attempt_id, host, started_at, ended_at, outcome "
            "FROM drain_backfill_attempts WHERE backfill_id = %s AND partition = %s "
            "ORDER BY started_at, id",
            (run_id, partition),
        )
        names = [c.name for c in cur.description or ()]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

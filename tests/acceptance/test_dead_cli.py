"""`drain dead list|requeue|purge`, `drain processed purge`, `drain status`: subprocesses."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest

import drain
from tests import roles, support

DEAD_ROWS = [
    # (id, task, tag, reason, dead for, ttl the job had at staging)
    (1, "mail.send", "api.signup", "expired", "2 days", "1 hour"),
    (2, "mail.send", "api.signup", "expired", "1 minute", "1 hour"),
    (3, "search.index", "backfill.x", "expired", "3 days", None),
    (4, "search.index", "backfill.x", "too_large", "3 days", None),
]


def _bury(db_url: str) -> dict[int, str]:
    task_ids = {}
    with psycopg.connect(db_url) as conn:
        for row_id, task, tag, reason, dead_for, ttl in DEAD_ROWS:
            task_id = str(uuid.uuid4())
            task_ids[row_id] = task_id
            conn.execute(
                "INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, priority, "
                "tag, expires_at, staged_at, reason, detail, dead_at) VALUES "
                "(%s, %s, %s, '[1]', '{}', 'celery', -1, %s, "
                " now() - %s::interval - %s::interval + coalesce(%s::interval, '0'), "
                " now() - %s::interval - %s::interval, %s, %s, now() - %s::interval)",
                (row_id, task_id, task, tag, dead_for, "1 hour", ttl, dead_for, "1 hour",
                 reason, "because" if reason != "expired" else None, dead_for),
            )
            if ttl is None:
                conn.execute("UPDATE dead_jobs SET expires_at = NULL WHERE id = %s", (row_id,))
    return task_ids


def test_list_with_filters(db_url: str) -> None:
    task_ids = _bury(db_url)
    result = support.run_cli(db_url, "dead", "list", "--reason", "expired")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "3 dead job(s) match (reason=expired)"
    assert sum(task_id in result.stdout for task_id in task_ids.values()) == 3
    result = support.run_cli(db_url, "dead", "list", "--json", "--tag", "backfill.x",
                             "--older-than", "1d")
    found = [json.loads(line) for line in result.stdout.splitlines()]
    assert {row["id"] for row in found} == {3, 4}
    assert {row["reason"] for row in found} == {"expired", "too_large"}


def test_requeue_needs_yes_without_a_terminal_then_moves_rows_back(db_url: str) -> None:
    task_ids = _bury(db_url)
    refused = support.run_cli(db_url, "dead", "requeue", "--task", "mail.send")
    assert refused.returncode == 2
    assert "2 dead job(s) match (task=mail.send)" in refused.stdout
    assert "refusing to requeue without --yes" in refused.stderr
    assert support.staged_count(db_url) == 0

    done = support.run_cli(db_url, "dead", "requeue", "--task", "mail.send", "--yes")
    assert done.returncode == 0, done.stderr
    assert "requeued 2 job(s)" in done.stdout
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT task_id::text, priority, tag, not_before, "
            "expires_at - now() BETWEEN interval '59 minutes' AND interval '61 minutes' "
            "FROM staged_jobs ORDER BY id"
        ).fetchall()
        left = conn.execute("SELECT id FROM dead_jobs ORDER BY id").fetchall()
    assert {r[0] for r in rows} == {task_ids[1], task_ids[2]}, "same task ids"
    assert all(r[1:] == (-1, "api.signup", None, True) for r in rows), rows
    assert left == [(3,), (4,)]


def test_requeue_with_expires_in(db_url: str) -> None:
    _bury(db_url)
    done = support.run_cli(db_url, "dead", "requeue", "--reason", "too_large",
                           "--expires-in", "10m", "--yes")
    assert done.returncode == 0, done.stderr
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT expires_at - now() BETWEEN interval '9 minutes' AND interval '11 minutes' "
            "FROM staged_jobs"
        ).fetchone()
    assert row == (True,)


def test_purge_needs_older_than_and_only_purges_matches(db_url: str) -> None:
    _bury(db_url)
    missing = support.run_cli(db_url, "dead", "purge", "--yes")
    assert missing.returncode == 2 and "--older-than" in missing.stderr
    bad = support.run_cli(db_url, "dead", "purge", "--older-than", "soon", "--yes")
    assert bad.returncode == 2 and "not a duration" in bad.stderr
    unsaid = support.run_cli(db_url, "dead", "purge", "--older-than", "1d", "--yes")
    assert unsaid.returncode == 2
    assert unsaid.stderr.splitlines()[-1] == (
        "drain dead purge: error: the following arguments are required: --why")
    done = support.run_cli(db_url, "dead", "purge", "--older-than", "1d", "--reason",
                           "expired", "--yes", "--why", "old noise", "--actor", "ann")
    assert done.returncode == 0, done.stderr
    assert "purged 2 dead job(s)" in done.stdout
    with psycopg.connect(db_url) as conn:
        left = conn.execute("SELECT id FROM dead_jobs ORDER BY id").fetchall()
        audited = conn.execute("SELECT actor, action, target, count, reason FROM drain_audit"
                               ).fetchall()
    assert left == [(2,), (4,)]
    # The purge's audit row, with the filter it acted on and how many went.
    assert audited == [("ann", "purge", {"older_than": "1d", "reason": "expired", "upto": 3},
                        2, "old noise")]
    nothing = support.run_cli(db_url, "dead", "purge", "--older-than", "0s", "--task", "x.y",
                              "--why", "none match")
    assert nothing.returncode == 0 and "0 dead job(s) match" in nothing.stdout


def test_processed_purge(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO drain_processed (task_id, processed_at) "
            "SELECT gen_random_uuid(), now() - make_interval(days => g) + interval '12 hours' "
            "FROM generate_series(0, 9) g"
        )
    done = support.run_cli(db_url, "processed", "purge", "--older-than", "7d")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "purged 2 processed task id(s) older than 7d\n"  # 7.5, 8.5 days
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM drain_processed").fetchone() == (8,)
    # Before: 0s exited 1 with "older_than must be positive, got 0:00:00".
    for zero in ("0s", "0d"):
        refused = support.run_cli(db_url, "processed", "purge", "--older-than", zero)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.splitlines()[-1] == (
            f"drain processed purge: error: argument --older-than: must be more than 0s, got "
            f"'{zero}': every record would go, and a copy of a job still in a queue or being "
            "retried would run again"
        )
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM drain_processed").fetchone() == (8,)


def test_status_groups_the_backlog_and_counts_dead_letters(db_url: str) -> None:
    _bury(db_url)
    with psycopg.connect(db_url) as conn:
        jobs: list[Any] = [drain.Job("search.index", [i], tag="backfill.x", priority=-10)
                           for i in range(5)]
        jobs += [drain.Job("mail.send", [1], tag="api.signup", queue="mail", countdown=3600)]
        drain.stage_many(conn, jobs)
    result = support.run_cli(db_url, "status", "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["backlog"] == 6 and status["delayed"] == 1
    groups = {(g["queue"], g["tag"], g["task"]): g["count"] for g in status["by_group"]}
    assert groups == {(None, "backfill.x", "search.index"): 5,
                      ("mail", "api.signup", "mail.send"): 1}
    assert status["dead_by_reason"] == {"expired": 3, "too_large": 1}
    human = support.run_cli(db_url, "status").stdout
    assert "backlog: 6 staged job(s) (1 delayed)" in human
    assert "dead letters: expired 3, too_large 1" in human
    assert "backfill.x" in human


# -- issue 24, item 6: the operator's paths -------------------------------------------------


def test_list_shows_a_5000_digit_integer_as_the_databases_json(db_url: str) -> None:
    """Before: exit 1, "ValueError: Exceeds the limit (4300 digits) for integer string
    conversion", until the row was purged."""
    big = "9" * 5000
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, priority, "
            "staged_at, reason, detail) VALUES (1, gen_random_uuid(), 't.big', %s::jsonb, "
            "'{}', 'celery', 0, now(), 'invalid', 'too long an integer')", (f"[{big}]",))
    listed = support.run_cli(db_url, "dead", "list")
    assert listed.returncode == 0, listed.stderr
    assert "t.big" in listed.stdout
    as_json = support.run_cli(db_url, "dead", "list", "--json")
    assert as_json.returncode == 0, as_json.stderr
    [line] = as_json.stdout.splitlines()
    assert f'"args": [{big}]' in line and '"task_name": "t.big"' in line


def test_requeue_refuses_jobs_that_expired_before_they_were_due(db_url: str) -> None:
    """Before: "requeued 1 job(s)", and the job expired again at once."""
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, priority, "
            "not_before, expires_at, staged_at, reason) VALUES (1, gen_random_uuid(), "
            "'t.late', '[]', '{}', 'celery', 0, now() - interval '1 hour', "
            "now() - interval '2 hours', now() - interval '3 hours', 'expired')")
    refused = support.run_cli(db_url, "dead", "requeue", "--yes")
    assert refused.returncode == 2, refused.stderr
    assert "expired at or before they were due" in refused.stderr
    assert "--expires-in" in refused.stderr
    assert support.staged_count(db_url) == 0
    done = support.run_cli(db_url, "dead", "requeue", "--yes", "--expires-in", "1h")
    assert done.returncode == 0, done.stderr
    assert "requeued 1 job(s)" in done.stdout
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT expires_at > now() + interval '59 minutes' "
                           "FROM staged_jobs").fetchone()
    assert row == (True,)


def test_requeue_refuses_an_expiry_beyond_the_brokers_limit(db_url: str) -> None:
    """Before: requeued with an expiry RabbitMQ refuses (406)."""
    _bury(db_url)
    refused = support.run_cli(db_url, "dead", "requeue", "--reason", "too_large",
                              "--expires-in", "3651d", "--yes")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith("drain: error: --expires-in is more than 3,650 days")
    assert refused.stderr.count("\n") == 1
    assert support.staged_count(db_url) == 0
    done = support.run_cli(db_url, "dead", "requeue", "--reason", "too_large",
                           "--expires-in", "3649d", "--yes")
    assert done.returncode == 0, done.stderr
    assert support.staged_count(db_url) == 1


@pytest.mark.parametrize("args", [
    ("stage", "t.x"), ("dead", "list"), ("dead", "requeue", "--yes"),
    ("dead", "purge", "--older-than", "0s", "--yes", "--why", "x"),
    ("processed", "purge", "--older-than", "1d"),
    ("status",), ("pause", "--queue", "q", "--why", "x"), ("resume", "--task", "t"),
    ("pauses",), ("audit",), ("show", "00000000-0000-0000-0000-000000000001"),
    ("staged", "list"),
])
def test_a_missing_schema_says_run_drain_migrate(empty_db_url: str, args: tuple[str, ...]) -> None:
    """Before: a raw UndefinedTable and exit 1, for all but status."""
    ran = support.run_cli(empty_db_url, *args)
    assert ran.returncode == 4, ran.stderr
    assert "run `drain migrate`" in ran.stderr and "UndefinedTable" not in ran.stderr


def test_status_names_the_database_it_read_and_no_url_is_refused(db_url: str) -> None:
    status = support.run_cli(db_url, "status")
    assert status.returncode == 0, status.stderr
    database = db_url.rsplit("/", 1)[1]
    assert status.stdout.splitlines()[0] == (
        f"database: postgresql://{roles.RUNNER}@127.0.0.1:{support.PG_PORT}/{database}")
    env = support.drain_env(db_url)
    del env["DRAIN_DATABASE_URL"]
    for args in (("status",), ("migrate",), ("dead", "list")):
        ran = support.run_cli(db_url, *args, env=env)
        assert ran.returncode == 2, ran.stderr
        assert "no database given" in ran.stderr


def test_infinite_and_bc_times_are_read_by_every_command(db_url: str) -> None:
    """Rows staged by plain SQL with times Python cannot hold. Before: `drain dead list
    --json` crashed on a staged_at of 'infinity' (timestamp too large), `drain status`
    failed on a not_before of 'infinity' (cannot subtract infinite timestamps), and
    `drain dead requeue` failed the same way on an 'infinity' expiry."""
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, priority, "
            "not_before, expires_at, staged_at, reason, detail) VALUES (1, gen_random_uuid(), "
            "'t.inf', '[]', '{}', 'celery', 0, '-infinity', 'infinity', 'infinity', 'invalid', "
            "'expires_at ''infinity'' cannot be read')")
        conn.execute("INSERT INTO staged_jobs (task_name, not_before, staged_at) VALUES "
                     "('t.never', 'infinity', '0044-03-15 BC'), ('t.due', '-infinity', now())")
    listed = support.run_cli(db_url, "dead", "list")
    assert listed.returncode == 0 and "t.inf" in listed.stdout, listed
    as_json = support.run_cli(db_url, "dead", "list", "--json")
    assert as_json.returncode == 0, as_json
    assert json.loads(as_json.stdout)["staged_at"] == "infinity"
    status = support.run_cli(db_url, "status")
    assert status.returncode == 0, status
    refused = support.run_cli(db_url, "dead", "requeue", "--yes")
    assert refused.returncode == 2 and "infinite expiry" in refused.stderr, refused
    assert "--expires-in" in refused.stderr
    done = support.run_cli(db_url, "dead", "requeue", "--yes", "--expires-in", "1h")
    assert done.returncode == 0 and "requeued 1 job(s)" in done.stdout, done


def _terminal(db_url: str, *args: str) -> support.Terminal:
    """``drain ARGS`` at a terminal (so it asks), as the operator."""
    return support.Terminal(support.drain_argv(*args), support.drain_env(db_url, roles.OPERATOR))


def _bury_more(db_url: str, count: int) -> None:
    """``count`` more dead jobs of mail.send, as a running drain expiring them would."""
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, priority, "
            "staged_at, reason) SELECT 1000 + g, gen_random_uuid(), 'mail.send', '[]', '{}', "
            "'celery', 0, now(), 'expired' FROM generate_series(1, %s) g", (count,))


def _open_transactions(db_url: str) -> int:
    """Sessions of the operator's role idle in a transaction."""
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = %s "
                           "AND state LIKE 'idle in transaction%%'", (roles.OPERATOR,)
                           ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.parametrize("action", ["requeue", "purge"])
def test_what_the_operator_confirms_is_exactly_what_is_moved(db_url: str, action: str) -> None:
    """Issue 36, item 4: the prompt said "2 dead job(s) match", the drain expired 50
    more while it was open, and answering y moved 52. Now the 2 shown are moved
    and the 50 stay; and the prompt holds no transaction open on dead_jobs."""
    task_ids = _bury(db_url)
    args = ["dead", action, "--task", "mail.send"] + (
        ["--older-than", "0s", "--why", "x"] if action == "purge" else [])
    term = _terminal(db_url, *args)
    try:
        support.wait_for(lambda: "them? [y/N]" in term.read(), 30, "the question")
        assert "2 dead job(s) match (task=mail.send" in term.read()
        assert _open_transactions(db_url) == 0, "a transaction open while asking"
        _bury_more(db_url, 50)
        term.answer("y")
        code, out = term.finish()
    finally:
        term.close()
    assert code == 0, out
    assert ("requeued 2 job(s)" if action == "requeue" else "purged 2 dead job(s)") in out
    with psycopg.connect(db_url) as conn:
        left = conn.execute("SELECT count(*) FROM dead_jobs WHERE task_name = 'mail.send'"
                            ).fetchone()
        staged = {r[0] for r in conn.execute("SELECT task_id::text FROM staged_jobs")}
    assert left == (50,)
    assert staged == ({task_ids[1], task_ids[2]} if action == "requeue" else set())


def test_shown_jobs_gone_meanwhile_move_nothing_and_say_so(db_url: str) -> None:
    """One of the two shown was purged by someone else while the question was open:
    the requeue moves neither, in one line, and exits non-zero."""
    _bury(db_url)
    term = _terminal(db_url, "dead", "requeue", "--task", "mail.send")
    try:
        support.wait_for(lambda: "them? [y/N]" in term.read(), 30, "the question")
        with psycopg.connect(db_url) as conn:
            conn.execute("DELETE FROM dead_jobs WHERE id = 1")
        term.answer("y")
        code, out = term.finish()
    finally:
        term.close()
    assert code == 1, out
    assert ("drain: error: 2 dead job(s) were shown, 1 match now (moved or removed "
            "meanwhile): nothing was requeued") in out
    assert support.staged_count(db_url) == 0


def test_an_action_whose_audit_row_cannot_be_written_does_nothing(db_url: str) -> None:
    """An action and its drain_audit row commit together: with the operator role
    refused the audit (its INSERT revoked in this database only), the purge, the
    requeue and the pause each fail with exit 5 and change nothing."""
    _bury(db_url)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(f"REVOKE INSERT ON drain_audit FROM {roles.prefix_of(db_url)}operator")
    for args in (("dead", "purge", "--older-than", "0s", "--yes", "--why", "x"),
                 ("dead", "requeue", "--yes"),
                 ("pause", "--queue", "q", "--why", "x")):
        ran = support.run_cli(db_url, *args)
        assert ran.returncode == 5, (args, ran.stderr)
        assert "permission denied for table drain_audit" in ran.stderr, args
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM dead_jobs").fetchone() == (len(DEAD_ROWS),)
        assert conn.execute("SELECT count(*) FROM staged_jobs").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM drain_pauses").fetchone() == (0,)


def _bury_many(db_url: str, n: int, reason: str = "invalid") -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, priority, "
            "staged_at, reason) SELECT -g, gen_random_uuid(), 'bulk.job', '[1]', '{}', 'celery', "
            "0, now(), %s FROM generate_series(1, %s) g", (reason, n))


def test_a_dry_run_binds_the_action_to_its_filters_and_count_and_it_runs_in_chunks(
    db_url: str,
) -> None:
    """Issue 39, bulk by filter: the dry run counts and prints a token; the action with
    --confirm moves exactly those (not the ones dead-lettered since), a chunk per
    transaction with its audit row and its progress, under a hard limit."""
    _bury_many(db_url, 25)
    dry = support.run_cli(db_url, "dead", "requeue", "--reason", "invalid", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[:2] == [
        "25 dead job(s) match (reason=invalid)",
        "each keeps its task id: a worker that dedupes by task id (drain.consumer) skips one "
        "it already processed"]
    token = dry.stdout.split("--confirm ")[1].strip()
    assert support.staged_count(db_url) == 0  # a dry run moves nothing
    _bury_many(db_url, 5)  # dead-lettered after the dry run: left alone

    # The token is bound to its action, its filters and its options.
    for args in (("dead", "purge", "--older-than", "0s", "--reason", "invalid", "--why", "x"),
                 ("dead", "requeue"), ("dead", "requeue", "--reason", "invalid",
                                       "--new-task-id")):
        refused = support.run_cli(db_url, *args, "--confirm", token)
        assert refused.returncode == 2, (args, refused.stdout, refused.stderr)
        assert "was not made by `--dry-run`" in refused.stderr
    limited = support.run_cli(db_url, "dead", "requeue", "--reason", "invalid",
                              "--confirm", token, "--max", "24")
    assert limited.returncode == 2 and "more than --max 24" in limited.stderr

    done = support.run_cli(db_url, "dead", "requeue", "--reason", "invalid", "--confirm", token,
                           "--chunk", "10", "--why", "consumer fixed")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[2:] == [
        "requeued 10 of 25 job(s)", "requeued 20 of 25 job(s)", "requeued 25 of 25 job(s)"]
    assert support.staged_count(db_url) == 25
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM dead_jobs").fetchone() == (5,)
        audited = conn.execute("SELECT action, count, reason FROM drain_audit ORDER BY id"
                               ).fetchall()
    assert audited == [("requeue", 10, "consumer fixed"), ("requeue", 10, "consumer fixed"),
                       ("requeue", 5, "consumer fixed")]
    # Used again, it no longer matches what it counted: nothing is done.
    again = support.run_cli(db_url, "dead", "requeue", "--reason", "invalid", "--confirm", token)
    assert again.returncode == 1 and "were shown" in again.stderr, again.stderr


def test_requeue_with_new_task_ids_says_so_and_records_it(db_url: str) -> None:
    task_ids = set(_bury(db_url).values())
    done = support.run_cli(db_url, "dead", "requeue", "--task", "mail.send", "--new-task-id",
                           "--yes")
    assert done.returncode == 0, done.stderr
    assert "each gets a new task id: it runs again, even where it already ran" in done.stdout
    with psycopg.connect(db_url) as conn:
        staged = {str(r[0]) for r in conn.execute("SELECT task_id FROM staged_jobs")}
        [(target,)] = conn.execute("SELECT target FROM drain_audit").fetchall()
    assert len(staged) == 2 and not staged & task_ids
    assert target["new_task_ids"] is True and target["task"] == "mail.send"

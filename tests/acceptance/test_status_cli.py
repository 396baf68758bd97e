"""`drain status`: --json fields, the oldest open transaction, --watch (subprocesses)."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
from typing import Any

import psycopg

import drain
from tests import roles, support


def _stage_mix(db_url: str) -> None:
    """5 ready jobs, 2 delayed by an hour, 1 that became due an hour ago; 2 dead letters."""
    an_hour_ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
    with psycopg.connect(db_url) as conn:
        drain.stage_many(conn, [drain.Job("search.index", [i], tag="api.x") for i in range(5)]
                         + [drain.Job("mail.send", [i], queue="mail", countdown=3600)
                            for i in range(2)]
                         + [drain.Job("mail.send", [9], queue="mail", eta=an_hour_ago)])
        conn.execute(
            "INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, priority, "
            "staged_at, reason) SELECT -g, gen_random_uuid(), 'x.y', '[]', '{}', 'celery', 0, "
            "now(), 'invalid' FROM generate_series(1, 2) g"
        )


def test_status_json_reports_backlog_waits_and_the_oldest_transaction(db_url: str) -> None:
    _stage_mix(db_url)
    result = support.run_cli(db_url, "status", "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["backlog"] == 8 and status["delayed"] == 2
    assert status["backlog_estimated"] is False and status["sample"] is None
    # The oldest due row became due an hour ago; the delayed ones are not waiting.
    assert 3600 <= status["oldest_age_seconds"] < 3600 + 120
    assert status["group_count"] == 2
    groups = {(g["queue"], g["tag"], g["task"]): g for g in status["by_group"]}
    # Staged without a queue: null (the drain routes them with --app, else to celery).
    assert groups.keys() == {(None, "api.x", "search.index"), ("mail", None, "mail.send")}
    mail = groups[("mail", None, "mail.send")]
    assert (mail["count"], mail["delayed"]) == (3, 2) and mail["oldest_age_seconds"] >= 3600
    ready = groups[(None, "api.x", "search.index")]
    assert (ready["count"], ready["delayed"]) == (5, 0)
    assert 0 <= ready["oldest_age_seconds"] < 120
    assert status["dead_by_reason"] == {"invalid": 2}
    assert isinstance(status["dead_tuples"], int)
    assert status["oldest_transaction"] is None  # only `drain status`'s own, left out
    assert status["lock"] == {"key": status["lock"]["key"], "held": False}
    assert status["lanes"] == {}

    # A session that wrote and stays idle in its transaction: the MVCC trap's cause.
    with psycopg.connect(db_url, application_name="forgotten psql") as idle:
        idle.execute("INSERT INTO drain_processed (task_id) VALUES (gen_random_uuid())")
        opened = idle.execute("SELECT now()").fetchone()
        status = json.loads(support.run_cli(db_url, "status", "--json").stdout)
        oldest = status["oldest_transaction"]
        assert oldest["pid"] == idle.info.backend_pid
        assert oldest["state"] == "idle in transaction"
        assert oldest["application_name"] == "forgotten psql"
        assert oldest["blocks_vacuum"] is True
        assert opened is not None and dt.datetime.fromisoformat(oldest["since"]) == opened[0]
        assert oldest["age_seconds"] >= 0
        human = support.run_cli(db_url, "status")
        assert human.returncode == 0, human.stderr
        line = next(x for x in human.stdout.splitlines() if x.startswith("oldest transaction:"))
        assert f"pid {idle.info.backend_pid}" in line and "forgotten psql" in line
        assert "holds back vacuum" in line
        idle.rollback()
    assert "backlog: 8 staged job(s) (2 delayed), oldest 1h00m old" in human.stdout
    assert "dead letters: invalid 2" in human.stdout


def test_status_of_a_running_drain_names_the_holder(db_url: str, spawn: Any) -> None:
    runner = spawn(support.drain_argv("run", "--metrics-port", "0"), support.drain_env(db_url),
                   "drain")
    runner.wait_for_output("active: took the drain lock", timeout=30)
    status = json.loads(support.run_cli(db_url, "status", "--json").stdout)
    lock = status["lock"]
    assert lock["held"] and lock["pid"] == runner.pid and lock["host"]
    assert dt.datetime.fromisoformat(lock["since"]) <= dt.datetime.now(dt.timezone.utc)
    human = support.run_cli(db_url, "status").stdout
    assert f"drain: active, pid {runner.pid} on {lock['host']} since {lock['since']}" in human


def _blocks(text: str) -> list[str]:
    return [b for b in text.split("\n\ndrain status at ") if b.strip()]


def test_status_watch_prints_a_block_per_refresh_until_interrupted(
    db_url: str, spawn: Any
) -> None:
    support.stage_backlog(db_url, "celery", 3)
    watch = spawn(support.drain_argv("status", "--watch", "0.2"), support.drain_env(db_url),
                  "watch")
    support.wait_for(lambda: len(_blocks(watch.output())) >= 2, 30, "two refreshes")
    first = _blocks(watch.output())[0]
    assert first.startswith("drain status at ") and "(every 0.2s; Ctrl-C to quit)" in first
    assert "backlog: 3 staged job(s)" in first
    # Each refresh reads afresh: no snapshot or statistics kept from the first one.
    support.stage_backlog(db_url, "celery", 4)
    support.wait_for(lambda: "backlog: 7 staged job(s)" in watch.output(), 30,
                     "a refresh showing the new rows")
    assert "\x1b[" not in watch.output(), "no terminal control codes when not on a terminal"
    watch.kill(signal.SIGINT)
    assert watch.wait(10) == 0, watch.output()[-2000:]


def test_status_watch_json_prints_one_object_per_line(db_url: str, spawn: Any) -> None:
    support.stage_backlog(db_url, "celery", 2)
    watch = spawn(support.drain_argv("status", "--watch", "0.2", "--json"),
                  support.drain_env(db_url), "watch-json")

    def lines() -> list[dict[str, Any]]:
        complete = watch.output().split("\n")[:-1]  # the last line may be half-written
        return [json.loads(line) for line in complete if line]

    support.wait_for(lambda: len(lines()) >= 2, 30, "two JSON lines")
    assert all(s["backlog"] == 2 and "oldest_transaction" in s for s in lines())
    watch.kill(signal.SIGINT)
    assert watch.wait(10) == 0


def test_status_watch_rejects_a_bad_interval(db_url: str) -> None:
    result = support.run_cli(db_url, "status", "--watch", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "drain status: error: argument --watch: must be positive, got '0'")


def test_status_watch_redraws_on_a_terminal(db_url: str) -> None:
    support.stage_backlog(db_url, "celery", 1)
    term = support.Terminal(support.drain_argv("status", "--watch", "0.2"),
                            support.drain_env(db_url), stdin=False)
    try:
        support.wait_for(lambda: term.read().count("\x1b[H\x1b[J") >= 2, 30,
                         "two redraws on the terminal")
        assert "backlog: 1 staged job(s)" in term.read()
        os.killpg(term.proc.pid, signal.SIGINT)
        assert term.proc.wait(10) == 0
    finally:
        term.close()


def test_status_watch_keeps_going_while_the_database_is_unreachable(spawn: Any) -> None:
    url = f"postgresql://{roles.RUNNER}:hunter2@127.0.0.1:{support.free_port()}/x"
    watch = spawn(support.drain_argv("status", "--watch", "0.2"), support.drain_env(url),
                  "watch-down")
    support.wait_for(lambda: watch.output().count("unreachable") >= 2, 30,
                     "two refreshes reporting the database unreachable")
    assert "hunter2" not in watch.output() and f"{roles.RUNNER}:***@" in watch.output()
    watch.kill(signal.SIGINT)
    assert watch.wait(10) == 0


def test_status_watch_ends_on_ctrl_c_even_when_started_with_sigint_ignored(
    db_url: str, spawn: Any
) -> None:
    """A background job of a non-interactive shell starts with SIGINT ignored
    (and Python then installs no handler of its own); the watch takes it back."""
    argv = ["bash", "-c", 'trap "" INT; exec "$@"', "bash",
            *support.drain_argv("status", "--watch", "0.2")]
    watch = spawn(argv, support.drain_env(db_url), "watch-sigign")
    support.wait_for(lambda: watch.output().count("drain status at ") >= 2, 30, "two refreshes")
    watch.kill(signal.SIGINT)
    assert watch.wait(10) == 0

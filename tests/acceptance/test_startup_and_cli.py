"""Start-up against missing services, and what the CLI says when things are wrong."""

from __future__ import annotations

from typing import Any

import psycopg

import drain
from tests import roles, support


def _stage_one(db_url: str, queue: str) -> str:
    with psycopg.connect(db_url) as conn:
        return str(drain.stage(conn, "celery_app.record", [1], queue=queue))


def _published(queue: str, task_id: str) -> bool:
    return task_id in support.task_ids(support.drain_queue(queue, timeout=0.3))


def test_database_unreachable_at_start_then_appears(
    db_url: str, queue: str, spawn: Any
) -> None:
    port = support.free_port()
    dbname = db_url.rsplit("/", 1)[1]
    url = f"postgresql://{roles.RUNNER}:hunter2-db@127.0.0.1:{port}/{dbname}"
    proc = spawn(support.drain_argv("run"), support.drain_env(url), "drain")
    proc.wait_for_output("unreachable", timeout=30)
    proc.wait_for_output("retrying with backoff", timeout=30)
    proxy = support.TcpProxy(support.PG_PORT, port=port).start()
    try:
        task_id = _stage_one(db_url, queue)
        support.wait_for(lambda: _published(queue, task_id), 60,
                         "the job to be published once the database appeared")
    finally:
        # Stop the drain first: cutting its database under it would add a line.
        proc.stop()
        proxy.stop()
    out = proc.output()
    assert "hunter2-db" not in out
    assert out.count("unreachable") == 1, "one line per state change, not one per retry"
    assert "database connected" in out


def test_broker_unreachable_at_start_then_appears(
    db_url: str, queue: str, spawn: Any
) -> None:
    port = support.free_port()
    env = support.drain_env(db_url, DRAIN_BROKER_URL=support.broker_url(port))
    proc = spawn(support.drain_argv("run"), env, "drain")
    proc.wait_for_output("active: took the drain lock", timeout=30)
    proc.wait_for_output("broker at amqp://guest:***@127.0.0.1", timeout=30)
    task_id = _stage_one(db_url, queue)
    assert support.staged_count(db_url) == 1
    proxy = support.TcpProxy(support.BROKER_PORT, port=port).start()
    try:
        support.wait_for(lambda: _published(queue, task_id), 60,
                         "the job to be published once the broker appeared")
    finally:
        proc.stop()
        proxy.stop()
    out = proc.output()
    assert ":guest@" not in out
    assert "broker connected" in out
    assert support.staged_count(db_url) == 0


def test_schema_missing_is_one_line_and_exit_4(empty_db_url: str) -> None:
    result = support.run_cli(empty_db_url, "run")
    assert result.returncode == 4
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("drain: error: ")
    assert "run `drain migrate` first" in lines[-1]
    assert "Traceback" not in result.stderr


def test_migrate_then_run_works(empty_db_url: str) -> None:
    assert support.run_cli(empty_db_url, "migrate").returncode == 0
    assert support.run_cli(empty_db_url, "migrate").returncode == 0
    roles.ensure(empty_db_url)  # its own roles, granted to the tests' login roles
    result = support.run_cli(empty_db_url, "status", "--json")
    assert result.returncode == 0, result.stderr
    assert '"backlog": 0' in result.stdout


def test_bad_urls_are_usage_errors_without_secrets(db_url: str) -> None:
    env = support.drain_env(db_url, DRAIN_BROKER_URL="redis://user:s3cret@127.0.0.1:6379/0")
    result = support.run_cli(db_url, "run", env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "drain: error: broker URL redis://user:***@127.0.0.1:6379/0 must start with "
        "amqp:// or amqps://"
    ]
    env = support.drain_env("postgresql://u:s3cret@127.0.0.1:notaport/x")
    result = support.run_cli(db_url, "run", env=env)
    assert result.returncode == 2
    assert "s3cret" not in result.stderr and "malformed database URL" in result.stderr
    env = support.drain_env(db_url, DRAIN_BATCH_SIZE="lots")
    result = support.run_cli(db_url, "run", env=env)
    assert result.returncode == 2 and "DRAIN_" in result.stderr


def test_unreachable_database_for_one_shot_commands_exit_3(db_url: str) -> None:
    url = f"postgresql://{roles.RUNNER}:hunter2@127.0.0.1:{support.free_port()}/x"
    for args in (("status",), ("migrate",), ("stage", "t.x")):
        result = support.run_cli(url, *args)
        assert result.returncode == 3, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1
        assert "hunter2" not in result.stderr + result.stdout


def test_wrong_password_is_reported_without_it(db_url: str) -> None:
    # Trust auth accepts any password here; a missing role is the refusal we can provoke.
    url = db_url.replace("postgres@", "nosuchrole:hunter2@")
    result = support.run_cli(url, "status")
    assert result.returncode == 3
    assert "nosuchrole" in result.stderr and "hunter2" not in result.stderr


def test_stage_command(db_url: str) -> None:
    result = support.run_cli(db_url, "stage", "search.index_annotation", "--kwargs",
                             '{"annotation_id": 42}', "--queue", "q1")
    assert result.returncode == 0, result.stderr
    task_id = result.stdout.strip()
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT task_name, args, kwargs, queue FROM staged_jobs WHERE task_id = %s",
            (task_id,),
        ).fetchone()
    assert row == ("search.index_annotation", [], {"annotation_id": 42}, "q1")
    bad = support.run_cli(db_url, "stage", "t.x", "--args", "{not json")
    assert bad.returncode == 2 and "--args is not valid JSON" in bad.stderr
    assert support.staged_count(db_url) == 1


def test_help_names_every_environment_variable(db_url: str) -> None:
    result = support.run_cli(db_url, "run", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for var in ("DRAIN_DATABASE_URL", "DRAIN_BROKER_URL", "DRAIN_BATCH_SIZE",
                "DRAIN_POLL_INTERVAL", "DRAIN_LOCK_KEY", "DRAIN_CONFIRM_TIMEOUT",
                "DRAIN_QUEUE_DECLARE"):
        assert var in text, var


def test_refused_credentials_at_start_exit_3_without_secrets(db_url: str) -> None:
    url = db_url.replace("postgres@", "nosuchrole:hunter2@")
    result = support.run_cli(url, "run")
    assert result.returncode == 3
    assert result.stderr.strip().splitlines()[-1] == (
        f"drain: error: database {url.replace('hunter2', '***')} refused the connection: "
        'role "nosuchrole" does not exist'
    )
    env = support.drain_env(db_url, DRAIN_BROKER_URL=support.broker_url(password="wrong-pw"))
    result = support.run_cli(db_url, "run", env=env)
    assert result.returncode == 3
    assert result.stderr.strip().splitlines()[-1] == (
        f"drain: error: broker at {support.broker_url(password='***')} refused us: "
        "login refused (check the user name and password)"
    )
    assert "wrong-pw" not in result.stderr


def test_a_schema_without_the_wake_flag_is_reported_at_connect(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute("DROP SEQUENCE drain_wake CASCADE")  # and the trigger reading it
    result = support.run_cli(db_url, "run")
    assert result.returncode == 4
    assert "older drain schema (no wake flag" in result.stderr
    assert support.run_cli(db_url, "migrate").returncode == 0


def test_an_older_schema_is_reported_not_retried(db_url: str, queue: str) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute("DROP INDEX staged_jobs_ready_idx")
        conn.execute("ALTER TABLE staged_jobs DROP COLUMN priority")
    result = support.run_cli(db_url, "run")
    assert result.returncode == 4
    assert "older drain schema" in result.stderr and "run `drain migrate`" in result.stderr
    # ... and `drain migrate` brings it up to date.
    assert support.run_cli(db_url, "migrate").returncode == 0
    with psycopg.connect(db_url) as conn:
        drain.stage(conn, "t.x", priority=5, queue=queue)
    done = support.run_cli(db_url, "run", "--exit-when-empty")
    assert done.returncode == 0, done.stderr
    assert support.staged_count(db_url) == 0

"""`drain show TASK_ID` (issue 39, a job's detail): every column of each staged or
dead row of a task id, its trace id, why it died with the broker's reply, and the
message the drain publishes for it, routed as `drain run --app` routes it. Run as
the operator role (tests/roles.py), as a subprocess."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg

import drain
from tests import roles, routing_app, support

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_staged_job_in_full_with_the_message_it_gets(db_url: str) -> None:
    with psycopg.connect(roles.url(db_url, roles.STAGER)) as conn:
        task_id = drain.stage(conn, "billing.refund", [7], {"why": "dup"}, queue="billing",
                              tag="api.refund", expires=3600)
    with psycopg.connect(db_url) as conn:  # a trace context, as drain.stage() gives one
        conn.execute("UPDATE staged_jobs SET trace = %s", (json.dumps(
            {"traceparent": TRACEPARENT}),))
    ran = support.run_cli(db_url, "show", str(task_id))
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0] == f"staged job {task_id} (row id 1)"
    assert "  tag         api.refund" in lines
    assert "  trace_id    4bf92f3577b34da6a3ce929d0e0e4736" in lines
    assert "  the message: exchange '', routing key 'billing'" in lines

    [shown] = [json.loads(line) for line in support.run_cli(
        db_url, "show", str(task_id), "--json").stdout.splitlines()]
    headers = shown["message"]["headers"]
    assert shown["state"] == "staged" and shown["args"] == "[7]"
    assert headers["id"] == str(task_id) and headers["task"] == "billing.refund"
    assert headers["drain_tag"] == "api.refund" and headers["expires"]
    assert headers["traceparent"].split("-")[1] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert shown["message"]["properties"]["correlation_id"] == str(task_id)


def test_a_dead_job_says_why_and_routed_by_the_app(db_url: str) -> None:
    task_id = uuid.uuid4()
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, priority, staged_at, "
            "reason, detail) VALUES (5, %s, 'orders.process', '[1]', '{\"vip\": true}', 0, "
            "now(), 'refused', '404 NOT_FOUND - no exchange ''x''')", (task_id,))
    suffix = uuid.uuid4().hex[:8]
    env = support.drain_env(db_url) | {"ROUTING_APP_SUFFIX": suffix}
    ran = support.run_cli(db_url, "show", str(task_id), "--app", "tests.routing_app", env=env)
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0] == f"dead job {task_id} (row id 5)"
    assert "  reason      refused" in lines
    assert "  detail      404 NOT_FOUND - no exchange 'x'" in lines
    # The app's router sends orders.process with vip to its priority queue.
    priority = routing_app.names(suffix)["priority"]
    assert any(line.startswith("  the message once requeued: ") and repr(priority) in line
               for line in lines), lines


def test_an_unknown_task_id_and_a_malformed_one_are_one_line_each(db_url: str) -> None:
    missing = support.run_cli(db_url, "show", str(uuid.UUID(int=1)))
    assert missing.returncode == 2
    assert missing.stderr.strip() == (
        "drain: error: no staged or dead job has task id 00000000-0000-0000-0000-000000000001")
    bad = support.run_cli(db_url, "show", "42")
    assert bad.returncode == 2 and "not a task id (a UUID): '42'" in bad.stderr


def test_pause_pauses_status_resume_and_audit_as_the_operator_would(db_url: str) -> None:
    """The commands of docs/operations.md, "Pausing publishing", and what they say."""
    def cli(*args: str) -> str:
        ran = support.run_cli(db_url, *args)
        assert ran.returncode == 0, (args, ran.stderr)
        return ran.stdout

    unsaid = support.run_cli(db_url, "pause", "--queue", "emails")
    assert unsaid.returncode == 2 and "required: --why" in unsaid.stderr
    assert cli("pause", "--queue", "emails", "--why", "SMTP outage", "--actor", "ann") == (
        "paused queue 'emails': every drain leaves its jobs staged from its next batch "
        "(`drain resume --queue emails` ends it)\n")
    assert "is already paused" in cli("pause", "--queue", "emails", "--why", "again")
    assert cli("pauses").startswith("queue 'emails': paused since ")
    status = support.run_cli(db_url, "status")  # as the runner role
    assert status.returncode == 0, status.stderr
    assert ("PAUSED by an operator: queue 'emails' since" in status.stdout
            and "by ann: SMTP outage (`drain resume --queue emails`)" in status.stdout)
    assert cli("resume", "--queue", "emails", "--why", "back").startswith(
        "resumed queue 'emails' (paused since ")
    assert cli("resume", "--queue", "emails") == "queue 'emails' was not paused (nothing changed)\n"
    assert cli("pauses") == "nothing paused\n"
    audit = cli("audit").splitlines()
    assert [line.split()[3] for line in audit] == ["resume", "pause"]
    assert audit[1].endswith(f"by ann (role {roles.OPERATOR}): SMTP outage")
    assert [json.loads(line)["action"] for line in cli("audit", "--json",
                                                        "--action", "pause").splitlines()] == [
        "pause"]


REDACT = """
def redact(task_name, args, kwargs):
    return ["<hidden>"] * len(args), {key: "<hidden>" for key in kwargs}
"""


def test_redact_hides_the_arguments_in_every_part_that_shows_them(
    db_url: str, tmp_path: Path,
) -> None:
    (tmp_path / "ops_redact.py").write_text(REDACT)
    with psycopg.connect(roles.url(db_url, roles.STAGER)) as conn:
        task_id = drain.stage(conn, "mail.send", ["ann@example.com"], {"token": "s3cret"})
    env = support.drain_env(db_url) | {"PYTHONPATH": f"{tmp_path}:{support.ROOT}",
                                       "DRAIN_REDACT": "ops_redact:redact"}
    ran = support.run_cli(db_url, "show", str(task_id), "--json", env=env)
    assert ran.returncode == 0, ran.stderr
    assert "ann@example.com" not in ran.stdout and "s3cret" not in ran.stdout
    [shown] = [json.loads(line) for line in ran.stdout.splitlines()]
    assert shown["args"] == '["<hidden>"]'
    assert shown["message"]["headers"]["argsrepr"] == "['<hidden>']"
    with psycopg.connect(db_url) as conn:  # and dead: drain dead list --json
        conn.execute("INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, priority, "
                     "staged_at, reason) SELECT id, task_id, task_name, args, kwargs, 0, "
                     "staged_at, 'invalid' FROM staged_jobs")
    listed = support.run_cli(db_url, "dead", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert "ann@example.com" not in listed.stdout and '"<hidden>"' in listed.stdout
    bad = support.run_cli(db_url, "show", str(task_id), "--redact", "ops_redact:nothing",
                          env=env)
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("drain: error: --redact ops_redact:nothing: cannot")

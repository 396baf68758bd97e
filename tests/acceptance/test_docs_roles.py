"""The "Database roles" recipe of docs/running.md, end to end, never as a superuser.

The superuser only sets the stage as a DBA would: a database owned by a login
role that is no superuser (with CREATEROLE, as docs/running.md asks of the role
running `drain migrate`). Everything else runs what the docs show, taken from
their text by Sybil (tests/docs/blocks.py, which runs the other blocks and
marks this one as run here): `drain migrate` as that owner, the CREATE ROLE /
GRANT block as that owner (role names suffixed for this test, passwords filled
in), then each documented path as the role the docs give it:

* my_app stages by every path of docs/staging.md: the plain SQL (INSERT, and
  INSERT ... RETURNING task_id), the bulk SQL (INSERT ... SELECT and
  SELECT drain_stage(...)), and drain.stage() in Python;
* my_drain runs `drain run` twice (a leader and a standby), serves /metrics,
  and runs `drain status`;
* my_ops runs `drain stage`, `drain dead list|requeue|purge` and
  `drain processed purge`; my_worker claims a task id (drain.consumer);
* the owner runs `drain migrate` again while both drains run: neither exits,
  and a job staged after it is delivered; then the leader stops and the
  standby takes over and delivers.

Jobs are observed in RabbitMQ (queues of this test only: rows without a queue
go to the app's task_default_queue through --app).
"""

from __future__ import annotations

import re
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import drain
from drain import consumer
from tests import roles, support
from tests.docs import blocks

DOC_ROLES = ("my_app", "my_drain", "my_ops", "my_worker")
RUNNING = support.ROOT / "docs" / "running.md"
STAGING = support.ROOT / "docs" / "staging.md"


def docs_sql(path: Path, after: str) -> str:
    """The first sql block of ``path`` after the text ``after``, as Sybil reads it
    (tests/docs/blocks.py, which runs the other blocks of the docs)."""
    return blocks.block_after(path, after, "sql")


class Setup:
    def __init__(self, suffix: str, tmp_path: Path) -> None:
        self.suffix = suffix
        self.db = f"drain_readme_{suffix}"
        self.owner = f"readme_owner_{suffix}"
        self.queue = f"readme_{suffix}"  # the app's task_default_queue
        self.mail = f"readme_mail_{suffix}"  # the staging page's 'mail' queue, for this test
        self.password = uuid.uuid4().hex
        self.app_dir = tmp_path

    def role(self, doc_name: str) -> str:
        return doc_name if doc_name not in DOC_ROLES else f"{doc_name}_{self.suffix}"

    def url(self, doc_name: str) -> str:
        user = self.owner if doc_name == "owner" else self.role(doc_name)
        return f"postgresql://{user}:{self.password}@127.0.0.1:{support.PG_PORT}/{self.db}"

    def env(self, doc_name: str, **extra: str) -> dict[str, str]:
        env = support.drain_env(self.url(doc_name), roles.ADMIN, **extra)
        env["PYTHONPATH"] = f"{self.app_dir}:{env.get('PYTHONPATH', '')}"
        return env


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    s = Setup(uuid.uuid4().hex[:8], tmp_path)
    (tmp_path / "readme_app.py").write_text(
        "from celery import Celery\n"
        f"app = Celery('readme', broker={support.BROKER_URL!r})\n"
        f"app.conf.task_default_queue = {s.queue!r}\n"
        "def noop(*args, **kwargs):\n    return None\n"
        "for name in ('search.index_annotation', 'mail.send', 'ops.by_hand', 't.after'):\n"
        "    app.task(name=name)(noop)\n")
    with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE \"{s.owner}\" LOGIN CREATEROLE PASSWORD '{s.password}'")
        admin.execute(f'CREATE DATABASE "{s.db}" OWNER "{s.owner}"')
    try:
        yield s
    finally:
        with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{s.db}" WITH (FORCE)')
            for name in (*DOC_ROLES, "owner"):
                role = s.owner if name == "owner" else s.role(name)
                admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        for queue in (s.queue, s.mail):
            support.delete_queue(queue)


def _ok(ran: Any) -> str:
    assert ran.returncode == 0, ran.stderr
    return str(ran.stdout)


def test_the_docs_roles_recipe(
    setup: Setup, spawn: Callable[..., support.Process]
) -> None:
    s = setup
    cli = support.run_cli
    # `drain migrate` as the owner, then the roles block of docs/running.md as the owner.
    migrated = cli(s.url("owner"), "migrate", env=s.env("owner"))
    assert migrated.returncode == 0, migrated.stderr
    # The docs name the roles of a database named app; this one's are named after it.
    prefix = f"{s.db}_drain_"
    assert f"its roles: {prefix}stager, {prefix}runner, {prefix}operator, {prefix}consumer" in (
        migrated.stderr)
    roles_sql = docs_sql(RUNNING, "## Database roles").replace("app_drain_", prefix)
    for name in DOC_ROLES:
        roles_sql = re.sub(rf"\b{name}\b", s.role(name), roles_sql)
    with psycopg.connect(s.url("owner"), autocommit=True) as owner:
        assert not owner.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
                                 ).fetchone()[0]  # type: ignore[index]
        owner.execute(roles_sql.replace("'...'", f"'{s.password}'"))
        owner.execute("CREATE TABLE annotation (id int PRIMARY KEY, user_id int)")
        owner.execute("INSERT INTO annotation SELECT g, 42 FROM generate_series(1, 3) g")
        owner.execute(f'GRANT SELECT ON annotation TO "{s.role("my_app")}"')

    # my_app stages by every documented path.
    plain = docs_sql(STAGING, "From plain SQL:").replace("'mail'", f"'{s.mail}'")
    bulk = docs_sql(STAGING, "## Bulk staging in SQL")
    with psycopg.connect(s.url("my_app")) as app:
        for statement in filter(str.strip, re.sub(r"--.*", "", plain).split(";")):
            cur = app.execute(statement)
        returned = cur.fetchone()  # RETURNING task_id
        assert returned is not None and isinstance(returned[0], uuid.UUID)
        for statement in filter(str.strip, re.sub(r"--.*", "", bulk).split(";")):
            app.execute(statement)
        drain.stage(app, "search.index_annotation", kwargs={"annotation_id": 42})
    to_default_queue = 1 + 3 + 3 + 1  # the plain SQL's first INSERT, bulk, drain.stage()
    # my_ops stages by hand, and an unknown task (dead-lettered as unknown_task).
    ops = s.env("my_ops")
    _ok(cli(s.url("my_ops"), "stage", "ops.by_hand", env=ops))
    _ok(cli(s.url("my_ops"), "stage", "ops.unknown", env=ops))

    # my_drain: a leader and a standby, with /metrics; `drain status`.
    ports = [support.free_port(), support.free_port()]
    drains = [spawn(support.drain_argv("run", "--app", "readme_app", "--poll-interval", "0.2"),
                    s.env("my_drain", DRAIN_METRICS_PORT=str(port),
                          DRAIN_METRICS_INTERVAL="0.5"), f"drain{i}")
              for i, port in enumerate(ports)]
    support.wait_for(lambda: all("active: took" in d.output() or "standby: another" in d.output()
                                 for d in drains), 60, "a leader and a standby")
    drains.sort(key=lambda d: "standby: another" in d.output())  # the leader first
    assert "standby: another" in drains[1].output(), drains[1].output()[-2000:]
    support.wait_for(lambda: _count(s, "staged_jobs") == 0, 60, "the backlog delivered")
    # ... and `drain stage ops.by_hand`
    assert len(support.drain_queue(s.queue)) == to_default_queue + 1
    assert len(support.drain_queue(s.mail)) == 1  # the staging page's INSERT with queue 'mail'
    support.wait_for(lambda: 'drain_dead_jobs_rows{reason="unknown_task"} 1.0' in support.http_get(
        ports[1], "/metrics")[1], 30, "the dead job in /metrics")
    shown = _ok(cli(s.url("my_drain"), "status", env=s.env("my_drain")))
    assert (f"database: postgresql://{s.role('my_drain')}@127.0.0.1:{support.PG_PORT}/{s.db}"
            in shown)
    assert "unknown_task 1" in shown

    # my_ops: the dead-letter commands; my_worker: the consumers' record.
    assert "ops.unknown" in _ok(cli(s.url("my_ops"), "dead", "list", env=ops))
    assert "requeued 1 job(s)" in _ok(cli(s.url("my_ops"), "dead", "requeue", "--task",
                                          "ops.unknown", "--yes", env=ops))
    support.wait_for(lambda: _count(s, "dead_jobs") == 1, 60, "the unknown task dead again")
    assert "purged 1 dead job(s)" in _ok(cli(s.url("my_ops"), "dead", "purge",
                                             "--older-than", "0s", "--yes", "--why",
                                             "the unknown task is gone for good", env=ops))
    assert "paused queue" in _ok(cli(s.url("my_ops"), "pause", "--queue", "ops.q", "--why",
                                     "a test", env=ops))
    assert "purge " in _ok(cli(s.url("my_ops"), "audit", env=ops))
    with psycopg.connect(s.url("my_worker")) as worker:
        assert consumer.claim(worker, uuid.uuid4())
    assert "purged 0 processed" in _ok(cli(s.url("my_ops"), "processed", "purge",
                                           "--older-than", "1d", env=ops))

    # A live `drain migrate` by the owner: neither drain exits, and a job staged
    # after it is delivered; then by the standby, once the leader stopped.
    _ok(cli(s.url("owner"), "migrate", env=s.env("owner")))
    _deliver_one(s)
    assert [d.proc.poll() for d in drains] == [None, None]
    drains[0].kill(signal.SIGTERM)
    assert drains[0].wait(30) == 0
    drains[1].wait_for_output("active: took the drain lock", timeout=60)
    _deliver_one(s)
    assert drains[1].proc.poll() is None
    for d in drains:
        assert "permission denied" not in d.output(), d.output()[-3000:]


def _deliver_one(s: Setup) -> None:
    with psycopg.connect(s.url("my_app")) as app:
        task_id = str(drain.stage(app, "t.after"))
    support.wait_for(lambda: task_id in support.task_ids(support.drain_queue(s.queue, 0.3)),
                     60, "the job staged after the migrate in RabbitMQ")


def _count(s: Setup, table: str) -> int:
    with psycopg.connect(s.url("owner")) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        return int(row[0]) if row else 0

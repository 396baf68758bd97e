"""drain's pytest plugin (drain/pytest_plugin.py), as a user's test suite uses it.

Each test writes a user's tests into pytester's directory and runs pytest on
them, in this process, against this test's own database and queue: the
staged_jobs assertions (what they say when they fail), drain_jobs.publish()
through the real drain to RabbitMQ, drain_jobs.run_eagerly() with a small
Celery app, inside a Django test transaction too, and docs/testing.md's example.
tests/package/test_wheel.py checks that installing the wheel is all a project
needs for the fixtures (the pytest11 entry point).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import textwrap

import pytest

from tests import support

pytest_plugins = ["pytester"]


def _run(pytester: pytest.Pytester, *args: str, subprocess: bool = False) -> pytest.RunResult:
    """pytest on pytester's directory; the plugin as the entry point loads it, or by
    name where drain is installed from a tree that predates the entry point."""
    registered = importlib.metadata.entry_points(group="pytest11", name="drain")
    plugin = () if registered else ("-p", "drain.pytest_plugin")
    run = pytester.runpytest_subprocess if subprocess else pytester.runpytest
    return run(*plugin, "-p", "no:cacheprovider", *args)


def _conftest(pytester: pytest.Pytester, db_url: str, extra: str = "") -> None:
    """The user's conftest: the test database and the broker as the drain_database_url
    and drain_broker_url fixtures, and every test starting from an empty staged_jobs."""
    pytester.makeconftest(f"""
        import pytest

        DB_URL = {db_url!r}
        BROKER_URL = {support.BROKER_URL!r}

        @pytest.fixture
        def drain_database_url():
            return DB_URL

        @pytest.fixture
        def drain_broker_url():
            return BROKER_URL

        @pytest.fixture(autouse=True)
        def _empty(staged_jobs):
            staged_jobs.clear()
        {textwrap.indent(textwrap.dedent(extra), " " * 8).strip()}
    """)


def test_assertions_pass_and_fail_saying_what_was_staged(
        pytester: pytest.Pytester, db_url: str) -> None:
    _conftest(pytester, db_url)
    pytester.makepyfile(test_user="""
        import datetime as dt
        import decimal

        import drain
        import pytest

        WHEN = dt.datetime(2036, 1, 2, 3, 4, 5, 678901, tzinfo=dt.timezone.utc)

        def test_staged(drain_connection, staged_jobs):
            task_id = drain.stage(drain_connection, "app.send_welcome", [7, WHEN],
                                  {"amount": decimal.Decimal("1.50")}, queue="mail",
                                  priority=3, tag="signup", eta=WHEN)
            job = staged_jobs.assert_staged(
                "app.send_welcome", args=(7, WHEN), kwargs={"amount": decimal.Decimal("1.50")},
                queue="mail", priority=3, tag="signup", eta=WHEN, task_id=str(task_id))
            assert job.task_id == task_id and not job.due
            staged_jobs.assert_staged("app.send_welcome")
            assert len(staged_jobs) == 1
            with pytest.raises(TypeError, match="unknown option.s. countdown: compare queue"):
                staged_jobs.find("app.send_welcome", countdown=60)

        def test_wrong_args(drain_connection, staged_jobs):
            drain.stage(drain_connection, "app.send_welcome", [7], {"lang": "en"}, queue="mail")
            staged_jobs.assert_staged("app.send_welcome", args=[8])

        def test_wrong_queue(drain_connection, staged_jobs):
            drain.stage(drain_connection, "app.send_welcome", [7], queue="mail")
            staged_jobs.assert_staged("app.send_welcome", queue="email")

        def test_nothing_staged(drain_connection, staged_jobs):
            drain.stage(drain_connection, "app.audit", [1], tag="admin")
            staged_jobs.assert_nothing_staged()

        def test_capture(drain_connection, staged_jobs):
            drain.stage(drain_connection, "app.before", [1])
            with staged_jobs.capture() as staged:
                drain.stage(drain_connection, "app.inside", [2])
            drain.stage(drain_connection, "app.after", [3])
            assert [job.task_name for job in staged.all()] == ["app.inside"]
            assert [job.task_name for job in staged_jobs.find(args=[3])] == ["app.after"]
            assert staged.clear() == 1 and len(staged_jobs) == 2

        def test_capture_sees_only_its_block(drain_connection, staged_jobs):
            drain.stage(drain_connection, "app.before", [1])
            with staged_jobs.capture() as staged:
                pass
            staged.assert_staged("app.before")
    """)
    result = _run(pytester)
    result.assert_outcomes(passed=2, failed=4)
    _said_in_order(result, [
        "E   AssertionError: no staged job matches app.send_welcome(args=[8])",
        "E   staged instead (1 job):",
        "E     app.send_welcome(args=[7], kwargs={'lang': 'en'}, queue='mail')",
    ], [
        "E   AssertionError: no staged job matches app.send_welcome(queue='email')",
        "E   staged instead (1 job):",
        "E     app.send_welcome(args=[7], kwargs={}, queue='mail')",
    ], [
        "E   AssertionError: expected no staged job",
        "E   staged (1 job):",
        "E     app.audit(args=[1], kwargs={}, tag='admin')",
    ], [
        "E   AssertionError: no staged job matches app.before()",
        "E   nothing is staged",
    ])


def _said_in_order(result: pytest.RunResult, *messages: list[str]) -> None:
    """Each message's lines appear one after another in the output (spaces after
    pytest's ``E`` squeezed)."""
    lines = [" ".join(line.split()) for line in result.outlines]
    for message in messages:
        want = [" ".join(line.split()) for line in message]
        assert any(lines[i:i + len(want)] == want for i in range(len(lines))), (
            "\n".join(message) + "\n  not in:\n" + result.stdout.str())


def test_without_a_database_the_fixtures_say_what_to_give(
        pytester: pytest.Pytester, db_url: str) -> None:
    pytester.makepyfile(test_user="""
        import drain

        def test_staged(staged_jobs):
            staged_jobs.assert_nothing_staged()

        def test_ini(drain_connection, staged_jobs):
            drain.stage(drain_connection, "app.x", [1])
            staged_jobs.assert_staged("app.x", args=[1])
            staged_jobs.clear()
    """)
    result = _run(pytester, "-k", "test_staged")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*drain's fixtures need the connection your code stages on: "
                                 "override the drain_connection fixture*"])
    # The same database given as the ini option instead.
    _run(pytester, "-o", f"drain_database_url={db_url}").assert_outcomes(passed=2)


def test_publish_through_the_drain_to_rabbitmq(
        pytester: pytest.Pytester, db_url: str, queue: str) -> None:
    _conftest(pytester, db_url)
    pytester.makepyfile(test_user=f"""
        import drain

        def test_publish(drain_connection, staged_jobs, drain_jobs):
            for i in (1, 2):
                drain.stage(drain_connection, "app.record", [i], queue={queue!r}, tag="t")
            drain.stage(drain_connection, "app.record", [3], queue={queue!r}, countdown=3600)
            drain.stage(drain_connection, "app.record", [4], queue={queue!r}, expires=-1)
            result = drain_jobs.publish()
            assert result.published == 2
            assert [(d.task_name, d.reason) for d in result.dead] == [("app.record", "expired")]
            assert [job.args for job in result.remaining] == [[3]]
            assert [job.args for job in staged_jobs] == [[3]]
    """)
    _run(pytester).assert_outcomes(passed=1)
    messages = support.drain_queue(queue)
    assert sorted(json.loads(body)[0][0] for _, _, body in messages) == [1, 2]
    assert {(p.headers["task"], p.headers["drain_tag"]) for _, p, _ in messages} == {
        ("app.record", "t")}


def test_publish_refuses_uncommitted_jobs_and_stops_at_an_outage(
        pytester: pytest.Pytester, db_url: str, queue: str) -> None:
    """On a connection of the user's own (its URL read off it), jobs staged in a
    transaction still open are seen by staged_jobs and refused by publish(); a
    broker that does not answer ends publish() with the drain's reason, its
    password masked, and the job stays staged."""
    _conftest(pytester, db_url, extra="""
        import psycopg

        @pytest.fixture
        def drain_database_url():
            return None

        @pytest.fixture
        def drain_connection():
            with psycopg.connect(DB_URL) as conn:
                yield conn
    """)
    port = support.free_port()
    pytester.makepyfile(test_user=f"""
        import drain
        import pytest
        from drain.testing import FixtureError

        def test_uncommitted(drain_connection, staged_jobs, drain_jobs):
            drain.stage(drain_connection, "app.record", [1], queue={queue!r})
            staged_jobs.assert_staged("app.record", args=[1])
            with pytest.raises(FixtureError, match="1 staged job.s. are not committed") as exc:
                drain_jobs.publish()
            assert "app.record(args=[1], kwargs={{}}, queue={queue!r})" in str(exc.value)
            drain_connection.commit()
            assert drain_jobs.publish().published == 1
            drain_connection.commit()
            drain.stage(drain_connection, "app.record", [3], queue={queue!r})
            drain_connection.commit()
            assert staged_jobs.clear() == 1
            with pytest.raises(FixtureError, match="1 committed job.s. are deleted in the test"):
                drain_jobs.publish()
            drain_connection.rollback()
            staged_jobs.assert_staged("app.record", args=[3])
            staged_jobs.clear()
            drain_connection.commit()

        def test_broker_down(drain_connection, staged_jobs, drain_jobs):
            drain.stage(drain_connection, "app.record", [2], queue={queue!r})
            drain_connection.commit()
            with pytest.raises(FixtureError, match="could not reach the broker") as exc:
                drain_jobs.publish(broker_url="amqp://guest:Sekr1tPassw0rd@127.0.0.1:{port}//")
            assert "Sekr1tPassw0rd" not in str(exc.value)
            staged_jobs.assert_staged("app.record", args=[2])
            drain_connection.commit()
    """)
    result = _run(pytester)
    result.assert_outcomes(passed=2)
    assert [json.loads(body)[0] for _, _, body in support.drain_queue(queue)] == [[1]]


def test_on_a_sqlalchemy_session(pytester: pytest.Pytester, db_url: str) -> None:
    """A SQLAlchemy Session as drain_connection: read and cleared in its transaction,
    and the URL publish() connects with read off its engine."""
    pytester.makeconftest(f"""
        import pytest
        import sqlalchemy
        from sqlalchemy.orm import Session

        @pytest.fixture
        def drain_connection():
            url = {db_url!r}.replace("postgresql://", "postgresql+psycopg://")
            engine = sqlalchemy.create_engine(url)
            with Session(engine) as session:
                yield session
                session.rollback()
            engine.dispose()
    """)
    pytester.makepyfile(test_user="""
        import drain
        import pytest
        from drain.testing import FixtureError

        def test_session(drain_connection, staged_jobs, drain_jobs):
            drain.stage(drain_connection, "app.record", [1], {"k": [1, 2]}, priority=-3)
            staged_jobs.assert_staged("app.record", args=[1], kwargs={"k": (1, 2)}, priority=-3)
            with pytest.raises(FixtureError, match="1 staged job.s. are not committed"):
                drain_jobs.publish()
            assert staged_jobs.clear() == 1
            staged_jobs.assert_nothing_staged()
    """)
    _run(pytester).assert_outcomes(passed=1)


_CELERY_APP = """
    import celery
    import drain

    app = celery.Celery("user_app", broker="memory://", set_as_current=False)
    ran = []
    staging = {}

    @app.task(name="app.record", shared=False)
    def record(x):
        ran.append(x)
        return x

    @app.task(name="app.add", shared=False)
    def add(x, y):
        ran.append(("add", x, y))
        return x + y

    @app.task(name="app.follow_up", shared=False)
    def follow_up(x):
        ran.append(("follow_up", x))
        drain.stage(staging["conn"], "app.record", [x * 10])

    @app.task(name="app.boom", shared=False)
    def boom():
        raise ValueError("boom")
"""


def test_run_eagerly_with_the_users_celery_app(pytester: pytest.Pytester, db_url: str) -> None:
    _conftest(pytester, db_url)
    pytester.makepyfile(user_app=_CELERY_APP)
    pytester.makepyfile(test_user="""
        import drain
        import pytest
        from drain.testing import FixtureError
        from user_app import add, app, boom, ran, record, staging

        @pytest.fixture(autouse=True)
        def _fresh(drain_connection):
            staging["conn"] = drain_connection
            ran.clear()

        def test_drain_order_and_what_tasks_stage(drain_connection, staged_jobs, drain_jobs):
            drain.stage(drain_connection, "app.record", ["low"], priority=-5)
            drain.stage(drain_connection, "app.record", ["later"], countdown=3600)
            drain.stage(drain_connection, "app.follow_up", [1])
            drain.stage(drain_connection, "app.record", ["high"], priority=5)
            drain.stage(drain_connection, add.s(1, 2) | record.s())
            drain.stage(drain_connection, add.s(2, 3).set(link=record.s()))
            drain.stage(drain_connection, "app.record", ["expired"], expires=-1)
            done = drain_jobs.run_eagerly(app)
            assert ran == ["high", ("follow_up", 1), ("add", 1, 2), 3, ("add", 2, 3), 5,
                           "low", "later", 10]
            assert [r.result.get() for r in done] == ["high", None, 3, 5, "low", "later", 10]
            assert [job.args for job in staged_jobs] == [["expired"]]
            assert not app.conf.task_always_eager

        def test_not_delayed(drain_connection, staged_jobs, drain_jobs):
            drain.stage(drain_connection, "app.record", ["later"], countdown=3600)
            drain.stage(drain_connection, "app.record", ["now"])
            drain_jobs.run_eagerly(app, delayed=False)
            assert ran == ["now"]
            staged_jobs.assert_staged("app.record", args=["later"])

        def test_failures(drain_connection, staged_jobs, drain_jobs):
            task_id = drain.stage(drain_connection, "app.boom")
            with pytest.raises(ValueError, match="boom"):
                drain_jobs.run_eagerly(app)
            staged_jobs.assert_staged(boom, task_id=task_id)
            [done] = drain_jobs.run_eagerly(app, propagate=False)
            assert done.result.failed() and done.result.id == str(task_id)
            staged_jobs.assert_nothing_staged()

        def test_unknown_task(drain_connection, staged_jobs, drain_jobs):
            drain.stage(drain_connection, "app.nope", [1])
            with pytest.raises(FixtureError, match="has no task 'app.nope'"):
                drain_jobs.run_eagerly(app)
            staged_jobs.assert_staged("app.nope")

        def test_a_task_that_stages_itself(drain_connection, drain_jobs):
            drain.stage(drain_connection, "app.follow_up", [1])
            drain.stage(drain_connection, "app.follow_up", [2])
            with pytest.raises(FixtureError, match="ran 3 staged jobs and more are staged"):
                drain_jobs.run_eagerly(app, limit=3)
    """)
    _run(pytester).assert_outcomes(passed=5)


def test_in_a_django_test_transaction(pytester: pytest.Pytester, django_db: str) -> None:
    """Django's connection inside the transaction a TestCase (or pytest-django's db
    fixture) wraps each test in: the jobs staged there are seen, run eagerly, and
    refused by publish(), whose URL is read off Django's settings."""
    pytester.makeconftest("""
        import pytest
        from django.db import connection, transaction

        @pytest.fixture
        def drain_connection():
            with transaction.atomic():
                yield connection
                transaction.set_rollback(True)
    """)
    pytester.makepyfile(user_app=_CELERY_APP)
    pytester.makepyfile(test_user="""
        import drain
        import pytest
        from drain.testing import FixtureError
        from user_app import app, ran

        def test_staged_in_the_test_transaction(drain_connection, staged_jobs, drain_jobs):
            staged_jobs.clear()
            drain.stage(drain_connection, "app.record", [42], queue="mail")
            staged_jobs.assert_staged("app.record", args=[42], queue="mail")
            with pytest.raises(FixtureError, match="TransactionTestCase"):
                drain_jobs.publish()
            drain_jobs.run_eagerly(app)
            assert ran == [42]
            staged_jobs.assert_nothing_staged()
    """)
    _run(pytester).assert_outcomes(passed=1)


def test_the_example_of_docs_testing_md(
        pytester: pytest.Pytester, db_url: str, queue: str) -> None:
    """docs/testing.md's complete example, as it is written there (the "mail" queue
    aside: this test's own), passes against a real Postgres and RabbitMQ, and its
    published job is in the queue."""
    files = _example_files((support.ROOT / "docs" / "testing.md").read_text("utf-8"))
    assert set(files) == {"tasks.py", "signup.py", "pytest.ini", "conftest.py",
                          "test_signup.py"}
    files["tasks.py"] = files["tasks.py"].replace('"mail"', repr(queue))
    for name, text in files.items():
        (pytester.path / name).write_text(text)
    # In a subprocess, as a user runs it: the example's tasks are Celery's shared kind,
    # which Celery adds to every app created later in the process (other tests' too).
    result = _run(pytester, "-o", f"drain_database_url={db_url}",
                  "-o", f"drain_broker_url={support.BROKER_URL}", subprocess=True)
    result.assert_outcomes(passed=4)
    assert [p.headers["task"] for _, p, _ in support.drain_queue(queue)] == [
        "mail.send_welcome"]


def _example_files(doc: str) -> dict[str, str]:
    """The fenced blocks of a doc whose first line names a file (``# tasks.py``)."""
    blocks = re.findall(r"^```(?:python|ini)\n# (\S+\.(?:py|ini))\n(.*?)^```", doc,
                        re.MULTILINE | re.DOTALL)
    return {name: body for name, body in blocks}

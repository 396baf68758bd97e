"""Application version x drain version x schema version: every cell works or refuses in
one line, and none fails the application's transaction (issue 38).

The previous release is 0.1.0 (tests/previous.py), built from git history; the
current one is this checkout. A schema is "previous" when only the previous
release's ``drain migrate`` ran on the database, "current" when this release's
ran after it (the upgrade a deployment makes). Each cell stages every way an
application can (tests/skew_app.py: ``stage()``, ``stage_many()``, a task's
``.stage()`` and ``.stage_with(link=...)``, both plain-SQL recipes), with and
without an OpenTelemetry span where the release captures one, in one
transaction with a row of the application's own; then runs that drain with
``--exit-when-empty`` and reads what it published.

What each cell must do (docs/running.md, "Upgrading"):

* every job delivered once, with its task id, task name, arguments and
  callback; its row deleted; the application's own row committed;
* the trace headers only where all three are current and a span was open;
* a current application on a previous schema drops the trace context and says
  so once (a log line), never failing the transaction;
* a current drain on a previous schema exits 4 in one line naming ``drain
  migrate``, leaving every row staged; after the migrate it publishes them.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from tests import pg_server, skew, support
from tests.skew import CURRENT, PREVIOUS

TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
#: staging's one-time line where the schema has no trace column (drain/staging.py).
NO_TRACE_COLUMN = "staged_jobs has no trace column yet"
#: The jobs tests/skew_app.py stages through drain's library, which captures the span
#: (the plain-SQL recipes give no trace column).
LIBRARY_WAYS = ("stage", "many", "task", "linked")


@pytest.fixture
def url(own_cluster: pg_server.Server) -> Iterator[str]:
    with skew.database(own_cluster) as made:
        yield made


def _errors(stderr: str) -> list[str]:
    """The error lines of a ``drain`` command's output (its log lines aside)."""
    return [line for line in stderr.splitlines() if line.startswith("drain: error:")]


def _published(queue: str, jobs: dict[str, dict[str, object]], *,
               traced: bool) -> None:
    """Each job in ``queue`` once, as staged; trace headers only where ``traced``, on the
    jobs staged through the library."""
    messages = support.drain_queue(queue)
    ids = support.task_ids(messages)
    assert sorted(ids) == sorted(jobs), f"published {ids}, staged {sorted(jobs)}"
    for _method, props, raw in messages:
        headers = props.headers
        job = jobs[str(headers["id"])]
        args, kwargs, embed = skew.body(raw)
        assert headers["task"] == "celery_app.record"
        assert (args, kwargs) == (job["args"], job["kwargs"])
        if kwargs == {"way": "linked"}:
            [callback] = embed["callbacks"]
            assert callback["task"] == "celery_app.record"
            assert callback["args"] == [args[0], "callback"]
        else:
            assert not embed.get("callbacks")
        if traced and kwargs["way"] in LIBRARY_WAYS:
            assert TRACEPARENT.fullmatch(str(headers.get("traceparent", ""))), headers
        else:
            assert "traceparent" not in headers, headers


class Cell(NamedTuple):
    app: str
    span: bool
    drain: str
    schema: str

    def __str__(self) -> str:
        span = "+span" if self.span else ""
        return f"app-{self.app}{span}/drain-{self.drain}/schema-{self.schema}"


#: The previous application has no OpenTelemetry: a span is nothing to it.
CELLS = [Cell(app, span, drain, schema)
         for app, span in ((PREVIOUS, False), (CURRENT, False), (CURRENT, True))
         for drain, schema in itertools.product(skew.VERSIONS, skew.VERSIONS)]


@pytest.mark.parametrize("cell", CELLS, ids=str)
def test_every_cell_delivers_or_refuses_in_one_line(
    releases: skew.Releases, url: str, queue: str, cell: Cell,
) -> None:
    app_version, span, drain_version, schema = cell
    skew.migrate(releases, PREVIOUS, url)
    if schema == CURRENT:
        skew.migrate(releases, CURRENT, url)

    staged, stderr = skew.stage_once(releases, app_version, url, queue, "m1", span=span)
    assert staged["version"] == ("0.1.0" if app_version == PREVIOUS else staged["version"])
    assert staged["order_committed"], "the application's own row was rolled back"
    assert len(staged["jobs"]) == 7
    dropped = app_version == CURRENT and span and schema == PREVIOUS
    assert stderr.count(NO_TRACE_COLUMN) == (1 if dropped else 0), stderr

    ran = skew.run(releases, drain_version, url, "run", "--exit-when-empty")
    if drain_version == CURRENT and schema == PREVIOUS:
        assert ran.returncode == 4, ran.stderr
        [line] = _errors(ran.stderr)
        assert "run `drain migrate`" in line, line
        assert support.staged_count(url) == 7
        assert support.queue_depth(queue) == 0
        # What the line says to do, and the same drain publishes every row.
        skew.migrate(releases, CURRENT, url)
        ran = skew.run(releases, CURRENT, url, "run", "--exit-when-empty")
    assert ran.returncode == 0, ran.stderr
    traced = (app_version, drain_version, schema) == (CURRENT, CURRENT, CURRENT) and span
    _published(queue, staged["jobs"], traced=traced)
    assert support.staged_count(url) == 0


def test_a_rollback_runs_the_previous_migrate_on_the_current_schema_and_changes_nothing(
    releases: skew.Releases, url: str, queue: str,
) -> None:
    """Rolling back one release: its migrate job runs again on the newer schema (as a
    deployment's pre-start job does); it keeps the schema version and the trace
    column, and the previous drain publishes what the current application stages."""
    skew.migrate(releases, PREVIOUS, url)
    skew.migrate(releases, CURRENT, url)
    skew.migrate(releases, PREVIOUS, url)
    checked = skew.run(releases, CURRENT, url, "migrate", "--check")
    assert checked.returncode == 0, checked.stderr
    staged, _ = skew.stage_once(releases, CURRENT, url, queue, "m2", span=True)
    ran = skew.run(releases, PREVIOUS, url, "run", "--exit-when-empty")
    assert ran.returncode == 0, ran.stderr
    _published(queue, staged["jobs"], traced=False)
    # Forward again: the current drain publishes what the previous application staged.
    staged, _ = skew.stage_once(releases, PREVIOUS, url, queue, "m3")
    ran = skew.run(releases, CURRENT, url, "run", "--exit-when-empty")
    assert ran.returncode == 0, ran.stderr
    _published(queue, staged["jobs"], traced=False)


def test_the_previous_migrate_alone_is_found_out_by_the_check(
    releases: skew.Releases, url: str,
) -> None:
    """A deploy pipeline's gate: ``drain migrate --check`` of this release on a schema
    the previous one made exits 4 in one line; after this release's migrate, 0."""
    skew.migrate(releases, PREVIOUS, url)
    checked = skew.run(releases, CURRENT, url, "migrate", "--check")
    assert checked.returncode == 4, checked.stderr
    [line] = _errors(checked.stderr)
    assert "run `drain migrate`" in line, line
    skew.migrate(releases, CURRENT, url)
    checked = skew.run(releases, CURRENT, url, "migrate", "--check")
    assert checked.returncode == 0, checked.stderr


def test_the_previous_release_is_what_it_says(releases: skew.Releases, tmp_path: Path) -> None:
    """The cells above test a real older release, not this checkout twice."""
    done = skew.run(releases, PREVIOUS, "postgresql://unused", "--version")
    assert done.returncode == 0 and done.stdout.startswith("drain 0.1.0"), done
    assert releases.previous.venv.is_dir()
    assert not str(releases.previous.venv).startswith(str(tmp_path))

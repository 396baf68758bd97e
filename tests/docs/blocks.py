"""The code blocks of README.md and docs/*.md, run as tests (tests/docs/test_blocks.py).

The markdown is read by Sybil (https://sybil.readthedocs.io; 10.1 released in
2026). Why Sybil: it is a parser and evaluator toolkit, not a fixed runner. Each
language gets an evaluator of ours over a namespace that one document's blocks
share, in order (the docs' shell blocks run ``drain`` against the test's own
database, their SQL runs as the role the page names, their Python sees the
connection a reader's application has); a directive of our own (``sql-as``) is a
few lines on its lexer for HTML comments; and it has a ``skip`` directive that
carries a reason. pytest-markdown-docs and pytest-examples run Python blocks
only; pytest-codeblocks and mktestdocs add shell, each with its own markers or
executors, but neither has a parser API for a directive of ours nor Sybil's
document namespace that per-test setup can fill.

The rules a page's author follows:

* A ``python``, ``sh`` or ``sql`` block runs. Any other block (no language,
  ``ini``, output) and any block that cannot run here (it installs packages,
  needs root, Docker, Kubernetes, a cluster or another host) is marked, with the
  reason, on the line before it::

      <!-- skip: next "needs Docker" -->

  A block that is neither runnable nor marked fails the test.
* A ``sql`` block says which role runs it, on the line before it (or before its
  skip marker): ``<!-- sql-as: app_drain_stager -->``, one of the group roles
  ``drain migrate`` creates, as the docs name them for a database named app
  (app_drain_stager, app_drain_runner, app_drain_operator, app_drain_consumer;
  the test connects as a login role holding the test database's role of that
  kind) or ``owner`` (the role that owns the tables). It runs in one transaction, committed.
* A ``python`` block runs in the page's namespace, which starts with what a
  reader's application has (:func:`reader_namespace`): ``dsn``, ``conn``,
  ``engine``, ``app`` and its tasks, ``order_id``, ``user_id``...
* A ``sh`` block runs under ``bash -euo pipefail`` with the drain's environment
  (``DRAIN_DATABASE_URL`` as the drain's role, ``DRAIN_BROKER_URL``), in a
  directory where ``yourproject.celery:app`` is the test's Celery app. The
  placeholder URLs of the docs are replaced by the test's own
  (:data:`PLACEHOLDERS`), and ``drain run`` gets ``--exit-when-empty``, so it
  drains what the page staged and exits.

Each document runs in a fresh database (the ``db_url`` fixture) with a table
``annotation (id, user_id, text, updated_at)`` of three rows, as the examples
assume; its queues are the test's own and are deleted afterwards.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from unittest import SkipTest

import psycopg
from sqlalchemy import create_engine
from sybil import Document, Example, Region, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer, RawFencedCodeBlockLexer

from tests import roles, support

#: The languages whose blocks run; any other block must be marked ``skip``.
RUNNABLE = ("python", "sh", "sql")

#: ``<!-- sql-as: ROLE -->``: the login role (tests/roles.py) that holds each group role.
SQL_ROLES = {
    "owner": roles.ADMIN,
    "app_drain_stager": roles.STAGER,
    "app_drain_runner": roles.RUNNER,
    "app_drain_operator": roles.OPERATOR,
    "app_drain_consumer": roles.CONSUMER,
}

#: The docs' placeholder URLs, and whose URL of the test's database each stands for.
PLACEHOLDERS = {
    "postgresql://app@db/app": roles.ADMIN,  # the owner: drain migrate
    "postgresql://drain@db/app": roles.RUNNER,
}
BROKER_PLACEHOLDER = "amqp://user:pass@rabbit:5672//"

#: ``yourproject/celery.py`` for the shell blocks, and the ``app`` of the Python ones.
APP_SOURCE = '''\
from celery import Celery


class App(Celery):
    """The reader's app, whose tasks (the pages' too) are its own: Celery shares a task
    with every app created later in the process unless told not to, and the test
    process goes on to create many."""

    def task(self, *args, **opts):
        opts.setdefault("shared", False)
        return super().task(*args, **opts)


app = App("yourproject", broker={broker!r}, task_cls="drain.celery_task:StagingTask",
          set_as_current=False)
app.conf.task_default_queue = {queue!r}


@app.task(name="search.index_annotation")
def index_annotation(annotation_id):
    return annotation_id


def order_step(order_id):
    return order_id


def anything(*args, **kwargs):
    return None


charge, reserve, ship = (app.task(name=f"billing.{{name}}")(order_step)
                         for name in ("charge", "reserve", "ship"))
receipt, alert = (app.task(name=f"billing.{{name}}")(anything)
                  for name in ("receipt", "alert"))
for name in ("mail.send", "mail.send_digest", "billing.close_month"):
    app.task(name=name)(anything)
'''

#: Makes ``drain run`` in a shell block drain what is due, then exit.
#: The ``drain`` commands an operator runs (tests/roles.py): a block's ``drain
#: pause``, say, runs as the operator role, as in real life.
OPERATOR_COMMANDS = sorted(c for c, role in roles.COMMAND_ROLES.items() if role == roles.OPERATOR)
SHELL_PRELUDE = f"""\
drain() {{
    case "${{1-}}" in
        run) shift; command drain run --exit-when-empty "$@" ;;
        {"|".join(OPERATOR_COMMANDS)})
            DRAIN_DATABASE_URL="$DRAIN_TEST_OPERATOR_URL" command drain "$@" ;;
        *) command drain "$@" ;;
    esac
}}
"""


class BlockFailed(AssertionError):
    """A block of a page failed: the page, the line and what it printed."""


@dataclass
class Reader:
    """What one document's blocks run against: the test's database, queue and files."""

    db_url: str
    queue: str
    workdir: Path
    sql_role: str | None = None
    closing: list[Any] = field(default_factory=list)

    def url(self, role: str) -> str:
        return roles.url(self.db_url, role)

    def env(self) -> dict[str, str]:
        env = support.drain_env(self.db_url)
        env["DRAIN_TEST_OPERATOR_URL"] = self.url(roles.OPERATOR)
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        env["PYTHONPATH"] = f"{self.workdir}:{support.ROOT}"
        return env

    def substitute(self, source: str) -> str:
        for placeholder, role in PLACEHOLDERS.items():
            source = source.replace(placeholder, self.url(role))
        return source.replace(BROKER_PLACEHOLDER, support.BROKER_URL)


def prepare(reader: Reader) -> None:
    """The tables and files the examples assume (as the owner of the database)."""
    with psycopg.connect(reader.db_url, autocommit=True) as owner:
        owner.execute("CREATE TABLE annotation (id int PRIMARY KEY, user_id int, text text,"
                      " updated_at timestamptz NOT NULL DEFAULT now())")
        owner.execute("INSERT INTO annotation (id, user_id, text)"
                      " VALUES (1, 42, 'a'), (2, 42, 'b'), (3, 17, 'c')")
        owner.execute(f'GRANT SELECT, INSERT, UPDATE ON annotation TO "{roles.STAGER}"')
    package = reader.workdir / "yourproject"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "celery.py").write_text(
        APP_SOURCE.format(broker=support.BROKER_URL, queue=reader.queue))


def reader_namespace(reader: Reader) -> dict[str, Any]:
    """The names the docs' Python blocks take as given: a reader's application."""
    # A module name of its own: functions defined by exec take __module__ from it (Celery
    # names tasks by it), and the app's tasks are not shared, so nothing a page defines
    # reaches the Celery apps of other tests in the same process.
    namespace: dict[str, Any] = {"__name__": "docs_reader"}
    exec(APP_SOURCE.format(broker=support.BROKER_URL, queue=reader.queue), namespace)
    dsn = reader.url(roles.STAGER)
    conn = psycopg.connect(dsn)
    engine = create_engine(dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    reader.closing += [conn, engine]
    namespace.update(
        dsn=dsn, conn=conn, engine=engine, order_id=17, user_id=42, datetime=datetime,
        get_connection=lambda: psycopg.connect(reader.url(roles.CONSUMER)))
    return namespace


def close(reader: Reader) -> None:
    for resource in reader.closing:
        if isinstance(resource, psycopg.Connection):
            if not resource.closed:
                resource.commit()
                resource.close()
        else:
            resource.dispose()


class SqlRoleParser:
    """``<!-- sql-as: ROLE -->``: the role the next ``sql`` block runs as."""

    def __init__(self, reader: Reader | None) -> None:
        self.reader = reader
        self.lexer = DirectiveInHTMLCommentLexer(directive="sql-as", arguments=r"\S+")

    def __call__(self, document: Document) -> Iterable[Region]:
        for lexed in self.lexer(document):
            yield Region(lexed.start, lexed.end, lexed.lexemes["arguments"], self.evaluate)

    def evaluate(self, example: Example) -> None:
        role = str(example.parsed)
        if role not in SQL_ROLES:
            raise BlockFailed(f"sql-as: {role!r} is none of {', '.join(SQL_ROLES)}")
        if self.reader:
            _no_role_left(self.reader)
            self.reader.sql_role = role


class UnmarkedBlockParser:
    """Every fenced block whose language is not one that runs: it fails unless a
    ``skip`` marker before it says why it does not run."""

    def __init__(self) -> None:
        self.lexer = RawFencedCodeBlockLexer(
            info_pattern=re.compile(r"(?P<info>[^\n]*)$\n", re.MULTILINE))

    def __call__(self, document: Document) -> Iterator[Region]:
        for region in self.lexer(document):
            info = str(region.lexemes["info"]).strip()
            if info not in RUNNABLE:
                yield Region(region.start, region.end, info or "(no language)", self.evaluate)

    @staticmethod
    def evaluate(example: Example) -> None:
        raise BlockFailed(
            f"a {example.parsed} block that does not run: mark why on the line before it,"
            ' <!-- skip: next "the reason" -->, or make it a python, sh or sql block')


def shell_evaluator(reader: Reader) -> Any:
    def evaluate(example: Example) -> None:
        source = reader.substitute(str(example.parsed))
        ran = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", SHELL_PRELUDE + source], env=reader.env(),
            cwd=reader.workdir, capture_output=True, text=True, check=False,
            stdin=subprocess.DEVNULL)
        if ran.returncode != 0:
            raise BlockFailed(f"exit {ran.returncode}\n{source}\n--- stdout:\n{ran.stdout}"
                              f"\n--- stderr:\n{ran.stderr}")
    return evaluate


def python_evaluator(reader: Reader, evaluator: Any) -> Any:
    """Sybil's, with ``conn`` open again where an earlier block closed it (``with
    psycopg.connect(dsn) as conn:``): the next block's ``conn`` is the reader's."""
    def evaluate(example: Example) -> None:
        conn = example.namespace.get("conn")
        if isinstance(conn, psycopg.Connection) and conn.closed:
            example.namespace["conn"] = psycopg.connect(reader.url(roles.STAGER))
            reader.closing.append(example.namespace["conn"])
        evaluator(example)
    return evaluate


def sql_evaluator(reader: Reader) -> Any:
    def evaluate(example: Example) -> None:
        role, reader.sql_role = reader.sql_role, None
        if role is None:
            raise BlockFailed("a sql block without the role that runs it: put"
                              " <!-- sql-as: ROLE --> on the line before it")
        with psycopg.connect(reader.url(SQL_ROLES[role])) as conn:
            conn.execute(str(example.parsed).encode())
    return evaluate


def sybil(reader: Reader | None) -> Sybil:
    """The parsers of a page: with ``reader``, blocks run against it; without one, a
    parse only (to find a block's text)."""
    shell: Any = shell_evaluator(reader) if reader else None
    sql: Any = sql_evaluator(reader) if reader else None
    return Sybil(parsers=[
        SkipParser(),
        SqlRoleParser(reader),
        PythonCodeBlockParser(),
        CodeBlockParser("sh", shell),
        CodeBlockParser("sql", sql),
        UnmarkedBlockParser(),
    ])


def block_after(path: Path, marker: str, language: str) -> str:
    """The source of the first ``language`` block after the text ``marker`` in
    ``path``: how a test that runs a block its own way (tests/acceptance/
    test_docs_roles.py) takes it from the page."""
    document = sybil(None).parse(path)
    start = document.text.index(marker)
    for example in document.examples():
        region = example.region
        if region.start > start and region.lexemes.get("arguments") == language:
            return str(example.parsed)
    raise LookupError(f"no {language} block after {marker!r} in {path}")


def _no_role_left(reader: Reader) -> None:
    if reader.sql_role is not None:
        raise BlockFailed(f"sql-as: {reader.sql_role} is followed by no sql block that runs")


def _shown(path: Path) -> str:
    return str(path.relative_to(support.ROOT) if path.is_relative_to(support.ROOT) else path)


def run_document(path: Path, reader: Reader) -> list[str]:
    """Run every block of ``path`` in order; the skipped ones, with their reasons."""
    prepare(reader)
    document = sybil(reader).parse(path)
    document.namespace.update(reader_namespace(reader))
    for example in document.examples():
        if example.region.lexemes.get("arguments") == "python":
            example.region.evaluator = python_evaluator(reader, example.region.evaluator)
    skipped = []
    try:
        for example in document.examples():
            where = f"{_shown(path)}, line {example.line}"
            try:
                example.evaluate()
            except SkipTest as skip:
                skipped.append(f"{where}: {skip}")
            except Exception as exc:
                raise BlockFailed(f"{where}: {type(exc).__name__}: {exc}") from exc
        _no_role_left(reader)
    finally:
        close(reader)
    return skipped

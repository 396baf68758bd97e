"""Staging Celery signatures (``drain.stage(conn, sig)``) and ``task.stage(conn, ...)``."""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery, chain, chord, group
from kombu.utils.json import loads

import drain
from drain.celery_task import StagingTask
from tests import support


@pytest.fixture
def app() -> Iterator[Celery]:
    built = Celery("signatures_test", set_as_current=False,
                   task_cls="drain.celery_task:StagingTask")

    @built.task(name="t.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @built.task(name="t.bound", bind=True, shared=False)
    def bound(self: Any, user_id: int, *, welcome: bool = True) -> None:
        return None

    @built.task(name="t.loose", typing=False, shared=False)
    def loose(x: int) -> int:
        return x

    yield built
    built.close()


def _rows(db_url: str) -> list[dict[str, Any]]:
    with psycopg.connect(db_url) as conn:
        cur = conn.execute("SELECT task_id, task_name, args, kwargs, queue, priority, "
                           "not_before, expires_at FROM staged_jobs ORDER BY id")
        names = [c.name for c in cur.description or ()]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def test_a_signature_stages_as_its_apply_async_would_send_it(db_url: str, app: Celery) -> None:
    given = uuid.uuid4()
    eta = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    with psycopg.connect(db_url) as conn:
        first = drain.stage(conn, app.tasks["t.add"].s(2, 3).set(
            queue="math", countdown=60, priority=3, expires=3600))
        second = drain.stage(conn, app.tasks["t.add"].s(y=4, x=1).set(task_id=str(given),
                                                                        eta=eta.isoformat()))
    assert second == given
    rows = _rows(db_url)
    assert [(r["task_id"], r["task_name"], r["args"], r["kwargs"], r["queue"], r["priority"])
            for r in rows] == [(first, "t.add", [2, 3], {}, "math", 3),
                               (given, "t.add", [], {"y": 4, "x": 1}, None, 0)]
    now = dt.datetime.now(dt.timezone.utc)
    assert dt.timedelta(seconds=50) < rows[0]["not_before"] - now <= dt.timedelta(seconds=60)
    assert dt.timedelta(minutes=59) < rows[0]["expires_at"] - now <= dt.timedelta(hours=1)
    assert rows[1]["not_before"] == eta


@pytest.mark.parametrize(("build", "says"), [
    (lambda t: group(t.s(1, 2), t.s(3, 4)), "a group cannot be staged"),
    (lambda t: chord([t.s(1, 2)], t.s(3)), "a chord cannot be staged"),
    (lambda t: t.s(1, 2) | group(t.s(3), t.s(4)), "a chain with a group in it cannot be staged"),
    (lambda t: chain(t.s(1, 2), chain(t.s(0), group(t.s(3), t.s(5)))),
     "a chain with a group in it cannot be staged"),
    (lambda t: t.s(1, 2).set(link=group(t.s(9))), "a group as a link cannot be staged"),
    (lambda t: chain(), "an empty chain cannot be staged"),
    (lambda t: dict(t.s(1, 2) | t.s(3)), "pass the chain itself"),
    (lambda t: t.s(1, 2).set(routing_key="x"), "option(s) ['routing_key'] cannot be staged"),
], ids=["group", "chord", "chain-group", "nested-chain-group", "link-group", "empty-chain",
        "chain-as-dict", "routing_key"])
def test_what_cannot_be_staged_is_refused_and_stages_nothing(
    db_url: str, app: Celery, build: Any, says: str
) -> None:
    with psycopg.connect(db_url) as conn, pytest.raises(drain.StagingError,
                                                         match=re.escape(says)):
        drain.stage(conn, build(app.tasks["t.add"]))
    assert _rows(db_url) == []


def _embed(db_url: str) -> list[Any]:
    with psycopg.connect(db_url) as conn:
        return [r[0] for r in conn.execute("SELECT embed FROM staged_jobs ORDER BY id")]


def test_callbacks_are_staged_with_the_job(db_url: str, app: Celery) -> None:
    add = app.tasks["t.add"]
    with psycopg.connect(db_url) as conn:
        drain.stage(conn, add.s(1, 2).set(link=add.s(10), link_error=[add.si(0, 0), add.s(1)]))
        drain.stage(conn, add.s(3, 4))  # no callbacks: no embed
        add.stage_with(conn, [5, 6], link=add.s(7))
    first, plain, third = _embed(db_url)
    assert plain is None
    assert first == {
        "callbacks": [json.loads(json.dumps(add.s(10)))],
        "errbacks": [json.loads(json.dumps(add.si(0, 0))), json.loads(json.dumps(add.s(1)))],
        "chain": None, "chord": None}
    assert [c["task"] for c in third["callbacks"]] == ["t.add"]
    assert third["callbacks"][0]["args"] == [7]


def test_a_chain_stages_its_first_task_with_the_rest_to_follow(db_url: str, app: Celery) -> None:
    add = app.tasks["t.add"]
    canvas = add.s(1, 2) | chain(add.s(3), add.s(4)) | add.s(5).set(countdown=9)
    frozen = canvas.freeze()  # the chain's result: its last task's id
    with psycopg.connect(db_url) as conn:
        first_id = drain.stage(conn, canvas.set(link_error=add.si(0, 0), priority=2))
    [row] = _rows(db_url)
    [embed] = _embed(db_url)
    assert (row["task_name"], row["args"], row["priority"]) == ("t.add", [1, 2], 2)
    assert row["task_id"] == first_id
    # The rest, last task first, as Celery's chain sends it; each with its task id.
    rest = embed["chain"]
    assert [(t["task"], t["args"]) for t in rest] == [("t.add", [5]), ("t.add", [4]),
                                                      ("t.add", [3])]
    assert rest[0]["options"]["task_id"] == frozen.id
    assert rest[0]["options"]["countdown"] == 9
    assert len({t["options"]["task_id"] for t in rest} | {str(first_id)}) == 4
    # The chain's link_error goes to every task.
    assert embed["errbacks"] == [json.loads(json.dumps(add.si(0, 0)))]
    assert all(t["options"]["link_error"] == embed["errbacks"] for t in rest)
    assert embed["callbacks"] is None


def test_a_database_not_yet_upgraded_takes_jobs_staged_by_name(db_url: str, app: Celery) -> None:
    """A database `drain migrate` has not upgraded yet (no embed column, queue NOT
    NULL DEFAULT 'celery') still takes jobs staged by name and plain signatures, a
    job without a queue as 'celery', as it read there; callbacks and chains need
    the column, and are refused in one line that names `drain migrate`."""
    support.as_an_older_schema(db_url)
    add = app.tasks["t.add"]
    with psycopg.connect(db_url) as conn:
        drain.stage(conn, "t.add", [1, 2])
        drain.stage(conn, add.s(3, 4))
        drain.stage_many(conn, [drain.Job("t.add", [5, 6]), drain.Job("t.add", [7, 8])])
        drain.stage(conn, "t.add", [9, 9], queue="q")
    assert [(r["args"], r["queue"]) for r in _rows(db_url)] == [
        ([1, 2], "celery"), ([3, 4], "celery"), ([5, 6], "celery"), ([7, 8], "celery"),
        ([9, 9], "q")]
    # Refused before any SQL, naming drain migrate: the transaction goes on.
    with psycopg.connect(db_url) as conn:
        with pytest.raises(drain.StagingError, match=r"no embed column.*`drain migrate`"):
            drain.stage(conn, add.s(1, 2) | add.s(3))
        drain.stage(conn, "t.add", [10, 10])
    assert [r["args"] for r in _rows(db_url)][-1] == [10, 10]


def test_a_signature_takes_no_other_arguments(db_url: str, app: Celery) -> None:
    with psycopg.connect(db_url) as conn, pytest.raises(drain.StagingError, match=r"\.set\("):
        drain.stage(conn, app.tasks["t.add"].s(1, 2), queue="q")


def test_task_stage_is_delay_in_the_callers_transaction(db_url: str, app: Celery) -> None:
    add, bound = app.tasks["t.add"], app.tasks["t.bound"]
    assert isinstance(add, StagingTask)
    with psycopg.connect(db_url) as conn:
        with conn.transaction():
            task_id = add.stage(conn, 2, y=5)
            bound.stage_with(conn, [7], {"welcome": False}, queue="mail", countdown=5)
        with conn.transaction():  # rolled back: its job goes with it
            add.stage(conn, 100, 200)
            raise psycopg.Rollback
    rows = _rows(db_url)
    assert [(r["task_id"] if r["task_name"] == "t.add" else None, r["task_name"], r["args"],
             r["kwargs"], r["queue"]) for r in rows] == [
        (task_id, "t.add", [2], {"y": 5}, None), (None, "t.bound", [7], {"welcome": False}, "mail")]


@pytest.mark.parametrize(("task", "args", "kwargs", "says"), [
    ("t.add", (1,), {}, "missing a required argument: 'y'"),
    ("t.add", (1, 2, 3), {}, "too many positional arguments"),
    ("t.bound", (1,), {"nope": 2}, "unexpected keyword argument 'nope'"),
], ids=["missing", "too-many", "unknown-keyword"])
def test_task_stage_checks_the_arguments_as_apply_async_does(
    db_url: str, app: Celery, *, task: str, args: tuple[Any, ...], kwargs: dict[str, Any],
    says: str,
) -> None:
    with psycopg.connect(db_url) as conn, pytest.raises(drain.StagingError, match=says):
        app.tasks[task].stage(conn, *args, **kwargs)
    assert _rows(db_url) == []
    # typing=False: Celery does not check, nor does drain.
    with psycopg.connect(db_url) as conn:
        app.tasks["t.loose"].stage(conn, 1, 2, 3)
    assert [r["args"] for r in _rows(db_url)] == [[1, 2, 3]]


#: Callbacks and chain steps holding what jsonb refuses: each must raise
#: StagingError before any SQL, as the same value in the main args does.
BAD_EMBEDS: dict[str, Any] = {
    "link-arg": lambda t: t.s(1, 2).set(link=t.s("a\ud800")),
    "link_error-kwarg": lambda t: t.s(1, 2).set(link_error=t.s(y="\udcff")),
    "link-option": lambda t: t.s(1, 2).set(link=t.s(1).set(queue="q\ud800")),
    "chain-step": lambda t: t.s(1, 2) | t.s(3) | t.s("b\ud800"),
    "chain-step-kwarg": lambda t: t.s(1, 2) | t.s(y={"k": ["\ud800"]}),
    "chain-link_error": lambda t: (t.s(1, 2) | t.s(3)).set(link_error=t.si("\udfff", 0)),
    "link-NUL": lambda t: t.s(1, 2).set(link=t.s("a\x00")),
    "link-nested": lambda t: t.s(1, 2).set(link=t.s(support.nested(3000))),
}


@pytest.mark.parametrize("build", BAD_EMBEDS.values(), ids=BAD_EMBEDS.keys())
def test_a_bad_callback_is_refused_and_the_applications_transaction_goes_on(
    db_url: str, app: Celery, build: Any
) -> None:
    """The application's own write in the same transaction commits: before, a
    lone surrogate in a callback reached the INSERT, and jsonb's refusal aborted
    the transaction with it."""
    with psycopg.connect(db_url) as conn:
        conn.execute("CREATE TABLE annotation (id int)")
        conn.execute("INSERT INTO annotation VALUES (1)")
        with pytest.raises(drain.StagingError, match=r"callbacks or chain for t\.add "):
            drain.stage(conn, build(app.tasks["t.add"]))
        conn.execute("INSERT INTO annotation VALUES (2)")
        conn.commit()
        assert conn.execute("SELECT array_agg(id ORDER BY id) FROM annotation").fetchone() == (
            [1, 2],)
    assert _rows(db_url) == []


@pytest.mark.parametrize(("options", "says"), [
    ({"expires": dt.datetime(2099, 1, 1)}, "expires for t.add is more than 3,650 days ahead"),
    ({"expires": 3651 * 86400}, "expires for t.add is more than 3,650 days ahead"),
    ({"expires": dt.datetime(2099, 1, 1).isoformat()}, "more than 3,650 days ahead"),
    ({"expires": 1e12}, "expires for t.add is out of range"),
    ({"countdown": 1e12}, "countdown for t.add is out of range"),
], ids=["datetime", "seconds", "iso-text", "expires-overflow", "countdown-overflow"])
def test_a_signatures_times_are_checked_as_stages(
    db_url: str, app: Celery, options: dict[str, Any], says: str
) -> None:
    add = app.tasks["t.add"]
    with psycopg.connect(db_url) as conn:
        with pytest.raises(drain.StagingError, match=re.escape(says)):
            drain.stage(conn, add.s(1, 2).set(**options))
        with pytest.raises(drain.StagingError, match=re.escape(says)):
            add.stage_with(conn, [1, 2], **options)
    assert _rows(db_url) == []


def test_chunks_are_refused_map_and_starmap_are_one_task(db_url: str, app: Celery) -> None:
    """apply_async sends chunks as a group of celery.starmap tasks (refused, as
    groups are); map and starmap as one task each, as staged here."""
    add = app.tasks["t.add"]
    with psycopg.connect(db_url) as conn:
        with pytest.raises(drain.StagingError, match=re.escape(
                "t.add.chunks(...) cannot be staged: its apply_async sends a group of "
                "celery.starmap tasks, one per part; stage each part as t.add.starmap(part)")):
            drain.stage(conn, add.chunks([(1, 2), (3, 4), (5, 6)], 2))
        drain.stage(conn, add.starmap([(1, 2), (3, 4)]))
        drain.stage(conn, add.map([1, 2]))
    rows = _rows(db_url)
    assert [(r["task_name"], r["args"], r["kwargs"]["it"]) for r in rows] == [
        ("celery.starmap", [], [[1, 2], [3, 4]]), ("celery.map", [], [1, 2])]
    assert rows[0]["kwargs"]["task"]["task"] == "t.add"


def test_a_signature_carries_kombus_types(db_url: str, app: Celery) -> None:
    """add.s(uuid) stages as add.delay(uuid) sends it, its callbacks too."""
    given = uuid.uuid4()
    at = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    with psycopg.connect(db_url) as conn:
        app.tasks["t.add"].stage(conn, given, y=at)
        drain.stage(conn, app.tasks["t.add"].s(1, 2).set(link=app.tasks["t.add"].s(given)))
        texts = conn.execute("SELECT args::text, kwargs::text, embed::text FROM staged_jobs "
                             "ORDER BY id").fetchall()
    assert (loads(texts[0][0]), loads(texts[0][1])) == ([given], {"y": at})
    assert loads(texts[1][2])["callbacks"][0]["args"] == [given]

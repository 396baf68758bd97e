"""Signatures with callbacks, and chains, staged through drain: sent as ``apply_async``
sends them, and run by a real Celery worker to their end.

The app is tests/routing_app.py (its ``canvas.*`` tasks go to its default
queue); the drain runs as ``drain run --app tests.routing_app``.
"""

from __future__ import annotations

import datetime as dt
import decimal
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from celery import Celery, chain

import drain
from tests import messages, routing_app, support

#: What kombu's JSON serializer carries besides plain JSON.
KOMBU_VALUES: list[Any] = [
    uuid.UUID("7d3f0f7e-8f3a-4d51-9a49-1bd9b1b0c2aa"),
    dt.datetime(2026, 11, 27, 3, 4, 5, 678901, tzinfo=dt.timezone(dt.timedelta(hours=2))),
    dt.datetime(2026, 11, 27, 3, 4, 5), dt.date(2026, 11, 27), dt.time(3, 4, 5, 6),
    decimal.Decimal("1.10"), b"utf-8 bytes \xc3\xa9", b"\xff\xfe not utf-8",
]


def _env(db_url: str, suffix: str) -> dict[str, str]:
    return support.drain_env(db_url, ROUTING_APP_SUFFIX=suffix, ROUTING_APP_DATABASE_URL=db_url)


def _canvases(app: Celery, suffix: str) -> dict[str, Any]:
    """Each case's canvas; chains frozen, so that drain and apply_async send the
    same task ids."""
    add, fail, on_error = (app.tasks[f"canvas.{n}"] for n in ("add", "fail", "on_error"))
    quorum = routing_app.names(suffix)["quorum"]
    cases: dict[str, Any] = {
        "link": add.s(1, 2).set(link=add.s(10), link_error=on_error.s()),
        "link-queue": add.s(2, 2).set(queue=quorum, link=[add.s(1), add.si(5, 5)]),
        "chain": (add.s(1, 2) | chain(add.s(3), add.s(4))).set(link_error=on_error.s()),
        "chain-link": (add.s(3, 3) | fail.s()).set(link=add.s(7)),
        "single-chain": chain(add.s(7, 1)),
        "kombu-types": app.tasks["canvas.types"].s(*KOMBU_VALUES, at=KOMBU_VALUES[1]).set(
            link=add.s(KOMBU_VALUES[5])),
    }
    for canvas in cases.values():
        if canvas["subtask_type"] == "chain":
            canvas.freeze()
    return cases


def test_each_canvas_is_sent_as_apply_async_sends_it(
    db_url: str, suffix: str, app: Celery
) -> None:
    cases = _canvases(app, suffix)
    staged: dict[str, str] = {}
    with psycopg.connect(db_url) as conn:
        for name, canvas in cases.items():
            staged[str(drain.stage(conn, canvas))] = name
    run = support.run_cli(db_url, "run", "--app", "tests.routing_app", "--exit-when-empty",
                          env=_env(db_url, suffix))
    assert run.returncode == 0, run.stderr
    n = routing_app.names(suffix)
    queues = {n["default"], n["quorum"]}
    ours = messages.collect(queues, len(cases))

    for task_id, name in staged.items():
        canvas = cases[name]
        if canvas["subtask_type"] == "chain":
            canvas.apply_async()  # frozen: the first task has the staged id
        else:
            canvas.apply_async(task_id=task_id)
    theirs = messages.collect(queues, len(cases))
    assert set(theirs) == set(ours)

    problems = []
    for task_id, name in staged.items():
        # A signature keeps its args as a tuple, which Celery's argsrepr shows as
        # "(1, 2)"; staged args are JSON, shown as apply_async(args=[1, 2]) shows
        # them: "[1, 2]" (a header for logs only; the body's args are the same).
        problems += [f"{name}: {d}" for d in messages.differences(
            ours[task_id], theirs[task_id], body_as_json=True)
            if not d.startswith("header argsrepr: ")]
    assert not problems, "\n".join(problems)
    assert ours[next(t for t, name in staged.items() if name == "link-queue")][0] == n["quorum"]


def _runs(db_url: str) -> list[tuple[str, str, Any, str | None, str | None]]:
    with psycopg.connect(db_url) as conn:
        if conn.execute("SELECT to_regclass('canvas_runs')").fetchone() == (None,):
            return []
        return conn.execute("SELECT * FROM canvas_runs").fetchall()


def _wait_runs(db_url: str, what: str,
               done: Callable[[list[tuple[str, str, Any, str | None, str | None]]], bool],
               ) -> list[tuple[str, str, Any, str | None, str | None]]:
    def check() -> list[tuple[str, str, Any, str | None, str | None]] | None:
        runs = _runs(db_url)
        return runs if done(runs) else None

    try:
        found: list[tuple[str, str, Any, str | None, str | None]] = support.wait_for(
            check, 60, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the tasks that ran: {_runs(db_url)}") from None
    return found


def _worker_and_drain(db_url: str, suffix: str, spawn: Any, name: str) -> None:
    """A real worker on the app's default queue (ready) and ``drain run --app``
    beside it."""
    env = _env(db_url, suffix)
    default = routing_app.names(suffix)["default"]
    worker = spawn([*support.celery_argv(default)[:3], "-A", "tests.routing_app", "worker",
                    "-Q", default, "-P", "threads", "-c", "1", "--without-gossip",
                    "--without-mingle", "-l", "info", "-n", f"{name}{suffix}@%h"], env, "worker")
    worker.wait_for_output("ready.", timeout=60)
    spawn(support.drain_argv("run", "--app", "tests.routing_app", "--poll-interval", "0.2"),
          env, "drain")


def test_a_celery_worker_runs_chains_and_callbacks_to_their_end(
    db_url: str, suffix: str, app: Celery, spawn: Any
) -> None:
    _worker_and_drain(db_url, suffix, spawn, "cv")
    add, fail, on_error = (app.tasks[f"canvas.{n}"] for n in ("add", "fail", "on_error"))

    three = add.s(1, 2) | add.s(3) | add.s(4)
    last = three.freeze()
    broken = (add.s(1, 1) | fail.s() | add.s(100)).set(link_error=on_error.s())
    with psycopg.connect(db_url) as conn:
        first = drain.stage(conn, three)
        linked = drain.stage(conn, add.s(5, 5).set(link=add.s(1)))
        failed = drain.stage(conn, fail.s(1).set(link_error=on_error.s()))
        drain.stage(conn, broken)

    def finished(runs: list[tuple[str, str, Any, str | None, str | None]]) -> bool:
        given = [r[2] for r in runs]
        return [6, 4] in given and [10, 1] in given and sum(
            r[1] == "canvas.on_error" for r in runs) >= 2

    runs = _wait_runs(db_url, "the chains and callbacks to run", finished)
    by_given = {(r[1], tuple(r[2])): r for r in runs}
    # The chain ran in order, each step with the one before's result, under its id.
    step1, step2, step3 = (by_given[("canvas.add", g)] for g in ((1, 2), (3, 3), (6, 4)))
    assert step1[0] == str(first) and step3[0] == last.id
    assert (step2[3], step3[3]) == (step1[0], step2[0])  # parent ids
    assert {step1[4], step2[4], step3[4]} == {str(first)}  # root id
    # link: the callback got the result; link_error: the errback got the failure.
    assert by_given[("canvas.add", (10, 1))][3] == str(linked)
    errbacks = [r[2] for r in runs if r[1] == "canvas.on_error"]
    assert [str(failed), "canvas.fail failed on purpose"] in errbacks
    # A chain stops at the failed task; its link_error fired for that task.
    broken_fail = next(r for r in runs if r[1] == "canvas.fail" and r[2] == [2])
    assert [broken_fail[0], "canvas.fail failed on purpose"] in errbacks

    # Nothing more comes of the broken chain: a job staged after it runs, alone.
    with psycopg.connect(db_url) as conn:
        drain.stage(conn, add.s(1000, 1))
    runs = _wait_runs(db_url, "the job staged last to run",
                      lambda runs: any(r[2] == [1000, 1] for r in runs))
    assert not [r for r in runs if 100 in r[2]]
    # A worker may run a job before the drain has deleted its confirmed row.
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                     "the drain to delete every row")


def test_a_worker_gets_kombus_types_as_from_apply_async_and_runs_starmap(
    db_url: str, suffix: str, app: Celery, spawn: Any
) -> None:
    """UUID, datetime, date, time, Decimal and bytes staged (by name, as a
    signature, as task.stage) reach a real worker as the same types as from
    apply_async; task.starmap is one task that runs the task for each item."""
    _worker_and_drain(db_url, suffix, spawn, "ty")
    types, add = app.tasks["canvas.types"], app.tasks["canvas.add"]
    kwargs = {"at": KOMBU_VALUES[1], "ids": [KOMBU_VALUES[0]], "amount": KOMBU_VALUES[5]}
    with psycopg.connect(db_url) as conn:
        staged = [str(drain.stage(conn, "canvas.types", KOMBU_VALUES, kwargs)),
                  str(drain.stage(conn, types.s(*KOMBU_VALUES, **kwargs)))]
        mapped = str(drain.stage(conn, add.starmap([(1, 2), (3, 4)])))
    sent = types.apply_async(KOMBU_VALUES, kwargs).id

    runs = _wait_runs(db_url, "the typed jobs and the starmap to run", lambda runs: (
        sum(r[1] == "canvas.types" for r in runs) == 3
        and {(1, 2), (3, 4)} <= {tuple(r[2]) for r in runs if r[1] == "canvas.add"}))
    given = {r[0]: r[2] for r in runs if r[1] == "canvas.types"}
    assert set(given) == {*staged, sent}
    assert given[sent]["args"] == [repr(v) for v in KOMBU_VALUES]
    assert given[staged[0]] == given[staged[1]] == given[sent]
    # starmap: drain published one celery.starmap message, whose task ran
    # canvas.add in itself (no task id of its own) for each item, as after
    # apply_async; nothing is left staged or dead.
    inline = [r for r in runs if r[1] == "canvas.add"]
    assert sorted(r[2] for r in inline) == [[1, 2], [3, 4]]
    assert [r[0] for r in inline if r[0] is not None] == []
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT (SELECT count(*) FROM staged_jobs), "
                            "(SELECT count(*) FROM dead_jobs)").fetchone() == (0, 0)
    assert mapped not in given

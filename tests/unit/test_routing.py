"""drain.celery.routing and drain.celery.celery_app against tests/routing_app.py (no broker)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu.common import Broadcast
from kombu.entity import Exchange, Queue

from drain.celery import celery_app, routing
from drain.celery.message import Destination
from drain.errors import ConfigError
from drain.postgres.rows import StagedRow
from tests import routing_app

SUFFIX = "unit"
N = routing_app.names(SUFFIX)


@pytest.fixture
def app() -> Iterator[Celery]:
    built = routing_app.create(SUFFIX)
    yield built
    built.close()


def _row(task: str, kwargs: str = "{}", queue: str | None = None, args: str = "[]") -> StagedRow:
    """A row as the drain reads it: without a queue, ``queue`` reads 'celery' and the row
    is unrouted."""
    return StagedRow(1, uuid.uuid4(), task, args, kwargs, queue or "celery",
                     unrouted=queue is None)


def test_routes_as_apply_async(app: Celery) -> None:
    router = routing.AppRouter(app)
    assert not router.static  # a router function: asked per row, with the arguments
    assert router.destination(_row("orders.process", '{"vip": true}')) == Destination(
        "", N["priority"], N["priority"], priority=7, max_priority=10, ignore_result=False)
    assert router.destination(_row("orders.process")).queue == N["default"]
    assert router.destination(_row("mail.send")).queue == N["quorum"]
    assert router.destination(_row("report.daily")) == Destination(
        N["topic"], "report.daily.eu", N["reports"], priority=0, ignore_result=False)
    assert router.destination(_row("video.encode")) == Destination(
        "", N["video"], N["video"], priority=4, timelimit=(60, 50), ignore_result=True)
    # A queue named in the row is apply_async(queue=...): the app's definition of it.
    named = router.destination(_row("orders.process", queue=N["quorum"]))
    assert (named.exchange, named.routing_key, named.queue, named.priority) == (
        "", N["quorum"], N["quorum"], None)


def test_declarations_are_the_apps(app: Celery) -> None:
    router = routing.AppRouter(app)

    def spec_for(task: str, queue: str | None = None) -> Any:
        return router.spec(router.destination(_row(task, queue=queue)).queue)

    assert spec_for("mail.send").arguments == {"x-queue-type": "quorum"}
    assert spec_for("orders.process", N["priority"]).arguments == {"x-max-priority": 10}
    reports = spec_for("report.daily")
    assert [(b.exchange.name, b.exchange.type, b.routing_key) for b in reports.bindings] == [
        (N["topic"], "topic", "report.#")]
    # A queue the app does not define is created as Celery creates a missing one.
    missing = spec_for("orders.process", "adhoc_unit")
    assert (missing.arguments, missing.durable) == (None, True)
    assert [b.exchange.name for b in missing.bindings] == ["adhoc_unit"]


def test_exchange_only_broadcast_and_queue_object_routes() -> None:
    """What send_task_message does with them: an exchange and no queue publishes
    there and declares nothing; a Broadcast goes to its fanout exchange and its
    bcast queue is not declared; a kombu Queue given by a route is declared as
    itself, even when the app defines another queue of that name."""
    app = Celery("shapes_unit", set_as_current=False)
    own = Queue("q_unit", Exchange("x_own_unit", type="topic"), routing_key="own.#",
                queue_arguments={"x-max-priority": 5})
    app.conf.task_queues = [Queue("q_unit"), Broadcast("bc_unit")]
    app.conf.task_routes = {
        "video.compress": {"exchange": "video_unit", "exchange_type": "topic",
                           "routing_key": "video.compress"},
        "cache.reset": {"queue": "bc_unit", "exchange": "bc_unit"},
        "own.task": {"queue": own, "routing_key": "own.a"},
    }
    try:
        router = routing.AppRouter(app, allow_unknown=True)
        video = router.destination(_row("video.compress"))
        assert (video.exchange, video.routing_key, video.queue) == (
            "video_unit", "video.compress", routing.NOTHING_DECLARED)
        assert router.spec(video.queue).no_declare
        bcast = router.destination(_row("cache.reset"))
        assert (bcast.exchange, bcast.routing_key) == ("bc_unit", "")
        assert router.spec(bcast.queue).no_declare
        mine = router.destination(_row("own.task"))
        assert (mine.exchange, mine.routing_key, mine.max_priority) == ("x_own_unit", "own.a", 5)
        spec = router.spec(mine.queue)
        assert (spec.name, spec.arguments) == ("q_unit", {"x-max-priority": 5})
        assert [(b.exchange.name, b.exchange.type, b.routing_key) for b in spec.bindings] == [
            ("x_own_unit", "topic", "own.#")]
        # The app's own q_unit (plain, default exchange) keeps its own declaration.
        plain = router.destination(_row("other.task", queue="q_unit"))
        assert plain.queue != mine.queue
        assert (router.spec(plain.queue).name, router.spec(plain.queue).arguments) == (
            "q_unit", None)
    finally:
        app.close()


def test_unknown_tasks(app: Celery) -> None:
    with pytest.raises(routing.UnknownTask, match=r"nobody\.knows"):
        routing.AppRouter(app).destination(_row("nobody.knows"))
    allowed = routing.AppRouter(app, allow_unknown=True).destination(_row("nobody.knows"))
    assert (allowed.queue, allowed.ignore_result) == (N["default"], None)  # as send_task


def test_static_routes_are_cached() -> None:
    app = Celery("static_unit", set_as_current=False)
    app.conf.task_routes = {"a.*": {"queue": "qa"}}
    try:
        router = routing.AppRouter(app, allow_unknown=True)
        assert router.static
        first = router.destination(_row("a.one", args="[1]"))
        assert router.destination(_row("a.one", args="[2]")) is first
        assert first.queue == "qa"
        assert router.destination(_row("b.one")).queue == "celery"
    finally:
        app.close()


def test_a_router_functions_answers_are_asked_per_row_and_reused_per_answer() -> None:
    app = Celery("function_unit", set_as_current=False)
    asked: list[int] = []
    fresh = Queue("fresh_unit")

    def by_size(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                **_: Any) -> Any:
        asked.append(args[0])
        if args[0] > 100:
            return {"queue": "big_unit", "priority": 3}
        if args[0] < 0:
            return {"queue": fresh}  # a Queue of its own: not the app's, never cached
        return None

    app.conf.task_routes = [by_size]
    try:
        router = routing.AppRouter(app, allow_unknown=True)
        assert not router.static
        sizes = [1, 500, 2, 700, -1, 3, 900, -2]
        found = [router.destination(_row("a.one", args=f"[{n}]")) for n in sizes]
        assert asked == sizes  # the function runs for every row
        assert [(d.queue, d.priority) for d in found] == [
            ("celery", 0), ("big_unit", 3), ("celery", 0), ("big_unit", 3),
            ("fresh_unit", 0), ("celery", 0), ("big_unit", 3), ("fresh_unit", 0)]
        # One answer, one Destination: what the routed options become is worked out once.
        assert found[1] is found[3] is found[6]
        assert found[0] is found[2] is found[5]
        assert found[4] is not found[7]
    finally:
        app.close()


def test_load_finds_the_app_as_celery_does() -> None:
    assert celery_app.load("tests.routing_app:app") is routing_app.app
    assert celery_app.load("tests.routing_app") is routing_app.app  # its `app` attribute
    with pytest.raises(ConfigError, match="cannot load"):
        celery_app.load("tests.no_such_module_here")
    with pytest.raises(ConfigError, match="is not a Celery app"):
        celery_app.load("tests.routing_app:names")

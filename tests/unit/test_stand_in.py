"""drain.celery.stand_in and what the piles make of it (drain.daemon.piles): a router
function that routes without looking at the arguments holds its rows by route."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from celery import Celery

from drain.broker.outgoing import PauseKey
from drain.celery import routing
from drain.celery.stand_in import Looked, StandIn, ignores_arguments
from drain.daemon import piles
from drain.daemon.holds import Holds
from drain.postgres.rows import StagedRow

Route = Callable[[str, Any, Any, Any], Any]

#: Router functions, each looking at the arguments in its own way.
LOOKS: dict[str, Route] = {
    "an item": lambda name, args, kwargs, options: {"queue": "q"} if args[0] else None,
    "a get": lambda name, args, kwargs, options: kwargs.get("user") and {"queue": "q"},
    "in": lambda name, args, kwargs, options: {"queue": "q"} if "vip" in kwargs else None,
    "its truth": lambda name, args, kwargs, options: {"queue": "q"} if kwargs else None,
    "its length": lambda name, args, kwargs, options: {"queue": "q"} if len(args) else None,
    "a comparison": lambda name, args, kwargs, options: None if kwargs == {} else "q",
    "isinstance": lambda name, args, kwargs, options: isinstance(args, list) and "q",
    "a Mapping check": lambda name, args, kwargs, options: isinstance(kwargs, Mapping) and "q",
    "an unpacking": lambda name, args, kwargs, options: {**kwargs} and "q",
    "iteration": lambda name, args, kwargs, options: any(a for a in args) and "q",
    "json": lambda name, args, kwargs, options: json.dumps(kwargs) and "q",
    "a format": lambda name, args, kwargs, options: f"q_{args}",
    "a copy": lambda name, args, kwargs, options: copy.deepcopy(kwargs) and "q",
    "a dict key": lambda name, args, kwargs, options: {kwargs: "q"}[kwargs],
}


def _task(*args: Any) -> None:
    """Never run: only routed."""


def _app(route: Route) -> Iterator[Celery]:
    app = Celery("stand_in_unit", set_as_current=False)
    app.conf.task_routes = [lambda name, args, kwargs, options, task=None, **_:
                            route(name, args, kwargs, options)]
    app.task(name="t.one", shared=False)(_task)
    try:
        yield app
    finally:
        app.close()


def _asks(route: Route) -> bool:
    for app in _app(route):
        router = app.amqp.router
        return ignores_arguments(router, "t.one", {}, app.tasks["t.one"])
    raise AssertionError("unreachable")


@pytest.mark.parametrize("how", sorted(LOOKS))
def test_a_router_that_looks_at_the_arguments_is_seen_to(how: str) -> None:
    assert not _asks(LOOKS[how])


def test_a_router_that_routes_by_name_and_options_does_not_look() -> None:
    assert _asks(lambda name, args, kwargs, options: {"queue": "q"} if name == "t.one" else None)
    assert _asks(lambda name, args, kwargs, options: options.get("queue") and None)
    assert _asks(lambda name, args, kwargs, options: args is None or "q")  # identity: unseen


def test_a_router_that_raises_or_catches_what_it_looked_at_counts_as_looking() -> None:
    def raises(name: str, args: Any, kwargs: Any, options: Any) -> Any:
        raise RuntimeError("down")

    def swallows(name: str, args: Any, kwargs: Any, options: Any) -> Any:
        try:
            return {"queue": kwargs["user"]}
        except Exception:
            return "q"

    assert not _asks(raises)
    assert not _asks(swallows)


def test_a_stand_in_refuses_every_use() -> None:
    used = StandIn()
    with pytest.raises(Looked):
        used.keys()
    assert used.used
    assert not StandIn().used


def _row(row_id: int, task: str, args: str = "[]") -> StagedRow:
    return StagedRow(row_id, uuid.uuid4(), task, args, "{}", "celery", unrouted=True)


def test_uniform_routes_need_one_key_per_route_and_a_router_that_does_not_look() -> None:
    """uniform_routes: a route whose batch rows all went to a paused key, and that the
    app routes there without the arguments, is held by route; one whose rows went
    apart, or whose router looks at the arguments, is not."""
    refused, other = PauseKey("refused"), PauseKey("other")

    def route(name: str, args: Any, kwargs: Any, options: Any) -> Any:
        if name == "t.by_name":
            return {"queue": "refused"}
        if name == "t.by_args":
            return {"queue": "refused" if args[0] else "other"}
        return None

    for app in _app(route):
        for name in ("t.by_name", "t.by_args"):
            app.task(name=name, shared=False)(_task)
        router = routing.AppRouter(app)
        paused = {refused}
        by_name = [(_row(1, "t.by_name"), "refused", refused),
                   (_row(2, "t.by_name"), "refused", refused)]
        by_args = [(_row(3, "t.by_args", "[1]"), "refused", refused)]
        assert piles.uniform_routes(router, by_name + by_args, paused) == {
            piles.route_key(by_name[0][0])}
        apart = [*by_name, (_row(4, "t.by_name"), "other", other)]  # a change of mind
        assert piles.uniform_routes(router, apart, paused) == set()
        assert piles.uniform_routes(router, by_name, set()) == set()  # nothing paused


def test_recheck_lets_a_route_go_with_its_rows_when_the_answer_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = PauseKey("refused")
    answer = {"queue": "refused"}

    def route(name: str, args: Any, kwargs: Any, options: Any) -> Any:
        return dict(answer)

    for app in _app(route):
        router = routing.AppRouter(app)
        holds, held = Holds(), piles.HeldKeys()
        holds.pause(refused, "refused")
        rows = [_row(i, "t.one") for i in (1, 2)]
        for row in rows:
            holds.rows[row.id] = refused
            held.hold(row, refused, by_route=True, asked=True)
        monkeypatch.setattr(piles, "RECHECK", 0.0)
        assert not held.recheck(router, holds)  # the same answer: still held by route
        assert set(held.routes) == {piles.route_key(rows[0])}
        answer["queue"] = "elsewhere"
        assert held.recheck(router, holds)  # let go: the marks must go back
        assert held.routes == {} and held.asked == {}
        assert holds.rows == {}  # its rows are fetched and routed again

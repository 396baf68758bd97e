"""Celery routing configurations drawn from a seed, for the differential routing test.

:func:`generate` draws apps (as JSON-able specs, so that ``drain run --app
tests.differential_app`` in another process builds the very same app from the
spec file) and rows to stage for each; :func:`build_app` turns a spec into a
Celery app. Every ``task_routes`` form is drawn: one dict, a list of items,
exact names, glob and regex keys, a list of (pattern, route) pairs, router
functions (returning a queue name, a dict with or without queue / exchange /
exchange_type / routing_key / priority, a dict holding a kombu ``Queue``
or ``Exchange`` object, or nothing), a router given by its dotted path and a pre-4.0 router
class; ``task_queues`` with direct, topic and fanout exchanges, extra
bindings, priority and quorum queues, ``Broadcast``; tasks with their own
queue, routing key, exchange and priority; the ``task_default_queue`` /
``_exchange`` / ``_exchange_type`` / ``_routing_key`` settings. Rows are staged
with and without a queue (explicit ``celery``, a queue of the app, a queue the
app does not define, a row marked ``queue_legacy``), with negative ids and ids
handed out again after an identity restart; each app also gets a row of a task
it does not register (``"unknown"``).

App 0 is always :func:`bullets`: one of each shape issue 24 names.
"""

from __future__ import annotations

import random
import re
from typing import Any

from celery import Celery, Task
from kombu.common import Broadcast
from kombu.entity import Exchange, Queue, binding

#: Exchange types drawn for queues and routes.
TYPES = ("direct", "topic", "fanout")


# -- building an app from its spec --------------------------------------------------


def build_queue(spec: dict[str, Any]) -> Queue:
    """A kombu Queue (or Broadcast) from its spec."""
    if spec.get("broadcast"):
        return Broadcast(spec["broadcast"])
    kwargs: dict[str, Any] = {}
    if spec.get("exchange"):
        kwargs["exchange"] = Exchange(spec["exchange"]["name"], type=spec["exchange"]["type"])
        kwargs["routing_key"] = spec.get("routing_key")
    if spec.get("arguments"):
        kwargs["queue_arguments"] = dict(spec["arguments"])
    if spec.get("max_priority"):
        kwargs["max_priority"] = spec["max_priority"]
    if spec.get("durable") is False:
        kwargs["durable"] = False  # a transient queue
    if spec.get("bindings"):
        kwargs["bindings"] = [binding(Exchange(b["exchange"]["name"], type=b["exchange"]["type"]),
                                      routing_key=b["routing_key"]) for b in spec["bindings"]]
    return Queue(spec["name"], **kwargs)


def build_route(value: dict[str, Any]) -> Any:
    """A route as task_routes or a router gives it: a queue name or a dict (new
    objects every time, as a router function that builds them per call)."""
    if "name" in value:
        return value["name"]
    route = dict(value["dict"])
    if isinstance(route.get("queue"), dict):
        route["queue"] = build_queue(route["queue"])
    if isinstance(route.get("exchange"), dict):
        route["exchange"] = Exchange(route["exchange"]["name"], type=route["exchange"]["type"])
    return route


def _key(key: Any) -> Any:
    return re.compile(key["regex"]) if isinstance(key, dict) else key


def _conditional(task: str, when: int | None, value: dict[str, Any]) -> Any:
    def router(name: str, args: Any, kwargs: Any, options: Any, task_type: Any = None,
               **_: Any) -> Any:
        if name != task:
            return None
        if when is not None and int(kwargs.get("n", 0)) % 2 != when:
            return None
        return build_route(value)

    return router


def path_router(name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                **_: Any) -> Any:
    """A router given in task_routes by its dotted path."""
    if name.endswith(".viapath"):
        return {"queue": name.replace(".", "_") + "_q", "routing_key": "via.path"}
    return None


class OldStyleRouter:
    """A pre-4.0 router class (``route_for_task``), which Celery still accepts."""

    def route_for_task(self, task: str, args: Any = None, kwargs: Any = None) -> Any:
        if task.endswith(".oldstyle"):
            return {"queue": task.replace(".", "_") + "_q"}
        return None


def build_app(spec: dict[str, Any], broker_url: str) -> Celery:
    """The Celery app of ``spec`` (see :func:`generate`)."""
    app = Celery(spec["name"], broker=broker_url, set_as_current=False)
    items: list[Any] = []
    for item in spec["routes"]:
        kind = item["kind"]
        if kind == "map":
            items.append({_key(k): build_route(v) for k, v in item["entries"]})
        elif kind == "pairs":
            items.append([(_key(k), build_route(v)) for k, v in item["entries"]])
        elif kind == "function":
            items.append(_conditional(item["task"], item.get("when"), item["returns"]))
        elif kind == "path":
            items.append("tests.route_shapes.path_router")
        elif kind == "oldstyle":
            items.append(OldStyleRouter())
    routes: Any = items[0] if len(items) == 1 and isinstance(items[0], dict) else items
    conf: dict[str, Any] = {"task_serializer": "json", "accept_content": ["json"],
                            "task_routes": routes, **spec["settings"]}
    if spec["queues"]:
        conf["task_queues"] = [build_queue(q) for q in spec["queues"]]
    app.conf.update(conf)
    for task in spec["tasks"]:
        def run(*args: Any, **kwargs: Any) -> None:
            return None

        options = dict(task["options"])
        if task.get("shadow") == "base":
            options["base"] = ShadowTask
        elif task.get("shadow") == "option":
            options["shadow_name"] = shadow_name
        app.task(name=task["name"], shared=False, **options)(run)
    return app


def shadow_name(task: Any, args: Any, kwargs: Any, options: Any) -> str:
    """A shadow name from the call, as ``@app.task(shadow_name=...)`` gives it."""
    return f"{task.name}~{args[0] if args else '-'}~{sorted(kwargs or {})}"


class ShadowTask(Task):  # type: ignore[misc]  # celery ships no type hints
    """A task class that names its calls in logs and monitoring (``shadow_name``)."""

    def shadow_name(self, args: Any, kwargs: Any, options: Any) -> str:
        return f"shadow.{self.name}.{len(args or ())}"


# -- drawing specs --------------------------------------------------------------------


class _Draw:
    """Draws the parts of one app; names are unique within the app."""

    def __init__(self, rng: random.Random, index: int) -> None:
        self.rng = rng
        self.index = index
        self.count = 0
        #: Exchanges routes name without a queue: a worker would have declared
        #: them (the test declares them, as it declares nothing else).
        self.external: dict[str, str] = {}
        self.queues: list[dict[str, Any]] = []

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.index}x{self.count}"

    def exchange(self) -> dict[str, str]:
        return {"name": self.fresh("qx"), "type": self.rng.choice(TYPES)}

    def queue(self, prefix: str = "q") -> dict[str, Any]:
        rng = self.rng
        spec: dict[str, Any] = {"name": self.fresh(prefix)}
        if rng.random() < 0.7:
            spec["exchange"] = self.exchange()
            spec["routing_key"] = rng.choice([spec["name"], self.fresh("rk"), "k.#", None])
        roll = rng.random()
        if roll < 0.15:
            spec["arguments"] = {"x-queue-type": "quorum"}
        elif roll < 0.35:
            spec["max_priority"] = rng.choice([5, 10])
        elif roll < 0.45:
            spec["arguments"] = {"x-message-ttl": 600000}
        if rng.random() < 0.25:
            spec["bindings"] = [{"exchange": self.exchange(), "routing_key": self.fresh("b")}]
        return spec

    def external_exchange(self) -> tuple[str, str]:
        if self.external and self.rng.random() < 0.4:
            name = self.rng.choice(sorted(self.external))
            return name, self.external[name]
        name, kind = self.fresh("ext"), self.rng.choice(TYPES)
        self.external[name] = kind
        return name, kind

    def queue_name(self) -> str:
        """A queue of the app (by name, or a Broadcast's by its alias)."""
        spec = self.rng.choice(self.queues)
        return str(spec.get("broadcast") or spec["name"])

    def route(self) -> dict[str, Any]:
        """A route value (see :func:`build_route`)."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.15:
            return {"name": self.queue_name()}
        if roll < 0.22:
            return {"name": self.fresh("missing")}  # task_create_missing_queues
        route: dict[str, Any] = {}
        shape = rng.choice(["queue", "queue", "object", "exchange", "exchange_no_type"])
        if shape == "queue":
            route["queue"] = self.queue_name()
        elif shape == "object":
            route["queue"] = self.queue("obj")
        else:
            name, kind = self.external_exchange()
            # The exchange by name, or as a kombu Exchange object.
            route["exchange"] = name if rng.random() < 0.75 else {"name": name, "type": kind}
            if shape == "exchange":
                route["exchange_type"] = kind
            # A direct exchange needs a routing key, else apply_async sends to ''
            # with none (nowhere); so does the drain, and the row stays staged.
            if kind == "direct" or shape == "exchange_no_type" or rng.random() < 0.7:
                route["routing_key"] = self.fresh("rk")
        if "queue" in route:
            if rng.random() < 0.3:
                route["routing_key"] = self.fresh("rk")
            if rng.random() < 0.2:
                name, kind = self.external_exchange()
                route["exchange"] = name
                if rng.random() < 0.5:
                    route["exchange_type"] = kind
        if rng.random() < 0.3:
            route["priority"] = rng.choice([0, 3, 9])
        return {"dict": route}


def _settings(draw: _Draw) -> dict[str, Any]:
    rng = draw.rng
    settings: dict[str, Any] = {}
    if rng.random() < 0.6:
        settings["task_default_queue"] = draw.fresh("dq")
    if rng.random() < 0.4:
        settings["task_default_exchange"] = draw.fresh("dx")
        settings["task_default_exchange_type"] = rng.choice(["direct", "topic"])
        draw.external[settings["task_default_exchange"]] = settings["task_default_exchange_type"]
    if rng.random() < 0.4:
        settings["task_default_routing_key"] = draw.fresh("drk")
    if rng.random() < 0.2:
        settings["task_default_priority"] = rng.choice([0, 4])
    return settings


def _task_options(draw: _Draw, *, own: bool) -> dict[str, Any]:
    """A task's own publishing options (``own``: always some)."""
    rng = draw.rng
    options: dict[str, Any] = {}
    if own and rng.random() < 0.25:
        # The task's own exchange and routing key, no queue of its own.
        options["exchange"], _ = draw.external_exchange()
        options["routing_key"] = draw.fresh("rk")
    elif own or rng.random() < 0.15:
        options["queue"] = draw.queue_name()
        if rng.random() < 0.3:
            options["routing_key"] = draw.fresh("rk")
        if rng.random() < 0.3:
            options["priority"] = rng.choice([1, 6])
    return options


KINDS = ("none", "task", "exact", "glob", "regex", "pairs", "function", "function",
         "conditional", "path", "oldstyle")


def app_spec(rng: random.Random, index: int) -> dict[str, Any]:
    """One app with its tasks and routes, and the rows to stage for it."""
    draw = _Draw(rng, index)
    settings = _settings(draw)
    draw.queues = [draw.queue() for _ in range(rng.randint(2, 5))]
    if rng.random() < 0.4:
        draw.queues.append({"name": "", "broadcast": draw.fresh("bc")})
        draw.external[draw.queues[-1]["broadcast"]] = "fanout"
    routes: list[dict[str, Any]] = []
    mapping: list[tuple[Any, dict[str, Any]]] = []
    tasks: list[dict[str, Any]] = []
    for _ in range(rng.randint(8, 14)):
        kind = rng.choice(KINDS)
        name = draw.fresh("t") + "." + {"path": "viapath", "oldstyle": "oldstyle"}.get(kind, "job")
        options = _task_options(draw, own=kind == "task")
        if kind == "exact":
            mapping.append((name, draw.route()))
        elif kind == "glob":
            mapping.append((name.rsplit(".", 1)[0] + ".*", draw.route()))
        elif kind == "regex":
            mapping.append(({"regex": "^" + re.escape(name.split(".")[0]) + r"\.(job|other)$"},
                            draw.route()))
        elif kind == "pairs":
            routes.append({"kind": "pairs", "entries": [(name, draw.route())]})
        elif kind in ("function", "conditional"):
            routes.append({"kind": "function", "task": name, "returns": draw.route(),
                           "when": rng.randint(0, 1) if kind == "conditional" else None})
        elif kind in ("path", "oldstyle") and not any(r["kind"] == kind for r in routes):
            routes.append({"kind": kind})
        tasks.append({"name": name, "options": options})
    if mapping:
        routes.insert(rng.randint(0, len(routes)), {"kind": "map", "entries": mapping})
    return {"name": f"diff{index}", "settings": settings, "queues": draw.queues,
            "routes": routes, "tasks": tasks, "external": draw.external,
            "rows": [*_rows(draw, tasks), unknown(index)]}


def unknown(index: int) -> dict[str, Any]:
    """A row whose task the app does not register: dead-lettered 'unknown_task'."""
    return {"task": f"nobody.registered{index}", "args": [], "kwargs": {}, "queue": None,
            "legacy": False, "id": None, "unknown": True}


def _rows(draw: _Draw, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for every task: with and without a queue, some with negative ids."""
    rng = draw.rng
    rows: list[dict[str, Any]] = []
    for task in tasks:
        for _ in range(rng.randint(1, 3)):
            queue, legacy = rng.choice([(None, False), (None, False), ("celery", False),
                                        ("celery", True), ("app", False), ("missing", False)])
            if queue == "app":
                queue = draw.queue_name()
            elif queue == "missing":
                queue = draw.fresh("rowq")
            rows.append({"task": task["name"], "args": [rng.randint(0, 99)],
                         "kwargs": {"n": rng.randint(0, 9)}, "queue": queue, "legacy": legacy,
                         "id": -rng.randint(1, 10**9) if rng.random() < 0.25 else None})
    return rows


def bullets(index: int = 0) -> dict[str, Any]:
    """Issue 24's shapes, in every run whatever the seed."""
    video = {"dict": {"exchange": f"video{index}", "exchange_type": "topic",
                      "routing_key": "video.compress"}}
    own = {"name": f"own{index}", "exchange": {"name": f"ownx{index}", "type": "topic"},
           "routing_key": "own.#", "arguments": {"x-message-ttl": 600000}}
    made = {"name": f"made{index}", "exchange": {"name": f"madex{index}", "type": "direct"},
            "routing_key": f"made{index}", "max_priority": 7}
    tasks: list[dict[str, Any]] = [{"name": name, "options": {}} for name in (
        "video.compress", "own.object", "made.by.router", "reload.cache", "plain.default")]
    return {
        "name": f"bullets{index}",
        "settings": {"task_default_queue": f"default{index}"},
        "queues": [{"name": f"default{index}"}, {"name": "", "broadcast": f"bcast{index}"}],
        "routes": [
            {"kind": "map", "entries": [
                ("video.compress", video),
                ("own.object", {"dict": {"queue": own}}),
                ("reload.cache", {"dict": {"queue": f"bcast{index}",
                                           "exchange": f"bcast{index}"}}),
            ]},
            {"kind": "function", "task": "made.by.router", "when": None,
             "returns": {"dict": {"queue": made, "routing_key": f"made{index}"}}},
        ],
        "tasks": tasks,
        "external": {f"video{index}": "topic", f"bcast{index}": "fanout"},
        "rows": [
            *({"task": t["name"], "args": [1], "kwargs": {}, "queue": None, "legacy": False,
               "id": None} for t in tasks),
            # An explicit celery, a negative id: apply_async(queue='celery').
            {"task": "plain.default", "args": [2], "kwargs": {}, "queue": "celery",
             "legacy": False, "id": -5},
            {"task": "video.compress", "args": [3], "kwargs": {}, "queue": "celery",
             "legacy": False, "id": None},
            # Staged before the upgrade without a queue: routed by task_routes.
            {"task": "video.compress", "args": [4], "kwargs": {}, "queue": "celery",
             "legacy": True, "id": -6},
            unknown(index),
        ],
    }


def generate(seed: int, apps: int) -> list[dict[str, Any]]:
    """:func:`bullets`, then ``apps - 1`` apps drawn from ``seed``."""
    rng = random.Random(seed)
    return [bullets(), *(app_spec(rng, i) for i in range(1, apps))]

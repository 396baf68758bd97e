"""Where the user's Celery app sends each task, and how it declares its queues.

With ``drain run --app``, each staged row is sent where, and as,
``task.apply_async(args, kwargs, task_id=...)`` of that app would send it:

1. The options ``apply_async`` starts from: the registered task's own
   publishing attributes (``queue``, ``routing_key``, ``exchange``,
   ``priority``, ``time_limit``, ``soft_time_limit``... which Celery fills in
   from the app's ``task_default_priority``, ``task_time_limit``...), and the
   row's queue when it names one.
2. Celery's own router, ``app.amqp.router.route(options, name, args, kwargs,
   task)``: ``task_routes`` in every form (dicts, globs, regexes, router
   functions), ``task_queues`` (a queue name resolves to the app's kombu
   ``Queue``, its exchange and routing key), ``task_default_queue`` and
   ``task_create_missing_queues``.
3. What Celery's ``send_task_message`` then does with the routed options
   (:func:`publish_target`): a direct exchange without a routing key goes
   through the default exchange ``''`` with the queue's name, anything else to
   the route's (or the queue's) exchange and routing key. A route may name an
   exchange and no queue (Celery's documented ``{'exchange': 'video',
   'exchange_type': 'topic', 'routing_key': 'video.compress'}``): the message
   goes to that exchange with that key.

What ``send_task_message`` declares is declared, nothing more
(:meth:`AppRouter.spec`): the routed kombu ``Queue`` itself, whether the app's
``task_queues`` hold it or a route gives it as an object (its exchange with
its type, the queue with its arguments, ``x-queue-type``, ``x-max-priority``,
TTLs..., its bindings); nothing for a ``Broadcast`` queue (its ``bcast.<uuid>``
queue is each worker's own) nor for a route with an exchange and no queue.

A row staged without a queue (``queue`` NULL, or ``'celery'`` staged before
``drain migrate`` made "no queue given" NULL, ``queue_legacy``:
:attr:`StagedRow.unrouted`) is
routed like ``apply_async`` without ``queue=``; any other queue, ``'celery'``
included, is ``apply_async(queue=...)``.

Routing costs a call into Celery per row only when the app has router
functions (which may look at the arguments); routes that are plain mappings
give one answer per (task name, queue), cached. With router functions, what
does not depend on the row is still worked out once: the task's options per
(task name, queue), and what a routed answer (queue, exchange, routing key,
priority) becomes, per answer; only the router itself runs per row.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from typing import Any

from celery import Celery, Task
from celery.app.routes import MapRoute
from kombu.common import Broadcast
from kombu.entity import Exchange, Queue
from kombu.transport.base import to_rabbitmq_queue_arguments

from drain.broker import outgoing
from drain.broker.queue_declare import BindingSpec, ExchangeSpec, QueueSpec
from drain.celery import celery_app, encoding, stand_in
from drain.celery.message import Destination
from drain.postgres.rows import StagedRow
from drain.settings.config import Settings

log = logging.getLogger("drain.routing")

#: The task attributes ``apply_async`` starts its options from (Celery's
#: ``extract_exec_options``), read as the public attributes they are.
EXEC_OPTIONS = (
    "queue", "routing_key", "exchange", "priority", "expires", "serializer",
    "delivery_mode", "compression", "time_limit", "soft_time_limit", "immediate", "mandatory",
)


class UnknownTask(Exception):
    """The row's task is not registered in the app."""


#: The declaration key (:attr:`Destination.queue`) of a message for which
#: nothing is declared (a ``Broadcast`` route, a route with an exchange and no
#: queue): its pauses are keyed by its exchange and routing key instead.
NOTHING_DECLARED = outgoing.NOTHING_DECLARED


def of_settings(settings: Settings) -> AppRouter | None:
    """The router of ``settings.celery_app`` (loaded now), or None without one."""
    if not settings.celery_app:
        return None
    return AppRouter(celery_app.load(settings.celery_app),
                     allow_unknown=settings.allow_unknown_tasks)


class AppRouter:
    """Routes rows as one Celery app's ``apply_async`` does."""

    def __init__(self, app: Celery, *, allow_unknown: bool = False) -> None:
        encoding.check_app(app)  # raises ConfigError: its workers could not take our messages
        self.app = app
        self.allow_unknown = allow_unknown
        self._tasks = app.tasks
        #: Plain mapping routes only: the answer depends on the task name and queue.
        self.static = all(isinstance(route, MapRoute) for route in app.amqp.routes)
        self._cache: dict[tuple[str, str | None], Destination] = {}
        #: What each declaration key (:attr:`Destination.queue`) declares.
        self._specs: dict[str, QueueSpec] = {
            NOTHING_DECLARED: QueueSpec(NOTHING_DECLARED, no_declare=True)}
        self._starts: dict[tuple[str, str | None], _Start] = {}
        # Both are the app's for good once it is finalized (cached properties).
        self._router = app.amqp.router
        self._queues = app.amqp.queues
        self._answers: dict[tuple[str, tuple[Any, ...]], Destination] = {}
        self._repr_limits = (int(app.amqp.argsrepr_maxsize), int(app.amqp.kwargsrepr_maxsize),
                             int(app.conf.task_repr_maxlevels))

    def destination(self, row: StagedRow) -> Destination:
        """Where ``apply_async`` sends this row's task (raises :class:`UnknownTask`)."""
        queue = None if row.unrouted else row.queue
        if self.static:  # one answer per (task name, queue), once it is known
            cached = self._cache.get((row.task_name, queue))
            if cached is not None:
                return cached
            return self._routed(row.task_name, queue, (), {})
        # Router functions may look at the arguments.
        return self._routed(row.task_name, queue, json.loads(row.args_json),
                            json.loads(row.kwargs_json))

    def uniform(self, task_name: str, queue: str | None) -> Destination | None:
        """Where every row of ``task_name`` staged for ``queue`` (None: staged
        without one) goes now, when that does not depend on the row: always with
        plain mapping routes; with router functions, when none of them looked at
        the arguments (drain.celery.stand_in). None otherwise: a router that
        looks, or raises, and a task the app does not know."""
        try:
            start = self._start_of(task_name, queue)
            if not self.static and not stand_in.ignores_arguments(
                    self._router, task_name, start.options, start.task):
                return None
            return self._routed(task_name, queue, (), {})
        except Exception:
            return None

    def _start_of(self, name: str, queue: str | None) -> _Start:
        start = self._starts.get((name, queue))
        if start is None:
            start = self._starts[(name, queue)] = self._start(name, queue)
        return start

    def _routed(self, name: str, queue: str | None, args: Any, kwargs: Any) -> Destination:
        key = (name, queue)
        if self.static:
            cached = self._cache.get(key)
            if cached is not None:
                return cached  # (uniform() asks for a static app's routes here)
        start = self._start_of(name, queue)
        routed = self._router.route(dict(start.options), name, args, kwargs, start.task)
        answer = self._answer_key(routed)
        if answer is not None:
            cached = self._answers.get((name, answer))
            if cached is not None:
                return cached
        found = self._destination(start, routed)
        if self.static:
            self._cache[key] = found
        elif answer is not None:
            self._answers[(name, answer)] = found
        return found

    def spec(self, key: str) -> QueueSpec:
        """What is declared for the messages of declaration key ``key`` (a
        :attr:`Destination.queue` this router gave): what kombu's ``Queue.declare``
        sends for the routed queue."""
        return self._specs[key]

    def _declaration_key(self, queue: Queue | None) -> str:
        """The key :meth:`spec` declares ``queue`` by: its name, unless another
        queue of that name but declared otherwise (a kombu ``Queue`` given by a
        route) came first."""
        if queue is None:
            return NOTHING_DECLARED
        spec = queue_spec(queue)
        key, n = str(queue.name), 1
        while self._specs.setdefault(key, spec) != spec:
            n += 1
            key = f"{queue.name} (declared otherwise, #{n})"
        return key

    def _start(self, name: str, queue: str | None) -> _Start:
        """What ``apply_async`` starts from for task ``name`` (raises UnknownTask)."""
        task = self._tasks.get(name)
        if task is None and not self.allow_unknown:
            raise UnknownTask(f"task {name!r} is not registered in the Celery app "
                              f"{self.app.main!r}")
        # Task.apply_async: dict(task exec options, **options), then send_task.
        options: dict[str, Any] = (
            {option: getattr(task, option, None) for option in EXEC_OPTIONS}
            if task is not None else {}
        )
        if queue is not None:
            options["queue"] = queue
        time_limit = options.pop("time_limit", None)
        soft_time_limit = options.pop("soft_time_limit", None)
        options.pop("expires", None)  # the row's expires_at decides (drain.celery.message)
        ignore_result = getattr(task, "ignore_result", None) if task is not None else None
        # Celery's own shadow_name gives None: called per row only where a task has its own.
        own_shadow = (task is not None and isinstance(task, Task)
                      and getattr(type(task), "shadow_name", None) is not Task.shadow_name)
        return _Start(task, options, (_header_number(time_limit),
                                      _header_number(soft_time_limit)),
                      None if ignore_result is None else bool(ignore_result),
                      task.shadow_name if own_shadow else None)

    def _answer_key(self, routed: dict[str, Any]) -> tuple[Any, ...] | None:
        """``routed`` as a cache key, or None when it holds something that cannot be
        one (a kombu Queue other than the app's own, an Exchange, a dict...)."""
        items: list[tuple[str, Any]] = []
        for name, value in routed.items():
            if isinstance(value, Queue):
                if self._queues.get(value.name) is not value:
                    return None
                items.append((name, ("queue", value.name)))
            elif isinstance(value, (str, int, float, bool, type(None))):
                items.append((name, value))
            else:
                return None
        return tuple(sorted(items))

    def _destination(self, start: _Start, routed: dict[str, Any]) -> Destination:
        declared, exchange, routing_key = publish_target(self.app, routed)
        key = self._declaration_key(declared)
        arguments = self.spec(key).arguments or {}
        # Celery's router drops a None priority when it merges a route (kombu then
        # publishes 0) and keeps it when it returns the options as they came (no
        # priority property at all): the same here.
        priority = routed.get("priority", 0)
        return Destination(
            exchange=exchange,
            routing_key=routing_key,
            queue=key,
            priority=None if priority is None else int(priority),
            max_priority=int(arguments.get("x-max-priority") or 0),
            timelimit=start.timelimit,
            ignore_result=start.ignore_result,
            # send_task_message: the routed options' serializer and compression,
            # else the app's task_serializer and task_compression.
            encoding=encoding.of(self.app, routed.get("serializer"), routed.get("compression")),
            repr_limits=self._repr_limits,
            shadow=start.shadow,
        )


@dataclasses.dataclass(frozen=True)
class _Start:
    """What ``apply_async`` starts from for one (task, queue): the registered task,
    its publishing options, and the options drain sends itself."""

    task: Any
    options: dict[str, Any]
    timelimit: tuple[int | float | None, int | float | None]
    ignore_result: bool | None
    #: The task's own ``shadow_name`` (None: Celery's, which gives no shadow).
    shadow: Any


def publish_target(app: Celery, routed: dict[str, Any]) -> tuple[Queue | None, str, str]:
    """The queue to declare (None: nothing), the exchange and the routing key that
    Celery's ``send_task_message`` makes of the routed options (Celery has no
    public call for it; this follows it step by step).

    The queue is the one the route names (a name of the app's ``task_queues``, or
    a kombu ``Queue`` given by the route), or the app's default queue when the
    route names neither a queue nor an exchange. A direct route (the route's
    ``exchange_type``, else the queue's exchange's type) that lacks its exchange
    or its routing key goes through the default exchange, keyed by the name the
    route gave the queue by; any other route without an exchange takes the
    queue's exchange (else the app's default) and the route's key, else the
    queue's, else the app's default key. A route with an exchange keeps it and
    its routing key. A ``Broadcast`` queue is not declared.
    """
    queue = routed.get("queue")
    exchange = routed.get("exchange")
    routing_key = routed.get("routing_key")
    exchange_type = routed.get("exchange_type")
    queue_name = queue
    if queue is None and exchange is None:
        queue = app.amqp.default_queue
    if queue is not None:
        if isinstance(queue, str):
            queue_name, queue = queue, app.amqp.queues[queue]
        else:
            queue_name = queue.name
    if exchange_type is None:
        try:
            exchange_type = queue.exchange.type  # type: ignore[union-attr]
        except AttributeError:  # no queue, or a queue without an exchange
            exchange_type = "direct"
    if (not exchange or not routing_key) and exchange_type == "direct":
        exchange, routing_key = "", queue_name
    elif exchange is None:
        assert queue is not None  # no exchange: the queue (or the default queue) is set
        exchange = queue.exchange.name or app.amqp.default_exchange
        routing_key = routing_key or queue.routing_key or app.conf.task_default_routing_key
    name = exchange.name if isinstance(exchange, Exchange) else exchange
    declared = queue if isinstance(queue, Queue) and not isinstance(queue, Broadcast) else None
    return declared, str(name or ""), str(routing_key or "")


def queue_spec(queue: Any) -> QueueSpec:
    """A kombu ``Queue`` as drain.broker.queue_declare declares it, as ``Queue.declare`` would.

    kombu declares a copy of the queue bound to its channel (``Queue.bind``), made
    anew from its attributes: the spec is made of such a copy too. (A queue with
    extra bindings loses its main exchange that way, for one: kombu declares and
    binds only the extra ones, even after Celery gave it the app's default exchange.)
    """
    queue = copy.copy(queue)
    arguments = to_rabbitmq_queue_arguments(
        queue.queue_arguments or {}, expires=queue.expires, message_ttl=queue.message_ttl,
        max_length=queue.max_length, max_length_bytes=queue.max_length_bytes,
        max_priority=queue.max_priority,
    )
    bindings: list[BindingSpec] = []
    if queue.exchange is not None and queue.exchange.name:
        bindings.append(BindingSpec(_exchange_spec(queue.exchange), queue.routing_key or "",
                                    queue.binding_arguments or None,
                                    declare_exchange=not queue.exchange.no_declare))
    for binding in queue.bindings:
        if binding.exchange is not None and binding.exchange.name:
            bindings.append(BindingSpec(_exchange_spec(binding.exchange),
                                        binding.routing_key or "", binding.arguments or None,
                                        declare_exchange=not binding.exchange.no_declare))
    return QueueSpec(
        queue.name, durable=bool(queue.durable), exclusive=bool(queue.exclusive),
        auto_delete=bool(queue.auto_delete), arguments=dict(arguments) or None,
        bindings=tuple(bindings), no_declare=bool(queue.no_declare),
    )


def _exchange_spec(exchange: Any) -> ExchangeSpec:
    return ExchangeSpec(exchange.name, type=exchange.type or "direct",
                        durable=bool(exchange.durable), auto_delete=bool(exchange.auto_delete),
                        arguments=exchange.arguments or None)


def _header_number(value: Any) -> int | float | None:
    """A time limit as an AMQP header takes it: pika encodes no floats, so a
    whole float (``30.0``) goes as the integer Celery's own message decodes to."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value  # type: ignore[no-any-return]

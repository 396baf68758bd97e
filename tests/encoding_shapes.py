"""How a Celery app encodes its messages, drawn from a seed, for the differential test.

tests/route_shapes.py draws the routing of each app; :func:`dress` then draws,
from a generator of its own (so that a seed keeps its routing workload), how
the app encodes: ``task_serializer`` (json, pickle, yaml; msgpack when it is
importable, else json) with a matching ``accept_content``, a task's own
``serializer``, ``task_compression`` and a task's own ``compression`` (gzip,
bzip2, zlib, lzma), ``task_repr_maxlevels``, tasks with a ``shadow_name`` (a
Task subclass, or the ``shadow_name=`` option), priorities
(``task_default_priority``, a task's ``priority``, ``task_queue_max_priority``,
a queue's ``max_priority`` or ``x-max-priority`` argument),
``task_create_missing_queue_type`` / ``_exchange_type`` and transient
(non-durable) queues; and for each row a ``priority`` (none, 0, 1..255 or
negative) and arguments whose repr the limits cut: long strings, long lists,
deep nesting, non-ASCII text, compressible strings above the drain's
:data:`MAX_MESSAGE_SIZE` (for compressed tasks), the types kombu's JSON
carries (datetime, date, time, Decimal, UUID and bytes, whatever the
serializer: where it cannot carry one, apply_async raises), kept in the spec in
kombu's own JSON form
(``{"__type__": ..., "__value__": ...}``; :func:`values` gives the Python
values; :data:`STAGE_KOMBU_TYPES` says how such rows are staged). Dict keys
are drawn in the order ``jsonb`` keeps them (shorter first), so that a JSON
body can be byte-identical.

The last app is always :func:`bullets`: one of each shape issue 25 names.
"""

from __future__ import annotations

import datetime as dt
import decimal
import importlib.util
import json
import random
import uuid
from typing import Any

from celery import Signature, signature
from kombu.utils import json as kombu_json

from tests import route_shapes

#: How rows holding the types kombu's JSON carries are staged: True, by
#: ``drain.stage`` with the Python values (it takes them since issue 25's staging
#: change); False, by SQL, in kombu's JSON form.
STAGE_KOMBU_TYPES = True

#: msgpack is drawn only where it is importable (kombu needs the package).
MSGPACK = importlib.util.find_spec("msgpack") is not None

SERIALIZERS = ("json", "json", "pickle", "yaml", "msgpack")

#: The drain's ``--max-message-size`` in the test: a compressible argument above
#: it must be delivered compressed, as apply_async sends it (issue 25: 17 MB that
#: gzip makes 17 KB was dead-lettered 'too_large'), not dead-lettered.
MAX_MESSAGE_SIZE = 64 * 1024
COMPRESSIONS = ("gzip", "bzip2", "zlib", "lzma")


def serializer(name: str) -> str:
    return "json" if name == "msgpack" and not MSGPACK else name


def values(row: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """A row's args and kwargs as the application holds them (kombu's types decoded)."""
    return (kombu_json.loads(json.dumps(row["args"])),
            kombu_json.loads(json.dumps(row["kwargs"])))


def callback(row: dict[str, Any]) -> Signature:
    """The row's ``link``: a signature of the callback it names."""
    return signature(row["link"]["task"], args=row["link"]["args"])


def typed(row: dict[str, Any]) -> bool:
    """Whether the row holds a value only kombu's JSON carries (staged by drain.stage)."""
    return '"__type__"' in json.dumps([row["args"], row["kwargs"]])


# -- drawing -------------------------------------------------------------------------


def _kombu_value(rng: random.Random) -> Any:
    """A value of a type kombu's JSON carries, in kombu's JSON form."""
    kind = rng.choice(["datetime", "datetime_tz", "date", "time", "decimal", "uuid",
                       "bytes"])
    moment = dt.datetime(2020, 1, 1) + dt.timedelta(seconds=rng.randint(0, 10**9),
                                                    microseconds=rng.choice([0, 123456]))
    value: Any = {
        "datetime": moment,
        "datetime_tz": moment.replace(tzinfo=dt.timezone(dt.timedelta(hours=rng.randint(-5, 5)))),
        "date": moment.date(),
        "time": moment.time(),
        "decimal": decimal.Decimal(f"{rng.randint(-10**6, 10**6)}.{rng.randint(0, 99):02d}"),
        "uuid": uuid.UUID(int=rng.getrandbits(128), version=4),
        "bytes": bytes(rng.randrange(32, 127) for _ in range(rng.randint(0, 12))),
    }[kind]
    return json.loads(kombu_json.dumps(value))


def _extra(rng: random.Random) -> tuple[list[Any], dict[str, Any]]:
    """Arguments added to a row (after its own), and kwargs (keys after ``n``). The
    types kombu's JSON carries are drawn whatever the serializer: where it cannot
    carry one (yaml has no UUID, Decimal or time, msgpack no date or time),
    apply_async raises and the drain must dead-letter the row 'invalid'."""
    roll = rng.random()
    if roll < 0.55:
        return [], {}
    if roll < 0.65:
        return ["x" * rng.randint(1000, 3000)], {}
    if roll < 0.72:
        return [list(range(rng.randint(200, 400)))], {}
    if roll < 0.82:
        deep: Any = rng.randint(0, 9)
        for level in range(rng.randint(3, 7)):
            deep = [deep] if level % 2 else {"kk": deep}
        return [deep], {"deep": [[[["x"]]]]}
    if roll < 0.9:
        return ["é€ 😀 ü", 0.5, True, None], {"text": "naïve"}
    kombu = [_kombu_value(rng) for _ in range(rng.randint(1, 3))]
    return kombu[1:], {"when": kombu[0]}


def _quorum(spec: dict[str, Any]) -> bool:
    return "quorum" in json.dumps(spec)


def _task(rng: random.Random, task: dict[str, Any]) -> None:
    """A task's own serializer, compression, priority and shadow name."""
    if rng.random() < 0.15:
        task["options"]["serializer"] = serializer(rng.choice(SERIALIZERS))
    if rng.random() < 0.15:
        task["options"]["compression"] = rng.choice(COMPRESSIONS)
    if rng.random() < 0.1 and "priority" not in task["options"]:
        task["options"]["priority"] = rng.randint(0, 9)
    if rng.random() < 0.15:
        task["shadow"] = rng.choice(["base", "option"])


def _settings(rng: random.Random, spec: dict[str, Any], tasks: list[dict[str, Any]]) -> None:
    settings = spec["settings"]
    app_serializer = serializer(rng.choice(SERIALIZERS))
    if app_serializer != "json" or rng.random() < 0.3:
        settings["task_serializer"] = app_serializer
    for task in tasks:
        _task(rng, task)
    accepted = sorted({app_serializer, *(t["options"].get("serializer", app_serializer)
                                         for t in tasks)})
    if rng.random() < 0.3:
        accepted.append("json")  # json accepted too, not sent
    settings["accept_content"] = sorted(set(accepted))
    if rng.random() < 0.5:
        settings["task_compression"] = rng.choice(COMPRESSIONS)
    if rng.random() < 0.3:
        settings["task_repr_maxlevels"] = rng.choice([1, 2, 5])
    if rng.random() < 0.25:
        settings["task_default_priority"] = rng.randint(0, 9)
    roll = rng.random()
    if roll < 0.25 and not _quorum(spec):
        # Every queue gets x-max-priority: a quorum queue would refuse it.
        settings["task_queue_max_priority"] = rng.choice([5, 10])
    elif roll < 0.4:
        settings["task_create_missing_queue_type"] = "quorum"
    if rng.random() < 0.15 and {"task_default_queue", "task_default_exchange"} <= set(settings):
        # Else the app's default exchange is named as a queue made when missing
        # ('celery' or the default queue) and is direct: apply_async's own
        # declarations would clash.
        settings["task_create_missing_queue_exchange_type"] = rng.choice(["direct", "topic"])


def _queues(rng: random.Random, spec: dict[str, Any]) -> None:
    """Transient queues and ``x-max-priority`` given as an argument."""
    for queue in spec["queues"]:
        if queue.get("broadcast"):
            continue
        roll = rng.random()
        if roll < 0.12 and not _quorum(queue):  # quorum queues are durable
            queue["durable"] = False
        elif roll < 0.24 and not queue.get("arguments") and not queue.get("max_priority"):
            queue["arguments"] = {"x-max-priority": rng.choice([3, 10])}


def _priority(rng: random.Random) -> int | None:
    """A row's priority: None (not given, the column's default 0), or given."""
    roll = rng.random()
    if roll < 0.5:
        return None
    if roll < 0.6:
        return 0
    if roll < 0.8:
        return rng.randint(1, 9)
    if roll < 0.88:
        return rng.randint(10, 255)
    return -rng.randint(1, 50)


def dress(rng: random.Random, spec: dict[str, Any],
          big: random.Random | None = None) -> dict[str, Any]:
    """``spec`` (a routing app) with its encoding drawn from ``rng``; with ``big``
    (a generator of its own, so that ``rng`` draws what it drew before), rows of
    compressed tasks get a compressible argument above :data:`MAX_MESSAGE_SIZE`."""
    _settings(rng, spec, spec["tasks"])
    _queues(rng, spec)
    packed = {t["name"] for t in spec["tasks"]
              if t["options"].get("compression", spec["settings"].get("task_compression"))}
    for row in spec["rows"]:
        args, kwargs = _extra(rng)
        row["args"] = [*row["args"], *args]
        row["kwargs"] = {**row["kwargs"], **kwargs}
        if typed(row):
            row["id"] = None  # drain.stage may stage it, which takes no id
        priority = _priority(rng)
        if priority is not None and not row.get("unknown"):
            row["priority"] = priority
        if big is not None and row["task"] in packed and big.random() < 0.15:
            row["kwargs"] = jsonb_order({**row["kwargs"], "blob": compressible(big)})
    return spec


def compressible(rng: random.Random) -> str:
    """A string 2 to 5 times :data:`MAX_MESSAGE_SIZE` that compresses far below it."""
    return rng.choice("abc") * rng.randint(2 * MAX_MESSAGE_SIZE, 5 * MAX_MESSAGE_SIZE)


def jsonb_order(value: dict[str, Any]) -> dict[str, Any]:
    """A dict's keys in the order ``jsonb`` keeps them: shorter first, then bytewise."""
    return dict(sorted(value.items(), key=lambda item: (len(item[0].encode()),
                                                          item[0].encode())))


def bullets(index: int) -> dict[str, Any]:
    """Issue 25's shapes, in every run whatever the seed: a pickle app with
    gzip; tasks sent with yaml and bzip2, json and lzma, with a shadow name;
    ``task_repr_maxlevels`` 1 and long arguments; a priority queue and a plain
    one with rows of priority 0, 5, 9 and -2; a transient queue; a missing queue
    made as a quorum queue; kombu's JSON types, with pickle, json, yaml and
    msgpack, and with yaml and msgpack where they cannot carry them; rows staged
    as signatures with a ``link`` callback, with each serializer."""
    name = f"enc{index}"
    prio = {"name": f"prio{index}", "max_priority": 5}
    transient = {"name": f"transient{index}", "durable": False}
    tasks: list[dict[str, Any]] = [
        {"name": "enc.pickled", "options": {}},
        {"name": "enc.yaml", "options": {"serializer": "yaml", "compression": "bzip2"}},
        {"name": "enc.json", "options": {"serializer": "json", "compression": "lzma"}},
        {"name": "enc.shadowed", "options": {}, "shadow": "base"},
        {"name": "enc.shadow_option", "options": {"serializer": "json"}, "shadow": "option"},
        {"name": "enc.prio", "options": {"queue": prio["name"]}},
        {"name": "enc.transient", "options": {"queue": transient["name"], "priority": 2}},
    ]

    def row(task: str, args: list[Any], **extra: Any) -> dict[str, Any]:
        return {"task": task, "args": args, "kwargs": extra.pop("kwargs", {}), "queue": None,
                "legacy": False, "id": None, **extra}

    deep = {"kk": [[{"kk": [1]}]]}
    typed = [json.loads(kombu_json.dumps(v)) for v in (
        dt.datetime(2024, 2, 29, 12, 0, 1, 5), dt.date(2024, 3, 1), dt.time(8, 30),
        decimal.Decimal("12.50"), uuid.UUID("5f1d7e4e-8a63-4c1f-9a39-2f3b0e0b7c11"),
        b"raw bytes")]
    rows = [
        row("enc.pickled", [1]),
        row("enc.pickled", [2, "y" * 2000], priority=5),
        row("enc.json", [21], kwargs={"n": 9, "blob": "z" * 3 * MAX_MESSAGE_SIZE}),
        row("enc.pickled", [3, deep], kwargs={"n": 1, "deep": deep}, priority=0),
        row("enc.yaml", [4, "é€"], kwargs={"n": 2}),
        row("enc.json", [5, list(range(300))]),
        row("enc.shadowed", [6], kwargs={"n": 3}),
        row("enc.shadow_option", [7, 8], kwargs={"n": 4}),
        row("enc.prio", [9]),
        row("enc.prio", [10], priority=3),
        row("enc.prio", [11], priority=9),
        row("enc.prio", [12], priority=-2),
        row("enc.transient", [13]),
        {**row("enc.pickled", [14]), "queue": f"made{index}"},
    ]
    # Callbacks (staged as signatures): the same body with json and msgpack; with
    # pickle a known difference; yaml cannot carry a Signature (apply_async raises).
    link = {"task": "enc.json", "args": [1, "cb"]}
    rows += [row("enc.json", [22], kwargs={"n": 10}, link=link),
             row("enc.pickled", [23], link=link, known="pickled callbacks"),
             row("enc.yaml", [24], link=link, known="callbacks with yaml")]
    rows += [row("enc.pickled", [15, *typed[:3]], kwargs={"n": 5, "when": typed[3]}),
             row("enc.json", [16, *typed[3:]], kwargs={"n": 6, "when": typed[0]}),
             row("enc.yaml", [18, typed[0], typed[1], typed[5]]),  # yaml carries these
             row("enc.yaml", [19], kwargs={"n": 8, "when": typed[3]})]  # a Decimal: invalid
    if MSGPACK:
        tasks.append({"name": "enc.msgpack", "options": {"serializer": "msgpack",
                                                         "compression": "zlib"}})
        rows += [row("enc.msgpack", [17, "é", typed[5]], kwargs={"n": 7}, link=link),
                 row("enc.msgpack", [20, typed[4]])]  # a UUID: invalid
    return {
        "name": name,
        "settings": {"task_default_queue": f"default{index}", "task_serializer": "pickle",
                     "accept_content": sorted({serializer(t["options"].get("serializer", "pickle"))
                                               for t in tasks}),
                     "task_compression": "gzip",
                     "task_repr_maxlevels": 1, "task_default_priority": 3,
                     "task_create_missing_queue_type": "quorum"},
        "queues": [{"name": f"default{index}"}, prio, transient],
        "routes": [],
        "tasks": tasks,
        "external": {},
        "rows": [*rows, route_shapes.unknown(index)],
    }


def generate(seed: int, apps: int) -> list[dict[str, Any]]:
    """:func:`route_shapes.generate`'s apps, dressed, and :func:`bullets`."""
    rng, big = random.Random(f"encoding {seed}"), random.Random(f"compressible {seed}")
    specs = route_shapes.generate(seed, apps)
    return [specs[0], *(dress(rng, spec, big) for spec in specs[1:]), bullets(apps)]


def celery_queue(spec: dict[str, Any]) -> tuple[Any, ...]:
    """What decides how an app declares Celery's ``celery`` queue and exchange when a
    row or route names it (apps that differ here cannot share one vhost's)."""
    settings = spec["settings"]
    return tuple(settings.get(f"task_{key}") for key in (
        "create_missing_queue_type", "queue_max_priority", "create_missing_queue_exchange_type"))


def census(specs: list[dict[str, Any]]) -> dict[str, int]:
    """What the specs draw, counted by task or row (for the test's summary line)."""
    counts: dict[str, int] = {}

    def count(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1

    for spec in specs:
        settings = spec["settings"]
        for task in spec["tasks"]:
            options = task["options"]
            count(options.get("serializer", settings.get("task_serializer", "json")))
            packed = options.get("compression", settings.get("task_compression"))
            if packed:
                count(packed)
            if task.get("shadow"):
                count("shadow")
        for key in ("task_queue_max_priority", "task_repr_maxlevels",
                    "task_create_missing_queue_type"):
            if key in settings:
                count(key.removeprefix("task_"))
        for row in spec["rows"]:
            if row.get("priority") is not None:
                count("row priority")
            if typed(row):
                count("kombu types")
            if "blob" in row["kwargs"]:
                count("compressible > max message size")
    return dict(sorted(counts.items()))

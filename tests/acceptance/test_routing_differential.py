"""``drain run --app`` publishes what the app's own ``apply_async`` publishes, for
routing configurations (tests/route_shapes.py) and encodings (serializers,
compression, priorities, shadow names, repr limits: tests/encoding_shapes.py)
drawn from a seed.

For each drawn app, every row is sent twice, each into its own RabbitMQ vhost
with the firehose tracer on (tests/firehose.py): by the app's own
``task.apply_async(args, kwargs, task_id=..., [queue=...])`` in this process,
and by ``drain run --app tests.differential_app`` from the staged row (a row
of a task the app does not register must be dead-lettered 'unknown_task', one
whose values the app's serializer cannot encode, where apply_async raises,
'invalid'). Then, message for message (by task id), the exchange, the routing keys, the
properties (``content_type``, ``content_encoding`` and ``priority`` included),
the headers (names, order and values, ``compression`` included) and the body
must be the same; only ``reply_to`` and the ``origin`` header, which name the
sending process, may differ. The body is compared twice: decoded (decompressed
by its ``compression`` header, deserialized by its content type with kombu's own
registries, compared by value and by ``repr``, so a tuple is not a list nor 1
a 1.0), and as bytes. Every serializer and compressor drawn is deterministic
(JSON, YAML, msgpack; zlib, bzip2, lzma: the same values give the same bytes),
and pickle's bytes depend only on the values and their sharing (its memo):
``apply_async`` is given the row's values as JSON decodes them (with kombu's
JSON, so its types come back as themselves), as the drain has them, so the
bytes must match too. At the end, the two vhosts must hold the same queues
(with their arguments and durability), exchanges and bindings: the drain
declares what ``apply_async`` declares, nothing more.

The drain runs with ``--max-message-size`` 64 KiB
(``encoding_shapes.MAX_MESSAGE_SIZE``): some rows of compressed tasks hold a
compressible argument 2 to 5 times that, which must be delivered compressed,
as apply_async sends it, not dead-lettered 'too_large'.

A row staged with a ``priority`` of 0..255 (the priorities AMQP carries) is
compared with ``apply_async(priority=...)``; a row staged without one, or below
0 (an order among staged rows only), with ``apply_async`` without ``priority``.

Exchanges that routes name without a queue (and Broadcast's fanout
exchanges) are declared by the test in both vhosts beforehand, as the app's
workers would; what an exchange cannot route goes to a catch-all queue (an
alternate exchange, by policy), since the drain publishes with ``mandatory``
and keeps a row staged while its message would go nowhere.

The known differences of docs/celery_app.md that the apps generate are
counted apart and printed, not failed: an explicit priority 0, pickled
callbacks, key order (bodies whose decoded values are equal and differ only in
dict key order), callbacks with yaml (:data:`KNOWN_DIFFERENCES`), and the
declarations made for a row its serializer cannot encode (:func:`_apply_async`).

The seed is random unless ``DRAIN_DIFF_SEED`` is set, and printed (replay:
``DRAIN_DIFF_SEED=<seed>``); ``DRAIN_DIFF_APPS`` apps are drawn (default 10), and
issue 25's fixed app is added (tests/encoding_shapes.py: :func:`bullets`).
``DRAIN_DIFF_REPORT=<file>`` writes every difference found there, one a line.
Rows holding kombu's JSON types are staged by ``drain.stage`` when
``encoding_shapes.STAGE_KOMBU_TYPES`` says it takes them, else by SQL in
kombu's JSON form; rows with a callback as a signature with ``link`` (and
``apply_async(link=...)``); the others by SQL.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from celery import signature
from kombu import compression, serialization
from kombu.exceptions import EncodeError
from psycopg.types.json import Jsonb

import drain
from tests import encoding_shapes, firehose, route_shapes, support

#: Seconds one drain run may take for one app's rows (normally 3-5).
DRAIN_RUN_LIMIT = 60

#: A ``Broadcast`` queue's own name, ``bcast.<uuid>``: a uuid drawn in each process
#: that builds the app, so the same route names a different queue in each.
BROADCAST_NAME = re.compile(r"^bcast\.[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$")


def _per_process(routing_key: str) -> str:
    return "bcast.<uuid>" if BROADCAST_NAME.match(routing_key) else routing_key


def _goes_nowhere(published: firehose.Published) -> bool:
    """apply_async sent it to the default exchange under a Broadcast queue's own
    name (a route naming a Broadcast queue with a direct exchange): no queue has
    that name, so the broker drops it, while the drain, which publishes with
    ``mandatory``, keeps the row staged (docs/celery_app.md: a route to nowhere
    comes back unroutable). The default exchange can have no alternate exchange."""
    return published[0] == "" and all(BROADCAST_NAME.match(k) for k in published[1])


def _stage(db_url: str, spec: dict[str, Any], restart: int) -> dict[str, dict[str, Any]]:
    """Stage the spec's rows (ids from ``restart`` on, as after an identity
    restart, or their own): {task id: row}."""
    staged: dict[str, dict[str, Any]] = {}
    with psycopg.connect(db_url) as conn:
        conn.execute(f"ALTER TABLE staged_jobs ALTER COLUMN id RESTART WITH {int(restart)}")
        for row in spec["rows"]:
            task_id = str(uuid.uuid4())
            if row.get("link"):  # a signature with a callback, staged as one
                args, kwargs = encoding_shapes.values(row)
                options = {"task_id": task_id, "link": encoding_shapes.callback(row)}
                if row["queue"] is not None:
                    options["queue"] = row["queue"]
                drain.stage(conn, signature(row["task"], args, kwargs, options=options))
                staged[task_id] = row
                continue
            if encoding_shapes.typed(row) and encoding_shapes.STAGE_KOMBU_TYPES:
                args, kwargs = encoding_shapes.values(row)
                drain.stage(conn, row["task"], args, kwargs, task_id=task_id,
                            queue=None if row["legacy"] else row["queue"],
                            priority=row.get("priority", 0))
                if row["legacy"]:
                    conn.execute("UPDATE staged_jobs SET queue = 'celery', queue_legacy = true "
                                 "WHERE task_id = %s", [task_id])
                staged[task_id] = row
                continue
            columns = {"task_id": task_id, "task_name": row["task"], "args": Jsonb(row["args"]),
                       "kwargs": Jsonb(row["kwargs"]), "queue_legacy": row["legacy"]}
            if row["queue"] is not None:
                columns["queue"] = row["queue"]
            if row["id"] is not None:
                columns["id"] = row["id"]
            if row.get("priority") is not None:
                columns["priority"] = row["priority"]
            conn.execute(f"INSERT INTO staged_jobs ({', '.join(columns)}) OVERRIDING SYSTEM "
                         f"VALUE VALUES ({', '.join(['%s'] * len(columns))})",
                         list(columns.values()))
            staged[task_id] = row
    return staged


def _apply_async(spec: dict[str, Any], vhost: str,
                 staged: dict[str, dict[str, Any]]) -> dict[str, str]:
    """What the app sends: apply_async, with queue= where the row names one. Returns
    the rows it sends nothing for, with the reason the drain must dead-letter them:
    'unknown_task' (the app has no such task), 'invalid' (apply_async raises
    EncodeError: the serializer cannot carry a value, yaml a Decimal say; such a row
    is then sent with JSON, so that this vhost gets the declarations the drain
    makes for it, a known difference)."""
    app = route_shapes.build_app(spec, firehose.url(vhost))
    unsent: dict[str, str] = {}
    try:
        with app.connection_for_write() as connection, \
                app.amqp.Producer(connection) as producer:
            for task_id, row in staged.items():
                if row.get("unknown"):
                    unsent[task_id] = "unknown_task"
                    continue
                options: dict[str, Any] = ({} if row["queue"] is None or row["legacy"]
                                           else {"queue": row["queue"]})
                if 0 <= row.get("priority", -1) <= 255:
                    options["priority"] = row["priority"]
                if row.get("link"):
                    options["link"] = encoding_shapes.callback(row)
                args, kwargs = encoding_shapes.values(row)
                try:
                    app.tasks[row["task"]].apply_async(args, kwargs, task_id=task_id,
                                                       producer=producer, **options)
                except EncodeError:
                    unsent[task_id] = "invalid"
                    # Known difference (docs/celery_app.md, "A row its serializer cannot
                    # encode"): the drain declares the row's queue before it finds the row
                    # invalid. What apply_async declares for that route, sent with a
                    # serializer that can carry it (its message is not compared):
                    app.tasks[row["task"]].apply_async(
                        args, kwargs, task_id=task_id, producer=producer,
                        **{**options, "serializer": "json"})
    finally:
        app.close()
    return unsent


def _traced(tap: firehose.Tap, keep: set[str], wait: set[str],
            what: str) -> dict[str, firehose.Published]:
    """The first traced publish of each of ``keep``, once every one of ``wait`` came."""
    found: dict[str, firehose.Published] = {}

    def more() -> bool:
        for published in tap.read():
            task_id = str(published[2].get("headers", {}).get("id"))
            if task_id in keep:
                found.setdefault(task_id, published)
        return wait <= set(found)

    support.wait_for(more, 60, what)
    return found


def decoded(published: firehose.Published) -> Any:
    """A publish's body as a worker reads it: decompressed, then deserialized."""
    properties = published[2]
    body = published[3]
    packed = properties.get("headers", {}).get("compression")
    if packed:
        body = compression.decompress(body, packed)
    content_type = properties.get("content_type")
    return serialization.loads(body, content_type, properties.get("content_encoding"),
                               accept=[content_type])


def _keys_sorted(value: Any) -> Any:
    """``value`` with every dict's keys sorted (its type kept): equal reprs of two
    such values differ at most in key order."""
    if isinstance(value, dict):
        return (type(value).__name__, sorted((repr(k), _keys_sorted(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return type(value)(_keys_sorted(v) for v in value)
    return value


def _body(ours: firehose.Published, theirs: firehose.Published) -> list[str]:
    """The bodies' differences: decoded (by value and repr), then as bytes."""
    try:
        values = decoded(ours), decoded(theirs)
    except Exception as exc:  # whatever kombu's decoders raise
        return [f"body undecodable: {type(exc).__name__}: {str(exc)[:200]}"]
    texts = repr(values[0]), repr(values[1])
    if values[0] != values[1]:
        return [f"body decoded: {texts[0][:300]} != {texts[1][:300]}"]
    if texts[0] != texts[1]:  # key order, 1 / 1.0 / True, a dict subclass
        what = ("body key order" if repr(_keys_sorted(values[0])) == repr(_keys_sorted(values[1]))
                else "body decoded equal, not its repr")
        return [f"{what}: {texts[0][:300]} != {texts[1][:300]}"]
    if ours[3] != theirs[3]:
        return [f"body bytes (decoded equal): {ours[3][:120]!r} != {theirs[3][:120]!r}"]
    return []


def differences(ours: firehose.Published, theirs: firehose.Published) -> list[str]:
    """What differs between two publishes, apart from what names the sending process."""
    found = []
    keys = [_per_process(k) for k in ours[1]], [_per_process(k) for k in theirs[1]]
    for what, a, b in zip(("exchange", "routing keys"), (ours[0], keys[0]),
                          (theirs[0], keys[1]), strict=True):
        if a != b:
            found.append(f"{what}: {a!r} != {b!r}")
    found += _body(ours, theirs)
    p1, p2 = dict(ours[2]), dict(theirs[2])
    h1, h2 = dict(p1.pop("headers", {})), dict(p2.pop("headers", {}))
    for per_process in (p1, p2, h1, h2):
        per_process.pop("reply_to", None)
        per_process.pop("origin", None)
    if list(h1) != list(h2):
        found.append(f"header names or order: {list(h1)} != {list(h2)}")
    for kind, a_all, b_all in (("property", p1, p2), ("header", h1, h2)):
        for key in sorted(set(a_all) | set(b_all)):
            if a_all.get(key) != b_all.get(key):
                found.append(f"{kind} {key}: {a_all.get(key)!r} != {b_all.get(key)!r}")
    return found


def _describe(row: dict[str, Any]) -> str:
    queue = "legacy celery" if row["legacy"] else row["queue"]
    priority = f", priority {row['priority']}" if "priority" in row else ""
    return f"{row['task']} (queue {queue}, id {row['id'] or 'auto'}{priority})"


#: Differences docs/celery_app.md lists under "Known differences", by name: each
#: (row, difference) it covers is counted apart and does not fail the test.
KNOWN_DIFFERENCES: dict[str, Callable[[dict[str, Any], str], bool]] = {
    # staged_jobs.priority is NOT NULL DEFAULT 0: an explicit 0 is "no priority".
    "explicit priority 0": lambda row, difference: (
        row.get("priority") == 0 and difference.startswith("property priority:")
        and difference.endswith("!= 0")),
    # apply_async pickles a callback as a celery Signature (its args a tuple), the
    # drain as the dict the staging API stored (rows marked so in encoding_shapes).
    "pickled callbacks": lambda row, difference: (
        row.get("known") == "pickled callbacks" and difference.startswith("body ")),
    # jsonb keeps an object's keys in its own order; the decoded values are equal
    # (by value and by repr with every dict's keys sorted: _body checks).
    "key order": lambda row, difference: difference.startswith("body key order:"),
    # apply_async(link=...) raises with yaml; the drain sends the staged dicts.
    "callbacks with yaml": lambda row, difference: (
        row.get("known") == "callbacks with yaml" and difference in (
            "published, apply_async sends nothing (invalid)", "not dead-lettered 'invalid'")),
}


def known_difference(row: dict[str, Any], difference: str) -> str | None:
    return next((name for name, covers in KNOWN_DIFFERENCES.items()
                 if covers(row, difference)), None)


def difference_class(problem: str) -> str:
    """What a problem line is about (``app: row (...): what: detail``), for the tally."""
    if problem.startswith("declared by"):
        return problem.split(" {", 1)[0]  # "declared by the drain only: queue"
    what = problem.split("): ", 1)[-1] if "): " in problem else problem.split(": ", 1)[-1]
    return what.split(":", 1)[0]


def _one_app(spec: dict[str, Any], db_url: str, tmp_path: Path, vhosts: tuple[str, str],
             taps: tuple[firehose.Tap, firehose.Tap], *, seen: collections.Counter[str],
             restart: int) -> list[str]:
    """Send one app's rows both ways; what differs (counted in ``seen``: the known
    differences, and the rows dead-lettered as expected, by reason)."""
    celery_vhost, drain_vhost = vhosts
    celery_tap, drain_tap = taps
    for tap in taps:
        for name, kind in spec["external"].items():
            tap.declare_exchange(name, kind)
    staged = _stage(db_url, spec, restart)
    unsent = _apply_async(spec, celery_vhost, staged)
    known = set(staged) - set(unsent)
    theirs = _traced(celery_tap, known, known, f"apply_async's {len(known)} publishes")

    spec_file = tmp_path / f"{spec['name']}.json"
    spec_file.write_text(json.dumps(spec))
    env = support.drain_env(db_url, DRAIN_BROKER_URL=firehose.url(drain_vhost),
                            DIFF_APP_SPEC=str(spec_file),
                            DRAIN_MAX_MESSAGE_SIZE=str(encoding_shapes.MAX_MESSAGE_SIZE))
    problems: list[str] = []
    try:
        run = support.run_cli(db_url, "run", "--app", "tests.differential_app",
                              "--exit-when-empty", env=env, timeout=DRAIN_RUN_LIMIT)
        if run.returncode != 0:
            problems.append(f"drain run exited {run.returncode}: "
                            f"{run.stderr[-2000:]}")
    except subprocess.TimeoutExpired:
        problems.append(f"drain run did not finish in {DRAIN_RUN_LIMIT}s")
    with psycopg.connect(db_url) as conn:
        left = conn.execute("SELECT task_id::text FROM staged_jobs").fetchall()
        dead = conn.execute("SELECT task_id::text, reason, detail FROM dead_jobs").fetchall()
        conn.execute("DELETE FROM staged_jobs")
        conn.execute("DELETE FROM dead_jobs")
    found: list[tuple[str, str]] = []  # (task id, what differs)
    found += [(t, "left staged") for (t,) in left
              if t not in theirs or not _goes_nowhere(theirs[t])]
    found += [(t, f"dead-lettered {r}: {d}") for t, r, d in dead if unsent.get(t) != r]
    found += [(t, f"not dead-lettered {r!r}")
              for t, r in unsent.items() if t not in {t for t, _, _ in dead}]
    seen.update(f"dead-lettered {r}" for t, r, _ in dead if unsent.get(t) == r)
    seen.update("known: a row its serializer cannot encode" for t, r, _ in dead
                if unsent.get(t) == r == "invalid")
    gone = {t for (t,) in left} | {t for t, _, _ in dead}
    ours = _traced(drain_tap, set(staged), known - gone, "the drain's publishes")
    for task_id in staged:
        if task_id not in known and task_id in ours:
            found.append((task_id, f"published, apply_async sends nothing ({unsent[task_id]})"))
        elif task_id in ours:
            found += [(task_id, d) for d in differences(ours[task_id], theirs[task_id])]
    for task_id, difference in found:
        name = known_difference(staged[task_id], difference)
        if name is None:
            problems.append(f"{_describe(staged[task_id])}: {difference}")
        else:
            seen[f"known: {name}"] += 1
    return [f"{spec['name']}: {p}" for p in problems]


def test_drain_run_app_publishes_what_apply_async_publishes(db_url: str,
                                                            tmp_path: Path) -> None:
    seed = int(os.environ.get("DRAIN_DIFF_SEED") or random.randrange(2**32))
    count = int(os.environ.get("DRAIN_DIFF_APPS") or 10)
    specs = encoding_shapes.generate(seed, count)
    problems: list[str] = []
    with firehose.traced_vhost("diff_celery", catch_all=True) as celery_vhost, \
            firehose.traced_vhost("diff_drain", catch_all=True) as drain_vhost, \
            firehose.Tap(celery_vhost) as celery_tap, firehose.Tap(drain_vhost) as drain_tap:
        restarts = random.Random(seed)
        seen: collections.Counter[str] = collections.Counter()
        shared = None
        for spec in specs:
            if encoding_shapes.celery_queue(spec) != shared:
                shared = encoding_shapes.celery_queue(spec)
                for tap in (celery_tap, drain_tap):
                    tap.forget_celery()
            problems += _one_app(spec, db_url, tmp_path, (celery_vhost, drain_vhost),
                                 (celery_tap, drain_tap), seen=seen,
                                 restart=restarts.choice([1, restarts.randint(2, 10**12)]))
        declared = firehose.entities(celery_vhost), firehose.entities(drain_vhost)
    for kind in ("queues", "exchanges", "bindings"):
        theirs, ours = set(declared[0][kind]), set(declared[1][kind])
        problems += [f"declared by the drain only: {kind[:-1]} {e}" for e in sorted(ours - theirs)]
        problems += [f"declared by apply_async only: {kind[:-1]} {e}"
                     for e in sorted(theirs - ours)]
    kinds = collections.Counter(route["kind"] for spec in specs for route in spec["routes"])
    rows = sum(len(spec["rows"]) for spec in specs)
    tasks = sum(len(spec["tasks"]) for spec in specs)
    tally = collections.Counter(difference_class(p) for p in problems)
    if os.environ.get("DRAIN_DIFF_REPORT"):  # every difference, one a line
        Path(os.environ["DRAIN_DIFF_REPORT"]).write_text("".join(f"{p}\n" for p in problems))
    print(f"\nrouting differential, seed {seed}: {len(specs)} apps, {tasks} tasks, "
          f"{dict(sorted(kinds.items()))} route items, {rows} messages compared, "
          f"{len(declared[1]['queues'])} queues declared; encodings: "
          f"{encoding_shapes.census(specs)}; {len(problems)} difference(s) "
          f"{dict(sorted(tally.items()))}; as expected (known: docs/celery_app.md): "
          f"{dict(sorted(seen.items()))}")
    assert not problems, (f"seed {seed} (replay with DRAIN_DIFF_SEED={seed}), "
                          f"{len(problems)} difference(s) {dict(sorted(tally.items()))}:\n"
                          + "\n".join(problems[:60]))

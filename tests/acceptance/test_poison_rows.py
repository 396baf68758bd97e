"""One bad row never stalls the drain: adversarial rows staged by plain SQL.

Rows are generated from a seed (printed; replay one with
``DRAIN_POISON_SEED=<seed>``, run several with ``DRAIN_POISON_RUNS=<n>``) and
inserted by plain SQL as the application's role (drain_stager), with values in
every column the schema accepts that the drain's own staging would refuse or
that probe an edge: ``infinity``/``-infinity``/BC/year-10000 times in
``not_before``, ``expires_at`` and ``staged_at``, expiries beyond RabbitMQ's
3,650 days and in the past, huge and deep JSON, every priority, odd queue names
(``amq.*``, 255 bytes, unicode, spaces), odd and unknown task names, and under
``--app`` routes to exchanges nobody declared (tests/poison_app.py) and a queue
the broker refuses to declare, interleaved with good rows across two queues, in
two waves (the second staged once the drain went through the first).

A real ``drain run --app tests.poison_app`` publishes them; the test reads the
queues (a worker would add nothing: it only sees what the queues hold). It
checks that the drain stays up without reconnecting, every good row is
delivered (at most twice), every bad row ends in dead_jobs with the expected
reason or stays staged (a refused queue: held, its cause logged once; a
not_before too far ahead: waiting), nothing is published in a loop, and the
dead-letter and status commands read every row.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import os
import random
import re
from collections.abc import Iterator
from typing import Any

import pika
import psycopg
import pytest

from tests import poison_app, roles, support

#: Runs per test (each its own seed); DRAIN_POISON_SEED replays the first.
RUNS = int(os.environ.get("DRAIN_POISON_RUNS", "1"))


@dataclasses.dataclass
class Row:
    """One generated row: its columns, and what must become of it."""

    kind: str
    #: deliver:<queue> | dead:<reason> | held:<queue> | waiting
    expect: str
    task_name: str = "poison.ok"
    args: str = "[]"
    kwargs: str = "{}"
    queue: str | None = None
    priority: int = 0
    tag: str | None = None
    not_before: str | None = None
    expires_at: str | None = None
    staged_at: str | None = None
    task_id: str = ""


def _iso(delta: dt.timedelta) -> str:
    return (dt.datetime.now(dt.timezone.utc) + delta).isoformat()


def generate(rng: random.Random, suffix: str) -> tuple[list[Row], set[str]]:
    """Bad rows of every kind (each at least once) and good rows, shuffled; and the
    odd queues the drain will declare (for teardown)."""
    n = poison_app.names(suffix)
    a, b = n["a"], n["b"]
    odd = {
        "amq": f"amq.pz_{suffix}",
        "long": (f"pz_long_{suffix}_" + "x" * 255)[:255],
        "unicode": f"pz_ünï_✓_{suffix}",
        "spaces": f"pz with spaces {suffix}",
    }

    def good(kind: str, **columns: Any) -> Row:
        queue = columns.pop("queue", rng.choice([a, b, None]))
        return Row(kind, f"deliver:{queue or a}", queue=queue, **columns)

    def pick(*values: str) -> str:
        return rng.choice(values)

    makers = [
        lambda: Row("expires beyond 3650 days", "dead:invalid", queue=pick(a, b),
                    expires_at=pick("infinity", "10000-06-01 00:00:00+00", "2099-01-01",
                                    _iso(dt.timedelta(days=3651)))),
        lambda: Row("expires in the past", "dead:expired", queue=pick(a, b),
                    expires_at=pick("-infinity", "0044-03-15 00:00:00+00 BC",
                                    "0001-01-01 00:00:00+00", _iso(-dt.timedelta(days=1)))),
        lambda: Row("not_before far ahead", "waiting", queue=pick(a, b),
                    not_before=pick("infinity", "12000-01-01 00:00:00+00", "9999-12-31")),
        lambda: good("not_before long past",
                     not_before=pick("-infinity", "0044-03-15 00:00:00+00 BC", "0001-01-01")),
        lambda: good("odd staged_at", staged_at=pick("infinity", "-infinity",
                                                     "0044-03-15 00:00:00+00 BC",
                                                     "11000-01-01 00:00:00+00")),
        lambda: good("extreme priority", priority=rng.choice([-32768, 32767,
                                                              rng.randint(-32768, 32767)])),
        lambda: good("huge numbers", args=pick("[1e400]", "[-1e400]", "[18446744073709551616]",
                                               "[-9223372036854775809, 1e-400]",
                                               '[1.7976931348623157e308, {"n": -1e300}]')),
        lambda: Row("integer of 5,000 digits", "dead:invalid", queue=pick(a, b),
                    args="[" + "9" * 5000 + "]"),
        lambda: good("nested 300 deep", args="[" * 300 + "]" * 300),
        lambda: Row("nested 5,000 deep", "dead:invalid", queue=pick(a, b),
                    args="[" * 5000 + "]" * 5000),
        lambda: good("odd kwargs", kwargs=pick('{"": 1}', '{"ü ✓": [null, true]}',
                                               '{"a": {"b": {"c": {"d": [[[]]]}}}}')),
        lambda: good("odd tag", tag=pick("ü" * 127, "t" * 255, " ")),
        lambda: Row("unknown task", "dead:unknown_task", queue=pick(a, b, None),  # type: ignore[arg-type]
                    task_name=pick("x" * 1024, "tâche.inconnue ✓", "poison.nope", " poison.ok")),
        lambda: Row("route to an exchange nobody declared", "dead:refused",
                    task_name="poison.misrouted"),
        lambda: Row("kombu Queue(no_declare=True) on an undeclared exchange", "dead:refused",
                    task_name="poison.nodeclare"),
        lambda: Row("kombu Queue(no_declare=True) that does not exist (unroutable)",
                    f"held:{n['unbound']}", task_name="poison.unbound"),
        lambda: Row("queue whose declare is refused (406)", f"held:{n['c']}",
                    task_name="poison.conflict"),
        lambda: Row("amq.* queue (declare refused, 403)", f"held:{odd['amq']}",
                    queue=odd["amq"]),
        lambda: good("odd queue name", queue=odd[pick("long", "unicode", "spaces")]),
    ]
    rows = [make() for make in makers]  # every kind at least once
    rows += [rng.choice(makers)() for _ in range(rng.randint(20, 40))]
    rows += [good("plain") for _ in range(rng.randint(len(rows), 2 * len(rows)))]
    rng.shuffle(rows)
    return rows, set(odd.values())


def stage(db_url: str, rows: list[Row]) -> None:
    """INSERT each row by plain SQL in one transaction, as the application's role."""
    with psycopg.connect(roles.url(db_url, roles.STAGER)) as conn:
        for row in rows:
            found = conn.execute(
                "INSERT INTO staged_jobs (task_name, args, kwargs, queue, priority, tag, "
                "not_before, expires_at, staged_at) VALUES (%s, %s::jsonb, %s::jsonb, %s, %s, "
                "%s, %s::timestamptz, %s::timestamptz, coalesce(%s::timestamptz, now())) "
                "RETURNING task_id::text",
                (row.task_name, row.args, row.kwargs, row.queue, row.priority, row.tag,
                 row.not_before, row.expires_at, row.staged_at)).fetchone()
            assert found is not None
            row.task_id = str(found[0])


def _seed(run: int) -> int:
    """Run 0 replays DRAIN_POISON_SEED when it is set; other runs draw their own.
    Drawn when the test runs, not at collection, where it was the test's id: each
    pytest-xdist worker collects the tests, and they must all find the same ids."""
    given = os.environ.get("DRAIN_POISON_SEED")
    return int(given) if given and run == 0 else random.SystemRandom().randrange(2**31)


@pytest.fixture
def suffix() -> Iterator[str]:
    value = support.unique("")[-10:]
    yield value
    poison_app.delete_entities(value, frozenset({
        f"amq.pz_{value}", (f"pz_long_{value}_" + "x" * 255)[:255], f"pz_ünï_✓_{value}",
        f"pz with spaces {value}"}))


@pytest.mark.parametrize("run", range(RUNS))
def test_poison_rows_never_stall_the_drain(db_url: str, suffix: str, spawn: Any,
                                          run: int) -> None:
    seed = _seed(run)
    print(f"\n[poison] seed {seed} (replay: DRAIN_POISON_SEED={seed})")
    rng = random.Random(seed)
    rows, odd_queues = generate(rng, suffix)
    names = poison_app.names(suffix)
    # Queue c exists with other arguments than the app declares it with: refused (406).
    with support.broker_channel() as ch:
        ch.queue_declare(names["c"], durable=True, arguments={"x-max-length": 1000})
    first, second = rows[: len(rows) * 2 // 3], rows[len(rows) * 2 // 3:]
    stage(db_url, first)

    port = support.free_port()
    env = support.drain_env(db_url, POISON_APP_SUFFIX=suffix, DRAIN_METRICS_PORT=str(port))
    proc = spawn(support.drain_argv("run", "--app", "tests.poison_app", "--poll-interval",
                                    "0.2", "--batch-size", str(rng.choice([3, 7, 20]))),
                 env, "drain")
    _settled(db_url, first, seed, proc)
    stage(db_url, second)
    _settled(db_url, rows, seed, proc)
    assert proc.proc.poll() is None, "the drain stopped"
    _, metrics = support.http_get(port, "/metrics")
    status = support.run_cli(db_url, "status", env=env)
    proc.stop()

    # What reached the queues: every good row, at most twice; nothing else.
    queues = {names["a"], names["b"], names["c"], *odd_queues}
    copies: collections.Counter[str] = collections.Counter()
    where: dict[str, set[str]] = collections.defaultdict(set)
    for queue in queues:
        for task_id in support.task_ids(_drain_queue(queue)):
            copies[task_id] += 1
            where[task_id].add(queue)
    with psycopg.connect(db_url) as conn:
        dead: dict[str, str] = dict(conn.execute(
            "SELECT task_id::text, reason FROM dead_jobs").fetchall())
    failures = []
    for row in rows:
        got = (f"deliver:{'/'.join(sorted(where[row.task_id]))}" if row.task_id in copies
               else f"dead:{dead[row.task_id]}" if row.task_id in dead else "staged")
        want = row.expect
        if want.startswith(("held", "waiting")):
            want = "staged"
        if got != want or copies[row.task_id] > 2:
            failures.append(f"{row.kind}: expected {row.expect}, got {got} "
                            f"(copies {copies[row.task_id]}): {_describe(row)}")
    assert not failures, f"seed {seed}:\n" + "\n".join(failures)

    # Held queues: one logged cause each, not one per cycle.
    out = proc.output()
    for held in {row.expect.split(":", 1)[1] for row in rows if row.expect.startswith("held")}:
        said = [line for line in out.splitlines()
                if "WARNING" in line and repr(held) in line]
        assert len(said) == 1, f"seed {seed}: queue {held!r} logged {len(said)} times:\n" + \
            "\n".join(said[:5])
    for target in ("broker", "database"):
        assert re.search(rf'^drain_reconnects_total\{{target="{target}"\}} 0\.0$', metrics,
                         re.M), f"seed {seed}: the drain reconnected to the {target}"
    assert status.returncode == 0, status
    listed = support.run_cli(db_url, "dead", "list", "--json", "--limit", "1000", env=env)
    assert listed.returncode == 0, listed
    assert len(listed.stdout.splitlines()) == len(dead)
    kinds = collections.Counter(row.expect.split(":")[0] for row in rows)
    print(f"[poison] seed {seed}: {len(rows)} rows ({len({r.kind for r in rows})} kinds): "
          f"{kinds['deliver']} delivered ({sum(copies.values())} messages, most copies "
          f"{max(copies.values())}), {len(dead)} dead, {kinds['held']} held, "
          f"{kinds['waiting']} waiting")


def _settled(db_url: str, rows: list[Row], seed: int, proc: support.Process) -> None:
    """Wait until every row of ``rows`` was delivered or dead-lettered but the held
    and waiting ones."""
    stays = {row.task_id for row in rows if row.expect.startswith(("held", "waiting"))}
    try:
        support.wait_for(lambda: _staged_ids(db_url) == stays, 60,
                         "every row delivered, dead-lettered, held or waiting")
    except AssertionError:
        staged = _staged_ids(db_url)
        wrong = [f"{r.kind}: expected {r.expect}, "
                 f"{'staged' if r.task_id in staged else 'gone'}: {_describe(r)}"
                 for r in rows if (r.task_id in staged) != (r.task_id in stays)]
        tail = "\n".join(proc.output().splitlines()[-15:])
        raise AssertionError(f"seed {seed}:\n" + "\n".join(wrong) + "\n" + tail) from None


def _staged_ids(db_url: str) -> set[str]:
    with psycopg.connect(db_url) as conn:
        return {r[0] for r in conn.execute("SELECT task_id::text FROM staged_jobs")}


def _drain_queue(queue: str) -> list[tuple[Any, Any, bytes]]:
    try:
        return support.drain_queue(queue, timeout=0.5)
    except pika.exceptions.AMQPError:
        return []


def _describe(row: Row) -> str:
    columns = dataclasses.asdict(row)
    return ", ".join(f"{k}={str(v)[:60]!r}" for k, v in columns.items()
                     if v not in (None, "", 0, "[]", "{}") and k not in ("kind", "expect"))

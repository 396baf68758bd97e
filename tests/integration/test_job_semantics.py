"""Job semantics end to end in-process: delays, priority, expiry, size limits, tags.

A Drain runs in a thread against real Postgres and RabbitMQ; what it
published is read back from the queue. Delays are kept in Postgres and found
by polling (a due row sends no NOTIFY), so these tests run the drain with a
short poll interval.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import psycopg
import pytest
from celery import Celery

import drain
from drain.celery import message
from drain.postgres import keyset, sql
from drain.postgres.rows import StagedRow
from drain.postgres.store import Store, fetch_params
from drain.settings import config
from tests import support

UTC = dt.timezone.utc

# -- helpers ------------------------------------------------------------------------


Msg = tuple[Any, Any, bytes]


def _consume(queue: str) -> list[Msg]:
    """Every message now in ``queue``, in queue order."""
    return support.drain_queue(queue, timeout=0.5)


def _by_id(messages: list[Msg]) -> dict[str, Msg]:
    return {str(p.headers["id"]): (m, p, b) for m, p, b in messages}


def _body(msg: Msg) -> tuple[list[Any], dict[str, Any]]:
    args, kwargs, _embed = json.loads(msg[2])
    return args, kwargs


def _column(db_url: str, task_id: uuid.UUID, column: str) -> Any:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            f"SELECT {column} FROM staged_jobs WHERE task_id = %s", (task_id,)
        ).fetchone()
    assert row is not None, f"{task_id} is not staged"
    return row[0]


def _staged_task_ids(db_url: str) -> set[str]:
    with psycopg.connect(db_url) as conn:
        return {r[0] for r in conn.execute("SELECT task_id::text FROM staged_jobs")}


def _dead(db_url: str) -> list[dict[str, Any]]:
    with psycopg.connect(db_url) as conn:
        cur = conn.execute(
            "SELECT id, task_id::text, task_name, args, kwargs, queue, priority, tag, "
            "not_before, expires_at, reason, detail FROM dead_jobs ORDER BY id"
        )
        names = [c.name for c in cur.description or []]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def _observe_nothing_published(
    db_url: str, queue: str, until: float, staged: set[str]
) -> None:
    """Until ``until`` (epoch seconds), the queue stays empty and ``staged`` stays staged.

    A bounded observation window: asserting that something does NOT happen
    before a known time.
    """
    checks = 0
    while time.time() < until or checks == 0:
        assert support.queue_depth(queue) == 0, "a delayed job was published before it was due"
        assert staged <= _staged_task_ids(db_url), "a delayed row left staged_jobs early"
        checks += 1
        time.sleep(0.05)


# -- 1. delays ---------------------------------------------------------------------


def test_countdown_waits_in_postgres_until_due_and_does_not_hold_back_ready_rows(
    db_url: str, queue: str, start_active_drain: Any
) -> None:
    start_active_drain(db_url, poll_interval=0.2)
    with psycopg.connect(db_url) as conn:
        delayed = drain.stage(conn, "t.delayed", ["later"], queue=queue, countdown=1.5)
        # Staged after the delayed row (a higher id): must not wait behind it.
        ready = drain.stage(conn, "t.ready", ["now"], queue=queue)
    due = _column(db_url, delayed, "not_before").timestamp()

    support.wait_for(lambda: support.staged_count(db_url) == 1, 10,
                     "the ready row behind the delayed one to be published")
    assert support.task_ids(_consume(queue)) == [str(ready)]
    assert time.time() < due, "the ready row took longer than the delay: nothing was shown"

    _observe_nothing_published(db_url, queue, due - 0.15, {str(delayed)})
    # No NOTIFY marks a row becoming due: only the poll interval can wake the drain.
    support.wait_for(lambda: support.queue_depth(queue) == 1, max(due - time.time(), 0) + 5,
                     "the delayed job to be published once due")
    assert time.time() >= due
    assert support.task_ids(_consume(queue)) == [str(delayed)]
    support.wait_for(lambda: support.staged_count(db_url) == 0, 10, "the delayed row's delete")


def test_eta_aware_naive_utc_and_sql_not_before(
    db_url: str, queue: str, start_active_drain: Any
) -> None:
    start_active_drain(db_url, poll_interval=0.2)
    plus_five = dt.timezone(dt.timedelta(hours=5))
    aware_eta = dt.datetime.now(plus_five) + dt.timedelta(seconds=1.5)
    naive_eta = dt.datetime.now(UTC).replace(tzinfo=None) + dt.timedelta(seconds=1.5)
    with psycopg.connect(db_url) as conn:
        aware = drain.stage(conn, "t.aware", queue=queue, eta=aware_eta)
        naive = drain.stage(conn, "t.naive", queue=queue, eta=naive_eta)
        row = conn.execute(
            "INSERT INTO staged_jobs (task_name, queue, not_before) "
            "VALUES ('t.sql', %s, now() + interval '1 second') RETURNING task_id",
            (queue,),
        ).fetchone()
        assert row is not None
        by_sql = row[0]
    assert _column(db_url, aware, "not_before") == aware_eta
    # A naive eta means UTC (as in Celery), whatever the session's TimeZone.
    assert _column(db_url, naive, "not_before") == naive_eta.replace(tzinfo=UTC)
    dues = {
        str(t): _column(db_url, t, "not_before").timestamp() for t in (aware, naive, by_sql)
    }
    _observe_nothing_published(db_url, queue, min(dues.values()) - 0.15, set(dues))
    support.wait_for(lambda: support.staged_count(db_url) == 0, max(dues.values())
                     - time.time() + 5, "the three delayed jobs to be published")
    published = time.time()
    assert all(published >= due for due in dues.values())
    assert sorted(support.task_ids(_consume(queue))) == sorted(dues)


# -- 2. rows not yet due are never scanned ------------------------------------------------


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _check_plan(plan: dict[str, Any], indexes: set[str], max_rows: int = 100) -> None:
    nodes = list(_nodes(plan))
    described = json.dumps(plan, indent=1)[:4000]
    seq = [n for n in nodes if n["Node Type"] == "Seq Scan"]
    assert not seq, f"sequential scan on {seq[0].get('Relation Name')}:\n{described}"
    used = {n["Index Name"] for n in nodes if "Index Name" in n}
    assert indexes <= used, f"expected scans of {indexes}, plan uses {used}:\n{described}"
    for n in nodes:
        removed = n.get("Rows Removed by Filter", 0) * n.get("Actual Loops", 1)
        assert removed <= max_rows, f"{n['Node Type']} filtered out {removed} rows:\n{described}"
    scanned = sum(
        n["Actual Rows"] * n["Actual Loops"]
        + n.get("Rows Removed by Filter", 0) + n.get("Rows Removed by Index Recheck", 0)
        for n in nodes
        if n.get("Relation Name") == "staged_jobs" and "Scan" in n["Node Type"]
    )
    assert scanned <= max_rows, f"scans of staged_jobs produced {scanned} rows:\n{described}"


def _positional(query: str, names: list[str]) -> str:
    """psycopg's %(name)s placeholders as $1, $2... for a server-side PREPARE."""
    for i, name in enumerate(names, 1):
        query = query.replace(f"%({name})s", f"${i}")
    assert "%(" not in query
    return query


@pytest.mark.parametrize("plan_cache_mode", ["custom", "generic"])
def test_fetch_never_scans_rows_that_are_not_yet_due(db_url: str, plan_cache_mode: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (task_name, not_before, queue) "
            "SELECT 't.future', now() + interval '1 day', 'q' FROM generate_series(1, 20000)"
        )
        wanted = {r[0] for r in conn.execute(
            "INSERT INTO staged_jobs (task_name, priority, queue) "
            "SELECT 't.ready', g % 3, 'q' FROM generate_series(1, 5) g RETURNING id")}
        wanted |= {r[0] for r in conn.execute(
            "INSERT INTO staged_jobs (task_name, not_before, queue) "
            "SELECT 't.due', now() - g * interval '1 minute', 'q' "
            "FROM generate_series(1, 5) g RETURNING id")}
        conn.execute("ANALYZE staged_jobs")
        params = fetch_params(1000)
        query = sql.query("fetch_batch")
        if plan_cache_mode == "custom":
            rows = conn.execute(query, params).fetchall()
            plan = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query, params
            ).fetchone()
        else:
            # What a long-running drain ends up with: psycopg prepares a statement
            # run often, and Postgres may switch it to a generic plan.
            conn.execute("SET plan_cache_mode = force_generic_plan")
            conn.execute(
                "PREPARE drain_fetch(int, bigint[], text[], int[], bigint[], bigint[], int[], "
                "int[], int, int, text, bigint, text[], bigint, bigint, text[]) AS "
                + _positional(query, ["limit", "exclude", "paused", "priorities", "mark_xacts",
                                      "mark_ids", "gap_above", "gap_below", "lanes", "lane",
                                      "delayed_from", "timed_xact", "held_routes",
                                      "exclude_min", "exclude_max", "paused_tasks"])
            )
            rows = conn.execute(
                "EXECUTE drain_fetch(1000, '{}', '{}', '{}', '{}', '{}', '{-32769}', '{32768}', "
                "1, 0, '-infinity', 0, '{}', 0, -9223372036854775808, '{}')"
            ).fetchall()
            # A row id inside the excluded range: looked up among them.
            plan = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                "EXECUTE drain_fetch(1000, '{-1,1000000000}', '{other}', '{}', '{}', '{}', "
                "'{-32769}', '{32768}', 1, 0, '-infinity', 0, '{other\x1f*}', -1, 1000000000, "
                "'{t.other}')"
            ).fetchone()
    assert {r[0] for r in rows} == wanted, "the fetch must return exactly the due rows"
    assert [r[6] for r in rows] == sorted((r[6] for r in rows), reverse=True)
    assert plan is not None
    _check_plan(plan[0][0]["Plan"], {"staged_jobs_ready_idx", "staged_jobs_delayed_idx"})


@pytest.mark.parametrize("plan_cache_mode", ["custom", "generic"])
def test_expire_never_scans_rows_that_have_not_expired(db_url: str, plan_cache_mode: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (task_name, expires_at) "
            "SELECT 't.later', now() + interval '1 day' FROM generate_series(1, 20000)"
        )
        conn.execute(
            "INSERT INTO staged_jobs (task_name, expires_at) "
            "SELECT 't.gone', now() - interval '1 second' FROM generate_series(1, 3)"
        )
        conn.execute("ANALYZE staged_jobs")
        query = sql.query("expiring")  # then bury moves them by id (Store.expire)
        with conn.transaction(force_rollback=True):
            if plan_cache_mode == "custom":
                plan = conn.execute(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query,
                    {"exclude": [], "limit": 1000, "lanes": 1, "lane": 0,
                     "expiring_from": "-infinity", "timed_xact": 0},
                ).fetchone()
            else:
                conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
                conn.execute("PREPARE expire(bigint[], int, int, int, text, bigint) AS "
                              + _positional(query, ["exclude", "limit", "lanes", "lane",
                                                    "expiring_from", "timed_xact"]))
                plan = conn.execute(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                    "EXECUTE expire('{}', 1000, 1, 0, '-infinity', 0)"
                ).fetchone()
        found = conn.execute(query, {"exclude": [], "limit": 1000, "lanes": 1, "lane": 0,
                                     "expiring_from": "-infinity", "timed_xact": 0})
        assert len(found.fetchall()) == 3
    assert plan is not None
    _check_plan(plan[0][0]["Plan"], {"staged_jobs_expiring_idx"})


# -- 3. priority -------------------------------------------------------------------


def test_a_high_priority_job_jumps_a_backlog_being_drained(
    db_url: str, queue: str, start_active_drain: Any
) -> None:
    total = 6000
    with psycopg.connect(db_url) as conn:
        drain.stage_many(conn, [drain.Job("t.backlog", [i], queue=queue) for i in range(total)])
    start_active_drain(db_url, batch_size=100)
    support.wait_for(lambda: support.staged_count(db_url) < total, 30,
                     "the drain to start publishing", interval=0.005)
    published_before = total - support.staged_count(db_url)
    with psycopg.connect(db_url) as conn:
        urgent = drain.stage(conn, "t.urgent", queue=queue, priority=10)
    # Read after the commit: at least as many as were published when it committed.
    published_after = total - support.staged_count(db_url)
    # When it committed, up to `pipeline` batches could be published and awaiting
    # confirms, and the next one fetched already (its snapshot predating the
    # commit): the fetch after those takes it, ahead of the rest of the backlog.
    slack = (config.DEFAULT_PIPELINE + 1) * 100 + 50
    assert published_after + slack < total, "the drain was too fast to show a jump"
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60, "the backlog to drain")
    order = support.task_ids(support.drain_queue(queue, timeout=1.0))
    assert len(order) == total + 1
    position = order.index(str(urgent))
    assert published_before <= position <= published_after + slack, (
        f"staged when {published_before}..{published_after} were published, "
        f"published at {position}"
    )


def test_a_static_backlog_is_published_highest_priority_first(
    db_url: str, queue: str, start_active_drain: Any
) -> None:
    rng = random.Random(7)
    priorities = [rng.choice([-10, -1, 0, 0, 0, 3, 5, 32767, -32768]) for _ in range(60)]
    with psycopg.connect(db_url) as conn:
        ids = drain.stage_many(
            conn, [drain.Job("t.p", [i], queue=queue, priority=p)
                   for i, p in enumerate(priorities)]
        )
    start_active_drain(db_url, batch_size=7)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the backlog to drain")
    messages = _consume(queue)
    expected = [str(ids[i]) for i in sorted(range(60), key=lambda i: (-priorities[i], i))]
    assert support.task_ids(messages) == expected
    # Without --queue-max-priority the AMQP priority stays 0, as send_task sends it.
    assert {p.priority for _, p, _ in messages} == {0}


# -- 4. AMQP priority ------------------------------------------------------------------


def _declare_fails_with(queue: str, arguments: dict[str, Any] | None) -> int | None:
    """Declare ``queue`` (durable) with ``arguments``; the broker's refusal code, if any."""
    with support.broker_channel() as ch:
        try:
            ch.queue_declare(queue, durable=True, arguments=arguments)
        except pika.exceptions.ChannelClosedByBroker as exc:
            return int(exc.reply_code)
    return None


def test_queue_max_priority_declares_x_max_priority_and_clamps_message_priority(
    db_url: str, queue: str, start_active_drain: Any
) -> None:
    with psycopg.connect(db_url) as conn:
        staged = {
            p: drain.stage(conn, "t.prio", [p], queue=queue, priority=p)
            for p in (-5, 0, 3, 10, 50)
        }
    start_active_drain(db_url, queue_max_priority=10)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the jobs to drain")
    messages = _consume(queue)
    by_id = _by_id(messages)
    expected = {-5: 0, 0: 0, 3: 3, 10: 10, 50: 10}
    assert {p: by_id[str(t)][1].priority for p, t in staged.items()} == expected
    # A priority queue delivers the highest priority first.
    assert [p.priority for _, p, _ in messages] == [10, 10, 3, 0, 0]
    # RabbitMQ does not report a queue's arguments over AMQP, but it refuses a
    # declare whose arguments differ: only {"x-max-priority": 10} is equivalent.
    assert _declare_fails_with(queue, {"x-max-priority": 10}) is None
    assert _declare_fails_with(queue, None) == 406
    assert _declare_fails_with(queue, {"x-max-priority": 5}) == 406


@pytest.fixture
def celery_app() -> Iterator[Celery]:
    app = Celery("drain_priority_test", broker=support.BROKER_URL, set_as_current=False)
    app.conf.task_queue_max_priority = 10
    yield app
    app.close()


def _celery_declare(app: Celery, queue: str) -> None:
    """Declare ``queue`` the way a worker started with ``-Q queue`` does."""
    celery_queue = app.amqp.queues[queue]
    assert celery_queue.queue_arguments == {"x-max-priority": 10}
    with app.connection_for_write() as conn:
        celery_queue(conn.default_channel).declare()


def test_drain_and_celery_declare_priority_queues_alike(
    db_url: str, queue: str, other_queue: str, start_active_drain: Any, celery_app: Celery
) -> None:
    try:
        # Celery first, then the drain: the drain's declare must be accepted.
        _celery_declare(celery_app, queue)
        with psycopg.connect(db_url) as conn:
            first = drain.stage(conn, "t.celery_first", queue=queue, priority=4)
        running = start_active_drain(db_url, queue_max_priority=10)
        support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the job to drain")
        assert not running.drain.pipeline.paused, "the drain's declare was refused"
        messages = _consume(queue)
        assert support.task_ids(messages) == [str(first)]
        assert messages[0][1].priority == 4
        # The drain first, then Celery: Celery's declare must be accepted.
        with psycopg.connect(db_url) as conn:
            second = drain.stage(conn, "t.drain_first", queue=other_queue, priority=4)
        support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the job to drain")
        _celery_declare(celery_app, other_queue)
        assert support.task_ids(_consume(other_queue)) == [str(second)]
    finally:
        with support.broker_channel() as ch:  # Celery declared an exchange per queue
            for name in (queue, other_queue):
                ch.exchange_delete(name)


# -- 5. expiry ---------------------------------------------------------------------


def test_expired_rows_go_to_dead_jobs_and_live_ones_carry_their_expiry(
    db_url: str, queue: str, start_active_drain: Any
) -> None:
    with psycopg.connect(db_url) as conn:
        expired = drain.stage(conn, "t.expired", [1], {"k": "v"}, queue=queue, expires=0.5,
                              tag="tests.expiry", priority=2)
        # Still delayed when it expires: expiry wins, the row is not kept until due.
        delayed_expired = drain.stage(conn, "t.delayed_expired", queue=queue,
                                      countdown=3600, expires=0.5)
        live = drain.stage(conn, "t.live", queue=queue, expires=120)
        plain = drain.stage(conn, "t.plain", queue=queue)
    expires_at = _column(db_url, live, "expires_at")

    def both_expired() -> bool:
        with psycopg.connect(db_url) as conn:
            row = conn.execute(
                "SELECT bool_and(expires_at <= now()) FROM staged_jobs "
                "WHERE task_id = ANY(%s)", ([expired, delayed_expired],)
            ).fetchone()
        return bool(row and row[0])

    support.wait_for(both_expired, 10, "the short expiries to pass")
    started = time.time()
    start_active_drain(db_url)
    support.wait_for(lambda: support.staged_count(db_url) == 0 and len(_dead(db_url)) == 2, 30,
                     "both expired rows in dead_jobs")
    dead = {d["task_id"]: d for d in _dead(db_url)}
    assert set(dead) == {str(expired), str(delayed_expired)}
    assert {d["reason"] for d in dead.values()} == {"expired"}
    assert dead[str(expired)]["args"] == [1] and dead[str(expired)]["kwargs"] == {"k": "v"}
    assert dead[str(expired)]["tag"] == "tests.expiry"
    assert dead[str(expired)]["priority"] == 2
    assert dead[str(expired)]["detail"] is None
    assert dead[str(delayed_expired)]["not_before"] is not None

    by_id = _by_id(_consume(queue))
    assert set(by_id) == {str(live), str(plain)}, "an expired job was published"
    _, props, _ = by_id[str(live)]
    assert props.headers["expires"] == expires_at.astimezone(UTC).isoformat()
    assert dt.datetime.fromisoformat(props.headers["expires"]) == expires_at
    assert isinstance(props.expiration, str) and props.expiration.isdigit()
    assert 0 < int(props.expiration) <= (expires_at.timestamp() - started) * 1000 + 1
    _, plain_props, _ = by_id[str(plain)]
    assert plain_props.headers["expires"] is None
    assert plain_props.expiration is None


def test_more_expired_rows_than_a_batch_are_all_dead_lettered(
    db_url: str, queue: str, start_active_drain: Any
) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (task_name, args, queue, expires_at) "
            "SELECT 't.expired', jsonb_build_array(g), %s, now() - interval '1 second' "
            "FROM generate_series(1, 25) g",
            (queue,),
        )
        sentinel = drain.stage(conn, "t.sentinel", queue=queue)
    running = start_active_drain(db_url, batch_size=10)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the backlog to settle")
    # (RabbitMQ drops a message published with expiration "0" when no consumer is
    # waiting, so the queue alone would not show an expired job that went out.)
    assert support.task_ids(_consume(queue)) == [str(sentinel)], "expired jobs were published"
    assert running.drain.published == 1, "expired jobs were published"
    dead = _dead(db_url)
    assert len(dead) == 25 and {d["reason"] for d in dead} == {"expired"}


def test_a_mass_expiry_is_moved_before_any_fetch_has_to_skip_it(
    db_url: str, queue: str, start_active_drain: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (task_name, args, queue, expires_at) "
            "SELECT 't.expired', jsonb_build_array(g), %s, now() - interval '1 second' "
            "FROM generate_series(1, 1000) g",
            (queue,),
        )
        live = drain.stage_many(conn, [drain.Job("t.live", [i], queue=queue) for i in range(30)])
    # How many expired rows (not in flight) each fetch would have to step over.
    skipped: list[object] = []
    fetch = Store.fetch

    def counting_fetch(
        self: Store, limit: int, exclude: list[int] | None = None,
        paused: list[str] | None = None, plan: keyset.FetchPlan | None = None,
        **options: Any,
    ) -> list[StagedRow]:
        row = self._require().execute(
            "SELECT count(*) FROM staged_jobs WHERE expires_at <= now() "
            "AND id <> ALL(%s::bigint[])", (exclude or [],)
        ).fetchone()
        skipped.append(row[0] if row else -1)
        return fetch(self, limit, exclude, paused, plan, **options)

    monkeypatch.setattr(Store, "fetch", counting_fetch)
    # No NOTIFY comes (everything was staged before the drain listened) and the
    # poll interval is far off: the drain must go from one cycle to the next at
    # once while it is moving full batches of expired rows.
    start_active_drain(db_url, batch_size=100, poll_interval=300.0)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60, "the backlog to settle")
    assert sorted(support.task_ids(_consume(queue))) == sorted(map(str, live))
    assert len(_dead(db_url)) == 1000
    assert skipped and set(skipped) == {0}, f"fetches stepped over expired rows: {skipped}"


def test_the_broker_drops_a_published_message_once_it_expires(
    db_url: str, queue: str, start_active_drain: Any
) -> None:
    start_active_drain(db_url)
    with psycopg.connect(db_url) as conn:
        drain.stage(conn, "t.short_lived", queue=queue, expires=1.5)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 10, "the job to be published")
    assert support.queue_depth(queue) == 1, "published with an expiration already passed"
    # The AMQP expiration property makes RabbitMQ discard it, unconsumed.
    support.wait_for(lambda: support.queue_depth(queue) == 0, 10,
                     "the broker to discard the expired message")
    assert _dead(db_url) == []


# -- 6. too large --------------------------------------------------------------------


def _body_size(args: list[Any]) -> int:
    row = StagedRow(id=1, task_id=uuid.uuid4(), task_name="t.big",
                            args_json=json.dumps(args), kwargs_json="{}", queue="q")
    return len(message.build(row, origin="o", reply_to="r").body)


def test_a_message_over_max_message_size_is_dead_lettered_and_its_batch_published(
    db_url: str, queue: str, start_active_drain: Any, caplog: pytest.LogCaptureFixture
) -> None:
    limit = 2000
    fits = limit - _body_size([""])  # the string that makes a body of exactly the limit
    assert _body_size(["x" * fits]) == limit
    with psycopg.connect(db_url) as conn:
        before = drain.stage_many(conn, [drain.Job("t.small", [i], queue=queue)
                                         for i in range(3)])
        exact = drain.stage(conn, "t.big", ["x" * fits], queue=queue)
        over = drain.stage(conn, "t.big", ["x" * (fits + 1)], queue=queue)
        huge = drain.stage(conn, "t.big", ["y" * 5000], queue=queue, tag="tests.big")
        after = drain.stage_many(conn, [drain.Job("t.small", [i], queue=queue)
                                        for i in range(3)])
    start_active_drain(db_url, max_message_size=limit)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the batch to settle")
    published = support.task_ids(_consume(queue))
    assert published == [str(t) for t in [*before, exact, *after]]
    dead = {d["task_id"]: d for d in _dead(db_url)}
    assert set(dead) == {str(over), str(huge)}
    assert {d["reason"] for d in dead.values()} == {"too_large"}
    for task_id, size in ((over, limit + 1), (huge, _body_size(["y" * 5000]))):
        detail = dead[str(task_id)]["detail"]
        assert re.fullmatch(
            rf"message body of {size} bytes exceeds max_message_size \({limit} bytes\)", detail
        ), detail
    assert dead[str(huge)]["tag"] == "tests.big"


# -- 8. tags -------------------------------------------------------------------------


def test_tags_travel_in_the_drain_tag_header(
    db_url: str, queue: str, start_active_drain: Any
) -> None:
    with psycopg.connect(db_url) as conn:
        tagged = drain.stage(conn, "t.tagged", queue=queue, tag="api.create_annotation")
        untagged = drain.stage(conn, "t.untagged", queue=queue)
        unicode_tag = "backfill.réindex-☃"
        many = drain.stage_many(conn, [
            drain.Job("t.many", [1], queue=queue, tag=unicode_tag),
            {"task_name": "t.many", "args": [2], "queue": queue},
        ])
    start_active_drain(db_url)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the jobs to drain")
    by_id = _by_id(_consume(queue))
    assert by_id[str(tagged)][1].headers["drain_tag"] == "api.create_annotation"
    assert by_id[str(many[0])][1].headers["drain_tag"] == unicode_tag
    for task_id in (untagged, many[1]):
        assert "drain_tag" not in by_id[str(task_id)][1].headers


# -- 9. staging in bulk from SQL -------------------------------------------------------------


def test_bulk_staging_from_sql_publishes_every_row_with_one_notify_per_statement(
    db_url: str, queue: str, start_active_drain: Any
) -> None:
    # As while a drain sleeps armed (drain.postgres.wakeup): otherwise staging sends none.
    with support.wake_flag_raised(db_url) as listener, psycopg.connect(db_url) as conn:
        listener.execute("LISTEN drain_staged_jobs")
        by_function = {
            str(r[0]) for r in conn.execute(
                "SELECT drain_stage('t.x', kwargs => jsonb_build_object('n', g), "
                "priority => -10, tag => 'backfill.test', queue => %s) "
                "FROM generate_series(1, 500) g",
                (queue,),
            )
        }
        conn.commit()
        by_insert = {
            str(r[0]) for r in conn.execute(
                "INSERT INTO staged_jobs (task_name, args, priority, tag, queue) "
                "SELECT 't.y', jsonb_build_array(g), 5, 'backfill.insert', %s "
                "FROM generate_series(1, 500) g RETURNING task_id",
                (queue,),
            )
        }
        conn.commit()
        # A bounded window: both commits are done, so their notifications are sent.
        notifies = list(listener.notifies(timeout=0.5))
    assert len(notifies) == 2, [n.channel for n in notifies]
    assert len(by_function) == 500 and len(by_insert) == 500

    start_active_drain(db_url)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the rows to drain")
    messages = _consume(queue)
    assert len(messages) == 1000
    # Priority 5 (the INSERT) before priority -10 (drain_stage).
    assert set(support.task_ids(messages[:500])) == by_insert
    assert set(support.task_ids(messages[500:])) == by_function
    for msg in messages:
        args, kwargs = _body(msg)
        headers = msg[1].headers
        if headers["task"] == "t.x":
            assert headers["drain_tag"] == "backfill.test"
            assert args == [] and set(kwargs) == {"n"}
        else:
            assert headers["drain_tag"] == "backfill.insert"
            assert kwargs == {} and len(args) == 1
    assert sorted(_body(m)[1]["n"] for m in messages[500:]) == list(range(1, 501))
    assert sorted(_body(m)[0][0] for m in messages[:500]) == list(range(1, 501))
    # Within one priority, staging order (the id) decides.
    assert [_body(m)[0][0] for m in messages[:500]] == list(range(1, 501))

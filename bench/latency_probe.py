"""bench_latency's probe: ``drain run`` with timestamps on a few methods, run inside
the drain process (``bench_latency.py --drain-probe run ...``)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any


def drain_probe(argv: list[str]) -> int:
    """``drain run`` (drain.cli.main.main) with timestamps on a few methods, dumped at exit.

    Each wrapper reads time.time() and appends one tuple; the drain's own code
    runs unchanged. The dump goes to the file named by $BENCH_LATENCY_PROBE.
    """
    from drain.broker.publisher import Publisher
    from drain.cli import main as cli
    from drain.postgres.store import Store

    out_path = os.environ["BENCH_LATENCY_PROBE"]
    rec: dict[str, list[Any]] = {
        "fetch": [],    # (t_before, t_after, [(row_id, task_id)])
        "publish": [],  # (t_before, t_after, generation, base_tag, [task_id])
        "confirm": [],  # (t, generation, delivery_tag, multiple, ack)
        "wait": [],     # (t_before, t_after, batch_size)
        "tx": [],       # (t_begin, t_committed, [deleted row ids])
        "idle": [],     # (t_before, t_after, notified, NOTIFYs waiting at the start)
        "query": [],    # (t_before, t_after, query name): every round trip but BEGIN/COMMIT
                        # (several statements in one: their names joined by +)
    }
    now = time.time
    deleting: list[int] = []
    fetch_before, start_before = Store.fetch, Publisher.start
    confirm_before, wait_before = Publisher._on_confirm, Publisher.wait
    wait_some_before = Publisher.wait_some
    batch_before, delete_before, idle_before = Store.batch, Store.delete, Store.wait
    execute_before, notified_before = Store._execute, Store._notified
    execute_all_before = Store._execute_all
    # NOTIFYs each Store._notified call took (psycopg's Connection.notifies), since
    # the idle wait began.
    taken: list[int] = []

    def fetch(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = now()
        rows = fetch_before(self, *args, **kwargs)
        rec["fetch"].append((t0, now(), [(r.id, r.task_id) for r in rows]))
        return rows

    def start(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = now()
        batch = start_before(self, *args, **kwargs)
        rec["publish"].append((t0, now(), batch.generation, batch.base,
                               [m.task_id for m in batch.messages]))
        return batch

    def on_confirm(self: Any, frame: Any) -> None:
        method = frame.method
        rec["confirm"].append((now(), self._generation, method.delivery_tag,
                               bool(method.multiple), type(method).__name__ == "Ack"))
        confirm_before(self, frame)

    def timed_wait(before: Any) -> Any:
        """``Publisher.wait`` or ``wait_some`` (drain.daemon.confirms: until enough is
        answered), timed into ``rec["wait"]``."""
        def wait(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = now()
            result = before(self, batch, *args, **kwargs)
            rec["wait"].append((t0, now(), len(batch.status)))
            return result
        return wait

    @contextlib.contextmanager
    def batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = now()
        deleting.clear()
        with batch_before(self, *args, **kwargs):
            yield
        rec["tx"].append((t0, now(), list(deleting)))

    def delete(self: Any, rows: Mapping[int, int], *args: Any, **kwargs: Any) -> Any:
        deleting.extend(rows)  # {id: xact}: the ids
        return delete_before(self, rows, *args, **kwargs)

    def notified(self: Any, conn: Any) -> Any:
        counting = CountingNotifies(conn)
        proxy: Any = counting  # stands in for the psycopg connection
        try:
            return notified_before(self, proxy)
        finally:
            taken.append(counting.count)

    def idle(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = now()
        taken.clear()
        notified = idle_before(self, *args, **kwargs)
        # The wait first takes, without blocking, the NOTIFYs that arrived while the
        # connection ran the batch's queries (psycopg keeps them) or sit unread.
        queued = taken[0] if taken else 0
        rec["idle"].append((t0, now(), notified, queued))
        return notified

    def execute(self: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        t0 = now()
        cursor = execute_before(self, name, *args, **kwargs)
        rec["query"].append((t0, now(), name))
        return cursor

    def execute_all(self: Any, commands: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = now()
        cursors = execute_all_before(self, commands, *args, **kwargs)
        rec["query"].append((t0, now(), "+".join(name for name, _ in commands)))
        return cursors

    Store._execute = execute  # type: ignore[method-assign]
    Store._execute_all = execute_all  # type: ignore[method-assign]
    Store.fetch = fetch  # type: ignore[method-assign]
    Publisher.start = start  # type: ignore[method-assign]
    Publisher._on_confirm = on_confirm  # type: ignore[method-assign]
    Publisher.wait = timed_wait(wait_before)  # type: ignore[method-assign]
    Publisher.wait_some = timed_wait(wait_some_before)  # type: ignore[method-assign]
    Store.batch = batch  # type: ignore[method-assign]
    Store.delete = delete  # type: ignore[method-assign]
    Store.wait = idle  # type: ignore[method-assign]
    Store._notified = notified  # type: ignore[method-assign]

    def dump() -> None:
        data = dict(rec)
        data["fetch"] = [(a, b, [(i, str(t)) for i, t in rows]) for a, b, rows in rec["fetch"]]
        with open(out_path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(out_path + ".tmp", out_path)

    atexit.register(dump)
    return int(cli.main(argv))


class CountingNotifies:
    """A psycopg connection whose ``notifies()`` counts the notifications it yields."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.count = 0

    def notifies(self, **kwargs: Any) -> Iterator[Any]:
        for note in self.conn.notifies(**kwargs):
            self.count += 1
            yield note

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)



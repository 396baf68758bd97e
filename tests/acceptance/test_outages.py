"""Postgres down for 1, 5 and 30 seconds: the drain resumes as soon as it listens again.

Between its reconnect attempts (exponential backoff up to 10 s) the drain
knocks on the database's port every 0.1 s (drain.broker.reachable); the first knock
accepted after a refused one ends the wait. Postgres is taken away by a real
TCP proxy in front of it that stops listening (connection refused, as for a
server that is down) and listens again.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests import support

_FAULT_CLOCK = threading.Event()  # never set: its wait() is how long a fault lasts


@pytest.mark.parametrize("outage", [1, 5, 30])
def test_the_drain_resumes_when_postgres_listens_again(
    db_url: str, queue: str, spawn: Any, outage: int
) -> None:
    proxy = support.TcpProxy(support.PG_PORT).start()
    try:
        via_proxy = support.via_proxy(db_url, proxy.port)
        proc = spawn(support.drain_argv("run", "--poll-interval", "0.2"),
                     support.drain_env(via_proxy), "drain")
        proc.wait_for_output("active: took the drain lock", timeout=30)
        proxy.refuse()
        support.wait_for(lambda: "retrying with backoff" in proc.output(), 30,
                         "the drain to notice Postgres is gone")
        _FAULT_CLOCK.wait(outage)  # the outage itself, not a synchronisation
        staged = support.stage_backlog(db_url, queue, 1)  # straight to Postgres
        proxy.restart()
        back = time.monotonic()
        support.wait_for(lambda: support.queue_depth(queue) == 1, 60,
                         "the job staged during the outage to be published")
        resumed = time.monotonic() - back
    finally:
        proxy.stop()
    out = proc.output()
    print(f"\n[outage {outage}s] the job was published {resumed:.2f}s after Postgres "
          f"listened again")
    support.check_at_least_once(support.drain_queue(queue), staged)
    assert "database is accepting connections again: reconnecting now" in out, out[-2000:]

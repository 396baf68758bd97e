"""A ``;``-separated broker list (Celery's failover syntax), with the real RabbitMQ.

* The first broker is down (a closed port): ``drain run`` publishes every
  staged job through the second.
* The drain publishes through the first broker (a TCP proxy in front of the
  real one) and that connection is cut in the middle of a backlog: it goes on
  through the second (round-robin: the next one, not the first again), and no
  job is lost.
* With ``--app`` and no ``--broker-url`` / ``DRAIN_BROKER_URL``, the app's
  ``broker_url`` list is the one used.

There is one RabbitMQ here, so "two brokers" are two ways to it: a closed
port or a proxy, and its own port. TLS (``broker_use_ssl``) cannot be tested
end to end here (no TLS listener): tests/unit/test_broker_options.py checks
what drain makes of it.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import psycopg

import drain
from drain.settings.urls import mask_url
from tests import support

SECOND = support.BROKER_URL
SECOND_SHOWN = mask_url(SECOND)


def test_the_first_broker_down_publishes_through_the_second(db_url: str, queue: str) -> None:
    staged = support.stage_backlog(db_url, queue, 300)
    closed = support.free_port()
    # Never sent anywhere (nothing listens there), and never shown.
    first = support.broker_url(closed, password="Zq8Kx3Wv")
    result = support.run_cli(db_url, "run", "--exit-when-empty",
                             "--broker-url", f"{first} ; {SECOND}")  # the flag wins
    assert result.returncode == 0, result.stderr
    assert support.staged_count(db_url) == 0
    support.check_at_least_once(support.drain_queue(queue), staged)
    out = result.stdout + result.stderr
    assert (f"broker at {support.broker_url(closed, password='***')} unreachable: connection "
            f"refused; failed over to broker at {SECOND_SHOWN} (2 of 2)") in out, out
    assert "Zq8Kx3Wv" not in out


def test_a_broker_lost_mid_run_fails_over_to_the_next_and_nothing_is_lost(
    db_url: str, queue: str, spawn: Any
) -> None:
    proxy = support.TcpProxy(support.BROKER_PORT).start()
    try:
        first = support.broker_url(proxy.port)
        env = support.drain_env(db_url, DRAIN_BROKER_URL=f"{first};{SECOND}")
        proc = spawn(support.drain_argv("run", "--batch-size", "200", "--poll-interval", "0.2"),
                     env, "drain")
        proc.wait_for_output(
            f"connected to broker at {support.broker_url(proxy.port, password='***')} (1 of 2)",
            timeout=30)
        staged = support.stage_backlog(db_url, queue, 20_000)
        support.wait_for(lambda: support.staged_count(db_url) < 19_000, 60,
                         "the drain to publish through the first broker")
        proxy.cut()  # the proxy still accepts new connections: round-robin goes on to B
        support.wait_for(lambda: f"{SECOND_SHOWN} (2 of 2)" in proc.output(), 30,
                         "the drain to fail over to the second broker")
        later = support.stage_backlog(db_url, queue, 200)
        support.wait_for(lambda: support.staged_count(db_url) == 0, 120,
                         "every job to be published")
        accepted = proxy.accepted
    finally:
        proc.stop()
        proxy.stop()
    messages = support.drain_queue(queue)
    copies = support.check_at_least_once(messages, {**staged, **later})
    out = proc.output()
    print(f"\n[broker list] {len(messages)} messages for {len(copies)} jobs after the cut")
    assert f"connected to broker at {SECOND_SHOWN} (2 of 2)" in out or (
        f"failed over to broker at {SECOND_SHOWN} (2 of 2)" in out), out[-3000:]
    # Round-robin: after the cut the drain reconnected to the next broker, not
    # to the first again (which still accepted connections).
    assert accepted == 1, f"{accepted} connections through the proxy:\n{out[-3000:]}"


def test_the_apps_broker_list_is_used_without_a_broker_url(
    db_url: str, queue: str, tmp_path: Path
) -> None:
    closed = support.free_port()
    (tmp_path / "failover_list_app.py").write_text(textwrap.dedent(f"""
        from celery import Celery

        app = Celery("failover_list_app", set_as_current=False)
        app.conf.broker_url = "{support.broker_url(closed, password='Qz6Wk1Xv')}; {SECOND}"


        @app.task(name="failover_list.record")
        def record(i, **kwargs):
            return i
    """))
    with psycopg.connect(db_url) as conn:
        ids = drain.stage_many(conn, (drain.Job("failover_list.record", [i], {"i": i},
                                                queue=queue) for i in range(50)))
    staged = {str(task_id): i for i, task_id in enumerate(ids)}
    env = support.drain_env(db_url)
    del env["DRAIN_BROKER_URL"]
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    result = support.run_cli(db_url, "run", "--app", "failover_list_app", "--exit-when-empty",
                             env=env)
    assert result.returncode == 0, result.stderr
    support.check_at_least_once(support.drain_queue(queue), staged)
    out = result.stdout + result.stderr
    first_shown = support.broker_url(closed, password="***")
    assert (f"brokers from the Celery app's broker_url: {first_shown};{SECOND_SHOWN} "
            "(failover: round-robin)") in out, out
    assert f"failed over to broker at {SECOND_SHOWN} (2 of 2)" in out, out
    assert "Qz6Wk1Xv" not in out

"""Fixtures for running a Drain in-process against the real services."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from drain.daemon.runner import Drain, State
from drain.settings.config import Settings
from tests import roles, support
from tests.machine import rabbitmqctl


class Running:
    """A Drain running in a background thread, stopped at the end of the test."""

    def __init__(self, settings: Settings, **hooks: Any) -> None:
        self.drain = Drain(settings, **hooks)
        self.thread = threading.Thread(target=self.drain.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.drain.stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the drain did not stop"


@pytest.fixture
def start_drain() -> Iterator[Callable[..., Running]]:
    """Start a drain on a database with Settings overrides (short polls and backoff);
    ``on_fetch`` and ``on_cycle`` are passed to the Drain itself. It runs as the
    drain's least-privileged role (tests/roles.py), or as ``role=``."""
    running: list[Running] = []

    def _start(db_url: str, role: str = roles.RUNNER, **overrides: Any) -> Running:
        hooks = {k: overrides.pop(k) for k in ("on_fetch", "on_cycle") if k in overrides}
        settings = Settings(database_url=roles.url(db_url, role), broker_url=support.BROKER_URL,
                            **{"poll_interval": 0.2, "max_backoff": 0.5, **overrides})
        r = Running(settings, **hooks)
        running.append(r)
        return r

    yield _start
    for r in running:
        r.stop()


@pytest.fixture
def start_active_drain(start_drain: Callable[..., Running]) -> Callable[..., Running]:
    """Like start_drain, and wait until the drain holds the lock."""

    def _start(db_url: str, **overrides: Any) -> Running:
        r = start_drain(db_url, **overrides)
        support.wait_for(lambda: r.drain.state is State.ACTIVE, 30, "the drain to lead")
        return r

    return _start


def queue_process(queue: str, call: str) -> None:
    """``sys:<call>`` on the process of ``queue`` (in the run's vhost) on the broker:
    "suspend" it and the broker takes the messages sent to it and confirms none,
    until "resume"."""
    name = f'rabbit_misc:r(<<"{support.BROKER_VHOST}">>, queue, <<"{queue}">>)'
    rabbitmqctl("eval", f"{{ok, Q}} = rabbit_amqqueue:lookup({name}), "
                        f"sys:{call}(amqqueue:get_pid(Q)).")


@pytest.fixture
def silence() -> Iterator[Callable[[str], None]]:
    """Suspend a queue's process (:func:`queue_process`): the broker stops confirming
    what goes to it. Resumed after the test, whatever happened (before the queue
    fixtures delete it)."""
    silenced: list[str] = []

    def _silence(queue: str) -> None:
        silenced.append(queue)
        queue_process(queue, "suspend")

    yield _silence
    for queue in silenced:
        queue_process(queue, "resume")


@pytest.fixture
def proxy() -> Iterator[support.TcpProxy]:
    """A TcpProxy in front of the run's RabbitMQ (tests/support.py), stopped after."""
    proxy = support.TcpProxy(support.BROKER_PORT).start()
    yield proxy
    proxy.stop()

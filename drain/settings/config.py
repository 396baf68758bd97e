"""Settings: everything ``drain run`` needs, checked when it is built.

One frozen :class:`Settings` holds everything ``drain run`` needs. It is built
from command-line flags, falling back to ``DRAIN_*`` environment variables,
falling back to defaults; the database URL may be empty, in which case libpq's
own ``PG*`` variables (``PGHOST``, ``PGDATABASE``...) apply.

URLs are read, checked and masked by :mod:`drain.settings.urls`; which brokers the
drain connects to, and how, is :mod:`drain.broker.broker_list`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from drain.errors import ConfigError
from drain.settings.urls import (
    broker_list_parameters,
    database_conninfo,
    mask_database_url,
    mask_url,
    secrets_of,
)

DEFAULT_BROKER_URL = "amqp://guest:guest@127.0.0.1:5672//"
#: An arbitrary fixed key (``hash('drain')`` truncated), overridable per deployment.
DEFAULT_LOCK_KEY = 7_236_969_102_118_146_416
NOTIFY_CHANNEL = "drain_staged_jobs"
#: The most lanes one drain may be split into.
MAX_LANES = 64
DEFAULT_BATCH_SIZE = 1000
#: RabbitMQ 4's max_message_size (3.x allows 128 MiB).
DEFAULT_MAX_MESSAGE_SIZE = 16 * 1024 * 1024
#: The drain's AMQP heartbeat when the Celery app sets none or 0, and the
#: longest it uses whatever the app sets (drain.broker.broker_options.heartbeat_for).
DEFAULT_HEARTBEAT = 30
MAX_HEARTBEAT = 60
#: Batches in flight by default, and at most (drain.daemon.runner).
DEFAULT_PIPELINE = 4
MAX_PIPELINE = 16

@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a drain process is configured with.

    ``repr()`` masks passwords; use :meth:`describe` for the start-up log line.
    """

    database_url: str = ""
    #: The broker URL, or a ``;``-separated failover list of them (drain.broker.broker_list),
    #: as given (``--broker-url``, ``DRAIN_BROKER_URL``). None: not given; with
    #: ``celery_app``, the app's broker_write_url or broker_url, else
    #: :data:`DEFAULT_BROKER_URL`.
    broker_url: str | None = None
    #: Rows fetched, published and deleted per transaction.
    batch_size: int = DEFAULT_BATCH_SIZE
    #: Batches in flight at once: while the broker confirms the oldest, the
    #: next ones are fetched and published. A crash republishes at most
    #: ``pipeline * batch_size`` jobs (duplicates with the same task ids); 1
    #: waits for each batch's confirms before fetching the next.
    pipeline: int = DEFAULT_PIPELINE
    #: Seconds between polls when no NOTIFY arrives (bounds the cost of a lost one).
    poll_interval: float = 1.0
    #: Seconds between a standby's attempts to take the lock.
    standby_interval: float = 0.5
    #: Postgres advisory lock key (bigint); drains sharing a key exclude each other.
    lock_key: int = DEFAULT_LOCK_KEY
    #: Seconds to wait for the broker to confirm a batch before abandoning it.
    confirm_timeout: float = 30.0
    #: The AMQP heartbeat (seconds, 1 to 60) when the Celery app sets none or 0
    #: (drain.broker.broker_options.heartbeat_for): a broker that blocks the drain and
    #: then dies silently is noticed within 2 x (heartbeat + 5) s.
    broker_heartbeat: int = DEFAULT_HEARTBEAT
    #: Seconds Postgres may take over one of the drain's commands: the
    #: session's ``statement_timeout``. A command still unanswered
    #: ``ANSWER_GRACE`` seconds later means the server, or a pooler or network
    #: path in front of it, hangs: the drain abandons that connection
    #: (drain.daemon.watchdog).
    db_timeout: float = 30.0
    #: How queues are declared: "celery" (durable, no arguments, like Celery's
    #: defaults) or "passive" (only check that the queue exists).
    queue_declare: str = "celery"
    #: Maximum seconds between reconnection attempts.
    max_backoff: float = 10.0
    #: Queues are declared with ``x-max-priority`` this high (0: no priority),
    #: as Celery does with ``task_queue_max_priority``; row priorities are
    #: published as AMQP priorities clamped to 0..N.
    queue_max_priority: int = 0
    #: Bodies larger than this are dead-lettered ('too_large') instead of being
    #: refused by the broker: RabbitMQ's ``max_message_size`` (16 MiB on 4.x,
    #: 128 MiB on 3.x).
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    #: How the fetch finds the next rows: "keyset" (from per-priority low-water
    #: marks, immune to the dead rows a long transaction keeps; drain.postgres.keyset) or
    #: "head" (from the head of the index every time; for comparison only).
    fetch_strategy: str = "keyset"
    #: Seconds between full rescans from the head of the index (keyset only; a
    #: backstop the marks do not rely on, see drain.postgres.keyset); 0: never.
    rescan_interval: float = 300.0
    #: Lanes: this drain publishes only the rows with ``abs(id % lanes) == lane``,
    #: under its own lock, so ``lanes`` drains can run in parallel.
    lanes: int = 1
    lane: int = 0
    #: The user's Celery app, ``MODULE:ATTR`` or ``MODULE`` as for ``celery -A``
    #: (drain.celery.celery_app): rows are routed, declared and sent as its
    #: ``apply_async`` would (drain.celery.routing). Empty: every row goes through the
    #: default exchange to its own queue, declared durable.
    celery_app: str = ""
    #: With ``celery_app``: publish rows whose task the app does not know (as
    #: ``send_task`` would) instead of moving them to dead_jobs ('unknown_task').
    allow_unknown_tasks: bool = False
    #: How a job's message relates to the OpenTelemetry context it was staged in
    #: (drain.daemon.tracing, docs/tracing.md): "child" (the publish span, and so
    #: the worker's, joins the staging trace), "link" (a new trace linked to
    #: it) or "none" (the staging context is not used).
    trace_context: str = "child"
    #: A job staged longer ago than this many seconds starts a new trace linked
    #: to its staging context, whatever ``trace_context`` says.
    trace_new_after: float = 300.0

    def __post_init__(self) -> None:
        positive = {
            "poll interval": self.poll_interval,
            "standby interval": self.standby_interval,
            "confirm timeout": self.confirm_timeout,
            "max backoff": self.max_backoff,
            "max message size": self.max_message_size,
            "trace new-after": self.trace_new_after,
        }
        for what, value in positive.items():
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{what} must be positive, got {value}")
        if not (math.isfinite(self.rescan_interval) and self.rescan_interval >= 0):
            raise ConfigError(
                f"rescan interval must be 0 (never) or positive, got {self.rescan_interval}")
        if not 0.1 <= self.db_timeout <= 86400:
            raise ConfigError(
                f"database timeout must be from 0.1 to 86400 s, got {self.db_timeout}")
        if self.batch_size < 1:
            raise ConfigError(f"batch size must be at least 1, got {self.batch_size}")
        if not 1 <= self.pipeline <= MAX_PIPELINE:
            raise ConfigError(f"pipeline must be from 1 to {MAX_PIPELINE}, got {self.pipeline}")
        if not -(2**63) <= self.lock_key < 2**63:
            raise ConfigError(f"lock key must fit in a signed 64-bit integer, got {self.lock_key}")
        if not 0 <= self.queue_max_priority <= 255:
            raise ConfigError(
                f"queue max priority must be from 0 to 255, got {self.queue_max_priority}"
            )
        if not 1 <= self.lanes <= MAX_LANES:
            raise ConfigError(f"lanes must be from 1 to {MAX_LANES}, got {self.lanes}")
        if not 0 <= self.lane < self.lanes:
            raise ConfigError(
                f"lane must be from 0 to {self.lanes - 1} (--lanes {self.lanes}), got {self.lane}"
            )
        choices = {
            "queue declare mode": (self.queue_declare, ("celery", "passive")),
            "fetch strategy": (self.fetch_strategy, ("keyset", "head")),
            "trace context": (self.trace_context, ("child", "link", "none")),
        }
        for what, (choice, allowed) in choices.items():
            if choice not in allowed:
                raise ConfigError(
                    f"{what} must be {' or '.join(repr(a) for a in allowed)}, got {choice!r}"
                )
        self._check_app()
        self._check_urls()
        self._check_broker()

    def _check_urls(self) -> None:
        """Parse the URLs now so that a malformed one fails at start, not later."""
        database_conninfo(self.database_url)
        if self.broker_url is not None:
            broker_list_parameters(self.broker_url)

    def _check_broker(self) -> None:
        if not 1 <= self.broker_heartbeat <= MAX_HEARTBEAT:
            raise ConfigError(f"broker heartbeat must be from 1 to {MAX_HEARTBEAT} s, "
                              f"got {self.broker_heartbeat}")

    def _check_app(self) -> None:
        if self.celery_app and self.queue_max_priority:
            raise ConfigError("--queue-max-priority does not go with --app: the app's "
                              "task_queue_max_priority and task_queues decide")
        if self.allow_unknown_tasks and not self.celery_app:
            raise ConfigError("--allow-unknown-tasks needs --app")

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{f.name}={self._display(f.name)!r}" for f in dataclasses.fields(self)
        )
        return f"Settings({fields})"

    def _display(self, name: str) -> Any:
        value = getattr(self, name)
        if name == "database_url":
            return mask_database_url(value)
        if name == "broker_url":
            return None if value is None else mask_url(value)
        return value

    def describe(self) -> str:
        """One line for the start-up log, passwords masked."""
        return (
            f"database={mask_database_url(self.database_url)} "
            f"broker={self._broker_shown()} batch_size={self.batch_size} "
            f"pipeline={self.pipeline} poll_interval={self.poll_interval}s "
            f"db_timeout={self.db_timeout:g}s "
            f"lock_key={self.lock_key} "
            f"queue_declare={self.queue_declare} queue_max_priority={self.queue_max_priority} "
            f"max_message_size={self.max_message_size} fetch={self.fetch_strategy}"
            + (f" lane={self.lane}/{self.lanes}" if self.lanes > 1 else "")
            + (f" app={self.celery_app}" if self.celery_app else "")
        )

    def _broker_shown(self) -> str:
        if self.broker_url is not None:
            return mask_url(self.broker_url)
        return "<the app's>" if self.celery_app else mask_url(DEFAULT_BROKER_URL)

    def secrets(self) -> list[str]:
        """The passwords that :func:`scrub` replaces wherever they appear (see
        :func:`secrets_of`: not the short ones, nor those the masked URLs show)."""
        return secrets_of(self.database_url, self.broker_url or "")

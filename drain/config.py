"""Settings, and the URL handling that keeps secrets out of output.

One frozen :class:`Settings` holds everything ``drain run`` needs. It is built
from command-line flags, falling back to ``DRAIN_*`` environment variables,
falling back to defaults; the database URL may be empty, in which case libpq's
own ``PG*`` variables (``PGHOST``, ``PGDATABASE``...) apply.
"""

from __future__ import annotations

import dataclasses
import re
import socket
import ssl
from typing import Any
from urllib.parse import unquote, urlsplit

import pika
from psycopg import conninfo

from drain.errors import ConfigError

DEFAULT_BROKER_URL = "amqp://guest:guest@127.0.0.1:5672//"
#: An arbitrary fixed key (``hash('drain')`` truncated), overridable per deployment.
DEFAULT_LOCK_KEY = 7_236_969_102_118_146_416
NOTIFY_CHANNEL = "drain_staged_jobs"
#: The most lanes one drain may be split into.
MAX_LANES = 64

_MASK = "***"


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a drain process is configured with.

    ``repr()`` masks passwords; use :meth:`describe` for the start-up log line.
    """

    database_url: str = ""
    broker_url: str = DEFAULT_BROKER_URL
    #: Rows fetched, published and deleted per transaction.
    batch_size: int = 1000
    #: Seconds between polls when no NOTIFY arrives (bounds the cost of a lost one).
    poll_interval: float = 1.0
    #: Seconds between a standby's attempts to take the lock.
    standby_interval: float = 0.5
    #: Postgres advisory lock key (bigint); drains sharing a key exclude each other.
    lock_key: int = DEFAULT_LOCK_KEY
    #: Seconds to wait for the broker to confirm a batch before abandoning it.
    confirm_timeout: float = 30.0
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
    max_message_size: int = 16 * 1024 * 1024
    #: How the fetch finds the next rows: "keyset" (from per-priority low-water
    #: marks, immune to the dead rows a long transaction keeps; drain.keyset) or
    #: "head" (from the head of the index every time; for comparison only).
    fetch_strategy: str = "keyset"
    #: Seconds between full rescans from the head of the index (keyset only).
    rescan_interval: float = 60.0
    #: Lanes: this drain publishes only the rows with ``id % lanes == lane``,
    #: under its own lock, so ``lanes`` drains can run in parallel.
    lanes: int = 1
    lane: int = 0

    def __post_init__(self) -> None:
        positive = {
            "poll interval": self.poll_interval,
            "standby interval": self.standby_interval,
            "confirm timeout": self.confirm_timeout,
            "max backoff": self.max_backoff,
            "max message size": self.max_message_size,
            "rescan interval": self.rescan_interval,
        }
        for what, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{what} must be positive, got {value}")
        if self.batch_size < 1:
            raise ConfigError(f"batch size must be at least 1, got {self.batch_size}")
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
        }
        for what, (choice, allowed) in choices.items():
            if choice not in allowed:
                raise ConfigError(
                    f"{what} must be {' or '.join(repr(a) for a in allowed)}, got {choice!r}"
                )
        # Parse both URLs now so that a malformed one fails at start, not later.
        database_conninfo(self.database_url)
        broker_parameters(self.broker_url)

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
            return mask_url(value)
        return value

    def describe(self) -> str:
        """One line for the start-up log, passwords masked."""
        return (
            f"database={mask_database_url(self.database_url)} "
            f"broker={mask_url(self.broker_url)} batch_size={self.batch_size} "
            f"poll_interval={self.poll_interval}s lock_key={self.lock_key} "
            f"queue_declare={self.queue_declare} queue_max_priority={self.queue_max_priority} "
            f"max_message_size={self.max_message_size} fetch={self.fetch_strategy}"
            + (f" lane={self.lane}/{self.lanes}" if self.lanes > 1 else "")
        )

    def secrets(self) -> list[str]:
        """The passwords in the URLs, so that error text can be scrubbed of them."""
        found = []
        try:
            password = conninfo.conninfo_to_dict(self.database_url).get("password")
        except Exception:
            password = None
        if password:
            found.append(str(password))
        broker_password = urlsplit(self.broker_url).password
        if broker_password:
            found.extend({broker_password, unquote(broker_password)})
        return found


def mask_url(url: str) -> str:
    """``scheme://user:secret@host/x`` -> ``scheme://user:***@host/x``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if parts.password is None:
        return url
    netloc = parts.netloc
    userinfo, _, hostinfo = netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return parts._replace(netloc=f"{user}:{_MASK}@{hostinfo}").geturl()


def mask_database_url(dsn: str) -> str:
    """Mask the password of a libpq URL or ``key=value`` string."""
    if not dsn:
        return "<libpq defaults (PG* variables)>"
    if "://" in dsn:
        return mask_url(dsn)
    return re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", rf"\g<1>{_MASK}", dsn)


def scrub(text: str, secrets: list[str]) -> str:
    """Replace every occurrence of each secret in ``text``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, _MASK)
    return text


def database_conninfo(dsn: str) -> str:
    """Validate a libpq connection string or URL (empty means libpq defaults)."""
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except Exception as exc:
        raise ConfigError(
            f"malformed database URL {mask_database_url(dsn)}: {_first_line(exc)}"
        ) from None
    for port in str(params.get("port") or "").split(","):
        if port and not port.strip().isdigit():
            raise ConfigError(
                f"malformed database URL {mask_database_url(dsn)}: port {port!r} is not a number"
            )
    return dsn


def broker_parameters(
    url: str, *, heartbeat: int = 30, blocked_connection_timeout: float = 30.0
) -> pika.ConnectionParameters:
    """Build pika parameters from a Celery-style broker URL.

    Celery users paste ``amqp://guest:guest@host:5672//``: the path after the
    first slash is the vhost, so ``//`` means the vhost ``/`` and an empty path
    means ``/`` too; ``%2F`` spellings work as well. ``amqps://`` uses TLS with
    the system's trust store. pika's own ``URLParameters`` reads ``//``
    differently, which is why this parser exists.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"malformed broker URL {mask_url(url)}: {exc}") from None
    if parts.scheme not in ("amqp", "amqps", "pyamqp"):
        raise ConfigError(
            f"broker URL {mask_url(url)} must start with amqp:// or amqps://"
        )
    if not parts.hostname:
        raise ConfigError(f"broker URL {mask_url(url)} names no host")
    if parts.query:
        raise ConfigError(
            f"broker URL {mask_url(url)}: query parameters are not supported"
        )
    tls = parts.scheme == "amqps"
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    vhost = unquote(path) if path else "/"
    credentials = pika.PlainCredentials(
        unquote(parts.username) if parts.username else "guest",
        unquote(parts.password) if parts.password else "guest",
    )
    return pika.ConnectionParameters(
        host=parts.hostname,
        port=port or (5671 if tls else 5672),
        virtual_host=vhost,
        credentials=credentials,
        heartbeat=heartbeat,
        blocked_connection_timeout=blocked_connection_timeout,
        connection_attempts=1,
        socket_timeout=5,
        stack_timeout=10,
        client_properties={"connection_name": f"drain@{socket.gethostname()}"},
        ssl_options=pika.SSLOptions(ssl.create_default_context(), parts.hostname) if tls else None,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

"""The exceptions drain raises.

Everything derives from :class:`DrainError`. Driver errors (psycopg, pika) are
wrapped at the boundary with ``raise ... from exc`` so that callers handle one
hierarchy, and every message is safe to print: no password ever appears in it.
"""

from __future__ import annotations


class DrainError(Exception):
    """Root of every error drain raises on purpose."""


class ConfigError(DrainError):
    """A setting is malformed (bad URL, negative batch size...)."""


class RolesShared(ConfigError):
    """``drain migrate`` was to grant this database's privileges to group roles that
    already hold privileges in another database of the cluster (a login granted
    them for one would act in the other): choose another ``--role-prefix``."""


class StagingError(DrainError):
    """A job cannot be staged: bad task name, arguments that are not JSON..."""


class UnsupportedConnection(StagingError):
    """``stage()`` was given an object it does not know how to execute SQL on."""


class DatabaseUnavailable(DrainError):
    """Postgres cannot be reached, refused the login, or the connection died."""


class DatabaseRefused(DatabaseUnavailable):
    """Postgres answered but refused us: bad password, unknown role or database."""


class PermissionDenied(DrainError):
    """Postgres refused a command for lack of privilege (SQLSTATE 42501): the role
    the command runs as lacks a grant. No retry can fix that: fatal, exit code 5."""


class PartitioningChanged(DrainError):
    """A backfill id's resume would put its records in other partitions than its first
    run did (the key, its type or the hash changed): staging would duplicate and lose
    records, so it is refused (exit 6)."""


class SchemaMissing(DrainError):
    """The database has no ``staged_jobs`` table: run ``drain migrate`` first."""


class SchemaNewer(DrainError):
    """The database's schema is of a newer drain than this one (``drain migrate --check``)."""


class BrokerUnavailable(DrainError):
    """RabbitMQ cannot be reached, refused the login, or the connection died."""


class BrokerBlocked(DrainError):
    """RabbitMQ blocks the connection (a memory or disk alarm): nothing failed,
    the confirms of what was sent come once the alarm clears."""


class BrokerRefused(BrokerUnavailable):
    """RabbitMQ answered but refused the login or the vhost."""


class QueueDeclareRefused(BrokerUnavailable):
    """The broker refused to declare a queue (406 PRECONDITION_FAILED...).

    Usually the queue already exists with other arguments (``x-max-priority``,
    ``x-queue-type``) than drain declares it with. The rows stay staged.
    """

    def __init__(self, queue: str, reason: str, mode: str = "celery") -> None:
        how = "check (passive declare)" if mode == "passive" else "declare"
        super().__init__(
            f"broker refused to {how} queue {queue!r}: {reason}; its rows stay staged. If "
            "the queue exists with other arguments (x-max-priority, x-queue-type...), "
            "declare it identically (--queue-max-priority) or run with --queue-declare=passive"
        )
        self.queue = queue
        self.reason = reason


class LaneConflict(DrainError):
    """Drains split in a different number of lanes run on the same lock key."""


class ReadOnlyStandby(DrainError):
    """The database is a hot standby (in recovery): the drain waits, connected,
    until it is promoted (drain.postgres.failover)."""


class PoolWithoutSession(ConfigError):
    """The drain's database URL leads through a pool that does not keep a session
    (PgBouncer in transaction or statement mode): its advisory lock, LISTEN and
    batches would not stay on one backend. Fatal, never retried (drain.postgres.session_probe)."""


class BatchConflict(DrainError):
    """A batch transaction failed on a concurrent change (a serialization failure
    or a deadlock): it was rolled back, the session and the lock are kept."""


class FixtureError(DrainError):
    """drain's pytest fixtures (drain.testing) cannot do what a test asked: no test
    database given, jobs not committed where a drain must see them, a broker that
    does not answer, a task the Celery app does not know."""


class UsageError(DrainError):
    """A command cannot go ahead as asked (the ``drain`` command's exit code 2)."""

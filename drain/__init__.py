"""drain: a transactionally staged job drain from Postgres to Celery on RabbitMQ.

Stage jobs in your own transaction with :func:`stage` / :func:`stage_many`
(or a plain ``INSERT INTO staged_jobs``); run ``drain run`` to publish them.
"""

from __future__ import annotations

from drain.consumer import ConsumerError, claim, effectively_once, purge
from drain.errors import DrainError, StagingError
from drain.staging import Job, stage, stage_many
from drain.version import VERSION as __version__

__all__ = [
    "ConsumerError",
    "DrainError",
    "Job",
    "StagingError",
    "__version__",
    "claim",
    "effectively_once",
    "purge",
    "stage",
    "stage_many",
]

"""Limits the broker sets on a message, which staging and the drain both respect.

RabbitMQ refuses a message whose AMQP ``expiration`` is above
315,360,000,000 ms (3,650 days) by closing the channel with ``406
PRECONDITION_FAILED - ... value_too_large``; ``apply_async`` raises it to its
caller. drain refuses such an expiry at staging (:class:`~drain.errors.StagingError`)
and moves a row staged past it by plain SQL to dead_jobs (reason ``invalid``)
instead of publishing it.
"""

from __future__ import annotations

import datetime as dt

#: The largest AMQP ``expiration`` RabbitMQ accepts, in milliseconds (3,650 days).
MAX_EXPIRATION_MS = 315_360_000_000
#: The same as a duration: an ``expires`` further ahead than this cannot be sent.
MAX_EXPIRES = dt.timedelta(milliseconds=MAX_EXPIRATION_MS)

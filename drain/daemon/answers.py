"""What the broker's answers to the drain do to its holds (drain.daemon.holds).

The pipeline (drain.daemon.pipeline) hands every refused declare and every
batch's :class:`drain.broker.publisher.PublishResult` to :class:`Answers`, which
counts them (drain.daemon.metrics) and pauses, holds, retries or resumes the
keys they name (drain.broker.outgoing.PauseKey): confirms resume their keys;
returns, nacks and refusals pause only theirs, and each log line names it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from drain.broker.batches import PublishResult
from drain.broker.outgoing import PauseKey
from drain.daemon.holds import Holds
from drain.daemon.metrics import Metrics
from drain.errors import QueueDeclareRefused

log = logging.getLogger("drain.pipeline")


class Answers:
    """Counts the broker's refusals, nacks and returns, and holds what they name."""

    def __init__(self, holds: Holds, metrics: Metrics, *, declare_mode: str,
                 forget: Callable[[str], None]) -> None:
        self.holds = holds
        self.metrics = metrics
        self._declare_mode = declare_mode
        #: Declare this queue again before the next publish to it (the publisher's).
        self._forget = forget

    def refused_reason(self, queue: str, reply: str) -> str:
        """The broker refused to declare ``queue``: count it (by reply code) and say
        what it means (drain.daemon.piles.Refusals pauses the queue's key with it)."""
        code = reply.split(" ", 1)[0]
        self.metrics.declare_refused.labels(code if code.isdigit() else "other").inc()
        return str(QueueDeclareRefused(queue, reply, self._declare_mode))

    def settle(self, result: PublishResult) -> None:
        """What one batch's confirms, returns, nacks and refusals do to the holds."""
        holds = self.holds
        confirmed = result.confirmed_keys
        holds.resume(confirmed - result.returned_keys)
        for queue in sorted(result.returned_declared):
            # Unroutable: nothing bound to it (deleted behind our back?). Declare
            # it again next time; meanwhile its rows stay staged.
            self._forget(queue)
        for key in sorted(result.returned_keys):
            holds.pause(key, f"messages to {key} came back unroutable (no queue bound); "
                             "their rows stay staged")
        holds.rows.update(result.returned_to)
        if result.nacked:
            log.warning("broker nacked %d message(s); their rows stay staged", result.nacked)
        for key in sorted(result.nacked_keys):
            # Nacked again if published again at once (a full queue with
            # x-overflow reject-publish): with backoff, not in a loop. A quorum
            # queue without a leader nacks too; the publisher sends the next
            # try on a new channel (drain.broker.channels, ChannelKeepingLink._renew).
            holds.hold(key, f"the broker nacks messages to {key} (full, with x-overflow "
                            "reject-publish, or a quorum queue electing a leader?); "
                            "their rows stay staged")
        holds.confirmed(confirmed - self._refused(result) - result.nacked_keys)

    def _refused(self, result: PublishResult) -> set[PauseKey]:
        """Count and say what the broker refused (drain.broker.refusal): dead-lettered
        rows went to dead_jobs with the batch; held rows pause their key, retried
        ones (their queue declared again) pause it only when it comes again before
        a confirm. Returns the keys held or retried."""
        #: (action, key) -> the reason said: "hold" sorts before "retry".
        pausing: dict[tuple[str, PauseKey], str] = {}
        for m, refusal in result.refused:
            self.metrics.publish_refused.labels(str(refusal.code)).inc()
            key = m.pause_key
            if refusal.action in ("hold", "retry"):
                self.holds.rows[m.row_id] = key
                pausing.setdefault((refusal.action, key), (
                    f"broker refused a publish to exchange {m.exchange!r} ({key}): "
                    f"{refusal.text}; its rows stay staged"))
            else:
                self.holds.say(f"dead {refusal.text}", (
                    f"broker refused a publish ({refusal.text}): moved to dead_jobs "
                    "(reason 'refused')"))
        for (action, key), reason in sorted(pausing.items()):
            (self.holds.hold if action == "hold" else self.holds.retry)(key, reason)
        return {key for _, key in pausing}

"""Messages as they land in queues, and how two of them differ (drain's and Celery's)."""

from __future__ import annotations

import json
from typing import Any

from tests import support

#: Properties and headers that name the sending process, by design per process.
PER_PROCESS = {"reply_to", "origin"}

#: (queue, method, properties, body) of one message.
Landed = tuple[str, Any, Any, bytes]


def collect(queues: set[str], count: int) -> dict[str, Landed]:
    """The next ``count`` messages of ``queues``: {task id: (queue, method, props, body)}."""
    found: dict[str, Landed] = {}

    def more() -> bool:
        for queue in sorted(queues):
            for method, props, body in support.drain_queue(queue, timeout=0.2):
                found[str(props.headers["id"])] = (queue, method, props, body)
        return len(found) >= count

    support.wait_for(more, 30, f"{count} messages in {sorted(queues)}")
    assert len(found) == count, f"expected {count} messages, got {len(found)}"
    return found


def differences(ours: Landed, theirs: Landed, *, body_as_json: bool = False) -> list[str]:
    """What differs between two messages, apart from what names the sending process.

    ``body_as_json``: bodies compared as JSON values (the embed drain sends is
    jsonb's text, whose keys Postgres orders its own way), else byte for byte.
    """
    (q1, m1, p1, b1), (q2, m2, p2, b2) = ours, theirs
    body1, body2 = (json.loads(b1), json.loads(b2)) if body_as_json else (b1, b2)
    found = []
    for what, a, b in (("queue", q1, q2), ("exchange", m1.exchange, m2.exchange),
                       ("routing key", m1.routing_key, m2.routing_key), ("body", body1, body2)):
        if a != b:
            found.append(f"{what}: {a!r} != {b!r}")
    p1_all, p2_all = dict(vars(p1)), dict(vars(p2))
    h1, h2 = p1_all.pop("headers"), p2_all.pop("headers")
    h1.pop("drain_tag", None)
    if list(h1) != list(h2):
        found.append(f"header names or order: {list(h1)} != {list(h2)}")
    for kind, ours_, theirs_ in (("property", p1_all, p2_all), ("header", h1, h2)):
        for key in sorted(set(ours_) | set(theirs_)):
            if key not in PER_PROCESS and ours_.get(key) != theirs_.get(key):
                found.append(f"{kind} {key}: {ours_.get(key)!r} != {theirs_.get(key)!r}")
    return found

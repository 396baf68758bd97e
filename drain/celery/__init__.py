"""Celery's protocol: a staged row becomes a task message (protocol v2,
byte-compatible with ``send_task``), encoded and routed as the user's Celery
app would (``--app``).

May import ``drain.broker`` (the message it builds, queue specs),
``drain.postgres.rows`` and ``drain.postgres.timestamps`` (the row it reads),
``drain.settings`` and the foundation; never the daemon or the CLI.
"""

"""The Postgres side: the drain's session (advisory lock, probes, failover),
the store that reads batches of ``staged_jobs`` and deletes what was
confirmed, the keyset marks, the wake-up, the dead-letter table and the
status queries.

May import ``drain.settings`` and the foundation (``drain.errors``,
``drain.limits``, ``drain.version``); never the broker, Celery, daemon or CLI
layers. A fetched row is a ``drain.postgres.rows.StagedRow``.
"""

"""drain on Spark: ``drain backfill`` and ``drain reconcile``.

pyspark comes with ``pip install 'drain-outbox[spark]'``.

The modules follow the data: :mod:`~drain.spark.sources` reads files or
Postgres over JDBC, :mod:`~drain.spark.mapping` turns records into
staged_jobs rows (in Spark SQL), :mod:`~drain.spark.writer` stages each
partition with COPY in one transaction recorded in a ledger,
:mod:`~drain.spark.backfill` and :mod:`~drain.spark.reconcile` put them
together and :mod:`~drain.cli.spark` is the command line.

Importing this package does not import pyspark; only running a command does.
"""

from __future__ import annotations

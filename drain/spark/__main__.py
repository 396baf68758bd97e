"""``python -m drain.spark backfill|reconcile ...``; also the file to give spark-submit.

It imports drain absolutely, so spark-submit can run it as a plain file with
drain shipped in ``--py-files`` (see docs/spark.md).
"""

import sys

from drain.cli.spark import main

sys.exit(main())

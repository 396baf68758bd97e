"""Two attempts at one partition on the cluster: a speculative copy, and a retry after a
failure between the COPY and the commit.

The slow and the failing partition are made by Postgres itself, not by a hook in
drain: a deferred constraint trigger on ``drain_backfill_ledger`` runs at the
COMMIT of a partition's transaction, after its COPY, and a sequence (which no
rollback undoes) makes it act on the partition's first attempt only.

* Speculation (``spark.speculation`` with aggressive thresholds): the first
  attempt of partition 5 sleeps in its commit, holding the ledger's key. Spark
  starts a copy on the other worker, which waits on that key. Exactly one
  attempt commits, the other stages nothing, and the run reports the extra
  attempt.
* ``spark.task.maxFailures``: the first attempt of partition 2 fails in its
  commit (its COPY rolled back); Spark retries it and the retry stages the
  partition once. The run reports the failed attempt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.spark import helpers
from tests.spark_cluster import standalone, submit

pytestmark = [pytest.mark.spark_cluster, pytest.mark.timeout(600)]

RECORDS = 200_000
PARTITIONS = 8
#: Longer than the other partitions take even on a loaded machine, so that Spark
#: speculates while the first attempt still holds the partition's ledger key.
SLOW_SECONDS = 30


def _backfill(cluster: standalone.Cluster, bundle_dir: Path, db_url: str, tmp_path: Path,
              *, run_id: str, conf: dict[str, str]) -> dict[str, Any]:
    path = submit.parquet(tmp_path / "records", RECORDS)
    log = tmp_path / "backfill.log"
    result = submit.finish(submit.submit(
        cluster, bundle_dir, db_url, log, "backfill", "--source", f"parquet:{path}",
        "--task", submit.TASK, "--kwargs", "annotation_id=id", "--tag", "backfill.attempts",
        "--id", run_id, "--partitions", str(PARTITIONS), conf=conf,
    ), log)
    print(f"{run_id}: {result}")
    assert result["rows"] == RECORDS
    submit.assert_every_key_once(db_url, run_id, RECORDS, PARTITIONS)
    return result


def test_speculative_copy_of_a_slow_partition_stages_nothing(
    workers: standalone.Cluster, bundle_dir: Path, db_url: str, tmp_path: Path
) -> None:
    helpers.on_first_commit(db_url, 5, f"PERFORM pg_sleep({SLOW_SECONDS})")
    result = _backfill(workers, bundle_dir, db_url, tmp_path, run_id="speculated", conf={
        "spark.speculation": "true",
        "spark.speculation.interval": "100ms",
        "spark.speculation.quantile": "0.5",
        "spark.speculation.multiplier": "1.5",
        "spark.speculation.minTaskRuntime": "1s",
        # Spark 3.4+ also asks a slow task to look inefficient; this one is just slow.
        "spark.speculation.efficiency.enabled": "false",
    })
    attempts = helpers.attempts(db_url, "speculated", 5)
    assert len(attempts) >= 2, attempts
    committed = [a for a in attempts if a["outcome"] == "committed"]
    assert len(committed) == 1, attempts
    first, copy = attempts[0], attempts[1]
    assert first is committed[0], "the slow first attempt should be the one that committed"
    # The copy ran at the same time, in another Python worker, and staged nothing: it
    # found the partition committed, or Spark stopped it once the first one succeeded.
    assert copy["started_at"] < first["ended_at"]
    assert copy["host"] != first["host"]
    assert copy["outcome"] in {"found committed", None}
    reported = result["attempts"]
    assert isinstance(reported, dict)
    assert reported["extra"] >= 1
    assert reported["partitions_retried"] >= 1
    assert reported["failed"] == 0
    assert reported["committed_twice"] == []


def test_partition_failing_between_copy_and_commit_is_retried_once(
    workers: standalone.Cluster, bundle_dir: Path, db_url: str, tmp_path: Path
) -> None:
    helpers.on_first_commit(db_url, 2, "RAISE EXCEPTION 'refused at commit (test)'")
    result = _backfill(workers, bundle_dir, db_url, tmp_path, run_id="retried",
                       conf={"spark.task.maxFailures": "4"})
    attempts = helpers.attempts(db_url, "retried", 2)
    assert [a["outcome"] for a in attempts][-1] == "committed"
    assert len(attempts) == 2, attempts
    failed = attempts[0]["outcome"]
    assert failed.startswith("failed: partition 2: Postgres refused it: refused at commit")
    assert "nothing of it was staged" in failed
    reported = result["attempts"]
    assert isinstance(reported, dict)
    assert (reported["extra"], reported["failed"], reported["partitions_retried"]) == (1, 1, 1)
    assert reported["committed_twice"] == []

-- drain backfill / reconcile: the ledger of committed Spark partitions.
--
-- Each partition of a backfill (or of a reconcile run with --stage) writes its
-- jobs into staged_jobs and its row here in ONE transaction. A Spark task that
-- is retried after its partition committed finds its row and stages nothing;
-- a whole re-run with the same backfill id stages only the partitions that
-- never committed. `partitions` is the partition count of the run: rows are
-- assigned to partitions by a hash of their key modulo that count, so a re-run
-- must use the same count (drain refuses one that does not).
CREATE TABLE IF NOT EXISTS drain_backfill_ledger (
    backfill_id  text        NOT NULL,
    partition    integer     NOT NULL,
    partitions   integer     NOT NULL,
    rows         bigint      NOT NULL DEFAULT 0,
    -- The run (one `drain backfill` invocation) that committed the partition.
    run_token    uuid,
    committed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (backfill_id, partition)
);

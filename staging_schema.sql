-- drain: the staging schema.
--
-- This file is the canonical schema. `drain migrate` applies exactly this file
-- (the wheel carries a byte-identical copy), in one transaction, and it is
-- idempotent: running it again on a migrated database changes nothing.
-- It needs PostgreSQL 14 or newer (CREATE OR REPLACE TRIGGER).
--
-- Objects are created in the first schema of the migrating session's
-- search_path (normally "public"); the drain and the applications must see
-- `staged_jobs` through their own search_path.
--
-- Roles and grants
-- ----------------
-- Two NOLOGIN group roles are created when the migrating role may create roles
-- (otherwise a NOTICE says so and the grants are skipped):
--
--   drain_stager  INSERT only: what an application needs to stage jobs.
--                 It cannot read, change or delete staged rows.
--   drain_runner  SELECT and DELETE on staged_jobs, INSERT on dead_jobs: what
--                 `drain run` needs. It cannot stage (only applications do)
--                 nor update rows.
--
-- drain_stage(), dead_jobs and drain_processed are described where they are
-- created. Operators running `drain dead ...` need SELECT, INSERT and DELETE
-- on both tables; consumers using drain.consumer need SELECT, INSERT on
-- drain_processed, and DELETE to purge it (grant them to your roles as fits).
--
-- Give them to your login roles:
--
--   GRANT drain_stager TO my_app;
--   GRANT drain_runner TO my_drain;
--
-- `drain status` also reads pg_locks and pg_stat_activity; grant the role
-- that runs it pg_read_all_stats to see other sessions' details.

CREATE TABLE IF NOT EXISTS staged_jobs (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Becomes the Celery task id: every copy of the message, however often it
    -- is republished after a crash, carries this id, so consumers can dedupe.
    task_id   uuid        NOT NULL DEFAULT gen_random_uuid(),
    task_name text        NOT NULL,
    args      jsonb       NOT NULL DEFAULT '[]',
    kwargs    jsonb       NOT NULL DEFAULT '{}',
    -- The Celery queue, published through the default exchange with this
    -- routing key, exactly like apply_async(queue=...).
    queue     text        NOT NULL DEFAULT 'celery',
    staged_at timestamptz NOT NULL DEFAULT now(),

    -- Rows that could never become a valid Celery message are refused at
    -- INSERT time, so the app's own transaction fails instead of the drain.
    CONSTRAINT staged_jobs_task_name_not_blank CHECK (task_name ~ '[^[:space:]]'),
    CONSTRAINT staged_jobs_task_name_length CHECK (octet_length(task_name) <= 1024),
    CONSTRAINT staged_jobs_args_is_array CHECK (jsonb_typeof(args) = 'array'),
    CONSTRAINT staged_jobs_kwargs_is_object CHECK (jsonb_typeof(kwargs) = 'object'),
    -- An AMQP routing key is a short string: 1 to 255 bytes.
    CONSTRAINT staged_jobs_queue_length CHECK (octet_length(queue) BETWEEN 1 AND 255)
);

-- Columns added since the first version: ADD COLUMN IF NOT EXISTS brings an
-- older table up to date when `drain migrate` runs again.
ALTER TABLE staged_jobs
    -- Higher runs first. Backfills use negative numbers; published as the AMQP
    -- priority (clamped to 0..N) when the drain runs with --queue-max-priority N.
    ADD COLUMN IF NOT EXISTS priority smallint NOT NULL DEFAULT 0,
    -- Who staged it ('api.create_annotation', 'backfill.reindex'...): carried in
    -- the message's drain_tag header; `drain status` groups the backlog by it.
    ADD COLUMN IF NOT EXISTS tag text,
    -- Not published before this time (NULL: at once). Delays live here, in
    -- Postgres, not in the broker or a worker's memory.
    ADD COLUMN IF NOT EXISTS not_before timestamptz,
    -- Never published at or after this time: moved to dead_jobs ('expired').
    -- The message carries Celery's `expires` too.
    ADD COLUMN IF NOT EXISTS expires_at timestamptz;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = 'staged_jobs'::regclass
                     AND conname = 'staged_jobs_tag_length') THEN
        ALTER TABLE staged_jobs
            ADD CONSTRAINT staged_jobs_tag_length CHECK (octet_length(tag) BETWEEN 1 AND 255);
    END IF;
END
$$;

-- The drain's fetch reads ready rows through the first index in priority
-- order, and due delayed rows through the second, by due time: rows that are
-- not yet due are never scanned. The third finds expired rows.
CREATE INDEX IF NOT EXISTS staged_jobs_ready_idx
    ON staged_jobs (priority DESC, id) WHERE not_before IS NULL;
CREATE INDEX IF NOT EXISTS staged_jobs_delayed_idx
    ON staged_jobs (not_before, id) WHERE not_before IS NOT NULL;
CREATE INDEX IF NOT EXISTS staged_jobs_expiring_idx
    ON staged_jobs (expires_at) WHERE expires_at IS NOT NULL;

COMMENT ON TABLE staged_jobs IS
    'Jobs staged in application transactions; drain publishes them to RabbitMQ and deletes them once the broker confirmed.';

-- Wake an idle drain as soon as jobs are committed. Statement-level: one
-- notification per INSERT or COPY statement, not one per row, and Postgres
-- folds identical notifications of one transaction into one. A notification
-- is delivered only when (and if) the transaction commits.
CREATE OR REPLACE FUNCTION staged_jobs_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('drain_staged_jobs', '');
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER staged_jobs_notify
    AFTER INSERT ON staged_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION staged_jobs_notify();

-- Staging from SQL with every option by name, e.g. a backfill in one statement:
--   SELECT drain_stage('search.index_annotation', kwargs => jsonb_build_object('annotation_id', id),
--                      priority => -10, tag => 'backfill.reindex')
--   FROM annotation WHERE user_id = 42;
-- (a plain INSERT INTO staged_jobs (...) SELECT ... is as good and a little faster).
CREATE OR REPLACE FUNCTION drain_stage(
    task_name  text,
    args       jsonb       DEFAULT '[]',
    kwargs     jsonb       DEFAULT '{}',
    queue      text        DEFAULT 'celery',
    priority   integer     DEFAULT 0,
    tag        text        DEFAULT NULL,
    not_before timestamptz DEFAULT NULL,
    expires_at timestamptz DEFAULT NULL,
    task_id    uuid        DEFAULT gen_random_uuid()
) RETURNS uuid
LANGUAGE sql VOLATILE AS $$
    INSERT INTO staged_jobs (task_id, task_name, args, kwargs, queue, priority, tag,
                             not_before, expires_at)
    VALUES (task_id, task_name, args, kwargs, queue, priority, tag, not_before, expires_at)
    RETURNING task_id;
$$;

-- Jobs that will never be published, with the reason: 'expired' (expires_at
-- passed while staged), 'too_large' (over the broker's max_message_size),
-- 'invalid' (cannot become a Celery message). `drain dead list / requeue /
-- purge` manage them. Unroutable messages are not dead-lettered: their rows
-- stay staged until the queue exists.
CREATE TABLE IF NOT EXISTS dead_jobs (
    id         bigint      PRIMARY KEY,  -- the id it had in staged_jobs
    task_id    uuid        NOT NULL,
    task_name  text        NOT NULL,
    args       jsonb       NOT NULL,
    kwargs     jsonb       NOT NULL,
    queue      text        NOT NULL,
    priority   smallint    NOT NULL,
    tag        text,
    not_before timestamptz,
    expires_at timestamptz,
    staged_at  timestamptz NOT NULL,
    reason     text        NOT NULL,
    detail     text,
    dead_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS dead_jobs_reason_idx ON dead_jobs (reason, dead_at);

-- Consumers' record of the task ids they have processed (drain.consumer):
-- written in the same transaction as the task's own effects, so a redelivered
-- message is recognised and skipped. Purge old rows with
-- `drain processed purge --older-than 7d`.
CREATE TABLE IF NOT EXISTS drain_processed (
    task_id      uuid        PRIMARY KEY,
    processed_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS drain_processed_at_idx ON drain_processed (processed_at);

-- drain backfill / reconcile --stage: one row per committed Spark partition,
-- written in the same transaction as the partition's jobs, so that a retried
-- Spark task or a re-run with the same backfill id stages nothing twice (see
-- drain/spark/writer.py). The role running backfills needs SELECT, INSERT,
-- UPDATE on it and INSERT on staged_jobs.
CREATE TABLE IF NOT EXISTS drain_backfill_ledger (
    backfill_id  text        NOT NULL,
    partition    integer     NOT NULL,
    partitions   integer     NOT NULL,
    rows         bigint      NOT NULL DEFAULT 0,
    run_token    uuid,
    committed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (backfill_id, partition)
);

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'drain_stager') THEN
        BEGIN
            CREATE ROLE drain_stager NOLOGIN;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'drain: cannot create role drain_stager (no CREATEROLE); grants skipped';
        END;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'drain_runner') THEN
        BEGIN
            CREATE ROLE drain_runner NOLOGIN;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'drain: cannot create role drain_runner (no CREATEROLE); grants skipped';
        END;
    END IF;
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'drain_stager') THEN
        REVOKE ALL ON staged_jobs FROM drain_stager;
        GRANT INSERT ON staged_jobs TO drain_stager;
    END IF;
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'drain_runner') THEN
        REVOKE ALL ON staged_jobs, dead_jobs FROM drain_runner;
        GRANT SELECT, DELETE ON staged_jobs TO drain_runner;
        -- The drain moves rows that can never be published into dead_jobs.
        GRANT INSERT ON dead_jobs TO drain_runner;
    END IF;
END
$$;

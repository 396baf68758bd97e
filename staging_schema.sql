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
--   drain_runner  SELECT and DELETE: what `drain run` needs. It cannot insert
--                 (only applications stage) nor update rows.
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
        REVOKE ALL ON staged_jobs FROM drain_runner;
        GRANT SELECT, DELETE ON staged_jobs TO drain_runner;
    END IF;
END
$$;

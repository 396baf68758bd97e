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
-- Four NOLOGIN group roles are created when the migrating role may create roles
-- (otherwise a NOTICE says so; the grants are made when the roles exist), each
-- with what its commands need and nothing more. Their names begin with this
-- database's role prefix, <database>_drain_ unless chosen (the DO block that
-- creates them, at the end, says how it is chosen); for a database named app:
--
--   app_drain_stager    an application staging jobs: INSERT on staged_jobs, SELECT
--                       on its task_id column only (INSERT ... RETURNING task_id,
--                       and drain_stage(), which returns it), EXECUTE on
--                       drain_stage(). It cannot read jobs' arguments, nor change
--                       or delete rows.
--   app_drain_runner    `drain run`, its metrics and `drain status`: SELECT, DELETE
--                       on staged_jobs; SELECT, INSERT on dead_jobs (rows set aside,
--                       and counted); SELECT on drain_schema_state and drain_pauses;
--                       the wake flag.
--                       It cannot stage, update rows, or touch drain_processed.
--   app_drain_operator  `drain stage`, `drain dead list|requeue|purge`, `drain
--                       processed purge`, `drain pause|resume|audit|show`: INSERT,
--                       SELECT on staged_jobs; SELECT, DELETE on dead_jobs and
--                       drain_processed; SELECT, INSERT, DELETE on drain_pauses;
--                       SELECT, INSERT on drain_audit.
--   app_drain_consumer  drain.consumer in the workers: SELECT, INSERT on
--                       drain_processed.
--
-- Roles belong to the whole cluster, grants to one database: the prefix keeps
-- another database's roles from reaching this one. Give them to your login
-- roles (docs/running.md, "Database roles", has the recipe):
--
--   GRANT app_drain_stager TO my_app;
--   GRANT app_drain_runner, pg_read_all_stats TO my_drain;
--
-- pg_read_all_stats lets the drain and `drain status` see other roles'
-- sessions in pg_stat_activity (the oldest transaction, the lock holder).
-- Grants are only ever added (but for a move to another prefix), and every
-- change a migrate makes commits at once, so running drains never see a role
-- without its rights.

CREATE TABLE IF NOT EXISTS staged_jobs (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Becomes the Celery task id: every copy of the message, however often it
    -- is republished after a crash, carries this id, so consumers can dedupe.
    task_id   uuid        NOT NULL DEFAULT gen_random_uuid(),
    task_name text        NOT NULL,
    args      jsonb       NOT NULL DEFAULT '[]',
    kwargs    jsonb       NOT NULL DEFAULT '{}',
    -- The Celery queue, like apply_async(queue=...). NULL: none given, like
    -- apply_async without queue=: `drain run --app` routes the job as the
    -- app would (task_routes, the task's queue, task_default_queue); without
    -- --app it goes to 'celery', Celery's own default.
    queue     text,
    -- True only for a row staged before `drain migrate` made "no queue given"
    -- NULL, when the column was NOT NULL DEFAULT 'celery': its 'celery' may
    -- mean "no queue given", and `drain run --app` routes it as the app would.
    -- Any other row says what it gave, whatever its id: 'celery' is
    -- apply_async(queue='celery'). Carried through dead_jobs and requeue.
    queue_legacy boolean NOT NULL DEFAULT false,
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
    ADD COLUMN IF NOT EXISTS expires_at timestamptz,
    -- The transaction that staged (or last updated) the row: always that
    -- transaction's own id, whatever a statement gives (the trigger below sees
    -- to it). Ready rows are fetched in (priority, xact, id) order, and the
    -- drain's low-water marks rest on it (drain/postgres/keyset.py): a row that is not
    -- visible yet belongs to a transaction still running, so its xact is at
    -- least the oldest running transaction id. Ids carry no such promise (a
    -- sequence can be reset, cached per session, or bypassed).
    ADD COLUMN IF NOT EXISTS xact xid8 NOT NULL DEFAULT pg_current_xact_id();

-- Celery's embed, the body's third part, for a job staged as a signature
-- with link / link_error callbacks or as a chain (drain.stage(conn,
-- signature)): {"callbacks": [...], "errbacks": [...], "chain": [...],
-- "chord": null}, each a list of signatures as Celery serialises them. NULL:
-- none (every key null), as for any job staged by name. The drain sends it
-- as it is; the worker runs the callbacks and the rest of the chain.
ALTER TABLE staged_jobs ADD COLUMN IF NOT EXISTS embed jsonb;
-- NOT VALID: a new column is NULL in every row already staged, so there is
-- nothing to check there (and no scan of a large backlog under the lock);
-- Postgres checks every row written from now on.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = 'staged_jobs'::regclass
                     AND conname = 'staged_jobs_embed_is_embed') THEN
        ALTER TABLE staged_jobs ADD CONSTRAINT staged_jobs_embed_is_embed CHECK (
            jsonb_typeof(embed) = 'object'
            AND embed - ARRAY['callbacks', 'errbacks', 'chain', 'chord'] = '{}'::jsonb
        ) NOT VALID;
    END IF;
END
$$;

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

-- The OpenTelemetry context of the code that staged the job: the carrier its
-- propagators write, {"traceparent": "00-<trace id>-<span id>-01",
-- "tracestate": "...", "baggage": "..."} (drain.stage() fills it in when
-- OpenTelemetry is in use; from SQL give it yourself, docs/tracing.md). NULL:
-- none. The drain sends traceparent, tracestate and baggage on as message
-- headers (where Celery's instrumentation reads them) and ignores other keys,
-- values that are not strings and values beyond the W3C limits.
-- "drain.link" (set by `drain dead requeue`) asks for a new trace linked to
-- this one. NOT VALID, as for embed: the rows already staged are NULL.
ALTER TABLE staged_jobs ADD COLUMN IF NOT EXISTS trace jsonb;
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conrelid = 'staged_jobs'::regclass
                     AND conname = 'staged_jobs_trace_is_object') THEN
        ALTER TABLE staged_jobs ADD CONSTRAINT staged_jobs_trace_is_object
            CHECK (jsonb_typeof(trace) = 'object') NOT VALID;
    END IF;
END
$$;

-- xact is the staging transaction's id, and only that: a value given by an
-- INSERT (a copy of another table's rows, a restore) or kept by an UPDATE
-- (which makes a row new to the drain: another queue, no delay any more) is
-- replaced. The WHEN clause keeps the ordinary INSERT, which takes the
-- default, out of PL/pgSQL.
CREATE OR REPLACE FUNCTION staged_jobs_xact() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.xact := pg_current_xact_id();
    RETURN NEW;
END
$$;

CREATE OR REPLACE TRIGGER staged_jobs_xact
    BEFORE INSERT OR UPDATE ON staged_jobs
    FOR EACH ROW WHEN (NEW.xact IS DISTINCT FROM pg_current_xact_id())
    EXECUTE FUNCTION staged_jobs_xact();

-- The drain's fetch reads ready rows through the first index in priority
-- order, then by staging transaction, and due delayed rows through the
-- second, by due time: rows that are not yet due are never scanned. The
-- third finds expired rows. (A schema from before xact had the first index on
-- (priority DESC, id): it is rebuilt.)
DO $$
BEGIN
    IF to_regclass('staged_jobs_ready_idx') IS NOT NULL
       AND pg_get_indexdef(to_regclass('staged_jobs_ready_idx')) NOT LIKE '%xact%' THEN
        DROP INDEX staged_jobs_ready_idx;
    END IF;
END
$$;
CREATE INDEX IF NOT EXISTS staged_jobs_ready_idx
    ON staged_jobs (priority DESC, xact, id) WHERE not_before IS NULL;
CREATE INDEX IF NOT EXISTS staged_jobs_delayed_idx
    ON staged_jobs (not_before, id) WHERE not_before IS NOT NULL;
CREATE INDEX IF NOT EXISTS staged_jobs_expiring_idx
    ON staged_jobs (expires_at) WHERE expires_at IS NOT NULL;
-- Delayed and expiring rows staged (or updated) by recent transactions: the
-- drain reads the other two indexes from low-water marks and finds the rows
-- that appeared below them through this one (drain/postgres/keyset.py, "Delayed and
-- expiring rows"). Ready rows without an expiry are not in it.
CREATE INDEX IF NOT EXISTS staged_jobs_timed_xact_idx
    ON staged_jobs (xact) WHERE not_before IS NOT NULL OR expires_at IS NOT NULL;

COMMENT ON TABLE staged_jobs IS
    'Jobs staged in application transactions; drain publishes them to RabbitMQ and deletes them once the broker confirmed.';

-- Wake an idle drain as soon as jobs are committed, without taxing commits.
-- Postgres serialises every committing transaction that has a pending NOTIFY
-- on one database-wide lock held across its WAL flush, so a NOTIFY per staging
-- transaction would keep concurrent writers from sharing a group commit. Only
-- an idle drain needs one, and it says so in the wake flag: the sequence
-- drain_wake, odd while a drain sleeps (armed), even (or never set) otherwise.
-- Each staging statement reads the flag in the trigger's WHEN (no function
-- call at all while it is even) and sends one NOTIFY, delivered at commit,
-- only while it is odd. Reading a sequence is not MVCC: it sees the flag as it
-- is now, and locks the sequence until the transaction ends, so a drain that
-- raises the flag sees in pg_locks every writer that may have read it low and
-- looks once more after they end (drain/postgres/wakeup.py has the argument). Staging
-- never waits for the drain (the lock conflicts with nothing a writer or the
-- drain takes) and never fails because it is gone. Statement-level: once per
-- INSERT or COPY statement, not per row.
CREATE SEQUENCE IF NOT EXISTS drain_wake;
-- Every role that stages reads the flag; only the drain sets it.
GRANT SELECT ON SEQUENCE drain_wake TO PUBLIC;

CREATE OR REPLACE FUNCTION staged_jobs_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('drain_staged_jobs', '');
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER staged_jobs_notify
    AFTER INSERT ON staged_jobs
    FOR EACH STATEMENT
    WHEN (pg_sequence_last_value('drain_wake'::regclass) % 2 = 1)
    EXECUTE FUNCTION staged_jobs_notify();

-- Staging from SQL with every option by name, e.g. a backfill in one statement:
--   SELECT drain_stage('search.index_annotation', kwargs => jsonb_build_object('annotation_id', id),
--                      priority => -10, tag => 'backfill.reindex')
--   FROM annotation WHERE user_id = 42;
-- (a plain INSERT INTO staged_jobs (...) SELECT ... is as good and a little faster).
-- It refuses, as drain.stage() does, what could never be sent: an expires_at
-- more than 3,650 days (315,360,000 s, drain/limits.py) after now(), which
-- RabbitMQ refuses (SQLSTATE 22023, invalid_parameter_value), and a not_before
-- or expires_at that is infinite or outside years 1 to 9999, which the drain
-- cannot read (SQLSTATE 22008, datetime_field_overflow). The exception fails
-- the caller's statement, and so its transaction, as apply_async raising
-- would. A plain INSERT is not checked: the drain moves such a row to dead_jobs
-- ('invalid').
CREATE OR REPLACE FUNCTION drain_stage(
    task_name  text,
    args       jsonb       DEFAULT '[]',
    kwargs     jsonb       DEFAULT '{}',
    queue      text        DEFAULT NULL,
    priority   integer     DEFAULT 0,
    tag        text        DEFAULT NULL,
    not_before timestamptz DEFAULT NULL,
    expires_at timestamptz DEFAULT NULL,
    task_id    uuid        DEFAULT gen_random_uuid()
) RETURNS uuid
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_variable
DECLARE
    staged uuid;
BEGIN
    IF NOT (not_before IS NULL OR not_before BETWEEN '0001-01-01 00:00:00+00'
                                                 AND '9999-12-31 23:59:59.999999+00') THEN
        RAISE EXCEPTION 'drain_stage: not_before % is not a time the drain can read', not_before
            USING ERRCODE = 'datetime_field_overflow',
                  HINT = 'give a finite time between years 1 and 9999 (UTC), or NULL';
    END IF;
    IF NOT (expires_at IS NULL OR expires_at BETWEEN '0001-01-01 00:00:00+00'
                                                 AND '9999-12-31 23:59:59.999999+00') THEN
        RAISE EXCEPTION 'drain_stage: expires_at % is not a time the drain can read', expires_at
            USING ERRCODE = 'datetime_field_overflow',
                  HINT = 'give a finite time between years 1 and 9999 (UTC), or NULL for never';
    END IF;
    IF expires_at > now() + interval '315360000 seconds' THEN
        RAISE EXCEPTION 'drain_stage: expires_at % is more than 3,650 days ahead', expires_at
            USING ERRCODE = 'invalid_parameter_value',
                  DETAIL = 'RabbitMQ refuses a message that expires later (406 PRECONDITION_FAILED).',
                  HINT = 'leave expires_at NULL for a job that never expires';
    END IF;
    INSERT INTO staged_jobs (task_id, task_name, args, kwargs, queue, priority, tag,
                             not_before, expires_at)
    VALUES (task_id, task_name, args, kwargs, queue, priority, tag, not_before, expires_at)
    RETURNING staged_jobs.task_id INTO staged;
    RETURN staged;
END
$$;

-- Jobs that will never be published, with the reason: 'expired' (expires_at
-- passed while staged), 'too_large' (over the broker's max_message_size),
-- 'invalid' (cannot become a Celery message: its app's serializer cannot
-- encode it, or an expires_at that is infinite, past year 9999 or more than
-- 3,650 days ahead, staged by a plain INSERT), 'unknown_task' (`drain run
-- --app`: the app registers no such task), 'refused' (the broker refused its
-- publish, e.g. 404 no exchange). `drain dead list / requeue /
-- purge` manage them. Unroutable messages are not dead-lettered: their rows
-- stay staged until the queue exists.
--
-- dead_id is the key. id is the id the row had in staged_jobs, and is not
-- unique here: staged ids can be handed out again (TRUNCATE ... RESTART
-- IDENTITY, a restored table, a requeued row's new id), and a row moved here
-- must never fail on an older one's id.
CREATE TABLE IF NOT EXISTS dead_jobs (
    dead_id    bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id         bigint      NOT NULL,
    task_id    uuid        NOT NULL,
    task_name  text        NOT NULL,
    args       jsonb       NOT NULL,
    kwargs     jsonb       NOT NULL,
    queue      text,
    -- staged_jobs.queue_legacy, kept for a requeue.
    queue_legacy boolean   NOT NULL DEFAULT false,
    priority   smallint    NOT NULL,
    tag        text,
    not_before timestamptz,
    expires_at timestamptz,
    staged_at  timestamptz NOT NULL,
    reason     text        NOT NULL,
    detail     text,
    dead_at    timestamptz NOT NULL DEFAULT now()
);
-- Its embed (staged_jobs.embed), kept for a requeue.
ALTER TABLE dead_jobs ADD COLUMN IF NOT EXISTS embed jsonb;
-- Its OpenTelemetry context (staged_jobs.trace), kept for a requeue.
ALTER TABLE dead_jobs ADD COLUMN IF NOT EXISTS trace jsonb;
-- A dead_jobs table from before dead_id had its primary key on id.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_attribute
                   WHERE attrelid = 'dead_jobs'::regclass AND attname = 'dead_id'
                     AND NOT attisdropped) THEN
        ALTER TABLE dead_jobs DROP CONSTRAINT IF EXISTS dead_jobs_pkey;
        ALTER TABLE dead_jobs
            ADD COLUMN dead_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY;
    END IF;
END
$$;
CREATE INDEX IF NOT EXISTS dead_jobs_reason_idx ON dead_jobs (reason, dead_at);
CREATE INDEX IF NOT EXISTS dead_jobs_id_idx ON dead_jobs (id);
-- One for each filter of `drain dead list` (and the console), in its order,
-- newest first (dead_at, then dead_id: the rows a batch dead-letters share their
-- dead_at, and a sort of a million ties took longer than the listing's timeout):
-- each stays an index scan on a table of 10 million dead jobs
-- (drain.postgres.dead). Dead-lettering is rare, so they cost the drain little.
CREATE INDEX IF NOT EXISTS dead_jobs_dead_at_idx ON dead_jobs (dead_at, dead_id);
CREATE INDEX IF NOT EXISTS dead_jobs_task_idx ON dead_jobs (task_name, dead_at, dead_id);
CREATE INDEX IF NOT EXISTS dead_jobs_queue_idx ON dead_jobs (queue, dead_at, dead_id);
CREATE INDEX IF NOT EXISTS dead_jobs_tag_idx ON dead_jobs (tag, dead_at, dead_id);
CREATE INDEX IF NOT EXISTS dead_jobs_task_id_idx ON dead_jobs (task_id);

-- What `drain migrate` changed in place, for drains from before
-- queue_legacy to read: one row per change whose effect depends on when it
-- was made.
CREATE TABLE IF NOT EXISTS drain_schema_state (
    key   text   PRIMARY KEY,
    value bigint NOT NULL
);

-- "No queue given" (NULL) was 'celery' before: a database from then has
-- staged_jobs.queue NOT NULL DEFAULT 'celery', and rows already staged with
-- 'celery' may have given no queue. The upgrade is in place and only touches
-- the catalog (no row is rewritten):
--
-- * queue_legacy is added as true for every row already there and false for
--   every row staged from now on (ADD COLUMN with a constant default, then SET
--   DEFAULT: Postgres keeps the first default in the catalog for the rows that
--   were there, no table rewrite), so a 'celery' row from before is still
--   routed as "no queue given", and nothing already staged is re-routed;
-- * the column loses its NOT NULL and its default.
--
-- A database upgraded by an older drain (queue already nullable) recorded the
-- first id staged after that upgrade, queue_given_from_id: the rows still
-- staged (or dead) with 'celery' below it get queue_legacy = true (one pass
-- over the tables under the lock; ids are not monotonic, which is why the
-- drain now reads the flag and never compares ids). queue_given_from_id is
-- still recorded for older drains that run on through the upgrade.
-- The brief ACCESS EXCLUSIVE lock waits for at most lock_timeout (drain
-- migrate sets it and retries) so that the application's writers are never
-- held up behind a long transaction.
DO $$
DECLARE
    mark bigint;
    t text;
BEGIN
    SELECT value INTO mark FROM drain_schema_state WHERE key = 'queue_given_from_id';
    -- staged_jobs first, then dead_jobs: the order every migrate locks them in.
    FOREACH t IN ARRAY ARRAY['staged_jobs', 'dead_jobs'] LOOP
        CONTINUE WHEN EXISTS (SELECT FROM pg_attribute
                              WHERE attrelid = t::regclass AND attname = 'queue_legacy'
                                AND NOT attisdropped);
        IF EXISTS (SELECT FROM pg_attribute
                   WHERE attrelid = t::regclass AND attname = 'queue' AND attnotnull) THEN
            EXECUTE format('ALTER TABLE %I ADD COLUMN queue_legacy boolean NOT NULL DEFAULT true', t);
            EXECUTE format('ALTER TABLE %I ALTER COLUMN queue_legacy SET DEFAULT false', t);
        ELSE
            EXECUTE format('ALTER TABLE %I ADD COLUMN queue_legacy boolean NOT NULL DEFAULT false', t);
            EXECUTE format('UPDATE %I SET queue_legacy = true WHERE queue = ''celery'' AND id < $1', t)
                USING mark;
        END IF;
    END LOOP;
    IF EXISTS (SELECT FROM pg_attribute
               WHERE attrelid = 'staged_jobs'::regclass AND attname = 'queue'
                 AND attnotnull) THEN
        ALTER TABLE staged_jobs ALTER COLUMN queue DROP NOT NULL,
                                ALTER COLUMN queue DROP DEFAULT;
    END IF;
    IF EXISTS (SELECT FROM pg_attribute
               WHERE attrelid = 'dead_jobs'::regclass AND attname = 'queue'
                 AND attnotnull) THEN
        ALTER TABLE dead_jobs ALTER COLUMN queue DROP NOT NULL;
    END IF;
    IF NOT EXISTS (SELECT FROM drain_schema_state WHERE key = 'queue_given_from_id') THEN
        -- Under the lock the ALTER took (or on a new table): no insert in flight.
        LOCK TABLE staged_jobs IN SHARE MODE;
        -- The next id the table's sequence hands out (or above any row given
        -- its own id), for drains from before queue_legacy.
        INSERT INTO drain_schema_state (key, value)
        SELECT 'queue_given_from_id', greatest(
            coalesce(pg_sequence_last_value(pg_get_serial_sequence('staged_jobs', 'id')::regclass), 0),
            coalesce(max(id), 0)) + 1
        FROM staged_jobs;
    END IF;
END
$$;

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

-- One row per backfill id, claimed (INSERT ... ON CONFLICT DO NOTHING) by the
-- first driver before any partition is: what the partitioning of its records
-- depends on. Every later run of the id is compared with it, so that two
-- drivers, or a resume after the key's type changed, cannot put one record in
-- two partitions (docs/spark.md, "Re-runs"). The role running backfills needs
-- SELECT, INSERT on it.
CREATE TABLE IF NOT EXISTS drain_backfills (
    backfill_id  text        PRIMARY KEY,
    partitions   integer     NOT NULL,
    hash_version integer     NOT NULL,
    key_expr     text        NOT NULL,
    key_type     text        NOT NULL,
    key_identity text        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- One row per Spark attempt at a backfill partition, written outside the
-- partition's transaction so that attempts which stage nothing (a task retried
-- after a failure, a speculative copy, an attempt that finds its partition
-- committed) are still on record: `drain backfill` reports them. outcome stays
-- NULL for an attempt that was stopped or lost before it could say how it ended.
-- attempt is Spark's attemptNumber(), which starts again at 0 when a stage is
-- attempted again (after an executor was lost with its shuffle output);
-- task_attempt_id is Spark's taskAttemptId() ("TID"), unique per attempt in the
-- Spark application, so two attempts at a partition never share it.
-- The role running backfills needs SELECT, INSERT, UPDATE on it.
CREATE TABLE IF NOT EXISTS drain_backfill_attempts (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    backfill_id  text        NOT NULL,
    run_token    uuid        NOT NULL,
    partition    integer     NOT NULL,
    attempt      integer     NOT NULL,
    host         text,
    started_at   timestamptz NOT NULL DEFAULT now(),
    ended_at     timestamptz,
    outcome      text,
    task_attempt_id bigint
);
-- Added since the first version (NULL in the rows written before).
ALTER TABLE drain_backfill_attempts ADD COLUMN IF NOT EXISTS task_attempt_id bigint;
CREATE INDEX IF NOT EXISTS drain_backfill_attempts_run
    ON drain_backfill_attempts (run_token);

-- Publishing paused by an operator (`drain pause`, the console): while a row
-- is here, no drain publishes the jobs of that queue (kind 'queue': the queue
-- a job is declared into, which with --app is where the app routes it) or of
-- that task (kind 'task': task_name). Staging goes on; the rows stay staged
-- and are published once the row is deleted (`drain resume`). A change here
-- notifies the drains (the trigger below): each one obeys it from its next
-- batch. Expiry goes on too: a paused job whose expires_at passes is moved to
-- dead_jobs ('expired'), as any other.
CREATE TABLE IF NOT EXISTS drain_pauses (
    kind      text        NOT NULL CHECK (kind IN ('queue', 'task')),
    name      text        NOT NULL CHECK (octet_length(name) BETWEEN 1 AND 1024),
    reason    text        NOT NULL CHECK (reason ~ '[^[:space:]]'),
    paused_by text        NOT NULL,
    paused_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, name)
);

CREATE OR REPLACE FUNCTION drain_pauses_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('drain_staged_jobs', 'pauses');
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER drain_pauses_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON drain_pauses
    FOR EACH STATEMENT EXECUTE FUNCTION drain_pauses_changed();

-- What operators did (drain.postgres.audit): one row per action, written in the
-- action's own transaction, so that an action and its record commit or vanish
-- together. actor is who the tool was told acts (the console's user, or
-- `--actor`, by default the operating system's user and host); db_role is the
-- database role that ran it, which the database vouches for. target is what
-- was acted on (a queue, a task, the filter of dead jobs), count how many
-- rows, reason the operator's why.
CREATE TABLE IF NOT EXISTS drain_audit (
    id      bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT now(),
    actor   text        NOT NULL,
    db_role text        NOT NULL DEFAULT current_user,
    action  text        NOT NULL,
    target  jsonb       NOT NULL DEFAULT '{}',
    count   bigint,
    reason  text
);

-- The settings of this database's drain, written by `drain migrate`: today
-- role_prefix, the prefix of this database's four group roles. Readable by
-- every role (nothing secret: drain names the roles in its errors).
CREATE TABLE IF NOT EXISTS drain_settings (
    key   text PRIMARY KEY,
    value text NOT NULL
);
GRANT SELECT ON drain_settings TO PUBLIC;

-- The schema's version (drain.postgres.migration.SCHEMA_VERSION), for
-- `drain migrate --check`, `drain status` and the status page. One more with
-- each release that changes this file. Never lowered: an older drain's
-- migrate after a newer one's changes nothing of the newer schema, and leaves
-- its version. A database from before versions were recorded has none.
INSERT INTO drain_settings (key, value) VALUES ('schema_version', '1')
ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value
WHERE drain_settings.value::int < EXCLUDED.value::int;

-- The group roles (see "Roles and grants" at the top). Roles belong to the
-- whole cluster while grants belong to one database, so each database gets
-- roles of its own: <prefix>stager, <prefix>runner, <prefix>operator and
-- <prefix>consumer. The prefix, in this order:
--
--   1. the setting drain.role_prefix (`drain migrate --role-prefix P` sets it;
--      with psql: PGOPTIONS='-c drain.role_prefix=P' psql -f staging_schema.sql);
--   2. the one recorded in drain_settings by an earlier migrate (a copy of the
--      database, CREATE DATABASE ... TEMPLATE or a restored dump, keeps it);
--   3. 'drain_' for a database an older drain migrated (its staged_jobs is
--      granted to drain_stager, drain_runner or drain_operator): the roles its
--      logins already hold keep working;
--   4. otherwise the database's name: <name>_drain_, lowercased, other
--      characters than a-z, 0-9 and _ made _, and a name longer than 48
--      characters cut to 41 and given 6 hex digits of its md5.
--
-- A database adopts a prefix once (and again when --role-prefix changes it).
-- Adopting roles that already hold privileges in another database of the
-- cluster is refused (SQLSTATE DR001): a login granted them for one database
-- would act in the other. Moving to another prefix grants the new roles and
-- then revokes from the old ones what this schema granted them here.
-- Two migrates on two databases at once never fail on each other's roles: a
-- role created meanwhile by the other is taken as existing.
DO $$
DECLARE
    kinds    constant text[] := ARRAY['stager', 'runner', 'operator', 'consumer'];
    given    text := nullif(current_setting('drain.role_prefix', true), '');
    recorded text;
    held     text;
    prefix   text;
    base     text;
    hashed   text;
    derived  text;
    old      text;
    kind     text;
    role     text;
    shared   text;
BEGIN
    SELECT value INTO recorded FROM drain_settings WHERE key = 'role_prefix';
    -- The prefix this database's grants have now: the recorded one, else drain_
    -- when an older drain's migrate, which named the roles drain_*, granted them.
    held := recorded;
    IF held IS NULL AND EXISTS (
        SELECT FROM pg_class c, aclexplode(c.relacl) a, pg_roles r
        WHERE c.oid IN ('staged_jobs'::regclass, 'drain_processed'::regclass)
          AND r.oid = a.grantee
          AND r.rolname IN ('drain_stager', 'drain_runner', 'drain_operator', 'drain_consumer'))
    THEN
        held := 'drain_';
    END IF;
    base := lower(regexp_replace(current_database(), '[^A-Za-z0-9_]', '_', 'g'));
    IF base !~ '^[a-z_]' THEN
        base := 'db_' || base;
    END IF;
    hashed := left(base, 41) || '_' || left(md5(current_database()), 6);
    derived := CASE WHEN length(base) > 48 THEN hashed ELSE base END || '_drain_';
    prefix := coalesce(given, held, derived);
    IF prefix !~ '^[a-z_][a-z0-9_]*$' OR length(prefix) > 55 THEN
        RAISE EXCEPTION 'drain: role prefix "%" is not a lowercase name of at most 55 letters, digits and _', prefix
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Moving to another prefix: the old one's roles lose their grants here (below).
    old := nullif(held, prefix);

    FOREACH kind IN ARRAY kinds LOOP
        role := prefix || kind;
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', role);
                EXECUTE format('COMMENT ON ROLE %I IS %L', role,
                               format('drain: the %s role of database %s', kind, current_database()));
            EXCEPTION
                WHEN insufficient_privilege THEN
                    RAISE NOTICE 'drain: cannot create role % (no CREATEROLE); its grants are skipped',
                        role;
                -- Created meanwhile by a migrate of another database (roles are
                -- the cluster's): it exists now, and is checked below as any other.
                WHEN unique_violation OR duplicate_object THEN
                    NULL;
            END;
        END IF;
    END LOOP;

    IF recorded IS DISTINCT FROM prefix THEN
        -- Adopting the prefix: its roles must hold nothing in another database.
        SELECT string_agg(DISTINCT d.datname, ', ')
        INTO shared
        FROM pg_shdepend s
        JOIN pg_roles r ON r.oid = s.refobjid
        JOIN pg_database d ON d.oid = s.dbid
        WHERE s.refclassid = 'pg_authid'::regclass
          AND r.rolname = ANY (SELECT prefix || k FROM unnest(kinds) k)
          AND d.datname <> current_database();
        IF shared IS NOT NULL THEN
            RAISE EXCEPTION USING
                ERRCODE = 'DR001',
                MESSAGE = format('drain migrate: the roles %s* already hold privileges in '
                                 'database %s, so a login granted them for database %s would act '
                                 'there too', prefix, shared, current_database()),
                HINT = format('give this database roles of its own: drain migrate --role-prefix %s',
                              CASE WHEN derived <> prefix THEN derived
                                   ELSE hashed || '_drain_' END);
        END IF;
        INSERT INTO drain_settings (key, value) VALUES ('role_prefix', prefix)
        ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value;
    END IF;

    role := prefix || 'stager';
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = role) THEN
        EXECUTE format('GRANT INSERT, SELECT (task_id) ON staged_jobs TO %I', role);
        EXECUTE format('GRANT EXECUTE ON FUNCTION drain_stage(text, jsonb, jsonb, text, integer, '
                       'text, timestamptz, timestamptz, uuid) TO %I', role);
    END IF;
    role := prefix || 'runner';
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = role) THEN
        EXECUTE format('GRANT SELECT, DELETE ON staged_jobs TO %I', role);
        -- The drain moves rows that can never be published into dead_jobs; its
        -- metrics and `drain status` count them.
        EXECUTE format('GRANT SELECT, INSERT ON dead_jobs TO %I', role);
        -- Drains of earlier versions read it (an upgrade runs both for a while).
        EXECUTE format('GRANT SELECT ON drain_schema_state TO %I', role);
        -- It raises and lowers the wake flag (drain/postgres/wakeup.py).
        EXECUTE format('GRANT UPDATE ON SEQUENCE drain_wake TO %I', role);
        -- It obeys the operators' pauses, and `drain status` shows them.
        EXECUTE format('GRANT SELECT ON drain_pauses TO %I', role);
    END IF;
    role := prefix || 'operator';
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = role) THEN
        -- `drain stage`, and `drain dead requeue`, which moves rows back; `drain
        -- show` reads a staged job.
        EXECUTE format('GRANT INSERT, SELECT ON staged_jobs TO %I', role);
        EXECUTE format('GRANT SELECT, DELETE ON dead_jobs, drain_processed TO %I', role);
        -- `drain pause` and `resume`; every action leaves its row in drain_audit.
        EXECUTE format('GRANT SELECT, INSERT, DELETE ON drain_pauses TO %I', role);
        EXECUTE format('GRANT SELECT, INSERT ON drain_audit TO %I', role);
    END IF;
    role := prefix || 'consumer';
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = role) THEN
        EXECUTE format('GRANT SELECT, INSERT ON drain_processed TO %I', role);
    END IF;

    -- Moved to another prefix: the old roles lose here what this schema gave them
    -- (only that: a grant of your own to them stays).
    IF old IS NOT NULL THEN
        FOREACH kind IN ARRAY kinds LOOP
            role := old || kind;
            CONTINUE WHEN NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role);
            EXECUTE format('REVOKE INSERT, SELECT, DELETE ON staged_jobs, dead_jobs, '
                           'drain_processed FROM %I', role);
            EXECUTE format('REVOKE SELECT (task_id) ON staged_jobs FROM %I', role);
            EXECUTE format('REVOKE SELECT ON drain_schema_state FROM %I', role);
            EXECUTE format('REVOKE SELECT, INSERT, DELETE ON drain_pauses FROM %I', role);
            EXECUTE format('REVOKE SELECT, INSERT ON drain_audit FROM %I', role);
            EXECUTE format('REVOKE UPDATE ON SEQUENCE drain_wake FROM %I', role);
            EXECUTE format('REVOKE EXECUTE ON FUNCTION drain_stage(text, jsonb, jsonb, text, '
                           'integer, text, timestamptz, timestamptz, uuid) FROM %I', role);
        END LOOP;
    END IF;
END
$$;

-- Every query drain runs, by name. Loaded once by drain.sql; placeholders are
-- psycopg's %(name)s. Staging helpers build their INSERT in drain.staging,
-- since each client library spells placeholders its own way.

-- name: schema_present
SELECT to_regclass('staged_jobs') IS NOT NULL;

-- name: try_lock
SELECT pg_try_advisory_lock(%(key)s);

-- name: unlock
SELECT pg_advisory_unlock(%(key)s);

-- name: listen
LISTEN drain_staged_jobs;

-- name: fetch_batch
-- The next batch: highest priority first, then oldest. Ready rows come from
-- staged_jobs_ready_idx in that order; delayed rows that are due come from
-- staged_jobs_delayed_idx by due time, so rows not yet due are never scanned.
-- Left out: the batch still in flight (published, not yet confirmed), the
-- queues the broker is refusing for now, and expired rows (expire moves at
-- most a batch of them per cycle; the rest wait for the next cycles rather
-- than being published with an expiry in the past). JSON stays text: the
-- message body is built from it without a decode/encode round trip.
SELECT id, task_id, task_name, args::text, kwargs::text, queue, priority, tag, expires_at
FROM (
    (SELECT * FROM staged_jobs
     WHERE not_before IS NULL
       AND (expires_at IS NULL OR expires_at > now())
       AND id <> ALL(%(exclude)s::bigint[])
       AND queue <> ALL(%(paused)s::text[])
     ORDER BY priority DESC, id
     LIMIT %(limit)s)
    UNION ALL
    (SELECT * FROM staged_jobs
     WHERE not_before IS NOT NULL AND not_before <= now()
       AND (expires_at IS NULL OR expires_at > now())
       AND id <> ALL(%(exclude)s::bigint[])
       AND queue <> ALL(%(paused)s::text[])
     ORDER BY not_before, id
     LIMIT %(limit)s)
) AS due
ORDER BY priority DESC, id
LIMIT %(limit)s;

-- name: expire
-- Move rows whose expires_at has passed to dead_jobs, in the batch transaction.
WITH gone AS (
    DELETE FROM staged_jobs
    WHERE id IN (
        SELECT id FROM staged_jobs
        WHERE expires_at IS NOT NULL AND expires_at <= now()
          AND id <> ALL(%(exclude)s::bigint[])
        ORDER BY expires_at
        LIMIT %(limit)s)
    RETURNING *
)
INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, priority, tag,
                       not_before, expires_at, staged_at, reason, detail)
SELECT id, task_id, task_name, args, kwargs, queue, priority, tag,
       not_before, expires_at, staged_at, 'expired', NULL
FROM gone;

-- name: bury
-- Move rows that can never become a valid message to dead_jobs, with the reason.
WITH doomed AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(reasons)s::text[], %(details)s::text[])
        AS d(id, reason, detail)
), gone AS (
    DELETE FROM staged_jobs s USING doomed d WHERE s.id = d.id
    RETURNING s.*, d.reason AS dead_reason, d.detail AS dead_detail
)
INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, priority, tag,
                       not_before, expires_at, staged_at, reason, detail)
SELECT id, task_id, task_name, args, kwargs, queue, priority, tag,
       not_before, expires_at, staged_at, dead_reason, dead_detail
FROM gone;

-- name: delete_confirmed
DELETE FROM staged_jobs WHERE id = ANY(%(ids)s);

-- name: backlog
SELECT count(*),
       EXTRACT(EPOCH FROM now() - min(staged_at))::float8,
       count(*) FILTER (WHERE not_before > now())
FROM staged_jobs;

-- name: backlog_groups
-- The backlog grouped for `drain status` (the biggest groups first).
SELECT queue, tag, task_name, count(*),
       EXTRACT(EPOCH FROM now() - min(staged_at))::float8
FROM staged_jobs
GROUP BY queue, tag, task_name
ORDER BY count(*) DESC, queue, tag, task_name
LIMIT 50;

-- name: dead_by_reason
SELECT reason, count(*) FROM dead_jobs GROUP BY reason ORDER BY count(*) DESC, reason;

-- name: lock_holder
-- Advisory locks on a bigint key appear in pg_locks split into two int4 halves.
SELECT a.pid, a.application_name, host(a.client_addr), a.backend_start
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
  AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = ((%(key)s::bigint >> 32) & 4294967295)::bigint::oid
  AND l.objid = (%(key)s::bigint & 4294967295)::bigint::oid
  AND l.objsubid = 1;

-- name: set_application_name
SELECT set_config('application_name', %(name)s, false);

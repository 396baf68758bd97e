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
-- The oldest staged rows first, leaving out the batch still in flight (published,
-- not yet confirmed). JSON stays text: the message body is built from it
-- without a decode/encode round trip.
SELECT id, task_id, task_name, args::text, kwargs::text, queue
FROM staged_jobs
WHERE id <> ALL(%(exclude)s::bigint[])
ORDER BY id
LIMIT %(limit)s;

-- name: delete_confirmed
DELETE FROM staged_jobs WHERE id = ANY(%(ids)s);

-- name: backlog
SELECT count(*), EXTRACT(EPOCH FROM now() - min(staged_at))::float8
FROM staged_jobs;

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

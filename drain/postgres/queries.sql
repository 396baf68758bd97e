-- Every query drain runs, by name. Loaded once by drain.postgres.sql; placeholders are
-- psycopg's %(name)s. Staging helpers build their INSERT in drain.staging,
-- since each client library spells placeholders its own way.

-- name: schema_present
-- staged_jobs's oid (NULL: no such table), which also keys the wake flag's
-- sentinel lock (drain.postgres.wakeup), and whether the wake flag exists (a schema
-- from before it needs `drain migrate`).
SELECT to_regclass('staged_jobs')::oid::int, to_regclass('drain_wake') IS NOT NULL;

-- name: try_lock
SELECT pg_try_advisory_lock(%(key)s);

-- name: try_lane_lock
-- Lane K of N: its own lock, (class, K) in the two-int keyspace.
SELECT pg_try_advisory_lock(%(class)s::int, %(lane)s::int);

-- name: join_lanes
-- Every drain of a lock key holds (guard, N) shared, N its number of lanes:
-- the lanes of one drain share rows by id modulo N, so drains split in a
-- different number of lanes would publish the same rows. lanes_in_use, run
-- after this, shows the lane counts of the others.
SELECT pg_advisory_lock_shared(%(guard)s::int, %(lanes)s::int)::text;

-- name: listen
LISTEN drain_staged_jobs;

-- name: take_sentinel
-- Only the session holding the sentinel lock raises the wake flag.
SELECT pg_try_advisory_lock(%(class)s::int, %(key)s::int);

-- name: release_sentinel
SELECT pg_advisory_unlock(%(class)s::int, %(key)s::int);

-- name: wake_flag
-- Is the wake flag raised (odd)? Never set reads as lowered.
SELECT coalesce(mod(pg_sequence_last_value('drain_wake'), 2) = 1, false);

-- name: raise_flag
-- Staging notifies from now on (not transactional: seen at once).
SELECT setval('drain_wake', 1);

-- name: lower_flag
SELECT setval('drain_wake', 2);

-- name: silent_writers
-- Some other transaction, still open, has read the wake flag, maybe before
-- it was raised: reading a sequence takes RowExclusiveLock on it until the
-- transaction ends (init_sequence in Postgres's sequence.c, every version
-- since 10). Other modes are not readers of the flag (pg_dump's
-- AccessShareLock, held for a whole dump, must not keep the drain from
-- arming). Asked after raising the flag.
SELECT EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'relation' AND relation = 'drain_wake'::regclass::oid
      AND mode = 'RowExclusiveLock'
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND pid <> pg_backend_pid()
);

-- name: announce
SELECT pg_notify('drain_staged_jobs', 'drain');

-- name: armed_elsewhere
-- Another session (another lane's drain) holds the sentinel lock: it is armed.
SELECT EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND granted
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND classid = %(class)s::int::oid AND objid = %(key)s::int::oid AND objsubid = 2
      AND pid <> pg_backend_pid()
);

-- name: fetch_batch
-- The next batch: highest priority first, then in staging transaction
-- order. Ready rows come from staged_jobs_ready_idx: each priority with a
-- low-water mark (drain.postgres.keyset) is read from (priority, xact, id) = (p, mark)
-- on, past the dead index entries of rows already drained; the open ranges of
-- priorities between them from their head. Delayed rows that are due come
-- from staged_jobs_delayed_idx by due time from their low-water mark, so rows
-- not yet due and rows already drained are never scanned; those that appeared
-- below the mark (a late commit, an update) through staged_jobs_timed_xact_idx.
-- Left out: the batches still in flight (published, not yet
-- confirmed: thousands of ids; a row outside their range, as most are when the
-- backlog drains in order, is not looked up at all, and the rest in a hash of
-- them built once: `NOT IN (SELECT unnest(...))`, not `<> ALL(...)`, whose
-- thousands of constants the planner estimated one by one, ~5 ms per fetch at
-- 4,000), the queues the broker is refusing for now and the tasks an operator
-- paused (paused_tasks: drain.postgres.pauses), the rows a static
-- --app routes to one of them (held_routes: task name, US, '*' for a row staged
-- without a queue or '=' and its queue, what drain.celery.routing routes by;
-- drain.daemon.piles), expired rows (expire
-- moves at most a batch of them per cycle; the rest wait for the next cycles
-- rather than being published with an expiry in the past), and rows of other
-- lanes (lane = |id mod N|: every id, negative ones too, has exactly one).
-- JSON stays text: the message body is built from it without a decode/encode
-- round trip.
-- A row without a queue (NULL, or 'celery' staged before that was NULL: see
-- staging_schema.sql, queue_legacy) reads as 'celery', Celery's default,
-- and as unrouted: `drain run --app` routes it as the app would.
SELECT id, task_id::text, task_name, args::text, kwargs::text, coalesce(queue, 'celery') AS queue,
       priority, tag, expires_at, not_before IS NULL AS ready,
       queue IS NULL OR (queue = 'celery' AND queue_legacy) AS unrouted,
       embed::text AS embed, trace::text AS trace,
       -- Unix times, which cost the drain less to read than timestamps: when it
       -- was staged (only for a row with a trace: drain.daemon.tracing's
       -- threshold) and when it became due (staged, or its not_before if later).
       CASE WHEN trace IS NOT NULL THEN extract(epoch FROM staged_at)::float8 END
           AS staged_epoch,
       extract(epoch FROM greatest(staged_at, not_before))::float8 AS due_epoch,
       xact::text::bigint AS xact
FROM (
    (SELECT s.* FROM unnest(%(priorities)s::int[], %(mark_xacts)s::bigint[],
                            %(mark_ids)s::bigint[]) AS m(p, wx, wi)
     CROSS JOIN LATERAL (
        SELECT * FROM staged_jobs s
        WHERE s.not_before IS NULL AND s.priority = m.p
          AND (s.xact, s.id) >= (m.wx::text::xid8, m.wi)
          AND (s.expires_at IS NULL OR s.expires_at > now())
          AND (s.id > %(exclude_max)s::bigint OR s.id < %(exclude_min)s::bigint
               OR s.id NOT IN (SELECT unnest(%(exclude)s::bigint[])))
          AND coalesce(s.queue, 'celery') <> ALL(%(paused)s::text[])
          AND s.task_name <> ALL(%(paused_tasks)s::text[])
          AND (cardinality(%(held_routes)s::text[]) = 0
               OR s.task_name || E'\x1f' || CASE WHEN s.queue IS NULL
                   OR (s.queue = 'celery' AND s.queue_legacy) THEN '*' ELSE '=' || s.queue END
                   <> ALL(%(held_routes)s::text[]))
          AND (%(lanes)s::int = 1 OR abs(mod(s.id, %(lanes)s::int)) = %(lane)s::int)
        ORDER BY s.priority DESC, s.xact, s.id
        LIMIT %(limit)s) AS s)
    UNION ALL
    (SELECT s.* FROM unnest(%(gap_above)s::int[], %(gap_below)s::int[]) AS g(above, below)
     CROSS JOIN LATERAL (
        SELECT * FROM staged_jobs s
        WHERE s.not_before IS NULL AND s.priority > g.above AND s.priority < g.below
          AND (s.expires_at IS NULL OR s.expires_at > now())
          AND (s.id > %(exclude_max)s::bigint OR s.id < %(exclude_min)s::bigint
               OR s.id NOT IN (SELECT unnest(%(exclude)s::bigint[])))
          AND coalesce(s.queue, 'celery') <> ALL(%(paused)s::text[])
          AND s.task_name <> ALL(%(paused_tasks)s::text[])
          AND (cardinality(%(held_routes)s::text[]) = 0
               OR s.task_name || E'\x1f' || CASE WHEN s.queue IS NULL
                   OR (s.queue = 'celery' AND s.queue_legacy) THEN '*' ELSE '=' || s.queue END
                   <> ALL(%(held_routes)s::text[]))
          AND (%(lanes)s::int = 1 OR abs(mod(s.id, %(lanes)s::int)) = %(lane)s::int)
        ORDER BY s.priority DESC, s.xact, s.id
        LIMIT %(limit)s) AS s)
    UNION ALL
    (SELECT * FROM staged_jobs s
     WHERE s.not_before IS NOT NULL AND s.not_before <= now()
       AND s.not_before >= %(delayed_from)s::timestamptz
       AND (s.expires_at IS NULL OR s.expires_at > now())
       AND (s.id > %(exclude_max)s::bigint OR s.id < %(exclude_min)s::bigint
            OR s.id NOT IN (SELECT unnest(%(exclude)s::bigint[])))
       AND coalesce(s.queue, 'celery') <> ALL(%(paused)s::text[])
       AND s.task_name <> ALL(%(paused_tasks)s::text[])
       AND (cardinality(%(held_routes)s::text[]) = 0
            OR s.task_name || E'\x1f' || CASE WHEN s.queue IS NULL
                OR (s.queue = 'celery' AND s.queue_legacy) THEN '*' ELSE '=' || s.queue END
                <> ALL(%(held_routes)s::text[]))
       AND (%(lanes)s::int = 1 OR abs(mod(s.id, %(lanes)s::int)) = %(lane)s::int)
     ORDER BY s.not_before, s.id
     LIMIT %(limit)s)
    UNION ALL
    (SELECT * FROM (
        SELECT * FROM staged_jobs s
        WHERE (s.not_before IS NOT NULL OR s.expires_at IS NOT NULL)
          AND %(delayed_from)s::timestamptz > '-infinity'  -- from the start: all above
          AND s.xact >= %(timed_xact)s::text::xid8
          AND s.not_before IS NOT NULL AND s.not_before <= now()
          AND s.not_before < %(delayed_from)s::timestamptz
          AND (s.expires_at IS NULL OR s.expires_at > now())
          AND (s.id > %(exclude_max)s::bigint OR s.id < %(exclude_min)s::bigint
               OR s.id NOT IN (SELECT unnest(%(exclude)s::bigint[])))
          AND coalesce(s.queue, 'celery') <> ALL(%(paused)s::text[])
          AND s.task_name <> ALL(%(paused_tasks)s::text[])
          AND (cardinality(%(held_routes)s::text[]) = 0
               OR s.task_name || E'\x1f' || CASE WHEN s.queue IS NULL
                   OR (s.queue = 'celery' AND s.queue_legacy) THEN '*' ELSE '=' || s.queue END
                   <> ALL(%(held_routes)s::text[]))
          AND (%(lanes)s::int = 1 OR abs(mod(s.id, %(lanes)s::int)) = %(lane)s::int)
        ORDER BY s.xact OFFSET 0) AS late
     ORDER BY late.not_before, late.id
     LIMIT %(limit)s)
) AS due
ORDER BY priority DESC, xact, id
LIMIT %(limit)s;

-- name: newest_columns_present
-- Whether staged_jobs and dead_jobs have queue_legacy and trace, and the
-- table drain_pauses is there (staging_schema.sql): the newest objects this
-- drain reads. A schema without them needs `drain migrate`.
SELECT count(*) = 4 AND to_regclass('drain_pauses') IS NOT NULL FROM pg_attribute
WHERE attrelid IN (to_regclass('staged_jobs'), to_regclass('dead_jobs'))
  AND attname IN ('queue_legacy', 'trace') AND NOT attisdropped;

-- name: pauses_present
-- Whether this schema has drain_pauses (`drain status` on an older one shows none).
SELECT to_regclass('drain_pauses') IS NOT NULL;

-- name: pauses
-- The operators' pauses (drain.postgres.pauses), read by the drain in its
-- batch's snapshot when they changed.
SELECT kind, name, reason, paused_by, paused_at FROM drain_pauses ORDER BY kind, name;

-- name: fetch_heads
-- For drain.postgres.keyset, in the batch's own snapshot: that snapshot's xmin, and
-- for each marked priority (in the order given) the smallest (xact, id) still
-- staged at or above its mark (NULLs: none), whatever its expiry or flight, in
-- any queue but the paused ones (drain.postgres.keyset, "Paused queues"), of any
-- task but those an operator paused, and other
-- than the rows held by id or by route (held_routes, as in fetch_batch) for a
-- paused queue (drain.daemon.piles: by id, those above the marks only). Each is one index descent from (priority, mark),
-- stepping over the paused queues' and the held rows.
SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint,
       array_agg(h.xact::text::bigint ORDER BY m.n),
       array_agg(h.id ORDER BY m.n)
FROM unnest(%(priorities)s::int[], %(mark_xacts)s::bigint[], %(mark_ids)s::bigint[])
    WITH ORDINALITY AS m(p, wx, wi, n)
LEFT JOIN LATERAL (
    SELECT s.xact, s.id FROM staged_jobs s
    WHERE s.not_before IS NULL AND s.priority = m.p
      AND (s.xact, s.id) >= (m.wx::text::xid8, m.wi)
      AND coalesce(s.queue, 'celery') <> ALL(%(paused)s::text[])
      AND s.task_name <> ALL(%(paused_tasks)s::text[])
      AND (cardinality(%(held_routes)s::text[]) = 0
           OR s.task_name || E'\x1f' || CASE WHEN s.queue IS NULL
               OR (s.queue = 'celery' AND s.queue_legacy) THEN '*' ELSE '=' || s.queue END
               <> ALL(%(held_routes)s::text[]))
      AND s.id <> ALL(%(held)s::bigint[])
      AND (%(lanes)s::int = 1 OR abs(mod(s.id, %(lanes)s::int)) = %(lane)s::int)
    ORDER BY s.priority DESC, s.xact, s.id
    LIMIT 1) AS h ON true;

-- name: timed_heads
-- For drain.postgres.keyset, in the batch's own snapshot: its xmin, and the smallest
-- due time and expiry still staged (this lane, any queue or flight) at or
-- above their marks, or staged by a transaction at or above the last look's
-- xmin (NULL: none). Each mark is one index descent; the recent rows come
-- through staged_jobs_timed_xact_idx.
WITH late AS MATERIALIZED (
    SELECT s.not_before, s.expires_at FROM staged_jobs s
    WHERE (s.not_before IS NOT NULL OR s.expires_at IS NOT NULL)
      -- from the start (a first look, a rescan) every row is at or above the marks
      AND (%(delayed_from)s::timestamptz > '-infinity'
           OR %(expiring_from)s::timestamptz > '-infinity')
      AND s.xact >= %(timed_xact)s::text::xid8
      AND (%(lanes)s::int = 1 OR abs(mod(s.id, %(lanes)s::int)) = %(lane)s::int)
    ORDER BY s.xact
)
SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint,
       least((SELECT s.not_before FROM staged_jobs s
              WHERE s.not_before IS NOT NULL
                AND s.not_before >= %(delayed_from)s::timestamptz
                AND (%(lanes)s::int = 1 OR abs(mod(s.id, %(lanes)s::int)) = %(lane)s::int)
              ORDER BY s.not_before LIMIT 1),
             (SELECT min(not_before) FROM late))::text,
       least((SELECT s.expires_at FROM staged_jobs s
              WHERE s.expires_at IS NOT NULL
                AND s.expires_at >= %(expiring_from)s::timestamptz
                AND (%(lanes)s::int = 1 OR abs(mod(s.id, %(lanes)s::int)) = %(lane)s::int)
              ORDER BY s.expires_at LIMIT 1),
             (SELECT min(expires_at) FROM late))::text;

-- name: expiring
-- The rows whose expires_at has passed, to move to dead_jobs in the batch
-- transaction (bury, reason 'expired'): this lane's rows only, never the
-- batches in flight nor the rows held out after a conflict (both in
-- exclude). Read from the expiry's low-water mark on, and below it the rows of
-- recent transactions (drain/postgres/keyset.py, "Delayed and expiring rows").
(SELECT id, xact::text::bigint FROM staged_jobs
 WHERE expires_at IS NOT NULL AND expires_at <= now()
   AND expires_at >= %(expiring_from)s::timestamptz
   AND id <> ALL(%(exclude)s::bigint[])
   AND (%(lanes)s::int = 1 OR abs(mod(id, %(lanes)s::int)) = %(lane)s::int)
 ORDER BY expires_at
 LIMIT %(limit)s)
UNION ALL
(SELECT late.id, late.xact::text::bigint FROM (
    SELECT id, xact, expires_at FROM staged_jobs
    WHERE (not_before IS NOT NULL OR expires_at IS NOT NULL)
      AND %(expiring_from)s::timestamptz > '-infinity'  -- from the start: all above
      AND xact >= %(timed_xact)s::text::xid8
      AND expires_at IS NOT NULL AND expires_at <= now()
      AND expires_at < %(expiring_from)s::timestamptz
      AND id <> ALL(%(exclude)s::bigint[])
      AND (%(lanes)s::int = 1 OR abs(mod(id, %(lanes)s::int)) = %(lane)s::int)
    ORDER BY xact OFFSET 0) AS late
 ORDER BY late.expires_at
 LIMIT %(limit)s);

-- name: keyed_lock_timeout
-- Before the statements that remove rows as the drain read them (bury,
-- delete_confirmed), for the rest of the batch transaction: a lock another
-- transaction holds is waited for this long at most, then locked_rows says
-- which rows to set aside, pending (drain/postgres/conflicts.py). Not FOR UPDATE
-- SKIP LOCKED: that would need UPDATE privilege on staged_jobs, which
-- drain_runner does not have. Sent in the same round trip as the first of
-- those statements (Store._keyed), not on its own.
SELECT set_config('lock_timeout', %(timeout)s, true);

-- name: keyed_savepoint
-- Around each statement that removes rows as the drain read them (Store._keyed):
-- a conflict undoes that statement only, the batch goes on. Sent in one round
-- trip with the statement and keyed_release (and keyed_lock_timeout before it,
-- once per batch); on a failure, keyed_rollback.
SAVEPOINT drain_keyed;

-- name: keyed_release
RELEASE SAVEPOINT drain_keyed;

-- name: keyed_rollback
ROLLBACK TO SAVEPOINT drain_keyed;

-- name: bury
-- Move rows to dead_jobs with their reason (expired, or never a valid
-- message), each only as the drain read it (same id and xact, which every
-- UPDATE renews): a row changed since is left staged (drain/postgres/conflicts.py).
-- Returns the ids moved.
WITH doomed AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(xacts)s::text[]::xid8[], %(reasons)s::text[],
                         %(details)s::text[]) AS d(id, xact, reason, detail)
), gone AS (
    DELETE FROM staged_jobs s USING doomed d WHERE s.id = d.id AND s.xact = d.xact
    RETURNING s.*, d.reason AS dead_reason, d.detail AS dead_detail
), dead AS (
    INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, queue_legacy, priority,
                           tag, not_before, expires_at, staged_at, embed, trace, reason, detail)
    SELECT id, task_id, task_name, args, kwargs, queue, queue_legacy, priority, tag,
           not_before, expires_at, staged_at, embed, trace, dead_reason, dead_detail
    FROM gone
    RETURNING id
)
SELECT id FROM dead;

-- name: alive
SELECT 1;

-- name: delete_confirmed
-- Delete the rows whose messages the broker confirmed, each only as the drain
-- read it (same id and xact: every UPDATE renews xact). A row changed since is
-- left staged and published again as it is now (drain/postgres/conflicts.py). Returns
-- the ids deleted.
-- `s.id = ANY(ids)` makes the read of staged_jobs one primary key lookup per id
-- (an index scan on the array), joined to the (id, xact) pairs after it. With
-- the join alone, the planner (sequential scans off: drain.postgres.session)
-- merge-joined the sorted pairs with the whole primary key from its first
-- entry: 51,000 entries read to delete 1,000 rows above a pile of 50,000 that
-- stays staged (a refused queue's), and more as the pile grows.
DELETE FROM staged_jobs s
USING unnest(%(ids)s::bigint[], %(xacts)s::text[]::xid8[]) AS c(id, xact)
WHERE s.id = ANY(%(ids)s::bigint[]) AND s.id = c.id AND s.xact = c.xact
RETURNING s.id;

-- name: locked_rows
-- Which of these rows a DELETE would wait for now, without waiting: all of
-- them while another session holds or awaits a lock on staged_jobs that
-- conflicts with ROW EXCLUSIVE (LOCK TABLE ... IN SHARE MODE, a plain CREATE
-- INDEX); else the rows whose xmax is a transaction running now (it locked or
-- is updating the row: every transaction holds a lock on its own id). An xmax
-- left by a locker that ended, or a multixact's id, does not count: the
-- statement is tried again and halved if it still waits
-- (drain/postgres/conflicts.py). pg_locks and xmax need no privilege.
WITH locks AS (
    SELECT locktype, database, relation, mode, transactionid FROM pg_locks
    WHERE pid IS DISTINCT FROM pg_backend_pid()
), whole AS (
    SELECT EXISTS (
        SELECT FROM locks
        WHERE locktype = 'relation' AND relation = 'staged_jobs'::regclass
          AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND mode IN ('ShareLock', 'ShareRowExclusiveLock', 'ExclusiveLock',
                       'AccessExclusiveLock')) AS locked
)
SELECT c.id FROM unnest(%(ids)s::bigint[]) AS c(id), whole
WHERE whole.locked
UNION ALL
SELECT s.id FROM staged_jobs s, whole
WHERE NOT whole.locked AND s.id = ANY(%(ids)s::bigint[]) AND s.xmax <> '0'::xid
  AND s.xmax IN (SELECT transactionid FROM locks WHERE locktype = 'transactionid');

-- name: backlog_estimate
-- drain status: what the statistics know about staged_jobs, without reading
-- it. n_live_tup is kept up to date by every commit (and reset by vacuum and
-- analyze); n_dead_tup counts the deleted rows vacuum has not removed yet
-- (held back by old transactions); the size in pages sets the sample rate.
SELECT coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0),
       pg_relation_size(c.oid) / current_setting('block_size')::int
FROM pg_class c
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.oid = 'staged_jobs'::regclass;

-- name: backlog_groups
-- drain status, exact: the backlog grouped (the biggest groups first), with
-- the totals over every group. A group's age is that of its oldest row that
-- is due: a ready row waits from staged_at, a delayed one from not_before
-- (NULL: every row of the group is delayed into the future). Times Postgres
-- holds and an interval cannot ('infinity', BC, a year past 9999, staged by
-- plain SQL) count as years 1 and 9999 here and in backlog_oldest: an age,
-- never an error that stops every sample. The clamp applies to each due row's
-- time, inside min(): greatest() skips a NULL, so a clamp around min() (or
-- around a CASE that gives NULL for a row not due) turned "no row is due" into
-- year 1, an age of 2,026 years.
SELECT queue, tag, task_name, count(*),
       count(*) FILTER (WHERE not_before > now()),
       EXTRACT(EPOCH FROM now() - min(CASE
           WHEN not_before IS NULL
               THEN least(greatest(staged_at, '0001-01-01 00:00:00+00'), '9999-12-31 00:00:00+00')
           WHEN not_before <= now()
               THEN least(greatest(not_before, '0001-01-01 00:00:00+00'), '9999-12-31 00:00:00+00')
           END))::float8,
       sum(count(*)) OVER ()::bigint,
       sum(count(*) FILTER (WHERE not_before > now())) OVER ()::bigint,
       count(*) OVER ()
FROM staged_jobs
GROUP BY queue, tag, task_name
ORDER BY count(*) DESC, queue, tag, task_name
LIMIT 50;

-- name: backlog_groups_sample
-- drain status above the exact-count threshold: the same from a block sample
-- of `percent` per cent of the pages; the caller scales the counts. Ages
-- are the oldest sampled row's: a lower bound.
SELECT queue, tag, task_name, count(*),
       count(*) FILTER (WHERE not_before > now()),
       EXTRACT(EPOCH FROM now() - min(CASE
           WHEN not_before IS NULL
               THEN least(greatest(staged_at, '0001-01-01 00:00:00+00'), '9999-12-31 00:00:00+00')
           WHEN not_before <= now()
               THEN least(greatest(not_before, '0001-01-01 00:00:00+00'), '9999-12-31 00:00:00+00')
           END))::float8,
       sum(count(*)) OVER ()::bigint,
       sum(count(*) FILTER (WHERE not_before > now())) OVER ()::bigint,
       count(*) OVER ()
FROM staged_jobs TABLESAMPLE SYSTEM (%(percent)s)
GROUP BY queue, tag, task_name
ORDER BY count(*) DESC, queue, tag, task_name
LIMIT 50;

-- name: backlog_oldest
-- drain status: how long the oldest due row has waited, from index heads
-- only (no scan, however big the backlog): the first entry of each priority
-- in staged_jobs_ready_idx (a loose index scan, one descent per priority;
-- within a priority rows follow staging transactions, so approximately the oldest),
-- and the head of staged_jobs_delayed_idx (positive: due that long ago;
-- negative: nothing delayed is due yet).
WITH RECURSIVE heads AS (
    (SELECT priority, staged_at FROM staged_jobs
     WHERE not_before IS NULL
     ORDER BY priority DESC, xact, id
     LIMIT 1)
    UNION ALL
    SELECT n.priority, n.staged_at
    FROM heads
    CROSS JOIN LATERAL (
        SELECT s.priority, s.staged_at FROM staged_jobs s
        WHERE s.not_before IS NULL AND s.priority < heads.priority
        ORDER BY s.priority DESC, s.xact, s.id
        LIMIT 1) AS n
)
SELECT (SELECT EXTRACT(EPOCH FROM now() - min(least(greatest(
                   staged_at, '0001-01-01 00:00:00+00'), '9999-12-31 00:00:00+00')))::float8
        FROM heads),
       (SELECT EXTRACT(EPOCH FROM now() - least(greatest(
                   not_before, '0001-01-01 00:00:00+00'), '9999-12-31 00:00:00+00'))::float8
        FROM staged_jobs
        WHERE not_before IS NOT NULL
        ORDER BY not_before, id
        LIMIT 1);

-- name: dead_by_reason
SELECT reason, count(*) FROM dead_jobs GROUP BY reason ORDER BY count(*) DESC, reason;

-- name: dead_estimate
-- drain status: what the statistics know about dead_jobs (as backlog_estimate).
SELECT coalesce(s.n_live_tup, 0),
       pg_relation_size(c.oid) / current_setting('block_size')::int
FROM pg_class c
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.oid = 'dead_jobs'::regclass;

-- name: dead_by_reason_sample
-- drain status above the exact-count threshold: dead_by_reason from a block
-- sample of `percent` per cent of the pages; the caller scales the counts.
SELECT reason, count(*) FROM dead_jobs TABLESAMPLE SYSTEM (%(percent)s)
GROUP BY reason ORDER BY count(*) DESC, reason;

-- name: oldest_transaction
-- drain status: the oldest open transaction of this database (other than our
-- own), the one that keeps vacuum from removing drained rows when it holds a
-- snapshot or a transaction id. Client sessions, and prepared transactions
-- (pid NULL). Other roles' sessions show no xact_start without
-- pg_read_all_stats, and are left out then.
SELECT * FROM (
    SELECT a.pid, a.state, a.application_name, a.xact_start,
           EXTRACT(EPOCH FROM now() - a.xact_start)::float8,
           a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL
    FROM pg_stat_activity a
    WHERE a.datname = current_database()
      AND a.pid <> pg_backend_pid()
      AND a.backend_type = 'client backend'
      AND a.xact_start IS NOT NULL
    UNION ALL
    SELECT NULL, 'prepared', NULL, p.prepared,
           EXTRACT(EPOCH FROM now() - p.prepared)::float8, true
    FROM pg_prepared_xacts p
    WHERE p.database = current_database()
) AS t(pid, state, application_name, xact_start, age, blocks_vacuum)
ORDER BY xact_start
LIMIT 1;

-- name: lock_holder
-- Who holds an advisory lock. pg_locks shows a bigint key as two int4 halves
-- (objsubid 1) and a two-int4 key as those two (objsubid 2), as unsigned oids.
SELECT a.pid, a.application_name, host(a.client_addr), a.backend_start
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
  AND l.granted
  AND l.mode = 'ExclusiveLock'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = (%(high)s::bigint & 4294967295)::bigint::oid
  AND l.objid = (%(low)s::bigint & 4294967295)::bigint::oid
  AND l.objsubid = %(form)s;

-- name: lane_holders
-- Who holds which lane of a lock key split in N lanes: the (class, lane)
-- locks of lock_holder's two-int4 form, every lane at once.
SELECT l.objid::text::int, a.pid, a.application_name, host(a.client_addr), a.backend_start
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
  AND l.granted
  AND l.mode = 'ExclusiveLock'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = (%(class)s::bigint & 4294967295)::bigint::oid
  AND l.objsubid = 2;

-- name: lanes_in_use
-- The lane counts drains of a lock key run with: each holds (guard, N) shared.
SELECT DISTINCT l.objid::text::int
FROM pg_locks l
WHERE l.locktype = 'advisory'
  AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = (%(guard)s::bigint & 4294967295)::bigint::oid
  AND l.objsubid = 2
ORDER BY 1;

-- name: set_application_name
SELECT set_config('application_name', %(name)s, false);

-- name: in_recovery
-- A hot standby (drain.postgres.failover): it refuses LISTEN and every write until promoted.
SELECT pg_is_in_recovery();

-- name: take_token
-- This session's token (drain.postgres.abandoned): held until the session ends.
SELECT pg_try_advisory_lock(%(class)s::int, %(key)s::int);

-- name: end_abandoned
-- End a session this drain abandoned because it stopped answering (a hung
-- path keeps it, and the lock it holds, alive on the server), only while that
-- backend still holds both this drain's lock and the abandoned session's token
-- (drain.postgres.abandoned): a pool may have handed the server connection to another
-- client meanwhile. The check and the kill are one statement (a one-time
-- filter, evaluated before the call).
SELECT pg_terminate_backend(%(pid)s)
WHERE EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND granted AND pid = %(pid)s
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND classid = %(token_class)s::int::oid AND objid = %(token)s::int::oid
      AND objsubid = 2
) AND EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory' AND mode = 'ExclusiveLock' AND granted AND pid = %(pid)s
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND classid = %(lock_classid)s::bigint::oid AND objid = %(lock_objid)s::bigint::oid
      AND objsubid = %(lock_objsubid)s::int
);

-- name: testing_staged
-- drain.testing: every staged row as a test sees it on its own connection, in
-- staging order; due and expired as a drain would judge them now. JSON and
-- ids as text, times as exact epoch seconds (text too, 'Infinity' included),
-- so that every driver, Django's whatever its time zone settings, hands them
-- back alike. CAST, not ::, so that SQLAlchemy's text() sees no bind
-- parameter in it.
SELECT id, CAST(task_id AS text), task_name, CAST(args AS text), CAST(kwargs AS text),
       CASE WHEN queue = 'celery' AND queue_legacy THEN NULL ELSE queue END,
       priority, tag, CAST(extract(epoch FROM not_before) AS text),
       CAST(extract(epoch FROM expires_at) AS text), CAST(extract(epoch FROM staged_at) AS text),
       CAST(embed AS text),
       CAST(CAST(xact AS text) AS bigint),
       coalesce(not_before <= statement_timestamp(), true),
       coalesce(expires_at <= statement_timestamp(), false)
FROM staged_jobs
ORDER BY id;

-- name: testing_delete
-- drain.testing: a row the test ran eagerly, or cleared.
DELETE FROM staged_jobs WHERE id = ANY(CAST(%(ids)s AS bigint[]));

-- name: testing_dead_mark
-- drain.testing: the last dead_jobs row before a publish.
SELECT coalesce(max(dead_id), 0) FROM dead_jobs;

-- name: testing_dead_since
-- drain.testing: the rows a publish moved to dead_jobs.
SELECT task_name, CAST(task_id AS text), reason, detail FROM dead_jobs
WHERE dead_id > %(mark)s
ORDER BY dead_id;

-- name: schema_tables
-- Whether staged_jobs and drain_settings (where `drain migrate` records the
-- schema's version) exist, as this session's search path finds them.
SELECT to_regclass('staged_jobs') IS NOT NULL, to_regclass('drain_settings') IS NOT NULL;

-- name: schema_version
SELECT value::int FROM drain_settings WHERE key = 'schema_version';

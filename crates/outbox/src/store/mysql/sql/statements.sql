-- The statements whose text is fixed once the table prefix is known, made once per store
-- (`Sql::new`). Each begins at a line `-- @name` (its field of `Sql`) and runs to the next;
-- other lines that begin with `--` are comments. `{p}` is the table prefix, `{lock}` the
-- inbox lock's name of the bound consumer and id (`inbox_lock_name`), `{expiry}`
-- `RELAY_EXPIRY` in ms, `{parked}` the parked time (`PARKED`). Times are `UTC_TIMESTAMP(6)`.

-- The connection
-- @max_packet
SELECT CAST(@@max_allowed_packet AS SIGNED)

-- User-level locks (`GET_LOCK`): the purge lock, taken only if free.
-- @lock_try
SELECT GET_LOCK(?, 0)

-- The parking lock, waiting up to the seconds bound.
-- @lock_wait
SELECT GET_LOCK(?, ?)

-- The migration lock, waiting up to 60 s.
-- @lock_migrate
SELECT GET_LOCK(?, 60)
-- @lock_release
SELECT RELEASE_LOCK(?)

-- Schema (schema.rs)
-- @versions_table
CREATE TABLE IF NOT EXISTS {p}_schema_migrations (
    version BIGINT NOT NULL PRIMARY KEY,
    applied_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6))) ENGINE = InnoDB
-- @versions_exist
SELECT COUNT(*) FROM information_schema.tables
WHERE table_schema = DATABASE() AND table_name = ?
-- @version
SELECT CAST(COALESCE(MAX(version), 0) AS SIGNED) FROM {p}_schema_migrations
-- @version_insert
INSERT INTO {p}_schema_migrations (version) VALUES (?)
-- @enqueue_limit_set
UPDATE {p}_control SET max_message_bytes = ? WHERE id = 1
-- @enqueue_limit
SELECT max_message_bytes FROM {p}_control WHERE id = 1
-- @pause_patterns
SELECT pattern FROM {p}_topic_pauses
-- @pause_regex_set
UPDATE {p}_topic_pauses SET regex = ? WHERE pattern = ?

-- Enqueue and the inbox (enqueue.rs, retention.rs)
-- @enqueue
INSERT INTO {p}_messages (message_id, topic, `key`, payload, headers, available_at)
VALUES (?, ?, ?, ?, ?, COALESCE(?, TIMESTAMPADD(MICROSECOND, ? * 1000, UTC_TIMESTAMP(6))))
-- @existing_id
SELECT id FROM {p}_messages WHERE message_id = ? LOCK IN SHARE MODE

-- Insert first. INSERT IGNORE writes 0 rows on a duplicate key whatever the
-- connection's CLIENT_FOUND_ROWS (an ON DUPLICATE KEY UPDATE no-op counts 1 with
-- it, as sqlx connects); the consumer name is checked and the id formatted
-- before, so the duplicate key is the only error there is to ignore.
-- @inbox_accept
INSERT IGNORE INTO {p}_inbox (consumer, message_id) VALUES (?, ?)
-- @inbox_lock
SELECT GET_LOCK({lock}, @@innodb_lock_wait_timeout),
CAST(@@innodb_lock_wait_timeout AS SIGNED)
-- @inbox_unlock
DO RELEASE_LOCK({lock})
-- @inbox_purge
DELETE FROM {p}_inbox
WHERE received_at < TIMESTAMPADD(MICROSECOND, -? * 1000, UTC_TIMESTAMP(6))
ORDER BY received_at LIMIT ?
-- @purge
DELETE FROM {p}_messages
WHERE status = 2 AND dispatched_at < TIMESTAMPADD(MICROSECOND, -? * 1000, UTC_TIMESTAMP(6))
ORDER BY id LIMIT ?

-- The wake-up probe (probe.rs)

-- The newest id and how long until the first live row is claimable (µs; ≤ 0:
-- due now; NULL: no live row). Both aggregates are read off an index end
-- ("Select tables optimized away").
-- @probe
SELECT CAST(COALESCE(MAX(id), 0) AS SIGNED),
       CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), MIN(live_at)) AS SIGNED)
FROM {p}_messages

-- Operations (ops.rs)

-- The switch and the topic pauses in one statement (one read view): a row per
-- pause, or one row of NULL pause columns when there is none.
-- @pause_state
SELECT c.paused, c.reason, c.changed_at, t.pattern, t.reason, t.paused_by, t.paused_at
FROM {p}_control c LEFT JOIN {p}_topic_pauses t ON 1 = 1
WHERE c.id = 1 ORDER BY t.pattern
-- @set_pause
UPDATE {p}_control SET paused = ?, reason = ?, changed_at = UTC_TIMESTAMP(6) WHERE id = 1
-- @pause_topic
INSERT INTO {p}_topic_pauses (pattern, reason, paused_by, paused_at, regex)
VALUES (?, ?, ?, UTC_TIMESTAMP(6), ?)
ON DUPLICATE KEY UPDATE reason = VALUES(reason), paused_by = VALUES(paused_by),
    paused_at = VALUES(paused_at), regex = VALUES(regex)
-- @resume_topic
DELETE FROM {p}_topic_pauses WHERE pattern = ?
-- @replay_insert
INSERT INTO {p}_replays (requested_by, reason, action, selection) VALUES (?, ?, ?, ?)
-- @replay_count
UPDATE {p}_replays SET `count` = `count` + ? WHERE id = ?
-- @replays
SELECT id, at, requested_by, reason, action, selection, `count`
FROM {p}_replays ORDER BY id DESC LIMIT ?

-- The relay registry (registry.rs)

-- `started_at` only on the first write; VALUES() is understood by MySQL 8 and
-- MariaDB alike.
-- @heartbeat
INSERT INTO {p}_relays (relay_id, host, pid, version, sink, in_flight, started_at,
                        last_seen, last_claim_at, destinations, instance,
                        lease_ms)
VALUES (?, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), TIMESTAMPADD(MICROSECOND, -? * 1000, UTC_TIMESTAMP(6)), ?,
        ?, ?)
ON DUPLICATE KEY UPDATE host = VALUES(host), pid = VALUES(pid),
    lease_ms = VALUES(lease_ms),
    version = VALUES(version), sink = VALUES(sink), in_flight = VALUES(in_flight),
    last_seen = VALUES(last_seen), last_claim_at = VALUES(last_claim_at),
    destinations = VALUES(destinations)
-- @relays_stale
SELECT relay_id, instance FROM {p}_relays
WHERE last_seen < TIMESTAMPADD(HOUR, -1, UTC_TIMESTAMP(6))
-- @relay_expire
DELETE FROM {p}_relays
WHERE relay_id = ? AND instance = ?
  AND last_seen < TIMESTAMPADD(HOUR, -1, UTC_TIMESTAMP(6))
-- @deregister
DELETE FROM {p}_relays WHERE relay_id = ? AND instance = ?
-- @relays
SELECT relay_id, host, pid, version, sink, in_flight, started_at, last_seen,
       CAST(TIMESTAMPDIFF(MICROSECOND, last_seen, UTC_TIMESTAMP(6)) AS SIGNED), last_claim_at,
       destinations, instance
FROM {p}_relays WHERE last_seen >= TIMESTAMPADD(MICROSECOND, -? * 1000, UTC_TIMESTAMP(6))
ORDER BY started_at, relay_id, instance

-- Views (views.rs)
-- @counts
SELECT CAST(COALESCE(SUM(status = 0), 0) AS SIGNED),
       CAST(COALESCE(SUM(status = 1), 0) AS SIGNED),
       CAST(COALESCE(SUM(status = 2), 0) AS SIGNED),
       CAST(COALESCE(SUM(status = 3), 0) AS SIGNED),
       CAST(TIMESTAMPDIFF(SECOND, MIN(CASE WHEN status = 0 THEN occurred_at END), UTC_TIMESTAMP(6)) AS SIGNED)
FROM {p}_messages

-- live_at is the lease end on claimed rows (and reads the live index).
-- @leases
SELECT CAST(COUNT(*) AS SIGNED), MAX(live_at),
       CAST(CEIL(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), MAX(live_at)) / 1000) AS SIGNED)
FROM {p}_messages WHERE live_at > UTC_TIMESTAMP(6) AND status = 1

-- Due rows: pending and due, or claimed with an ended lease (the live index).
-- @due
SELECT COUNT(*), CAST(TIMESTAMPDIFF(SECOND, MIN(live_at), UTC_TIMESTAMP(6)) AS SIGNED),
       CAST(COALESCE(SUM(status = 1), 0) AS SIGNED)
FROM {p}_messages WHERE live_at <= UTC_TIMESTAMP(6)

-- Each claim goes to the latest-started live instance of its relay id
-- whose start plus lease is not after the claim's lease end (none: an
-- earlier process's).
-- @claims_by
SELECT m.claimed_by,
       (SELECT r.instance FROM {p}_relays r
        WHERE r.relay_id = m.claimed_by
          AND r.last_seen >= TIMESTAMPADD(MICROSECOND, -{expiry} * 1000, UTC_TIMESTAMP(6))
          AND TIMESTAMPADD(MICROSECOND, r.lease_ms * 1000, r.started_at)
              <= m.available_at
        ORDER BY r.started_at DESC, r.instance LIMIT 1) AS inst,
       COUNT(*), CAST(COALESCE(SUM(m.available_at <= UTC_TIMESTAMP(6)), 0) AS SIGNED)
FROM {p}_messages m WHERE m.status = 1 GROUP BY 1, 2 ORDER BY 1, 2
-- @by_topic
SELECT topic, COUNT(*) FROM {p}_messages WHERE status = ?
GROUP BY topic ORDER BY COUNT(*) DESC, topic LIMIT ?

-- Rows parked behind a dead letter, by the live index.
-- @parked
SELECT COUNT(*) FROM {p}_messages WHERE live_at = '{parked}'

-- The oldest InnoDB transaction of another connection: its read view keeps purge
-- from removing the undo records (and delete-marked rows) of every later change.
-- `trx_started` and NOW() are both in the session's time zone.
-- @oldest_transaction
SELECT TIMESTAMPDIFF(SECOND, t.trx_started, NOW()),
       CAST(t.trx_mysql_thread_id AS SIGNED),
       CAST(p.USER AS CHAR), CAST(p.HOST AS CHAR), CAST(t.trx_state AS CHAR)
FROM information_schema.INNODB_TRX t
LEFT JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id
WHERE t.trx_mysql_thread_id <> CONNECTION_ID()
ORDER BY t.trx_started LIMIT 1

-- The history list length, where the server tells it (MariaDB's status variable;
-- MySQL's INNODB_METRICS counter).
-- @history_mariadb
SELECT CAST(VARIABLE_VALUE AS CHAR) FROM information_schema.GLOBAL_STATUS
WHERE VARIABLE_NAME = 'INNODB_HISTORY_LIST_LENGTH'
-- @history_mysql
SELECT CAST(`COUNT` AS SIGNED) FROM information_schema.INNODB_METRICS
WHERE NAME = 'trx_rseg_history_len'
-- @find_by_id
SELECT id, message_id, topic, `key`, CAST(status AS SIGNED) AS status, attempts,
       occurred_at, available_at, claimed_by, locked_until, dispatched_at,
       last_error, CAST(OCTET_LENGTH(payload) AS SIGNED) AS payload_bytes, replay_id
FROM {p}_messages WHERE message_id = ?
-- @find_by_topic_key
SELECT id, message_id, topic, `key`, CAST(status AS SIGNED) AS status, attempts,
       occurred_at, available_at, claimed_by, locked_until, dispatched_at,
       last_error, CAST(OCTET_LENGTH(payload) AS SIGNED) AS payload_bytes, replay_id
FROM {p}_messages WHERE topic = ? AND `key` = ?
ORDER BY id DESC LIMIT ?
-- @find_by_key
SELECT id, message_id, topic, `key`, CAST(status AS SIGNED) AS status, attempts,
       occurred_at, available_at, claimed_by, locked_until, dispatched_at,
       last_error, CAST(OCTET_LENGTH(payload) AS SIGNED) AS payload_bytes, replay_id
FROM {p}_messages WHERE `key` = ? ORDER BY id DESC LIMIT ?
-- @throughput
SELECT m, CAST(SUM(d) AS SIGNED), CAST(SUM(x) AS SIGNED) FROM (
  SELECT CAST(FLOOR(TIMESTAMPDIFF(MICROSECOND, dispatched_at, UTC_TIMESTAMP(6)) / 60000000) AS SIGNED) AS m,
         1 AS d, 0 AS x
  FROM {p}_messages
  WHERE status = 2 AND dispatched_at >= TIMESTAMPADD(MINUTE, -?, UTC_TIMESTAMP(6))
  UNION ALL
  SELECT CAST(FLOOR(TIMESTAMPDIFF(MICROSECOND, dead_at, UTC_TIMESTAMP(6)) / 60000000) AS SIGNED),
         0, 1
  FROM {p}_messages WHERE dead_at >= TIMESTAMPADD(MINUTE, -?, UTC_TIMESTAMP(6))
) t GROUP BY m

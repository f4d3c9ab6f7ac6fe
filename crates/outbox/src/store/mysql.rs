//! MySQL / MariaDB store: MariaDB ≥ 10.6 or MySQL ≥ 8.0.13 (`SKIP LOCKED`, expression
//! defaults, stored generated columns). Tested here on MariaDB 10.11.
//!
//! Tables are `{prefix}_messages`, `{prefix}_control`, `{prefix}_schema_migrations`,
//! `{prefix}_replays` (the audit of dead-row replays and discards), `{prefix}_relays` (the
//! relay registry), `{prefix}_topic_pauses` and `{prefix}_inbox` (the consumer inbox) in
//! the connected database, plus the procedures `{prefix}_enqueue(...)` and
//! `{prefix}_inbox_accept(...)`. Times are
//! `DATETIME(6)` in UTC, always from `UTC_TIMESTAMP(6)`, so neither the session time zone
//! nor the relay's clock matters.
//!
//! Locking: the relay's connections use `READ COMMITTED`, where InnoDB takes no gap locks
//! for searches, so claims, marks and purges never block a producer's insert. The claim is
//! one short transaction: `SELECT … FOR UPDATE SKIP LOCKED` over the live-row index, then
//! an `UPDATE` by primary key. InnoDB has no partial indexes: the stored generated column
//! `live_at` (= `available_at` while status ≤ 1, else NULL) and its index play the part of
//! PostgreSQL's partial index, so the claim range never reaches dispatched rows. Dead rows
//! are read by when they died the same way: `dead_at` (= `available_at` while status = 3,
//! else NULL) and its index; being NULL on every live row, it costs the claim path no
//! index writes.

use super::ops::{self, Dialect};
use super::seam::{Maintenance, Operations, Registry, Relaying, Views};
use super::{
    Claim, ClaimRequest, ClaimsBy, Counts, Dead, DeadLetter, DeadSelector, DueHeld, HeldKeys,
    KeyOrdering, Leases, Overview, PauseState, PurgeBatch, RelayHeartbeat, RelayRecord,
    ReplayAction, ReplayOutcome, ReplayRecord, ReplayRequest, Settled, Settlement, StoreConfig,
    TopicPause, millis, parse_headers,
};
use crate::error::{Error, Result};
use crate::inbox::Accepted;
use crate::message::{Enqueued, Message, OutgoingMessage};
use crate::sink::router::TopicPattern;
use async_trait::async_trait;
use chrono::{DateTime, NaiveDateTime, Utc};
use sqlx::mysql::{MySqlConnectOptions, MySqlDatabaseError, MySqlPool, MySqlPoolOptions, MySqlRow};
use sqlx::{AssertSqlSafe, Executor, MySql, Row, SqlSafeStr, SqlStr, Transaction};
use std::fmt::Write as _;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use uuid::Uuid;

/// Schema version this build creates and expects (2: `{prefix}_enqueue` validates headers
/// as `outbox.enqueue` does on PostgreSQL; 3: dead letters, replays, the relay registry and
/// topic pauses; 4: the consumer inbox, `{prefix}_inbox` and `{prefix}_inbox_accept`; 5:
/// topic pauses carry their regex, so the claim itself honours them; 6: `order_key` and its
/// index, for per-key ordering; 7: the relay registry keeps destinations; 8:
/// `{prefix}_inbox_accept` takes the id's inbox lock, as `MySqlStore::inbox_accept` does).
pub const SCHEMA_VERSION: i64 = 9;

const NOW: &str = "UTC_TIMESTAMP(6)";

/// [`super::PARKED_AT`] as a `DATETIME(6)` literal.
const PARKED: &str = "9999-01-01 00:00:00";

/// The wake-up probe's interval (one statement each: `MAX(id)` from the primary key and
/// `MIN(live_at)` from the live index, both single index reads): 5 ms right after a change,
/// growing by half each quiet probe up to 200 ms, and up to [`PROBE_IDLE`] once nothing
/// has changed for [`PROBE_QUIET`]. MySQL has no notification, so this bounds how soon a
/// commit wakes an idle relay: ≤ 200 ms in the first 10 s after a change, ≤ 1 s after.
const PROBE_MIN: Duration = Duration::from_millis(5);
const PROBE_MAX: Duration = Duration::from_millis(200);
/// The probe's interval after [`PROBE_QUIET`] without a change: the relay's default poll
/// interval, so a long-idle relay runs one statement per second to find new rows. A relay
/// polling more often lowers every cap to its poll interval (see [`Relaying::nothing_due`]),
/// so a commit waits no longer than with a claim per poll.
const PROBE_IDLE: Duration = Duration::from_secs(1);
const PROBE_QUIET: Duration = Duration::from_secs(10);

/// Most ids one replay or discard statement names (a replay runs as many as it needs, in
/// one transaction): a large selection never makes a statement over `max_allowed_packet`,
/// and the list stays under MariaDB's `in_predicate_conversion_threshold` (1000), past
/// which an `IN` list becomes a join that may scan, and lock, rows it does not name.
const REPLAY_CHUNK: usize = 500;

struct Sql {
    enqueue: SqlStr,
    existing_id: SqlStr,
    claim_select: SqlStr,
    pause_state: SqlStr,
    set_pause: SqlStr,
    counts: SqlStr,
    purge: SqlStr,
    probe: SqlStr,
    leases: SqlStr,
    inbox_accept: SqlStr,
    inbox_lock: SqlStr,
    inbox_unlock: SqlStr,
    inbox_purge: SqlStr,
    replay_insert: SqlStr,
    replay_count: SqlStr,
    replays: SqlStr,
    heartbeat: SqlStr,
    relays_stale: SqlStr,
    relay_expire: SqlStr,
    deregister: SqlStr,
    relays: SqlStr,
    pause_topic: SqlStr,
    resume_topic: SqlStr,
    due: SqlStr,
    claims_by: SqlStr,
    by_topic: SqlStr,
}

impl Sql {
    fn new(p: &str) -> Self {
        let q = |text: String| AssertSqlSafe(text).into_sql_str();
        let n = NOW;
        Sql {
            enqueue: q(format!(
                "INSERT INTO {p}_messages (message_id, topic, `key`, payload, headers, available_at)
                 VALUES (?, ?, ?, ?, ?, COALESCE(?, TIMESTAMPADD(MICROSECOND, ? * 1000, {n})))"
            )),
            existing_id: q(format!(
                "SELECT id FROM {p}_messages WHERE message_id = ? LOCK IN SHARE MODE"
            )),
            claim_select: q(claim_select(p, "")),
            // The switch and the topic pauses in one statement (one read view): a row per
            // pause, or one row of NULL pause columns when there is none.
            pause_state: q(format!(
                "SELECT c.paused, c.reason, c.changed_at, t.pattern, t.reason, t.paused_by, t.paused_at
                 FROM {p}_control c LEFT JOIN {p}_topic_pauses t ON 1 = 1
                 WHERE c.id = 1 ORDER BY t.pattern"
            )),
            set_pause: q(format!(
                "UPDATE {p}_control SET paused = ?, reason = ?, changed_at = {n} WHERE id = 1"
            )),
            counts: q(format!(
                "SELECT CAST(COALESCE(SUM(status = 0), 0) AS SIGNED),
                        CAST(COALESCE(SUM(status = 1), 0) AS SIGNED),
                        CAST(COALESCE(SUM(status = 2), 0) AS SIGNED),
                        CAST(COALESCE(SUM(status = 3), 0) AS SIGNED),
                        CAST(TIMESTAMPDIFF(SECOND, MIN(CASE WHEN status = 0 THEN occurred_at END), {n}) AS SIGNED)
                 FROM {p}_messages"
            )),
            purge: q(format!(
                "DELETE FROM {p}_messages
                 WHERE status = 2 AND dispatched_at < TIMESTAMPADD(MICROSECOND, -? * 1000, {n})
                 ORDER BY id LIMIT ?"
            )),
            // The newest id and how long until the first live row is claimable (µs; ≤ 0:
            // due now; NULL: no live row). Both aggregates are read off an index end
            // ("Select tables optimized away").
            probe: q(format!(
                "SELECT CAST(COALESCE(MAX(id), 0) AS SIGNED),
                        CAST(TIMESTAMPDIFF(MICROSECOND, {n}, MIN(live_at)) AS SIGNED)
                 FROM {p}_messages"
            )),
            // live_at is the lease end on claimed rows (and reads the live index).
            leases: q(format!(
                "SELECT CAST(COUNT(*) AS SIGNED), MAX(live_at),
                        CAST(CEIL(TIMESTAMPDIFF(MICROSECOND, {n}, MAX(live_at)) / 1000) AS SIGNED)
                 FROM {p}_messages WHERE live_at > {n} AND status = 1"
            )),
            // Insert first. INSERT IGNORE writes 0 rows on a duplicate key whatever the
            // connection's CLIENT_FOUND_ROWS (an ON DUPLICATE KEY UPDATE no-op counts 1 with
            // it, as sqlx connects); the consumer name is checked and the id formatted
            // before, so the duplicate key is the only error there is to ignore.
            inbox_accept: q(format!(
                "INSERT IGNORE INTO {p}_inbox (consumer, message_id) VALUES (?, ?)"
            )),
            inbox_lock: q(format!(
                "SELECT GET_LOCK({lock}, @@innodb_lock_wait_timeout),
                        CAST(@@innodb_lock_wait_timeout AS SIGNED)",
                lock = inbox_lock_name(p, "?", "?")
            )),
            inbox_unlock: q(format!(
                "DO RELEASE_LOCK({lock})",
                lock = inbox_lock_name(p, "?", "?")
            )),
            inbox_purge: q(format!(
                "DELETE FROM {p}_inbox
                 WHERE received_at < TIMESTAMPADD(MICROSECOND, -? * 1000, {n})
                 ORDER BY received_at LIMIT ?"
            )),
            replay_insert: q(format!(
                "INSERT INTO {p}_replays (requested_by, reason, action, selection) VALUES (?, ?, ?, ?)"
            )),
            replay_count: q(format!(
                "UPDATE {p}_replays SET `count` = `count` + ? WHERE id = ?"
            )),
            replays: q(format!(
                "SELECT id, at, requested_by, reason, action, selection, `count`
                 FROM {p}_replays ORDER BY id DESC LIMIT ?"
            )),
            // `started_at` only on the first write; VALUES() is understood by MySQL 8 and
            // MariaDB alike.
            heartbeat: q(format!(
                "INSERT INTO {p}_relays (relay_id, host, pid, version, sink, in_flight, started_at,
                                         last_seen, last_claim_at, destinations, instance,
                                         lease_ms)
                 VALUES (?, ?, ?, ?, ?, ?, {n}, {n}, TIMESTAMPADD(MICROSECOND, -? * 1000, {n}), ?,
                         ?, ?)
                 ON DUPLICATE KEY UPDATE host = VALUES(host), pid = VALUES(pid),
                     lease_ms = VALUES(lease_ms),
                     version = VALUES(version), sink = VALUES(sink), in_flight = VALUES(in_flight),
                     last_seen = VALUES(last_seen), last_claim_at = VALUES(last_claim_at),
                     destinations = VALUES(destinations)"
            )),
            relays_stale: q(format!(
                "SELECT relay_id, instance FROM {p}_relays
                 WHERE last_seen < TIMESTAMPADD(HOUR, -1, {n})"
            )),
            relay_expire: q(format!(
                "DELETE FROM {p}_relays
                 WHERE relay_id = ? AND instance = ?
                   AND last_seen < TIMESTAMPADD(HOUR, -1, {n})"
            )),
            deregister: q(format!(
                "DELETE FROM {p}_relays WHERE relay_id = ? AND instance = ?"
            )),
            relays: q(format!(
                "SELECT relay_id, host, pid, version, sink, in_flight, started_at, last_seen,
                        CAST(TIMESTAMPDIFF(MICROSECOND, last_seen, {n}) AS SIGNED), last_claim_at,
                        destinations, instance
                 FROM {p}_relays WHERE last_seen >= TIMESTAMPADD(MICROSECOND, -? * 1000, {n})
                 ORDER BY started_at, relay_id, instance"
            )),
            pause_topic: q(format!(
                "INSERT INTO {p}_topic_pauses (pattern, reason, paused_by, paused_at, regex)
                 VALUES (?, ?, ?, {n}, ?)
                 ON DUPLICATE KEY UPDATE reason = VALUES(reason), paused_by = VALUES(paused_by),
                     paused_at = VALUES(paused_at), regex = VALUES(regex)"
            )),
            resume_topic: q(format!("DELETE FROM {p}_topic_pauses WHERE pattern = ?")),
            // Due rows: pending and due, or claimed with an ended lease (the live index).
            due: q(format!(
                "SELECT COUNT(*), CAST(TIMESTAMPDIFF(SECOND, MIN(live_at), {n}) AS SIGNED),
                        CAST(COALESCE(SUM(status = 1), 0) AS SIGNED)
                 FROM {p}_messages WHERE live_at <= {n}"
            )),
            claims_by: q(format!(
                // Each claim goes to the latest-started live instance of its relay id
                // whose start plus lease is not after the claim's lease end (none: an
                // earlier process's).
                "SELECT m.claimed_by,
                        (SELECT r.instance FROM {p}_relays r
                         WHERE r.relay_id = m.claimed_by
                           AND r.last_seen >= TIMESTAMPADD(MICROSECOND, -{expiry} * 1000, {n})
                           AND TIMESTAMPADD(MICROSECOND, r.lease_ms * 1000, r.started_at)
                               <= m.available_at
                         ORDER BY r.started_at DESC, r.instance LIMIT 1) AS inst,
                        COUNT(*), CAST(COALESCE(SUM(m.available_at <= {n}), 0) AS SIGNED)
                 FROM {p}_messages m WHERE m.status = 1 GROUP BY 1, 2 ORDER BY 1, 2",
                expiry = super::RELAY_EXPIRY.as_millis()
            )),
            by_topic: q(format!(
                "SELECT topic, COUNT(*) FROM {p}_messages WHERE status = ?
                 GROUP BY topic ORDER BY COUNT(*) DESC, topic LIMIT ?"
            )),
        }
    }
}

/// Lower-case hex of `bytes` (an `order_key`, for an `X'…'` literal).
fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// `column REGEXP ? OR …` over `count` parameters (`FALSE` when `count` is 0).
fn regexp_any(column: &str, count: usize) -> String {
    if count == 0 {
        return "FALSE".to_owned();
    }
    vec![format!("{column} REGEXP ?"); count].join(" OR ")
}

/// The claim's select of due ids, with `extra` appended to the filter. It honours the
/// pause switch and the topic pauses itself: both tests are uncorrelated subqueries the
/// server evaluates once, and the topic regexes are matched row by row only when a topic
/// pause exists (`OR` stops at its left side); a pause whose regex is not filled in yet
/// holds every topic (fail closed) until `migrate` fills it. The subqueries are plain
/// reads: `FOR UPDATE` locks only the rows of the outer table (checked on MariaDB 10.11).
fn claim_select(p: &str, extra: &str) -> String {
    format!(
        "SELECT id FROM {p}_messages m
         WHERE live_at <= {NOW}{extra}
           AND NOT EXISTS (SELECT 1 FROM {p}_control c WHERE c.id = 1 AND c.paused)
           AND (NOT EXISTS (SELECT 1 FROM {p}_topic_pauses)
                OR NOT EXISTS (SELECT 1 FROM {p}_topic_pauses tp
                               WHERE tp.regex IS NULL OR m.topic REGEXP tp.regex))
         ORDER BY live_at, id
         LIMIT ?
         FOR UPDATE SKIP LOCKED"
    )
}

/// The ordered claim's first step (see `MySqlStore::claim_ordered_ids`): `ordered`
/// regexes bound twice (the `ord` column, then the head test), then `skip` regexes, then
/// the limit.
fn ordered_select(p: &str, ordered: usize, skip: usize, skip_dead: bool) -> String {
    let ord = regexp_any("m.topic", ordered);
    let dead_h = if skip_dead { " AND h.status <> 3" } else { "" };
    let skip: String = (0..skip).map(|_| " AND m.topic NOT REGEXP ?").collect();
    let head_ready = format!(
        " AND (m.order_key IS NULL OR NOT ({ord}) OR COALESCE(
              (SELECT h.status = 3 OR h.available_at > m.available_at
               FROM {p}_messages h FORCE INDEX ({p}_messages_key)
               WHERE h.order_key = m.order_key{dead_h} ORDER BY h.id LIMIT 1), 0) = 0){skip}"
    );
    claim_select(p, &head_ready).replacen(
        "SELECT id FROM",
        &format!(
            "SELECT id, CAST(order_key IS NOT NULL AND ({ord}) AS SIGNED) AS ord, order_key FROM"
        ),
        1,
    )
}

/// The ordered claim's fences: per key hash of `rows` (a derived table of `ok` values), its
/// first row not dispatched (nor dead, with `skip_dead`) outside the ids `list`.
fn fence_sql(p: &str, skip_dead: bool, list: &str, rows: &str) -> String {
    let dead_e = if skip_dead { " AND e.status <> 3" } else { "" };
    format!(
        "SELECT x.ok, (SELECT e.id FROM {p}_messages e FORCE INDEX ({p}_messages_key)
                       WHERE e.order_key = x.ok{dead_e} AND e.id NOT IN ({list})
                       ORDER BY e.id LIMIT 1) AS fence
         FROM ({rows}) x"
    )
}

/// A UUIDv7 built in SQL (RFC 9562 section 5.7): 48-bit Unix ms, version 7, variant 10,
/// the rest from MD5 of RAND() and UUID().
fn uuid_v7_sql() -> &'static str {
    "LOWER(CONCAT(
        SUBSTR(LPAD(HEX(FLOOR(UNIX_TIMESTAMP(NOW(6)) * 1000)), 12, '0'), 1, 8), '-',
        SUBSTR(LPAD(HEX(FLOOR(UNIX_TIMESTAMP(NOW(6)) * 1000)), 12, '0'), 9, 4), '-7',
        SUBSTR(@outbox_r := MD5(CONCAT(RAND(), UUID())), 1, 3), '-',
        HEX(8 | (CONV(SUBSTR(@outbox_r, 4, 1), 16, 10) & 3)), SUBSTR(@outbox_r, 5, 3), '-',
        SUBSTR(@outbox_r, 8, 12)))"
}

/// Each migration is a list of statements, run one by one (MySQL DDL commits implicitly).
fn migrations(p: &str) -> Vec<Vec<String>> {
    let n = NOW;
    let uuid = uuid_v7_sql();
    vec![vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {p}_messages (
                id            BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                message_id    CHAR(36) CHARACTER SET ascii NOT NULL,
                topic         VARCHAR(255) NOT NULL,
                `key`         VARCHAR(1024),
                payload       LONGBLOB NOT NULL,
                headers       LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL CHECK (JSON_VALID(headers)),
                occurred_at   DATETIME(6) NOT NULL DEFAULT ({n}),
                available_at  DATETIME(6) NOT NULL DEFAULT ({n}),
                status        TINYINT NOT NULL DEFAULT 0 CHECK (status BETWEEN 0 AND 3),
                attempts      INT NOT NULL DEFAULT 0,
                claimed_by    VARCHAR(255),
                claim_token   CHAR(36) CHARACTER SET ascii,
                locked_until  DATETIME(6),
                dispatched_at DATETIME(6),
                last_error    TEXT,
                live_at       DATETIME(6) GENERATED ALWAYS AS (CASE WHEN status <= 1 THEN available_at END) STORED,
                UNIQUE KEY {p}_messages_message_id (message_id),
                KEY {p}_messages_live (live_at, id),
                KEY {p}_messages_dispatched (status, dispatched_at)
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {p}_control (
                id                TINYINT NOT NULL PRIMARY KEY CHECK (id = 1),
                paused            BOOLEAN NOT NULL DEFAULT FALSE,
                reason            TEXT,
                changed_at        DATETIME(6) NOT NULL DEFAULT ({n}),
                max_message_bytes BIGINT NOT NULL DEFAULT 4194304
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4"
        ),
        format!("INSERT IGNORE INTO {p}_control (id) VALUES (1)"),
        format!("DROP PROCEDURE IF EXISTS {p}_enqueue"),
        format!(
            "CREATE PROCEDURE {p}_enqueue(
                IN p_topic VARCHAR(255), IN p_payload LONGBLOB, IN p_key VARCHAR(1024),
                IN p_message_id CHAR(36), IN p_headers LONGTEXT)
             BEGIN
                DECLARE v_headers LONGTEXT DEFAULT COALESCE(p_headers, '{{}}');
                DECLARE v_id CHAR(36) DEFAULT LOWER(p_message_id);
                DECLARE v_limit BIGINT;
                DECLARE v_size BIGINT;
                IF p_topic IS NULL OR p_topic = '' OR OCTET_LENGTH(p_topic) > 255
                   OR p_topic REGEXP '[[:space:][:cntrl:]*>]' THEN
                    SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_enqueue: topic must be 1-255 bytes without whitespace, control characters or wildcards (* >)';
                END IF;
                IF p_payload IS NULL THEN
                    SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_enqueue: payload must not be NULL (use an empty string)';
                END IF;
                IF JSON_VALID(v_headers) = 0 OR JSON_TYPE(v_headers) <> 'OBJECT' THEN
                    SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_enqueue: headers must be a JSON object of strings';
                END IF;
                IF JSON_CONTAINS_PATH(v_headers, 'one', '$.\"message-id\"', '$.topic', '$.key', '$.\"occurred-at\"') THEN
                    SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_enqueue: headers message-id, topic, key and occurred-at are reserved';
                END IF;
                IF v_id IS NULL THEN
                    SET v_id = {uuid};
                END IF;
                SELECT max_message_bytes INTO v_limit FROM {p}_control WHERE id = 1;
                SET v_size = OCTET_LENGTH(p_payload) + OCTET_LENGTH(p_topic)
                           + COALESCE(OCTET_LENGTH(p_key), 0) + OCTET_LENGTH(v_headers);
                IF v_size > v_limit THEN
                    SIGNAL SQLSTATE '22001' SET MESSAGE_TEXT = '{p}_enqueue: message too large for max_message_bytes';
                END IF;
                INSERT INTO {p}_messages (message_id, topic, `key`, payload, headers)
                VALUES (v_id, p_topic, p_key, p_payload, v_headers)
                ON DUPLICATE KEY UPDATE id = LAST_INSERT_ID(id);
                SELECT LAST_INSERT_ID() AS id;
             END"
        ),
    ], enqueue_v2(p), operations_v3(p), inbox_v4(p),
    // v5: a topic pause carries its pattern's regex (`TopicPattern::regex`), so the claim
    // matches topics against it; `migrate` fills it for pauses made before. Guarded, as
    // v3 is, so an interrupted run can be rerun.
    alter_unless_column(
        &format!("{p}_topic_pauses"),
        "regex",
        &format!("ALTER TABLE {p}_topic_pauses ADD COLUMN regex TEXT NULL"),
    ),
    // v6: per-key ordering. `order_key` is MD5(topic NUL key) while the row is keyed and
    // not dispatched, else NULL (no partial indexes, as `live_at`), so its index reads a
    // key's rows that are not dispatched, in id order, and never reaches the history.
    alter_unless_column(
        &format!("{p}_messages"),
        "order_key",
        &format!(
            "ALTER TABLE {p}_messages ADD COLUMN order_key BINARY(16) GENERATED ALWAYS AS
             (CASE WHEN status <> 2 AND `key` IS NOT NULL
                   THEN UNHEX(MD5(CONCAT(topic, CHAR(0), `key`))) END) STORED,
             ADD KEY {p}_messages_key (order_key, id)"
        ),
    ),
    // v7: the registry keeps each relay's destinations and their state (JSON).
    alter_unless_column(
        &format!("{p}_relays"),
        "destinations",
        &format!("ALTER TABLE {p}_relays ADD COLUMN destinations TEXT NULL"),
    ),
    // v8: the SQL entry point takes the id's inbox lock (`inbox_lock_name`).
    inbox_accept_v8(p),
    // v9: a registry row per relay instance (two relays under one id each keep theirs),
    // with the instance's lease (which claims are whose). Guarded, as v3 is.
    alter_unless_column(
        &format!("{p}_relays"),
        "instance",
        &format!(
            "ALTER TABLE {p}_relays ADD COLUMN instance VARCHAR(64) NOT NULL,
             ADD COLUMN lease_ms BIGINT NOT NULL DEFAULT 0,
             DROP PRIMARY KEY, ADD PRIMARY KEY (relay_id, instance)"
        ),
    )]
}

/// The name of the inbox lock of (`consumer`, `message_id`), SQL expressions (the
/// consumer as bytes, the id as lower-case text): `outbox_inbox:` and the MD5 of the
/// database, the table prefix, the consumer and the id, 45 characters (a lock name may
/// have 64). `MySqlStore::inbox_accept` and `{prefix}_inbox_accept` name it alike, so
/// accepts through either wait for each other.
///
/// Why a lock beside the row: when the first transaction to insert an id rolls back while
/// two others wait on its uncommitted row, InnoDB grants both waiters the lock they waited
/// for (shared for `INSERT IGNORE`, exclusive for `INSERT … ON DUPLICATE KEY UPDATE`; both
/// are kept on the gap once the row is gone) and then both insert, each waiting for the
/// other: a deadlock, and the victim's whole transaction is rolled back (MariaDB 10.11:
/// 25 of 30 such ids, either statement). Holding this lock across the insert lets one
/// accept at a time wait on an id's row, so there are never two waiters to deadlock. It
/// is a user-level lock (`GET_LOCK`), not part of the transaction: taken with the
/// session's `innodb_lock_wait_timeout` and released as soon as the insert returns,
/// whatever its outcome.
fn inbox_lock_name(p: &str, consumer: &str, message_id: &str) -> String {
    format!(
        "CONCAT('outbox_inbox:', MD5(CONCAT(DATABASE(), CHAR(0), '{p}', CHAR(0), {consumer}, CHAR(0), {message_id})))"
    )
}

/// Migration 8: `{p}_inbox_accept` as in migration 4, inserting under the id's inbox lock
/// ([`inbox_lock_name`]); an error in the insert releases the lock and is raised again.
fn inbox_accept_v8(p: &str) -> Vec<String> {
    let lock = inbox_lock_name(p, "CONVERT(p_consumer USING binary)", "LOWER(p_message_id)");
    vec![
        format!("DROP PROCEDURE IF EXISTS {p}_inbox_accept"),
        format!(
            "CREATE PROCEDURE {p}_inbox_accept(
                IN p_consumer TEXT CHARACTER SET utf8mb4, IN p_message_id VARCHAR(64) CHARACTER SET ascii)
             BEGIN
                DECLARE v_lock VARCHAR(64);
                DECLARE v_fresh BIGINT;
                IF p_consumer IS NULL OR OCTET_LENGTH(p_consumer) = 0 OR OCTET_LENGTH(p_consumer) > 255
                   OR p_consumer REGEXP '[[:cntrl:]]' THEN
                    SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_inbox_accept: consumer must be 1-255 bytes without control characters';
                END IF;
                IF p_message_id IS NULL OR NOT (p_message_id REGEXP '^[0-9A-Fa-f]{{8}}-[0-9A-Fa-f]{{4}}-[0-9A-Fa-f]{{4}}-[0-9A-Fa-f]{{4}}-[0-9A-Fa-f]{{12}}$') THEN
                    SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_inbox_accept: message_id must be a UUID (8-4-4-4-12 hex digits)';
                END IF;
                SET v_lock = {lock};
                IF COALESCE(GET_LOCK(v_lock, @@innodb_lock_wait_timeout), 0) <> 1 THEN
                    SIGNAL SQLSTATE 'HY000' SET MYSQL_ERRNO = 1205, MESSAGE_TEXT = '{p}_inbox_accept: lock wait timeout on the message id';
                END IF;
                BEGIN
                    DECLARE EXIT HANDLER FOR SQLEXCEPTION
                    BEGIN
                        DO RELEASE_LOCK(v_lock);
                        RESIGNAL;
                    END;
                    INSERT IGNORE INTO {p}_inbox (consumer, message_id)
                    VALUES (CONVERT(p_consumer USING binary), LOWER(p_message_id));
                    SET v_fresh = ROW_COUNT();
                END;
                DO RELEASE_LOCK(v_lock);
                SELECT v_fresh AS fresh;
             END"
        ),
    ]
}

/// Migration 4: the consumer inbox. `consumer` is `VARBINARY(255)`: compared as bytes, with
/// no trailing-space padding (`utf8mb4_bin` is `PAD SPACE` on MariaDB, where `'a'` and
/// `'a '` would collide), at most 255 bytes as everywhere else. `{p}_inbox_accept(consumer,
/// message_id)` is a procedure, not a function (a function that writes needs
/// `log_bin_trust_function_creators` or SUPER under binary logging); it returns one row,
/// column `fresh`: 1 the first time, 0 for a duplicate. Its checks `SIGNAL` SQLSTATE
/// `22023`, which rolls back that statement only, never the caller's transaction.
fn inbox_v4(p: &str) -> Vec<String> {
    let n = NOW;
    vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {p}_inbox (
                consumer    VARBINARY(255) NOT NULL,
                message_id  CHAR(36) CHARACTER SET ascii NOT NULL,
                received_at DATETIME(6) NOT NULL DEFAULT ({n}),
                PRIMARY KEY (consumer, message_id),
                KEY {p}_inbox_received (received_at)
            ) ENGINE = InnoDB"
        ),
        format!("DROP PROCEDURE IF EXISTS {p}_inbox_accept"),
        format!(
            "CREATE PROCEDURE {p}_inbox_accept(
                IN p_consumer TEXT CHARACTER SET utf8mb4, IN p_message_id VARCHAR(64) CHARACTER SET ascii)
             BEGIN
                IF p_consumer IS NULL OR OCTET_LENGTH(p_consumer) = 0 OR OCTET_LENGTH(p_consumer) > 255
                   OR p_consumer REGEXP '[[:cntrl:]]' THEN
                    SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_inbox_accept: consumer must be 1-255 bytes without control characters';
                END IF;
                IF p_message_id IS NULL OR NOT (p_message_id REGEXP '^[0-9A-Fa-f]{{8}}-[0-9A-Fa-f]{{4}}-[0-9A-Fa-f]{{4}}-[0-9A-Fa-f]{{4}}-[0-9A-Fa-f]{{12}}$') THEN
                    SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_inbox_accept: message_id must be a UUID (8-4-4-4-12 hex digits)';
                END IF;
                INSERT IGNORE INTO {p}_inbox (consumer, message_id)
                VALUES (CONVERT(p_consumer USING binary), LOWER(p_message_id));
                SELECT ROW_COUNT() AS fresh;
             END"
        ),
    ]
}

/// Migration 3: the operations tables (the audit of replays and discards, the relay
/// registry, topic pauses), `replay_id` on messages, and the dead-row index: the stored
/// generated column `dead_at` (`available_at`, the time of death, while status = 3, else
/// NULL) and an index on it. The `ALTER TABLE` runs only while `replay_id` is missing, so
/// a migration interrupted after it can run again. Adding a stored column rebuilds the
/// table: writes wait until it is done (as they wait for the index build on PostgreSQL).
fn operations_v3(p: &str) -> Vec<String> {
    let n = NOW;
    vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {p}_replays (
                id           BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                at           DATETIME(6) NOT NULL DEFAULT ({n}),
                requested_by TEXT NOT NULL,
                reason       TEXT NOT NULL,
                action       VARCHAR(16) NOT NULL,
                selection    TEXT NOT NULL,
                `count`      BIGINT NOT NULL DEFAULT 0
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {p}_relays (
                relay_id      VARCHAR(255) NOT NULL PRIMARY KEY,
                host          TEXT NOT NULL,
                pid           BIGINT NOT NULL,
                version       TEXT NOT NULL,
                sink          TEXT NOT NULL,
                in_flight     BIGINT NOT NULL DEFAULT 0,
                started_at    DATETIME(6) NOT NULL DEFAULT ({n}),
                last_seen     DATETIME(6) NOT NULL DEFAULT ({n}),
                last_claim_at DATETIME(6)
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {p}_topic_pauses (
                pattern   VARCHAR(255) NOT NULL PRIMARY KEY,
                reason    TEXT NOT NULL,
                paused_by TEXT NOT NULL,
                paused_at DATETIME(6) NOT NULL DEFAULT ({n})
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
        ),
    ]
    .into_iter()
    .chain(alter_unless_column(
        &format!("{p}_messages"),
        "replay_id",
        &format!(
            "ALTER TABLE {p}_messages
                               ADD COLUMN replay_id BIGINT NULL,
                               ADD COLUMN dead_at DATETIME(6) GENERATED ALWAYS AS
                                   (CASE WHEN status = 3 THEN available_at END) STORED,
                               ADD KEY {p}_messages_dead (dead_at, id)"
        ),
    ))
    .collect()
}

/// Statements that run `alter` only while `table` has no column `column` (MySQL has no
/// `ADD COLUMN IF NOT EXISTS`), so a migration interrupted after it can run again.
/// `alter` is our own DDL, without single quotes.
fn alter_unless_column(table: &str, column: &str, alter: &str) -> Vec<String> {
    vec![
        format!(
            "SET @outbox_ddl = (
                SELECT IF(COUNT(*) = 0, '{alter}', 'DO 0')
                FROM information_schema.columns
                WHERE table_schema = DATABASE() AND table_name = '{table}'
                  AND column_name = '{column}')"
        ),
        "PREPARE outbox_ddl FROM @outbox_ddl".to_owned(),
        "EXECUTE outbox_ddl".to_owned(),
        "DEALLOCATE PREPARE outbox_ddl".to_owned(),
    ]
}

/// Migration 2: `{p}_enqueue` refuses what PostgreSQL's `outbox.enqueue` refuses, in the
/// producer's transaction, with the same SQLSTATEs: headers that are not a JSON object of
/// strings (a null or number value included), header names that are not 1-255 byte HTTP
/// tokens (compared as bytes, so no case folding lets a non-ASCII letter through), the
/// reserved names (exact, case-sensitive), all `22023`; a message over the limit `54000`,
/// its size counted as everywhere else (payload + topic + key + header names and values).
/// The header values are read as the `$.*` array, so no header name is ever spliced into
/// a JSON path.
fn enqueue_v2(p: &str) -> Vec<String> {
    let uuid = uuid_v7_sql();
    vec![
        format!("DROP PROCEDURE IF EXISTS {p}_enqueue"),
        format!(
            "CREATE PROCEDURE {p}_enqueue(
                IN p_topic VARCHAR(255), IN p_payload LONGBLOB, IN p_key VARCHAR(1024),
                IN p_message_id CHAR(36), IN p_headers LONGTEXT)
             BEGIN
                DECLARE v_headers LONGTEXT CHARACTER SET utf8mb4 DEFAULT COALESCE(p_headers, '{{}}');
                DECLARE v_id CHAR(36) DEFAULT LOWER(p_message_id);
                DECLARE v_limit BIGINT;
                DECLARE v_size BIGINT;
                DECLARE v_names LONGTEXT CHARACTER SET utf8mb4;
                DECLARE v_values LONGTEXT CHARACTER SET utf8mb4;
                DECLARE v_name LONGTEXT CHARACTER SET utf8mb4;
                DECLARE v_value LONGTEXT CHARACTER SET utf8mb4;
                DECLARE v_header_bytes BIGINT DEFAULT 0;
                DECLARE v_i BIGINT DEFAULT 0;
                DECLARE v_msg VARCHAR(128) CHARACTER SET utf8mb4;
                IF p_topic IS NULL OR p_topic = '' OR OCTET_LENGTH(p_topic) > 255
                   OR p_topic REGEXP '[[:space:][:cntrl:]*>]' THEN
                    SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_enqueue: topic must be 1-255 bytes without whitespace, control characters or wildcards (* >)';
                END IF;
                IF p_payload IS NULL THEN
                    SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_enqueue: payload must not be NULL (use an empty string)';
                END IF;
                IF JSON_VALID(v_headers) = 0 OR JSON_TYPE(v_headers) <> 'OBJECT' THEN
                    SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = '{p}_enqueue: headers must be a JSON object of strings';
                END IF;
                SET v_values = COALESCE(JSON_EXTRACT(v_headers, '$.*'), '[]');
                WHILE v_i < JSON_LENGTH(v_values) DO
                    SET v_value = JSON_EXTRACT(v_values, CONCAT('$[', v_i, ']'));
                    IF JSON_TYPE(v_value) <> 'STRING' THEN
                        SET v_msg = LEFT(CONCAT('{p}_enqueue: headers must be a JSON object of strings (a value is a JSON ', LOWER(JSON_TYPE(v_value)), ')'), 128);
                        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = v_msg;
                    END IF;
                    SET v_header_bytes = v_header_bytes + OCTET_LENGTH(JSON_UNQUOTE(v_value));
                    SET v_i = v_i + 1;
                END WHILE;
                SET v_names = JSON_KEYS(v_headers);
                SET v_i = 0;
                WHILE v_i < JSON_LENGTH(v_names) DO
                    SET v_name = JSON_UNQUOTE(JSON_EXTRACT(v_names, CONCAT('$[', v_i, ']')));
                    IF NOT (CAST(v_name AS BINARY) REGEXP '^[A-Za-z0-9!#$%&''*+.^_`|~-]{{1,255}}$') THEN
                        SET v_msg = LEFT(CONCAT('{p}_enqueue: header name ', QUOTE(LEFT(v_name, 40)), ' is not 1-255 characters of A-Z a-z 0-9 !#$%&''*+-.^_`|~'), 128);
                        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = v_msg;
                    END IF;
                    IF CAST(v_name AS BINARY) IN ('message-id', 'topic', 'key', 'occurred-at') THEN
                        SET v_msg = LEFT(CONCAT('{p}_enqueue: header ', v_name, ' is reserved (message-id, topic, key and occurred-at come from the message)'), 128);
                        SIGNAL SQLSTATE '22023' SET MESSAGE_TEXT = v_msg;
                    END IF;
                    SET v_header_bytes = v_header_bytes + OCTET_LENGTH(v_name);
                    SET v_i = v_i + 1;
                END WHILE;
                IF v_id IS NULL THEN
                    SET v_id = {uuid};
                END IF;
                SELECT max_message_bytes INTO v_limit FROM {p}_control WHERE id = 1;
                SET v_size = OCTET_LENGTH(p_payload) + OCTET_LENGTH(p_topic)
                           + COALESCE(OCTET_LENGTH(p_key), 0) + v_header_bytes;
                IF v_size > v_limit THEN
                    SET v_msg = LEFT(CONCAT('{p}_enqueue: message too large: ', v_size, ' bytes exceed the limit of ', v_limit, ' bytes'), 128);
                    SIGNAL SQLSTATE '54000' SET MESSAGE_TEXT = v_msg;
                END IF;
                INSERT INTO {p}_messages (message_id, topic, `key`, payload, headers)
                VALUES (v_id, p_topic, p_key, p_payload, v_headers)
                ON DUPLICATE KEY UPDATE id = LAST_INSERT_ID(id);
                SELECT LAST_INSERT_ID() AS id;
             END"
        ),
    ]
}

struct Inner {
    pool: MySqlPool,
    config: StoreConfig,
    sql: Sql,
    max_packet: usize,
    wakeup: super::Wakeup,
    quiet: Arc<Quiet>,
}

/// What the wake-up probe last saw, for [`Relaying::nothing_due`].
struct Quiet {
    /// Writes through this store that can make rows due (settle, replay, give-back),
    /// counted as each ends: a probe that began before one ended may not have seen it.
    writes: std::sync::atomic::AtomicU64,
    /// `writes` when the last successful probe began, and the instant before which it
    /// found no row claimable.
    seen: std::sync::Mutex<Option<(u64, std::time::Instant)>>,
    /// The shortest poll interval a relay skipping claims on the probe's word asked with
    /// (ms; `u64::MAX` until one asks): the probe never waits longer than that.
    poll_ms: std::sync::atomic::AtomicU64,
}

impl Default for Quiet {
    fn default() -> Self {
        Quiet {
            writes: Default::default(),
            seen: Default::default(),
            poll_ms: std::sync::atomic::AtomicU64::new(u64::MAX),
        }
    }
}

impl Quiet {
    fn seen(&self) -> std::sync::MutexGuard<'_, Option<(u64, std::time::Instant)>> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// See [`Relaying::nothing_due`]; `poll_interval` caps the probe's quiet interval.
    fn nothing_due(&self, poll_interval: Duration) -> bool {
        let ms = u64::try_from(poll_interval.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        self.poll_ms
            .fetch_min(ms, std::sync::atomic::Ordering::Relaxed);
        let writes = self.writes.load(std::sync::atomic::Ordering::SeqCst);
        self.seen()
            .is_some_and(|(w, until)| w == writes && std::time::Instant::now() < until)
    }

    /// Counts a write when the returned guard drops (declare it first, so it drops after
    /// the write's transaction).
    fn writing(&self) -> WriteEnd<'_> {
        WriteEnd(self)
    }
}

/// Until when a probe that began at `at` and found the first live row `next_us` µs away
/// (≤ 0: due now; `None`: no live row) says nothing is claimable: measured from the
/// probe's start, so never later than the database's view, and never more than
/// [`QUIET_VALID`] past it, so an answer from a probe that hangs (a connection that went
/// silent) lapses and the relay claims on its poll again.
fn quiet_until(at: std::time::Instant, next_us: Option<i64>) -> Option<std::time::Instant> {
    match next_us {
        None => Some(at + QUIET_VALID),
        Some(us) if us > 0 => Some(at + Duration::from_micros(us.unsigned_abs()).min(QUIET_VALID)),
        Some(_) => None,
    }
}

/// How long one probe's "nothing claimable" holds: twice its longest interval.
const QUIET_VALID: Duration = Duration::from_secs(2);

struct WriteEnd<'a>(&'a Quiet);

impl Drop for WriteEnd<'_> {
    fn drop(&mut self) {
        self.0
            .writes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The MySQL / MariaDB store. Cheap to clone.
#[derive(Clone)]
pub struct MySqlStore {
    inner: Arc<Inner>,
}

/// The MySQL error number of `e`, if it is a server error.
pub(crate) fn error_number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(|m| m.number()),
        _ => None,
    }
}

/// MySQL/MariaDB error numbers
/// (<https://dev.mysql.com/doc/mysql-errors/8.0/en/server-error-reference.html>,
/// <https://mariadb.com/kb/en/mariadb-error-code-reference/>): 1205 lock wait timeout and
/// 1213 deadlock are a lost conflict; 1040 too many connections, 1053 server shutdown, 1317
/// query interrupted and 1927 connection killed (MariaDB) are the server being unavailable.
pub(crate) fn classify(number: u16) -> super::Failure {
    match number {
        1205 | 1213 => super::Failure::Conflict,
        1040 | 1053 | 1317 | 1927 => super::Failure::Unavailable,
        _ => super::Failure::Other,
    }
}

/// How many times a statement chosen as an InnoDB deadlock victim is run again before the
/// error is returned (the relay then retries on its own backoff).
const DEADLOCK_ATTEMPTS: u32 = 4;

/// Runs `op` again when InnoDB chose it as a deadlock victim (error 1213). InnoDB rolls the
/// victim's whole transaction back, so a claim, a settle or a purge batch can simply be
/// rerun: MySQL's manual ("How to Minimize and Handle Deadlocks") asks applications to be
/// ready to do so, since even `READ COMMITTED` and single-statement transactions deadlock
/// when their record locks meet in different orders (a claim's `UPDATE` of pending rows,
/// a settle moving rows into the dispatched range, a purge deleting from it).
async fn retry_deadlock<T, F>(mut op: impl FnMut() -> F) -> Result<T>
where
    F: std::future::Future<Output = Result<T>>,
{
    let mut attempt = 1;
    loop {
        match op().await {
            Err(Error::Database(e))
                if attempt < DEADLOCK_ATTEMPTS && error_number(&e) == Some(1213) =>
            {
                // A short, growing, jittered pause so the two victims do not meet again.
                let ms = u64::from(attempt) * 2 + u64::from(rand::random::<u8>() % 5);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                attempt += 1;
            }
            other => return other,
        }
    }
}

impl MySqlStore {
    /// Connects a pool of its own to `url` (`mysql://user:pass@host:port/database`). Its
    /// connections use `READ COMMITTED` and the UTC session time zone.
    ///
    /// TLS follows the URL (sqlx's parameters): `ssl-mode=DISABLED`, `PREFERRED` (the
    /// default: TLS when the server offers it, its certificate not checked), `REQUIRED`
    /// (TLS, not checked), `VERIFY_CA` (the chain) or `VERIFY_IDENTITY` (the chain and the
    /// host name); `ssl-ca=PATH` adds CAs to the system's roots; `ssl-cert=PATH&ssl-key=PATH`
    /// is a client certificate.
    ///
    /// # Errors
    /// Database errors when the connection fails.
    pub async fn connect(url: &str, config: StoreConfig) -> Result<Self> {
        super::install_tls_provider();
        let options = MySqlConnectOptions::from_str(url)?.timezone(Some("+00:00".to_owned()));
        // One direct connection first: an unreachable server or a bad password is
        // reported as itself at once, not as a pool timeout later; bounded by
        // ACQUIRE_TIMEOUT (a server that accepts TCP and never answers fails it).
        let conn = super::bounded_connect(<MySqlConnectOptions as sqlx::ConnectOptions>::connect(
            &options,
        ))
        .await?;
        sqlx::Connection::close(conn).await?;
        // The pool's acquire_timeout bounds the wait for a connection, opening one included.
        let pool = super::ping_when_idle(MySqlPoolOptions::new())
            .max_connections(8)
            .acquire_timeout(super::ACQUIRE_TIMEOUT)
            .after_connect(|conn, _meta| {
                Box::pin(async move {
                    conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                        .await?;
                    Ok(())
                })
            })
            .connect_with(options)
            .await?;
        Self::from_pool(pool, config).await
    }

    /// Uses an existing pool. Give its connections `READ COMMITTED` (see
    /// [`MySqlStore::connect`]) if the relay uses it, or claims may take gap locks.
    ///
    /// # Errors
    /// Database errors reading `max_allowed_packet`.
    pub async fn from_pool(pool: MySqlPool, config: StoreConfig) -> Result<Self> {
        let max_packet: i64 = sqlx::query_scalar("SELECT CAST(@@max_allowed_packet AS SIGNED)")
            .fetch_one(&pool)
            .await?;
        let sql = Sql::new(config.schema.as_str());
        Ok(MySqlStore {
            inner: Arc::new(Inner {
                pool,
                config,
                sql,
                max_packet: usize::try_from(max_packet).unwrap_or(usize::MAX),
                wakeup: super::Wakeup::new(),
                quiet: Arc::default(),
            }),
        })
    }

    /// The pool this store uses.
    pub fn pool(&self) -> &MySqlPool {
        &self.inner.pool
    }

    /// The store's settings.
    pub fn config(&self) -> &StoreConfig {
        &self.inner.config
    }

    /// Accepts the message (an [`Envelope`](crate::Envelope) or its id) for `consumer` inside the consumer's transaction (see
    /// [`crate::inbox`]): inserts the inbox row first, under the primary key
    /// `(consumer, message_id)`, with `INSERT IGNORE`, holding the id's inbox lock (a
    /// `GET_LOCK` user lock, released when the insert returns) so that one accept at a
    /// time waits on the id's row: when the first transaction to accept an id rolls back,
    /// the next one is fresh and the others duplicates, never a deadlock. [`Accepted::Fresh`] means do the
    /// work in this transaction; [`Accepted::Duplicate`] means it was done (or a concurrent
    /// transaction holding the same id committed while this one waited on the key): skip
    /// it. No error on a duplicate, so the transaction stays usable; a rollback removes
    /// the row with the rest. Works at `READ COMMITTED` and at the server's default
    /// `REPEATABLE READ` alike (the duplicate check reads the latest committed row).
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] for a consumer name that is empty, over 255 bytes or
    /// holds a control character, before any SQL runs; [`Error::Database`] from the insert
    /// (a lock wait timeout when the concurrent transaction holding the id stays open past
    /// `innodb_lock_wait_timeout`); [`Error::Timeout`] when the id's inbox lock was not
    /// free within `innodb_lock_wait_timeout` (accepts of the id queued behind a
    /// transaction that stays open).
    pub async fn inbox_accept(
        &self,
        tx: &mut Transaction<'_, MySql>,
        consumer: &str,
        message: impl crate::inbox::Incoming,
    ) -> Result<Accepted> {
        let message_id = message.message_id();
        crate::inbox::validate_consumer(consumer)?;
        let id = message_id.hyphenated().to_string();
        let (locked, wait_s): (Option<i64>, i64) =
            sqlx::query_as(self.inner.sql.inbox_lock.clone())
                .bind(consumer.as_bytes())
                .bind(&id)
                .fetch_one(&mut **tx)
                .await?;
        if locked != Some(1) {
            return Err(Error::Timeout(Duration::from_secs(
                u64::try_from(wait_s).unwrap_or(0),
            )));
        }
        let r = sqlx::query(self.inner.sql.inbox_accept.clone())
            .bind(consumer.as_bytes())
            .bind(&id)
            .execute(&mut **tx)
            .await;
        let unlocked = sqlx::query(self.inner.sql.inbox_unlock.clone())
            .bind(consumer.as_bytes())
            .bind(&id)
            .execute(&mut **tx)
            .await;
        let r = r?;
        unlocked?;
        Ok(Accepted::from_rows(r.rows_affected()))
    }

    /// Enqueues `msg` inside the caller's transaction. Idempotent on the message id: a
    /// duplicate returns the existing row's id with `inserted: false`; the duplicate-key
    /// error is the only one absorbed (unlike `INSERT IGNORE`), and InnoDB rolls back only
    /// that statement, so the transaction stays usable.
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] / [`Error::MessageTooLarge`] before any SQL runs (the
    /// limit is the smaller of `max_message_bytes` and the server's `max_allowed_packet`
    /// less 64 KiB for the statement around the payload); [`Error::Database`] otherwise.
    pub async fn enqueue(
        &self,
        tx: &mut Transaction<'_, MySql>,
        msg: &Message,
    ) -> Result<Enqueued> {
        let limit = self
            .inner
            .config
            .max_message_bytes
            .min(self.inner.max_packet.saturating_sub(64 * 1024));
        msg.validate(limit)?;
        let mid = msg.message_id.hyphenated().to_string();
        let inserted = sqlx::query(self.inner.sql.enqueue.clone())
            .bind(&mid)
            .bind(&msg.topic)
            .bind(msg.key.as_deref())
            .bind(msg.payload.as_ref())
            .bind(msg.headers_json().to_string())
            .bind(msg.available_at.map(|t| t.naive_utc()))
            .bind(msg.delay_ms())
            .execute(&mut **tx)
            .await;
        match inserted {
            Ok(r) => Ok(Enqueued {
                id: i64::try_from(r.last_insert_id()).unwrap_or(i64::MAX),
                message_id: msg.message_id,
                inserted: true,
            }),
            // The only unique key an insert can hit is `message_id` (the primary key is
            // AUTO_INCREMENT): a duplicate is the idempotent case.
            Err(sqlx::Error::Database(db)) if db.is_unique_violation() => {
                let id: i64 = sqlx::query_scalar(self.inner.sql.existing_id.clone())
                    .bind(&mid)
                    .fetch_one(&mut **tx)
                    .await?;
                Ok(Enqueued {
                    id,
                    message_id: msg.message_id,
                    inserted: false,
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The limit `{prefix}_enqueue(...)` enforces (written by [`Maintenance::migrate`] from
    /// [`StoreConfig::max_message_bytes`]), in bytes; `None` before the first migration.
    ///
    /// # Errors
    /// Database errors other than a missing table.
    pub async fn sql_enqueue_limit(&self) -> Result<Option<usize>> {
        let p = &self.inner.config.schema;
        let r: std::result::Result<i64, sqlx::Error> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT max_message_bytes FROM {p}_control WHERE id = 1"
        )))
        .fetch_one(&self.inner.pool)
        .await;
        match r {
            Ok(n) => Ok(usize::try_from(n).ok()),
            Err(e) if error_number(&e) == Some(1146) => Ok(None), // no such table
            Err(e) => Err(e.into()),
        }
    }

    fn row_to_message(row: &MySqlRow) -> std::result::Result<OutgoingMessage, Dead> {
        let id: i64 = row.try_get("id").map_err(|e| Dead {
            id: -1,
            error: e.to_string(),
        })?;
        let read = || -> Result<OutgoingMessage> {
            let message_id = super::text_message_id(id, &row.try_get::<String, _>("message_id")?)?;
            let headers: String = row.try_get("headers")?;
            let headers: serde_json::Value =
                serde_json::from_str(&headers).map_err(|e| Error::MalformedRow {
                    id,
                    reason: format!("headers are not JSON: {e}"),
                })?;
            let occurred: NaiveDateTime = row.try_get("occurred_at")?;
            Ok(OutgoingMessage {
                id,
                message_id,
                topic: row.try_get("topic")?,
                key: row.try_get("key")?,
                payload: bytes::Bytes::from(row.try_get::<Vec<u8>, _>("payload")?),
                headers: parse_headers(id, headers)?,
                occurred_at: occurred.and_utc(),
                attempts: row.try_get("attempts")?,
            })
        };
        read().map_err(|e| Dead {
            id,
            error: super::malformed_reason(e),
        })
    }

    /// The wake-up probe (see [`PROBE_MIN`]). It moves the counter when the newest id
    /// changes (a commit of new rows) and when rows become due after a probe that found
    /// none (a retry's backoff or a lease ran out, a replay, a release), and records in
    /// `quiet` until when nothing is claimable, so an idle relay's poll costs no claim.
    fn start_watcher(&self) {
        let pool = self.inner.pool.clone();
        let sql = self.inner.sql.probe.clone();
        let quiet = self.inner.quiet.clone();
        self.inner.wakeup.start_once(|wake| async move {
            let mut last: Option<i64> = None;
            let mut was_due = false;
            let mut interval = PROBE_MIN;
            let mut changed = std::time::Instant::now();
            loop {
                tokio::time::sleep(interval).await;
                let writes = quiet.writes.load(std::sync::atomic::Ordering::SeqCst);
                let at = std::time::Instant::now();
                let seen = sqlx::query_as::<_, (i64, Option<i64>)>(sql.clone())
                    .fetch_one(&pool)
                    .await;
                let Ok((max, next_us)) = seen else {
                    *quiet.seen() = None;
                    interval = Duration::from_secs(1);
                    continue;
                };
                let due = next_us.is_some_and(|us| us <= 0);
                *quiet.seen() = quiet_until(at, next_us).map(|u| (writes, u));
                let new_rows = last.is_some_and(|l| l != max);
                if new_rows || (due && !was_due) {
                    if last.is_some() {
                        wake.bump();
                    }
                    changed = at;
                    interval = PROBE_MIN;
                } else if last.is_none() {
                    interval = PROBE_MIN;
                } else {
                    let poll = Duration::from_millis(
                        quiet.poll_ms.load(std::sync::atomic::Ordering::Relaxed),
                    );
                    let cap = if changed.elapsed() < PROBE_QUIET {
                        PROBE_MAX
                    } else {
                        PROBE_IDLE
                    }
                    .min(poll);
                    interval = (interval * 3 / 2).min(cap);
                }
                last = Some(max);
                was_due = due;
            }
        });
    }

    /// `id IN (…)` for ids from the store itself (integers, formatted, never user text).
    fn id_list(ids: &[i64]) -> String {
        let mut s = String::with_capacity(ids.len() * 8);
        for (i, id) in ids.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            let _ = write!(s, "{id}");
        }
        s
    }

    /// `CONVERT(X'…' USING utf8mb4)`: any text as a SQL literal, whatever the `sql_mode`
    /// (hex digits only, nothing to escape).
    fn text_literal(text: &str) -> String {
        let mut s = String::with_capacity(text.len() * 2 + 28);
        s.push_str("CONVERT(X'");
        for b in text.as_bytes() {
            let _ = write!(s, "{b:02x}");
        }
        s.push_str("' USING utf8mb4)");
        s
    }
}

// Statements whose text varies per call (id lists: settle, renew) go by the text
// protocol with their values inlined (integers, a UUID we formatted,
// `MySqlStore::text_literal`): a one-off prepared statement ends with `COM_STMT_CLOSE`,
// which the server never answers, so the connection's next command waited for the
// server's delayed ACK (Nagle; sqlx sets no `TCP_NODELAY`): 40 ms per statement, ~90 ms
// per claim.
impl MySqlStore {
    /// One claim transaction (see [`Relaying::claim`]); [`retry_deadlock`] reruns it.
    async fn claim_once(&self, req: &ClaimRequest) -> Result<Claim> {
        let token = Uuid::now_v7();
        let p = &self.inner.config.schema;
        let mut tx = self.inner.pool.begin().await?;
        let ids: Vec<i64> = if req.ordering.is_on() {
            self.claim_ordered_ids(&mut tx, req).await?
        } else if req.skip_topics.is_empty() {
            sqlx::query_scalar(self.inner.sql.claim_select.clone())
                .bind(i64::from(req.batch_size))
                .fetch_all(&mut *tx)
                .await?
        } else {
            // Topic pauses: the same range of the live index, passing over rows whose topic
            // matches a paused pattern (the patterns' regexes bound, one per pattern).
            let skip: String = req
                .skip_topics
                .iter()
                .map(|_| " AND topic NOT REGEXP ?")
                .collect();
            let mut query = sqlx::query_scalar(AssertSqlSafe(claim_select(p.as_str(), &skip)));
            for t in &req.skip_topics {
                query = query.bind(t.regex());
            }
            query
                .bind(i64::from(req.batch_size))
                .fetch_all(&mut *tx)
                .await?
        };
        if ids.is_empty() {
            tx.commit().await?;
            return Ok(Claim {
                token,
                messages: Vec::new(),
                malformed: Vec::new(),
                db_now: None,
            });
        }
        // Text protocol with inlined values: see `update_ids`.
        let list = Self::id_list(&ids);
        let relay = Self::text_literal(&req.relay_id);
        let token_text = token.hyphenated();
        let lease = millis(req.lease);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "UPDATE {p}_messages
             SET status = 1, attempts = LEAST(attempts, 2147483646) + 1, claimed_by = {relay},
                 claim_token = '{token_text}',
                 locked_until = TIMESTAMPADD(MICROSECOND, {lease} * 1000, {NOW}),
                 available_at = TIMESTAMPADD(MICROSECOND, {lease} * 1000, {NOW})
             WHERE id IN ({list})"
        )))
        .execute(&mut *tx)
        .await?;
        let rows = sqlx::raw_sql(AssertSqlSafe(format!(
            "SELECT id, message_id, topic, `key`, payload, headers, occurred_at, attempts,
                    {NOW} AS db_now
             FROM {p}_messages WHERE id IN ({list}) ORDER BY id"
        )))
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        let mut claim = super::claim_from_rows(token, &rows, Self::row_to_message, |r| {
            r.try_get::<i64, _>("id").unwrap_or(-1)
        });
        claim.db_now = rows
            .first()
            .and_then(|r| r.try_get::<NaiveDateTime, _>("db_now").ok())
            .map(|t| t.and_utc());
        Ok(claim)
    }

    /// The plans MySQL/MariaDB chooses for the ordered claim's two reads of `req` (the
    /// candidates, then the fences), one line per `EXPLAIN` row as `table key`: which
    /// indexes an ordered claim reads, for tests and for operators.
    ///
    /// # Errors
    /// Database errors.
    pub async fn explain_ordered_claim(&self, req: &ClaimRequest) -> Result<String> {
        let p = self.inner.config.schema.as_str();
        let regexes = req.ordering.regexes();
        let select = ordered_select(p, regexes.len(), 0, req.ordering.skip_dead);
        let mut query = sqlx::query(AssertSqlSafe(format!("EXPLAIN {select}")));
        for re in regexes.iter().chain(regexes.iter()) {
            query = query.bind(re.as_str());
        }
        let mut rows = query
            .bind(i64::from(req.batch_size))
            .fetch_all(&self.inner.pool)
            .await?;
        let fence = fence_sql(p, req.ordering.skip_dead, "0", "SELECT X'00' AS ok");
        rows.extend(
            sqlx::raw_sql(AssertSqlSafe(format!("EXPLAIN {fence}")))
                .fetch_all(&self.inner.pool)
                .await?,
        );
        let col = |r: &MySqlRow, name: &str| -> String {
            r.try_get::<Option<String>, _>(name)
                .ok()
                .flatten()
                .or_else(|| {
                    r.try_get::<Option<Vec<u8>>, _>(name)
                        .ok()
                        .flatten()
                        .map(|b| String::from_utf8_lossy(&b).into_owned())
                })
                .unwrap_or_else(|| "-".into())
        };
        Ok(rows
            .iter()
            .map(|r| format!("{} {}", col(r, "table"), col(r, "key")))
            .collect::<Vec<_>>()
            .join("\n"))
    }

    /// The ids an ordered claim takes ([`super::KeyOrdering`]), the rows locked in `tx`:
    ///
    /// 1. the due rows as the unordered claim selects them (`FOR UPDATE SKIP LOCKED`),
    ///    less those of an ordered key whose first row not dispatched (its head, by the
    ///    `order_key` index) comes after them in the claim's order (claimed under a live
    ///    lease, waiting for a retry, given back later) or is dead when dead rows hold
    ///    their key: a blocked key never fills the claim, and a row taken has its key's
    ///    head before it, so every key makes progress;
    /// 2. per ordered key among them, its fence: the first row of the key not dispatched
    ///    (nor dead, with `skip_dead`) that the first step did not lock: cut off by the
    ///    limit, locked by another claim, or not ready;
    /// 3. the rows before their key's fence are taken; the others stay as they are.
    ///
    /// The per-key reads name the `order_key` index (`FORCE INDEX`): with one hot key
    /// holding most rows, the optimizer would otherwise walk the primary key for `ORDER BY
    /// id LIMIT 1` and pass every dispatched row of the key on each read.
    ///
    /// Rows are matched by `order_key` alone: a hash collision between two keys can only
    /// hold one back behind the other, never let a row pass its own key's fence.
    async fn claim_ordered_ids(
        &self,
        tx: &mut Transaction<'static, MySql>,
        req: &ClaimRequest,
    ) -> Result<Vec<i64>> {
        let p = &self.inner.config.schema;
        let regexes = req.ordering.regexes();
        let skip_dead = req.ordering.skip_dead;
        let select = ordered_select(p.as_str(), regexes.len(), req.skip_topics.len(), skip_dead);
        let mut query = sqlx::query_as::<_, (i64, i64, Option<Vec<u8>>)>(AssertSqlSafe(select));
        for re in regexes.iter().chain(regexes.iter()) {
            query = query.bind(re.as_str());
        }
        for t in &req.skip_topics {
            query = query.bind(t.regex());
        }
        let cand = query
            .bind(i64::from(req.batch_size))
            .fetch_all(&mut **tx)
            .await?;
        let mut keys: Vec<&[u8]> = cand
            .iter()
            .filter(|(_, ord, _)| *ord != 0)
            .filter_map(|(_, _, k)| k.as_deref())
            .collect();
        keys.sort_unstable();
        keys.dedup();
        if keys.is_empty() {
            return Ok(cand.into_iter().map(|(id, _, _)| id).collect());
        }
        let all: Vec<i64> = cand.iter().map(|(id, _, _)| *id).collect();
        let list = Self::id_list(&all);
        let mut rows = String::with_capacity(keys.len() * 48);
        for (i, k) in keys.iter().enumerate() {
            if i > 0 {
                rows.push_str(" UNION ALL ");
            }
            rows.push_str("SELECT X'");
            for b in *k {
                let _ = write!(rows, "{b:02x}");
            }
            rows.push_str("' AS ok");
        }
        let fences: Vec<(Vec<u8>, Option<i64>)> = sqlx::raw_sql(AssertSqlSafe(fence_sql(
            p.as_str(),
            skip_dead,
            &list,
            &rows,
        )))
        .fetch_all(&mut **tx)
        .await?
        .iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .collect::<Result<_>>()?;
        let fence: std::collections::HashMap<Vec<u8>, i64> = fences
            .into_iter()
            .filter_map(|(k, f)| f.map(|f| (k, f)))
            .collect();
        Ok(cand
            .into_iter()
            .filter(|(id, ord, k)| {
                *ord == 0 || k.as_ref().and_then(|k| fence.get(k)).is_none_or(|f| id < f)
            })
            .map(|(id, _, _)| id)
            .collect())
    }

    /// One settle statement (see [`Relaying::settle`]); [`retry_deadlock`] reruns it.
    async fn settle_once(&self, token: Uuid, settlement: &Settlement) -> Result<Settled> {
        if settlement.is_empty() {
            return Ok(Settled::default());
        }
        let p = &self.inner.config.schema;
        // One multi-table UPDATE over an inlined derived table of outcomes. MySQL has no
        // UPDATE … RETURNING: when fewer rows changed than were sent, a second query
        // finds the rows another claim now holds (the lost ones).
        let mut rows = String::with_capacity(settlement.len() * 64);
        for (i, (id, st, delay, err, refund)) in
            super::settle_rows(settlement).into_iter().enumerate()
        {
            let err = err.map_or_else(
                || "CAST(NULL AS CHAR CHARACTER SET utf8mb4)".to_owned(),
                |e| Self::text_literal(&e),
            );
            if i > 0 {
                rows.push_str(" UNION ALL ");
            }
            let _ = write!(
                rows,
                "SELECT {id} AS id, {st} AS st, {delay} AS delay_ms, {err} AS err, {} AS refund",
                i32::from(refund)
            );
        }
        let token_text = token.hyphenated();
        // Assignments that read the row come before `status` changes (MySQL applies
        // multi-table assignments in no promised order, but the WHERE was evaluated first).
        let sql = format!(
            "UPDATE {p}_messages m JOIN ({rows}) x ON m.id = x.id
             SET m.available_at = CASE WHEN x.st = 0 THEN TIMESTAMPADD(MICROSECOND, x.delay_ms * 1000, {NOW})
                                       WHEN x.st = 3 THEN {NOW} ELSE m.available_at END,
                 m.attempts = CASE WHEN x.refund = 1 THEN GREATEST(m.attempts - 1, 0) ELSE m.attempts END,
                 m.dispatched_at = CASE WHEN x.st = 2 THEN {NOW} ELSE m.dispatched_at END,
                 m.last_error = CASE WHEN x.st = 2 THEN NULL ELSE COALESCE(x.err, m.last_error) END,
                 m.locked_until = NULL, m.claim_token = NULL, m.status = x.st
             WHERE m.claim_token = '{token_text}' AND m.status = 1"
        );
        let n = sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&self.inner.pool)
            .await?
            .rows_affected();
        let ids = settlement.ids();
        if n >= ids.len() as u64 {
            return Ok(super::settled(settlement, ids));
        }
        if n == 0 {
            return Ok(super::settled(settlement, Vec::new()));
        }
        // Some changed: the rows another claim holds now are certainly lost. A row that
        // was already settled by its new owner cannot be told from one settled here, so
        // the rest are attributed by count (this only affects which ids a log names).
        let held: Vec<i64> = sqlx::raw_sql(AssertSqlSafe(format!(
            "SELECT id FROM {p}_messages WHERE id IN ({}) AND claim_token IS NOT NULL",
            Self::id_list(&ids)
        )))
        .fetch_all(&self.inner.pool)
        .await?
        .iter()
        .map(|r| r.try_get::<i64, _>(0))
        .collect::<std::result::Result<_, _>>()?;
        let changed = ids
            .into_iter()
            .filter(|id| !held.contains(id))
            .take(usize::try_from(n).unwrap_or(usize::MAX))
            .collect();
        Ok(super::settled(settlement, changed))
    }

    /// One deleting transaction (see [`Relaying::delete_claimed`]); [`retry_deadlock`] reruns it.
    async fn delete_claimed_once(&self, token: Uuid, ids: &[i64]) -> Result<Vec<i64>> {
        let p = &self.inner.config.schema;
        let list = &Self::id_list(ids);
        let token_text = token.hyphenated();
        // No DELETE … RETURNING in MySQL: the rows this claim still holds are read and
        // locked first, in the same transaction, and exactly those are deleted.
        let mut tx = self.inner.pool.begin().await?;
        let held: Vec<i64> = sqlx::raw_sql(AssertSqlSafe(format!(
            "SELECT id FROM {p}_messages
                 WHERE id IN ({list}) AND claim_token = '{token_text}' AND status = 1
                 FOR UPDATE"
        )))
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(|r| r.try_get::<i64, _>("id").unwrap_or(-1))
        .collect();
        if !held.is_empty() {
            let held_list = Self::id_list(&held);
            sqlx::raw_sql(AssertSqlSafe(format!(
                    "DELETE FROM {p}_messages WHERE id IN ({held_list}) AND claim_token = '{token_text}'"
                )))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(held)
    }

    /// One purge batch under the purge lock (see [`Maintenance::purge`]); [`retry_deadlock`] reruns it.
    async fn purge_once(&self, older_than: Duration, batch_size: u32) -> Result<PurgeBatch> {
        let p = &self.inner.config.schema;
        let mut conn = self.inner.pool.acquire().await?;
        let lock = format!("outbox_purge_{p}");
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
            .bind(&lock)
            .fetch_one(&mut *conn)
            .await?;
        if got != Some(1) {
            return Ok(PurgeBatch {
                deleted: 0,
                locked_out: true,
            });
        }
        let r = sqlx::query(self.inner.sql.purge.clone())
            .bind(millis(older_than))
            .bind(i64::from(batch_size))
            .execute(&mut *conn)
            .await;
        let _ = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock)
            .execute(&mut *conn)
            .await;
        let deleted = r?.rows_affected();
        crate::metrics::purged(deleted);
        Ok(PurgeBatch {
            deleted,
            locked_out: false,
        })
    }

    /// Runs `op` on one connection under the parking lock (`GET_LOCK`, waiting up to
    /// `wait_s` seconds): one parker at a time, so two relays never update the same parked
    /// rows in different orders. `Ok(0)` when another connection holds it past that.
    async fn under_parking_lock<F>(&self, wait_s: u32, op: F) -> Result<u64>
    where
        F: AsyncFnOnce(&mut sqlx::pool::PoolConnection<MySql>) -> Result<u64>,
    {
        let p = &self.inner.config.schema;
        let mut conn = self.inner.pool.acquire().await?;
        let lock = format!("outbox_park_{p}");
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
            .bind(&lock)
            .bind(wait_s)
            .fetch_one(&mut *conn)
            .await?;
        if got != Some(1) {
            return Ok(0);
        }
        let r = op(&mut conn).await;
        let _ = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock)
            .execute(&mut *conn)
            .await;
        r
    }

    /// Gives back the parked rows of the keys of `rows` (the replayed, discarded or purged
    /// dead letters: id, `order_key`, and the replayed one's delay from `at` in ms) that
    /// come before their key's next dead letter: at the replayed row's own time, so it
    /// still goes first, or at `at` for a deleted one. In the replay's transaction, after
    /// its change. Rows are matched by `order_key`, as the ordered claim matches them.
    async fn unpark_keys(
        &self,
        tx: &mut Transaction<'static, MySql>,
        rows: &[(i64, Vec<u8>, i64)],
        at: &str,
    ) -> Result<()> {
        let p = &self.inner.config.schema;
        // The earliest replayed row of each key, with its delay.
        let mut first: std::collections::BTreeMap<&[u8], (i64, i64)> = Default::default();
        for (id, ok, delay) in rows {
            let e = first.entry(ok.as_slice()).or_insert((*id, *delay));
            if *id < e.0 {
                *e = (*id, *delay);
            }
        }
        let keys: Vec<(&[u8], i64, i64)> = first.into_iter().map(|(k, (i, d))| (k, i, d)).collect();
        for chunk in keys.chunks(REPLAY_CHUNK) {
            let mut derived = String::with_capacity(chunk.len() * 80);
            for (k, (ok, id, delay)) in chunk.iter().enumerate() {
                if k > 0 {
                    derived.push_str(" UNION ALL ");
                }
                let _ = write!(
                    derived,
                    "SELECT X'{}' AS ok, {id} AS id, {delay} AS delay_ms",
                    hex(ok)
                );
            }
            // The key's next dead letter bounds what comes back (read first: the target
            // table cannot be read in the update's own subqueries).
            let bounds = sqlx::raw_sql(AssertSqlSafe(format!(
                "SELECT r.ok, r.id, r.delay_ms,
                        (SELECT MIN(d.id) FROM {p}_messages d FORCE INDEX ({p}_messages_key)
                         WHERE d.order_key = r.ok AND d.id > r.id AND d.status = 3)
                 FROM ({derived}) r"
            )))
            .fetch_all(&mut **tx)
            .await?;
            let mut with_bounds = String::with_capacity(chunk.len() * 100);
            for (k, row) in bounds.iter().enumerate() {
                let ok: Vec<u8> = row.try_get(0)?;
                let id: i64 = row.try_get(1)?;
                let delay: i64 = row.try_get(2)?;
                let next: Option<i64> = row.try_get(3)?;
                if k > 0 {
                    with_bounds.push_str(" UNION ALL ");
                }
                let _ = write!(
                    with_bounds,
                    "SELECT X'{}' AS ok, {id} AS id, {delay} AS delay_ms, {} AS next_dead",
                    hex(&ok),
                    next.unwrap_or(i64::MAX)
                );
            }
            if with_bounds.is_empty() {
                continue;
            }
            sqlx::raw_sql(AssertSqlSafe(format!(
                "UPDATE {p}_messages m FORCE INDEX ({p}_messages_key) JOIN ({with_bounds}) r
                   ON m.order_key = r.ok AND m.id > r.id AND m.id < r.next_dead
                 SET m.available_at = TIMESTAMPADD(MICROSECOND, r.delay_ms * 1000, {at})
                 WHERE m.live_at = '{PARKED}' AND m.status = 0"
            )))
            .execute(&mut **tx)
            .await?;
        }
        Ok(())
    }
}

#[async_trait]
impl Relaying for MySqlStore {
    fn kind(&self) -> &'static str {
        "mysql"
    }

    async fn check_schema(&self) -> Result<()> {
        let p = self.inner.config.schema.as_str();
        let table = format!("{p}_schema_migrations");
        let exists: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.tables
             WHERE table_schema = DATABASE() AND table_name = ?",
        )
        .bind(&table)
        .fetch_one(&self.inner.pool)
        .await?;
        let found: i64 = if exists > 0 {
            sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT CAST(COALESCE(MAX(version), 0) AS SIGNED) FROM {table}"
            )))
            .fetch_one(&self.inner.pool)
            .await?
        } else {
            0
        };
        if found != SCHEMA_VERSION {
            return Err(Error::NotMigrated {
                schema: p.to_owned(),
                found,
                expected: SCHEMA_VERSION,
            });
        }
        Ok(())
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim> {
        retry_deadlock(|| self.claim_once(req)).await
    }

    async fn settle(&self, token: Uuid, settlement: &Settlement) -> Result<Settled> {
        let _wrote = self.inner.quiet.writing();
        if settlement.delete_dispatched && !settlement.dispatched.is_empty() {
            return super::settle_deleting(self, token, settlement).await;
        }
        retry_deadlock(|| self.settle_once(token, settlement)).await
    }

    async fn delete_claimed(&self, token: Uuid, ids: &[i64]) -> Result<Vec<i64>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        retry_deadlock(|| self.delete_claimed_once(token, ids)).await
    }

    async fn renew(&self, token: Uuid, ids: &[i64], lease: Duration) -> Result<Vec<i64>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let p = &self.inner.config.schema;
        let list = Self::id_list(ids);
        let token_text = token.hyphenated();
        let ms = millis(lease);
        let n = sqlx::raw_sql(AssertSqlSafe(format!(
            "UPDATE {p}_messages
             SET locked_until = TIMESTAMPADD(MICROSECOND, {ms} * 1000, {NOW}),
                 available_at = TIMESTAMPADD(MICROSECOND, {ms} * 1000, {NOW})
             WHERE id IN ({list}) AND claim_token = '{token_text}' AND status = 1"
        )))
        .execute(&self.inner.pool)
        .await?
        .rows_affected();
        if n >= ids.len() as u64 {
            return Ok(ids.to_vec());
        }
        let held = sqlx::raw_sql(AssertSqlSafe(format!(
            "SELECT id FROM {p}_messages
             WHERE id IN ({list}) AND claim_token = '{token_text}' AND status = 1"
        )))
        .fetch_all(&self.inner.pool)
        .await?
        .iter()
        .map(|r| r.try_get::<i64, _>(0))
        .collect::<std::result::Result<_, _>>()?;
        Ok(held)
    }

    async fn pause_state(&self) -> Result<PauseState> {
        type Row = (
            bool,
            Option<String>,
            NaiveDateTime,
            Option<String>,
            Option<String>,
            Option<String>,
            Option<NaiveDateTime>,
        );
        let rows: Vec<Row> = sqlx::query_as(self.inner.sql.pause_state.clone())
            .fetch_all(&self.inner.pool)
            .await?;
        let Some((paused, reason, changed_at, ..)) = rows.first().cloned() else {
            return Err(sqlx::Error::RowNotFound.into());
        };
        let mut topics: Vec<TopicPause> = rows
            .into_iter()
            .filter_map(|(.., pattern, reason, by, at)| {
                Some(TopicPause {
                    pattern: pattern?,
                    reason: reason.unwrap_or_default(),
                    by: by.unwrap_or_default(),
                    paused_at: at.unwrap_or_default().and_utc(),
                })
            })
            .collect();
        // By pattern in byte order, whatever the collation.
        topics.sort_by(|a, b| a.pattern.cmp(&b.pattern));
        Ok(PauseState {
            paused,
            reason,
            changed_at: Some(DateTime::<Utc>::from_naive_utc_and_offset(changed_at, Utc)),
            topics,
        })
    }

    fn wakeups(&self) -> watch::Receiver<u64> {
        self.start_watcher();
        self.inner.wakeup.subscribe()
    }

    fn nothing_due(&self, poll_interval: Duration) -> bool {
        self.inner.quiet.nothing_due(poll_interval)
    }
}

#[async_trait]
impl Maintenance for MySqlStore {
    async fn migrate(&self) -> Result<()> {
        let p = self.inner.config.schema.as_str();
        let mut conn = self.inner.pool.acquire().await?;
        let lock = format!("outbox_migrate_{p}");
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 60)")
            .bind(&lock)
            .fetch_one(&mut *conn)
            .await?;
        if got != Some(1) {
            return Err(Error::Timeout(Duration::from_secs(60)));
        }
        let result = async {
            sqlx::query(AssertSqlSafe(format!(
                "CREATE TABLE IF NOT EXISTS {p}_schema_migrations (
                    version BIGINT NOT NULL PRIMARY KEY,
                    applied_at DATETIME(6) NOT NULL DEFAULT ({NOW})) ENGINE = InnoDB"
            )))
            .execute(&mut *conn)
            .await?;
            let current: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT CAST(COALESCE(MAX(version), 0) AS SIGNED) FROM {p}_schema_migrations"
            )))
            .fetch_one(&mut *conn)
            .await?;
            for (i, statements) in migrations(p).into_iter().enumerate() {
                let version = i as i64 + 1;
                if version <= current {
                    continue;
                }
                for statement in statements {
                    sqlx::raw_sql(AssertSqlSafe(statement))
                        .execute(&mut *conn)
                        .await?;
                }
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {p}_schema_migrations (version) VALUES (?)"
                )))
                .bind(version)
                .execute(&mut *conn)
                .await?;
            }
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {p}_control SET max_message_bytes = ? WHERE id = 1"
            )))
            .bind(i64::try_from(self.inner.config.max_message_bytes).unwrap_or(i64::MAX))
            .execute(&mut *conn)
            .await?;
            let stored: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT pattern FROM {p}_topic_pauses"
            )))
            .fetch_all(&mut *conn)
            .await?;
            for (pattern, regex) in super::pause_regexes(stored) {
                sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {p}_topic_pauses SET regex = ? WHERE pattern = ?"
                )))
                .bind(regex)
                .bind(pattern)
                .execute(&mut *conn)
                .await?;
            }
            Ok::<_, Error>(())
        }
        .await;
        let _ = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock)
            .execute(&mut *conn)
            .await;
        result
    }

    async fn purge(&self, older_than: Duration, batch_size: u32) -> Result<PurgeBatch> {
        retry_deadlock(|| self.purge_once(older_than, batch_size)).await
    }

    async fn inbox_purge(&self, older_than: Duration, batch_size: u32) -> Result<u64> {
        if batch_size == 0 {
            return Ok(0);
        }
        let r = sqlx::query(self.inner.sql.inbox_purge.clone())
            .bind(millis(older_than))
            .bind(i64::from(batch_size))
            .execute(&self.inner.pool)
            .await?;
        Ok(r.rows_affected())
    }

    async fn park_held(&self, ordering: &KeyOrdering) -> Result<u64> {
        if !ordering.holds_dead() {
            return Ok(0);
        }
        let p = self.inner.config.schema.clone();
        let regexes = ordering.regexes();
        self.under_parking_lock(0, async |conn| {
            let ord = regexp_any("topic", regexes.len());
            let mut tx = sqlx::Connection::begin(&mut **conn).await?;
            // The dead letters are locked (a replay or discard holding one is skipped: it
            // releases its key): a replay that comes after waits for this transaction and
            // then gives the parked rows back itself.
            let mut query = sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!(
                "SELECT id FROM {p}_messages FORCE INDEX ({p}_messages_dead)
                 WHERE dead_at IS NOT NULL AND order_key IS NOT NULL AND ({ord})
                 FOR UPDATE SKIP LOCKED"
            )));
            for re in &regexes {
                query = query.bind(re.as_str());
            }
            let dead = query.fetch_all(&mut *tx).await?;
            let mut parked = 0;
            for chunk in dead.chunks(REPLAY_CHUNK) {
                parked += sqlx::raw_sql(AssertSqlSafe(format!(
                    "UPDATE {p}_messages m FORCE INDEX ({p}_messages_key)
                     JOIN (SELECT MIN(order_key) AS ok, topic, `key`, MIN(id) AS id
                           FROM {p}_messages WHERE id IN ({}) AND status = 3
                           GROUP BY topic, `key`) b
                       ON m.order_key = b.ok AND m.topic = b.topic AND m.`key` = b.`key`
                      AND m.id > b.id
                     SET m.available_at = '{PARKED}'
                     WHERE m.status = 0 AND m.live_at <= {NOW}",
                    Self::id_list(chunk)
                )))
                .execute(&mut *tx)
                .await?
                .rows_affected();
            }
            tx.commit().await?;
            Ok(parked)
        })
        .await
    }

    async fn unpark_released(&self, ordering: &KeyOrdering) -> Result<u64> {
        let _wrote = self.inner.quiet.writing();
        let p = self.inner.config.schema.clone();
        let strict = ordering.holds_dead();
        let regexes = ordering.regexes();
        self.under_parking_lock(10, async |conn| {
            // The first parked row of each key, and whether a dead letter still holds it.
            let ord = regexp_any("f.topic", regexes.len());
            let mut query = sqlx::query_as::<_, (i64, i64)>(AssertSqlSafe(format!(
                "SELECT f.id, CAST(({ord}) AND EXISTS (
                          SELECT 1 FROM {p}_messages d FORCE INDEX ({p}_messages_key)
                          WHERE d.order_key = f.ok AND d.topic = f.topic AND d.`key` = f.`key`
                            AND d.status = 3 AND d.id < f.id) AS SIGNED)
                 FROM (SELECT MIN(order_key) AS ok, topic, `key`, MIN(id) AS id
                       FROM {p}_messages FORCE INDEX ({p}_messages_live)
                       WHERE live_at = '{PARKED}' GROUP BY topic, `key`) f"
            )));
            for re in &regexes {
                query = query.bind(re.as_str());
            }
            let firsts = query.fetch_all(&mut **conn).await?;
            let free: Vec<i64> = firsts
                .into_iter()
                .filter(|(_, held)| !strict || *held == 0)
                .map(|(id, _)| id)
                .collect();
            let mut given = 0;
            for chunk in free.chunks(REPLAY_CHUNK) {
                given += sqlx::raw_sql(AssertSqlSafe(format!(
                    "UPDATE {p}_messages m FORCE INDEX ({p}_messages_key)
                     JOIN {p}_messages f ON f.id IN ({})
                      AND m.order_key = f.order_key AND m.topic = f.topic AND m.`key` = f.`key`
                     SET m.available_at = {NOW}
                     WHERE m.live_at = '{PARKED}' AND m.status = 0",
                    Self::id_list(chunk)
                )))
                .execute(&mut **conn)
                .await?
                .rows_affected();
            }
            Ok(given)
        })
        .await
    }
}

#[async_trait]
impl Registry for MySqlStore {
    async fn heartbeat(&self, beat: &RelayHeartbeat) -> Result<()> {
        sqlx::query(self.inner.sql.heartbeat.clone())
            .bind(&beat.relay_id)
            .bind(&beat.host)
            .bind(beat.pid)
            .bind(&beat.version)
            .bind(&beat.sink)
            .bind(beat.in_flight)
            .bind(beat.last_claim_ago.map(millis))
            .bind(super::ops::destinations_json(&beat.destinations))
            .bind(&beat.instance)
            .bind(millis(beat.lease))
            .execute(&self.inner.pool)
            .await?;
        // Rows not seen for an hour: found by a plain read, deleted by primary key (still
        // stale), so no range of the registry is ever locked.
        let stale: Vec<(String, String)> = sqlx::query_as(self.inner.sql.relays_stale.clone())
            .fetch_all(&self.inner.pool)
            .await?;
        for (relay_id, instance) in stale {
            sqlx::query(self.inner.sql.relay_expire.clone())
                .bind(relay_id)
                .bind(instance)
                .execute(&self.inner.pool)
                .await?;
        }
        Ok(())
    }

    async fn deregister(&self, relay_id: &str, instance: &str) -> Result<()> {
        sqlx::query(self.inner.sql.deregister.clone())
            .bind(relay_id)
            .bind(instance)
            .execute(&self.inner.pool)
            .await?;
        Ok(())
    }

    async fn relays(&self, within: Duration) -> Result<Vec<RelayRecord>> {
        type Row = (
            String,
            String,
            i64,
            String,
            String,
            i64,
            NaiveDateTime,
            NaiveDateTime,
            i64,
            Option<NaiveDateTime>,
            Option<String>,
            String,
        );
        let rows: Vec<Row> = sqlx::query_as(self.inner.sql.relays.clone())
            .bind(millis(within))
            .fetch_all(&self.inner.pool)
            .await?;
        Ok(rows
            .into_iter()
            .map(|r| RelayRecord {
                relay_id: r.0,
                instance: r.11,
                host: r.1,
                pid: r.2,
                version: r.3,
                sink: r.4,
                in_flight: r.5,
                started_at: r.6.and_utc(),
                last_seen: r.7.and_utc(),
                last_seen_ago_s: r.8.max(0) as f64 / 1e6,
                last_claim_at: r.9.map(|t| t.and_utc()),
                destinations: super::ops::parse_destinations(r.10.as_deref()),
            })
            .collect())
    }
}

#[async_trait]
impl Operations for MySqlStore {
    async fn set_pause(&self, reason: Option<&str>) -> Result<()> {
        sqlx::query(self.inner.sql.set_pause.clone())
            .bind(reason.is_some())
            .bind(reason)
            .execute(&self.inner.pool)
            .await?;
        Ok(())
    }

    async fn dead_letters(
        &self,
        selector: &DeadSelector,
        limit: u32,
        with_payload: bool,
    ) -> Result<Vec<DeadLetter>> {
        let p = &self.inner.config.schema;
        let (filter, binds) = ops::dead_filter(selector, Dialect::MySql, 1);
        let payload = if with_payload { "payload" } else { "NULL" };
        let sql = format!(
            "SELECT id, message_id, topic, `key`, attempts, occurred_at, available_at, last_error,
                    headers, CAST(OCTET_LENGTH(payload) AS SIGNED) AS payload_bytes,
                    {payload} AS payload, replay_id,
                    (SELECT COUNT(*) FROM {p}_messages l FORCE INDEX ({p}_messages_key)
                     WHERE l.order_key = m.order_key AND l.topic = m.topic AND l.`key` = m.`key`
                       AND l.status <= 1 AND l.id > m.id) AS waiting_behind
             FROM {p}_messages m WHERE {filter} ORDER BY id LIMIT {limit}"
        );
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for b in binds {
            query = query.bind(b);
        }
        let rows = query.fetch_all(&self.inner.pool).await?;
        rows.iter()
            .map(|r| {
                let id: i64 = r.try_get("id")?;
                let message_id =
                    super::text_message_id(id, &r.try_get::<String, _>("message_id")?)?;
                Ok(DeadLetter {
                    id,
                    message_id,
                    topic: r.try_get("topic")?,
                    key: r.try_get("key")?,
                    attempts: r.try_get("attempts")?,
                    occurred_at: r.try_get::<NaiveDateTime, _>("occurred_at")?.and_utc(),
                    died_at: r.try_get::<NaiveDateTime, _>("available_at")?.and_utc(),
                    last_error: r.try_get("last_error")?,
                    headers: r.try_get("headers")?,
                    payload_bytes: r.try_get("payload_bytes")?,
                    payload: r.try_get("payload")?,
                    replay_id: r.try_get("replay_id")?,
                    waiting_behind: r.try_get("waiting_behind")?,
                })
            })
            .collect()
    }

    async fn count_dead(&self, selector: &DeadSelector) -> Result<u64> {
        let p = &self.inner.config.schema;
        let (filter, binds) = ops::dead_filter(selector, Dialect::MySql, 1);
        let sql = format!("SELECT COUNT(*) FROM {p}_messages WHERE {filter}");
        let mut query = sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql));
        for b in binds {
            query = query.bind(b);
        }
        Ok(u64::try_from(query.fetch_one(&self.inner.pool).await?).unwrap_or(0))
    }

    async fn replay(&self, req: &ReplayRequest) -> Result<ReplayOutcome> {
        let _wrote = self.inner.quiet.writing();
        ops::validate(req)?;
        let p = &self.inner.config.schema;
        let mut tx = self.inner.pool.begin().await?;
        let refused = if let Some(filter) = ops::named_filter(&req.selector, Dialect::MySql) {
            let found = sqlx::raw_sql(AssertSqlSafe(format!(
                "SELECT id, message_id, CAST(status AS SIGNED) FROM {p}_messages WHERE {filter}"
            )))
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(|r| {
                let mid: String = r.try_get(1)?;
                let status: i64 = r.try_get(2)?;
                Ok((
                    r.try_get::<i64, _>(0)?,
                    Uuid::parse_str(&mid).unwrap_or_default(),
                    i16::try_from(status).unwrap_or(-1),
                ))
            })
            .collect::<Result<Vec<_>>>()?;
            ops::refusals(&req.selector, &found)
        } else {
            Vec::new()
        };
        // The selected rows, read without locks (no gap locks, and no waiting on rows the
        // selection does not take), then locked by primary key while still dead (the
        // primary key forced: a covering secondary index would look cheaper and lock every
        // dead row, waiting on any a claim or a producer holds): a concurrent replay of the
        // same rows waits there, then finds them no longer dead.
        let (filter, binds) = ops::dead_filter(&req.selector, Dialect::MySql, 1);
        let limit = req
            .limit
            .map_or_else(String::new, |l| format!(" LIMIT {l}"));
        let mut query = sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!(
            "SELECT id FROM {p}_messages WHERE {filter} ORDER BY id{limit}"
        )));
        for b in binds {
            query = query.bind(b);
        }
        let selected = query.fetch_all(&mut *tx).await?;
        ops::check_spread(selected.len(), req.rate_per_s)?;
        if req.dry_run || selected.is_empty() {
            tx.rollback().await?;
            return Ok(ReplayOutcome {
                replay_id: None,
                count: selected.len() as u64,
                sample: selected.iter().take(20).copied().collect(),
                refused,
            });
        }
        let mut ids = Vec::with_capacity(selected.len());
        for chunk in selected.chunks(REPLAY_CHUNK) {
            let locked = sqlx::raw_sql(AssertSqlSafe(format!(
                "SELECT id FROM {p}_messages FORCE INDEX (PRIMARY)
                 WHERE id IN ({}) AND status = 3 ORDER BY id FOR UPDATE",
                Self::id_list(chunk)
            )))
            .fetch_all(&mut *tx)
            .await?;
            for r in &locked {
                ids.push(r.try_get::<i64, _>(0)?);
            }
        }
        // The keyed rows among them (id, order_key), whose parked followers come back below.
        let mut keyed: Vec<(i64, Vec<u8>)> = Vec::new();
        for chunk in ids.chunks(REPLAY_CHUNK) {
            let rows = sqlx::raw_sql(AssertSqlSafe(format!(
                "SELECT id, order_key FROM {p}_messages
                 WHERE id IN ({}) AND order_key IS NOT NULL",
                Self::id_list(chunk)
            )))
            .fetch_all(&mut *tx)
            .await?;
            for r in &rows {
                keyed.push((r.try_get(0)?, r.try_get(1)?));
            }
        }
        let sample: Vec<i64> = ids.iter().take(20).copied().collect();
        if ids.is_empty() {
            tx.rollback().await?;
            return Ok(ReplayOutcome {
                replay_id: None,
                count: 0,
                sample,
                refused,
            });
        }
        let replay_id: i64 = match req.append_to {
            Some(id) => id,
            None => {
                let r = sqlx::query(self.inner.sql.replay_insert.clone())
                    .bind(&req.by)
                    .bind(&req.reason)
                    .bind(req.action.as_str())
                    .bind(req.describe())
                    .execute(&mut *tx)
                    .await?;
                i64::try_from(r.last_insert_id()).unwrap_or(i64::MAX)
            }
        };
        // One database time for every statement, as one statement would have: the spread
        // starts at it whatever the number of statements.
        let at: NaiveDateTime = sqlx::raw_sql(AssertSqlSafe(format!("SELECT {NOW}")))
            .fetch_one(&mut *tx)
            .await?
            .try_get(0)?;
        let at = format!("TIMESTAMP'{}'", at.format("%Y-%m-%d %H:%M:%S%.6f"));
        let mut changed = 0;
        for (c, chunk) in ids.chunks(REPLAY_CHUNK).enumerate() {
            let list = Self::id_list(chunk);
            let sql = match (req.action, req.rate_per_s) {
                (ReplayAction::Replay, None) => format!(
                    "UPDATE {p}_messages
                     SET status = 0, attempts = 0, replay_id = {replay_id}, available_at = {at},
                         claim_token = NULL, locked_until = NULL, dispatched_at = NULL
                     WHERE id IN ({list}) AND status = 3"
                ),
                (ReplayAction::Replay, Some(_)) => {
                    // Each row due at its place in id order at the rate: an inlined derived
                    // table of (id, delay), as `settle` does.
                    let mut rows = String::with_capacity(chunk.len() * 40);
                    for (k, id) in chunk.iter().enumerate() {
                        if k > 0 {
                            rows.push_str(" UNION ALL ");
                        }
                        let delay = ops::spread_ms(c * REPLAY_CHUNK + k, req.rate_per_s);
                        let _ = write!(rows, "SELECT {id} AS id, {delay} AS delay_ms");
                    }
                    format!(
                        "UPDATE {p}_messages m JOIN ({rows}) x ON m.id = x.id
                         SET m.available_at = TIMESTAMPADD(MICROSECOND, x.delay_ms * 1000, {at}),
                             m.attempts = 0, m.replay_id = {replay_id}, m.claim_token = NULL,
                             m.locked_until = NULL, m.dispatched_at = NULL, m.status = 0
                         WHERE m.status = 3"
                    )
                }
                (ReplayAction::Discard | ReplayAction::Purge, _) => {
                    format!("DELETE FROM {p}_messages WHERE id IN ({list}) AND status = 3")
                }
            };
            changed += sqlx::raw_sql(AssertSqlSafe(sql))
                .execute(&mut *tx)
                .await?
                .rows_affected();
        }
        // A replayed row is due after its spread delay (its followers then, too); a deleted
        // one releases its followers at once.
        let position: std::collections::HashMap<i64, usize> =
            ids.iter().enumerate().map(|(k, id)| (*id, k)).collect();
        let delayed: Vec<(i64, Vec<u8>, i64)> = keyed
            .into_iter()
            .map(|(id, ok)| {
                let delay = match req.action {
                    ReplayAction::Replay => position
                        .get(&id)
                        .map_or(0, |k| ops::spread_ms(*k, req.rate_per_s)),
                    ReplayAction::Discard | ReplayAction::Purge => 0,
                };
                (id, ok, delay)
            })
            .collect();
        self.unpark_keys(&mut tx, &delayed, &at).await?;
        sqlx::query(self.inner.sql.replay_count.clone())
            .bind(i64::try_from(changed).unwrap_or(i64::MAX))
            .bind(replay_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(ReplayOutcome {
            replay_id: Some(replay_id),
            count: changed,
            sample,
            refused,
        })
    }

    async fn replays(&self, limit: u32) -> Result<Vec<ReplayRecord>> {
        let rows: Vec<(i64, NaiveDateTime, String, String, String, String, i64)> =
            sqlx::query_as(self.inner.sql.replays.clone())
                .bind(i64::from(limit))
                .fetch_all(&self.inner.pool)
                .await?;
        Ok(rows
            .into_iter()
            .map(
                |(id, at, by, reason, action, selection, count)| ReplayRecord {
                    id,
                    at: at.and_utc(),
                    by,
                    reason,
                    action,
                    selection,
                    count,
                },
            )
            .collect())
    }

    async fn pause_topic(&self, pattern: &TopicPattern, reason: &str, by: &str) -> Result<()> {
        sqlx::query(self.inner.sql.pause_topic.clone())
            .bind(pattern.as_str())
            .bind(reason)
            .bind(by)
            .bind(pattern.regex())
            .execute(&self.inner.pool)
            .await?;
        Ok(())
    }

    async fn resume_topic(&self, pattern: &str) -> Result<bool> {
        let r = sqlx::query(self.inner.sql.resume_topic.clone())
            .bind(pattern)
            .execute(&self.inner.pool)
            .await?;
        Ok(r.rows_affected() > 0)
    }

    async fn audit(&self, entry: &super::ops::AuditEntry) -> Result<()> {
        sqlx::query(self.inner.sql.replay_insert.clone())
            .bind(&entry.by)
            .bind(&entry.reason)
            .bind(&entry.action)
            .bind(&entry.selection)
            .execute(&self.inner.pool)
            .await?;
        Ok(())
    }
}

#[async_trait]
impl Views for MySqlStore {
    async fn counts(&self) -> Result<Counts> {
        let row: super::CountsRow = sqlx::query_as(self.inner.sql.counts.clone())
            .fetch_one(&self.inner.pool)
            .await?;
        Ok(row.into())
    }

    async fn leases(&self) -> Result<Leases> {
        let (held, last, ms): (i64, Option<NaiveDateTime>, Option<i64>) =
            sqlx::query_as(self.inner.sql.leases.clone())
                .fetch_one(&self.inner.pool)
                .await?;
        Ok(Leases::from_row(held, last.map(|t| t.and_utc()), ms))
    }

    async fn cleanup_horizon(&self) -> Result<super::CleanupHorizon> {
        let pool = &self.inner.pool;
        // The oldest InnoDB transaction of another connection: its read view keeps purge
        // from removing the undo records (and delete-marked rows) of every later change.
        // `trx_started` and NOW() are both in the session's time zone.
        let oldest: Option<(
            i64,
            Option<i64>,
            Option<String>,
            Option<String>,
            Option<String>,
        )> = sqlx::query_as(
            "SELECT TIMESTAMPDIFF(SECOND, t.trx_started, NOW()),
                        CAST(t.trx_mysql_thread_id AS SIGNED),
                        CAST(p.USER AS CHAR), CAST(p.HOST AS CHAR), CAST(t.trx_state AS CHAR)
                 FROM information_schema.INNODB_TRX t
                 LEFT JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id
                 WHERE t.trx_mysql_thread_id <> CONNECTION_ID()
                 ORDER BY t.trx_started LIMIT 1",
        )
        .fetch_optional(pool)
        .await?;
        // The history list length, where the server tells it (MariaDB's status variable;
        // MySQL's INNODB_METRICS counter); unreadable is None, not an error.
        let history: Option<i64> = match sqlx::query_scalar::<_, String>(
            "SELECT CAST(VARIABLE_VALUE AS CHAR) FROM information_schema.GLOBAL_STATUS
             WHERE VARIABLE_NAME = 'INNODB_HISTORY_LIST_LENGTH'",
        )
        .fetch_optional(pool)
        .await
        {
            Ok(Some(v)) => v.trim().parse().ok(),
            _ => sqlx::query_scalar::<_, i64>(
                "SELECT CAST(`COUNT` AS SIGNED) FROM information_schema.INNODB_METRICS
                 WHERE NAME = 'trx_rseg_history_len'",
            )
            .fetch_optional(pool)
            .await
            .ok()
            .flatten(),
        };
        Ok(super::CleanupHorizon {
            oldest: oldest.map(|(age_s, pid, user, host, state)| super::OldTransaction {
                kind: "session".to_owned(),
                age_s: age_s.max(0) as f64,
                pid,
                user,
                application: host,
                state,
                gid: None,
            }),
            xmin_age: None,
            slot: None,
            history_length: history,
        })
    }

    async fn held_keys(&self, ordering: &KeyOrdering) -> Result<HeldKeys> {
        if !ordering.is_on() {
            return Ok(HeldKeys::default());
        }
        let p = &self.inner.config.schema;
        let regexes = ordering.regexes();
        let ord = regexp_any("topic", regexes.len());
        let mut query = sqlx::query_as::<_, (i64, i64, Option<i64>)>(AssertSqlSafe(format!(
            "WITH blocked AS (
               SELECT MIN(order_key) AS order_key, topic, `key`, MIN(id) AS id FROM {p}_messages
               WHERE status = 3 AND `key` IS NOT NULL AND ({ord}) GROUP BY topic, `key`),
             held AS (
               SELECT m.occurred_at FROM blocked b JOIN {p}_messages m FORCE INDEX ({p}_messages_key)
                 ON m.order_key = b.order_key AND m.topic = b.topic AND m.`key` = b.`key`
                AND m.status <= 1 AND m.id > b.id)
             SELECT CAST((SELECT COUNT(*) FROM blocked) AS SIGNED),
                    CAST((SELECT COUNT(*) FROM held) AS SIGNED),
                    CAST((SELECT TIMESTAMPDIFF(SECOND, MIN(occurred_at), {NOW}) FROM held) AS SIGNED)"
        )));
        for re in &regexes {
            query = query.bind(re.as_str());
        }
        let (blocked_keys, held, oldest) = query.fetch_one(&self.inner.pool).await?;
        Ok(HeldKeys {
            blocked_keys,
            held,
            oldest_held_age_seconds: oldest,
        })
    }

    async fn due_held_by_order(&self, ordering: &KeyOrdering) -> Result<DueHeld> {
        let p = &self.inner.config.schema;
        let regexes = ordering.regexes();
        let ord = regexp_any("m.topic", regexes.len());
        let dead_h = if ordering.skip_dead {
            " AND h.status <> 3"
        } else {
            ""
        };
        // The key's head is read as the ordered claim reads it (see `ordered_select`), and
        // only for the due rows of ordered keys.
        let mut query = sqlx::query_as::<_, (i64, Option<i64>)>(AssertSqlSafe(format!(
            "SELECT CAST(COALESCE(SUM(held), 0) AS SIGNED),
                    CAST(TIMESTAMPDIFF(SECOND, MIN(CASE WHEN held = 0 THEN live_at END), {NOW}) AS SIGNED)
             FROM (
               SELECT m.live_at,
                      CASE WHEN m.order_key IS NOT NULL AND ({ord}) THEN COALESCE(
                        (SELECT h.id <> m.id AND (h.status = 3 OR h.available_at > {NOW})
                         FROM {p}_messages h FORCE INDEX ({p}_messages_key)
                         WHERE h.order_key = m.order_key{dead_h} ORDER BY h.id LIMIT 1), 0)
                      ELSE 0 END AS held
               FROM {p}_messages m WHERE m.live_at <= {NOW}) d"
        )));
        for re in &regexes {
            query = query.bind(re.as_str());
        }
        let (held, oldest_free) = query.fetch_one(&self.inner.pool).await?;
        Ok(DueHeld {
            held,
            oldest_free_due_s: oldest_free.map(|s| s.max(0)),
        })
    }

    async fn overview(&self, top_n: u32) -> Result<Overview> {
        let pool = &self.inner.pool;
        let sql = &self.inner.sql;
        let counts = self.counts().await?;
        let (due, oldest_due, expired): (i64, Option<i64>, i64) =
            sqlx::query_as(sql.due.clone()).fetch_one(pool).await?;
        let claims_by: Vec<(Option<String>, Option<String>, i64, i64)> =
            sqlx::query_as(sql.claims_by.clone())
                .fetch_all(pool)
                .await?;
        let p = &self.inner.config.schema;
        let parked: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {p}_messages WHERE live_at = '{PARKED}'"
        )))
        .fetch_one(pool)
        .await?;
        let by_topic = async |status: i16| -> Result<Vec<(String, i64)>> {
            Ok(sqlx::query_as(sql.by_topic.clone())
                .bind(status)
                .bind(i64::from(top_n))
                .fetch_all(pool)
                .await?)
        };
        Ok(Overview {
            counts,
            due,
            oldest_due_s: oldest_due.map(|s| s.max(0)),
            expired_claims: expired,
            parked,
            claims_by: claims_by
                .into_iter()
                .map(|(r, instance, claimed, expired)| ClaimsBy {
                    relay_id: r.unwrap_or_default(),
                    instance,
                    claimed,
                    expired,
                })
                .collect(),
            pending_by_topic: by_topic(super::status::PENDING).await?,
            dead_by_topic: by_topic(super::status::DEAD).await?,
        })
    }

    async fn find_messages(
        &self,
        query: &super::lookup::MessageQuery,
        limit: u32,
    ) -> Result<Vec<super::lookup::MessageLocation>> {
        use super::lookup::MessageQuery;
        let p = &self.inner.config.schema;
        let cols = "id, message_id, topic, `key`, CAST(status AS SIGNED) AS status, attempts,
                    occurred_at, available_at, claimed_by, locked_until, dispatched_at,
                    last_error, CAST(OCTET_LENGTH(payload) AS SIGNED) AS payload_bytes, replay_id";
        let rows = match query {
            MessageQuery::MessageId(id) => {
                sqlx::query(AssertSqlSafe(format!(
                    "SELECT {cols} FROM {p}_messages WHERE message_id = ?"
                )))
                .bind(id.hyphenated().to_string())
                .fetch_all(&self.inner.pool)
                .await?
            }
            MessageQuery::Key {
                key,
                topic: Some(topic),
            } => {
                sqlx::query(AssertSqlSafe(format!(
                    "SELECT {cols} FROM {p}_messages WHERE topic = ? AND `key` = ?
                     ORDER BY id DESC LIMIT ?"
                )))
                .bind(topic)
                .bind(key)
                .bind(i64::from(limit))
                .fetch_all(&self.inner.pool)
                .await?
            }
            MessageQuery::Key { key, topic: None } => {
                sqlx::query(AssertSqlSafe(format!(
                    "SELECT {cols} FROM {p}_messages WHERE `key` = ? ORDER BY id DESC LIMIT ?"
                )))
                .bind(key)
                .bind(i64::from(limit))
                .fetch_all(&self.inner.pool)
                .await?
            }
        };
        rows.iter()
            .map(|r| {
                let id: i64 = r.try_get("id")?;
                let message_id =
                    super::text_message_id(id, &r.try_get::<String, _>("message_id")?)?;
                let time = |c: &str| -> Result<Option<chrono::DateTime<chrono::Utc>>> {
                    Ok(r.try_get::<Option<NaiveDateTime>, _>(c)?
                        .map(|t| t.and_utc()))
                };
                Ok(super::lookup::MessageLocation {
                    id,
                    message_id,
                    topic: r.try_get("topic")?,
                    key: r.try_get("key")?,
                    status: super::lookup::status_name(r.try_get("status")?),
                    attempts: r.try_get("attempts")?,
                    occurred_at: r.try_get::<NaiveDateTime, _>("occurred_at")?.and_utc(),
                    available_at: r.try_get::<NaiveDateTime, _>("available_at")?.and_utc(),
                    claimed_by: r.try_get("claimed_by")?,
                    locked_until: time("locked_until")?,
                    dispatched_at: time("dispatched_at")?,
                    last_error: r.try_get("last_error")?,
                    payload_bytes: r.try_get("payload_bytes")?,
                    replay_id: r.try_get("replay_id")?,
                }
                .noting_parked())
            })
            .collect()
    }

    async fn throughput(&self, minutes: u32) -> Result<Vec<super::lookup::MinuteCounts>> {
        let p = &self.inner.config.schema;
        let n = NOW;
        let minutes = minutes.min(super::lookup::MAX_THROUGHPUT_MINUTES);
        let rows: Vec<(i64, i64, i64)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT m, CAST(SUM(d) AS SIGNED), CAST(SUM(x) AS SIGNED) FROM (
               SELECT CAST(FLOOR(TIMESTAMPDIFF(MICROSECOND, dispatched_at, {n}) / 60000000) AS SIGNED) AS m,
                      1 AS d, 0 AS x
               FROM {p}_messages
               WHERE status = 2 AND dispatched_at >= TIMESTAMPADD(MINUTE, -?, {n})
               UNION ALL
               SELECT CAST(FLOOR(TIMESTAMPDIFF(MICROSECOND, dead_at, {n}) / 60000000) AS SIGNED),
                      0, 1
               FROM {p}_messages WHERE dead_at >= TIMESTAMPADD(MINUTE, -?, {n})
             ) t GROUP BY m"
        )))
        .bind(i64::from(minutes))
        .bind(i64::from(minutes))
        .fetch_all(&self.inner.pool)
        .await?;
        Ok(super::lookup::fill_minutes(minutes, &rows))
    }
}

#[cfg(test)]
mod quiet_tests {
    use super::{QUIET_VALID, quiet_until};
    use std::time::{Duration, Instant};

    #[test]
    fn a_probe_answer_lapses_even_when_nothing_is_live_or_due_for_long() {
        let at = Instant::now();
        assert_eq!(quiet_until(at, None), Some(at + QUIET_VALID));
        // A parked row (due in 8,000 years) or a far retry: still at most QUIET_VALID.
        assert_eq!(quiet_until(at, Some(i64::MAX)), Some(at + QUIET_VALID));
        assert_eq!(
            quiet_until(at, Some(300_000)),
            Some(at + Duration::from_millis(300))
        );
        assert_eq!(quiet_until(at, Some(0)), None);
        assert_eq!(quiet_until(at, Some(-5)), None);
    }
}

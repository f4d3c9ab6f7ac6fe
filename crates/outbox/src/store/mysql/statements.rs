//! The statements whose text is fixed once the table prefix is known, made once per store:
//! read from `sql/statements.sql` (the claim's select, built from pieces, from
//! [`claim_select`]).

use super::PARKED;
use super::claim::claim_select;
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};
use std::collections::HashMap;

/// The statements of `Sql`, each after a line `-- @name` naming its field.
const STATEMENTS: &str = include_str!("sql/statements.sql");

/// The statements of `text`, a file of `sql/`: each begins at a line `-- @tag` (a name, or
/// what to do with it) and runs to the next such line; other lines that begin with `--`
/// are comments, left out. Returns each statement's tag (the rest of its line, trimmed)
/// and its text (trimmed), in file order.
pub(super) fn sections(text: &'static str) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, Vec<&'static str>)> = Vec::new();
    for line in text.lines() {
        if let Some(tag) = line.strip_prefix("-- @") {
            out.push((tag.trim(), Vec::new()));
        } else if !line.starts_with("--")
            && let Some((_, lines)) = out.last_mut()
        {
            lines.push(line);
        }
    }
    out.into_iter()
        .map(|(tag, lines)| (tag, lines.join("\n").trim().to_owned()))
        .collect()
}

/// The statements of one store, its table prefix filled in.
pub(super) struct Sql {
    pub(super) claim_select: SqlStr,
    pub(super) max_packet: SqlStr,
    pub(super) lock_try: SqlStr,
    pub(super) lock_wait: SqlStr,
    pub(super) lock_migrate: SqlStr,
    pub(super) lock_release: SqlStr,
    pub(super) versions_table: SqlStr,
    pub(super) versions_exist: SqlStr,
    pub(super) version: SqlStr,
    pub(super) version_insert: SqlStr,
    pub(super) enqueue_limit_set: SqlStr,
    pub(super) enqueue_limit: SqlStr,
    pub(super) pause_patterns: SqlStr,
    pub(super) pause_regex_set: SqlStr,
    pub(super) enqueue: SqlStr,
    pub(super) existing_id: SqlStr,
    pub(super) inbox_accept: SqlStr,
    pub(super) inbox_lock: SqlStr,
    pub(super) inbox_unlock: SqlStr,
    pub(super) inbox_purge: SqlStr,
    pub(super) purge: SqlStr,
    pub(super) probe: SqlStr,
    pub(super) pause_state: SqlStr,
    pub(super) set_pause: SqlStr,
    pub(super) pause_topic: SqlStr,
    pub(super) resume_topic: SqlStr,
    pub(super) replay_insert: SqlStr,
    pub(super) replay_count: SqlStr,
    pub(super) replays: SqlStr,
    pub(super) heartbeat: SqlStr,
    pub(super) relays_stale: SqlStr,
    pub(super) relay_expire: SqlStr,
    pub(super) deregister: SqlStr,
    pub(super) relays: SqlStr,
    pub(super) counts: SqlStr,
    pub(super) leases: SqlStr,
    pub(super) due: SqlStr,
    pub(super) claims_by: SqlStr,
    pub(super) by_topic: SqlStr,
    pub(super) parked: SqlStr,
    pub(super) oldest_transaction: SqlStr,
    pub(super) history_mariadb: SqlStr,
    pub(super) history_mysql: SqlStr,
    pub(super) find_by_id: SqlStr,
    pub(super) find_by_topic_key: SqlStr,
    pub(super) find_by_key: SqlStr,
    pub(super) throughput: SqlStr,
}

impl Sql {
    /// The statements for table prefix `p`.
    ///
    /// # Panics
    /// When `sql/statements.sql` lacks a statement (a build defect, caught by any test that
    /// opens a store).
    pub(super) fn new(p: &str) -> Self {
        let lock = inbox_lock_name(p, "?", "?");
        let expiry = crate::store::RELAY_EXPIRY.as_millis().to_string();
        let mut text: HashMap<&str, String> = sections(STATEMENTS)
            .into_iter()
            .map(|(name, s)| {
                let s = s
                    .replace("{lock}", &lock)
                    .replace("{expiry}", &expiry)
                    .replace("{parked}", PARKED)
                    .replace("{p}", p);
                (name, s)
            })
            .collect();
        let mut q = |name: &str| {
            let s = text
                .remove(name)
                .unwrap_or_else(|| panic!("sql/statements.sql has no statement `{name}`"));
            AssertSqlSafe(s).into_sql_str()
        };
        Sql {
            claim_select: AssertSqlSafe(claim_select(p, "")).into_sql_str(),
            max_packet: q("max_packet"),
            lock_try: q("lock_try"),
            lock_wait: q("lock_wait"),
            lock_migrate: q("lock_migrate"),
            lock_release: q("lock_release"),
            versions_table: q("versions_table"),
            versions_exist: q("versions_exist"),
            version: q("version"),
            version_insert: q("version_insert"),
            enqueue_limit_set: q("enqueue_limit_set"),
            enqueue_limit: q("enqueue_limit"),
            pause_patterns: q("pause_patterns"),
            pause_regex_set: q("pause_regex_set"),
            enqueue: q("enqueue"),
            existing_id: q("existing_id"),
            inbox_accept: q("inbox_accept"),
            inbox_lock: q("inbox_lock"),
            inbox_unlock: q("inbox_unlock"),
            inbox_purge: q("inbox_purge"),
            purge: q("purge"),
            probe: q("probe"),
            pause_state: q("pause_state"),
            set_pause: q("set_pause"),
            pause_topic: q("pause_topic"),
            resume_topic: q("resume_topic"),
            replay_insert: q("replay_insert"),
            replay_count: q("replay_count"),
            replays: q("replays"),
            heartbeat: q("heartbeat"),
            relays_stale: q("relays_stale"),
            relay_expire: q("relay_expire"),
            deregister: q("deregister"),
            relays: q("relays"),
            counts: q("counts"),
            leases: q("leases"),
            due: q("due"),
            claims_by: q("claims_by"),
            by_topic: q("by_topic"),
            parked: q("parked"),
            oldest_transaction: q("oldest_transaction"),
            history_mariadb: q("history_mariadb"),
            history_mysql: q("history_mysql"),
            find_by_id: q("find_by_id"),
            find_by_topic_key: q("find_by_topic_key"),
            find_by_key: q("find_by_key"),
            throughput: q("throughput"),
        }
    }
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
pub(super) fn inbox_lock_name(p: &str, consumer: &str, message_id: &str) -> String {
    format!(
        "CONCAT('outbox_inbox:', MD5(CONCAT(DATABASE(), CHAR(0), '{p}', CHAR(0), {consumer}, CHAR(0), {message_id})))"
    )
}

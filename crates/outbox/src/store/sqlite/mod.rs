//! SQLite store, the embedded default: WAL, a busy handler and pragmas on every
//! connection, claims by one `UPDATE … RETURNING`, wake-up by the WAL hook of the store's
//! own connections (this process's commits) and by watching the database and WAL files
//! (every commit, from any process, changes one of them).
//!
//! Tables are named `{prefix}_messages`, `{prefix}_control`, `{prefix}_schema_migrations`,
//! `{prefix}_inbox` (the consumer inbox), … (SQLite has no schemas). Times are integer milliseconds since the Unix epoch, UTC,
//! taken from SQLite's clock inside each statement.

mod busy;
mod claim;
mod decode;
mod enqueue;
mod error;
mod ops;
mod ordering;
mod registry;
mod replay;
mod retention;
mod schema;
mod settle;
#[cfg(test)]
mod tests;
mod topics;
mod views;
mod wakeup;

use super::{CLAIMED_SQL, PENDING_SQL, StoreConfig};
use crate::error::Result;
use claim::claim_sql;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};
use std::str::FromStr;
use std::sync::Arc;

/// Schema version this build creates and expects (4: the consumer inbox; 5: topic pauses
/// carry their regex, so the claim itself honours them; 6: the `messages_key` index of
/// per-key ordering; 7 and 8: the registry's destinations and instances; 9: a claim
/// writes no column an index reads).
pub const SCHEMA_VERSION: i64 = 9;

/// The database clock in integer milliseconds (UTC); constant within one statement.
const NOW_MS: &str = super::SQLITE_NOW_MS;

struct Sql {
    enqueue: SqlStr,
    existing_id: SqlStr,
    claim: SqlStr,
    settle: SqlStr,
    renew: SqlStr,
    pause_state: SqlStr,
    topic_pauses: SqlStr,
    set_pause: SqlStr,
    counts: SqlStr,
    purge: SqlStr,
    leases: SqlStr,
    inbox_accept: SqlStr,
    inbox_purge: SqlStr,
}

impl Sql {
    fn new(p: &str) -> Self {
        let q = |text: String| AssertSqlSafe(text).into_sql_str();
        let n = NOW_MS;
        Sql {
            enqueue: q(format!(
                "INSERT INTO {p}_messages (message_id, topic, key, payload, headers, available_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, coalesce(?6, {n} + ?7))
                 ON CONFLICT (message_id) DO NOTHING RETURNING id"
            )),
            existing_id: q(format!("SELECT id FROM {p}_messages WHERE message_id = ?1")),
            claim: q(claim_sql(p, 0)),
            // A claim's whole outcome in one statement; ?1 is a JSON array of
            // [id, status, delay_ms, error or null, refund].
            settle: q(format!(
                "UPDATE {p}_messages AS m
                 SET status = x.st,
                     available_at = CASE WHEN x.st = 0 THEN {n} + x.delay_ms
                                         WHEN x.st = 3 THEN {n} ELSE m.available_at END,
                     attempts = CASE WHEN x.refund THEN max(m.attempts - 1, 0) ELSE m.attempts END,
                     dispatched_at = CASE WHEN x.st = 2 THEN {n} ELSE m.dispatched_at END,
                     last_error = CASE WHEN x.st = 2 THEN NULL ELSE coalesce(x.err, m.last_error) END,
                     locked_until = NULL, claim_token = NULL
                 FROM (SELECT json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS st,
                              json_extract(value, '$[2]') AS delay_ms, json_extract(value, '$[3]') AS err,
                              json_extract(value, '$[4]') AS refund
                       FROM json_each(?1)) AS x
                 WHERE m.id = x.id AND m.claim_token = ?2 AND m.status <= 1
                 RETURNING id"
            )),
            renew: q(format!(
                "UPDATE {p}_messages SET locked_until = {n} + ?2
                 WHERE id IN (SELECT value FROM json_each(?3)) AND claim_token = ?1 AND status <= 1
                 RETURNING id"
            )),
            pause_state: q(format!(
                "SELECT c.paused, c.reason, c.changed_at,
                        (SELECT json_group_array(json_array(pattern, reason, paused_by, paused_at))
                         FROM {p}_topic_pauses)
                 FROM {p}_control c WHERE c.id = 1"
            )),
            topic_pauses: q(format!("SELECT pattern, regex FROM {p}_topic_pauses")),
            set_pause: q(format!(
                "UPDATE {p}_control SET paused = ?1, reason = ?2, changed_at = {n} WHERE id = 1"
            )),
            counts: q(format!(
                "SELECT coalesce(sum({PENDING_SQL}), 0), coalesce(sum({CLAIMED_SQL}), 0),
                        coalesce(sum(status = 2), 0), coalesce(sum(status = 3), 0),
                        CAST(({n} - min(CASE WHEN {PENDING_SQL} THEN occurred_at END)) / 1000 AS INTEGER)
                 FROM {p}_messages"
            )),
            purge: q(format!(
                "DELETE FROM {p}_messages WHERE id IN (
                   SELECT id FROM {p}_messages
                   WHERE status = 2 AND dispatched_at < {n} - ?1
                   ORDER BY id LIMIT ?2)"
            )),
            // NOW_MS is one value per statement.
            leases: q(format!(
                "SELECT count(*), max(locked_until), max(locked_until) - {n}
                 FROM {p}_messages WHERE {CLAIMED_SQL} AND locked_until > {n}"
            )),
            // Insert first; the write lock serialises concurrent accepts, and a duplicate
            // changes no row (no error, the transaction goes on).
            inbox_accept: q(format!(
                "INSERT INTO {p}_inbox (consumer, message_id) VALUES (?1, ?2)
                 ON CONFLICT (consumer, message_id) DO NOTHING"
            )),
            inbox_purge: q(format!(
                "DELETE FROM {p}_inbox WHERE rowid IN (
                   SELECT rowid FROM {p}_inbox WHERE received_at < {n} - ?1
                   ORDER BY received_at LIMIT ?2)"
            )),
        }
    }
}

struct Inner {
    pool: SqlitePool,
    options: SqliteConnectOptions,
    config: StoreConfig,
    sql: Sql,
    wakeup: super::Wakeup,
}

/// The SQLite store. Cheap to clone.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

crate::store::debug_by_schema!(SqliteStore);

/// Connection options every connection of the store gets: WAL, `synchronous = FULL` (a
/// commit that returned survives a power cut), a 5 s busy timeout, foreign keys on.
/// Applications that enqueue through their own pool should use the same.
///
/// # Errors
/// [`Error::Database`](crate::Error::Database) when `url` is not a SQLite URL.
pub fn connect_options(url: &str) -> Result<SqliteConnectOptions> {
    Ok(SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(busy::BUSY_TIMEOUT)
        .foreign_keys(true)
        .with_regexp())
}

impl SqliteStore {
    /// Opens (creating when missing) the database at `url` (`sqlite://PATH`).
    ///
    /// # Errors
    /// Database errors when the file cannot be opened.
    pub async fn connect(url: &str, config: StoreConfig) -> Result<Self> {
        let options = connect_options(url)?;
        let wakeup = super::Wakeup::new();
        let bump = wakeup.bumper();
        let p = config.schema.as_str().to_owned();
        // The acquire bound covers waiting for one of the four connections and opening
        // one; a statement waiting for the write lock is bounded by the busy timeout.
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .acquire_timeout(super::ACQUIRE_TIMEOUT)
            .after_connect(move |conn, _| {
                let bump = bump.clone();
                let p = p.clone();
                Box::pin(async move {
                    wakeup::wake_on_commit(conn, &p, bump).await;
                    Ok(())
                })
            })
            .connect_with(options.clone())
            .await?;
        Ok(Self::with_wakeup(pool, options, config, wakeup))
    }

    /// Uses an existing pool; `options` name the database file the wake-up watcher
    /// watches. Commits on this pool's connections wake the store's relays through the
    /// file watch only (a pool from [`SqliteStore::connect`] wakes them at the commit).
    pub fn from_pool(pool: SqlitePool, options: SqliteConnectOptions, config: StoreConfig) -> Self {
        Self::with_wakeup(pool, options, config, super::Wakeup::new())
    }

    fn with_wakeup(
        pool: SqlitePool,
        options: SqliteConnectOptions,
        config: StoreConfig,
        wakeup: super::Wakeup,
    ) -> Self {
        let sql = Sql::new(config.schema.as_str());
        SqliteStore {
            inner: Arc::new(Inner {
                pool,
                options,
                config,
                sql,
                wakeup,
            }),
        }
    }

    /// The pool this store uses.
    pub fn pool(&self) -> &SqlitePool {
        &self.inner.pool
    }

    /// The store's settings.
    pub fn config(&self) -> &StoreConfig {
        &self.inner.config
    }

    fn p(&self) -> &str {
        self.inner.config.schema.as_str()
    }
}

fn ids_json(ids: &[i64]) -> String {
    serde_json::Value::from(ids.to_vec()).to_string()
}

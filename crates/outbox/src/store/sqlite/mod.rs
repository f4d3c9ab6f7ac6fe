//! SQLite store, the embedded default: WAL, a busy handler and pragmas on every
//! connection, claims by one `UPDATE … RETURNING`, wake-up by the WAL hook of the store's
//! own connections (this process's commits) and by watching the database and WAL files
//! (every commit, from any process, changes one of them).
//!
//! Tables are named `{prefix}_messages`, `{prefix}_control`, `{prefix}_schema_migrations`,
//! `{prefix}_inbox` (the consumer inbox), … (SQLite has no schemas). Times are integer milliseconds since the Unix epoch, UTC,
//! taken from SQLite's clock inside each statement.

mod busy;
mod decode;
mod error;
mod ops;
mod ordering;
mod registry;
mod retention;
mod schema;
#[cfg(test)]
mod tests;
mod topics;
mod views;
mod wakeup;

use super::seam::Relaying;
use super::{Claim, ClaimRequest, PauseState, Settled, Settlement, StoreConfig, millis};
use crate::error::{Error, Result};
use crate::inbox::Accepted;
use crate::message::{Enqueued, Message};
use crate::sink::router::TopicPattern;
use async_trait::async_trait;
use decode::ms_to_time;
use error::regexp_refused;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Row, SqlSafeStr, SqlStr, Sqlite, Transaction};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use uuid::Uuid;

/// Schema version this build creates and expects (4: the consumer inbox; 5: topic pauses
/// carry their regex, so the claim itself honours them; 6: the `messages_key` index of
/// per-key ordering).
pub const SCHEMA_VERSION: i64 = 8;

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
                 WHERE m.id = x.id AND m.claim_token = ?2 AND m.status = 1
                 RETURNING id"
            )),
            renew: q(format!(
                "UPDATE {p}_messages SET locked_until = {n} + ?2, available_at = {n} + ?2
                 WHERE id IN (SELECT value FROM json_each(?3)) AND claim_token = ?1 AND status = 1
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
                "SELECT coalesce(sum(status = 0), 0), coalesce(sum(status = 1), 0),
                        coalesce(sum(status = 2), 0), coalesce(sum(status = 3), 0),
                        CAST(({n} - min(CASE WHEN status = 0 THEN occurred_at END)) / 1000 AS INTEGER)
                 FROM {p}_messages"
            )),
            purge: q(format!(
                "DELETE FROM {p}_messages WHERE id IN (
                   SELECT id FROM {p}_messages
                   WHERE status = 2 AND dispatched_at < {n} - ?1
                   ORDER BY id LIMIT ?2)"
            )),
            // On a claimed row available_at is the lease end; NOW_MS is one value per statement.
            leases: q(format!(
                "SELECT count(*), max(available_at), max(available_at) - {n}
                 FROM {p}_messages WHERE status = 1 AND available_at > {n}"
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

/// The claim statement; with `skip` topic regexes bound as ?5, ?6, … (the topic pauses,
/// read in the claim's transaction, and any the caller adds). It honours the pause switch
/// itself (an uncorrelated subquery SQLite evaluates once per statement). The regexes are
/// bound rather than joined from the pauses table: SQLite keeps a compiled pattern only
/// for a constant argument, so a pattern from a column would be compiled again per row.
fn claim_sql(p: &str, skip: usize) -> String {
    let n = NOW_MS;
    let skip: String = (0..skip)
        .map(|i| format!(" AND topic NOT REGEXP ?{}", i + 5))
        .collect();
    format!(
        "UPDATE {p}_messages
         SET status = 1, attempts = min(attempts, 2147483646) + 1, claimed_by = ?1, claim_token = ?2,
             locked_until = {n} + ?3, available_at = {n} + ?3
         WHERE id IN (SELECT id FROM {p}_messages
                      WHERE status <= 1 AND available_at <= {n}{skip}
                        AND NOT EXISTS (SELECT 1 FROM {p}_control c WHERE c.id = 1 AND c.paused)
                      ORDER BY available_at, id LIMIT ?4)
         RETURNING id, message_id, topic, key, payload, headers, occurred_at, attempts, {n} AS now_ms"
    )
}

/// `column REGEXP ?first OR …` over `count` parameters from `?first` (`0`, false, when
/// `count` is 0).
fn regexp_any(column: &str, first: usize, count: usize) -> String {
    if count == 0 {
        return "0".to_owned();
    }
    (first..first + count)
        .map(|i| format!("{column} REGEXP ?{i}"))
        .collect::<Vec<_>>()
        .join(" OR ")
}

/// The ordered claim's first step ([`super::KeyOrdering`]): the due rows as [`claim_sql`]
/// selects them, with whether each is of an ordered key, less the rows of an ordered key
/// whose first row not dispatched (its head) comes after them in the claim's order
/// (claimed under a live lease, waiting for a retry, given back later) or is dead when dead
/// rows hold their key: a blocked key never fills the claim, and a row taken has its key's
/// head before it, so every key makes progress. `?1` is the limit, `?2 … ?{ordered+1}` the ordered topics' regexes, then `skip`
/// regexes to pass over (the topic pauses).
fn claim_ordered_select(p: &str, ordered: usize, skip: usize, skip_dead: bool) -> String {
    let n = NOW_MS;
    let ord = regexp_any("topic", 2, ordered);
    let skip: String = (0..skip)
        .map(|i| format!(" AND topic NOT REGEXP ?{}", i + 2 + ordered))
        .collect();
    let dead_h = if skip_dead { " AND h.status <> 3" } else { "" };
    format!(
        "SELECT id, CAST(topic AS BLOB), CAST(key AS BLOB), (key IS NOT NULL AND ({ord})) AS ord
         FROM {p}_messages m
         WHERE status <= 1 AND available_at <= {n}{skip}
           AND NOT EXISTS (SELECT 1 FROM {p}_control c WHERE c.id = 1 AND c.paused)
           AND (key IS NULL OR NOT ({ord}) OR coalesce(
                 (SELECT h.status = 3 OR h.available_at > m.available_at FROM {p}_messages h
                  WHERE h.topic = m.topic AND h.key = m.key AND h.status <> 2{dead_h}
                  ORDER BY h.id LIMIT 1), 0) = 0)
         ORDER BY available_at, id LIMIT ?1"
    )
}

/// The ordered claim's second step: per key of `?2` (a JSON array of `[topic, key]`), its
/// fence, the first row not dispatched (nor dead, with `skip_dead`) outside the first
/// step's rows `?1` (cut off by the limit, or not ready). Rows before it are taken.
fn claim_fence_sql(p: &str, skip_dead: bool) -> String {
    let dead_e = if skip_dead { " AND e.status <> 3" } else { "" };
    format!(
        "WITH k(topic, key) AS (
           SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each(?2))
         SELECT k.topic, k.key,
                (SELECT e.id FROM {p}_messages e
                 WHERE e.topic = k.topic AND e.key = k.key AND e.status <> 2{dead_e}
                   AND e.id NOT IN (SELECT value FROM json_each(?1))
                 ORDER BY e.id LIMIT 1) AS fence
         FROM k"
    )
}

/// The ordered claim's last step: claims the rows of `?4` (a JSON array of ids).
fn claim_ids_sql(p: &str) -> String {
    let n = NOW_MS;
    format!(
        "UPDATE {p}_messages
         SET status = 1, attempts = min(attempts, 2147483646) + 1, claimed_by = ?1, claim_token = ?2,
             locked_until = {n} + ?3, available_at = {n} + ?3
         WHERE id IN (SELECT value FROM json_each(?4))
         RETURNING id, message_id, topic, key, payload, headers, occurred_at, attempts, {n} AS now_ms"
    )
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

/// Connection options every connection of the store gets: WAL, `synchronous = FULL` (a
/// commit that returned survives a power cut), a 5 s busy timeout, foreign keys on.
/// Applications that enqueue through their own pool should use the same.
///
/// # Errors
/// [`Error::Database`] when `url` is not a SQLite URL.
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

    /// Enqueues `msg` inside the caller's transaction; idempotent on the message id (an
    /// existing row comes back with `inserted: false`).
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] / [`Error::MessageTooLarge`] before any SQL runs;
    /// [`Error::Database`] from the insert.
    pub async fn enqueue(
        &self,
        tx: &mut Transaction<'_, Sqlite>,
        msg: &Message,
    ) -> Result<Enqueued> {
        msg.validate(self.inner.config.max_message_bytes)?;
        let mid = msg.message_id.hyphenated().to_string();
        let inserted: Option<i64> = sqlx::query_scalar(self.inner.sql.enqueue.clone())
            .bind(&mid)
            .bind(&msg.topic)
            .bind(msg.key.as_deref())
            .bind(msg.payload.as_ref())
            .bind(msg.headers_json().to_string())
            .bind(msg.available_at.map(|t| t.timestamp_millis()))
            .bind(msg.delay_ms())
            .fetch_optional(&mut **tx)
            .await?;
        let (id, inserted) = match inserted {
            Some(id) => (id, true),
            None => (
                sqlx::query_scalar(self.inner.sql.existing_id.clone())
                    .bind(&mid)
                    .fetch_one(&mut **tx)
                    .await?,
                false,
            ),
        };
        Ok(Enqueued {
            id,
            message_id: msg.message_id,
            inserted,
        })
    }

    /// Accepts the message (an [`Envelope`](crate::Envelope) or its id) for `consumer` inside the consumer's transaction (see
    /// [`crate::inbox`]): inserts the inbox row first, under the primary key
    /// `(consumer, message_id)`, with `ON CONFLICT DO NOTHING`. [`Accepted::Fresh`] means
    /// do the work in this transaction; [`Accepted::Duplicate`] means it was done: skip it.
    /// SQLite's write lock serialises concurrent accepts (the second waits up to the busy
    /// timeout for the first to commit). No error on a duplicate, so the transaction stays
    /// usable; a rollback removes the row with the rest. A transaction that reads before
    /// it accepts should begin with `BEGIN IMMEDIATE` (`pool.begin_with("BEGIN
    /// IMMEDIATE")`), or its upgrade to a writer can fail with `SQLITE_BUSY` at once.
    ///
    /// Message ids are stored as hyphenated lower-case text (as in `{prefix}_messages`);
    /// other languages accept with `INSERT INTO {prefix}_inbox (consumer, message_id)
    /// VALUES (?, ?) ON CONFLICT DO NOTHING` and read `changes()` (1 = fresh).
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] for a consumer name that is empty, over 255 bytes or
    /// holds a control character, before any SQL runs; [`Error::Database`] from the insert
    /// (`SQLITE_BUSY` past the busy timeout).
    pub async fn inbox_accept(
        &self,
        tx: &mut Transaction<'_, Sqlite>,
        consumer: &str,
        message: impl crate::inbox::Incoming,
    ) -> Result<Accepted> {
        let message_id = message.message_id();
        crate::inbox::validate_consumer(consumer)?;
        let r = sqlx::query(self.inner.sql.inbox_accept.clone())
            .bind(consumer)
            .bind(message_id.hyphenated().to_string())
            .execute(&mut **tx)
            .await?;
        Ok(Accepted::from_rows(r.rows_affected()))
    }
}

fn ids_json(ids: &[i64]) -> String {
    serde_json::Value::from(ids.to_vec()).to_string()
}

impl SqliteStore {
    /// The plans SQLite chooses for the ordered claim's two reads of `req` (the candidates,
    /// then the fences), as `EXPLAIN QUERY PLAN` details joined by newlines: which
    /// indexes an ordered claim reads, for tests and for operators checking a large file.
    ///
    /// # Errors
    /// Database errors.
    pub async fn explain_ordered_claim(&self, req: &ClaimRequest) -> Result<String> {
        let regexes = req.ordering.regexes();
        let skip_dead = req.ordering.skip_dead;
        let select = claim_ordered_select(self.p(), regexes.len(), 0, skip_dead);
        let mut query = sqlx::query(AssertSqlSafe(format!("EXPLAIN QUERY PLAN {select}")))
            .bind(i64::from(req.batch_size));
        for re in &regexes {
            query = query.bind(re.as_str());
        }
        let mut lines: Vec<String> = Vec::new();
        for r in query.fetch_all(&self.inner.pool).await? {
            lines.push(r.try_get("detail")?);
        }
        let fence = claim_fence_sql(self.p(), skip_dead);
        let rows = sqlx::query(AssertSqlSafe(format!("EXPLAIN QUERY PLAN {fence}")))
            .bind("[1]")
            .bind(r#"[["t","k"]]"#)
            .fetch_all(&self.inner.pool)
            .await?;
        for r in rows {
            lines.push(r.try_get("detail")?);
        }
        Ok(lines.join("\n"))
    }

    /// One claim (see [`Relaying::claim`]).
    async fn claim_once(&self, req: &ClaimRequest) -> Result<Claim> {
        let token = Uuid::now_v7();
        // BEGIN IMMEDIATE takes the write lock up front (waiting under the busy timeout),
        // so the claim never fails half-way as a read that cannot upgrade to a write.
        let mut tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await?;
        // The topic pauses, under the same write lock as the claim.
        let pauses: Vec<(String, Option<String>)> =
            sqlx::query_as(self.inner.sql.topic_pauses.clone())
                .fetch_all(&mut *tx)
                .await?;
        let mut skip: Vec<String> = req.skip_topics.iter().map(TopicPattern::regex).collect();
        for (pattern, regex) in pauses {
            skip.push(regex.unwrap_or_else(|| super::pause_regex(&pattern)));
        }
        if req.ordering.is_on() {
            let ids = Self::claim_ordered_ids(&mut tx, self.p(), req, &skip).await?;
            let rows = if ids.is_empty() {
                Vec::new()
            } else {
                Self::claim_ids(&mut tx, self.p(), req, token, &ids).await?
            };
            tx.commit().await?;
            return Ok(Self::claim_of(token, &rows));
        }
        let sql = if skip.is_empty() {
            self.inner.sql.claim.clone()
        } else {
            AssertSqlSafe(claim_sql(self.p(), skip.len())).into_sql_str()
        };
        let mut query = sqlx::query(sql)
            .bind(&req.relay_id)
            .bind(token.hyphenated().to_string())
            .bind(millis(req.lease))
            .bind(i64::from(req.batch_size));
        for re in skip {
            query = query.bind(re);
        }
        let rows = query.fetch_all(&mut *tx).await?;
        tx.commit().await?;
        Ok(Self::claim_of(token, &rows))
    }

    /// The claim when the `REGEXP` function refused a topic that is not UTF-8 (it fails
    /// the whole statement, and would fail every claim that reads that row: the ordered
    /// claim and topic pauses match topics against patterns). The due rows whose topic is
    /// not UTF-8 are claimed (up to the batch size), to come back malformed and be
    /// quarantined; the next claim takes the rest. Nothing while the pause switch is on.
    /// `None` when no due row has such a topic (the error was something else).
    async fn claim_unmatchable_topics(&self, req: &ClaimRequest) -> Result<Option<Claim>> {
        let token = Uuid::now_v7();
        let p = self.p();
        let mut tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await?;
        let paused: bool = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT EXISTS (SELECT 1 FROM {p}_control WHERE id = 1 AND paused)"
        )))
        .fetch_one(&mut *tx)
        .await?;
        if paused {
            return Ok(Some(Self::claim_of(token, &[])));
        }
        let due: Vec<(i64, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, CAST(topic AS BLOB) FROM {p}_messages
             WHERE status <= 1 AND available_at <= {NOW_MS} ORDER BY available_at, id"
        )))
        .fetch_all(&mut *tx)
        .await?;
        let ids: Vec<i64> = due
            .into_iter()
            .filter(|(_, topic)| std::str::from_utf8(topic).is_err())
            .map(|(id, _)| id)
            .take(req.batch_size as usize)
            .collect();
        if ids.is_empty() {
            return Ok(None);
        }
        let rows = Self::claim_ids(&mut tx, p, req, token, &ids).await?;
        tx.commit().await?;
        Ok(Some(Self::claim_of(token, &rows)))
    }

    /// Claims the rows `ids` for `req` under `token` ([`claim_ids_sql`]), returning them.
    async fn claim_ids(
        tx: &mut Transaction<'static, Sqlite>,
        p: &str,
        req: &ClaimRequest,
        token: Uuid,
        ids: &[i64],
    ) -> Result<Vec<SqliteRow>> {
        Ok(sqlx::query(AssertSqlSafe(claim_ids_sql(p)))
            .bind(&req.relay_id)
            .bind(token.hyphenated().to_string())
            .bind(millis(req.lease))
            .bind(ids_json(ids))
            .fetch_all(&mut **tx)
            .await?)
    }

    /// The claim of the rows the claim statement returned.
    fn claim_of(token: Uuid, rows: &[SqliteRow]) -> Claim {
        let mut claim = super::claim_from_rows(token, rows, Self::row_to_message, |r| {
            r.try_get::<i64, _>("id").unwrap_or(-1)
        });
        claim.db_now = rows
            .first()
            .and_then(|r| r.try_get::<i64, _>("now_ms").ok())
            .map(ms_to_time);
        claim
    }

    /// The ids an ordered claim takes, in the claim's transaction (which holds the write
    /// lock, so nothing changes between the steps): see [`claim_ordered_select`] and
    /// [`claim_fence_sql`].
    async fn claim_ordered_ids(
        tx: &mut Transaction<'static, Sqlite>,
        p: &str,
        req: &ClaimRequest,
        skip: &[String],
    ) -> Result<Vec<i64>> {
        let regexes = req.ordering.regexes();
        let sql = claim_ordered_select(p, regexes.len(), skip.len(), req.ordering.skip_dead);
        // Topic and key as bytes: a row written by hand with a BLOB or non-UTF-8 topic or
        // key must not fail the claim (it is claimed as unordered, then quarantined as
        // malformed when read).
        let mut query =
            sqlx::query_as::<_, (i64, Vec<u8>, Option<Vec<u8>>, bool)>(AssertSqlSafe(sql))
                .bind(i64::from(req.batch_size));
        for re in regexes.iter().chain(skip) {
            query = query.bind(re.as_str());
        }
        let cand: Vec<(i64, String, Option<String>, bool)> = query
            .fetch_all(&mut **tx)
            .await?
            .into_iter()
            .map(|(id, topic, key, ord)| {
                let topic = String::from_utf8(topic).ok();
                let key = key.map(String::from_utf8);
                match (topic, key) {
                    (Some(t), Some(Ok(k))) => (id, t, Some(k), ord),
                    (Some(t), None) => (id, t, None, ord),
                    _ => (id, String::new(), None, false),
                }
            })
            .collect();
        let mut keys: Vec<(&str, &str)> = cand
            .iter()
            .filter(|c| c.3)
            .filter_map(|(_, t, k, _)| Some((t.as_str(), k.as_deref()?)))
            .collect();
        keys.sort_unstable();
        keys.dedup();
        if keys.is_empty() {
            return Ok(cand.into_iter().map(|c| c.0).collect());
        }
        let all: Vec<i64> = cand.iter().map(|c| c.0).collect();
        let fences: Vec<(String, String, Option<i64>)> =
            sqlx::query_as(AssertSqlSafe(claim_fence_sql(p, req.ordering.skip_dead)))
                .bind(ids_json(&all))
                .bind(serde_json::to_string(&keys).unwrap_or_default())
                .fetch_all(&mut **tx)
                .await?;
        let fence: std::collections::HashMap<(String, String), i64> = fences
            .into_iter()
            .filter_map(|(t, k, f)| Some(((t, k), f?)))
            .collect();
        Ok(cand
            .into_iter()
            .filter(|(id, t, k, ord)| {
                !*ord
                    || k.as_ref()
                        .and_then(|k| fence.get(&(t.clone(), k.clone())))
                        .is_none_or(|f| id < f)
            })
            .map(|c| c.0)
            .collect())
    }
}

#[async_trait]
impl Relaying for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn check_schema(&self) -> Result<()> {
        SqliteStore::check_schema(self).await
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim> {
        match self.claim_once(req).await {
            Err(Error::Database(e)) if regexp_refused(&e) => self
                .claim_unmatchable_topics(req)
                .await?
                .ok_or(Error::Database(e)),
            claimed => claimed,
        }
    }

    async fn settle(&self, token: Uuid, settlement: &Settlement) -> Result<Settled> {
        if settlement.delete_dispatched && !settlement.dispatched.is_empty() {
            return super::settle_deleting(self, token, settlement).await;
        }
        if settlement.is_empty() {
            return Ok(Settled::default());
        }
        let rows: Vec<serde_json::Value> = super::settle_rows(settlement)
            .into_iter()
            .map(|(id, st, delay, err, refund)| serde_json::json!([id, st, delay, err, refund]))
            .collect();
        let changed: Vec<i64> = sqlx::query_scalar(self.inner.sql.settle.clone())
            .bind(serde_json::Value::from(rows).to_string())
            .bind(token.hyphenated().to_string())
            .fetch_all(&self.inner.pool)
            .await?;
        Ok(super::settled(settlement, changed))
    }

    async fn delete_claimed(&self, token: Uuid, ids: &[i64]) -> Result<Vec<i64>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let p = &self.inner.config.schema;
        Ok(sqlx::query_scalar(AssertSqlSafe(format!(
            "DELETE FROM {p}_messages
             WHERE id IN (SELECT value FROM json_each(?2)) AND claim_token = ?1 AND status = 1
             RETURNING id"
        )))
        .bind(token.hyphenated().to_string())
        .bind(ids_json(ids))
        .fetch_all(&self.inner.pool)
        .await?)
    }

    async fn renew(&self, token: Uuid, ids: &[i64], lease: Duration) -> Result<Vec<i64>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        Ok(sqlx::query_scalar(self.inner.sql.renew.clone())
            .bind(token.hyphenated().to_string())
            .bind(millis(lease))
            .bind(ids_json(ids))
            .fetch_all(&self.inner.pool)
            .await?)
    }

    async fn pause_state(&self) -> Result<PauseState> {
        SqliteStore::pause_state(self).await
    }

    fn wakeups(&self) -> watch::Receiver<u64> {
        self.start_watcher();
        self.inner.wakeup.subscribe()
    }

    fn one_writer(&self) -> bool {
        true
    }
}

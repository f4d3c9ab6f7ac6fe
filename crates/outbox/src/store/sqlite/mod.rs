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
mod ordering;
mod retention;
mod schema;
#[cfg(test)]
mod tests;
mod topics;
mod wakeup;

use super::ops::{self, Dialect};
use super::seam::{Operations, Registry, Relaying, Views};
use super::{
    Claim, ClaimRequest, ClaimsBy, Counts, DeadLetter, DeadSelector, DueHeld, HeldKeys,
    KeyOrdering, Leases, Overview, PARKED_AT_MS, PauseState, RelayHeartbeat, RelayRecord,
    ReplayAction, ReplayOutcome, ReplayRecord, ReplayRequest, Settled, Settlement, StoreConfig,
    TopicPause, millis,
};
use crate::error::{Error, Result};
use crate::inbox::Accepted;
use crate::message::{Enqueued, Message};
use crate::sink::router::TopicPattern;
use async_trait::async_trait;
use chrono::{DateTime, Utc};
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
use topics::{dead_topics, topic_in};
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

/// [`ops::dead_filter`] for SQLite, with the topic pattern matched by [`dead_topics`].
async fn dead_filter(
    conn: &mut sqlx::SqliteConnection,
    p: &str,
    sel: &DeadSelector,
) -> Result<(String, Vec<String>)> {
    let Some(pattern) = &sel.topic else {
        return Ok(ops::dead_filter(sel, Dialect::Sqlite, 1));
    };
    let rest = DeadSelector {
        topic: None,
        ..sel.clone()
    };
    let (mut filter, mut binds) = ops::dead_filter(&rest, Dialect::Sqlite, 1);
    filter.push_str(&format!(" AND {}", topic_in("topic", "?")));
    binds.push(dead_topics(conn, p, |t| pattern.matches(t)).await?);
    Ok((filter, binds))
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
        let (paused, reason, changed_at, topics): (bool, Option<String>, i64, String) =
            sqlx::query_as(self.inner.sql.pause_state.clone())
                .fetch_one(&self.inner.pool)
                .await?;
        let mut topics: Vec<(String, String, String, i64)> =
            serde_json::from_str(&topics).unwrap_or_default();
        topics.sort();
        Ok(PauseState {
            paused,
            reason,
            changed_at: Some(ms_to_time(changed_at)),
            topics: topics
                .into_iter()
                .map(|(pattern, reason, by, at)| TopicPause {
                    pattern,
                    reason,
                    by,
                    paused_at: ms_to_time(at),
                })
                .collect(),
        })
    }

    fn wakeups(&self) -> watch::Receiver<u64> {
        self.start_watcher();
        self.inner.wakeup.subscribe()
    }

    fn one_writer(&self) -> bool {
        true
    }
}

#[async_trait]
impl Registry for SqliteStore {
    async fn heartbeat(&self, beat: &RelayHeartbeat) -> Result<()> {
        let p = self.p();
        let n = NOW_MS;
        let mut tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {p}_relays (relay_id, host, pid, version, sink, in_flight, started_at,
                                     last_seen, last_claim_at, destinations, instance, lease_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, {n}, {n}, CASE WHEN ?7 IS NULL THEN NULL ELSE {n} - ?7 END, ?8,
                     ?9, ?10)
             ON CONFLICT (relay_id, instance) DO UPDATE SET lease_ms = excluded.lease_ms,
                 host = excluded.host, pid = excluded.pid, version = excluded.version,
                 sink = excluded.sink, in_flight = excluded.in_flight,
                 last_seen = excluded.last_seen, last_claim_at = excluded.last_claim_at,
                 destinations = excluded.destinations"
        )))
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
        .execute(&mut *tx)
        .await?;
        sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {p}_relays WHERE last_seen < {n} - 3600000"
        )))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn deregister(&self, relay_id: &str, instance: &str) -> Result<()> {
        let p = self.p();
        sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {p}_relays WHERE relay_id = ?1 AND instance = ?2"
        )))
        .bind(relay_id)
        .bind(instance)
        .execute(&self.inner.pool)
        .await?;
        Ok(())
    }

    async fn relays(&self, within: Duration) -> Result<Vec<RelayRecord>> {
        let p = self.p();
        let n = NOW_MS;
        type Row = (
            String,
            String,
            i64,
            String,
            String,
            i64,
            i64,
            i64,
            i64,
            Option<i64>,
            Option<String>,
            String,
        );
        let rows: Vec<Row> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT relay_id, host, pid, version, sink, in_flight, started_at, last_seen,
                    {n} - last_seen, last_claim_at, destinations, instance
             FROM {p}_relays WHERE last_seen >= {n} - ?1
             ORDER BY started_at, relay_id, instance"
        )))
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
                started_at: ms_to_time(r.6),
                last_seen: ms_to_time(r.7),
                last_seen_ago_s: r.8.max(0) as f64 / 1000.0,
                last_claim_at: r.9.map(ms_to_time),
                destinations: super::ops::parse_destinations(r.10.as_deref()),
            })
            .collect())
    }
}

#[async_trait]
impl Operations for SqliteStore {
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
        let p = self.p();
        let mut conn = self.inner.pool.acquire().await?;
        let (filter, binds) = dead_filter(&mut conn, p, selector).await?;
        let payload = if with_payload { "payload" } else { "NULL" };
        let sql = format!(
            "SELECT id, message_id, CAST(topic AS BLOB) AS topic, CAST(key AS BLOB) AS key,
                    attempts, occurred_at, available_at, last_error,
                    CAST(headers AS BLOB) AS headers, length(payload) AS payload_bytes,
                    {payload} AS payload, replay_id,
                    (SELECT count(*) FROM {p}_messages l
                     WHERE l.topic = m.topic AND l.key = m.key AND l.status <> 2
                       AND l.status <= 1 AND l.id > m.id) AS waiting_behind
             FROM {p}_messages m WHERE {filter} ORDER BY id LIMIT {limit}"
        );
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for b in binds {
            query = query.bind(b);
        }
        let rows = query.fetch_all(&mut *conn).await?;
        rows.iter()
            .map(|r| {
                let mid: String = r.try_get("message_id")?;
                Ok(DeadLetter {
                    id: r.try_get("id")?,
                    message_id: Uuid::parse_str(&mid).unwrap_or_default(),
                    // Text as bytes: a malformed row's text may not be UTF-8, shown with
                    // U+FFFD for what is not rather than failing the whole list.
                    topic: super::lossy(r.try_get("topic")?),
                    key: r.try_get::<Option<Vec<u8>>, _>("key")?.map(super::lossy),
                    attempts: r.try_get("attempts")?,
                    occurred_at: ms_to_time(r.try_get("occurred_at")?),
                    died_at: ms_to_time(r.try_get("available_at")?),
                    last_error: r.try_get("last_error")?,
                    headers: super::lossy(r.try_get("headers")?),
                    payload_bytes: r.try_get("payload_bytes")?,
                    payload: r.try_get("payload")?,
                    replay_id: r.try_get("replay_id")?,
                    waiting_behind: r.try_get("waiting_behind")?,
                })
            })
            .collect()
    }

    async fn count_dead(&self, selector: &DeadSelector) -> Result<u64> {
        let p = self.p();
        let mut conn = self.inner.pool.acquire().await?;
        let (filter, binds) = dead_filter(&mut conn, p, selector).await?;
        let sql = format!("SELECT count(*) FROM {p}_messages WHERE {filter}");
        let mut query = sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql));
        for b in binds {
            query = query.bind(b);
        }
        Ok(u64::try_from(query.fetch_one(&mut *conn).await?).unwrap_or(0))
    }

    async fn replay(&self, req: &ReplayRequest) -> Result<ReplayOutcome> {
        ops::validate(req)?;
        let p = self.p();
        let n = NOW_MS;
        let mut tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await?;
        let refused = if let Some(filter) = ops::named_filter(&req.selector, Dialect::Sqlite) {
            let rows: Vec<(i64, String, i16)> = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT id, message_id, status FROM {p}_messages WHERE {filter}"
            )))
            .fetch_all(&mut *tx)
            .await?;
            let found: Vec<(i64, Uuid, i16)> = rows
                .into_iter()
                .map(|(id, m, st)| (id, Uuid::parse_str(&m).unwrap_or_default(), st))
                .collect();
            ops::refusals(&req.selector, &found)
        } else {
            Vec::new()
        };
        let (filter, binds) = dead_filter(&mut tx, p, &req.selector).await?;
        let limit = req.limit.map_or(i64::MAX, i64::from);
        let mut query = sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!(
            "SELECT id FROM {p}_messages WHERE {filter} ORDER BY id LIMIT {limit}"
        )));
        for b in binds {
            query = query.bind(b);
        }
        let ids = query.fetch_all(&mut *tx).await?;
        let sample: Vec<i64> = ids.iter().take(20).copied().collect();
        ops::check_spread(ids.len(), req.rate_per_s)?;
        if req.dry_run || ids.is_empty() {
            return Ok(ReplayOutcome {
                replay_id: None,
                count: ids.len() as u64,
                sample,
                refused,
            });
        }
        let replay_id: i64 = match req.append_to {
            Some(id) => id,
            None => {
                sqlx::query_scalar(AssertSqlSafe(format!(
                    "INSERT INTO {p}_replays (requested_by, reason, action, selection)
                     VALUES (?1, ?2, ?3, ?4) RETURNING id"
                )))
                .bind(&req.by)
                .bind(&req.reason)
                .bind(req.action.as_str())
                .bind(req.describe())
                .fetch_one(&mut *tx)
                .await?
            }
        };
        // The keyed rows among them, whose parked followers are given back below. A key
        // that is not UTF-8 is left out (its followers, malformed too, come back with the
        // relays' periodic give-back of what no dead letter holds).
        let keyed: Vec<(i64, Vec<u8>, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, CAST(topic AS BLOB), CAST(key AS BLOB) FROM {p}_messages
             WHERE id IN (SELECT value FROM json_each(?1)) AND typeof(key) = 'text'
               AND typeof(topic) = 'text'"
        )))
        .bind(ids_json(&ids))
        .fetch_all(&mut *tx)
        .await?;
        let keyed: Vec<(i64, String, String)> = keyed
            .into_iter()
            .filter_map(|(id, t, k)| {
                Some((id, String::from_utf8(t).ok()?, String::from_utf8(k).ok()?))
            })
            .collect();
        let changed = match req.action {
            ReplayAction::Replay => {
                let rows: Vec<serde_json::Value> = ids
                    .iter()
                    .enumerate()
                    .map(|(k, id)| serde_json::json!([id, ops::spread_ms(k, req.rate_per_s)]))
                    .collect();
                sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {p}_messages AS m
                     SET status = 0, attempts = 0, available_at = {n} + x.delay_ms, replay_id = ?2,
                         claim_token = NULL, locked_until = NULL, dispatched_at = NULL
                     FROM (SELECT json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS delay_ms
                           FROM json_each(?1)) AS x
                     WHERE m.id = x.id AND m.status = 3"
                )))
                .bind(serde_json::Value::from(rows).to_string())
                .bind(replay_id)
                .execute(&mut *tx)
                .await?
                .rows_affected()
            }
            ReplayAction::Discard | ReplayAction::Purge => sqlx::query(AssertSqlSafe(format!(
                "DELETE FROM {p}_messages WHERE id IN (SELECT value FROM json_each(?1)) AND status = 3"
            )))
            .bind(ids_json(&ids))
            .execute(&mut *tx)
            .await?
            .rows_affected(),
        };
        // A replayed row is due after its spread delay (its followers then, too); a deleted
        // one releases its followers now. Each key's parked rows before its next dead
        // letter come back.
        let delay_of: std::collections::HashMap<i64, i64> = match req.action {
            ReplayAction::Replay => ids
                .iter()
                .enumerate()
                .map(|(k, &id)| (id, ops::spread_ms(k, req.rate_per_s)))
                .collect(),
            ReplayAction::Discard | ReplayAction::Purge => Default::default(),
        };
        let released: Vec<serde_json::Value> = keyed
            .iter()
            .map(|(id, t, k)| serde_json::json!([id, t, k, delay_of.get(id).copied().unwrap_or(0)]))
            .collect();
        if !released.is_empty() {
            sqlx::query(AssertSqlSafe(format!(
                "WITH r AS (
                   SELECT json_extract(value, '$[1]') AS topic, json_extract(value, '$[2]') AS key,
                          min(json_extract(value, '$[0]')) AS id, min(json_extract(value, '$[3]')) AS at_ms
                   FROM json_each(?1) GROUP BY 1, 2),
                 k AS (
                   SELECT r.*, (SELECT min(d.id) FROM {p}_messages d
                                WHERE d.topic = r.topic AND d.key = r.key AND d.key IS NOT NULL
                                  AND d.status <> 2 AND d.status = 3) AS next_dead
                   FROM r)
                 UPDATE {p}_messages AS m SET available_at = {n} + max(k.at_ms, 0)
                 FROM k
                 WHERE m.topic = k.topic AND m.key = k.key AND m.key IS NOT NULL
                   AND m.status <> 2 AND m.status = 0 AND m.available_at = {PARKED_AT_MS}
                   AND m.id > k.id AND (k.next_dead IS NULL OR m.id < k.next_dead)"
            )))
            .bind(serde_json::Value::from(released).to_string())
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {p}_replays SET count = count + ?1 WHERE id = ?2"
        )))
        .bind(changed as i64)
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
        let p = self.p();
        let rows: Vec<(i64, i64, String, String, String, String, i64)> =
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT id, at, requested_by, reason, action, selection, count
                 FROM {p}_replays ORDER BY id DESC LIMIT ?1"
            )))
            .bind(i64::from(limit))
            .fetch_all(&self.inner.pool)
            .await?;
        Ok(rows
            .into_iter()
            .map(
                |(id, at, by, reason, action, selection, count)| ReplayRecord {
                    id,
                    at: ms_to_time(at),
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
        let p = self.p();
        let n = NOW_MS;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {p}_topic_pauses (pattern, reason, paused_by, paused_at, regex)
             VALUES (?1, ?2, ?3, {n}, ?4)
             ON CONFLICT (pattern) DO UPDATE SET reason = excluded.reason,
                 paused_by = excluded.paused_by, paused_at = excluded.paused_at,
                 regex = excluded.regex"
        )))
        .bind(pattern.as_str())
        .bind(reason)
        .bind(by)
        .bind(pattern.regex())
        .execute(&self.inner.pool)
        .await?;
        Ok(())
    }

    async fn resume_topic(&self, pattern: &str) -> Result<bool> {
        let p = self.p();
        let r = sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {p}_topic_pauses WHERE pattern = ?1"
        )))
        .bind(pattern)
        .execute(&self.inner.pool)
        .await?;
        Ok(r.rows_affected() > 0)
    }

    async fn audit(&self, entry: &super::ops::AuditEntry) -> Result<()> {
        let p = self.p();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {p}_replays (requested_by, reason, action, selection)
             VALUES (?1, ?2, ?3, ?4)"
        )))
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
impl Views for SqliteStore {
    async fn counts(&self) -> Result<Counts> {
        let row: super::CountsRow = sqlx::query_as(self.inner.sql.counts.clone())
            .fetch_one(&self.inner.pool)
            .await?;
        Ok(row.into())
    }

    async fn leases(&self) -> Result<Leases> {
        let (held, last, ms): (i64, Option<i64>, Option<i64>) =
            sqlx::query_as(self.inner.sql.leases.clone())
                .fetch_one(&self.inner.pool)
                .await?;
        Ok(Leases::from_row(held, last.map(ms_to_time), ms))
    }

    async fn held_keys(&self, ordering: &KeyOrdering) -> Result<HeldKeys> {
        SqliteStore::held_keys(self, ordering).await
    }

    async fn due_held_by_order(&self, ordering: &KeyOrdering) -> Result<DueHeld> {
        SqliteStore::due_held_by_order(self, ordering).await
    }

    async fn overview(&self, top_n: u32) -> Result<Overview> {
        let p = self.p();
        let n = NOW_MS;
        let pool = &self.inner.pool;
        let counts = self.counts().await?;
        let (due, oldest_due_ms, expired): (i64, Option<i64>, i64) =
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT count(*), CAST({n} - min(available_at) AS INTEGER), coalesce(sum(status = 1), 0)
                 FROM {p}_messages WHERE status <= 1 AND available_at <= {n}"
            )))
            .fetch_one(pool)
            .await?;
        let parked: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {p}_messages
             WHERE status <= 1 AND available_at = {PARKED_AT_MS}"
        )))
        .fetch_one(pool)
        .await?;
        // Each claim goes to the latest-started live instance of its relay id whose start
        // plus lease is not after the claim's lease end (none: an earlier process's).
        let claims_by: Vec<(Option<String>, Option<String>, i64, i64)> =
            sqlx::query_as(AssertSqlSafe(format!(
                "SELECT m.claimed_by,
                        (SELECT r.instance FROM {p}_relays r
                         WHERE r.relay_id = m.claimed_by AND r.last_seen >= {n} - {expiry}
                           AND r.started_at + r.lease_ms <= m.available_at
                         ORDER BY r.started_at DESC, r.instance LIMIT 1) AS instance,
                        count(*), coalesce(sum(m.available_at <= {n}), 0)
                 FROM {p}_messages m WHERE m.status = 1 GROUP BY 1, 2 ORDER BY 1, 2",
                expiry = super::RELAY_EXPIRY.as_millis()
            )))
            .fetch_all(pool)
            .await?;
        let by_topic = async |status: i16| -> Result<Vec<(String, i64)>> {
            let rows: Vec<(Vec<u8>, i64)> = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT CAST(topic AS BLOB), count(*) FROM {p}_messages WHERE status = ?1
                 GROUP BY topic ORDER BY count(*) DESC, topic LIMIT ?2"
            )))
            .bind(status)
            .bind(i64::from(top_n))
            .fetch_all(pool)
            .await?;
            Ok(rows
                .into_iter()
                .map(|(t, n)| (super::lossy(t), n))
                .collect())
        };
        Ok(Overview {
            counts,
            due,
            oldest_due_s: oldest_due_ms.map(|ms| ms.max(0) / 1000),
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
        let p = self.p();
        // Text as bytes, shown with U+FFFD for what is not UTF-8 (see `dead_letters`).
        let cols = "id, message_id, CAST(topic AS BLOB) AS topic, CAST(key AS BLOB) AS key,
                    status, attempts, occurred_at, available_at, claimed_by, locked_until,
                    dispatched_at, last_error, length(payload) AS payload_bytes, replay_id";
        let rows = match query {
            MessageQuery::MessageId(id) => {
                sqlx::query(AssertSqlSafe(format!(
                    "SELECT {cols} FROM {p}_messages WHERE message_id = ?1"
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
                    "SELECT {cols} FROM {p}_messages WHERE topic = ?1 AND key = ?2
                     ORDER BY id DESC LIMIT ?3"
                )))
                .bind(topic)
                .bind(key)
                .bind(i64::from(limit))
                .fetch_all(&self.inner.pool)
                .await?
            }
            MessageQuery::Key { key, topic: None } => {
                sqlx::query(AssertSqlSafe(format!(
                    "SELECT {cols} FROM {p}_messages WHERE key = ?1 ORDER BY id DESC LIMIT ?2"
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
                let time = |c: &str| -> Result<Option<DateTime<Utc>>> {
                    Ok(r.try_get::<Option<i64>, _>(c)?.map(ms_to_time))
                };
                Ok(super::lookup::MessageLocation {
                    id,
                    message_id,
                    topic: super::lossy(r.try_get("topic")?),
                    key: r.try_get::<Option<Vec<u8>>, _>("key")?.map(super::lossy),
                    status: super::lookup::status_name(r.try_get("status")?),
                    attempts: r.try_get("attempts")?,
                    occurred_at: ms_to_time(r.try_get("occurred_at")?),
                    available_at: ms_to_time(r.try_get("available_at")?),
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
        let p = self.p();
        let n = NOW_MS;
        let minutes = minutes.min(super::lookup::MAX_THROUGHPUT_MINUTES);
        let rows: Vec<(i64, i64, i64)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT m, sum(d), sum(x) FROM (
               SELECT ({n} - dispatched_at) / 60000 AS m, 1 AS d, 0 AS x
               FROM {p}_messages WHERE status = 2 AND dispatched_at >= {n} - ?1 * 60000
               UNION ALL
               SELECT ({n} - available_at) / 60000, 0, 1
               FROM {p}_messages WHERE status = 3 AND available_at >= {n} - ?1 * 60000
             ) GROUP BY m"
        )))
        .bind(i64::from(minutes))
        .fetch_all(&self.inner.pool)
        .await?;
        Ok(super::lookup::fill_minutes(minutes, &rows))
    }
}

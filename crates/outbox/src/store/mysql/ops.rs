//! Operator actions: the pause switch and topic pauses, dead letters, replays and
//! discards, and the audit of operator actions.

use super::{MySqlStore, NOW, REPLAY_CHUNK};
use crate::error::Result;
use crate::store::common::replay::{self, DeadText, ReplaySteps, Tx};
use crate::store::ops::{self, Dialect};
use crate::store::{
    DeadLetter, DeadSelector, Operations, PauseState, ReplayAction, ReplayOutcome, ReplayRecord,
    ReplayRequest, TopicPause,
};
use crate::topic::TopicPattern;
use async_trait::async_trait;
use chrono::{DateTime, NaiveDateTime, Utc};
use sqlx::{AssertSqlSafe, MySql, Row};
use std::fmt::Write as _;
use uuid::Uuid;

impl MySqlStore {
    pub(super) async fn read_pause_state(&self) -> Result<PauseState> {
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
                let mid = r.try_get::<String, _>("message_id")?;
                let text = DeadText {
                    message_id: crate::store::text_message_id(r.try_get("id")?, &mid)?,
                    topic: r.try_get("topic")?,
                    key: r.try_get("key")?,
                    headers: r.try_get("headers")?,
                    occurred_at: r.try_get::<NaiveDateTime, _>("occurred_at")?.and_utc(),
                    died_at: r.try_get::<NaiveDateTime, _>("available_at")?.and_utc(),
                };
                replay::dead_letter(r, text)
            })
            .collect()
    }

    async fn count_dead(&self, selector: &DeadSelector) -> Result<u64> {
        let p = &self.inner.config.schema;
        let (filter, binds) = ops::dead_filter(selector, Dialect::MySql, 1);
        let sql = format!("SELECT COUNT(*) FROM {p}_messages WHERE {filter}");
        let n = replay::bound(sql, binds)
            .fetch_one(&self.inner.pool)
            .await?;
        Ok(replay::count(n))
    }

    async fn replay(&self, req: &ReplayRequest) -> Result<ReplayOutcome> {
        let _wrote = self.inner.quiet.writing();
        ops::validate(req)?;
        let tx = self.inner.pool.begin().await?;
        replay::replay(self, tx, req).await
    }

    async fn replays(&self, limit: u32) -> Result<Vec<ReplayRecord>> {
        let rows: Vec<replay::ReplayRow<NaiveDateTime>> =
            sqlx::query_as(self.inner.sql.replays.clone())
                .bind(i64::from(limit))
                .fetch_all(&self.inner.pool)
                .await?;
        Ok(replay::replay_records(rows, |at| at.and_utc()))
    }

    async fn audit(&self, entry: &crate::store::ops::AuditEntry) -> Result<()> {
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
impl ReplaySteps for MySqlStore {
    type Db = MySql;
    /// The keyed rows among the locked ones: (id, order key).
    type Held = Vec<(i64, Vec<u8>)>;
    const DIALECT: Dialect = Dialect::MySql;

    async fn named(&self, tx: &mut Tx<Self>, filter: &str) -> Result<Vec<(i64, Uuid, i16)>> {
        let p = &self.inner.config.schema;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "SELECT id, message_id, CAST(status AS SIGNED) FROM {p}_messages WHERE {filter}"
        )))
        .fetch_all(&mut **tx)
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
        .collect()
    }

    async fn select(&self, tx: &mut Tx<Self>, req: &ReplayRequest) -> Result<Vec<i64>> {
        let p = &self.inner.config.schema;
        // The selected rows, read without locks (no gap locks, and no waiting on rows the
        // selection does not take), then locked by primary key while still dead (the
        // primary key forced: a covering secondary index would look cheaper and lock every
        // dead row, waiting on any a claim or a producer holds): a concurrent replay of the
        // same rows waits there, then finds them no longer dead.
        let (filter, binds) = ops::dead_filter(&req.selector, Dialect::MySql, 1);
        let limit = req
            .limit
            .map_or_else(String::new, |l| format!(" LIMIT {l}"));
        let sql = format!("SELECT id FROM {p}_messages WHERE {filter} ORDER BY id{limit}");
        Ok(replay::bound(sql, binds).fetch_all(&mut **tx).await?)
    }

    async fn lock(&self, tx: &mut Tx<Self>, selected: Vec<i64>) -> Result<(Vec<i64>, Self::Held)> {
        let p = &self.inner.config.schema;
        let mut ids = Vec::with_capacity(selected.len());
        for chunk in selected.chunks(REPLAY_CHUNK) {
            let locked = sqlx::raw_sql(AssertSqlSafe(format!(
                "SELECT id FROM {p}_messages FORCE INDEX (PRIMARY)
                 WHERE id IN ({}) AND status = 3 ORDER BY id FOR UPDATE",
                Self::id_list(chunk)
            )))
            .fetch_all(&mut **tx)
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
            .fetch_all(&mut **tx)
            .await?;
            for r in &rows {
                keyed.push((r.try_get(0)?, r.try_get(1)?));
            }
        }
        Ok((ids, keyed))
    }

    async fn record(&self, tx: &mut Tx<Self>, req: &ReplayRequest) -> Result<i64> {
        let r = sqlx::query(self.inner.sql.replay_insert.clone())
            .bind(&req.by)
            .bind(&req.reason)
            .bind(req.action.as_str())
            .bind(req.describe())
            .execute(&mut **tx)
            .await?;
        Ok(i64::try_from(r.last_insert_id()).unwrap_or(i64::MAX))
    }

    async fn change(
        &self,
        tx: &mut Tx<Self>,
        req: &ReplayRequest,
        ids: &[i64],
        replay_id: i64,
        keyed: Self::Held,
    ) -> Result<u64> {
        let p = &self.inner.config.schema;
        // One database time for every statement, as one statement would have: the spread
        // starts at it whatever the number of statements.
        let at: NaiveDateTime = sqlx::raw_sql(AssertSqlSafe(format!("SELECT {NOW}")))
            .fetch_one(&mut **tx)
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
                .execute(&mut **tx)
                .await?
                .rows_affected();
        }
        // A replayed row is due after its spread delay (its followers then, too); a deleted
        // one releases its followers at once.
        let delay_of = replay::delays(req, ids);
        let delayed: Vec<(i64, Vec<u8>, i64)> = keyed
            .into_iter()
            .map(|(id, ok)| (id, ok, delay_of.get(&id).copied().unwrap_or(0)))
            .collect();
        self.unpark_keys(tx, &delayed, &at).await?;
        Ok(changed)
    }

    async fn count(&self, tx: &mut Tx<Self>, changed: u64, replay_id: i64) -> Result<()> {
        sqlx::query(self.inner.sql.replay_count.clone())
            .bind(i64::try_from(changed).unwrap_or(i64::MAX))
            .bind(replay_id)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

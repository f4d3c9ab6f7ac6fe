//! Operator actions: the pause switch, topic pauses, dead letters, replay and the audit.

use super::{AVAILABLE_AT, OCCURRED_AT, PgStore, UTF8_BYTES, schema_sql};
use crate::error::Result;
use crate::store::Operations;
use crate::store::common::replay::{self, DeadText, ReplaySteps, Tx};
use crate::store::lossy;
use crate::store::ops::{self, Dialect};
use crate::store::{
    DeadLetter, DeadSelector, PauseState, ReplayAction, ReplayOutcome, ReplayRecord, ReplayRequest,
    TopicPause,
};
use crate::topic::TopicPattern;
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, Postgres, Row};
use uuid::Uuid;

impl PgStore {
    pub(super) async fn pause_state(&self) -> Result<PauseState> {
        let (paused, reason, changed_at, topics): (bool, Option<String>, DateTime<Utc>, String) =
            sqlx::query_as(self.inner.sql.pause_state.clone())
                .fetch_one(&self.inner.pool)
                .await?;
        let mut topics: Vec<(String, String, String, i64)> =
            serde_json::from_str(&topics).unwrap_or_default();
        topics.sort();
        Ok(PauseState {
            paused,
            reason,
            changed_at: Some(changed_at),
            topics: topics
                .into_iter()
                .map(|(pattern, reason, by, at)| TopicPause {
                    pattern,
                    reason,
                    by,
                    paused_at: DateTime::from_timestamp_millis(at).unwrap_or_default(),
                })
                .collect(),
        })
    }
}

#[async_trait]
impl Operations for PgStore {
    async fn set_pause(&self, reason: Option<&str>) -> Result<()> {
        // The claim reads the switch itself; the notification makes a resume take effect
        // at once instead of at the relays' next poll.
        let mut tx = self.inner.pool.begin().await?;
        sqlx::query(self.inner.sql.set_pause.clone())
            .bind(reason.is_some())
            .bind(reason)
            .execute(&mut *tx)
            .await?;
        if reason.is_none() {
            let s = self.s();
            sqlx::query(AssertSqlSafe(schema_sql(
                include_str!("sql/notify_relays.sql"),
                s,
            )))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn pause_topic(&self, pattern: &TopicPattern, reason: &str, by: &str) -> Result<()> {
        let s = self.s();
        sqlx::query(AssertSqlSafe(schema_sql(
            include_str!("sql/pause_topic.sql"),
            s,
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
        let s = self.s();
        // The notification makes the resumed topics flow at once, not at the next poll.
        let mut tx = self.inner.pool.begin().await?;
        let r = sqlx::query(AssertSqlSafe(schema_sql(
            include_str!("sql/resume_topic.sql"),
            s,
        )))
        .bind(pattern)
        .execute(&mut *tx)
        .await?;
        sqlx::query(AssertSqlSafe(schema_sql(
            include_str!("sql/notify_relays.sql"),
            s,
        )))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(r.rows_affected() > 0)
    }

    async fn dead_letters(
        &self,
        selector: &DeadSelector,
        limit: u32,
        with_payload: bool,
    ) -> Result<Vec<DeadLetter>> {
        let s = self.s();
        let (filter, binds) = ops::dead_filter(selector, Dialect::Postgres, 1);
        let payload = if with_payload {
            "payload"
        } else {
            "NULL::bytea"
        };
        // Text as bytes: a malformed row's text may not be UTF-8 (see `read_claimed`), and
        // is shown with U+FFFD for what is not, rather than failing the whole list.
        let sql = format!(
            "SELECT id, message_id, convert_to(topic, {UTF8_BYTES}) AS topic,
                    convert_to(key, {UTF8_BYTES}) AS key, attempts, {OCCURRED_AT} AS occurred_at,
                    {AVAILABLE_AT} AS available_at, last_error, convert_to(headers::text, {UTF8_BYTES}) AS headers,
                    octet_length(payload)::bigint AS payload_bytes,
                    {payload} AS payload, replay_id,
                    (SELECT count(*) FROM {s}.messages l
                     WHERE l.topic = m.topic AND md5(l.key) = md5(m.key) AND l.key = m.key
                       AND l.status <> 2 AND l.status <= 1 AND l.id > m.id) AS waiting_behind
             FROM {s}.messages m WHERE {filter} ORDER BY id LIMIT {limit}"
        );
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for b in binds {
            query = query.bind(b);
        }
        let rows = query.fetch_all(&self.inner.pool).await?;
        rows.iter()
            .map(|r| {
                let text = DeadText {
                    message_id: r.try_get("message_id")?,
                    topic: lossy(r.try_get("topic")?),
                    key: r.try_get::<Option<Vec<u8>>, _>("key")?.map(lossy),
                    headers: lossy(r.try_get("headers")?),
                    occurred_at: r.try_get("occurred_at")?,
                    died_at: r.try_get("available_at")?,
                };
                replay::dead_letter(r, text)
            })
            .collect()
    }

    async fn count_dead(&self, selector: &DeadSelector) -> Result<u64> {
        let s = self.s();
        let (filter, binds) = ops::dead_filter(selector, Dialect::Postgres, 1);
        let sql = format!("SELECT count(*) FROM {s}.messages WHERE {filter}");
        let n = replay::bound(sql, binds)
            .fetch_one(&self.inner.pool)
            .await?;
        Ok(replay::count(n))
    }

    async fn replay(&self, req: &ReplayRequest) -> Result<ReplayOutcome> {
        ops::validate(req)?;
        let tx = self.inner.pool.begin().await?;
        replay::replay(self, tx, req).await
    }

    async fn replays(&self, limit: u32) -> Result<Vec<ReplayRecord>> {
        let s = self.s();
        let rows: Vec<replay::ReplayRow<DateTime<Utc>>> = sqlx::query_as(AssertSqlSafe(
            schema_sql(include_str!("sql/replays.sql"), s),
        ))
        .bind(i64::from(limit))
        .fetch_all(&self.inner.pool)
        .await?;
        Ok(replay::replay_records(rows, |at| at))
    }

    async fn audit(&self, entry: &crate::store::ops::AuditEntry) -> Result<()> {
        let s = self.s();
        sqlx::query(AssertSqlSafe(schema_sql(include_str!("sql/audit.sql"), s)))
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
impl ReplaySteps for PgStore {
    type Db = Postgres;
    type Held = ();
    const DIALECT: Dialect = Dialect::Postgres;

    async fn named(&self, tx: &mut Tx<Self>, filter: &str) -> Result<Vec<(i64, Uuid, i16)>> {
        let s = self.s();
        Ok(sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, message_id, status FROM {s}.messages WHERE {filter}"
        )))
        .fetch_all(&mut **tx)
        .await?)
    }

    async fn select(&self, tx: &mut Tx<Self>, req: &ReplayRequest) -> Result<Vec<i64>> {
        let s = self.s();
        let (filter, binds) = ops::dead_filter(&req.selector, Dialect::Postgres, 1);
        let limit = req
            .limit
            .map_or_else(|| "ALL".to_owned(), |l| l.to_string());
        // Locks the selected rows: a concurrent replay of the same rows waits, then finds
        // them no longer dead.
        let sql = format!(
            "SELECT id FROM {s}.messages WHERE {filter} ORDER BY id LIMIT {limit} FOR UPDATE"
        );
        Ok(replay::bound(sql, binds).fetch_all(&mut **tx).await?)
    }

    async fn lock(&self, _: &mut Tx<Self>, selected: Vec<i64>) -> Result<(Vec<i64>, ())> {
        Ok((selected, ()))
    }

    async fn record(&self, tx: &mut Tx<Self>, req: &ReplayRequest) -> Result<i64> {
        let s = self.s();
        Ok(sqlx::query_scalar(AssertSqlSafe(schema_sql(
            include_str!("sql/replay_record.sql"),
            s,
        )))
        .bind(&req.by)
        .bind(&req.reason)
        .bind(req.action.as_str())
        .bind(req.describe())
        .fetch_one(&mut **tx)
        .await?)
    }

    async fn change(
        &self,
        tx: &mut Tx<Self>,
        req: &ReplayRequest,
        ids: &[i64],
        replay_id: i64,
        (): (),
    ) -> Result<u64> {
        let s = self.s();
        // The keyed rows among them, whose parked followers are given back below; their
        // text as bytes, which any row's text can be sent as (see `read_claimed`).
        let keyed: Vec<(i64, Vec<u8>, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, convert_to(topic, {UTF8_BYTES}), convert_to(key, {UTF8_BYTES})
             FROM {s}.messages WHERE id = ANY($1) AND key IS NOT NULL"
        )))
        .bind(ids)
        .fetch_all(&mut **tx)
        .await?;
        let delays: Vec<i64> = (0..ids.len())
            .map(|k| ops::spread_ms(k, req.rate_per_s))
            .collect();
        let changed = match req.action {
            ReplayAction::Replay => sqlx::query(AssertSqlSafe(schema_sql(
                include_str!("sql/replay_dead.sql"),
                s,
            )))
            .bind(ids)
            .bind(&delays)
            .bind(replay_id)
            .execute(&mut **tx)
            .await?
            .rows_affected(),
            ReplayAction::Discard | ReplayAction::Purge => sqlx::query(AssertSqlSafe(schema_sql(
                include_str!("sql/discard_dead.sql"),
                s,
            )))
            .bind(ids)
            .execute(&mut **tx)
            .await?
            .rows_affected(),
        };
        // A replayed row is due after its spread delay (its followers then, too); a deleted
        // one releases its followers now.
        let delay_of = replay::delays(req, ids);
        let at = |id: i64| delay_of.get(&id).copied().unwrap_or(0);
        self.unpark_keys(
            tx,
            &keyed.iter().map(|k| k.0).collect::<Vec<_>>(),
            &keyed.iter().map(|k| k.1.clone()).collect::<Vec<_>>(),
            &keyed.iter().map(|k| k.2.clone()).collect::<Vec<_>>(),
            &keyed.iter().map(|k| at(k.0)).collect::<Vec<_>>(),
        )
        .await?;
        Ok(changed)
    }

    async fn count(&self, tx: &mut Tx<Self>, changed: u64, replay_id: i64) -> Result<()> {
        let s = self.s();
        sqlx::query(AssertSqlSafe(schema_sql(
            include_str!("sql/replay_count.sql"),
            s,
        )))
        .bind(changed as i64)
        .bind(replay_id)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

//! Operator actions: the pause switch, topic pauses, dead letters, replay and the audit.

use super::{AVAILABLE_AT, OCCURRED_AT, PgStore, UTF8_BYTES, schema_sql};
use crate::error::Result;
use crate::store::Operations;
use crate::store::common;
use crate::store::common::replay::{self, DeadText};
use crate::store::lossy;
use crate::store::ops::{self, Dialect};
use crate::store::{
    DeadLetter, DeadSelector, PauseState, ReplayOutcome, ReplayRecord, ReplayRequest,
};
use crate::topic::TopicPattern;
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, Row};

impl PgStore {
    pub(super) async fn pause_state(&self) -> Result<PauseState> {
        let (paused, reason, changed_at, topics): (bool, Option<String>, DateTime<Utc>, String) =
            sqlx::query_as(self.inner.sql.pause_state.clone())
                .fetch_one(&self.inner.pool)
                .await?;
        let at = |ms| DateTime::from_timestamp_millis(ms).unwrap_or_default();
        Ok(common::ops::pause_state(
            paused, reason, changed_at, &topics, at,
        ))
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
        let sql = AssertSqlSafe(schema_sql(include_str!("sql/pause_topic.sql"), self.s()));
        common::ops::pause_topic(sql, pattern, reason, by)
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
        let rows = common::ops::selected(sql, binds)
            .fetch_all(&self.inner.pool)
            .await?;
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
        common::ops::count(&self.inner.pool, sql, binds).await
    }

    async fn replay(&self, req: &ReplayRequest) -> Result<ReplayOutcome> {
        ops::validate(req)?;
        let tx = self.inner.pool.begin().await?;
        replay::replay(self, tx, req).await
    }

    async fn replays(&self, limit: u32) -> Result<Vec<ReplayRecord>> {
        let sql = AssertSqlSafe(schema_sql(include_str!("sql/replays.sql"), self.s()));
        common::ops::replays(&self.inner.pool, sql, limit, |at: DateTime<Utc>| at).await
    }

    async fn audit(&self, entry: &crate::store::ops::AuditEntry) -> Result<()> {
        let sql = AssertSqlSafe(schema_sql(include_str!("sql/audit.sql"), self.s()));
        common::ops::audit(&self.inner.pool, sql, entry).await
    }
}

//! Operator actions: the pause switch and topic pauses, dead letters, replays and
//! discards, and the audit of operator actions.

use super::MySqlStore;
use crate::error::Result;
use crate::store::common;
use crate::store::common::replay::{self, DeadText};
use crate::store::ops::{self, Dialect};
use crate::store::{
    DeadLetter, DeadSelector, Operations, PauseState, ReplayOutcome, ReplayRecord, ReplayRequest,
    TopicPause,
};
use crate::topic::TopicPattern;
use async_trait::async_trait;
use chrono::{DateTime, NaiveDateTime, Utc};
use sqlx::Row;

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
        common::ops::set_pause(&self.inner.pool, self.inner.sql.set_pause.clone(), reason).await
    }

    async fn pause_topic(&self, pattern: &TopicPattern, reason: &str, by: &str) -> Result<()> {
        common::ops::pause_topic(self.inner.sql.pause_topic.clone(), pattern, reason, by)
            .execute(&self.inner.pool)
            .await?;
        Ok(())
    }

    async fn resume_topic(&self, pattern: &str) -> Result<bool> {
        let sql = self.inner.sql.resume_topic.clone();
        common::ops::resume_topic(&self.inner.pool, sql, pattern).await
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
        let rows = common::ops::selected(sql, binds)
            .fetch_all(&self.inner.pool)
            .await?;
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
        common::ops::count(&self.inner.pool, sql, binds).await
    }

    async fn replay(&self, req: &ReplayRequest) -> Result<ReplayOutcome> {
        let _wrote = self.inner.quiet.writing();
        ops::validate(req)?;
        let tx = self.inner.pool.begin().await?;
        replay::replay(self, tx, req).await
    }

    async fn replays(&self, limit: u32) -> Result<Vec<ReplayRecord>> {
        let sql = self.inner.sql.replays.clone();
        common::ops::replays(&self.inner.pool, sql, limit, |at: NaiveDateTime| {
            at.and_utc()
        })
        .await
    }

    async fn audit(&self, entry: &crate::store::ops::AuditEntry) -> Result<()> {
        common::ops::audit(
            &self.inner.pool,
            self.inner.sql.replay_insert.clone(),
            entry,
        )
        .await
    }
}

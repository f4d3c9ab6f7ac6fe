//! Operator actions: the pause switch and topic pauses, dead letters, their replay or
//! discard, and the audit.

use super::decode::ms_to_time;
use super::topics::{dead_topics, topic_in};
use super::{NOW_MS, SqliteStore};
use crate::error::Result;
use crate::store::common;
use crate::store::common::replay::{self, DeadText};
use crate::store::lossy;
use crate::store::ops::{self, Dialect};
use crate::store::{
    DeadLetter, DeadSelector, Operations, PauseState, ReplayOutcome, ReplayRecord, ReplayRequest,
};
use crate::topic::TopicPattern;
use async_trait::async_trait;
use sqlx::{AssertSqlSafe, Row, SqlSafeStr};
use uuid::Uuid;

/// [`ops::dead_filter`] for SQLite, with the topic pattern matched by [`dead_topics`].
pub(super) async fn dead_filter(
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

impl SqliteStore {
    pub(super) async fn pause_state(&self) -> Result<PauseState> {
        let (paused, reason, changed_at, topics): (bool, Option<String>, i64, String) =
            sqlx::query_as(self.inner.sql.pause_state.clone())
                .fetch_one(&self.inner.pool)
                .await?;
        let changed_at = ms_to_time(changed_at);
        Ok(common::ops::pause_state(
            paused, reason, changed_at, &topics, ms_to_time,
        ))
    }
}

#[async_trait]
impl Operations for SqliteStore {
    async fn set_pause(&self, reason: Option<&str>) -> Result<()> {
        common::ops::set_pause(&self.inner.pool, self.inner.sql.set_pause.clone(), reason).await
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
        let rows = common::ops::selected(sql, binds)
            .fetch_all(&mut *conn)
            .await?;
        rows.iter()
            .map(|r| {
                let mid: String = r.try_get("message_id")?;
                // Text as bytes: a malformed row's text may not be UTF-8, shown with
                // U+FFFD for what is not rather than failing the whole list.
                let text = DeadText {
                    message_id: Uuid::parse_str(&mid).unwrap_or_default(),
                    topic: lossy(r.try_get("topic")?),
                    key: r.try_get::<Option<Vec<u8>>, _>("key")?.map(lossy),
                    headers: lossy(r.try_get("headers")?),
                    occurred_at: ms_to_time(r.try_get("occurred_at")?),
                    died_at: ms_to_time(r.try_get("available_at")?),
                };
                replay::dead_letter(r, text)
            })
            .collect()
    }

    async fn count_dead(&self, selector: &DeadSelector) -> Result<u64> {
        let p = self.p();
        let mut conn = self.inner.pool.acquire().await?;
        let (filter, binds) = dead_filter(&mut conn, p, selector).await?;
        let sql = format!("SELECT count(*) FROM {p}_messages WHERE {filter}");
        common::ops::count(&mut *conn, sql, binds).await
    }

    async fn replay(&self, req: &ReplayRequest) -> Result<ReplayOutcome> {
        ops::validate(req)?;
        let tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await?;
        replay::replay(self, tx, req).await
    }

    async fn replays(&self, limit: u32) -> Result<Vec<ReplayRecord>> {
        let sql = AssertSqlSafe(format!(
            "SELECT id, at, requested_by, reason, action, selection, count
                 FROM {}_replays ORDER BY id DESC LIMIT ?1",
            self.p()
        ));
        common::ops::replays(&self.inner.pool, sql, limit, ms_to_time).await
    }

    async fn pause_topic(&self, pattern: &TopicPattern, reason: &str, by: &str) -> Result<()> {
        let (p, n) = (self.p(), NOW_MS);
        let sql = AssertSqlSafe(format!(
            "INSERT INTO {p}_topic_pauses (pattern, reason, paused_by, paused_at, regex)
             VALUES (?1, ?2, ?3, {n}, ?4)
             ON CONFLICT (pattern) DO UPDATE SET reason = excluded.reason,
                 paused_by = excluded.paused_by, paused_at = excluded.paused_at,
                 regex = excluded.regex"
        ));
        common::ops::pause_topic(sql, pattern, reason, by)
            .execute(&self.inner.pool)
            .await?;
        Ok(())
    }

    async fn resume_topic(&self, pattern: &str) -> Result<bool> {
        let sql = AssertSqlSafe(format!(
            "DELETE FROM {}_topic_pauses WHERE pattern = ?1",
            self.p()
        ));
        common::ops::resume_topic(&self.inner.pool, sql.into_sql_str(), pattern).await
    }

    async fn audit(&self, entry: &crate::store::ops::AuditEntry) -> Result<()> {
        let sql = AssertSqlSafe(format!(
            "INSERT INTO {}_replays (requested_by, reason, action, selection)
             VALUES (?1, ?2, ?3, ?4)",
            self.p()
        ));
        common::ops::audit(&self.inner.pool, sql, entry).await
    }
}

//! Operator actions: the pause switch and topic pauses, dead letters, their replay or
//! discard, and the audit.

use super::decode::ms_to_time;
use super::topics::{dead_topics, topic_in};
use super::{NOW_MS, SqliteStore, ids_json};
use crate::error::Result;
use crate::store::common::replay::{self, DeadText, ReplaySteps, Tx};
use crate::store::lossy;
use crate::store::ops::{self, Dialect};
use crate::store::{
    DeadLetter, DeadSelector, Operations, PARKED_AT_MS, PauseState, ReplayAction, ReplayOutcome,
    ReplayRecord, ReplayRequest, TopicPause,
};
use crate::topic::TopicPattern;
use async_trait::async_trait;
use sqlx::{AssertSqlSafe, Row, Sqlite};
use uuid::Uuid;

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

impl SqliteStore {
    pub(super) async fn pause_state(&self) -> Result<PauseState> {
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
        let n = replay::bound(sql, binds).fetch_one(&mut *conn).await?;
        Ok(replay::count(n))
    }

    async fn replay(&self, req: &ReplayRequest) -> Result<ReplayOutcome> {
        ops::validate(req)?;
        let tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await?;
        replay::replay(self, tx, req).await
    }

    async fn replays(&self, limit: u32) -> Result<Vec<ReplayRecord>> {
        let p = self.p();
        let rows: Vec<replay::ReplayRow<i64>> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, at, requested_by, reason, action, selection, count
                 FROM {p}_replays ORDER BY id DESC LIMIT ?1"
        )))
        .bind(i64::from(limit))
        .fetch_all(&self.inner.pool)
        .await?;
        Ok(replay::replay_records(rows, ms_to_time))
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

    async fn audit(&self, entry: &crate::store::ops::AuditEntry) -> Result<()> {
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
impl ReplaySteps for SqliteStore {
    type Db = Sqlite;
    type Held = ();
    const DIALECT: Dialect = Dialect::Sqlite;

    async fn named(&self, tx: &mut Tx<Self>, filter: &str) -> Result<Vec<(i64, Uuid, i16)>> {
        let p = self.p();
        let rows: Vec<(i64, String, i16)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, message_id, status FROM {p}_messages WHERE {filter}"
        )))
        .fetch_all(&mut **tx)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(id, m, st)| (id, Uuid::parse_str(&m).unwrap_or_default(), st))
            .collect())
    }

    async fn select(&self, tx: &mut Tx<Self>, req: &ReplayRequest) -> Result<Vec<i64>> {
        let p = self.p();
        let (filter, binds) = dead_filter(tx, p, &req.selector).await?;
        let limit = req.limit.map_or(i64::MAX, i64::from);
        let sql = format!("SELECT id FROM {p}_messages WHERE {filter} ORDER BY id LIMIT {limit}");
        Ok(replay::bound(sql, binds).fetch_all(&mut **tx).await?)
    }

    async fn lock(&self, _: &mut Tx<Self>, selected: Vec<i64>) -> Result<(Vec<i64>, ())> {
        Ok((selected, ()))
    }

    async fn record(&self, tx: &mut Tx<Self>, req: &ReplayRequest) -> Result<i64> {
        let p = self.p();
        Ok(sqlx::query_scalar(AssertSqlSafe(format!(
            "INSERT INTO {p}_replays (requested_by, reason, action, selection)
             VALUES (?1, ?2, ?3, ?4) RETURNING id"
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
        let p = self.p();
        let n = NOW_MS;
        // The keyed rows among them, whose parked followers are given back below. A key
        // that is not UTF-8 is left out (its followers, malformed too, come back with the
        // relays' periodic give-back of what no dead letter holds).
        let keyed: Vec<(i64, Vec<u8>, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, CAST(topic AS BLOB), CAST(key AS BLOB) FROM {p}_messages
             WHERE id IN (SELECT value FROM json_each(?1)) AND typeof(key) = 'text'
               AND typeof(topic) = 'text'"
        )))
        .bind(ids_json(ids))
        .fetch_all(&mut **tx)
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
                .execute(&mut **tx)
                .await?
                .rows_affected()
            }
            ReplayAction::Discard | ReplayAction::Purge => sqlx::query(AssertSqlSafe(format!(
                "DELETE FROM {p}_messages WHERE id IN (SELECT value FROM json_each(?1)) AND status = 3"
            )))
            .bind(ids_json(ids))
            .execute(&mut **tx)
            .await?
            .rows_affected(),
        };
        // A replayed row is due after its spread delay (its followers then, too); a deleted
        // one releases its followers now. Each key's parked rows before its next dead
        // letter come back.
        let delay_of = replay::delays(req, ids);
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
            .execute(&mut **tx)
            .await?;
        }
        Ok(changed)
    }

    async fn count(&self, tx: &mut Tx<Self>, changed: u64, replay_id: i64) -> Result<()> {
        let p = self.p();
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {p}_replays SET count = count + ?1 WHERE id = ?2"
        )))
        .bind(changed as i64)
        .bind(replay_id)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

//! Strict per-key ordering's upkeep and views: parking the messages held behind dead
//! letters, giving them back, and what ordering holds back.

use super::topics::{dead_topics, topic_in, topics_where};
use super::{NOW_MS, SqliteStore};
use crate::error::Result;
use crate::store::{DueHeld, HeldKeys, KeyOrdering, PARKED_AT_MS};
use sqlx::AssertSqlSafe;

impl SqliteStore {
    pub(super) async fn park_held(&self, ordering: &KeyOrdering) -> Result<u64> {
        if !ordering.holds_dead() {
            return Ok(0);
        }
        let p = self.p();
        let n = NOW_MS;
        // Under the write lock: a replay or discard runs wholly before or after.
        let mut tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await?;
        let topics = dead_topics(&mut tx, p, |t| ordering.covers(t)).await?;
        let ordered = topic_in("topic", "?1");
        let query = sqlx::query(AssertSqlSafe(format!(
            "WITH blocked AS (
               SELECT topic, key, min(id) AS id FROM {p}_messages
               WHERE status = 3 AND key IS NOT NULL AND {ordered} GROUP BY topic, key)
             UPDATE {p}_messages SET available_at = {PARKED_AT_MS}
             WHERE id IN (SELECT m.id FROM blocked b JOIN {p}_messages m
                          ON m.topic = b.topic AND m.key = b.key AND m.key IS NOT NULL
                         AND m.status <> 2 AND m.id > b.id
                          WHERE m.status <= 1 AND m.claim_token IS NULL AND m.available_at <= {n})"
        )));
        let parked = query.bind(topics).execute(&mut *tx).await?.rows_affected();
        tx.commit().await?;
        Ok(parked)
    }

    pub(super) async fn unpark_released(&self, ordering: &KeyOrdering) -> Result<u64> {
        let p = self.p();
        let n = NOW_MS;
        // Not ordered (or nothing held): every parked row is free (no ordered topic has a
        // dead letter).
        let held = format!(
            "pk.key IS NOT NULL AND {} AND EXISTS (
               SELECT 1 FROM {p}_messages d
               WHERE d.topic = pk.topic AND d.key = pk.key AND d.key IS NOT NULL
                 AND d.status <> 2 AND d.status = 3 AND d.id < pk.id)",
            topic_in("pk.topic", "?1")
        );
        let mut tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await?;
        let topics = if ordering.holds_dead() {
            dead_topics(&mut tx, p, |t| ordering.covers(t)).await?
        } else {
            "[]".to_owned()
        };
        let query = sqlx::query(AssertSqlSafe(format!(
            "WITH pk AS (
               SELECT topic, key, min(id) AS id FROM {p}_messages
               WHERE status <= 1 AND status = 0 AND available_at = {PARKED_AT_MS}
               GROUP BY topic, key),
             free AS (SELECT topic, key FROM pk WHERE NOT ({held}))
             UPDATE {p}_messages SET available_at = {n}
             WHERE status <= 1 AND status = 0 AND available_at = {PARKED_AT_MS}
               AND EXISTS (SELECT 1 FROM free f WHERE f.topic = {p}_messages.topic
                           AND f.key IS {p}_messages.key)"
        )));
        let given = query.bind(topics).execute(&mut *tx).await?.rows_affected();
        tx.commit().await?;
        Ok(given)
    }

    pub(super) async fn held_keys(&self, ordering: &KeyOrdering) -> Result<HeldKeys> {
        if !ordering.is_on() {
            return Ok(HeldKeys::default());
        }
        let p = self.p();
        let n = NOW_MS;
        let mut tx = self.inner.pool.begin().await?;
        let topics = dead_topics(&mut tx, p, |t| ordering.covers(t)).await?;
        let ordered = topic_in("topic", "?1");
        let (blocked_keys, held, oldest) =
            sqlx::query_as::<_, (i64, i64, Option<i64>)>(AssertSqlSafe(format!(
                "WITH blocked AS (
                   SELECT topic, key, min(id) AS id FROM {p}_messages
                   WHERE status = 3 AND key IS NOT NULL AND {ordered} GROUP BY topic, key),
                 held AS (
                   SELECT m.occurred_at FROM blocked b JOIN {p}_messages m
                     ON m.topic = b.topic AND m.key = b.key AND m.status <> 2
                    AND m.status <= 1 AND m.id > b.id)
                 SELECT (SELECT count(*) FROM blocked), (SELECT count(*) FROM held),
                        (SELECT CAST(({n} - min(occurred_at)) / 1000 AS INTEGER) FROM held)"
            )))
            .bind(topics)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(HeldKeys {
            blocked_keys,
            held,
            oldest_held_age_seconds: oldest,
        })
    }

    pub(super) async fn due_held_by_order(&self, ordering: &KeyOrdering) -> Result<DueHeld> {
        let p = self.p();
        let n = NOW_MS;
        let dead_h = if ordering.skip_dead {
            " AND h.status <> 3"
        } else {
            ""
        };
        let ordered = topic_in("m.topic", "?1");
        let mut tx = self.inner.pool.begin().await?;
        let topics = topics_where(&mut tx, p, "status <= 1 AND key IS NOT NULL", |t| {
            ordering.covers(t)
        })
        .await?;
        // The key's head is read as the ordered claim reads it (see
        // `claim_ordered_select`), and only for the due rows of ordered keys.
        let (held, oldest_free_ms): (i64, Option<i64>) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT coalesce(sum(held), 0),
                    CAST({n} - min(CASE WHEN NOT held THEN available_at END) AS INTEGER)
             FROM (
               SELECT m.available_at,
                      CASE WHEN m.key IS NOT NULL AND {ordered} THEN coalesce(
                        (SELECT h.id <> m.id
                                AND (h.status = 3 OR h.available_at > {n}
                                     OR coalesce(h.locked_until > {n}, 0))
                         FROM {p}_messages h
                         WHERE h.topic = m.topic AND h.key = m.key AND h.status <> 2{dead_h}
                         ORDER BY h.id LIMIT 1), 0)
                      ELSE 0 END AS held
               FROM {p}_messages m WHERE m.status <= 1 AND m.available_at <= {n}{lease})",
            lease = super::claim::lease_free("m.")
        )))
        .bind(topics)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(DueHeld {
            held,
            oldest_free_due_s: oldest_free_ms.map(|ms| ms.max(0) / 1000),
        })
    }
}

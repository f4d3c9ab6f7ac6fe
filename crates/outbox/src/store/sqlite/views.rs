//! Read-only views for `outbox status`, the dashboard and the sampled gauges: counts,
//! leases, the overview, where a message is, and throughput.

use super::decode::ms_to_time;
use super::{NOW_MS, SqliteStore};
use crate::error::Result;
use crate::store::common::views::{self, FindSql, LocationText, OverviewSql};
use crate::store::lossy;
use crate::store::{CLAIMED_SQL, STATE_SQL};
use crate::store::{Counts, DueHeld, HeldKeys, KeyOrdering, Leases, Overview, PARKED_AT_MS, Views};
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, Row, SqlSafeStr};

/// `available_at` as the views show it: on a claimed row, when its lease ends (the claim
/// keeps the row's own `available_at`; see [`CLAIMED_SQL`]).
const SHOWN_AVAILABLE_AT: &str = "(CASE WHEN status <= 1 AND claim_token IS NOT NULL
      THEN max(available_at, coalesce(locked_until, available_at)) ELSE available_at END)";

#[async_trait]
impl Views for SqliteStore {
    async fn counts(&self) -> Result<Counts> {
        views::counts(&self.inner.pool, self.inner.sql.counts.clone()).await
    }

    async fn leases(&self) -> Result<Leases> {
        views::leases(&self.inner.pool, self.inner.sql.leases.clone(), ms_to_time).await
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
        let counts = self.counts().await?;
        let sql = |t: String| AssertSqlSafe(t).into_sql_str();
        // Each claim goes to the latest-started live instance of its relay id whose start
        // plus lease is not after the claim's lease end, `locked_until` (none: an earlier
        // process's).
        let statements = OverviewSql {
            due: sql(format!(
                "SELECT count(*), CAST({n} - min({SHOWN_AVAILABLE_AT}) AS INTEGER),
                        coalesce(sum({CLAIMED_SQL}), 0)
                 FROM {p}_messages WHERE status <= 1 AND available_at <= {n}{lease}",
                lease = super::claim::lease_free("")
            )),
            parked: sql(format!(
                "SELECT count(*) FROM {p}_messages
                 WHERE status <= 1 AND available_at = {PARKED_AT_MS}"
            )),
            claims_by: sql(format!(
                "SELECT m.claimed_by,
                        (SELECT r.instance FROM {p}_relays r
                         WHERE r.relay_id = m.claimed_by AND r.last_seen >= {n} - {expiry}
                           AND r.started_at + r.lease_ms <= m.locked_until
                         ORDER BY r.started_at DESC, r.instance LIMIT 1) AS instance,
                        count(*), coalesce(sum(m.locked_until <= {n}), 0)
                 FROM {p}_messages m WHERE {CLAIMED_SQL} GROUP BY 1, 2 ORDER BY 1, 2",
                expiry = crate::store::RELAY_EXPIRY.as_millis()
            )),
            by_topic: sql(format!(
                "SELECT CAST(topic AS BLOB), count(*) FROM {p}_messages WHERE {STATE_SQL} = ?1
                 GROUP BY topic ORDER BY count(*) DESC, topic LIMIT ?2"
            )),
        };
        let oldest_s = |ms: i64| ms.max(0) / 1000;
        views::overview(&self.inner.pool, counts, statements, top_n, oldest_s, lossy).await
    }

    async fn find_messages(
        &self,
        query: &crate::store::lookup::MessageQuery,
        limit: u32,
    ) -> Result<Vec<crate::store::lookup::MessageLocation>> {
        let p = self.p();
        // Text as bytes, shown with U+FFFD for what is not UTF-8 (see `dead_letters`).
        let cols = format!(
            "id, message_id, CAST(topic AS BLOB) AS topic, CAST(key AS BLOB) AS key,
             {STATE_SQL} AS status, attempts, occurred_at, {SHOWN_AVAILABLE_AT} AS available_at,
             claimed_by, locked_until, dispatched_at, last_error,
             length(payload) AS payload_bytes, replay_id"
        );
        let table = format!("{p}_messages");
        let sql = FindSql::select(&cols, &table, "topic = ?1 AND key = ?2", |n| {
            format!("?{n}")
        });
        let id = |id: &uuid::Uuid| id.hyphenated().to_string();
        let rows = views::find(&self.inner.pool, query, limit, sql, id).await?;
        rows.iter()
            .map(|r| {
                let mid = r.try_get::<String, _>("message_id")?;
                let time = |c: &str| -> Result<Option<DateTime<Utc>>> {
                    Ok(r.try_get::<Option<i64>, _>(c)?.map(ms_to_time))
                };
                let text = LocationText {
                    message_id: crate::store::text_message_id(r.try_get("id")?, &mid)?,
                    topic: lossy(r.try_get("topic")?),
                    key: r.try_get::<Option<Vec<u8>>, _>("key")?.map(lossy),
                    status: r.try_get("status")?,
                    occurred_at: ms_to_time(r.try_get("occurred_at")?),
                    available_at: ms_to_time(r.try_get("available_at")?),
                    locked_until: time("locked_until")?,
                    dispatched_at: time("dispatched_at")?,
                };
                views::location(r, text)
            })
            .collect()
    }

    async fn throughput(&self, minutes: u32) -> Result<Vec<crate::store::lookup::MinuteCounts>> {
        let p = self.p();
        let n = NOW_MS;
        let minutes = minutes.min(crate::store::lookup::MAX_THROUGHPUT_MINUTES);
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
        Ok(crate::store::lookup::fill_minutes(minutes, &rows))
    }
}

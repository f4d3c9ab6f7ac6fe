//! Read-only views: counts, leases, the overview, the cleanup horizon, message look-up and
//! throughput.

use super::{
    DISPATCHED_AT, LOCKED_UNTIL, OCCURRED_AT, PgStore, SHOWN_AVAILABLE_AT, UTF8_BYTES, schema_sql,
};
use crate::error::Result;
use crate::store::Views;
use crate::store::common::views::{self, FindSql, LocationText, OverviewSql};
use crate::store::lossy;
use crate::store::{CLAIMED_SQL, STATE_SQL};
use crate::store::{Counts, Leases, Overview, PARKED_AT};
use crate::store::{DueHeld, HeldKeys, KeyOrdering};
use async_trait::async_trait;
use sqlx::{AssertSqlSafe, Row, SqlSafeStr};

#[async_trait]
impl Views for PgStore {
    async fn counts(&self) -> Result<Counts> {
        views::counts(&self.inner.pool, self.inner.sql.counts.clone()).await
    }

    async fn leases(&self) -> Result<Leases> {
        views::leases(&self.inner.pool, self.inner.sql.leases.clone(), |t| t).await
    }

    async fn overview(&self, top_n: u32) -> Result<Overview> {
        let s = self.s();
        let counts = self.counts().await?;
        let sql = |t: String| AssertSqlSafe(t).into_sql_str();
        // Each claim goes to the latest-started live instance of its relay id whose start
        // plus lease is not after the claim's lease end, `locked_until` (none: an earlier
        // process's).
        let statements = OverviewSql {
            due: sql(format!(
                "SELECT count(*), floor(extract(epoch FROM now() - min({SHOWN_AVAILABLE_AT})))::bigint,
                        count(*) FILTER (WHERE {CLAIMED_SQL})
                 FROM {s}.messages WHERE status <= 1 AND available_at <= now(){lease}",
                lease = crate::store::lease_free("", "now()")
            )),
            parked: sql(format!(
                "SELECT count(*) FROM {s}.messages
                 WHERE status <= 1 AND available_at = '{PARKED_AT}'"
            )),
            claims_by: sql(format!(
                "SELECT m.claimed_by,
                        (SELECT r.instance FROM {s}.relays r
                         WHERE r.relay_id = m.claimed_by
                           AND r.last_seen >= now() - {expiry} * interval '1 millisecond'
                           AND r.started_at + r.lease_ms * interval '1 millisecond' <= m.locked_until
                         ORDER BY r.started_at DESC, r.instance LIMIT 1) AS instance,
                        count(*), count(*) FILTER (WHERE m.locked_until <= now())
                 FROM {s}.messages m WHERE {CLAIMED_SQL} GROUP BY 1, 2 ORDER BY 1, 2",
                expiry = crate::store::RELAY_EXPIRY.as_millis()
            )),
            by_topic: sql(format!(
                "SELECT convert_to(topic, {UTF8_BYTES}), count(*) FROM {s}.messages
                 WHERE {STATE_SQL} = $1 GROUP BY topic ORDER BY count(*) DESC, topic LIMIT $2"
            )),
        };
        views::overview(&self.inner.pool, counts, statements, top_n, |s| s, lossy).await
    }

    async fn cleanup_horizon(&self) -> Result<crate::store::CleanupHorizon> {
        let pool = &self.inner.pool;
        // Sessions of this database (since PostgreSQL 14 only they hold back the cleanup of
        // its tables) with a snapshot or a transaction id, and prepared transactions; this
        // connection's own statement excluded.
        type Oldest = (
            String,
            f64,
            Option<i64>,
            Option<String>,
            Option<String>,
            Option<String>,
            Option<String>,
        );
        let oldest: Option<Oldest> =
            sqlx::query_as(include_str!("sql/cleanup_oldest_transaction.sql"))
                .fetch_optional(pool)
                .await?;
        let (xmin_age, slot, slot_age): (Option<i64>, Option<String>, Option<i64>) =
            sqlx::query_as(include_str!("sql/cleanup_xmin_age.sql"))
                .fetch_one(pool)
                .await?;
        Ok(crate::store::CleanupHorizon {
            oldest: oldest.map(|(kind, age_s, pid, user, application, state, gid)| {
                crate::store::OldTransaction {
                    kind,
                    age_s: age_s.max(0.0),
                    pid,
                    user,
                    application,
                    state,
                    gid,
                }
            }),
            xmin_age,
            slot: slot.zip(slot_age),
            history_length: None,
        })
    }

    async fn find_messages(
        &self,
        query: &crate::store::lookup::MessageQuery,
        limit: u32,
    ) -> Result<Vec<crate::store::lookup::MessageLocation>> {
        let s = self.s();
        // Text as bytes, shown with U+FFFD for what is not UTF-8 (see `dead_letters`).
        let cols = format!(
            "id, message_id, convert_to(topic, {UTF8_BYTES}) AS topic,
             convert_to(key, {UTF8_BYTES}) AS key, {STATE_SQL}::smallint AS status, attempts, {OCCURRED_AT} AS occurred_at,
             {SHOWN_AVAILABLE_AT} AS available_at, claimed_by, {LOCKED_UNTIL} AS locked_until,
             {DISPATCHED_AT} AS dispatched_at, last_error,
             octet_length(payload)::bigint AS payload_bytes, replay_id"
        );
        // md5(key) as the per-key index has it.
        let by_topic_key = "topic = $1 AND md5(key) = md5($2) AND key = $2";
        let table = format!("{s}.messages");
        let sql = FindSql::select(&cols, &table, by_topic_key, |n| format!("${n}"));
        let rows = views::find(&self.inner.pool, query, limit, sql, |id| *id).await?;
        rows.iter()
            .map(|r| {
                let text = LocationText {
                    message_id: r.try_get("message_id")?,
                    topic: lossy(r.try_get("topic")?),
                    key: r.try_get::<Option<Vec<u8>>, _>("key")?.map(lossy),
                    status: i64::from(r.try_get::<i16, _>("status")?),
                    occurred_at: r.try_get("occurred_at")?,
                    available_at: r.try_get("available_at")?,
                    locked_until: r.try_get("locked_until")?,
                    dispatched_at: r.try_get("dispatched_at")?,
                };
                views::location(r, text)
            })
            .collect()
    }

    async fn throughput(&self, minutes: u32) -> Result<Vec<crate::store::lookup::MinuteCounts>> {
        let s = self.s();
        let minutes = minutes.min(crate::store::lookup::MAX_THROUGHPUT_MINUTES);
        let rows: Vec<(i64, i64, i64)> = sqlx::query_as(AssertSqlSafe(schema_sql(
            include_str!("sql/throughput.sql"),
            s,
        )))
        .bind(f64::from(minutes))
        .fetch_all(&self.inner.pool)
        .await?;
        Ok(crate::store::lookup::fill_minutes(minutes, &rows))
    }

    async fn held_keys(&self, ordering: &KeyOrdering) -> Result<HeldKeys> {
        PgStore::held_keys(self, ordering).await
    }

    async fn due_held_by_order(&self, ordering: &KeyOrdering) -> Result<DueHeld> {
        PgStore::due_held_by_order(self, ordering).await
    }
}

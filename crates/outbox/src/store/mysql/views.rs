//! Read-only views for status, the dashboard and metrics: counts, leases, the overview,
//! the cleanup horizon, message lookup and throughput.

use super::MySqlStore;
use crate::error::Result;
use crate::store::common::views::{self, FindSql, LocationText, OverviewSql};
use crate::store::{Counts, DueHeld, HeldKeys, KeyOrdering, Leases, Overview, Views};
use async_trait::async_trait;
use chrono::NaiveDateTime;
use sqlx::Row;

#[async_trait]
impl Views for MySqlStore {
    async fn counts(&self) -> Result<Counts> {
        views::counts(&self.inner.pool, self.inner.sql.counts.clone()).await
    }

    async fn leases(&self) -> Result<Leases> {
        let sql = self.inner.sql.leases.clone();
        views::leases(&self.inner.pool, sql, |t: NaiveDateTime| t.and_utc()).await
    }

    async fn overview(&self, top_n: u32) -> Result<Overview> {
        let sql = &self.inner.sql;
        let counts = self.counts().await?;
        let statements = OverviewSql {
            due: sql.due.clone(),
            parked: sql.parked.clone(),
            claims_by: sql.claims_by.clone(),
            by_topic: sql.by_topic.clone(),
        };
        views::overview(&self.inner.pool, counts, statements, top_n, |s| s, |t| t).await
    }

    async fn held_keys(&self, ordering: &KeyOrdering) -> Result<HeldKeys> {
        self.count_held_keys(ordering).await
    }

    async fn due_held_by_order(&self, ordering: &KeyOrdering) -> Result<DueHeld> {
        self.count_due_held(ordering).await
    }

    async fn cleanup_horizon(&self) -> Result<crate::store::CleanupHorizon> {
        let pool = &self.inner.pool;
        let sql = &self.inner.sql;
        // The oldest InnoDB transaction of another connection: its read view keeps purge
        // from removing the undo records (and delete-marked rows) of every later change.
        // `trx_started` and NOW() are both in the session's time zone.
        // Age (s), thread id, user, host, state.
        type Oldest = (
            i64,
            Option<i64>,
            Option<String>,
            Option<String>,
            Option<String>,
        );
        let oldest: Option<Oldest> = sqlx::query_as(sql.oldest_transaction.clone())
            .fetch_optional(pool)
            .await?;
        // The history list length, where the server tells it (MariaDB's status variable;
        // MySQL's INNODB_METRICS counter); unreadable is None, not an error.
        let history: Option<i64> =
            match sqlx::query_scalar::<_, String>(sql.history_mariadb.clone())
                .fetch_optional(pool)
                .await
            {
                Ok(Some(v)) => v.trim().parse().ok(),
                _ => sqlx::query_scalar::<_, i64>(sql.history_mysql.clone())
                    .fetch_optional(pool)
                    .await
                    .ok()
                    .flatten(),
            };
        Ok(crate::store::CleanupHorizon {
            oldest: oldest.map(
                |(age_s, pid, user, host, state)| crate::store::OldTransaction {
                    kind: "session".to_owned(),
                    age_s: age_s.max(0) as f64,
                    pid,
                    user,
                    application: host,
                    state,
                    gid: None,
                },
            ),
            xmin_age: None,
            slot: None,
            history_length: history,
        })
    }

    async fn find_messages(
        &self,
        query: &crate::store::lookup::MessageQuery,
        limit: u32,
    ) -> Result<Vec<crate::store::lookup::MessageLocation>> {
        let sql = FindSql {
            message_id: self.inner.sql.find_by_id.clone(),
            topic_key: self.inner.sql.find_by_topic_key.clone(),
            key: self.inner.sql.find_by_key.clone(),
        };
        let id = |id: &uuid::Uuid| id.hyphenated().to_string();
        let rows = views::find(&self.inner.pool, query, limit, sql, id).await?;
        rows.iter()
            .map(|r| {
                let mid = r.try_get::<String, _>("message_id")?;
                let time = |c: &str| -> Result<Option<chrono::DateTime<chrono::Utc>>> {
                    Ok(r.try_get::<Option<NaiveDateTime>, _>(c)?
                        .map(|t| t.and_utc()))
                };
                let text = LocationText {
                    message_id: crate::store::text_message_id(r.try_get("id")?, &mid)?,
                    topic: r.try_get("topic")?,
                    key: r.try_get("key")?,
                    status: r.try_get("status")?,
                    occurred_at: r.try_get::<NaiveDateTime, _>("occurred_at")?.and_utc(),
                    available_at: r.try_get::<NaiveDateTime, _>("available_at")?.and_utc(),
                    locked_until: time("locked_until")?,
                    dispatched_at: time("dispatched_at")?,
                };
                views::location(r, text)
            })
            .collect()
    }

    async fn throughput(&self, minutes: u32) -> Result<Vec<crate::store::lookup::MinuteCounts>> {
        let minutes = minutes.min(crate::store::lookup::MAX_THROUGHPUT_MINUTES);
        let rows: Vec<(i64, i64, i64)> = sqlx::query_as(self.inner.sql.throughput.clone())
            .bind(i64::from(minutes))
            .bind(i64::from(minutes))
            .fetch_all(&self.inner.pool)
            .await?;
        Ok(crate::store::lookup::fill_minutes(minutes, &rows))
    }
}

//! The relay registry: heartbeats, deregistration and the list of relays.

use super::{PgStore, schema_sql};
use crate::error::Result;
use crate::store::Registry;
use crate::store::{RelayHeartbeat, RelayRecord, millis};
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::AssertSqlSafe;
use std::time::Duration;

#[async_trait]
impl Registry for PgStore {
    async fn heartbeat(&self, beat: &RelayHeartbeat) -> Result<()> {
        let s = self.s();
        sqlx::query(AssertSqlSafe(schema_sql(
            include_str!("sql/heartbeat.sql"),
            s,
        )))
        .bind(&beat.relay_id)
        .bind(&beat.host)
        .bind(beat.pid)
        .bind(&beat.version)
        .bind(&beat.sink)
        .bind(beat.in_flight)
        .bind(beat.last_claim_ago.map(millis))
        .bind(crate::store::ops::destinations_json(&beat.destinations))
        .bind(&beat.instance)
        .bind(millis(beat.lease))
        .execute(&self.inner.pool)
        .await?;
        Ok(())
    }

    async fn deregister(&self, relay_id: &str, instance: &str) -> Result<()> {
        let s = self.s();
        sqlx::query(AssertSqlSafe(schema_sql(
            include_str!("sql/deregister.sql"),
            s,
        )))
        .bind(relay_id)
        .bind(instance)
        .execute(&self.inner.pool)
        .await?;
        Ok(())
    }

    async fn relays(&self, within: Duration) -> Result<Vec<RelayRecord>> {
        let s = self.s();
        type Row = (
            String,
            String,
            i64,
            String,
            String,
            i64,
            DateTime<Utc>,
            DateTime<Utc>,
            f64,
            Option<DateTime<Utc>>,
            Option<String>,
            String,
        );
        let rows: Vec<Row> =
            sqlx::query_as(AssertSqlSafe(schema_sql(include_str!("sql/relays.sql"), s)))
                .bind(millis(within))
                .fetch_all(&self.inner.pool)
                .await?;
        Ok(rows
            .into_iter()
            .map(|r| RelayRecord {
                relay_id: r.0,
                instance: r.11,
                host: r.1,
                pid: r.2,
                version: r.3,
                sink: r.4,
                in_flight: r.5,
                started_at: r.6,
                last_seen: r.7,
                last_seen_ago_s: r.8.max(0.0),
                last_claim_at: r.9,
                destinations: crate::store::ops::parse_destinations(r.10.as_deref()),
            })
            .collect())
    }
}

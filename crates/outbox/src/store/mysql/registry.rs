//! The relay registry: heartbeats, deregistration and the list of live relays.

use super::MySqlStore;
use crate::error::Result;
use crate::store::{Registry, RelayHeartbeat, RelayRecord, millis};
use async_trait::async_trait;
use chrono::NaiveDateTime;
use std::time::Duration;

#[async_trait]
impl Registry for MySqlStore {
    async fn heartbeat(&self, beat: &RelayHeartbeat) -> Result<()> {
        sqlx::query(self.inner.sql.heartbeat.clone())
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
        // Rows not seen for an hour: found by a plain read, deleted by primary key (still
        // stale), so no range of the registry is ever locked.
        let stale: Vec<(String, String)> = sqlx::query_as(self.inner.sql.relays_stale.clone())
            .fetch_all(&self.inner.pool)
            .await?;
        for (relay_id, instance) in stale {
            sqlx::query(self.inner.sql.relay_expire.clone())
                .bind(relay_id)
                .bind(instance)
                .execute(&self.inner.pool)
                .await?;
        }
        Ok(())
    }

    async fn deregister(&self, relay_id: &str, instance: &str) -> Result<()> {
        sqlx::query(self.inner.sql.deregister.clone())
            .bind(relay_id)
            .bind(instance)
            .execute(&self.inner.pool)
            .await?;
        Ok(())
    }

    async fn relays(&self, within: Duration) -> Result<Vec<RelayRecord>> {
        type Row = (
            String,
            String,
            i64,
            String,
            String,
            i64,
            NaiveDateTime,
            NaiveDateTime,
            i64,
            Option<NaiveDateTime>,
            Option<String>,
            String,
        );
        let rows: Vec<Row> = sqlx::query_as(self.inner.sql.relays.clone())
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
                started_at: r.6.and_utc(),
                last_seen: r.7.and_utc(),
                last_seen_ago_s: r.8.max(0) as f64 / 1e6,
                last_claim_at: r.9.map(|t| t.and_utc()),
                destinations: crate::store::ops::parse_destinations(r.10.as_deref()),
            })
            .collect())
    }
}

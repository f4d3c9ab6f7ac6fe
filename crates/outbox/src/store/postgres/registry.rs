//! The relay registry: heartbeats, deregistration and the list of relays.

use super::PgStore;
use crate::error::Result;
use crate::store::{RelayHeartbeat, RelayRecord, millis};
use chrono::{DateTime, Utc};
use sqlx::AssertSqlSafe;
use std::time::Duration;

impl PgStore {
    pub(super) async fn heartbeat(&self, beat: &RelayHeartbeat) -> Result<()> {
        let s = self.s();
        sqlx::query(AssertSqlSafe(format!(
            "WITH up AS (
               INSERT INTO {s}.relays (relay_id, host, pid, version, sink, in_flight, last_claim_at,
                                       destinations, instance, lease_ms)
               VALUES ($1, $2, $3, $4, $5, $6, now() - $7 * interval '1 millisecond', $8, $9, $10)
               ON CONFLICT (relay_id, instance) DO UPDATE SET lease_ms = excluded.lease_ms,
                   host = excluded.host, pid = excluded.pid, version = excluded.version,
                   sink = excluded.sink, in_flight = excluded.in_flight, last_seen = now(),
                   last_claim_at = excluded.last_claim_at, destinations = excluded.destinations
               RETURNING 1)
             DELETE FROM {s}.relays WHERE last_seen < now() - interval '1 hour'"
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

    pub(super) async fn deregister(&self, relay_id: &str, instance: &str) -> Result<()> {
        let s = self.s();
        sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {s}.relays WHERE relay_id = $1 AND instance = $2"
        )))
        .bind(relay_id)
        .bind(instance)
        .execute(&self.inner.pool)
        .await?;
        Ok(())
    }

    pub(super) async fn relays(&self, within: Duration) -> Result<Vec<RelayRecord>> {
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
        let rows: Vec<Row> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT relay_id, host, pid, version, sink, in_flight, started_at, last_seen,
                    extract(epoch FROM now() - last_seen)::float8, last_claim_at, destinations,
                    instance
             FROM {s}.relays WHERE last_seen >= now() - $1 * interval '1 millisecond'
             ORDER BY started_at, relay_id, instance"
        )))
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

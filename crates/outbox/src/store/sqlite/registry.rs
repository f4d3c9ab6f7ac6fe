//! The relay registry: each relay's heartbeat row, its removal, and the list of relays.

use super::decode::ms_to_time;
use super::{NOW_MS, SqliteStore};
use crate::error::Result;
use crate::store::common::registry;
use crate::store::{Registry, RelayHeartbeat, RelayRecord, millis};
use async_trait::async_trait;
use sqlx::AssertSqlSafe;
use std::time::Duration;

#[async_trait]
impl Registry for SqliteStore {
    async fn heartbeat(&self, beat: &RelayHeartbeat) -> Result<()> {
        let p = self.p();
        let n = NOW_MS;
        let mut tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await?;
        registry::heartbeat(AssertSqlSafe(format!(
            "INSERT INTO {p}_relays (relay_id, host, pid, version, sink, in_flight, started_at,
                                     last_seen, last_claim_at, destinations, instance, lease_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, {n}, {n}, CASE WHEN ?7 IS NULL THEN NULL ELSE {n} - ?7 END, ?8,
                     ?9, ?10)
             ON CONFLICT (relay_id, instance) DO UPDATE SET lease_ms = excluded.lease_ms,
                 host = excluded.host, pid = excluded.pid, version = excluded.version,
                 sink = excluded.sink, in_flight = excluded.in_flight,
                 last_seen = excluded.last_seen, last_claim_at = excluded.last_claim_at,
                 destinations = excluded.destinations"
        )), beat)
        .execute(&mut *tx)
        .await?;
        sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {p}_relays WHERE last_seen < {n} - 3600000"
        )))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn deregister(&self, relay_id: &str, instance: &str) -> Result<()> {
        let sql = AssertSqlSafe(format!(
            "DELETE FROM {}_relays WHERE relay_id = ?1 AND instance = ?2",
            self.p()
        ));
        registry::deregister(&self.inner.pool, sql, relay_id, instance).await
    }

    async fn relays(&self, within: Duration) -> Result<Vec<RelayRecord>> {
        let p = self.p();
        let n = NOW_MS;
        type Row = registry::RelayRow<i64, i64>;
        let rows: Vec<Row> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT relay_id, host, pid, version, sink, in_flight, started_at, last_seen,
                    {n} - last_seen, last_claim_at, destinations, instance
             FROM {p}_relays WHERE last_seen >= {n} - ?1
             ORDER BY started_at, relay_id, instance"
        )))
        .bind(millis(within))
        .fetch_all(&self.inner.pool)
        .await?;
        Ok(registry::relay_records(rows, ms_to_time, |ms| {
            ms.max(0) as f64 / 1000.0
        }))
    }
}

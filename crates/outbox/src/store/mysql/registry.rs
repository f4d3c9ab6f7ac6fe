//! The relay registry: heartbeats, deregistration and the list of live relays.

use super::MySqlStore;
use crate::error::Result;
use crate::store::common::registry;
use crate::store::{Registry, RelayHeartbeat, RelayRecord, millis};
use async_trait::async_trait;
use chrono::NaiveDateTime;
use std::time::Duration;

#[async_trait]
impl Registry for MySqlStore {
    async fn heartbeat(&self, beat: &RelayHeartbeat) -> Result<()> {
        registry::heartbeat(self.inner.sql.heartbeat.clone(), beat)
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
        let sql = self.inner.sql.deregister.clone();
        registry::deregister(&self.inner.pool, sql, relay_id, instance).await
    }

    async fn relays(&self, within: Duration) -> Result<Vec<RelayRecord>> {
        type Row = registry::RelayRow<NaiveDateTime, i64>;
        let rows: Vec<Row> = sqlx::query_as(self.inner.sql.relays.clone())
            .bind(millis(within))
            .fetch_all(&self.inner.pool)
            .await?;
        Ok(registry::relay_records(
            rows,
            |t| t.and_utc(),
            |us| us.max(0) as f64 / 1e6,
        ))
    }
}

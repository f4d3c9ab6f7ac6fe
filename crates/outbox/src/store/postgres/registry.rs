//! The relay registry: heartbeats, deregistration and the list of relays.

use super::{PgStore, schema_sql};
use crate::error::Result;
use crate::store::Registry;
use crate::store::common::registry;
use crate::store::{RelayHeartbeat, RelayRecord, millis};
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::AssertSqlSafe;
use std::time::Duration;

#[async_trait]
impl Registry for PgStore {
    async fn heartbeat(&self, beat: &RelayHeartbeat) -> Result<()> {
        let s = self.s();
        registry::heartbeat(
            AssertSqlSafe(schema_sql(include_str!("sql/heartbeat.sql"), s)),
            beat,
        )
        .execute(&self.inner.pool)
        .await?;
        Ok(())
    }

    async fn deregister(&self, relay_id: &str, instance: &str) -> Result<()> {
        let sql = AssertSqlSafe(schema_sql(include_str!("sql/deregister.sql"), self.s()));
        registry::deregister(&self.inner.pool, sql, relay_id, instance).await
    }

    async fn relays(&self, within: Duration) -> Result<Vec<RelayRecord>> {
        let s = self.s();
        type Row = registry::RelayRow<DateTime<Utc>, f64>;
        let rows: Vec<Row> =
            sqlx::query_as(AssertSqlSafe(schema_sql(include_str!("sql/relays.sql"), s)))
                .bind(millis(within))
                .fetch_all(&self.inner.pool)
                .await?;
        Ok(registry::relay_records(rows, |t| t, |s| s.max(0.0)))
    }
}

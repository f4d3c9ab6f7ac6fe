//! A claim's outcome: settle, delete on dispatch, and lease renewal; and `Relaying`, the
//! relay's role trait, which calls the claim, the schema check and the pause state in
//! their rooms.

use super::{SqliteStore, ids_json};
use crate::error::Result;
use crate::store::{Claim, ClaimRequest, PauseState, Relaying, Settled, Settlement, millis};
use async_trait::async_trait;
use sqlx::AssertSqlSafe;
use std::time::Duration;
use tokio::sync::watch;
use uuid::Uuid;

#[async_trait]
impl Relaying for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn check_schema(&self) -> Result<()> {
        SqliteStore::check_schema(self).await
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim> {
        SqliteStore::claim(self, req).await
    }

    async fn settle(&self, token: Uuid, settlement: &Settlement) -> Result<Settled> {
        if settlement.delete_dispatched && !settlement.dispatched.is_empty() {
            return crate::store::settle_deleting(self, token, settlement).await;
        }
        if settlement.is_empty() {
            return Ok(Settled::default());
        }
        let rows: Vec<serde_json::Value> = crate::store::settle_rows(settlement)
            .into_iter()
            .map(|(id, st, delay, err, refund)| serde_json::json!([id, st, delay, err, refund]))
            .collect();
        let changed: Vec<i64> = sqlx::query_scalar(self.inner.sql.settle.clone())
            .bind(serde_json::Value::from(rows).to_string())
            .bind(token.hyphenated().to_string())
            .fetch_all(&self.inner.pool)
            .await?;
        Ok(crate::store::settled(settlement, changed))
    }

    async fn delete_claimed(&self, token: Uuid, ids: &[i64]) -> Result<Vec<i64>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let p = &self.inner.config.schema;
        Ok(sqlx::query_scalar(AssertSqlSafe(format!(
            "DELETE FROM {p}_messages
             WHERE id IN (SELECT value FROM json_each(?2)) AND claim_token = ?1 AND status <= 1
             RETURNING id"
        )))
        .bind(token.hyphenated().to_string())
        .bind(ids_json(ids))
        .fetch_all(&self.inner.pool)
        .await?)
    }

    async fn renew(&self, token: Uuid, ids: &[i64], lease: Duration) -> Result<Vec<i64>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        Ok(sqlx::query_scalar(self.inner.sql.renew.clone())
            .bind(token.hyphenated().to_string())
            .bind(millis(lease))
            .bind(ids_json(ids))
            .fetch_all(&self.inner.pool)
            .await?)
    }

    async fn pause_state(&self) -> Result<PauseState> {
        SqliteStore::pause_state(self).await
    }

    fn wakeups(&self) -> watch::Receiver<u64> {
        self.start_watcher();
        self.inner.wakeup.subscribe()
    }

    fn one_writer(&self) -> bool {
        true
    }
}

//! A claim's outcome: settle, delete on dispatch, and lease renewal.

use super::{PgStore, schema_sql};
use crate::error::Result;
use crate::store::Relaying;
use crate::store::{Claim, ClaimRequest, PauseState};
use crate::store::{Settled, Settlement, millis};
use async_trait::async_trait;
use sqlx::AssertSqlSafe;
use std::time::Duration;
use tokio::sync::watch;
use uuid::Uuid;

#[async_trait]
impl Relaying for PgStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    async fn settle(&self, token: Uuid, settlement: &Settlement) -> Result<Settled> {
        if settlement.delete_dispatched && !settlement.dispatched.is_empty() {
            return crate::store::settle_deleting(self, token, settlement).await;
        }
        if settlement.is_empty() {
            return Ok(Settled::default());
        }
        if settlement.len() == settlement.dispatched.len() {
            let changed: Vec<i64> = sqlx::query_scalar(self.inner.sql.mark.clone())
                .bind(&settlement.dispatched)
                .bind(token)
                .fetch_one(&self.inner.pool)
                .await?;
            return Ok(crate::store::settled(settlement, changed));
        }
        let r = &settlement.retries;
        let q = &settlement.dead;
        let changed: Vec<i64> = sqlx::query_scalar(self.inner.sql.settle.clone())
            .bind(&settlement.dispatched)
            .bind(r.iter().map(|r| r.id).collect::<Vec<_>>())
            .bind(r.iter().map(|r| millis(r.delay)).collect::<Vec<_>>())
            .bind(r.iter().map(|r| r.error.clone()).collect::<Vec<_>>())
            .bind(r.iter().map(|r| r.refund_attempt).collect::<Vec<_>>())
            .bind(q.iter().map(|d| d.id).collect::<Vec<_>>())
            .bind(q.iter().map(|d| d.error.clone()).collect::<Vec<_>>())
            .bind(&settlement.release)
            .bind(token)
            .fetch_one(&self.inner.pool)
            .await?;
        Ok(crate::store::settled(settlement, changed))
    }

    async fn delete_claimed(&self, token: Uuid, ids: &[i64]) -> Result<Vec<i64>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let s = self.s();
        Ok(sqlx::query_scalar(AssertSqlSafe(schema_sql(
            include_str!("sql/delete_claimed.sql"),
            s,
        )))
        .bind(ids)
        .bind(token)
        .fetch_one(&self.inner.pool)
        .await?)
    }

    async fn renew(&self, token: Uuid, ids: &[i64], lease: Duration) -> Result<Vec<i64>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        Ok(sqlx::query_scalar(self.inner.sql.renew.clone())
            .bind(token)
            .bind(millis(lease))
            .bind(ids)
            .fetch_one(&self.inner.pool)
            .await?)
    }

    async fn check_schema(&self) -> Result<()> {
        PgStore::check_schema(self).await
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim> {
        PgStore::claim(self, req).await
    }

    async fn pause_state(&self) -> Result<PauseState> {
        PgStore::pause_state(self).await
    }

    fn wakeups(&self) -> watch::Receiver<u64> {
        self.start_listener();
        self.inner.wakeup.subscribe()
    }
}

//! Retention: purging dispatched rows and old inbox rows in batches.

use super::{MySqlStore, retry_deadlock};
use crate::error::Result;
use crate::store::PurgeBatch;
use crate::store::common::retention;
use std::time::Duration;

impl MySqlStore {
    pub(super) async fn purge_dispatched(
        &self,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<PurgeBatch> {
        retry_deadlock(|| self.purge_once(older_than, batch_size)).await
    }

    /// One purge batch under the purge lock (see [`Maintenance::purge`](crate::store::Maintenance::purge)); [`retry_deadlock`] reruns it.
    async fn purge_once(&self, older_than: Duration, batch_size: u32) -> Result<PurgeBatch> {
        let p = &self.inner.config.schema;
        let mut conn = self.inner.pool.acquire().await?;
        let lock = format!("outbox_purge_{p}");
        let got: Option<i64> = sqlx::query_scalar(self.inner.sql.lock_try.clone())
            .bind(&lock)
            .fetch_one(&mut *conn)
            .await?;
        if got != Some(1) {
            return Ok(retention::locked_out());
        }
        let r = retention::batch(self.inner.sql.purge.clone(), older_than, batch_size)
            .execute(&mut *conn)
            .await;
        let _ = sqlx::query(self.inner.sql.lock_release.clone())
            .bind(&lock)
            .execute(&mut *conn)
            .await;
        Ok(retention::purged(r?.rows_affected()))
    }

    pub(super) async fn purge_inbox(&self, older_than: Duration, batch_size: u32) -> Result<u64> {
        let sql = self.inner.sql.inbox_purge.clone();
        retention::inbox(&self.inner.pool, sql, older_than, batch_size).await
    }
}

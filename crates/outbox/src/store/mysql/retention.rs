//! Retention: purging dispatched rows and old inbox rows in batches.

use super::{MySqlStore, retry_deadlock};
use crate::error::Result;
use crate::store::{PurgeBatch, millis};
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
            return Ok(PurgeBatch {
                deleted: 0,
                locked_out: true,
            });
        }
        let r = sqlx::query(self.inner.sql.purge.clone())
            .bind(millis(older_than))
            .bind(i64::from(batch_size))
            .execute(&mut *conn)
            .await;
        let _ = sqlx::query(self.inner.sql.lock_release.clone())
            .bind(&lock)
            .execute(&mut *conn)
            .await;
        let deleted = r?.rows_affected();
        crate::metrics::purged(deleted);
        Ok(PurgeBatch {
            deleted,
            locked_out: false,
        })
    }

    pub(super) async fn purge_inbox(&self, older_than: Duration, batch_size: u32) -> Result<u64> {
        if batch_size == 0 {
            return Ok(0);
        }
        let r = sqlx::query(self.inner.sql.inbox_purge.clone())
            .bind(millis(older_than))
            .bind(i64::from(batch_size))
            .execute(&self.inner.pool)
            .await?;
        Ok(r.rows_affected())
    }
}

//! Retention: purging dispatched rows and old inbox rows in batches.

use super::SqliteStore;
use crate::error::Result;
use crate::store::{PurgeBatch, millis};
use std::time::Duration;

impl SqliteStore {
    pub(super) async fn purge_dispatched(
        &self,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<PurgeBatch> {
        // SQLite has one writer at a time: the write lock is the purge lock.
        let r = sqlx::query(self.inner.sql.purge.clone())
            .bind(millis(older_than))
            .bind(i64::from(batch_size))
            .execute(&self.inner.pool)
            .await?;
        crate::metrics::purged(r.rows_affected());
        Ok(PurgeBatch {
            deleted: r.rows_affected(),
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

//! Retention: purging dispatched rows and old inbox rows in batches.

use super::SqliteStore;
use crate::error::Result;
use crate::store::PurgeBatch;
use crate::store::common::retention;
use std::time::Duration;

impl SqliteStore {
    pub(super) async fn purge_dispatched(
        &self,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<PurgeBatch> {
        // SQLite has one writer at a time: the write lock is the purge lock.
        let r = retention::batch(self.inner.sql.purge.clone(), older_than, batch_size)
            .execute(&self.inner.pool)
            .await?;
        Ok(retention::purged(r.rows_affected()))
    }

    pub(super) async fn purge_inbox(&self, older_than: Duration, batch_size: u32) -> Result<u64> {
        let sql = self.inner.sql.inbox_purge.clone();
        retention::inbox(&self.inner.pool, sql, older_than, batch_size).await
    }
}

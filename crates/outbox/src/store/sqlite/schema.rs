//! The schema: its migrations (tables and indexes, in `sql/migration_N.sql`), `migrate`
//! and the version check.

use super::{NOW_MS, SCHEMA_VERSION, SqliteStore};
use crate::error::Result;
use crate::store::common::retention;
use crate::store::common::schema::{self, MigrateSql};
use crate::store::{KeyOrdering, Maintenance, PurgeBatch};
use async_trait::async_trait;
use sqlx::{AssertSqlSafe, SqlSafeStr};
use std::time::Duration;

/// The migrations in order, migration N in `sql/migration_N.sql`: each the text sent as it
/// is, with `{p}` the table prefix and `{n}` [`NOW_MS`] (whitespace included: SQLite keeps
/// the text of a `CREATE` in `sqlite_master`). Each is applied once, all in `migrate`'s
/// one transaction.
const MIGRATIONS: [&str; 9] = [
    include_str!("sql/migration_1.sql"),
    include_str!("sql/migration_2.sql"),
    include_str!("sql/migration_3.sql"),
    include_str!("sql/migration_4.sql"),
    // v5: a topic pause carries its pattern's regex (`TopicPattern::regex`), so the
    // claim matches topics against it; `migrate` fills it for pauses made before.
    include_str!("sql/migration_5.sql"),
    // v6: per-key ordering reads a key's rows that are not dispatched, in id order.
    include_str!("sql/migration_6.sql"),
    // v7: the registry keeps each relay's destinations and their state (JSON).
    include_str!("sql/migration_7.sql"),
    // v8: a registry row per relay instance (two relays under one id each keep
    // theirs), with the instance's lease (which claims are whose). SQLite cannot
    // change a primary key: the table is rebuilt.
    include_str!("sql/migration_8.sql"),
    // v9: a claim writes no column an index reads (see `claim::claim_sql`); earlier
    // builds refuse the file.
    include_str!("sql/migration_9.sql"),
];

const _: () = assert!(MIGRATIONS.len() as i64 == SCHEMA_VERSION);

fn migrations(p: &str) -> Vec<String> {
    MIGRATIONS
        .iter()
        .map(|text| text.replace("{p}", p).replace("{n}", NOW_MS))
        .collect()
}

impl SqliteStore {
    pub(super) async fn check_schema(&self) -> Result<()> {
        let p = self.inner.config.schema.as_str();
        let table = format!("{p}_schema_migrations");
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)",
        )
        .bind(&table)
        .fetch_one(&self.inner.pool)
        .await?;
        let version = AssertSqlSafe(format!("SELECT coalesce(max(version), 0) FROM {table}"));
        let version = version.into_sql_str();
        schema::verify(&self.inner.pool, exists, version, p, SCHEMA_VERSION).await
    }
}

#[async_trait]
impl Maintenance for SqliteStore {
    async fn migrate(&self) -> Result<()> {
        let p = self.inner.config.schema.as_str();
        let mut tx = self.inner.pool.begin_with("BEGIN IMMEDIATE").await?;
        let sql = |t: String| AssertSqlSafe(t).into_sql_str();
        let statements = MigrateSql {
            versions_table: sql(format!(
                "CREATE TABLE IF NOT EXISTS {p}_schema_migrations (
                     version INTEGER PRIMARY KEY, applied_at INTEGER NOT NULL DEFAULT ({NOW_MS}))"
            )),
            version: sql(format!(
                "SELECT coalesce(max(version), 0) FROM {p}_schema_migrations"
            )),
            record: sql(format!(
                "INSERT INTO {p}_schema_migrations (version) VALUES (?1)"
            )),
        };
        let migrations = migrations(p).into_iter().map(|m| vec![m]).collect();
        schema::apply::<sqlx::Sqlite>(&mut *tx, statements, migrations).await?;
        let patterns = sql(format!("SELECT pattern FROM {p}_topic_pauses"));
        let set = sql(format!(
            "UPDATE {p}_topic_pauses SET regex = ?2 WHERE pattern = ?1"
        ));
        schema::refill_pause_regexes::<sqlx::Sqlite>(&mut *tx, patterns, set, false).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn purge(&self, older_than: Duration, batch_size: u32) -> Result<PurgeBatch> {
        self.purge_dispatched(older_than, batch_size).await
    }

    async fn inbox_purge(&self, older_than: Duration, batch_size: u32) -> Result<u64> {
        self.purge_inbox(older_than, batch_size).await
    }

    async fn count_purgeable(&self, older_than: Duration) -> Result<u64> {
        let p = self.inner.config.schema.as_str();
        let sql = format!(
            "SELECT count(*) FROM {p}_messages WHERE status = 2 AND dispatched_at < {NOW_MS} - ?1"
        );
        retention::count(&self.inner.pool, sql, older_than).await
    }

    async fn count_inbox_purgeable(&self, older_than: Duration) -> Result<u64> {
        let p = self.inner.config.schema.as_str();
        let sql = format!("SELECT count(*) FROM {p}_inbox WHERE received_at < {NOW_MS} - ?1");
        retention::count(&self.inner.pool, sql, older_than).await
    }

    async fn park_held(&self, ordering: &KeyOrdering) -> Result<u64> {
        SqliteStore::park_held(self, ordering).await
    }

    async fn unpark_released(&self, ordering: &KeyOrdering) -> Result<u64> {
        SqliteStore::unpark_released(self, ordering).await
    }
}

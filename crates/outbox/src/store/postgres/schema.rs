//! The schema: its migrations, the `enqueue(...)` SQL function, `migrate` and the version
//! check; and retention (the purges).

use super::{PgStore, SCHEMA_VERSION, schema_sql};
use crate::error::Result;
use crate::store::KeyOrdering;
use crate::store::Maintenance;
use crate::store::PurgeBatch;
use crate::store::common::retention;
use crate::store::common::schema::{self, MigrateSql};
use async_trait::async_trait;
use sqlx::{AssertSqlSafe, SqlSafeStr};
use std::time::Duration;

/// The `enqueue(...)` SQL function, as the latest migration defines it (v1 creates it,
/// later versions replace it).
pub(super) fn enqueue_function(s: &str) -> String {
    schema_sql(include_str!("sql/enqueue_function.sql"), s)
}

/// The migrations, in order; each is applied once, in its own transaction.
pub(super) fn migrations(s: &str) -> Vec<String> {
    vec![
        schema_sql(include_str!("sql/migrations/01_base.sql"), s)
            .replace("{enqueue_fn}", &enqueue_function(s)),
        schema_sql(include_str!("sql/migrations/02_retention.sql"), s),
        schema_sql(include_str!("sql/migrations/03_operations.sql"), s),
        schema_sql(include_str!("sql/migrations/04_inbox.sql"), s),
        // v5: enqueue() skips the header checks for a message without headers.
        enqueue_function(s),
        // v6: a topic pause carries its pattern's regex (`TopicPattern::regex`), so the
        // claim matches topics against it; `migrate` fills it for pauses made before.
        schema_sql(include_str!("sql/migrations/06_topic_pause_regex.sql"), s),
        // v7: per-key ordering reads a key's rows that are not dispatched, in id order.
        // By md5(key): a key of any length fits the index (a btree entry is at most 2704
        // bytes); two keys of one topic with the same hash only hold each other back.
        schema_sql(include_str!("sql/migrations/07_messages_key.sql"), s),
        // v8: the registry keeps each relay's destinations and their state (JSON).
        schema_sql(include_str!("sql/migrations/08_relay_destinations.sql"), s),
        // v9: a registry row per relay instance (two relays under one id each keep
        // theirs), with the instance's lease (which claims are whose).
        schema_sql(include_str!("sql/migrations/09_relay_instances.sql"), s),
        // v10: the claim keeps a row's status and available_at (a claimed row is one
        // holding a token), and the table keeps room on each page for the claim's new
        // version, so a claim writes no index entry (see `claim::claim_set`).
        schema_sql(include_str!("sql/migrations/10_hot_claim.sql"), s),
    ]
}

impl PgStore {
    /// The limit `{schema}.enqueue(...)` enforces (written by
    /// [`Maintenance::migrate`] from
    /// [`StoreConfig::max_message_bytes`](crate::StoreConfig::max_message_bytes)), in bytes;
    /// `None` before the first migration.
    ///
    /// # Errors
    /// Database errors other than a missing schema.
    pub async fn sql_enqueue_limit(&self) -> Result<Option<usize>> {
        let s = self.s();
        let r: std::result::Result<i32, sqlx::Error> = sqlx::query_scalar(AssertSqlSafe(
            schema_sql(include_str!("sql/max_message_bytes.sql"), s),
        ))
        .fetch_one(&self.inner.pool)
        .await;
        match r {
            Ok(n) => Ok(usize::try_from(n).ok()),
            // 42P01 undefined table, 3F000 undefined schema
            Err(sqlx::Error::Database(db))
                if matches!(db.code().as_deref(), Some("42P01") | Some("3F000")) =>
            {
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Turns the insert trigger that notifies relays on or off. Off saves producers the
    /// `pg_notify` per inserting statement; relays then find work by polling only.
    ///
    /// # Errors
    /// Database errors (the schema must be migrated).
    pub async fn set_notify(&self, on: bool) -> Result<()> {
        let s = &self.inner.config.schema;
        let verb = if on { "ENABLE" } else { "DISABLE" };
        sqlx::query(AssertSqlSafe(format!(
            "ALTER TABLE {s}.messages {verb} TRIGGER messages_notify"
        )))
        .execute(&self.inner.pool)
        .await?;
        Ok(())
    }

    pub(super) async fn check_schema(&self) -> Result<()> {
        let s = self.inner.config.schema.as_str();
        let exists: bool = sqlx::query_scalar(include_str!("sql/schema_migrations_exists.sql"))
            .bind(s)
            .fetch_one(&self.inner.pool)
            .await?;
        let version = self.inner.sql.version.clone();
        schema::verify(&self.inner.pool, exists, version, s, SCHEMA_VERSION).await
    }
}

#[async_trait]
impl Maintenance for PgStore {
    async fn migrate(&self) -> Result<()> {
        let s = self.inner.config.schema.as_str();
        let mut tx = self.inner.pool.begin().await?;
        // One migrator at a time, across processes.
        sqlx::query(include_str!("sql/advisory_xact_lock.sql"))
            .bind(format!("outbox-migrate-{s}"))
            .execute(&mut *tx)
            .await?;
        let sql = |t: &str| AssertSqlSafe(schema_sql(t, s)).into_sql_str();
        let statements = MigrateSql {
            versions_table: sql(include_str!("sql/migrations/schema_migrations.sql")),
            version: self.inner.sql.version.clone(),
            record: sql(include_str!("sql/record_migration.sql")),
        };
        let migrations = migrations(s).into_iter().map(|m| vec![m]).collect();
        schema::apply::<sqlx::Postgres>(&mut *tx, statements, migrations).await?;
        sqlx::query(sql(include_str!("sql/set_max_message_bytes.sql")))
            .bind(i32::try_from(self.inner.config.max_message_bytes).unwrap_or(i32::MAX))
            .execute(&mut *tx)
            .await?;
        let patterns = sql(include_str!("sql/topic_pause_patterns.sql"));
        let set = sql(include_str!("sql/set_topic_pause_regex.sql"));
        schema::refill_pause_regexes::<sqlx::Postgres>(&mut *tx, patterns, set, false).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn purge(&self, older_than: Duration, batch_size: u32) -> Result<PurgeBatch> {
        let s = &self.inner.config.schema;
        let mut tx = self.inner.pool.begin().await?;
        let got: bool = sqlx::query_scalar(include_str!("sql/try_advisory_xact_lock.sql"))
            .bind(format!("outbox-purge-{s}"))
            .fetch_one(&mut *tx)
            .await?;
        if !got {
            return Ok(retention::locked_out());
        }
        let r = retention::batch(self.inner.sql.purge.clone(), older_than, batch_size)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(retention::purged(r.rows_affected()))
    }

    async fn inbox_purge(&self, older_than: Duration, batch_size: u32) -> Result<u64> {
        let sql = self.inner.sql.inbox_purge.clone();
        retention::inbox(&self.inner.pool, sql, older_than, batch_size).await
    }

    async fn count_purgeable(&self, older_than: Duration) -> Result<u64> {
        let s = &self.inner.config.schema;
        let sql = format!(
            "SELECT count(*) FROM {s}.messages
             WHERE status = 2 AND dispatched_at < now() - $1 * interval '1 millisecond'"
        );
        retention::count(&self.inner.pool, sql, older_than).await
    }

    async fn count_inbox_purgeable(&self, older_than: Duration) -> Result<u64> {
        let s = &self.inner.config.schema;
        let sql = format!(
            "SELECT count(*) FROM {s}.inbox WHERE received_at < now() - $1 * interval '1 millisecond'"
        );
        retention::count(&self.inner.pool, sql, older_than).await
    }

    async fn park_held(&self, ordering: &KeyOrdering) -> Result<u64> {
        PgStore::park_held(self, ordering).await
    }

    async fn unpark_released(&self, ordering: &KeyOrdering) -> Result<u64> {
        PgStore::unpark_released(self, ordering).await
    }
}

//! The schema: migrations (tables, indexes and the SQL entry points `{prefix}_enqueue` and
//! `{prefix}_inbox_accept`, in `sql/migration_N.sql`), `migrate` and `check_schema`.

use super::statements::{inbox_lock_name, sections};
use super::{MySqlStore, SCHEMA_VERSION, error_number};
use crate::error::{Error, Result};
use crate::store::common::retention;
use crate::store::common::schema::{self, MigrateSql};
use crate::store::{KeyOrdering, Maintenance, PurgeBatch};
use async_trait::async_trait;
use sqlx::MySql;
use std::time::Duration;

/// A UUIDv7 built in SQL (RFC 9562 section 5.7): 48-bit Unix ms, version 7, variant 10,
/// the rest from MD5 of RAND() and UUID().
fn uuid_v7_sql() -> &'static str {
    include_str!("sql/uuid_v7.sql").trim_end()
}

/// The migrations in order, migration N in `sql/migration_N.sql` (each file says what it
/// adds). A statement follows a line `-- @run`, or `-- @unless_column TABLE COLUMN` for
/// one that runs through [`alter_unless_column`]; `{p}` is the table prefix, `{uuid}`
/// [`uuid_v7_sql`], `{lock}` the inbox lock of the procedure's consumer and id
/// ([`inbox_lock_name`]).
const MIGRATIONS: [&str; 9] = [
    include_str!("sql/migration_1.sql"),
    include_str!("sql/migration_2.sql"),
    include_str!("sql/migration_3.sql"),
    include_str!("sql/migration_4.sql"),
    include_str!("sql/migration_5.sql"),
    include_str!("sql/migration_6.sql"),
    include_str!("sql/migration_7.sql"),
    include_str!("sql/migration_8.sql"),
    include_str!("sql/migration_9.sql"),
];

const _: () = assert!(MIGRATIONS.len() as i64 == SCHEMA_VERSION);

/// Each migration is a list of statements, run one by one (MySQL DDL commits implicitly).
///
/// # Panics
/// On a tag of `sql/migration_N.sql` other than the two above (a build defect, caught by
/// any test that migrates).
fn migrations(p: &str) -> Vec<Vec<String>> {
    let uuid = uuid_v7_sql();
    let lock = inbox_lock_name(p, "CONVERT(p_consumer USING binary)", "LOWER(p_message_id)");
    MIGRATIONS
        .iter()
        .map(|text| {
            sections(text)
                .into_iter()
                .flat_map(|(tag, s)| {
                    let s = s
                        .replace("{uuid}", uuid)
                        .replace("{lock}", &lock)
                        .replace("{p}", p);
                    match tag.split_whitespace().collect::<Vec<_>>()[..] {
                        ["run"] => vec![s],
                        ["unless_column", table, column] => {
                            alter_unless_column(&table.replace("{p}", p), column, &s)
                        }
                        _ => panic!("unknown tag `-- @{tag}` in a migration"),
                    }
                })
                .collect()
        })
        .collect()
}

/// Statements that run `alter` only while `table` has no column `column` (MySQL has no
/// `ADD COLUMN IF NOT EXISTS`), so a migration interrupted after it can run again.
/// `alter` is our own DDL, without single quotes.
fn alter_unless_column(table: &str, column: &str, alter: &str) -> Vec<String> {
    vec![
        format!(
            "SET @outbox_ddl = (
                SELECT IF(COUNT(*) = 0, '{alter}', 'DO 0')
                FROM information_schema.columns
                WHERE table_schema = DATABASE() AND table_name = '{table}'
                  AND column_name = '{column}')"
        ),
        "PREPARE outbox_ddl FROM @outbox_ddl".to_owned(),
        "EXECUTE outbox_ddl".to_owned(),
        "DEALLOCATE PREPARE outbox_ddl".to_owned(),
    ]
}

impl MySqlStore {
    pub(super) async fn verify_schema(&self) -> Result<()> {
        let p = self.inner.config.schema.as_str();
        let table = format!("{p}_schema_migrations");
        let exists: i64 = sqlx::query_scalar(self.inner.sql.versions_exist.clone())
            .bind(&table)
            .fetch_one(&self.inner.pool)
            .await?;
        let version = self.inner.sql.version.clone();
        schema::verify(&self.inner.pool, exists > 0, version, p, SCHEMA_VERSION).await
    }

    /// The limit `{prefix}_enqueue(...)` enforces (written by [`Maintenance::migrate`] from
    /// [`StoreConfig::max_message_bytes`](crate::store::StoreConfig::max_message_bytes)), in bytes; `None` before the first migration.
    ///
    /// # Errors
    /// Database errors other than a missing table.
    pub async fn sql_enqueue_limit(&self) -> Result<Option<usize>> {
        let r: std::result::Result<i64, sqlx::Error> =
            sqlx::query_scalar(self.inner.sql.enqueue_limit.clone())
                .fetch_one(&self.inner.pool)
                .await;
        match r {
            Ok(n) => Ok(usize::try_from(n).ok()),
            Err(e) if error_number(&e) == Some(1146) => Ok(None), // no such table
            Err(e) => Err(e.into()),
        }
    }
}

#[async_trait]
impl Maintenance for MySqlStore {
    async fn migrate(&self) -> Result<()> {
        let p = self.inner.config.schema.as_str();
        let mut conn = self.inner.pool.acquire().await?;
        let lock = format!("outbox_migrate_{p}");
        let sql = &self.inner.sql;
        let got: Option<i64> = sqlx::query_scalar(sql.lock_migrate.clone())
            .bind(&lock)
            .fetch_one(&mut *conn)
            .await?;
        if got != Some(1) {
            return Err(Error::Timeout(Duration::from_secs(60)));
        }
        let result = async {
            let statements = MigrateSql {
                versions_table: sql.versions_table.clone(),
                version: sql.version.clone(),
                record: sql.version_insert.clone(),
            };
            schema::apply::<MySql>(&mut *conn, statements, migrations(p)).await?;
            sqlx::query(sql.enqueue_limit_set.clone())
                .bind(i64::try_from(self.inner.config.max_message_bytes).unwrap_or(i64::MAX))
                .execute(&mut *conn)
                .await?;
            let (patterns, set) = (sql.pause_patterns.clone(), sql.pause_regex_set.clone());
            schema::refill_pause_regexes::<MySql>(&mut *conn, patterns, set, true).await?;
            Ok::<_, Error>(())
        }
        .await;
        let _ = sqlx::query(sql.lock_release.clone())
            .bind(&lock)
            .execute(&mut *conn)
            .await;
        result
    }

    async fn purge(&self, older_than: Duration, batch_size: u32) -> Result<PurgeBatch> {
        self.purge_dispatched(older_than, batch_size).await
    }

    async fn inbox_purge(&self, older_than: Duration, batch_size: u32) -> Result<u64> {
        self.purge_inbox(older_than, batch_size).await
    }

    async fn count_purgeable(&self, older_than: Duration) -> Result<u64> {
        let p = &self.inner.config.schema;
        let sql = format!(
            "SELECT COUNT(*) FROM {p}_messages WHERE status = 2
             AND dispatched_at < TIMESTAMPADD(MICROSECOND, -? * 1000, UTC_TIMESTAMP(6))"
        );
        retention::count(&self.inner.pool, sql, older_than).await
    }

    async fn count_inbox_purgeable(&self, older_than: Duration) -> Result<u64> {
        let p = &self.inner.config.schema;
        let sql = format!(
            "SELECT COUNT(*) FROM {p}_inbox
             WHERE received_at < TIMESTAMPADD(MICROSECOND, -? * 1000, UTC_TIMESTAMP(6))"
        );
        retention::count(&self.inner.pool, sql, older_than).await
    }

    async fn park_held(&self, ordering: &KeyOrdering) -> Result<u64> {
        self.park_held_rows(ordering).await
    }

    async fn unpark_released(&self, ordering: &KeyOrdering) -> Result<u64> {
        self.unpark_released_rows(ordering).await
    }
}

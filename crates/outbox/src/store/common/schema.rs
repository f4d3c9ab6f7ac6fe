//! The migration loop and the schema check ([`crate::store::Maintenance::migrate`]), the
//! same steps in every store: each store supplies its statements, its migrations and the
//! lock that keeps one migrator at a time.

use crate::error::{Error, Result};
use sqlx::{AssertSqlSafe, Database, FromRow, SqlStr};

/// The statements of the migration loop, each store's own.
pub(crate) struct MigrateSql {
    /// Creates the table of applied versions when it is missing.
    pub(crate) versions_table: SqlStr,
    /// The highest applied version (0 for none): one `i64`.
    pub(crate) version: SqlStr,
    /// Records the version bound first as applied.
    pub(crate) record: SqlStr,
}

/// Applies the migrations after the highest applied version on `conn`, in order (each
/// migration's statements one by one, then its version recorded), and returns how many
/// were applied. The caller holds the migration lock or transaction.
pub(crate) async fn apply<DB>(
    conn: &mut DB::Connection,
    sql: MigrateSql,
    migrations: Vec<Vec<String>>,
) -> Result<usize>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    (i64,): for<'r> FromRow<'r, DB::Row>,
    i64: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    sqlx::raw_sql(sql.versions_table)
        .execute(&mut *conn)
        .await?;
    let current: i64 = sqlx::query_scalar(sql.version)
        .fetch_one(&mut *conn)
        .await?;
    let mut applied = 0;
    for (version, statements) in (1_i64..).zip(migrations) {
        if version <= current {
            continue;
        }
        for statement in statements {
            sqlx::raw_sql(AssertSqlSafe(statement))
                .execute(&mut *conn)
                .await?;
        }
        sqlx::query(sql.record.clone())
            .bind(version)
            .execute(&mut *conn)
            .await?;
        applied += 1;
    }
    Ok(applied)
}

/// Writes again the regular expression of every paused topic pattern (read by
/// `patterns`, one pattern a row) with `set`, which takes the pattern and the expression
/// in the order `regex_first` says: an upgrade that changes how patterns translate
/// applies to the pauses already stored.
pub(crate) async fn refill_pause_regexes<DB>(
    conn: &mut DB::Connection,
    patterns: SqlStr,
    set: SqlStr,
    regex_first: bool,
) -> Result<()>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    (String,): for<'r> FromRow<'r, DB::Row>,
    String: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    let stored: Vec<String> = sqlx::query_scalar(patterns).fetch_all(&mut *conn).await?;
    for (pattern, regex) in crate::store::pause_regexes(stored) {
        let (first, second) = if regex_first {
            (regex, pattern)
        } else {
            (pattern, regex)
        };
        sqlx::query(set.clone())
            .bind(first)
            .bind(second)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// The schema check: the highest applied version (`version`, read only when the
/// versions table `exists`) must be `expected`, else [`Error::NotMigrated`] naming
/// `schema`.
pub(crate) async fn verify<'c, DB, E>(
    e: E,
    exists: bool,
    version: SqlStr,
    schema: &str,
    expected: i64,
) -> Result<()>
where
    DB: Database,
    E: sqlx::Executor<'c, Database = DB>,
    (i64,): for<'r> FromRow<'r, DB::Row>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    let found = if exists {
        sqlx::query_scalar(version).fetch_one(e).await?
    } else {
        0
    };
    if found != expected {
        return Err(Error::NotMigrated {
            schema: schema.to_owned(),
            found,
            expected,
        });
    }
    Ok(())
}

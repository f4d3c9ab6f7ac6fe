//! Retention ([`crate::store::Maintenance::purge`], [`crate::store::Maintenance::inbox_purge`])
//! bound and counted the same way in every store: each store supplies its statements and
//! the lock that keeps one purger at a time.

use super::{Affected, Query};
use crate::error::Result;
use crate::store::{PurgeBatch, millis};
use sqlx::{Database, SqlStr};
use std::time::Duration;

/// A purge statement `sql` with its arguments bound in the order every store's statement
/// takes them: the age (ms), the batch size.
pub(crate) fn batch<'q, DB>(sql: SqlStr, older_than: Duration, batch_size: u32) -> Query<'q, DB>
where
    DB: Database,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    sqlx::query(sql)
        .bind(millis(older_than))
        .bind(i64::from(batch_size))
}

/// A purge batch that deleted `deleted` rows, counted in the metrics.
pub(crate) fn purged(deleted: u64) -> PurgeBatch {
    crate::metrics::purged(deleted);
    PurgeBatch {
        deleted,
        locked_out: false,
    }
}

/// A purge batch that did not run: another purger holds the lock.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn locked_out() -> PurgeBatch {
    PurgeBatch {
        deleted: 0,
        locked_out: true,
    }
}

/// One batch of the inbox purge statement `sql` (nothing when `batch_size` is 0):
/// returns the rows deleted.
pub(crate) async fn inbox<'c, DB, E>(
    e: E,
    sql: SqlStr,
    older_than: Duration,
    batch_size: u32,
) -> Result<u64>
where
    DB: Database,
    DB::QueryResult: Affected,
    E: sqlx::Executor<'c, Database = DB>,
    i64: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    if batch_size == 0 {
        return Ok(0);
    }
    Ok(batch(sql, older_than, batch_size)
        .execute(e)
        .await?
        .affected())
}

/// The count statement `sql` (its one argument the age, in ms) as a number of rows.
pub(crate) async fn count<'c, DB, E>(e: E, sql: String, older_than: Duration) -> Result<u64>
where
    DB: Database,
    E: sqlx::Executor<'c, Database = DB>,
    i64: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(millis(older_than))
        .fetch_one(e)
        .await?;
    Ok(u64::try_from(n).unwrap_or(0))
}

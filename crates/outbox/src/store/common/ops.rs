//! Operator actions ([`crate::store::Operations`]) bound and read the same way in every
//! store: the audit row, the topic pause, the pause state's topics, the dead-letter
//! selection. Each store supplies its statements and its time columns' type.

#[cfg(any(feature = "mysql", feature = "sqlite"))]
use super::Affected;
use super::Query;
use crate::error::Result;
use crate::store::ops::AuditEntry;
use crate::store::{PauseState, ReplayRequest, TopicPause};
use crate::topic::TopicPattern;
use chrono::{DateTime, Utc};
#[cfg(any(feature = "mysql", feature = "sqlite"))]
use sqlx::SqlStr;
use sqlx::{AssertSqlSafe, Database, SqlSafeStr};

/// The audit row of a replay request: who, why, the action and the selection.
pub(crate) fn replay_entry(req: &ReplayRequest) -> AuditEntry {
    AuditEntry {
        by: req.by.clone(),
        reason: req.reason.clone(),
        action: req.action.as_str().to_owned(),
        selection: req.describe(),
    }
}

/// The audit statement `sql` (an insert into the replays table) with `entry` bound in the
/// order every store's statement takes it: by, reason, action, selection.
pub(crate) fn audit_query<'q, DB>(sql: impl SqlSafeStr, entry: &AuditEntry) -> Query<'q, DB>
where
    DB: Database,
    String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    sqlx::query(sql)
        .bind(entry.by.clone())
        .bind(entry.reason.clone())
        .bind(entry.action.clone())
        .bind(entry.selection.clone())
}

/// The topic pause statement `sql` with its arguments bound in the order every store's
/// statement takes them: pattern, reason, by, the pattern as a regular expression.
pub(crate) fn pause_topic<'q, DB>(
    sql: impl SqlSafeStr,
    pattern: &TopicPattern,
    reason: &str,
    by: &str,
) -> Query<'q, DB>
where
    DB: Database,
    String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    sqlx::query(sql)
        .bind(pattern.as_str().to_owned())
        .bind(reason.to_owned())
        .bind(by.to_owned())
        .bind(pattern.regex())
}

/// The pause state from the switch's row and the paused topics as the statement returns
/// them: a JSON array of `[pattern, reason, by, paused at (ms since the epoch)]`, sorted
/// by pattern here, each time read by `at`. Unreadable JSON reads as no paused topic.
pub(crate) fn pause_state(
    paused: bool,
    reason: Option<String>,
    changed_at: DateTime<Utc>,
    topics: &str,
    at: impl Fn(i64) -> DateTime<Utc>,
) -> PauseState {
    let mut topics: Vec<(String, String, String, i64)> =
        serde_json::from_str(topics).unwrap_or_default();
    topics.sort();
    PauseState {
        paused,
        reason,
        changed_at: Some(changed_at),
        topics: topics
            .into_iter()
            .map(|(pattern, reason, by, paused_ms)| TopicPause {
                pattern,
                reason,
                by,
                paused_at: at(paused_ms),
            })
            .collect(),
    }
}

/// `sql` with the selector's strings (from [`crate::store::ops::dead_filter`]) bound in
/// order.
pub(crate) fn selected<'q, DB>(sql: String, binds: Vec<String>) -> Query<'q, DB>
where
    DB: Database,
    String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let mut query = sqlx::query(AssertSqlSafe(sql));
    for b in binds {
        query = query.bind(b);
    }
    query
}

#[cfg(any(feature = "mysql", feature = "sqlite"))]
/// Runs the pause switch's statement `sql` with its arguments bound in the order every
/// store's statement takes them: paused (`reason` given), the reason.
pub(crate) async fn set_pause<'c, DB, E>(e: E, sql: SqlStr, reason: Option<&str>) -> Result<()>
where
    DB: Database,
    E: sqlx::Executor<'c, Database = DB>,
    bool: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    Option<String>: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    sqlx::query(sql)
        .bind(reason.is_some())
        .bind(reason.map(str::to_owned))
        .execute(e)
        .await?;
    Ok(())
}

#[cfg(any(feature = "mysql", feature = "sqlite"))]
/// Runs the statement `sql` that deletes the pause of `pattern` (bound first): whether
/// there was one.
pub(crate) async fn resume_topic<'c, DB, E>(e: E, sql: SqlStr, pattern: &str) -> Result<bool>
where
    DB: Database,
    DB::QueryResult: Affected,
    E: sqlx::Executor<'c, Database = DB>,
    String: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    let r = sqlx::query(sql).bind(pattern.to_owned()).execute(e).await?;
    Ok(r.affected() > 0)
}

/// Writes the audit row `entry` with the store's audit statement `sql` (see
/// [`audit_query`]).
pub(crate) async fn audit<'c, DB, E>(e: E, sql: impl SqlSafeStr, entry: &AuditEntry) -> Result<()>
where
    DB: Database,
    E: sqlx::Executor<'c, Database = DB>,
    String: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    audit_query(sql, entry).execute(e).await?;
    Ok(())
}

/// The number of dead rows the store's count statement `sql` counts, the selector's
/// strings bound in order.
pub(crate) async fn count<'c, DB, E>(e: E, sql: String, binds: Vec<String>) -> Result<u64>
where
    DB: Database,
    E: sqlx::Executor<'c, Database = DB>,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
    String: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    let n = super::replay::bound(sql, binds).fetch_one(e).await?;
    Ok(super::replay::count(n))
}

/// The latest `limit` audit rows, newest first, from the store's statement `sql` (the
/// limit bound first), each time read by `at`.
pub(crate) async fn replays<'c, DB, E, T>(
    e: E,
    sql: impl SqlSafeStr,
    limit: u32,
    at: impl Fn(T) -> DateTime<Utc>,
) -> Result<Vec<crate::store::ReplayRecord>>
where
    DB: Database,
    E: sqlx::Executor<'c, Database = DB>,
    super::replay::ReplayRow<T>: for<'r> sqlx::FromRow<'r, DB::Row>,
    T: Send + Unpin,
    i64: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    let rows: Vec<super::replay::ReplayRow<T>> = sqlx::query_as(sql)
        .bind(i64::from(limit))
        .fetch_all(e)
        .await?;
    Ok(super::replay::replay_records(rows, at))
}

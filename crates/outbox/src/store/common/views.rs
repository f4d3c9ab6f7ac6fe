//! The read-only views every store answers alike ([`crate::store::Views`]): the overview
//! assembled from its sampled rows, a message's whereabouts from its row, and the
//! statement that finds it chosen and bound once; each store supplies its statements and
//! decodes the columns it stores its own way.

use crate::error::Result;
use crate::store::lookup::{MessageLocation, MessageQuery};
use crate::store::{ClaimsBy, Counts, CountsRow, Leases, Overview};
use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, Database, FromRow, SqlSafeStr, SqlStr};
use uuid::Uuid;

/// Claimed rows by claimant as the stores read them: claimed_by, the live instance that
/// holds them, claimed, expired.
pub(crate) type ClaimsRow = (Option<String>, Option<String>, i64, i64);

/// The sampled rows of an overview, as each store read them.
pub(crate) struct OverviewRows {
    pub(crate) counts: Counts,
    /// Rows due now.
    pub(crate) due: i64,
    /// Seconds the oldest due row has been due, as read (negative is 0).
    pub(crate) oldest_due_s: Option<i64>,
    /// Claimed rows whose lease has ended.
    pub(crate) expired: i64,
    /// Pending rows parked behind a dead letter.
    pub(crate) parked: i64,
    pub(crate) claims_by: Vec<ClaimsRow>,
    pub(crate) pending_by_topic: Vec<(String, i64)>,
    pub(crate) dead_by_topic: Vec<(String, i64)>,
}

impl From<OverviewRows> for Overview {
    fn from(r: OverviewRows) -> Self {
        Overview {
            counts: r.counts,
            due: r.due,
            oldest_due_s: r.oldest_due_s.map(|s| s.max(0)),
            expired_claims: r.expired,
            parked: r.parked,
            claims_by: r
                .claims_by
                .into_iter()
                .map(|(r, instance, claimed, expired)| ClaimsBy {
                    relay_id: r.unwrap_or_default(),
                    instance,
                    claimed,
                    expired,
                })
                .collect(),
            pending_by_topic: r.pending_by_topic,
            dead_by_topic: r.dead_by_topic,
        }
    }
}

/// The counts of rows by status, from the store's counts statement `sql`.
pub(crate) async fn counts<'c, DB, E>(e: E, sql: SqlStr) -> Result<Counts>
where
    DB: Database,
    E: sqlx::Executor<'c, Database = DB>,
    CountsRow: for<'r> FromRow<'r, DB::Row>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    let row: CountsRow = sqlx::query_as(sql).fetch_one(e).await?;
    Ok(row.into())
}

/// The leases held, from the store's leases statement `sql` (held, the latest lease end
/// as the store keeps times, ms until it), each time read by `time`.
pub(crate) async fn leases<'c, DB, E, T>(
    e: E,
    sql: SqlStr,
    time: impl Fn(T) -> DateTime<Utc>,
) -> Result<Leases>
where
    DB: Database,
    E: sqlx::Executor<'c, Database = DB>,
    (i64, Option<T>, Option<i64>): for<'r> FromRow<'r, DB::Row>,
    T: Send + Unpin,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    let (held, last, ms): (i64, Option<T>, Option<i64>) = sqlx::query_as(sql).fetch_one(e).await?;
    Ok(Leases::from_row(held, last.map(time), ms))
}

/// The statements of an overview, each store's own.
pub(crate) struct OverviewSql {
    /// Rows due now, how long the oldest has been due (in the unit `oldest_s` reads),
    /// and the claimed ones among them whose lease has ended: one row.
    pub(crate) due: SqlStr,
    /// Pending rows parked behind a dead letter: one count.
    pub(crate) parked: SqlStr,
    /// Claimed rows by claimant ([`ClaimsRow`]).
    pub(crate) claims_by: SqlStr,
    /// (topic, count) of the rows in the status bound first, most first, at most the
    /// limit bound second.
    pub(crate) by_topic: SqlStr,
}

/// The overview: `counts` and the rows of the store's `sql`, the oldest due read by
/// `oldest_s` into seconds and each topic by `topic`.
pub(crate) async fn overview<'c, DB, E, T>(
    e: E,
    counts: Counts,
    sql: OverviewSql,
    top_n: u32,
    oldest_s: impl Fn(i64) -> i64,
    topic: impl Fn(T) -> String,
) -> Result<Overview>
where
    DB: Database,
    E: sqlx::Executor<'c, Database = DB> + Copy,
    (i64, Option<i64>, i64): for<'r> FromRow<'r, DB::Row>,
    (i64,): for<'r> FromRow<'r, DB::Row>,
    ClaimsRow: for<'r> FromRow<'r, DB::Row>,
    (T, i64): for<'r> FromRow<'r, DB::Row>,
    T: Send + Unpin,
    i16: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    let (due, oldest_due, expired): (i64, Option<i64>, i64) =
        sqlx::query_as(sql.due).fetch_one(e).await?;
    let parked: i64 = sqlx::query_scalar(sql.parked).fetch_one(e).await?;
    let claims_by: Vec<ClaimsRow> = sqlx::query_as(sql.claims_by).fetch_all(e).await?;
    let mut by_topic = Vec::with_capacity(2);
    for status in [crate::store::status::PENDING, crate::store::status::DEAD] {
        let rows: Vec<(T, i64)> = sqlx::query_as(sql.by_topic.clone())
            .bind(status)
            .bind(i64::from(top_n))
            .fetch_all(e)
            .await?;
        by_topic.push(rows.into_iter().map(|(t, n)| (topic(t), n)).collect());
    }
    let dead_by_topic = by_topic.pop().unwrap_or_default();
    let pending_by_topic = by_topic.pop().unwrap_or_default();
    Ok(OverviewRows {
        counts,
        due,
        oldest_due_s: oldest_due.map(oldest_s),
        expired,
        parked,
        claims_by,
        pending_by_topic,
        dead_by_topic,
    }
    .into())
}

/// The statements [`find`] chooses from, each store's own.
pub(crate) struct FindSql {
    /// `WHERE message_id = ?` (the id bound first).
    pub(crate) message_id: SqlStr,
    /// `WHERE topic = ? AND key = ?`, newest first, with a limit.
    pub(crate) topic_key: SqlStr,
    /// `WHERE key = ?`, newest first, with a limit.
    pub(crate) key: SqlStr,
}

impl FindSql {
    /// The three statements, each `SELECT {cols} FROM {table} WHERE …` with the store's
    /// placeholders `ph(1)`, `ph(2)`, `ph(3)` and `by_topic_key` as the topic-and-key
    /// condition (placeholders 1 and 2).
    pub(crate) fn select(
        cols: &str,
        table: &str,
        by_topic_key: &str,
        ph: impl Fn(u8) -> String,
    ) -> Self {
        let sql = |t: String| AssertSqlSafe(t).into_sql_str();
        FindSql {
            message_id: sql(format!(
                "SELECT {cols} FROM {table} WHERE message_id = {}",
                ph(1)
            )),
            topic_key: sql(format!(
                "SELECT {cols} FROM {table} WHERE {by_topic_key} ORDER BY id DESC LIMIT {}",
                ph(3)
            )),
            key: sql(format!(
                "SELECT {cols} FROM {table} WHERE key = {} ORDER BY id DESC LIMIT {}",
                ph(1),
                ph(2)
            )),
        }
    }
}

/// The rows of `query`: the statement of `sql` for it, bound in order (the message id
/// as `id` makes it, the topic, the key, the limit).
pub(crate) async fn find<'c, DB, E, I>(
    e: E,
    query: &MessageQuery,
    limit: u32,
    sql: FindSql,
    id: impl Fn(&Uuid) -> I,
) -> Result<Vec<DB::Row>>
where
    DB: Database,
    E: sqlx::Executor<'c, Database = DB>,
    I: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB> + Send + 'static,
    String: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'a> <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    let q = match query {
        MessageQuery::MessageId(m) => sqlx::query(sql.message_id).bind(id(m)),
        MessageQuery::Key {
            key,
            topic: Some(topic),
        } => sqlx::query(sql.topic_key)
            .bind(topic.clone())
            .bind(key.clone())
            .bind(i64::from(limit)),
        MessageQuery::Key { key, topic: None } => sqlx::query(sql.key)
            .bind(key.clone())
            .bind(i64::from(limit)),
    };
    Ok(q.fetch_all(e).await?)
}

/// The columns of a found message each store decodes its own way.
pub(crate) struct LocationText {
    pub(crate) message_id: Uuid,
    pub(crate) topic: String,
    pub(crate) key: Option<String>,
    pub(crate) status: i64,
    pub(crate) occurred_at: DateTime<Utc>,
    pub(crate) available_at: DateTime<Utc>,
    pub(crate) locked_until: Option<DateTime<Utc>>,
    pub(crate) dispatched_at: Option<DateTime<Utc>>,
}

/// A found message from a row of the store's lookup statement: the columns every store
/// decodes alike read here, the rest given as `text`.
pub(crate) fn location<R>(r: &R, text: LocationText) -> Result<MessageLocation>
where
    R: sqlx::Row,
    &'static str: sqlx::ColumnIndex<R>,
    i64: sqlx::Type<R::Database> + for<'r> sqlx::Decode<'r, R::Database>,
    i32: sqlx::Type<R::Database> + for<'r> sqlx::Decode<'r, R::Database>,
    String: sqlx::Type<R::Database> + for<'r> sqlx::Decode<'r, R::Database>,
{
    Ok(MessageLocation {
        id: r.try_get("id")?,
        message_id: text.message_id,
        topic: text.topic,
        key: text.key,
        status: crate::store::lookup::status_name(text.status),
        attempts: r.try_get("attempts")?,
        occurred_at: text.occurred_at,
        available_at: text.available_at,
        claimed_by: r.try_get("claimed_by")?,
        locked_until: text.locked_until,
        dispatched_at: text.dispatched_at,
        last_error: r.try_get("last_error")?,
        payload_bytes: r.try_get("payload_bytes")?,
        replay_id: r.try_get("replay_id")?,
    }
    .noting_parked())
}

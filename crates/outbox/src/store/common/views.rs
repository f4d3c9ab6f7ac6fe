//! The read-only views every store answers alike ([`crate::store::Views`]): the overview
//! assembled from its sampled rows, a message's whereabouts from its row, and the
//! statement that finds it chosen and bound once; each store supplies its statements and
//! decodes the columns it stores its own way.

use crate::error::Result;
use crate::store::lookup::{MessageLocation, MessageQuery};
use crate::store::{ClaimsBy, Counts, Overview};
use chrono::{DateTime, Utc};
use sqlx::{Database, SqlSafeStr};
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

/// The statement [`find`] runs for a query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Find {
    /// `WHERE message_id = ?` (the id bound first).
    MessageId,
    /// `WHERE topic = ? AND key = ?`, newest first, with a limit.
    TopicKey,
    /// `WHERE key = ?`, newest first, with a limit.
    Key,
}

/// The rows of `query`: the statement `sql` gives for it, bound in order (the message id
/// as `id` makes it, the topic, the key, the limit).
pub(crate) async fn find<'c, DB, E, S, I>(
    e: E,
    query: &MessageQuery,
    limit: u32,
    sql: impl Fn(Find) -> S,
    id: impl Fn(&Uuid) -> I,
) -> Result<Vec<DB::Row>>
where
    DB: Database,
    E: sqlx::Executor<'c, Database = DB>,
    S: SqlSafeStr,
    I: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB> + Send + 'static,
    String: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'a> <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    let q = match query {
        MessageQuery::MessageId(m) => sqlx::query(sql(Find::MessageId)).bind(id(m)),
        MessageQuery::Key {
            key,
            topic: Some(topic),
        } => sqlx::query(sql(Find::TopicKey))
            .bind(topic.clone())
            .bind(key.clone())
            .bind(i64::from(limit)),
        MessageQuery::Key { key, topic: None } => sqlx::query(sql(Find::Key))
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

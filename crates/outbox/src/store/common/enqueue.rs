//! The writes in the caller's transaction ([`crate::events::Enqueue`],
//! [`crate::inbox::Inbox`]) bound the same way in every store: each store supplies its
//! statements and how it stores a message id, the headers and a time.

use super::Query;
use crate::error::Result;
use crate::message::{Enqueued, Message};
use sqlx::{Database, SqlStr};

/// The enqueue statement `sql` with `msg` bound in the order every store's statement
/// takes it: message id, topic, key, payload, headers, available at, delay (ms). The
/// message id, the headers and the time come as the store keeps them.
pub(crate) fn insert<'q, DB, M, H, A>(
    sql: SqlStr,
    msg: &'q Message,
    message_id: M,
    headers: H,
    available_at: A,
) -> Query<'q, DB>
where
    DB: Database,
    M: sqlx::Encode<'q, DB> + sqlx::Type<DB> + 'q,
    H: sqlx::Encode<'q, DB> + sqlx::Type<DB> + 'q,
    A: sqlx::Encode<'q, DB> + sqlx::Type<DB> + 'q,
    &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    Option<&'q str>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    sqlx::query(sql)
        .bind(message_id)
        .bind(msg.topic.as_str())
        .bind(msg.key.as_deref())
        .bind(msg.payload.as_ref())
        .bind(headers)
        .bind(available_at)
        .bind(msg.delay_ms())
}

/// What an enqueue of `msg` returns: the row `id`, and whether this call inserted it.
pub(crate) fn enqueued(msg: &Message, id: i64, inserted: bool) -> Enqueued {
    Enqueued {
        id,
        message_id: msg.message_id,
        inserted,
    }
}

/// Runs the inbox statement `sql` (an insert that does nothing on a duplicate) for
/// `consumer` and the message id as the store keeps it, in the consumer's transaction;
/// the consumer name is checked first. Returns the statement's result, whose rows
/// affected tell fresh (1) from duplicate (0): [`crate::inbox::Accepted::from_rows`].
pub(crate) async fn accept<'q, DB, I>(
    conn: &mut DB::Connection,
    sql: SqlStr,
    consumer: &'q str,
    message_id: I,
) -> Result<DB::QueryResult>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    I: sqlx::Encode<'q, DB> + sqlx::Type<DB> + 'q,
    &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
{
    crate::inbox::validate_consumer(consumer)?;
    Ok(sqlx::query(sql)
        .bind(consumer)
        .bind(message_id)
        .execute(&mut *conn)
        .await?)
}

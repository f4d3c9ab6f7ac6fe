//! A claimed row as the message a sink is given, for the stores that keep the message id
//! and the headers as text (MySQL, SQLite): a row that cannot be read is a [`Dead`] with
//! the reason, to be quarantined, never a message sent with made-up fields.

use crate::error::{Error, Result};
use crate::message::OutgoingMessage;
use crate::store::{Dead, parse_headers};
use chrono::{DateTime, Utc};

/// The message of a claimed row `row` (columns `id`, `message_id`, `topic`, `key`,
/// `payload`, `headers`, `occurred_at`, `attempts`), its `occurred_at` column (of type
/// `T`) read by `occurred` (given the row's id, for the error).
pub(crate) fn text_row<R, T>(
    row: &R,
    occurred: impl Fn(i64, T) -> Result<DateTime<Utc>>,
) -> std::result::Result<OutgoingMessage, Dead>
where
    R: sqlx::Row,
    &'static str: sqlx::ColumnIndex<R>,
    T: sqlx::Type<R::Database> + for<'r> sqlx::Decode<'r, R::Database>,
    i64: sqlx::Type<R::Database> + for<'r> sqlx::Decode<'r, R::Database>,
    i32: sqlx::Type<R::Database> + for<'r> sqlx::Decode<'r, R::Database>,
    String: sqlx::Type<R::Database> + for<'r> sqlx::Decode<'r, R::Database>,
    Option<String>: sqlx::Type<R::Database> + for<'r> sqlx::Decode<'r, R::Database>,
    Vec<u8>: sqlx::Type<R::Database> + for<'r> sqlx::Decode<'r, R::Database>,
{
    let id: i64 = row.try_get("id").map_err(|e| Dead {
        id: -1,
        error: e.to_string(),
    })?;
    let read = || -> Result<OutgoingMessage> {
        let message_id =
            crate::store::text_message_id(id, &row.try_get::<String, _>("message_id")?)?;
        let headers: String = row.try_get("headers")?;
        let headers: serde_json::Value =
            serde_json::from_str(&headers).map_err(|e| Error::MalformedRow {
                id,
                reason: format!("headers are not JSON: {e}"),
            })?;
        Ok(OutgoingMessage {
            id,
            message_id,
            topic: row.try_get("topic")?,
            key: row.try_get("key")?,
            payload: bytes::Bytes::from(row.try_get::<Vec<u8>, _>("payload")?),
            headers: parse_headers(id, headers)?,
            occurred_at: occurred(id, row.try_get("occurred_at")?)?,
            attempts: row.try_get("attempts")?,
        })
    };
    read().map_err(|e| Dead {
        id,
        error: crate::store::malformed_reason(e),
    })
}

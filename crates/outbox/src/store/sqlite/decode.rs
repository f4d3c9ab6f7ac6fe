//! Reading rows: a claimed row as the message a sink is given (or the reason it is
//! malformed), and a stored time for people.

use super::SqliteStore;
use crate::error::{Error, Result};
use crate::message::OutgoingMessage;
use crate::store::{Dead, parse_headers};
use chrono::{DateTime, TimeZone, Utc};
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

impl SqliteStore {
    pub(super) fn row_to_message(row: &SqliteRow) -> std::result::Result<OutgoingMessage, Dead> {
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
            let occurred: i64 = row.try_get("occurred_at")?;
            Ok(OutgoingMessage {
                id,
                message_id,
                topic: row.try_get("topic")?,
                key: row.try_get("key")?,
                payload: bytes::Bytes::from(row.try_get::<Vec<u8>, _>("payload")?),
                headers: parse_headers(id, headers)?,
                // Out of range: a malformed row (quarantined), as on the other stores,
                // not a message sent with a made-up time.
                occurred_at: Utc.timestamp_millis_opt(occurred).single().ok_or_else(|| {
                    Error::MalformedRow {
                        id,
                        reason: format!("occurred_at is not a representable time ({occurred} ms)"),
                    }
                })?,
                attempts: row.try_get("attempts")?,
            })
        };
        read().map_err(|e| Dead {
            id,
            error: crate::store::malformed_reason(e),
        })
    }
}

/// A stored time for people: clamped to what chrono represents (years -262143 to
/// 262142), so a hand-written time at the integer limits shows as the nearest end rather
/// than as 1970.
pub(super) fn ms_to_time(ms: i64) -> DateTime<Utc> {
    let (lo, hi) = (
        DateTime::<Utc>::MIN_UTC.timestamp_millis(),
        DateTime::<Utc>::MAX_UTC.timestamp_millis(),
    );
    Utc.timestamp_millis_opt(ms.clamp(lo, hi))
        .single()
        .unwrap_or_default()
}

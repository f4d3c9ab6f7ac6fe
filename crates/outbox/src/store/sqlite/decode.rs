//! Reading rows: a claimed row as the message a sink is given (or the reason it is
//! malformed), and a stored time for people.

use super::SqliteStore;
use crate::error::Error;
use crate::message::OutgoingMessage;
use crate::store::Dead;
use crate::store::common;
use chrono::{DateTime, TimeZone, Utc};
use sqlx::sqlite::SqliteRow;

impl SqliteStore {
    pub(super) fn row_to_message(row: &SqliteRow) -> std::result::Result<OutgoingMessage, Dead> {
        // Out of range: a malformed row (quarantined), as on the other stores, not a
        // message sent with a made-up time.
        common::decode::text_row(row, |id, occurred: i64| {
            Utc.timestamp_millis_opt(occurred)
                .single()
                .ok_or_else(|| Error::MalformedRow {
                    id,
                    reason: format!("occurred_at is not a representable time ({occurred} ms)"),
                })
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

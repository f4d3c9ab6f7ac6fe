//! What the admin dashboard asks of a store beside the operations of [`super::ops`]:
//! where a message is now ([`super::Views::find_messages`]) and what was delivered and
//! what died per minute ([`super::Views::throughput`]). Types and the pure helpers the
//! three stores share.

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

/// Which messages [`super::Views::find_messages`] looks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageQuery {
    /// The row of one message id (at most one row: message ids are unique).
    MessageId(Uuid),
    /// The rows of one key, newest first; within one topic when `topic` is given (which
    /// reads the per-key index; without a topic the table is scanned).
    Key {
        /// The key, exactly.
        key: String,
        /// The topic, exactly.
        topic: Option<String>,
    },
}

/// Where a message is now, as the dashboard's message search shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MessageLocation {
    /// Primary key.
    pub id: i64,
    /// The message id.
    pub message_id: Uuid,
    /// Topic.
    pub topic: String,
    /// Key, if any.
    pub key: Option<String>,
    /// `pending`, `parked` (pending, held behind a dead letter of its key by strict
    /// per-key ordering: see [`super::Maintenance::park_held`]), `claimed`, `dispatched` or
    /// `dead`.
    pub status: &'static str,
    /// Attempts counted so far.
    pub attempts: i32,
    /// When it was enqueued (database clock).
    pub occurred_at: DateTime<Utc>,
    /// Pending: when it is due; claimed: when the lease ends; dead: when it died.
    pub available_at: DateTime<Utc>,
    /// The relay that claimed it last (kept after the claim ends).
    pub claimed_by: Option<String>,
    /// Claimed: when the lease ends.
    pub locked_until: Option<DateTime<Utc>>,
    /// Dispatched: when its sink confirmed it.
    pub dispatched_at: Option<DateTime<Utc>>,
    /// The last error the relay recorded.
    pub last_error: Option<String>,
    /// Payload size, in bytes.
    pub payload_bytes: i64,
    /// The last replay that moved it back to pending.
    pub replay_id: Option<i64>,
}

impl MessageLocation {
    /// Names a pending row whose `available_at` is [`super::PARKED_AT`] `parked`.
    pub(crate) fn noting_parked(mut self) -> Self {
        let parked = DateTime::parse_from_rfc3339(super::PARKED_AT)
            .is_ok_and(|p| self.available_at >= p.with_timezone(&Utc));
        if self.status == "pending" && parked {
            self.status = "parked";
        }
        self
    }
}

/// Rows dispatched and rows that died in one minute ([`super::Views::throughput`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MinuteCounts {
    /// How many whole minutes ago the minute began (0: the current minute).
    pub minutes_ago: u32,
    /// Rows dispatched in that minute (and still kept: `--on-dispatch delete` and
    /// retention leave none to count).
    pub dispatched: i64,
    /// Rows that died in that minute and are still dead.
    pub dead: i64,
}

/// The name of a stored status.
pub(crate) fn status_name(status: i64) -> &'static str {
    match status {
        0 => "pending",
        1 => "claimed",
        2 => "dispatched",
        _ => "dead",
    }
}

/// One entry per minute of the last `minutes`, oldest first, from the sparse rows a
/// store returns: (minutes ago, dispatched, dead). Rows outside the window are dropped; a
/// row a moment in the future (another statement's clock) counts as this minute.
pub(crate) fn fill_minutes(minutes: u32, rows: &[(i64, i64, i64)]) -> Vec<MinuteCounts> {
    let mut out: Vec<MinuteCounts> = (0..minutes)
        .rev()
        .map(|m| MinuteCounts {
            minutes_ago: m,
            dispatched: 0,
            dead: 0,
        })
        .collect();
    for &(ago, dispatched, dead) in rows {
        let ago = ago.max(0);
        if let Ok(ago) = u32::try_from(ago)
            && ago < minutes
        {
            let slot = &mut out[(minutes - 1 - ago) as usize];
            slot.dispatched += dispatched;
            slot.dead += dead;
        }
    }
    out
}

/// The most minutes [`super::Views::throughput`] answers for: one day.
pub const MAX_THROUGHPUT_MINUTES: u32 = 24 * 60;

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn minutes_are_filled_oldest_first() {
        let m = fill_minutes(4, &[(0, 5, 1), (-1, 2, 0), (3, 7, 0), (4, 100, 100)]);
        let d: Vec<(u32, i64, i64)> = m
            .iter()
            .map(|c| (c.minutes_ago, c.dispatched, c.dead))
            .collect();
        assert_eq!(d, vec![(3, 7, 0), (2, 0, 0), (1, 0, 0), (0, 7, 1)]);
        assert_eq!(status_name(1), "claimed");
        let parked = DateTime::parse_from_rfc3339(super::super::PARKED_AT)
            .unwrap()
            .with_timezone(&Utc);
        let at = |status: &'static str, available_at| {
            MessageLocation {
                id: 1,
                message_id: Uuid::nil(),
                topic: "t".into(),
                key: None,
                status,
                attempts: 0,
                occurred_at: Utc::now(),
                available_at,
                claimed_by: None,
                locked_until: None,
                dispatched_at: None,
                last_error: None,
                payload_bytes: 0,
                replay_id: None,
            }
            .noting_parked()
            .status
        };
        assert_eq!(at("pending", parked), "parked");
        assert_eq!(at("pending", Utc::now()), "pending");
        assert_eq!(at("dead", parked), "dead");
    }
}

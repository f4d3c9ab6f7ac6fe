//! The states of an outbox row, as stored in its `status` column (a `SMALLINT`).
//!
//! ```text
//! pending(0) --claim--> claimed(1) --confirmed, mark--> dispatched(2)
//! claimed --transient error--> pending (available_at = now + backoff)
//! claimed --permanent error or attempts > max--> dead(3)
//! claimed --lease expired--> claimable again (attempt already counted)
//! claimed --release on shutdown--> pending (attempt given back)
//! ```
//!
//! **Parked is not a status.** A row that strict per-key ordering holds behind a dead
//! letter of its key is *parked*: it stays [`Status::Pending`] and its `available_at` is
//! set to 9999-01-01T00:00:00Z (`store::PARKED_AT`; SQLite: `store::PARKED_AT_MS`
//! milliseconds), so it is never due and no claim reads it. Giving it back (a replay of
//! the dead letter, `Store::unpark_released`) sets `available_at` again; its status never
//! changed. Counts of parked rows are pending rows with that `available_at`.
//!
//! Vocabulary: no IO, no imports from the rest of the crate.

/// Waiting to be claimed (possibly not yet available): [`Status::Pending`]'s code.
pub const PENDING: i16 = Status::Pending.as_i16();
/// Claimed by a relay until `locked_until`: [`Status::Claimed`]'s code.
pub const CLAIMED: i16 = Status::Claimed.as_i16();
/// The sink confirmed it: [`Status::Dispatched`]'s code.
pub const DISPATCHED: i16 = Status::Dispatched.as_i16();
/// Quarantined: permanent error or attempts exhausted: [`Status::Dead`]'s code.
pub const DEAD: i16 = Status::Dead.as_i16();

/// The state of an outbox row. The discriminant is the value stored in `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(i16)]
pub enum Status {
    /// `0`: waiting to be claimed (possibly not yet available, or parked: see the module
    /// docs).
    Pending = 0,
    /// `1`: claimed by a relay until `locked_until`; every later update of the row is
    /// guarded by its `claim_token` and this status.
    Claimed = 1,
    /// `2`: the sink confirmed it.
    Dispatched = 2,
    /// `3`: quarantined (a dead letter): a permanent error or attempts exhausted.
    Dead = 3,
}

impl Status {
    /// Every status, in the order of their codes.
    pub const ALL: [Status; 4] = [
        Status::Pending,
        Status::Claimed,
        Status::Dispatched,
        Status::Dead,
    ];

    /// The value stored in the `status` column.
    pub const fn as_i16(self) -> i16 {
        self as i16
    }

    /// The name `outbox status`, the metrics (`outbox_messages{status}`) and the
    /// dashboard use: `pending`, `claimed`, `dispatched`, `dead`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Claimed => "claimed",
            Status::Dispatched => "dispatched",
            Status::Dead => "dead",
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<Status> for i16 {
    fn from(s: Status) -> i16 {
        s.as_i16()
    }
}

/// A `status` value that is none of the four codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("unknown row status {0} (expected 0 pending, 1 claimed, 2 dispatched or 3 dead)")]
pub struct UnknownStatus(pub i16);

impl TryFrom<i16> for Status {
    type Error = UnknownStatus;

    /// # Errors
    /// [`UnknownStatus`] for a value other than 0, 1, 2 or 3.
    fn try_from(v: i16) -> Result<Self, UnknownStatus> {
        match v {
            PENDING => Ok(Status::Pending),
            CLAIMED => Ok(Status::Claimed),
            DISPATCHED => Ok(Status::Dispatched),
            DEAD => Ok(Status::Dead),
            other => Err(UnknownStatus(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_stay_what_is_stored() {
        assert_eq!([PENDING, CLAIMED, DISPATCHED, DEAD], [0, 1, 2, 3]);
        for s in Status::ALL {
            assert_eq!(Status::try_from(s.as_i16()), Ok(s));
            assert_eq!(i16::from(s), s.as_i16());
        }
        assert_eq!(Status::try_from(4), Err(UnknownStatus(4)));
        assert_eq!(Status::try_from(-1), Err(UnknownStatus(-1)));
        let names: Vec<String> = Status::ALL.iter().map(ToString::to_string).collect();
        assert_eq!(names, ["pending", "claimed", "dispatched", "dead"]);
    }
}

//! The relay's settings: [`RelayConfig`], [`OnDispatch`] and their defaults.

use super::registry::host_name;
use crate::store::KeyOrdering;
use std::time::Duration;

/// The longest [`RelayConfig::relay_id`], in bytes: what every store's `claimed_by` column
/// and relay registry hold (MariaDB's are `VARCHAR(255)`). A longer or empty id is refused
/// with [`RelayError::Config`](super::RelayError::Config) before anything is claimed.
pub const MAX_RELAY_ID_BYTES: usize = 255;

/// Settings of one relay. `Default` gives production values.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Written to `claimed_by` (default `HOSTNAME:PID:RANDOM`); 1 to
    /// [`MAX_RELAY_ID_BYTES`] bytes.
    pub relay_id: String,
    /// The most rows per claim (default 1,000). Claims start at [`Self::min_batch_size`]
    /// rows and follow the backlog: the size doubles after a claim that came back full
    /// (up to this bound) and halves after one that came back less than half full (down
    /// to the minimum). Equal bounds give a fixed size.
    pub batch_size: u32,
    /// The fewest rows a claim asks for (default 100; at most `batch_size`): the size
    /// while little is due, so a burst is spread over the batches in flight.
    pub min_batch_size: u32,
    /// How long a claim holds (default 30 s) before other relays may claim its rows
    /// again. While a batch is in flight the relay renews it every third of the lease, so
    /// a publish may take longer than the lease; only a relay that dies (or cannot reach
    /// the store to renew) lets it run out.
    pub lease: Duration,
    /// Attempts before a transiently failing row is quarantined (default 10).
    pub max_attempts: i32,
    /// Poll interval when no wake-up arrives (default 1 s; the store's wake-up usually
    /// comes first).
    pub poll_interval: Duration,
    /// How long each message may wait for its own confirmation (default 10 s); the
    /// messages of a destination are sent together, so this bounds each destination's
    /// part of a batch. A message without a confirmation by then timed out: its own fault
    /// when the destination confirmed others meanwhile (an attempt counts), an outage
    /// when it confirmed nothing (no attempt counts), except a message the sink knows it
    /// sent (a webhook request): only its first [`crate::sink::router::TIMEOUT_REFUNDS`]
    /// such timeouts are free, later ones count. Sinks with their own timeout (HTTP's
    /// request timeout, NATS' ack timeout) are judged the same way.
    pub publish_timeout: Duration,
    /// First retry delay (default 1 s); doubles per attempt, with jitter.
    pub backoff_base: Duration,
    /// Largest retry delay (default 5 min).
    pub backoff_max: Duration,
    /// On shutdown, how long an in-flight batch may still finish (default 10 s): messages
    /// confirmed by then are marked dispatched, the others are released.
    pub shutdown_grace: Duration,
    /// Exit once a claim finds nothing due, instead of waiting for more.
    pub drain: bool,
    /// The most batches in flight at once (default 4): while one batch waits for its
    /// confirmations, another is claimed or marked. Each has its own claim token. While
    /// little is due one batch is in flight; more join only after a claim came back full.
    pub in_flight_batches: u32,
    /// How often the relay writes its registry row (default 5 s; zero: no registry row).
    /// A row not refreshed for [`crate::store::RELAY_EXPIRY`] counts as gone.
    pub heartbeat_interval: Duration,
    /// How often one relay (the live one with the smallest id) samples the store for the
    /// store gauges (default 15 s; zero: never).
    pub sample_interval: Duration,
    /// How often the relay logs a summary line (default 60 s; zero: never).
    pub summary_interval: Duration,
    /// What becomes of a confirmed row: kept as dispatched (the default; `purge` removes
    /// old ones) or deleted at once ([`OnDispatch::Delete`]).
    pub on_dispatch: OnDispatch,
    /// Per-key ordering (default: none). Every relay of one outbox must use the same
    /// setting: the claim enforces it, so a relay without it would claim a key's later
    /// messages while an earlier one is in flight. Within a claim, the messages of one
    /// ordered key are published one after another (each once the previous one is
    /// confirmed), different keys together; when one fails, the key's later messages of
    /// the claim are released unpublished, attempt given back.
    pub ordering: KeyOrdering,
}

/// What the relay does with a row once its broker confirmed it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OnDispatch {
    /// Mark it dispatched (status 2, `dispatched_at`): history for `outbox status`, the
    /// dispatched gauges and a later look-up; `outbox purge` deletes old ones.
    #[default]
    Keep,
    /// Delete it in the settle: no history of dispatched messages (`status` counts none,
    /// a message id cannot be looked up once delivered) and nothing to purge; dead letters
    /// are kept and replayed as always. Fewer writes to retain and vacuum.
    Delete,
}

impl RelayConfig {
    /// The claim size's bounds in rows, (smallest, largest): `min_batch_size` kept within
    /// 1..=`batch_size`, and `batch_size` (at least 1 here; `run` refuses 0).
    pub(super) fn claim_bounds(&self) -> (u32, u32) {
        let max = self.batch_size.max(1);
        (self.min_batch_size.clamp(1, max), max)
    }
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            relay_id: default_relay_id(),
            batch_size: 1000,
            min_batch_size: 100,
            lease: Duration::from_secs(30),
            max_attempts: 10,
            poll_interval: Duration::from_secs(1),
            publish_timeout: Duration::from_secs(10),
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            shutdown_grace: Duration::from_secs(10),
            drain: false,
            on_dispatch: OnDispatch::Keep,
            in_flight_batches: 4,
            heartbeat_interval: Duration::from_secs(5),
            sample_interval: Duration::from_secs(15),
            summary_interval: Duration::from_secs(60),
            ordering: KeyOrdering::default(),
        }
    }
}

/// `HOSTNAME:PID:XXXX` with four random hex digits.
pub fn default_relay_id() -> String {
    let host = host_name();
    format!(
        "{host}:{}:{:04x}",
        std::process::id(),
        rand::random::<u16>()
    )
}

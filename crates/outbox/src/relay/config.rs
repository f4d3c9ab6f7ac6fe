//! The relay's settings: [`RelayConfig`], [`OnDispatch`] and their defaults, and the
//! rules a configuration must meet for the relay to start ([`RelayConfig::validate`],
//! [`ConfigError`]).

use super::RelayError;
use super::registry::host_name;
use crate::store::KeyOrdering;
use std::time::Duration;

/// The longest [`RelayConfig::relay_id`], in bytes: what every store's `claimed_by` column
/// and relay registry hold (MariaDB's are `VARCHAR(255)`). A longer or empty id is refused
/// with [`RelayError::Config`] before anything is claimed.
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

/// The shortest [`RelayConfig::lease`]: the lease is renewed every third of it.
const MIN_LEASE: Duration = Duration::from_millis(30);

impl RelayConfig {
    /// The claim size's bounds in rows, (smallest, largest): `min_batch_size` kept within
    /// 1..=`batch_size`, and `batch_size` (at least 1 here; `run` refuses 0).
    pub(super) fn claim_bounds(&self) -> (u32, u32) {
        let max = self.batch_size.max(1);
        (self.min_batch_size.clamp(1, max), max)
    }

    /// Checks the settings a relay cannot work with; [`Relay::run`](super::Relay::run)
    /// calls it first and refuses to start with [`RelayError::Config`], whose text is
    /// the [`ConfigError`]'s. The rules, checked in this order (the first broken one is
    /// returned): `batch_size` at least 1, `max_attempts` at least 1, `lease` at least
    /// 30 ms, `publish_timeout` more than zero, `in_flight_batches` at least 1, and
    /// `relay_id` 1 to [`MAX_RELAY_ID_BYTES`] bytes. Every other setting is taken as it
    /// is (`min_batch_size` is kept within 1..=`batch_size`, not refused).
    ///
    /// # Errors
    /// The first rule the configuration breaks.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.batch_size == 0 {
            return Err(ConfigError::BatchSizeZero);
        }
        if self.max_attempts < 1 {
            return Err(ConfigError::MaxAttemptsBelowOne {
                max_attempts: self.max_attempts,
            });
        }
        if self.lease < MIN_LEASE {
            return Err(ConfigError::LeaseTooShort { lease: self.lease });
        }
        if self.publish_timeout.is_zero() {
            return Err(ConfigError::PublishTimeoutZero);
        }
        if self.in_flight_batches == 0 {
            return Err(ConfigError::InFlightBatchesZero);
        }
        if self.relay_id.is_empty() || self.relay_id.len() > MAX_RELAY_ID_BYTES {
            return Err(ConfigError::RelayIdLength {
                len: self.relay_id.len(),
            });
        }
        Ok(())
    }
}

/// A rule of [`RelayConfig::validate`] that a configuration breaks: each variant names
/// its field ([`ConfigError::field`]) and its text states the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `batch_size` is 0: a claim must ask for at least one row.
    #[error("batch_size must be at least 1")]
    BatchSizeZero,
    /// `max_attempts` is below 1: no message could ever be published.
    #[error("max_attempts must be at least 1")]
    MaxAttemptsBelowOne {
        /// The value given.
        max_attempts: i32,
    },
    /// `lease` is shorter than 30 ms: it is renewed every third of it.
    #[error("the lease ({lease:?}) must be at least 30 ms: it is renewed every third of it")]
    LeaseTooShort {
        /// The value given.
        lease: Duration,
    },
    /// `publish_timeout` is zero: no message could wait for its confirmation.
    #[error("publish_timeout must be more than zero")]
    PublishTimeoutZero,
    /// `in_flight_batches` is 0: no worker would claim.
    #[error("in_flight_batches must be at least 1")]
    InFlightBatchesZero,
    /// `relay_id` is empty or longer than [`MAX_RELAY_ID_BYTES`] bytes (what the stores'
    /// `claimed_by` column and relay registry hold).
    #[error("relay_id must be 1-{max} bytes, got {len}", max = MAX_RELAY_ID_BYTES)]
    RelayIdLength {
        /// Its length in bytes.
        len: usize,
    },
}

impl ConfigError {
    /// The [`RelayConfig`] field at fault, as spelled there (`"lease"`, `"relay_id"`, …).
    pub fn field(&self) -> &'static str {
        match self {
            ConfigError::BatchSizeZero => "batch_size",
            ConfigError::MaxAttemptsBelowOne { .. } => "max_attempts",
            ConfigError::LeaseTooShort { .. } => "lease",
            ConfigError::PublishTimeoutZero => "publish_timeout",
            ConfigError::InFlightBatchesZero => "in_flight_batches",
            ConfigError::RelayIdLength { .. } => "relay_id",
        }
    }
}

impl From<ConfigError> for RelayError {
    /// [`RelayError::Config`] with the rule's text.
    fn from(e: ConfigError) -> Self {
        RelayError::Config(e.to_string())
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A configuration that passes, with a short lease (the defaults pass too).
    fn valid() -> RelayConfig {
        RelayConfig {
            relay_id: "relay-1".into(),
            lease: MIN_LEASE,
            ..RelayConfig::default()
        }
    }

    /// `cfg` breaks exactly `want`, whose field it names, with the text `text`.
    fn refused(cfg: &RelayConfig, want: ConfigError, field: &str, text: &str) {
        let e = cfg.validate().unwrap_err();
        assert_eq!(e, want);
        assert_eq!(e.field(), field);
        assert_eq!(e.to_string(), text);
    }

    #[test]
    fn the_defaults_and_the_bounds_pass() {
        RelayConfig::default().validate().unwrap();
        valid().validate().unwrap();
        let bounds = RelayConfig {
            batch_size: 1,
            min_batch_size: 0, // kept within 1..=batch_size, not refused
            max_attempts: 1,
            publish_timeout: Duration::from_nanos(1),
            in_flight_batches: 1,
            relay_id: "r".repeat(MAX_RELAY_ID_BYTES),
            ..valid()
        };
        bounds.validate().unwrap();
        let over = RelayConfig {
            min_batch_size: 5_000, // above batch_size: kept within it, not refused
            ..valid()
        };
        over.validate().unwrap();
    }

    #[test]
    fn a_zero_batch_size_is_refused() {
        let cfg = RelayConfig {
            batch_size: 0,
            ..valid()
        };
        refused(
            &cfg,
            ConfigError::BatchSizeZero,
            "batch_size",
            "batch_size must be at least 1",
        );
    }

    #[test]
    fn max_attempts_below_one_is_refused() {
        for max_attempts in [0, -3] {
            let cfg = RelayConfig {
                max_attempts,
                ..valid()
            };
            refused(
                &cfg,
                ConfigError::MaxAttemptsBelowOne { max_attempts },
                "max_attempts",
                "max_attempts must be at least 1",
            );
        }
    }

    #[test]
    fn a_lease_under_30_ms_is_refused() {
        let lease = Duration::from_millis(29);
        let cfg = RelayConfig { lease, ..valid() };
        refused(
            &cfg,
            ConfigError::LeaseTooShort { lease },
            "lease",
            "the lease (29ms) must be at least 30 ms: it is renewed every third of it",
        );
    }

    #[test]
    fn a_zero_publish_timeout_is_refused() {
        let cfg = RelayConfig {
            publish_timeout: Duration::ZERO,
            ..valid()
        };
        refused(
            &cfg,
            ConfigError::PublishTimeoutZero,
            "publish_timeout",
            "publish_timeout must be more than zero",
        );
    }

    #[test]
    fn zero_in_flight_batches_are_refused() {
        let cfg = RelayConfig {
            in_flight_batches: 0,
            ..valid()
        };
        refused(
            &cfg,
            ConfigError::InFlightBatchesZero,
            "in_flight_batches",
            "in_flight_batches must be at least 1",
        );
    }

    #[test]
    fn an_empty_or_too_long_relay_id_is_refused() {
        let empty = RelayConfig {
            relay_id: String::new(),
            ..valid()
        };
        refused(
            &empty,
            ConfigError::RelayIdLength { len: 0 },
            "relay_id",
            "relay_id must be 1-255 bytes, got 0",
        );
        let long = RelayConfig {
            relay_id: "r".repeat(MAX_RELAY_ID_BYTES + 1),
            ..valid()
        };
        refused(
            &long,
            ConfigError::RelayIdLength { len: 256 },
            "relay_id",
            "relay_id must be 1-255 bytes, got 256",
        );
    }

    #[test]
    fn the_first_broken_rule_is_reported() {
        let cfg = RelayConfig {
            batch_size: 0,
            in_flight_batches: 0,
            relay_id: String::new(),
            ..valid()
        };
        assert_eq!(cfg.validate(), Err(ConfigError::BatchSizeZero));
        let cfg = RelayConfig {
            batch_size: 1,
            ..cfg
        };
        assert_eq!(cfg.validate(), Err(ConfigError::InFlightBatchesZero));
    }

    #[test]
    fn the_relay_refuses_with_the_rule_s_text() {
        let e = RelayError::from(ConfigError::PublishTimeoutZero);
        assert!(
            matches!(&e, RelayError::Config(text) if text == "publish_timeout must be more than zero"),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "invalid relay configuration: publish_timeout must be more than zero"
        );
    }
}

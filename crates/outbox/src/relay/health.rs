//! What a running relay shows of itself: its counters ([`RelayStats`]) and its health
//! ([`RelayHealth`], for `/readyz`).

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Counters of one relay, since it started.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct RelayStats {
    /// Claim statements run, whether they found rows or not.
    pub claims: u64,
    /// Claims that returned at least one row.
    pub batches: u64,
    /// Rows claimed.
    pub claimed: u64,
    /// Rows marked dispatched.
    pub dispatched: u64,
    /// Rows rescheduled after a transient error.
    pub retried: u64,
    /// Rows quarantined.
    pub quarantined: u64,
    /// Rows given back unpublished (attempt refunded): on shutdown, and with per-key
    /// ordering the rest of a key's claim after one of its messages failed.
    pub released: u64,
    /// Rows this relay held whose claim passed to another relay (found at a lease renewal
    /// or at settle; each is logged with its message id when found).
    pub lost_claims: u64,
    /// Lease renewals of batches still in flight.
    pub lease_renewals: u64,
    /// Store calls that failed transiently (connection loss, SQLite busy, deadlock, lock
    /// wait) and were retried.
    pub store_retries: u64,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) claims: AtomicU64,
    pub(super) batches: AtomicU64,
    pub(super) claimed: AtomicU64,
    pub(super) dispatched: AtomicU64,
    pub(super) retried: AtomicU64,
    pub(super) quarantined: AtomicU64,
    pub(super) released: AtomicU64,
    pub(super) lost_claims: AtomicU64,
    pub(super) lease_renewals: AtomicU64,
    pub(super) store_retries: AtomicU64,
}

impl Counters {
    pub(super) fn snapshot(&self) -> RelayStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RelayStats {
            claims: g(&self.claims),
            batches: g(&self.batches),
            claimed: g(&self.claimed),
            dispatched: g(&self.dispatched),
            retried: g(&self.retried),
            quarantined: g(&self.quarantined),
            released: g(&self.released),
            lost_claims: g(&self.lost_claims),
            lease_renewals: g(&self.lease_renewals),
            store_retries: g(&self.store_retries),
        }
    }
}

pub(super) fn add(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

/// What a running relay shows of its own health (`/readyz`): the last time its loop made
/// progress and what it holds in flight. Cheap to read from any thread.
#[derive(Debug)]
pub struct RelayHealth {
    started: std::time::Instant,
    /// Milliseconds after `started` of the last loop turn (a claim, a wait that ended).
    last_turn_ms: AtomicU64,
    /// Messages claimed and not settled yet.
    pub(super) in_flight: std::sync::atomic::AtomicI64,
    /// Milliseconds after `started` of the last claim that returned rows (0: none yet).
    pub(super) last_claim_ms: AtomicU64,
    /// The poll interval (the loop turns at least this often when idle).
    poll_interval: Duration,
}

impl RelayHealth {
    pub(super) fn new(poll_interval: Duration) -> Self {
        RelayHealth {
            started: std::time::Instant::now(),
            last_turn_ms: AtomicU64::new(0),
            in_flight: std::sync::atomic::AtomicI64::new(0),
            last_claim_ms: AtomicU64::new(0),
            poll_interval,
        }
    }

    pub(super) fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub(super) fn turned(&self) {
        self.last_turn_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// Time since the relay's loop last turned.
    pub fn since_last_turn(&self) -> Duration {
        let last = self.last_turn_ms.load(Ordering::Relaxed);
        Duration::from_millis(self.now_ms().saturating_sub(last))
    }

    /// Messages claimed and not yet settled.
    pub fn in_flight(&self) -> i64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Time since the last claim that returned rows; `None` before the first.
    pub fn since_last_claim(&self) -> Option<Duration> {
        match self.last_claim_ms.load(Ordering::Relaxed) {
            0 => None,
            at => Some(Duration::from_millis(self.now_ms().saturating_sub(at))),
        }
    }

    /// True while the loop turns within two poll intervals (at least 2.5 s: a worker waits
    /// up to 2 s for a destination's breaker to probe again), or a batch is in flight (a slow publish holds the loop, and its lease renewal shows it alive).
    pub fn is_alive(&self) -> bool {
        self.in_flight() > 0
            || self.since_last_turn() <= (self.poll_interval * 2).max(Duration::from_millis(2_500))
    }
}

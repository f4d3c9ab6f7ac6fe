//! The store's outage as the relay sees it: logged when it begins and when it ends, and
//! the backoff of the workers' store calls while it lasts.

use super::Relay;
use crate::error::Error;
use std::time::Duration;
use tokio::time::Instant;

/// The store's outage as this relay sees it, and the claim backoff while it lasts. An
/// outage runs from the start of the first store call that failed (a claim, a settle, a
/// lease renewal or a registry heartbeat) to the first call that succeeded after it; it is
/// logged twice, once when it begins (WARN, with its start) and once when it ends (INFO,
/// with its start, end and length), never once per retry.
#[derive(Default)]
pub(super) struct Failing {
    /// When the outage began: the monotonic instant (for its length) and the wall clock.
    since: Option<(Instant, chrono::DateTime<chrono::Utc>)>,
    delay: Duration,
}

impl Failing {
    /// A store call that began at `began` failed (the outage is counted from the first
    /// failed call's start, not from when its error arrived).
    pub(super) fn store_error(&mut self, what: &str, e: &Error, began: Instant) {
        if self.since.is_some() {
            self.delay = (self.delay * 2).min(Duration::from_secs(5));
            tracing::debug!(error = %e, "store still failing while {what}");
            return;
        }
        let ago = Instant::now().saturating_duration_since(began);
        let start = chrono::Utc::now() - chrono::TimeDelta::from_std(ago).unwrap_or_default();
        self.since = Some((began, start));
        self.delay = Duration::from_millis(100);
        tracing::warn!(
            error = %e,
            started = %rfc3339(start),
            "store outage: a store call failed while {what}; retrying with backoff until the store answers"
        );
    }

    /// A store call that began at `call_began` succeeded: ends the outage, if one was running
    /// and the call began after it did (a call sent before the first failure proves
    /// nothing about the store now).
    pub(super) fn recovered(&mut self, call_began: Instant) {
        if self.since.is_some_and(|(since, _)| call_began >= since)
            && let Some((began, start)) = self.since.take()
        {
            let length = began.elapsed();
            let end = start + chrono::TimeDelta::from_std(length).unwrap_or_default();
            tracing::info!(
                started = %rfc3339(start),
                ended = %rfc3339(end),
                length = ?Duration::from_millis(u64::try_from(length.as_millis()).unwrap_or(u64::MAX)),
                length_ms = u64::try_from(length.as_millis()).unwrap_or(u64::MAX),
                "store reachable again: the outage is over"
            );
        }
    }

    fn delay(&self) -> Duration {
        self.delay
    }
}

impl Relay {
    pub(super) fn lock_failing(&self) -> std::sync::MutexGuard<'_, Failing> {
        self.failing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a failed store call; returns how long this worker backs off.
    pub(super) fn store_failed(&self, what: &str, e: &Error, began: Instant) -> Duration {
        let mut f = self.lock_failing();
        f.store_error(what, e, began);
        f.delay()
    }
}

/// `t` as RFC 3339 with milliseconds, UTC (`2026-12-07T02:53:59.123Z`).
fn rfc3339(t: chrono::DateTime<chrono::Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

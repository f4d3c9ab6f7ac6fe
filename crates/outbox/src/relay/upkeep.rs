//! The relay's background beside its workers: the registry heartbeat, the store sample for
//! the gauges, the pause log lines, parking and giving back rows held behind dead letters,
//! and the summary line.

use super::registry::host_name;
use super::{Relay, RelayStats};
use crate::error::Error;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How often a relay reads the pause switch to log its changes (the claim honours the
/// switch at once; this only bounds how late the "paused" log line comes).
const PAUSE_LOG_INTERVAL: Duration = Duration::from_secs(5);

/// How often a relay with strict per-key ordering parks the rows dead letters hold back
/// ([`Maintenance::park_held`](crate::store::Maintenance::park_held)), besides right after it quarantined a keyed message itself: rows
/// of a blocked key written meanwhile are read by every claim until they are parked.
const PARK_INTERVAL: Duration = Duration::from_secs(10);

/// How often a relay gives back parked rows that its ordering does not hold
/// ([`Maintenance::unpark_released`](crate::store::Maintenance::unpark_released); replay and discard give theirs back themselves, so this
/// catches dead letters removed by other means, a relay that no longer orders strictly,
/// and a start-up call that found another parker at work). Every relay also does it before
/// its first claim.
const UNPARK_INTERVAL: Duration = Duration::from_secs(60);

impl Relay {
    /// The relay's side jobs while its workers run: the registry heartbeat (and the
    /// deregistration on exit), the store sample for the gauges (when this relay is the
    /// sampler), the destination state gauges and the summary log line.
    pub(super) async fn background(&self, done: &CancellationToken) {
        let cfg = &self.config;
        let registry = !cfg.heartbeat_interval.is_zero();
        let far = Duration::from_secs(3600);
        // At most a day: an interval so long it overflows the clock means "rarely".
        let every = |d: Duration| {
            if d.is_zero() {
                None
            } else {
                Some(d.min(Duration::from_secs(86_400)))
            }
        };
        let start = Instant::now();
        let mut next_beat = every(cfg.heartbeat_interval).map(|_| start);
        // The first sample after the first heartbeat (so the registry knows this relay).
        let mut next_sample =
            every(cfg.sample_interval).map(|_| start + Duration::from_millis(200));
        let mut next_summary = every(cfg.summary_interval).map(|d| start + d);
        // The pause switch for the log lines (the claim honours it by itself): read every
        // PAUSE_LOG_INTERVAL, and within a second of a wake-up (a pause or resume moves
        // the store's counter), so an idle relay reads it rarely.
        let mut next_pause = start;
        let mut last_pause = start;
        let mut wakeups = Some(self.store.wakeups());
        let mut last_summary = (start, self.counters.snapshot());
        let host = host_name();
        // With strict ordering the relay parks held rows; every relay gives back, at start
        // (`run`, before the first claim) and every UNPARK_INTERVAL, parked rows its
        // ordering does not hold (a start-up call that found another parker at work is
        // so retried).
        let strict = cfg.ordering.holds_dead();
        let mut next_park = strict.then_some(start);
        let mut next_unpark = Some(start + UNPARK_INTERVAL);
        loop {
            let wake = [
                next_beat,
                next_sample,
                next_summary,
                Some(next_pause),
                next_park,
                next_unpark,
            ]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(start + far)
            .min(Instant::now() + Duration::from_secs(5));
            tokio::select! {
                () = tokio::time::sleep_until(wake) => {}
                r = async { wakeups.as_mut()?.changed().await.ok() },
                    if wakeups.is_some() && next_pause > last_pause + Duration::from_secs(1) => {
                    match r {
                        Some(()) => next_pause = last_pause + Duration::from_secs(1),
                        None => wakeups = None, // the store's counter is gone
                    }
                    continue;
                }
                () = self.park_wanted.notified(), if strict => {
                    next_park = Some(Instant::now());
                }
                () = done.cancelled() => break,
            }
            let now = Instant::now();
            // Re-set every turn: a recorder may drop gauges that are not set for a while.
            crate::metrics::relay_info(&self.store_kind(), &self.router.describe());
            for (destination, state) in self.router.destination_states() {
                crate::metrics::destination_state(&destination, state);
            }
            if let (Some(at), Some(interval)) = (next_beat, every(cfg.heartbeat_interval))
                && now >= at
            {
                next_beat = Some(now + interval);
                let beat = self.beat(&host);
                self.check_id_at_heartbeat(&host).await;
                let began = Instant::now();
                match self.store.heartbeat(&beat).await {
                    Ok(()) => self.lock_failing().recovered(began),
                    Err(e) => {
                        crate::metrics::store_error("heartbeat");
                        if e.is_transient() {
                            self.lock_failing().store_error(
                                "writing the relay's registry row",
                                &e,
                                began,
                            );
                        }
                        tracing::debug!(error = %e, "writing the relay's registry row failed; next try in {interval:?}");
                    }
                }
            }
            if now >= next_pause {
                last_pause = now;
                next_pause = now + PAUSE_LOG_INTERVAL;
                if let Err(e) = self.note_pause().await {
                    crate::metrics::store_error("pause");
                    tracing::debug!(error = %e, "reading the pause switch failed");
                }
            }
            if let (Some(at), Some(interval)) = (next_sample, every(cfg.sample_interval))
                && now >= at
            {
                next_sample = Some(now + interval);
                if let Err(e) = self.sample(registry).await {
                    crate::metrics::store_error("sample");
                    tracing::debug!(error = %e, "sampling the store for metrics failed");
                }
            }
            if let Some(at) = next_park
                && now >= at
            {
                next_park = Some(now + PARK_INTERVAL);
                match self.store.park_held(&cfg.ordering).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(
                        rows = n,
                        "parked rows of ordered keys blocked by dead letters (replay or discard the dead letter to release them)"
                    ),
                    Err(e) => {
                        crate::metrics::store_error("park");
                        tracing::debug!(error = %e, "parking rows held behind dead letters failed; next try in {PARK_INTERVAL:?}");
                    }
                }
            }
            if let Some(at) = next_unpark
                && now >= at
            {
                next_unpark = Some(now + UNPARK_INTERVAL);
                self.unpark().await;
            }
            if let (Some(at), Some(interval)) = (next_summary, every(cfg.summary_interval))
                && now >= at
            {
                next_summary = Some(now + interval);
                let stats = self.counters.snapshot();
                self.summary(&last_summary, &stats).await;
                last_summary = (now, stats);
            }
        }
        // The last log lines tell the pause state the relay stopped in.
        let _ = tokio::time::timeout(Duration::from_secs(2), self.note_pause()).await;
        if registry {
            match tokio::time::timeout(
                Duration::from_secs(2),
                self.store.deregister(&cfg.relay_id, &self.instance),
            )
            .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "removing the relay's registry row failed; it expires by itself")
                }
                Err(_) => tracing::debug!(
                    "removing the relay's registry row timed out; it expires by itself"
                ),
            }
        }
    }

    /// Gives back the parked rows that this relay's ordering does not hold
    /// ([`Maintenance::unpark_released`](crate::store::Maintenance::unpark_released)); failures are counted and logged at debug.
    pub(super) async fn unpark(&self) {
        match self.store.unpark_released(&self.config.ordering).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                rows = n,
                "gave back parked rows no dead letter holds any more"
            ),
            Err(e) => {
                crate::metrics::store_error("park");
                tracing::debug!(error = %e, "giving back released parked rows failed");
            }
        }
    }

    /// Samples the store into the store gauges when this relay is the sampler: the live
    /// relay with the smallest id (every relay when there is no registry).
    async fn sample(&self, registry: bool) -> Result<(), Error> {
        let relays = if registry {
            self.store.relays(crate::store::RELAY_EXPIRY).await?
        } else {
            Vec::new()
        };
        let sampler = !registry
            || relays
                .iter()
                .map(|r| (r.relay_id.as_str(), r.instance.as_str()))
                .min()
                .is_none_or(|first| first == (&self.config.relay_id, &self.instance));
        if !sampler {
            return Ok(());
        }
        let overview = self.store.overview(10).await?;
        let pause = self.store.pause_state().await?;
        crate::metrics::store_sample(&overview, relays.len(), &pause);
        let ordering = &self.config.ordering;
        if ordering.holds_dead() {
            crate::metrics::ordering_sample(&self.store.held_keys(ordering).await?);
        }
        // A session that holds back cleanup slows every claim down without an error: the
        // gauge is the signal (its own failure, e.g. no privilege to read the server's
        // views, leaves the other gauges alone).
        match self.store.cleanup_horizon().await {
            Ok(h) => crate::metrics::horizon_sample(self.store.kind(), &h),
            Err(e) => {
                crate::metrics::store_error("sample");
                tracing::debug!(error = %e, "reading what holds back the store's cleanup failed");
            }
        }
        Ok(())
    }

    /// Logs the summary line: what this relay did since `last`, and the backlog.
    async fn summary(&self, last: &(Instant, RelayStats), now: &RelayStats) {
        let secs = last.0.elapsed().as_secs_f64().max(0.001);
        let delivered = now.dispatched - last.1.dispatched;
        let down: Vec<String> = self
            .router
            .destination_states()
            .into_iter()
            .filter(|(_, s)| *s != "up")
            .map(|(d, s)| format!("{d} ({s})"))
            .collect();
        let counts = self.store.counts().await.ok();
        tracing::info!(
            delivered,
            rate_per_s = format!("{:.1}", delivered as f64 / secs),
            retried = now.retried - last.1.retried,
            quarantined = now.quarantined - last.1.quarantined,
            backlog = counts.as_ref().map(|c| c.pending + c.claimed),
            oldest_pending_age_s = counts.as_ref().and_then(|c| c.oldest_pending_age_seconds),
            destinations_down = %if down.is_empty() { "none".to_owned() } else { down.join(", ") },
            "relay summary"
        );
    }

    /// Reads the pause switch and the topic pauses and logs each change once (the claim
    /// honours them by itself; this is for the operator). Returns the switch.
    pub(super) async fn note_pause(&self) -> Result<bool, Error> {
        let state = self.store.pause_state().await?;
        let mut p = self.pause.lock().await;
        p.reason = state.reason;
        let patterns: Vec<String> = state.topics.iter().map(|t| t.pattern.clone()).collect();
        if patterns != p.logged_topics {
            if patterns.is_empty() {
                tracing::info!("topic pauses lifted: every topic flows");
            } else {
                tracing::warn!(topics = %patterns.join(","), "topics paused: not publishing these (other topics flow)");
            }
            p.logged_topics = patterns;
        }
        if state.paused != p.logged {
            if state.paused {
                tracing::warn!(
                    reason = p.reason.as_deref().unwrap_or(""),
                    "outbox paused: not publishing"
                );
            } else {
                tracing::info!("outbox resumed");
            }
            p.logged = state.paused;
        }
        Ok(state.paused)
    }
}

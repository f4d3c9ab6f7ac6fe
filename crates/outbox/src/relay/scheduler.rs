//! The workers: started together and joined beside the background; each claims,
//! publishes and settles its own batches; while idle one of them listens for the store's
//! wake-up, and the others join when a claim comes back full.

use super::health::add;
use super::{Relay, RelayError};
use crate::store::ClaimRequest;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long a worker woken while others are busy waits for one of them to begin a claim
/// before it claims itself (see [`Relay::covered`]).
const JOIN_AFTER: Duration = Duration::from_millis(5);

/// Counts a worker in [`Relay::working`] while it lives.
struct Working<'a>(&'a std::sync::atomic::AtomicU32);

impl<'a> Working<'a> {
    fn start(n: &'a std::sync::atomic::AtomicU32) -> Self {
        n.fetch_add(1, Ordering::Relaxed);
        Working(n)
    }
}

impl Drop for Working<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Relay {
    /// Runs the relay's `in_flight_batches` workers until each has stopped (shutdown, a
    /// drain that found nothing due, an error), with the background beside them
    /// ([`Relay::background`]), which ends once the last worker has. Returns each
    /// worker's result.
    pub(super) async fn run_workers(
        &self,
        cancel: &CancellationToken,
    ) -> Vec<Result<(), RelayError>> {
        // Subscribed before the first claim: a commit after it moves the counter even if
        // no worker is idle yet.
        *self.listener.lock().await = Some(self.store.wakeups());
        let done = CancellationToken::new();
        // Each worker claims, publishes and settles its own batches; SKIP LOCKED keeps
        // their claims apart, and one worker's publish overlaps another's claim and mark.
        let workers = async {
            let r = futures::future::join_all(
                (0..self.config.in_flight_batches).map(|w| self.worker(w, cancel)),
            )
            .await;
            done.cancel();
            r
        };
        let (results, ()) = tokio::join!(workers, self.background(&done));
        results
    }

    /// Waits while idle: for the store's wake-up or the poll interval when this worker is
    /// the relay's listener (one idle worker at a time is), for a full batch found by
    /// another worker, or for shutdown. One claim follows per wake-up, not one per worker,
    /// and none when a busy worker's next claim covers it ([`Relay::covered`]).
    /// Returns true when the poll interval alone ended the wait.
    async fn idle(&self, cancel: &CancellationToken) -> bool {
        tokio::select! {
            mut slot = self.listener.lock() => {
                let wake = slot.get_or_insert_with(|| self.store.wakeups());
                loop {
                    tokio::select! {
                        r = wake.changed() => {
                            if r.is_err() {
                                // The store's counter is gone: poll instead.
                                *slot = None;
                                sleep_or_cancel(self.config.poll_interval, cancel).await;
                                return false;
                            }
                            if !self.covered(cancel).await {
                                return false;
                            }
                        }
                        () = tokio::time::sleep(self.config.poll_interval) => return true,
                        () = self.more.notified() => return false,
                        () = cancel.cancelled() => return false,
                    }
                }
            }
            () = self.more.notified() => false,
            () = cancel.cancelled() => false,
        }
    }

    /// After a wake-up, while other workers are busy (and the store is not
    /// [`Relaying::one_writer`](crate::store::Relaying::one_writer)): true when one of them began a claim
    /// since (a claim that begins after the commit's wake-up sees the commit), so this
    /// worker need not claim too; false, and this worker claims, when none is busy, a
    /// claim came back full, or none began within [`JOIN_AFTER`] (a slow publish does not
    /// hold new rows back for longer). So a trickle of commits is claimed by the worker
    /// that comes round next, in fewer, larger claims, rather than by every idle worker in
    /// turn, and the workers in flight follow the backlog.
    async fn covered(&self, cancel: &CancellationToken) -> bool {
        if self.store.one_writer() {
            return false;
        }
        let seen = self.counters.claims.load(Ordering::Relaxed);
        let deadline = tokio::time::Instant::now() + JOIN_AFTER;
        loop {
            let turned = self.turn.notified();
            tokio::pin!(turned);
            turned.as_mut().enable();
            if self.counters.claims.load(Ordering::Relaxed) != seen {
                return true;
            }
            if self.working.load(Ordering::Relaxed) == 0 {
                return false;
            }
            tokio::select! {
                () = turned => {}
                () = tokio::time::sleep_until(deadline) => return false,
                () = self.more.notified() => return false,
                () = cancel.cancelled() => return false,
            }
        }
    }

    /// [`Relay::idle`] for a worker that was working.
    async fn rest(&self, cancel: &CancellationToken) -> bool {
        self.working.fetch_sub(1, Ordering::Relaxed);
        self.turn.notify_waiters();
        let polled = self.idle(cancel).await;
        self.working.fetch_add(1, Ordering::Relaxed);
        polled
    }

    /// One claim → publish → settle loop (worker `index`). While idle, one worker at a
    /// time listens for the store's wake-up and polls (see [`Relay::idle`]); a claim that
    /// found rows is followed at once by another.
    async fn worker(&self, index: u32, cancel: &CancellationToken) -> Result<(), RelayError> {
        let cfg = &self.config;
        // One worker claims first; the others join when a claim comes back full (or a
        // wake-up comes), as while idle, so a small backlog is one batch, not one split
        // between every worker. A drain starts them all (each ends on an empty claim).
        let _working = Working::start(&self.working);
        if index > 0 && !cfg.drain {
            self.rest(cancel).await;
        }
        let mut request = ClaimRequest {
            relay_id: cfg.relay_id.clone(),
            batch_size: cfg.batch_size,
            lease: cfg.lease,
            skip_topics: Vec::new(),
            ordering: cfg.ordering.clone(),
        };
        while !cancel.is_cancelled() {
            self.health.turned();

            // Every destination down: nothing claimed now could be published before the
            // first probe is due, so wait for it instead of cycling rows.
            if let Some(wait) = self.router.all_open_for() {
                if cfg.drain {
                    // Nothing can be delivered now: a drain stops here (its rescheduled
                    // rows stay pending, so the run reports them).
                    tracing::warn!(sink = %self.router.describe(), "every destination is unavailable: drain stops with rows still pending");
                    break;
                }
                sleep_or_cancel(wait, cancel).await;
                continue;
            }

            let size = self.claim_size.load(Ordering::Relaxed);
            request.batch_size = size;
            // Other workers' claims in flight (this worker's own has settled).
            let beside_others = self.health.in_flight.load(Ordering::Relaxed) > 0;
            let began = Instant::now();
            add(&self.counters.claims, 1);
            self.turn.notify_waiters();
            let claim = match self.store.claim(&request).await {
                Ok(c) => {
                    crate::metrics::seconds(crate::metrics::CLAIM_DURATION, began.elapsed());
                    self.lock_failing().recovered(began);
                    c
                }
                Err(e) => {
                    add(&self.counters.store_retries, 1);
                    crate::metrics::store_error("claim");
                    let delay = self.store_failed("claiming", &e, began);
                    sleep_or_cancel(delay, cancel).await;
                    continue;
                }
            };
            let n = claim.messages.len() + claim.malformed.len();
            let ordered = cfg.ordering.is_on();
            if ordered && beside_others {
                // Beside other claims, what an ordered claim finds says which keys are
                // free, not how large the backlog is.
                self.futile.store(n == 0, Ordering::Relaxed);
                if n > 0 {
                    self.follow_backlog(size, n);
                }
            } else {
                self.follow_backlog(size, n);
            }
            if n == 0 {
                if cfg.drain {
                    // Nothing claimed: nothing due, or the outbox is paused (the claim
                    // honours the switch), which a drain reports.
                    match self.note_pause().await {
                        Ok(true) => {
                            let reason = self.pause.lock().await.reason.clone();
                            return Err(RelayError::Paused {
                                reason: reason.unwrap_or_default(),
                            });
                        }
                        Ok(false) => break,
                        Err(e) => {
                            // Not known whether paused: try again, as after any store error.
                            add(&self.counters.store_retries, 1);
                            crate::metrics::store_error("pause");
                            let delay = self.store_failed("reading the pause switch", &e, began);
                            sleep_or_cancel(delay, cancel).await;
                            continue;
                        }
                    }
                }
                // A poll the store knows would find nothing (MySQL's probe) is skipped:
                // the loop still turns, for the health check.
                while self.rest(cancel).await && self.store.nothing_due(cfg.poll_interval) {
                    self.health.turned();
                }
                continue;
            }
            if n >= size as usize && !(ordered && self.futile.load(Ordering::Relaxed)) {
                // More may be due: let the idle workers claim too (unless, with ordering,
                // the last claim beside others found every key held).
                self.more.notify_waiters();
            }
            add(&self.counters.batches, 1);
            add(&self.counters.claimed, n as u64);
            crate::metrics::value(crate::metrics::BATCH_SIZE, n as f64);
            let h = &self.health;
            h.last_claim_ms.store(h.now_ms().max(1), Ordering::Relaxed);
            // A claim's rows, at most the batch size (a u32): always an i64.
            let rows = i64::try_from(n).unwrap_or(i64::MAX);
            h.in_flight.fetch_add(rows, Ordering::Relaxed);
            let stop = self.process(claim, cancel).await;
            h.in_flight.fetch_sub(rows, Ordering::Relaxed);
            if stop {
                break;
            }
            // A batch was found: claim again at once (more may be due).
        }
        Ok(())
    }

    /// The next claim's size after a claim of `size` rows found `n`: doubled when it came
    /// back full (a backlog), halved when less than half full, within the bounds.
    fn follow_backlog(&self, size: u32, n: usize) {
        let (min, max) = self.config.claim_bounds();
        let next = if n >= size as usize {
            size.saturating_mul(2).min(max)
        } else if n < (size / 2) as usize {
            (size / 2).max(min)
        } else {
            size
        };
        if next != size {
            self.claim_size.store(next, Ordering::Relaxed);
        }
    }
}

async fn sleep_or_cancel(d: Duration, cancel: &CancellationToken) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = cancel.cancelled() => {}
    }
}

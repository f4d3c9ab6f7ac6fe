//! One batch: publish the claim (in rounds when keys are ordered), keep its lease while it
//! is in flight, wait for the confirmations, then settle it in one store call.

use super::health::add;
use super::{DeadStops, Ending, KeyStops, Policy, Relay, decide, plan, rounds};
use crate::error::Error;
use crate::message::OutgoingMessage;
use crate::sink::Confirmations;
use crate::store::{Claim, Dead, Retry, Settlement};
use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

impl Relay {
    /// Publishes one claim and settles it. Returns true when shutdown grace ran out.
    pub(super) async fn process(&self, claim: Claim, cancel: &CancellationToken) -> bool {
        let cfg = &self.config;
        let policy = Policy::of(cfg);
        let claimed_at = std::time::Instant::now();
        let Claim {
            token,
            messages,
            malformed,
            db_now,
        } = claim;
        // Messages that go dead unpublished stop what follows them when dead rows hold
        // their key: one past max_attempts stops its key, a malformed row, whose key is
        // not known, every message after it (`DeadStops`, then `KeyStops` per round).
        let dead_stops = DeadStops::of(&messages, &malformed, &cfg.ordering, &policy);
        let (mut to_publish, mut dead) = plan(messages, &policy);
        let mut dead_all: Vec<Dead> = malformed;
        dead_all.append(&mut dead);
        let rounds = rounds(&to_publish, &cfg.ordering);
        let stops = KeyStops::at_claim(&dead_stops, &to_publish, &rounds);
        // One round with nothing held back: the batch goes out as one publish.
        let whole = rounds.of.len() == 1 && dead_stops.is_empty();
        let sent = std::sync::Mutex::new(vec![whole; to_publish.len()]);

        // A producer span per message (only with an OpenTelemetry layer); it also puts
        // its own trace context into the headers sent.
        let mut spans =
            crate::trace::PublishSpans::start(&mut to_publish, |t| self.router.system_of(t));
        let confirm = Confirmations::new(to_publish.len());
        let publish_began = Instant::now();
        let ending = if to_publish.is_empty() {
            Ending::Finished
        } else {
            let ids: Vec<i64> = to_publish.iter().map(|m| m.id).collect();
            let publish = async {
                let route = async {
                    if whole {
                        return self
                            .router
                            .publish(&to_publish, &confirm, cfg.publish_timeout)
                            .await;
                    }
                    let mut stops = stops;
                    for round in &rounds.of {
                        if cancel.is_cancelled() {
                            break; // the rest is released
                        }
                        let ids = stops.pick(round, &to_publish, &rounds);
                        if ids.is_empty() {
                            continue;
                        }
                        {
                            let mut sent = sent.lock().unwrap_or_else(|p| p.into_inner());
                            for &i in &ids {
                                sent[i] = true;
                            }
                        }
                        let part: Vec<OutgoingMessage> =
                            ids.iter().map(|&i| to_publish[i].clone()).collect();
                        self.router
                            .publish(&part, &confirm.subset(&ids), cfg.publish_timeout)
                            .await;
                        stops.stop_failed(
                            &ids,
                            |i| matches!(confirm.get(i), Some(Ok(()))),
                            &rounds,
                        );
                    }
                };
                tokio::pin!(route);
                // The spans end as outcomes arrive; the publish alone decides when it is
                // done (spans still open then are ended below).
                tokio::select! {
                    () = &mut route => {}
                    () = spans.follow(&confirm) => route.await,
                }
            };
            tokio::pin!(publish);
            let renew = self.keep_lease(token, ids, &to_publish);
            tokio::pin!(renew);
            tokio::select! {
                () = &mut publish => Ending::Finished,
                () = &mut renew => Ending::LeaseLost,
                () = cancel.cancelled() => {
                    tokio::select! {
                        () = &mut publish => Ending::Finished,
                        () = &mut renew => Ending::LeaseLost,
                        () = tokio::time::sleep(cfg.shutdown_grace) => Ending::Abandoned,
                    }
                }
            }
        };
        let outcomes = confirm.snapshot();
        spans.finish(&outcomes);
        if !to_publish.is_empty() {
            crate::metrics::seconds(
                crate::metrics::BATCH_PUBLISH_DURATION,
                publish_began.elapsed(),
            );
        }
        // occurred_at → confirmation on the database clock: the database's now at the
        // claim, plus the time since the claim returned (one clock for both ends).
        if let Some(db_now) = db_now {
            let h = crate::metrics::seconds_histogram(crate::metrics::ENQUEUE_TO_CONFIRM);
            let db_now_us = db_now.timestamp_micros();
            let times = confirm.recorded_times();
            for (i, m) in to_publish.iter().enumerate() {
                if let (Some(Ok(())), Some(Some(at))) = (&outcomes[i], times.get(i)) {
                    let before_us = (db_now_us - m.occurred_at.timestamp_micros()).max(0);
                    let since = at.saturating_duration_since(claimed_at).as_secs_f64();
                    h.record(before_us as f64 / 1e6 + since);
                }
            }
        }
        let held: Vec<bool> = sent
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .into_iter()
            .map(|sent| !sent)
            .collect();
        let mut settlement = decide(&to_publish, &outcomes, &held, ending, &policy);
        settlement.dead.splice(0..0, dead_all);
        if ending == Ending::LeaseLost {
            let unsettled = outcomes.iter().filter(|o| o.is_none()).count();
            tracing::warn!(
                sink = %self.router.describe(),
                confirmed = settlement.dispatched.len(),
                without_outcome = unsettled,
                "could not renew the lease: stopped waiting for this batch; its unconfirmed rows come back after the lease"
            );
        }
        self.settle(token, settlement, &to_publish).await;
        ending == Ending::Abandoned
    }

    /// Renews the claim every third of the lease while its batch is in flight. Returns
    /// only when the claim cannot be kept: every row lost, or no renewal succeeded before
    /// the lease would end (then the batch must stop: another relay may claim the rows).
    async fn keep_lease(&self, token: uuid::Uuid, mut ids: Vec<i64>, batch: &[OutgoingMessage]) {
        let lease = self.config.lease;
        let every = lease / 3;
        // The lease ends no earlier than `held_since + lease` on the database clock.
        let mut held_since = Instant::now();
        loop {
            tokio::time::sleep(every).await;
            let sent = Instant::now();
            match self.store.renew(token, &ids, lease).await {
                Ok(held) => {
                    self.lock_failing().recovered(sent);
                    add(&self.counters.lease_renewals, 1);
                    crate::metrics::add(crate::metrics::LEASE_RENEWALS, 1);
                    held_since = sent;
                    if held.len() < ids.len() {
                        let lost: Vec<i64> = ids
                            .iter()
                            .copied()
                            .filter(|id| !held.contains(id))
                            .collect();
                        self.log_lost(&lost, batch, "renewing the lease");
                        ids = held;
                    }
                    if ids.is_empty() {
                        return;
                    }
                }
                Err(e) => {
                    add(&self.counters.store_retries, 1);
                    crate::metrics::store_error("renew");
                    let left = (held_since + lease).saturating_duration_since(Instant::now());
                    // Part of the store's outage (logged when it begins and ends); a lease
                    // that runs out is logged where the batch stops.
                    self.lock_failing()
                        .store_error("renewing a lease", &e, sent);
                    tracing::debug!(error = %e, lease_left = ?left, "renewing the lease failed; retrying");
                    if left <= every {
                        return;
                    }
                }
            }
        }
    }

    fn log_lost(&self, lost: &[i64], batch: &[OutgoingMessage], when: &str) {
        if lost.is_empty() {
            return;
        }
        add(&self.counters.lost_claims, lost.len() as u64);
        crate::metrics::add(crate::metrics::CLAIMS_LOST, lost.len() as u64);
        let ids: Vec<String> = lost
            .iter()
            .map(|id| {
                batch
                    .iter()
                    .find(|m| m.id == *id)
                    .map_or_else(|| format!("row {id}"), |m| m.message_id.to_string())
            })
            .collect();
        tracing::warn!(
            count = lost.len(),
            message_ids = %ids.join(","),
            "lost the claim on these rows while {when}: their lease ran out and another relay claimed them (this relay changed nothing for them)"
        );
    }

    /// Logs the retries that were written (`changed`, sorted): never a row whose settle
    /// changed nothing.
    fn log_retries(&self, batch: &[OutgoingMessage], s: &Settlement, changed: &[i64]) {
        let written = |r: &&Retry| changed.binary_search(&r.id).is_ok();
        let counted: Vec<&Retry> = s
            .retries
            .iter()
            .filter(written)
            .filter(|r| !r.refund_attempt)
            .collect();
        if let Some(first) = counted.first() {
            tracing::warn!(
                sink = %self.router.describe(),
                count = counted.len(),
                first_error = %first.error,
                "publish failed; rescheduled with backoff"
            );
        }
        for r in &counted {
            if let Some(m) = batch.iter().find(|m| m.id == r.id) {
                tracing::debug!(message_id = %m.message_id, topic = %m.topic.escape_debug(), attempt = m.attempts, retry_in = ?r.delay, error = %r.error, "publish failed; will retry");
            }
        }
        let waiting: Vec<&Retry> = s
            .retries
            .iter()
            .filter(written)
            .filter(|r| r.refund_attempt)
            .collect();
        if let Some(first) = waiting.first() {
            tracing::debug!(
                count = waiting.len(),
                retry_in = ?first.delay,
                first_error = %first.error,
                "destination unavailable; rows wait for it without counting an attempt"
            );
        }
    }

    /// Writes a claim's outcome in one store call, retried on transient store errors
    /// until the lease would run out (then the rows come back by lease expiry: marked
    /// ones as duplicates, never lost). Logs what actually changed.
    async fn settle(&self, token: uuid::Uuid, s: Settlement, batch: &[OutgoingMessage]) {
        if s.is_empty() {
            return;
        }
        let deadline = Instant::now() + self.config.lease;
        let Some(settled) = self
            .store_retry("settling a batch", deadline, || async {
                let began = Instant::now();
                let r = self.store.settle(token, &s).await;
                crate::metrics::seconds(crate::metrics::SETTLE_DURATION, began.elapsed());
                r
            })
            .await
        else {
            return;
        };
        let c = &self.counters;
        let changed = |ids: &mut dyn Iterator<Item = i64>| -> u64 {
            ids.filter(|id| settled.changed.binary_search(id).is_ok())
                .count() as u64
        };
        add(&c.dispatched, changed(&mut s.dispatched.iter().copied()));
        let retried = changed(&mut s.retries.iter().map(|r| r.id));
        add(&c.retried, retried);
        crate::metrics::add(crate::metrics::RETRIED, retried);
        let released = changed(&mut s.release.iter().copied());
        add(&c.released, released);
        crate::metrics::add(crate::metrics::RELEASED, released);
        for d in &s.dead {
            if settled.changed.binary_search(&d.id).is_err() {
                continue;
            }
            add(&c.quarantined, 1);
            crate::metrics::quarantined(quarantine_reason(&d.error), 1);
            let found = batch.iter().find(|m| m.id == d.id);
            let ordering = &self.config.ordering;
            if ordering.holds_dead()
                && found.is_none_or(|m| m.key.is_some() && ordering.covers(&m.topic))
            {
                // A malformed row (not in the batch) may have been keyed too.
                self.park_wanted.notify_one();
            }
            match found {
                Some(m) => {
                    tracing::warn!(message_id = %m.message_id, topic = %m.topic.escape_debug(), attempts = m.attempts, error = %d.error, "message quarantined");
                }
                None => tracing::warn!(row = d.id, error = %d.error, "row quarantined"),
            }
        }
        self.log_retries(batch, &s, &settled.changed);
        self.log_lost(&settled.lost, batch, "settling");
    }

    async fn store_retry<'a, T, F, Fut>(&'a self, what: &str, deadline: Instant, f: F) -> Option<T>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, Error>> + 'a,
    {
        let mut delay = Duration::from_millis(50);
        loop {
            let began = Instant::now();
            match f().await {
                Ok(n) => {
                    self.lock_failing().recovered(began);
                    return Some(n);
                }
                Err(e) if e.is_transient() && Instant::now() + delay < deadline => {
                    add(&self.counters.store_retries, 1);
                    crate::metrics::store_error("settle");
                    // Part of the store's outage: logged when it begins and ends.
                    self.lock_failing().store_error(what, &e, began);
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
                Err(e) => {
                    crate::metrics::store_error("settle");
                    if e.is_transient() {
                        self.lock_failing().store_error(what, &e, began);
                    }
                    tracing::error!(error = %e, "{what} failed; the rows return after their lease");
                    return None;
                }
            }
        }
    }
}

/// The `reason` label of `outbox_messages_quarantined_total` for a dead row's error.
fn quarantine_reason(error: &str) -> &'static str {
    if error.starts_with("malformed row") {
        "malformed"
    } else if error.starts_with("gave up after") || error.contains("exceeds max_attempts") {
        "max_attempts"
    } else {
        "permanent"
    }
}

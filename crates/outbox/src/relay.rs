//! The relay: claim → publish the batch → collect each confirmation → mark → reschedule or
//! quarantine → repeat.
//!
//! Where each guarantee is enforced:
//! - *publish-then-mark*: a row is marked only after its own `Ok` from the sink
//!   (`Relay::settle`); a crash in between leaves it claimed, and it is published again
//!   with the same message id after the lease.
//! - *no transaction across a publish*: every store call is one statement (or one short
//!   transaction) that has returned before the sink is called.
//! - *stale claimants*: every update passes the claim token; the store ignores rows whose
//!   token changed.
//! - *bounded retries*: attempts are counted at claim; past `max_attempts` a row is
//!   quarantined, even if earlier claims never reported back (a message that crashes the
//!   relay). An [`ErrorKind::Unavailable`] failure (the destination, not the message)
//!   gives the attempt back and backs off on the relay's outage streak instead.
//! - *idle relays do not spin*: an empty claim waits for the store's wake-up or the poll
//!   interval.

use crate::backoff;
use crate::error::Error;
use crate::message::OutgoingMessage;
use crate::sink::{ErrorKind, PublishError, Sink};
use crate::store::{Claim, ClaimRequest, Dead, Retry, Store};
use serde::Serialize;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Settings of one relay. `Default` gives production values.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Written to `claimed_by` (default `HOSTNAME:PID:RANDOM`).
    pub relay_id: String,
    /// Rows per claim (default 100).
    pub batch_size: u32,
    /// How long a claim holds (default 30 s). Must exceed `publish_timeout`.
    pub lease: Duration,
    /// Attempts before a transiently failing row is quarantined (default 10).
    pub max_attempts: i32,
    /// Poll interval when no wake-up arrives (default 1 s; the store's wake-up usually
    /// comes first).
    pub poll_interval: Duration,
    /// Bound on one batch's publish, confirmations included (default 10 s).
    pub publish_timeout: Duration,
    /// First retry delay (default 1 s); doubles per attempt, with jitter.
    pub backoff_base: Duration,
    /// Largest retry delay (default 5 min).
    pub backoff_max: Duration,
    /// On shutdown, how long an in-flight batch may still finish before its claims are
    /// released (default 10 s).
    pub shutdown_grace: Duration,
    /// Exit once a claim finds nothing due, instead of waiting for more.
    pub drain: bool,
    /// Batches in flight at once (default 2): while one batch waits for its
    /// confirmations, another is claimed or marked. Each has its own claim token.
    pub in_flight_batches: u32,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            relay_id: default_relay_id(),
            batch_size: 100,
            lease: Duration::from_secs(30),
            max_attempts: 10,
            poll_interval: Duration::from_secs(1),
            publish_timeout: Duration::from_secs(10),
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            shutdown_grace: Duration::from_secs(10),
            drain: false,
            in_flight_batches: 2,
        }
    }
}

/// `HOSTNAME:PID:XXXX` with four random hex digits.
pub fn default_relay_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into());
    format!(
        "{host}:{}:{:04x}",
        std::process::id(),
        rand::random::<u16>()
    )
}

/// Why a relay stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The store failed at start (unreachable, not migrated) or with a non-transient error.
    #[error(transparent)]
    Store(#[from] Error),
    /// `drain` was asked while the outbox is paused: nothing would ever be published.
    #[error("the outbox is paused ({reason}): run `outbox resume` first")]
    Paused {
        /// The reason given when pausing.
        reason: String,
    },
    /// The relay's configuration cannot work.
    #[error("invalid relay configuration: {0}")]
    Config(String),
}

/// Counters of one relay, since it started.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct RelayStats {
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
    /// Rows released on shutdown.
    pub released: u64,
    /// Rows this relay settled whose claim had already passed to another relay (its update
    /// changed nothing).
    pub lost_claims: u64,
    /// Store calls that failed transiently (connection loss, SQLite busy, deadlock, lock
    /// wait) and were retried.
    pub store_retries: u64,
}

#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    claimed: AtomicU64,
    dispatched: AtomicU64,
    retried: AtomicU64,
    quarantined: AtomicU64,
    released: AtomicU64,
    lost_claims: AtomicU64,
    store_retries: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> RelayStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RelayStats {
            batches: g(&self.batches),
            claimed: g(&self.claimed),
            dispatched: g(&self.dispatched),
            retried: g(&self.retried),
            quarantined: g(&self.quarantined),
            released: g(&self.released),
            lost_claims: g(&self.lost_claims),
            store_retries: g(&self.store_retries),
        }
    }
}

fn add(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

/// A relay over one store and one sink.
///
/// ```no_run
/// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use outbox::{AnyStore, Relay, RelayConfig, StoreConfig, sink};
/// let store = AnyStore::connect("sqlite://outbox.db", StoreConfig::default()).await?;
/// let sink = sink::open("stdout").await?;
/// let handle = Relay::new(Arc::new(store), Arc::from(sink), RelayConfig::default()).spawn();
/// // ... on shutdown:
/// let stats = handle.shutdown().await?;
/// # Ok(()) }
/// ```
pub struct Relay {
    store: Arc<dyn Store>,
    sink: Arc<dyn Sink>,
    config: RelayConfig,
    counters: Arc<Counters>,
    /// Consecutive batches that found the destination unreachable (the outage backoff's
    /// exponent); reset by any confirmation.
    outage_streak: AtomicU32,
}

/// A running relay. Dropping it does not stop the relay; call [`RelayHandle::shutdown`].
#[must_use = "a relay runs until shutdown() is called"]
pub struct RelayHandle {
    cancel: CancellationToken,
    counters: Arc<Counters>,
    task: tokio::task::JoinHandle<Result<RelayStats, RelayError>>,
}

impl RelayHandle {
    /// Stops claiming, lets the in-flight batch finish within the grace period (releasing
    /// what it could not finish), and returns the final counters.
    ///
    /// # Errors
    /// The relay's own error if it had stopped on one.
    pub async fn shutdown(self) -> Result<RelayStats, RelayError> {
        self.cancel.cancel();
        self.wait().await
    }

    /// Waits until the relay stops by itself (drain mode, or an error).
    ///
    /// # Errors
    /// The relay's error.
    pub async fn wait(self) -> Result<RelayStats, RelayError> {
        match self.task.await {
            Ok(r) => r,
            Err(e) => Err(RelayError::Config(format!("relay task failed: {e}"))),
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> RelayStats {
        self.counters.snapshot()
    }

    /// The token that stops the relay (to tie it to a service's own shutdown).
    pub fn cancellation_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Stops the relay at once without releasing anything, as a crash would (for tests
    /// and demonstrations of lease expiry).
    pub fn abort(self) {
        self.task.abort();
    }
}

/// What the sink said about one batch.
enum Outcome {
    /// One result per message.
    Results(Vec<Result<(), PublishError>>),
    /// Shutdown grace ran out before the sink answered.
    Abandoned,
}

impl Relay {
    /// A relay that claims from `store` and publishes to `sink`.
    pub fn new(store: Arc<dyn Store>, sink: Arc<dyn Sink>, config: RelayConfig) -> Self {
        Relay {
            store,
            sink,
            config,
            counters: Arc::new(Counters::default()),
            outage_streak: AtomicU32::new(0),
        }
    }

    /// Spawns the relay on the current tokio runtime.
    pub fn spawn(self) -> RelayHandle {
        let cancel = CancellationToken::new();
        let counters = self.counters.clone();
        let token = cancel.clone();
        let task = tokio::spawn(self.run(token));
        RelayHandle {
            cancel,
            counters,
            task,
        }
    }

    /// Runs until `cancel` fires (or, with `drain`, until nothing is due).
    ///
    /// # Errors
    /// [`RelayError::Store`] when the store is not migrated or unreachable at start;
    /// [`RelayError::Paused`] in drain mode on a paused outbox; [`RelayError::Config`] for
    /// settings that cannot work.
    pub async fn run(self, cancel: CancellationToken) -> Result<RelayStats, RelayError> {
        let cfg = &self.config;
        if cfg.batch_size == 0 {
            return Err(RelayError::Config("batch_size must be at least 1".into()));
        }
        if cfg.max_attempts < 1 {
            return Err(RelayError::Config("max_attempts must be at least 1".into()));
        }
        if cfg.publish_timeout >= cfg.lease {
            return Err(RelayError::Config(format!(
                "publish_timeout ({:?}) must be shorter than the lease ({:?}), or claims expire while publishing",
                cfg.publish_timeout, cfg.lease
            )));
        }
        if cfg.in_flight_batches == 0 {
            return Err(RelayError::Config(
                "in_flight_batches must be at least 1".into(),
            ));
        }
        self.store.check_schema().await?;
        tracing::info!(relay_id = %cfg.relay_id, sink = %self.sink.describe(), batch_size = cfg.batch_size, in_flight_batches = cfg.in_flight_batches, "relay started");
        // Each worker claims, publishes and settles its own batches; SKIP LOCKED keeps
        // their claims apart, and one worker's publish overlaps another's claim and mark.
        let results =
            futures::future::join_all((0..cfg.in_flight_batches).map(|w| self.worker(w, &cancel)))
                .await;
        // A broker that is down must not keep the process from exiting.
        if tokio::time::timeout(cfg.shutdown_grace, self.sink.close())
            .await
            .is_err()
        {
            tracing::warn!(sink = %self.sink.describe(), "sink did not close within the shutdown grace; exiting anyway");
        }
        let stats = self.counters.snapshot();
        tracing::info!(
            dispatched = stats.dispatched,
            retried = stats.retried,
            quarantined = stats.quarantined,
            released = stats.released,
            lost_claims = stats.lost_claims,
            store_retries = stats.store_retries,
            "relay stopped"
        );
        results.into_iter().collect::<Result<Vec<()>, _>>()?;
        Ok(stats)
    }

    /// One claim → publish → settle loop. Worker 0 speaks for the relay in the logs about
    /// the pause switch.
    async fn worker(&self, index: u32, cancel: &CancellationToken) -> Result<(), RelayError> {
        let cfg = &self.config;
        let mut wake = self.store.wakeups();
        let request = ClaimRequest {
            relay_id: cfg.relay_id.clone(),
            batch_size: cfg.batch_size,
            lease: cfg.lease,
        };
        let mut paused_logged = false;
        let mut last_pause_check: Option<Instant> = None;
        let mut paused = false;
        let mut failing = Failing::default();

        while !cancel.is_cancelled() {
            wake.borrow_and_update();

            if last_pause_check.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                match self.store.pause_state().await {
                    Ok(p) => {
                        paused = p.paused;
                        last_pause_check = Some(Instant::now());
                        if paused && cfg.drain {
                            return Err(RelayError::Paused {
                                reason: p.reason.unwrap_or_default(),
                            });
                        }
                        // Worker 0 speaks for the relay: one log line per change.
                        if index == 0 && paused != paused_logged {
                            if paused {
                                tracing::warn!(
                                    reason = p.reason.as_deref().unwrap_or(""),
                                    "outbox paused: not publishing"
                                );
                            } else {
                                tracing::info!("outbox resumed");
                            }
                            paused_logged = paused;
                        }
                    }
                    Err(e) => {
                        add(&self.counters.store_retries, 1);
                        failing.store_error("reading the pause switch", &e);
                        sleep_or_cancel(failing.delay(), cancel).await;
                        continue;
                    }
                }
            }
            if paused {
                sleep_or_cancel(Duration::from_secs(1), cancel).await;
                continue;
            }

            let claim = match self.store.claim(&request).await {
                Ok(c) => {
                    failing.recovered();
                    c
                }
                Err(e) => {
                    add(&self.counters.store_retries, 1);
                    failing.store_error("claiming", &e);
                    sleep_or_cancel(failing.delay(), cancel).await;
                    continue;
                }
            };
            let n = claim.messages.len() + claim.malformed.len();
            if n == 0 {
                if cfg.drain {
                    break;
                }
                // Idle: wait for the store's wake-up, the poll interval, or shutdown.
                tokio::select! {
                    _ = wake.changed() => {}
                    _ = tokio::time::sleep(cfg.poll_interval) => {}
                    _ = cancel.cancelled() => {}
                }
                continue;
            }
            add(&self.counters.batches, 1);
            add(&self.counters.claimed, n as u64);
            if self.process(claim, cancel).await {
                break;
            }
            // A batch was found: claim again at once (more may be due).
        }
        Ok(())
    }

    /// Publishes one claim and settles it. Returns true when shutdown grace ran out.
    async fn process(&self, claim: Claim, cancel: &CancellationToken) -> bool {
        let cfg = &self.config;
        let Claim {
            token,
            messages,
            malformed,
        } = claim;
        let mut dead: Vec<Dead> = malformed;
        // Rows whose earlier claims never reported back (the relay died each time).
        let (to_publish, over): (Vec<OutgoingMessage>, Vec<OutgoingMessage>) = messages
            .into_iter()
            .partition(|m| m.attempts <= cfg.max_attempts);
        for m in &over {
            dead.push(Dead {
                id: m.id,
                error: format!(
                    "attempt {} exceeds max_attempts {}: earlier claims ended without an outcome (relay crashed or lost its lease)",
                    m.attempts, cfg.max_attempts
                ),
            });
        }

        let outcome = if to_publish.is_empty() {
            Outcome::Results(Vec::new())
        } else {
            let publish = tokio::time::timeout(cfg.publish_timeout, self.sink.publish(&to_publish));
            tokio::pin!(publish);
            let r = tokio::select! {
                r = &mut publish => Some(r),
                _ = cancel.cancelled() => tokio::time::timeout(cfg.shutdown_grace, &mut publish).await.ok(),
            };
            match r {
                None => Outcome::Abandoned,
                Some(Err(_)) => Outcome::Results(vec![
                    Err(PublishError::unavailable(format!(
                        "publish timed out after {:?}",
                        cfg.publish_timeout
                    )));
                    to_publish.len()
                ]),
                Some(Ok(mut results)) => {
                    if results.len() != to_publish.len() {
                        tracing::error!(sink = %self.sink.describe(), got = results.len(), expected = to_publish.len(), "sink returned the wrong number of outcomes");
                        results.truncate(to_publish.len());
                        results.resize(
                            to_publish.len(),
                            Err(PublishError::transient("sink returned no outcome")),
                        );
                    }
                    Outcome::Results(results)
                }
            }
        };

        match outcome {
            Outcome::Abandoned => {
                let ids: Vec<i64> = to_publish.iter().map(|m| m.id).collect();
                self.settle(token, Vec::new(), Vec::new(), dead, ids).await;
                true
            }
            Outcome::Results(results) => {
                let mut ok = Vec::new();
                let mut retries = Vec::new();
                let unavailable = results
                    .iter()
                    .any(|r| matches!(r, Err(e) if e.kind == ErrorKind::Unavailable));
                let streak = if unavailable {
                    self.outage_streak.fetch_add(1, Ordering::Relaxed) + 1
                } else {
                    if results.iter().any(Result::is_ok) {
                        self.outage_streak.store(0, Ordering::Relaxed);
                    }
                    0
                };
                for (m, r) in to_publish.iter().zip(results) {
                    match r {
                        Ok(()) => ok.push(m.id),
                        Err(e) if e.kind == ErrorKind::Unavailable => {
                            // The destination, not the message: outage backoff, attempt
                            // given back.
                            let mut delay = backoff::jittered(
                                i32::try_from(streak).unwrap_or(i32::MAX),
                                cfg.backoff_base,
                                cfg.backoff_max,
                            );
                            if let Some(after) = e.retry_after {
                                delay = delay.max(after);
                            }
                            retries.push(Retry {
                                id: m.id,
                                delay,
                                error: e.to_string(),
                                refund_attempt: true,
                            });
                        }
                        Err(e) if e.is_transient() && m.attempts < cfg.max_attempts => {
                            let mut delay =
                                backoff::jittered(m.attempts, cfg.backoff_base, cfg.backoff_max);
                            if let Some(after) = e.retry_after {
                                delay = delay.max(after);
                            }
                            tracing::debug!(message_id = %m.message_id, topic = %m.topic, attempt = m.attempts, error = %e, "publish failed; will retry");
                            retries.push(Retry {
                                id: m.id,
                                delay,
                                error: e.to_string(),
                                refund_attempt: false,
                            });
                        }
                        Err(e) => {
                            let error = if e.is_transient() {
                                format!("gave up after {} attempts; last error: {e}", m.attempts)
                            } else {
                                e.to_string()
                            };
                            dead.push(Dead { id: m.id, error });
                        }
                    }
                }
                if let Some(first) = retries.first() {
                    tracing::warn!(
                        sink = %self.sink.describe(),
                        count = retries.len(),
                        first_error = %first.error,
                        "publish failed transiently; rescheduled with backoff"
                    );
                }
                for d in &dead {
                    if let Some(m) = to_publish.iter().chain(&over).find(|m| m.id == d.id) {
                        tracing::warn!(message_id = %m.message_id, topic = %m.topic, attempts = m.attempts, error = %d.error, "message quarantined");
                    } else {
                        tracing::warn!(row = d.id, error = %d.error, "row quarantined");
                    }
                }
                self.settle(token, ok, retries, dead, Vec::new()).await;
                false
            }
        }
    }

    /// Writes a batch's outcome: marks first (what the broker confirmed), then retries,
    /// quarantines and releases. Each is retried on transient store errors until the
    /// lease would run out; after that the rows come back by lease expiry (the marked
    /// ones as duplicates, never lost).
    async fn settle(
        &self,
        token: uuid::Uuid,
        ok: Vec<i64>,
        retries: Vec<Retry>,
        dead: Vec<Dead>,
        release: Vec<i64>,
    ) {
        let deadline = Instant::now() + self.config.lease;
        let c = &self.counters;
        if !ok.is_empty() {
            let n = self
                .store_retry("marking dispatched", deadline, || {
                    self.store.mark_dispatched(token, &ok)
                })
                .await;
            if let Some(n) = n {
                add(&c.dispatched, n);
                add(&c.lost_claims, ok.len() as u64 - n.min(ok.len() as u64));
            }
        }
        if !retries.is_empty() {
            let n = self
                .store_retry("rescheduling", deadline, || {
                    self.store.reschedule(token, &retries)
                })
                .await;
            if let Some(n) = n {
                add(&c.retried, n);
                add(
                    &c.lost_claims,
                    retries.len() as u64 - n.min(retries.len() as u64),
                );
            }
        }
        if !dead.is_empty() {
            let n = self
                .store_retry("quarantining", deadline, || {
                    self.store.quarantine(token, &dead)
                })
                .await;
            if let Some(n) = n {
                add(&c.quarantined, n);
                add(&c.lost_claims, dead.len() as u64 - n.min(dead.len() as u64));
            }
        }
        if !release.is_empty() {
            let n = self
                .store_retry("releasing", deadline, || {
                    self.store.release(token, &release)
                })
                .await;
            if let Some(n) = n {
                add(&c.released, n);
            }
        }
    }

    async fn store_retry<'a, F, Fut>(&'a self, what: &str, deadline: Instant, f: F) -> Option<u64>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<u64, Error>> + 'a,
    {
        let mut delay = Duration::from_millis(50);
        loop {
            match f().await {
                Ok(n) => return Some(n),
                Err(e) if e.is_transient() && Instant::now() + delay < deadline => {
                    add(&self.counters.store_retries, 1);
                    tracing::warn!(error = %e, "{what} failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
                Err(e) => {
                    tracing::error!(error = %e, "{what} failed; the rows return after their lease");
                    return None;
                }
            }
        }
    }
}

/// Capped backoff and rate-limited logging while the store is failing.
#[derive(Default)]
struct Failing {
    since: Option<Instant>,
    last_log: Option<Instant>,
    delay: Duration,
}

impl Failing {
    fn store_error(&mut self, what: &str, e: &Error) {
        let now = Instant::now();
        if self.since.is_none() {
            self.since = Some(now);
            self.delay = Duration::from_millis(100);
        } else {
            self.delay = (self.delay * 2).min(Duration::from_secs(5));
        }
        if self
            .last_log
            .is_none_or(|t| now - t >= Duration::from_secs(30))
        {
            tracing::warn!(error = %e, "store error while {what}; retrying with backoff");
            self.last_log = Some(now);
        }
    }

    fn recovered(&mut self) {
        if let Some(since) = self.since.take() {
            tracing::info!(after = ?since.elapsed(), "store reachable again");
            self.last_log = None;
        }
    }

    fn delay(&self) -> Duration {
        self.delay
    }
}

async fn sleep_or_cancel(d: Duration, cancel: &CancellationToken) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = cancel.cancelled() => {}
    }
}

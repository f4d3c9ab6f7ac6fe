//! The relay: claim → publish the batch → record each confirmation → settle the claim in
//! one store call → repeat.
//!
//! Where each guarantee is enforced:
//! - *publish-then-mark*: a row is marked only after its own `Ok` in the batch's
//!   [`Confirmations`] (`decide`); a crash in between leaves it claimed, and it is
//!   published again with the same message id after the lease. A message confirmed
//!   before the publish timeout, the shutdown grace or a lost lease cut the batch short is
//!   still marked: confirmations are per message, never per batch.
//! - *no transaction across a publish*: every store call is one statement (or one short
//!   transaction) that has returned before the sink is called.
//! - *stale claimants*: every update passes the claim token; the store ignores rows whose
//!   token changed, and the relay logs each such lost row with its message id.
//! - *leases hold while a publish is slow but alive*: the claim is renewed every third of
//!   the lease while its batch is in flight; a relay that cannot renew in time stops
//!   waiting for those rows.
//! - *bounded retries*: attempts are counted at claim; past `max_attempts` a row is
//!   quarantined, even if earlier claims never reported back (a message that crashes the
//!   relay). An [`ErrorKind::Unavailable`] failure (the destination, not the message)
//!   gives the attempt back and waits for the destination's next probe instead
//!   (destination health lives in [`Router`], which also bounds the refunds of a message
//!   that timed out after it was sent).
//! - *idle relays do not spin*: an empty claim waits for the store's wake-up or the poll
//!   interval; while idle only one worker per relay polls.

use crate::backoff;
use crate::error::Error;
use crate::message::OutgoingMessage;
use crate::sink::router::Router;
use crate::sink::{Confirmations, ErrorKind, PublishError, Sink};
use crate::store::{Claim, ClaimRequest, Dead, KeyOrdering, Retry, Settlement, Store};
use serde::Serialize;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

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

impl RelayConfig {
    /// The claim size's bounds in rows, (smallest, largest): `min_batch_size` kept within
    /// 1..=`batch_size`, and `batch_size` (at least 1 here; `run` refuses 0).
    fn claim_bounds(&self) -> (u32, u32) {
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

/// `HOSTNAME:PID:XXXX` with four random hex digits.
pub fn default_relay_id() -> String {
    let host = host_name();
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
    /// Another live relay already runs under this relay id: another process (the
    /// registry has its fresh heartbeat), or another `Relay` of this program (then `host`
    /// and `pid` are this process's). Two relays under one id could not be told apart by
    /// their claims (`claimed_by`). Refused at start; a registry row whose process is
    /// gone (same host, that pid no longer running, as after a `kill -9` and a restart)
    /// does not count, and is removed.
    #[error(
        "relay id {relay_id:?} is in use by a live relay on {host} (pid {pid}, heartbeat {seen_ago_s:.1} s ago): give each relay its own --relay-id, or stop that one (a stopped relay's registry row expires 15 s after its last heartbeat)"
    )]
    IdTaken {
        /// The relay id asked for.
        relay_id: String,
        /// The host of the process that holds it.
        host: String,
        /// Its process id.
        pid: i64,
        /// Seconds since its last heartbeat (database clock).
        seen_ago_s: f64,
    },
    /// The relay's task panicked (a bug) or was cancelled from outside its handle. What it
    /// had claimed comes back by lease expiry; nothing it confirmed was lost (confirmed
    /// rows it could not mark are published again: at least once).
    #[error("the relay task {0}")]
    Task(String),
}

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
struct Counters {
    claims: AtomicU64,
    batches: AtomicU64,
    claimed: AtomicU64,
    dispatched: AtomicU64,
    retried: AtomicU64,
    quarantined: AtomicU64,
    released: AtomicU64,
    lost_claims: AtomicU64,
    lease_renewals: AtomicU64,
    store_retries: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> RelayStats {
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

fn add(a: &AtomicU64, n: u64) {
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
    in_flight: std::sync::atomic::AtomicI64,
    /// Milliseconds after `started` of the last claim that returned rows (0: none yet).
    last_claim_ms: AtomicU64,
    /// The poll interval (the loop turns at least this often when idle).
    poll_interval: Duration,
}

impl RelayHealth {
    fn new(poll_interval: Duration) -> Self {
        RelayHealth {
            started: std::time::Instant::now(),
            last_turn_ms: AtomicU64::new(0),
            in_flight: std::sync::atomic::AtomicI64::new(0),
            last_claim_ms: AtomicU64::new(0),
            poll_interval,
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn turned(&self) {
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
    /// This relay's instance (a UUID drawn in [`Relay::with_router`]): its registry row
    /// is keyed by (relay id, instance), so two relays under one id (two processes, or two
    /// `Relay`s in one program) each keep theirs and see each other.
    instance: String,
    router: Arc<Router>,
    config: RelayConfig,
    counters: Arc<Counters>,
    /// The pause switch as last read, for the log lines (the claim itself honours the
    /// switch and the topic pauses; the background reads them every few seconds).
    pause: tokio::sync::Mutex<PauseCache>,
    /// The store's wake-up counter, held by the one idle worker that listens for the
    /// relay (the others wait for it or for `more`): one claim per wake-up or poll.
    listener: tokio::sync::Mutex<Option<tokio::sync::watch::Receiver<u64>>>,
    /// Wakes the idle workers that are not listening when a claim came back full.
    more: tokio::sync::Notify,
    /// Workers not waiting in [`Relay::idle`]: claiming, publishing or settling.
    working: std::sync::atomic::AtomicU32,
    /// Told when a worker begins a claim or starts to wait (see [`Relay::covered`]).
    turn: tokio::sync::Notify,
    /// Rows the next claim asks for, between the configured bounds (see
    /// [`RelayConfig::batch_size`]); shared by the workers.
    claim_size: std::sync::atomic::AtomicU32,
    /// The store's health as the workers saw it (one outage, one pair of log lines).
    failing: std::sync::Mutex<Failing>,
    /// Progress and in-flight count, shared with whoever watches the relay.
    health: Arc<RelayHealth>,
    /// Set when this relay quarantined a keyed message of an ordered topic (strict mode):
    /// the background parks the rows its key now holds back ([`Maintenance::park_held`](crate::store::Maintenance::park_held)).
    park_wanted: tokio::sync::Notify,
    /// Per-key ordering: set when a claim found nothing while other workers held claims
    /// (their keys hold the rest back, and such a claim reads every due row for nothing);
    /// while set, a full claim does not bring the idle workers in. Cleared when a claim
    /// beside others finds rows.
    futile: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct PauseCache {
    reason: Option<String>,
    logged: bool,
    /// The topic patterns last logged (to log each change once).
    logged_topics: Vec<String>,
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
            Err(e) if e.is_panic() => {
                let panic = e.into_panic();
                let text = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-text payload".into());
                Err(RelayError::Task(format!("panicked: {text}")))
            }
            Err(_) => Err(RelayError::Task("was cancelled".into())),
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

/// How a batch's wait for its confirmations ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// The router returned: every message has an outcome.
    Finished,
    /// The shutdown grace ran out: messages without an outcome are released.
    Abandoned,
    /// The lease could not be renewed in time: messages without an outcome are left to
    /// come back by lease expiry (the store is not reachable to release them anyway).
    LeaseLost,
}

/// The retry policy [`decide`] applies.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Policy {
    pub(crate) max_attempts: i32,
    pub(crate) backoff_base: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) delete_dispatched: bool,
}

impl Policy {
    fn of(cfg: &RelayConfig) -> Self {
        Policy {
            max_attempts: cfg.max_attempts,
            backoff_base: cfg.backoff_base,
            backoff_max: cfg.backoff_max,
            delete_dispatched: cfg.on_dispatch == OnDispatch::Delete,
        }
    }
}

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

/// Delay for an unavailable destination that named none (the router names one whenever
/// a breaker is open).
const UNAVAILABLE_RETRY: Duration = Duration::from_millis(500);

/// Splits a claim's messages into those to publish and those already past
/// `max_attempts` (earlier claims ended without an outcome: the relay crashed or lost its
/// lease each time), which are quarantined unpublished.
pub(crate) fn plan(
    messages: Vec<OutgoingMessage>,
    policy: &Policy,
) -> (Vec<OutgoingMessage>, Vec<Dead>) {
    if messages.iter().all(|m| m.attempts <= policy.max_attempts) {
        return (messages, Vec::new()); // the usual claim, moved as it is
    }
    let (publish, over): (Vec<_>, Vec<_>) = messages
        .into_iter()
        .partition(|m| m.attempts <= policy.max_attempts);
    let dead = over
        .iter()
        .map(|m| Dead {
            id: m.id,
            error: format!(
                "attempt {} exceeds max_attempts {}: earlier claims ended without an outcome (relay crashed or lost its lease)",
                m.attempts, policy.max_attempts
            ),
        })
        .collect();
    (publish, dead)
}

/// The rounds in which a claim is published: `of[r]` lists indices into `messages` (in
/// `id` order, as claimed), published together, round `r + 1` only once round `r` has its
/// outcomes. A message of an ordered topic with a key is in the round after the previous
/// message of its key in this claim; every other message is in round 0. So a key's
/// messages go out one at a time in `id` order while different keys go together; without
/// ordering (or with no key twice) there is one round.
#[derive(Debug, PartialEq)]
pub(crate) struct Rounds {
    /// The rounds, each a list of indices into the claim's messages.
    pub(crate) of: Vec<Vec<usize>>,
    /// Per message, its ordered key's number in this claim (0, 1, …, in order of first
    /// appearance); `None` for a message that is not ordered.
    pub(crate) key: Vec<Option<usize>>,
    /// How many ordered keys the claim holds.
    pub(crate) keys: usize,
}

/// The [`Rounds`] of a claim's `messages` under `ordering`.
pub(crate) fn rounds(messages: &[OutgoingMessage], ordering: &KeyOrdering) -> Rounds {
    let mut rounds = Rounds {
        of: vec![Vec::new()],
        key: vec![None; messages.len()],
        keys: 0,
    };
    if !ordering.is_on() {
        rounds.of[0].extend(0..messages.len());
        return rounds;
    }
    // Per ordered key: its number and the round of its next message.
    let mut next: std::collections::HashMap<(&str, &str), (usize, usize)> = Default::default();
    for (i, m) in messages.iter().enumerate() {
        let r = match m.key.as_deref() {
            Some(key) if ordering.covers(&m.topic) => {
                let fresh = next.len();
                let (k, r) = next.entry((m.topic.as_str(), key)).or_insert((fresh, 0));
                rounds.key[i] = Some(*k);
                *r += 1;
                *r - 1
            }
            _ => 0,
        };
        if rounds.of.len() <= r {
            rounds.of.resize_with(r + 1, Vec::new);
        }
        rounds.of[r].push(i);
    }
    rounds.keys = next.len();
    rounds
}

/// The pure decision: what to write for each published message, given its outcome (slot
/// `i` is `messages[i]`; `None` = no outcome) and how the wait ended.
///
/// - `Ok` → dispatched;
/// - [`ErrorKind::Unavailable`] → retry after the destination's `retry_after` (its next
///   probe), attempt given back;
/// - transient (and a timeout, should one reach here unjudged) → retry with jittered
///   exponential backoff (at least `retry_after`), or dead once `max_attempts` is reached;
/// - permanent → dead;
/// - no outcome → released when abandoned (shutdown), left alone when the lease was lost,
///   a transient failure otherwise (a sink that returned without one);
/// - held (`held[i]`: never sent, because an earlier message of its ordered key failed or
///   the relay stopped between rounds) → released, attempt given back, unless the lease
///   was lost.
pub(crate) fn decide(
    messages: &[OutgoingMessage],
    outcomes: &[Option<Result<(), PublishError>>],
    held: &[bool],
    ending: Ending,
    policy: &Policy,
) -> Settlement {
    let mut s = Settlement {
        delete_dispatched: policy.delete_dispatched,
        ..Settlement::default()
    };
    for (i, m) in messages.iter().enumerate() {
        if held.get(i).copied().unwrap_or(false) {
            if ending != Ending::LeaseLost {
                s.release.push(m.id);
            }
            continue;
        }
        let outcome = match outcomes.get(i).cloned().flatten() {
            Some(o) => o,
            None => match ending {
                Ending::Abandoned => {
                    s.release.push(m.id);
                    continue;
                }
                Ending::LeaseLost => continue,
                Ending::Finished => Err(PublishError::transient("the sink gave no outcome")),
            },
        };
        match outcome {
            Ok(()) => s.dispatched.push(m.id),
            Err(e) if e.kind == ErrorKind::Unavailable => s.retries.push(Retry {
                id: m.id,
                delay: e.retry_after.unwrap_or(UNAVAILABLE_RETRY),
                error: e.to_string(),
                refund_attempt: true,
            }),
            Err(e) if e.is_transient() && m.attempts < policy.max_attempts => {
                let mut delay =
                    backoff::jittered(m.attempts, policy.backoff_base, policy.backoff_max);
                if let Some(after) = e.retry_after {
                    delay = delay.max(after);
                }
                s.retries.push(Retry {
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
                s.dead.push(Dead { id: m.id, error });
            }
        }
    }
    s
}

impl Relay {
    /// A relay that claims from `store` and publishes everything to `sink`.
    pub fn new(store: Arc<dyn Store>, sink: Arc<dyn Sink>, config: RelayConfig) -> Self {
        Relay::with_router(store, Router::single(sink), config)
    }

    /// A relay that publishes through `router` (topic routes over several destinations).
    pub fn with_router(store: Arc<dyn Store>, router: Router, config: RelayConfig) -> Self {
        Relay {
            store,
            instance: uuid::Uuid::new_v4().to_string(),
            router: Arc::new(router),
            counters: Arc::new(Counters::default()),
            pause: tokio::sync::Mutex::new(PauseCache::default()),
            listener: tokio::sync::Mutex::new(None),
            more: tokio::sync::Notify::new(),
            working: std::sync::atomic::AtomicU32::new(0),
            turn: tokio::sync::Notify::new(),
            claim_size: std::sync::atomic::AtomicU32::new(config.claim_bounds().0),
            failing: std::sync::Mutex::new(Failing::default()),
            health: Arc::new(RelayHealth::new(config.poll_interval)),
            park_wanted: tokio::sync::Notify::new(),
            futile: std::sync::atomic::AtomicBool::new(false),
            config,
        }
    }

    /// The relay's health (for readiness probes), valid before and after [`Relay::run`].
    pub fn health(&self) -> Arc<RelayHealth> {
        self.health.clone()
    }

    /// The destinations and their health.
    pub fn router(&self) -> &Arc<Router> {
        &self.router
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
        if cfg.lease < Duration::from_millis(30) {
            return Err(RelayError::Config(format!(
                "the lease ({:?}) must be at least 30 ms: it is renewed every third of it",
                cfg.lease
            )));
        }
        if cfg.publish_timeout.is_zero() {
            return Err(RelayError::Config(
                "publish_timeout must be more than zero".into(),
            ));
        }
        if cfg.in_flight_batches == 0 {
            return Err(RelayError::Config(
                "in_flight_batches must be at least 1".into(),
            ));
        }
        if cfg.relay_id.is_empty() || cfg.relay_id.len() > MAX_RELAY_ID_BYTES {
            return Err(RelayError::Config(format!(
                "relay_id must be 1-{MAX_RELAY_ID_BYTES} bytes, got {}",
                cfg.relay_id.len()
            )));
        }
        self.store.check_schema().await?;
        // Each worker claims, publishes and settles its own batches; SKIP LOCKED keeps
        // their claims apart, and one worker's publish overlaps another's claim and mark.
        crate::metrics::relay_info(&self.store_kind(), &self.router.describe());
        // Logged once the id is ours: a refused relay never says it started.
        let _running = self.refuse_if_id_taken().await?;
        tracing::info!(relay_id = %cfg.relay_id, sink = %self.router.describe(), batch_size = cfg.batch_size, min_batch_size = cfg.claim_bounds().0, in_flight_batches = cfg.in_flight_batches, ordered = %cfg.ordering, "relay started");
        self.health.turned();
        // Parked rows this relay's ordering does not hold come back before the first
        // claim (so a drain sees them due).
        self.unpark().await;
        // Subscribed before the first claim: a commit after it moves the counter even if
        // no worker is idle yet.
        *self.listener.lock().await = Some(self.store.wakeups());
        let done = CancellationToken::new();
        let workers = async {
            let r = futures::future::join_all(
                (0..cfg.in_flight_batches).map(|w| self.worker(w, &cancel)),
            )
            .await;
            done.cancel();
            r
        };
        let (results, ()) = tokio::join!(workers, self.background(&done));
        // A broker that is down must not keep the process from exiting.
        if tokio::time::timeout(cfg.shutdown_grace, self.router.close())
            .await
            .is_err()
        {
            tracing::warn!(sink = %self.router.describe(), "sink did not close within the shutdown grace; exiting anyway");
        }
        let stats = self.counters.snapshot();
        tracing::info!(
            dispatched = stats.dispatched,
            retried = stats.retried,
            quarantined = stats.quarantined,
            released = stats.released,
            lost_claims = stats.lost_claims,
            lease_renewals = stats.lease_renewals,
            store_retries = stats.store_retries,
            "relay stopped"
        );
        results.into_iter().collect::<Result<Vec<()>, _>>()?;
        Ok(stats)
    }

    /// Refuses to start when a live relay of another process already uses this relay's
    /// id ([`RelayError::IdTaken`]). A registry that cannot be read does not stop the
    /// relay (the heartbeat checks again).
    async fn refuse_if_id_taken(&self) -> Result<Running, RelayError> {
        let host = host_name();
        let running = Running::enter(&self.config.relay_id, &self.instance).map_err(|_| {
            RelayError::IdTaken {
                relay_id: self.config.relay_id.clone(),
                host: host.clone(),
                pid: i64::from(std::process::id()),
                seen_ago_s: 0.0,
            }
        })?;
        if self.config.heartbeat_interval.is_zero() {
            return Ok(running);
        }
        let Ok(relays) = self.store.relays(crate::store::RELAY_EXPIRY).await else {
            return Ok(running);
        };
        if let Some(other) = id_holder(&relays, &self.config.relay_id, &self.instance, &host) {
            return Err(RelayError::IdTaken {
                relay_id: self.config.relay_id.clone(),
                host: other.host.clone(),
                pid: other.pid,
                seen_ago_s: other.last_seen_ago_s,
            });
        }
        // The rows of this id left by processes of this host that are gone (a kill -9
        // and a restart): not a second relay, so not listed as one.
        for gone in relays.iter().filter(|r| {
            r.relay_id == self.config.relay_id && r.instance != self.instance && gone(r, &host)
        }) {
            let _ = self.store.deregister(&gone.relay_id, &gone.instance).await;
        }
        // Registered before the first claim: the row's `started_at` precedes every claim
        // of this instance, which tells its claims from an earlier process's.
        let _ = self.store.heartbeat(&self.beat(&host)).await;
        Ok(running)
    }

    /// The registry row this relay writes at a heartbeat.
    fn beat(&self, host: &str) -> crate::store::RelayHeartbeat {
        crate::store::RelayHeartbeat {
            relay_id: self.config.relay_id.clone(),
            instance: self.instance.clone(),
            host: host.to_owned(),
            pid: i64::from(std::process::id()),
            lease: self.config.lease,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            sink: self.router.describe(),
            in_flight: self.health.in_flight(),
            last_claim_ago: self.health.since_last_claim(),
            destinations: self
                .router
                .destination_states()
                .into_iter()
                .map(|(name, state)| crate::store::DestinationState {
                    name,
                    state: state.to_owned(),
                })
                .collect(),
        }
    }

    /// At a heartbeat: logs an ERROR and counts `outbox_relay_id_conflicts_total` when the
    /// registry row of this relay's id was last written by another live process (two
    /// relays started under one id at the same moment both passed the start check, or one
    /// was started with heartbeats off). Both keep running; the operator renames one.
    async fn check_id_at_heartbeat(&self, host: &str) {
        let Ok(relays) = self.store.relays(crate::store::RELAY_EXPIRY).await else {
            return;
        };
        if let Some(other) = id_holder(&relays, &self.config.relay_id, &self.instance, host) {
            crate::metrics::add(crate::metrics::RELAY_ID_CONFLICTS, 1);
            tracing::error!(
                relay_id = %self.config.relay_id,
                other_host = %other.host,
                other_pid = other.pid,
                "another live relay runs under this relay id: the registry shows the two as one and their claims cannot be told apart; give each relay its own --relay-id"
            );
        }
    }

    fn store_kind(&self) -> String {
        self.store.kind().to_owned()
    }

    /// The relay's side jobs while its workers run: the registry heartbeat (and the
    /// deregistration on exit), the store sample for the gauges (when this relay is the
    /// sampler), the destination state gauges and the summary log line.
    async fn background(&self, done: &CancellationToken) {
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
    async fn unpark(&self) {
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
    async fn note_pause(&self) -> Result<bool, Error> {
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
            h.in_flight.fetch_add(n as i64, Ordering::Relaxed);
            let stop = self.process(claim, cancel).await;
            h.in_flight.fetch_sub(n as i64, Ordering::Relaxed);
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

    /// Publishes one claim and settles it. Returns true when shutdown grace ran out.
    async fn process(&self, claim: Claim, cancel: &CancellationToken) -> bool {
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
        // their key: one past max_attempts stops its key (`dead_keys`), a malformed row,
        // whose key is not known, every ordered message after it (`stop_after`).
        let strict = cfg.ordering.holds_dead();
        let stop_after = if strict {
            malformed.iter().map(|d| d.id).min().unwrap_or(i64::MAX)
        } else {
            i64::MAX
        };
        let dead_keys: Vec<(String, Option<String>)> = if strict {
            messages
                .iter()
                .filter(|m| m.attempts > policy.max_attempts && cfg.ordering.covers(&m.topic))
                .map(|m| (m.topic.clone(), m.key.clone()))
                .collect()
        } else {
            Vec::new()
        };
        let (mut to_publish, mut dead) = plan(messages, &policy);
        let mut dead_all: Vec<Dead> = malformed;
        dead_all.append(&mut dead);
        let rounds = rounds(&to_publish, &cfg.ordering);
        // Per ordered key of the claim: true once it must not be published further.
        let mut stopped = vec![false; rounds.keys];
        for (m, k) in to_publish.iter().zip(&rounds.key) {
            if let Some(k) = k
                && dead_keys
                    .iter()
                    .any(|(t, key)| *t == m.topic && *key == m.key)
            {
                stopped[*k] = true;
            }
        }
        // One round with nothing held back: the batch goes out as one publish.
        let whole = rounds.of.len() == 1 && dead_keys.is_empty() && stop_after == i64::MAX;
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
                    let mut stopped = stopped;
                    for round in &rounds.of {
                        if cancel.is_cancelled() {
                            break; // the rest is released
                        }
                        let ids: Vec<usize> = round
                            .iter()
                            .copied()
                            .filter(|&i| {
                                to_publish[i].id < stop_after
                                    && rounds.key[i].is_none_or(|k| !stopped[k])
                            })
                            .collect();
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
                        for &i in &ids {
                            if !matches!(confirm.get(i), Some(Ok(())))
                                && let Some(k) = rounds.key[i]
                            {
                                stopped[k] = true;
                            }
                        }
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

    fn lock_failing(&self) -> std::sync::MutexGuard<'_, Failing> {
        self.failing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a failed store call; returns how long this worker backs off.
    fn store_failed(&self, what: &str, e: &Error, began: Instant) -> Duration {
        let mut f = self.lock_failing();
        f.store_error(what, e, began);
        f.delay()
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

/// The live registry row of `relay_id` that another relay instance wrote, if any: not
/// this one (`instance`; another `Relay` of this process counts), and not a process of
/// this host that is gone ([`gone`]).
fn id_holder<'a>(
    relays: &'a [crate::store::RelayRecord],
    relay_id: &str,
    instance: &str,
    host: &str,
) -> Option<&'a crate::store::RelayRecord> {
    relays
        .iter()
        .find(|r| r.relay_id == relay_id && r.instance != instance && !gone(r, host))
}

/// Whether the registry row was written by a process of this host (`host`) that no longer
/// runs: a registry row outlives a `kill -9` by up to its expiry. A row of this pid is
/// gone unless its instance runs in this process (a restarted process may get the pid of
/// the one that died, as a container's first process does); for another pid, `/proc`
/// tells whether it still runs, where there is one.
fn gone(r: &crate::store::RelayRecord, host: &str) -> bool {
    if r.host != host {
        return false;
    }
    if r.pid == i64::from(std::process::id()) {
        return !Running::runs(&r.instance);
    }
    std::path::Path::new("/proc/self").exists()
        && !std::path::Path::new(&format!("/proc/{}", r.pid)).exists()
}

/// The relays running in this process, as (relay id, instance): a second `Relay` of this
/// program under a relay id already running here is refused at once, whatever the
/// registry says (heartbeats off, or the first one's row not written yet).
static RUNNING: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// A relay's entry in [`RUNNING`], removed when its run ends.
struct Running(String);

impl Running {
    /// Enters `instance` under `relay_id`; `Err` when another instance of this process
    /// runs under that id.
    fn enter(relay_id: &str, instance: &str) -> Result<Running, ()> {
        let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        if running
            .iter()
            .any(|(id, i)| id == relay_id && i != instance)
        {
            return Err(());
        }
        running.push((relay_id.to_owned(), instance.to_owned()));
        Ok(Running(instance.to_owned()))
    }

    /// Whether `instance` runs in this process.
    fn runs(instance: &str) -> bool {
        RUNNING
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|(_, i)| i == instance)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        RUNNING
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(_, i)| *i != self.0);
    }
}

/// This host's name (`HOSTNAME`, else `/etc/hostname`, else `localhost`).
fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// The store's outage as this relay sees it, and the claim backoff while it lasts. An
/// outage runs from the start of the first store call that failed (a claim, a settle, a
/// lease renewal or a registry heartbeat) to the first call that succeeded after it; it is
/// logged twice, once when it begins (WARN, with its start) and once when it ends (INFO,
/// with its start, end and length), never once per retry.
#[derive(Default)]
struct Failing {
    /// When the outage began: the monotonic instant (for its length) and the wall clock.
    since: Option<(Instant, chrono::DateTime<chrono::Utc>)>,
    delay: Duration,
}

impl Failing {
    /// A store call that began at `began` failed (the outage is counted from the first
    /// failed call's start, not from when its error arrived).
    fn store_error(&mut self, what: &str, e: &Error, began: Instant) {
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
    fn recovered(&mut self, call_began: Instant) {
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

/// `t` as RFC 3339 with milliseconds, UTC (`2026-12-07T02:53:59.123Z`).
fn rfc3339(t: chrono::DateTime<chrono::Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

async fn sleep_or_cancel(d: Duration, cancel: &CancellationToken) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = cancel.cancelled() => {}
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn msg(id: i64, attempts: i32) -> OutgoingMessage {
        OutgoingMessage {
            id,
            message_id: uuid::Uuid::now_v7(),
            topic: "t.v1".into(),
            key: None,
            payload: bytes::Bytes::from_static(b"x"),
            headers: BTreeMap::new(),
            occurred_at: chrono::Utc::now(),
            attempts,
        }
    }

    const POLICY: Policy = Policy {
        max_attempts: 3,
        backoff_base: Duration::from_secs(1),
        backoff_max: Duration::from_secs(60),
        delete_dispatched: false,
    };

    #[test]
    fn each_message_is_settled_by_its_own_outcome() {
        let batch = [
            msg(1, 1),
            msg(2, 1),
            msg(3, 1),
            msg(4, 3),
            msg(5, 1),
            msg(6, 1),
        ];
        let outcomes = vec![
            Some(Ok(())),
            Some(Err(PublishError::transient("busy"))),
            Some(Err(PublishError::permanent("too large"))),
            Some(Err(PublishError::transient("busy"))),
            Some(Err(
                PublishError::unavailable("down").with_retry_after(Duration::from_secs(2))
            )),
            None,
        ];
        let s = decide(&batch, &outcomes, &[], Ending::Finished, &POLICY);
        assert_eq!(s.dispatched, vec![1]);
        let retried: Vec<(i64, bool)> =
            s.retries.iter().map(|r| (r.id, r.refund_attempt)).collect();
        // 6: the sink gave no outcome on a finished publish: a transient failure.
        assert_eq!(retried, vec![(2, false), (5, true), (6, false)]);
        let unavailable = s.retries.iter().find(|r| r.id == 5).unwrap();
        assert_eq!(unavailable.delay, Duration::from_secs(2));
        let dead: Vec<i64> = s.dead.iter().map(|d| d.id).collect();
        assert_eq!(dead, vec![3, 4]);
        assert!(
            s.dead[1].error.starts_with("gave up after 3 attempts"),
            "{}",
            s.dead[1].error
        );
        assert!(s.release.is_empty());
    }

    #[test]
    fn confirmed_messages_are_marked_when_the_grace_runs_out() {
        let batch = [msg(1, 1), msg(2, 1), msg(3, 1)];
        let outcomes = vec![Some(Ok(())), None, Some(Ok(()))];
        let s = decide(&batch, &outcomes, &[], Ending::Abandoned, &POLICY);
        assert_eq!(s.dispatched, vec![1, 3]);
        assert_eq!(s.release, vec![2]);
        assert!(s.retries.is_empty() && s.dead.is_empty());
    }

    #[test]
    fn a_lost_lease_settles_only_what_was_confirmed() {
        let batch = [msg(1, 1), msg(2, 1)];
        let outcomes = vec![Some(Ok(())), None];
        let s = decide(&batch, &outcomes, &[], Ending::LeaseLost, &POLICY);
        assert_eq!(s.dispatched, vec![1]);
        assert_eq!(s.len(), 1, "{s:?}");
    }

    #[test]
    fn an_unavailable_destination_never_quarantines() {
        // At the last attempt, an outage still gives the attempt back.
        let batch = [msg(1, 3)];
        let outcomes = vec![Some(Err(PublishError::unavailable("down")))];
        let s = decide(&batch, &outcomes, &[], Ending::Finished, &POLICY);
        assert!(s.dead.is_empty());
        assert!(s.retries[0].refund_attempt);
        assert_eq!(s.retries[0].delay, UNAVAILABLE_RETRY);
    }

    #[test]
    fn rows_past_max_attempts_are_quarantined_unpublished() {
        let (publish, dead) = plan(vec![msg(1, 3), msg(2, 4)], &POLICY);
        assert_eq!(publish.iter().map(|m| m.id).collect::<Vec<_>>(), vec![1]);
        assert_eq!(dead.len(), 1);
        assert!(dead[0].error.contains("exceeds max_attempts 3"));
    }

    #[test]
    fn a_transient_retry_honours_retry_after() {
        let batch = [msg(1, 1)];
        let outcomes = vec![Some(Err(
            PublishError::transient("slow down").with_retry_after(Duration::from_secs(30))
        ))];
        let s = decide(&batch, &outcomes, &[], Ending::Finished, &POLICY);
        assert_eq!(s.retries[0].delay, Duration::from_secs(30));
        assert!(!s.retries[0].refund_attempt);
    }

    fn keyed(id: i64, topic: &str, key: Option<&str>) -> OutgoingMessage {
        OutgoingMessage {
            topic: topic.into(),
            key: key.map(str::to_owned),
            ..msg(id, 1)
        }
    }

    #[test]
    fn an_ordered_key_goes_out_one_message_per_round() {
        let ordering = KeyOrdering {
            topics: vec![crate::sink::router::TopicPattern::parse("orders.>").unwrap()],
            skip_dead: false,
        };
        let batch = [
            keyed(1, "orders.placed", Some("a")),
            keyed(2, "orders.placed", Some("b")),
            keyed(3, "orders.placed", Some("a")),
            keyed(4, "orders.placed", None),
            keyed(5, "orders.paid", Some("a")), // another topic: another sequence
            keyed(6, "audit.seen", Some("a")),  // not ordered
            keyed(7, "orders.placed", Some("a")),
            keyed(8, "audit.seen", Some("a")),
        ];
        let r = rounds(&batch, &ordering);
        assert_eq!(r.of, vec![vec![0, 1, 3, 4, 5, 7], vec![2], vec![6]]);
        // Keys: orders.placed/a 0, orders.placed/b 1, orders.paid/a 2.
        assert_eq!(
            r.key,
            vec![
                Some(0),
                Some(1),
                Some(0),
                None,
                Some(2),
                None,
                Some(0),
                None
            ]
        );
        assert_eq!(r.keys, 3);
        // Without ordering, one round.
        let r = rounds(&batch, &KeyOrdering::default());
        assert_eq!(r.of, vec![(0..8).collect::<Vec<_>>()]);
        assert_eq!((r.keys, r.key.iter().flatten().count()), (0, 0));
    }

    #[test]
    fn held_messages_are_released_unless_the_lease_was_lost() {
        let batch = [msg(1, 1), msg(2, 1)];
        let outcomes = vec![Some(Err(PublishError::transient("busy"))), None];
        let s = decide(&batch, &outcomes, &[false, true], Ending::Finished, &POLICY);
        assert_eq!(s.retries.len(), 1);
        assert_eq!(s.release, vec![2]);
        let s = decide(
            &batch,
            &outcomes,
            &[false, true],
            Ending::LeaseLost,
            &POLICY,
        );
        assert!(s.release.is_empty());
    }
}

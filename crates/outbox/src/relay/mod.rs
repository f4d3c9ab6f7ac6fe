//! The relay: claim → publish the batch → record each confirmation → settle the claim in
//! one store call → repeat.
//!
//! Where each guarantee is enforced:
//! - *publish-then-mark*: a row is marked only after its own `Ok` in the batch's
//!   [`Confirmations`](crate::sink::Confirmations) (`decide`); a crash in between leaves
//!   it claimed, and it is published again with the same message id after the lease. A
//!   message confirmed before the publish timeout, the shutdown grace or a lost lease cut
//!   the batch short is still marked: confirmations are per message, never per batch.
//! - *no transaction across a publish*: every store call is one statement (or one short
//!   transaction) that has returned before the sink is called.
//! - *stale claimants*: every update passes the claim token; the store ignores rows whose
//!   token changed, and the relay logs each such lost row with its message id.
//! - *leases hold while a publish is slow but alive*: the claim is renewed every third of
//!   the lease while its batch is in flight; a relay that cannot renew in time stops
//!   waiting for those rows.
//! - *bounded retries*: attempts are counted at claim; past `max_attempts` a row is
//!   quarantined, even if earlier claims never reported back (a message that crashes the
//!   relay). An [`ErrorKind::Unavailable`](crate::sink::ErrorKind::Unavailable) failure
//!   (the destination, not the message) gives the attempt back and waits for the
//!   destination's next probe instead (destination health lives in [`Router`], which
//!   also bounds the refunds of a message that timed out after it was sent).
//! - *idle relays do not spin*: an empty claim waits for the store's wake-up or the poll
//!   interval; while idle only one worker per relay polls.
//!
//! The rooms: `config` (the settings), `scheduler` (the workers: when each claims or
//! waits), `process` (one batch: publish, await the confirmations, settle), `decide` and
//! `rounds` (the pure decisions; `rounds` those of ordered keys), `upkeep` (the background
//! beside the workers), `registry` (the relay id's row and its uniqueness), `health`
//! (counters and health), `failing` (the store's outage as the relay sees it).

mod config;
mod decide;
mod failing;
mod health;
mod process;
mod registry;
mod rounds;
mod scheduler;
mod upkeep;

pub use config::{ConfigError, MAX_RELAY_ID_BYTES, OnDispatch, RelayConfig, default_relay_id};
pub(crate) use decide::{Ending, Policy, decide, plan};
pub use health::{RelayHealth, RelayStats};
pub(crate) use rounds::{DeadStops, KeyStops, rounds};

use crate::error::Error;
use crate::sink::Sink;
use crate::sink::router::Router;
use crate::store::Store;
use failing::Failing;
use health::Counters;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

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
    /// The relay's configuration cannot work: the text of the [`ConfigError`] that
    /// [`RelayConfig::validate`] returned.
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

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("relay_id", &self.config.relay_id)
            .field("instance", &self.instance)
            .field("router", &self.router)
            .finish_non_exhaustive()
    }
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

impl std::fmt::Debug for RelayHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayHandle")
            .field("finished", &self.task.is_finished())
            .finish_non_exhaustive()
    }
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
    /// Run it in a task of a multi-threaded runtime ([`Relay::spawn`], or
    /// `tokio::spawn(relay.run(cancel))`) rather than awaiting it in `main` under
    /// `#[tokio::main]`: `main`'s future is polled on the thread that blocks on the runtime,
    /// not on a worker, so every wake-up from the sockets the workers drive crosses
    /// threads. Measured with the CLI, draining 50,000 rows to JetStream: 4,157 futex calls
    /// and 7,500–8,900 voluntary context switches polled on the main thread, 1,623 and
    /// 1,500–1,800 in a task, about a fifth less CPU.
    ///
    /// # Errors
    /// [`RelayError::Store`] when the store is not migrated or unreachable at start;
    /// [`RelayError::Paused`] in drain mode on a paused outbox; [`RelayError::Config`] for
    /// settings that cannot work.
    pub async fn run(self, cancel: CancellationToken) -> Result<RelayStats, RelayError> {
        let cfg = &self.config;
        cfg.validate()?;
        self.store.check_schema().await?;
        crate::metrics::relay_info(&self.store_kind(), &self.router.describe());
        // Logged once the id is ours: a refused relay never says it started.
        let _running = self.refuse_if_id_taken().await?;
        tracing::info!(relay_id = %cfg.relay_id, sink = %self.router.describe(), batch_size = cfg.batch_size, min_batch_size = cfg.claim_bounds().0, in_flight_batches = cfg.in_flight_batches, ordered = %cfg.ordering, "relay started");
        self.health.turned();
        // Parked rows this relay's ordering does not hold come back before the first
        // claim (so a drain sees them due).
        self.unpark().await;
        let results = self.run_workers(&cancel).await;
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

    fn store_kind(&self) -> String {
        self.store.kind().to_owned()
    }
}

//! The store seam, split by its users: one role trait per kind of caller, so each caller
//! names (and each double implements) only what it uses.
//!
//! | Trait | Serves |
//! |---|---|
//! | [`Relaying`] | the relay's hot path: claim, settle, renew, the pause switch, wake-ups |
//! | [`Maintenance`] | schema and upkeep: `outbox migrate`, retention (`outbox purge`, the inbox's), the relay's parking of held keys |
//! | [`Registry`] | relay processes: the relay's heartbeat, `outbox status` and the dashboard's list of relays |
//! | [`Operations`] | operator actions of the CLI and dashboard: pause, resume, dead letters, replay, the audit |
//! | [`Views`] | read-only views for `outbox status`, the dashboard and the metrics' sampled gauges |
//! | [`SettleShortcuts`] | tests and tools: one-outcome forms of [`Relaying::settle`]; not implemented by stores |
//!
//! A store implements the five role traits; [`Store`] is all five, implemented for every
//! type that implements them. Stores outside this crate are supported: any type may
//! implement the role traits (the integration tests wrap the stores in doubles that do).
//! Code that calls the methods on a concrete type imports the traits
//! (`use outbox::store::prelude::*;`); through an `S: Store` bound or a `dyn Store` they
//! are callable without importing them.

#[cfg(doc)]
use super::PARKED_AT;
use super::{
    Claim, ClaimRequest, CleanupHorizon, Counts, Dead, DeadLetter, DeadSelector, DueHeld, HeldKeys,
    KeyOrdering, Leases, Overview, PauseState, PurgeBatch, RelayHeartbeat, RelayRecord,
    ReplayOutcome, ReplayRecord, ReplayRequest, Retry, Settled, Settlement, lookup, ops,
};
use crate::error::Result;
use crate::topic::TopicPattern;
use async_trait::async_trait;
use std::time::Duration;
use uuid::Uuid;

/// The relay's hot path: what every claim loop calls, from the schema check at start to
/// the wake-ups between claims. Served to the relay ([`crate::Relay`]).
#[async_trait]
pub trait Relaying: Send + Sync + 'static {
    /// The store's kind for metrics and logs: `postgres`, `mysql`, `sqlite` (`custom` for
    /// other implementations).
    fn kind(&self) -> &'static str {
        "custom"
    }

    /// Fails with [`crate::Error::NotMigrated`] unless the schema is at this build's version.
    async fn check_schema(&self) -> Result<()>;

    /// Claims up to `batch_size` due rows in one statement: sets status claimed, a fresh
    /// claim token, `locked_until = now + lease`, and counts the attempt.
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim>;

    /// Writes a claim's whole outcome in one call (one statement where the store allows):
    /// every row changes only while `claim_token = token AND status = claimed`, so a stale
    /// claimant changes nothing. Dispatched rows get `dispatched_at = now()` and their
    /// `last_error` cleared; retries become pending at `now() + delay`; dead rows keep
    /// their error; released rows are due at once with the attempt given back.
    async fn settle(&self, token: Uuid, settlement: &Settlement) -> Result<Settled>;

    /// Deletes the rows `ids` still claimed by `token` (the confirmed rows of
    /// [`Settlement::delete_dispatched`]); returns the ids deleted. A row another claim
    /// holds now is not touched (it is `lost`, as in [`Relaying::settle`]). Each store's
    /// `settle` calls it for a deleting settlement; the default refuses, for stores that
    /// cannot delete on dispatch.
    ///
    /// # Errors
    /// [`crate::Error::InvalidRequest`] by default; database errors.
    async fn delete_claimed(&self, token: Uuid, ids: &[i64]) -> Result<Vec<i64>> {
        let _ = (token, ids);
        Err(crate::Error::InvalidRequest(
            "this store cannot delete rows on dispatch".into(),
        ))
    }

    /// Extends the lease of the rows `ids` still held by `token` to `now() + lease`
    /// (database clock). Returns the ids still held (a row missing from the answer was
    /// lost: its lease ran out and another relay claimed it, or it was settled).
    async fn renew(&self, token: Uuid, ids: &[i64], lease: Duration) -> Result<Vec<i64>>;

    /// Reads the pause switch.
    async fn pause_state(&self) -> Result<PauseState>;

    /// A counter that moves whenever new rows may be due (a `NOTIFY`, a commit seen by the
    /// store). The relay marks it seen before each claim and, when a claim finds nothing,
    /// waits for a change or its poll interval, whichever comes first; so a commit between
    /// the claim and the wait is never missed. Starts the store's watcher on first call.
    /// A broken wake-up channel never fails the relay: it degrades to polling.
    fn wakeups(&self) -> tokio::sync::watch::Receiver<u64>;

    /// True only when the store knows, without running a statement, that no row is
    /// claimable now, paused or not: the wake-up watcher's last look found none due, and
    /// it moves [`Relaying::wakeups`] when that changes. A relay woken by its poll interval
    /// alone skips the claim then. `poll_interval` is how often the caller asks: a watcher
    /// that answers keeps looking at least that often, so a commit waits no longer than
    /// with a claim per poll. False when not known (the default; PostgreSQL and SQLite,
    /// whose claim is one cheap statement). MySQL's probe answers it: an idle relay there
    /// runs the probe and no claim.
    fn nothing_due(&self, poll_interval: std::time::Duration) -> bool {
        let _ = poll_interval;
        false
    }

    /// True when the store runs one writer at a time (SQLite). A relay worker woken while
    /// another is busy then claims at once: its claim fits beside the other's publish,
    /// while the busy worker's next claim waits behind its settle's synced commit. False
    /// (the default): the woken worker leaves the rows to the busy worker's next claim for
    /// a few milliseconds, which on PostgreSQL means fewer, larger claims and a lower p99
    /// (see the user guide's benchmarks, `docs/guide/src/benchmarks.md`).
    fn one_writer(&self) -> bool {
        false
    }
}

/// Schema and upkeep: migrations, retention of dispatched outbox rows and of inbox rows,
/// and the parking of messages that per-key ordering holds behind dead letters. Served to
/// `outbox migrate`, `outbox purge`, `outbox inbox-purge` and the relay's background
/// upkeep.
#[async_trait]
pub trait Maintenance: Send + Sync + 'static {
    /// Creates or upgrades the schema; idempotent and safe to run concurrently.
    async fn migrate(&self) -> Result<()>;

    /// Deletes at most `batch_size` dispatched rows whose `dispatched_at` is older than
    /// `older_than` (database clock), by primary key, in one short transaction. Pending,
    /// claimed and dead rows are never touched. One purger runs at a time per store; the
    /// others get `locked_out`. Call it in a loop until `deleted < batch_size`.
    async fn purge(&self, older_than: Duration, batch_size: u32) -> Result<PurgeBatch>;

    /// Deletes at most `batch_size` inbox rows ([`crate::inbox`]) whose `received_at` is
    /// older than `older_than` (database clock), oldest first, in one statement over the
    /// `received_at` index. Returns how many rows it deleted; call it in a loop until that
    /// is less than `batch_size`. A message whose row is gone is fresh again to its
    /// consumer, so `older_than` must exceed every redelivery window (see
    /// [`crate::inbox::MIN_RETENTION`], which the CLI enforces).
    async fn inbox_purge(&self, older_than: Duration, batch_size: u32) -> Result<u64>;

    /// How many rows [`Maintenance::purge`] with `older_than` would delete now, all
    /// batches together (database clock): what an operator confirms before a large purge.
    async fn count_purgeable(&self, older_than: Duration) -> Result<u64>;

    /// How many rows [`Maintenance::inbox_purge`] with `older_than` would delete now, all
    /// batches together (database clock).
    async fn count_inbox_purgeable(&self, older_than: Duration) -> Result<u64>;

    /// Parks the messages that strict per-key ordering holds behind dead letters: every
    /// pending, due row of an ordered topic (`ordering`) whose key has a dead letter with a
    /// smaller `id` gets `available_at` = [`PARKED_AT`], so it leaves the claim's due range
    /// and no claim reads it again while the key is blocked (a backlog of 200,000 rows
    /// behind one dead letter otherwise cost every claim of every relay seconds). Rows not
    /// due yet are parked by a later call, once due. Returns the rows parked.
    ///
    /// The key's rows come back by [`Operations::replay`] (replayed: at the replayed dead
    /// letter's own time, so it still goes first; discarded or purged: at once), and by
    /// [`Maintenance::unpark_released`] for anything else that released them. Does nothing with
    /// `skip_dead` or no ordered topic. One short transaction per call; one parker at a
    /// time per store (a call while another runs returns 0).
    async fn park_held(&self, ordering: &KeyOrdering) -> Result<u64>;

    /// Gives back the parked messages (`available_at` = [`PARKED_AT`], pending) that no
    /// dead letter holds under `ordering` any more: their topic is not ordered, dead
    /// letters hold nothing (`skip_dead`), or no dead letter of their key comes before
    /// them. They become due now, in `id` order. Returns the rows given back. Reads every
    /// parked row: meant for a relay's start and a slow background interval (the paths
    /// that release a key, [`Operations::replay`] above all, give its rows back themselves).
    /// Waits for a parker at work (PostgreSQL; MySQL up to 10 s, then returns 0).
    async fn unpark_released(&self, ordering: &KeyOrdering) -> Result<u64>;
}

/// The registry of relay processes: written by each relay's heartbeat and clean exit, read
/// by `outbox status`, the dashboard and the relay's own check for a duplicate id.
#[async_trait]
pub trait Registry: Send + Sync + 'static {
    /// Upserts the relay's registry row (`last_seen = now()`, `started_at` on first
    /// write) and deletes rows not seen for an hour.
    async fn heartbeat(&self, beat: &RelayHeartbeat) -> Result<()>;

    /// Deletes the registry row of one relay instance (clean exit, or a process of this
    /// host that is gone); the rows of other instances under the same id stay.
    async fn deregister(&self, relay_id: &str, instance: &str) -> Result<()>;

    /// Registry rows seen within `within` (database clock), oldest first.
    async fn relays(&self, within: Duration) -> Result<Vec<RelayRecord>>;
}

/// Operator actions, audited where they change something: the pause switch, topic pauses,
/// dead letters and their replay. Served to the CLI's commands and the dashboard.
#[async_trait]
pub trait Operations: Send + Sync + 'static {
    /// Pauses (`Some(reason)`) or resumes (`None`) every relay of this store.
    async fn set_pause(&self, reason: Option<&str>) -> Result<()>;

    /// Dead rows matching `selector` (every dead row when it is empty), by primary key,
    /// at most `limit`; payloads only when `with_payload`. Reads the dead index.
    async fn dead_letters(
        &self,
        selector: &DeadSelector,
        limit: u32,
        with_payload: bool,
    ) -> Result<Vec<DeadLetter>>;

    /// Dead rows matching `selector` (every dead row when it is empty).
    async fn count_dead(&self, selector: &DeadSelector) -> Result<u64>;

    /// Replays or discards dead rows in one transaction, audited: one `replays` row (who,
    /// why, the selection, the count; or the one of `append_to`), and each replayed row
    /// gets `status = pending`, `attempts = 0`, `replay_id` and its availability (spread
    /// by `rate_per_s`), keeping its message id. Only dead rows are ever changed: named
    /// ids that are not dead come back in `refused`. A dry run changes nothing.
    ///
    /// # Errors
    /// [`crate::Error::InvalidRequest`] for an empty selector, reason or `by`.
    async fn replay(&self, request: &ReplayRequest) -> Result<ReplayOutcome>;

    /// The audit rows, newest first, at most `limit`.
    async fn replays(&self, limit: u32) -> Result<Vec<ReplayRecord>>;

    /// Pauses topics matching `pattern` (an upsert: pausing again updates reason and by).
    async fn pause_topic(&self, pattern: &TopicPattern, reason: &str, by: &str) -> Result<()>;

    /// Lifts the pause of exactly `pattern`; false when there was none.
    async fn resume_topic(&self, pattern: &str) -> Result<bool>;

    /// Writes an operator's change that is not a replay (a pause, a resume) into the
    /// audit (`replays`, the table [`Operations::replays`] reads) with no rows counted: who,
    /// why, the action (at most 16 bytes: `pause`, `resume`) and what it applied to.
    /// One insert.
    async fn audit(&self, entry: &ops::AuditEntry) -> Result<()>;
}

/// Read-only views of the store for `outbox status`, the dashboard and the metrics'
/// sampled gauges; none of them changes a row.
#[async_trait]
pub trait Views: Send + Sync + 'static {
    /// Row counts by status.
    async fn counts(&self) -> Result<Counts>;

    /// Claimed rows whose lease has not ended on the database clock (`status = 1` and the
    /// lease end after now), and when the last of those leases ends. Expired claims are not
    /// counted: any relay may claim them again. One read-only statement.
    async fn leases(&self) -> Result<Leases>;

    /// The store's overview: counts, due and expired claims, claims by relay, and the
    /// top `top_n` topics of pending and dead rows.
    async fn overview(&self, top_n: u32) -> Result<Overview>;

    /// What strict per-key ordering holds back now: the keys of `ordering`'s topics with a
    /// dead letter, the messages not delivered behind them, and the oldest one's age
    /// (database clock). One statement; meant for the sampled gauges.
    async fn held_keys(&self, ordering: &KeyOrdering) -> Result<HeldKeys>;

    /// What on the database server holds back the cleanup of the outbox's dead row
    /// versions ([`CleanupHorizon`]): the oldest open transaction of another session, and
    /// on PostgreSQL replication slots and prepared transactions. One or two reads of the
    /// server's views (PostgreSQL: `pg_stat_activity`, which shows other roles' sessions
    /// only to a superuser or a member of `pg_read_all_stats`; MySQL/MariaDB:
    /// `information_schema.innodb_trx`, which needs the `PROCESS` privilege); meant for
    /// the sampled gauges and `outbox status`. The default (and SQLite, whose readers are
    /// in other processes' files and not visible to a query) tells nothing.
    async fn cleanup_horizon(&self) -> Result<CleanupHorizon> {
        Ok(CleanupHorizon::default())
    }

    /// What per-key ordering holds back of the rows due now: how many due rows (pending,
    /// or claimed under an expired lease) of `ordering`'s keys wait behind their key's
    /// first row not dispatched (nor dead, with `skip_dead`) because that row is dead or
    /// not due yet (a delayed message, a retry waiting out its backoff, a claim under a
    /// live lease), and how long the oldest of the other due rows has been due. Held
    /// rows wait by design, so an operator's verdict counts only the others as stuck or
    /// behind. With no topic ordered, nothing is held. One statement over the due rows
    /// (a per-key look-up for each of an ordered key): for `outbox status`, not for
    /// sampling.
    async fn due_held_by_order(&self, ordering: &KeyOrdering) -> Result<DueHeld>;

    // The admin dashboard: where a message is, and what was delivered and died per minute.
    /// The rows `query` names, wherever they are in their life (pending, claimed,
    /// dispatched, dead), newest first, at most `limit`. One statement.
    async fn find_messages(
        &self,
        query: &lookup::MessageQuery,
        limit: u32,
    ) -> Result<Vec<lookup::MessageLocation>>;

    /// Rows dispatched and rows that died in each of the last `minutes` minutes (at most
    /// [`lookup::MAX_THROUGHPUT_MINUTES`]; database clock), one entry per minute, oldest
    /// first. Counts rows still kept: dispatched rows deleted at dispatch or purged, and
    /// dead rows replayed or discarded since, are not counted. One statement over the
    /// dispatched and dead indexes.
    async fn throughput(&self, minutes: u32) -> Result<Vec<lookup::MinuteCounts>>;
}

/// One-outcome shortcuts over [`Relaying::settle`], for tests and tools. Not implemented
/// by stores: every [`Relaying`] type has them (a blanket implementation).
#[async_trait]
pub trait SettleShortcuts: Relaying {
    /// Marks confirmed rows dispatched ([`Relaying::settle`] with only `dispatched`). Returns
    /// how many rows changed (rows whose claim was lost are not changed).
    async fn mark_dispatched(&self, token: Uuid, ids: &[i64]) -> Result<u64> {
        let s = Settlement {
            dispatched: ids.to_vec(),
            ..Settlement::default()
        };
        Ok(self.settle(token, &s).await?.changed.len() as u64)
    }

    /// Puts transiently failed rows back to pending with their backoff and error.
    async fn reschedule(&self, token: Uuid, retries: &[Retry]) -> Result<u64> {
        let s = Settlement {
            retries: retries.to_vec(),
            ..Settlement::default()
        };
        Ok(self.settle(token, &s).await?.changed.len() as u64)
    }

    /// Moves rows to dead with their error.
    async fn quarantine(&self, token: Uuid, dead: &[Dead]) -> Result<u64> {
        let s = Settlement {
            dead: dead.to_vec(),
            ..Settlement::default()
        };
        Ok(self.settle(token, &s).await?.changed.len() as u64)
    }

    /// Gives claimed rows back (due now) and gives back the attempt the claim counted.
    async fn release(&self, token: Uuid, ids: &[i64]) -> Result<u64> {
        let s = Settlement {
            release: ids.to_vec(),
            ..Settlement::default()
        };
        Ok(self.settle(token, &s).await?.changed.len() as u64)
    }
}

impl<T: Relaying + ?Sized> SettleShortcuts for T {}

/// The operations a relay, the CLI and the tests need from a store: all five role traits.
///
/// Never implemented by hand: every type that implements [`Relaying`], [`Maintenance`],
/// [`Registry`], [`Operations`] and [`Views`] is a `Store` (a blanket implementation).
/// Implementations in this crate: [`super::postgres::PgStore`], [`super::mysql::MySqlStore`],
/// [`super::sqlite::SqliteStore`], and [`super::AnyStore`] to pick one from a URL.
/// Implementations outside this crate are supported: a type that implements the five role
/// traits (the integration tests wrap the stores in doubles that way) is a `Store` and
/// runs a relay. An `S: Store` bound or a `dyn Store` reaches every method of the five
/// traits without importing them.
///
#[cfg_attr(
    not(feature = "postgres"),
    doc = "[`super::postgres::PgStore`]: crate#features"
)]
#[cfg_attr(
    not(feature = "mysql"),
    doc = "[`super::mysql::MySqlStore`]: crate#features"
)]
#[cfg_attr(
    not(feature = "sqlite"),
    doc = "[`super::sqlite::SqliteStore`]: crate#features"
)]
pub trait Store: Relaying + Maintenance + Registry + Operations + Views {}

impl<T: Relaying + Maintenance + Registry + Operations + Views + ?Sized> Store for T {}

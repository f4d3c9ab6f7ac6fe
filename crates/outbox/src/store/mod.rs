//! The store seam: where messages live, and the operations the relay needs.
//!
//! Every implementation keeps this row lifecycle (ARCHITECTURE.md, "How a message flows"):
//!
//! ```text
//! pending(0) --claim--> claimed(1) --confirmed, mark--> dispatched(2)
//! claimed --transient error--> pending (available_at = now + backoff)
//! claimed --permanent error or attempts > max--> dead(3)
//! claimed --lease expired--> claimable again (attempt already counted)
//! claimed --release on shutdown--> pending (attempt given back)
//! ```
//!
//! Architecture invariants:
//! - every time comparison uses the database clock, never the relay's;
//! - every update after a claim is guarded by `claim_token` and `status = 1`, so a stale
//!   claimant changes nothing;
//! - no method holds a transaction open after it returns.

use crate::error::Result;
use crate::ident::Ident;
use crate::message::OutgoingMessage;
use crate::topic::TopicPattern;
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;
use std::time::Duration;
use uuid::Uuid;

#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
mod common;
pub mod lookup;
#[cfg(feature = "mysql")]
pub mod mysql;
pub mod ops;
#[cfg(feature = "postgres")]
pub mod postgres;
mod seam;
#[cfg(feature = "sqlite")]
pub mod sqlite;

pub use seam::{Maintenance, Operations, Registry, Relaying, SettleShortcuts, Store, Views};

/// The store seam's traits, and the producer's and consumer's ([`crate::events::Enqueue`]:
/// `enqueue_in`, `enqueue_alone`; [`crate::inbox::Inbox`]: `accept_in`), for code that calls
/// them on a concrete store (`use outbox::store::prelude::*;`).
pub mod prelude {
    pub use super::seam::{
        Maintenance, Operations, Registry, Relaying, SettleShortcuts, Store, Views,
    };
    pub use crate::events::Enqueue;
    pub use crate::inbox::Inbox;
}

pub use ops::{
    AuditEntry, ClaimsBy, CleanupHorizon, DeadLetter, DeadSelector, DestinationState,
    OldTransaction, Overview, Refused, RelayHeartbeat, RelayRecord, ReplayAction, ReplayOutcome,
    ReplayRecord, ReplayRequest, TopicPause,
};

/// SQLite's database clock in integer milliseconds (UTC); constant within one statement.
pub(crate) const SQLITE_NOW_MS: &str =
    "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)";

/// How long a relay's registry row counts as alive after its last heartbeat: 15 s (three
/// heartbeats at the relay's 5 s interval).
pub const RELAY_EXPIRY: Duration = Duration::from_secs(15);

/// Row status codes, as stored in the `status` column.
pub mod status {
    /// Waiting to be claimed (possibly not yet available).
    pub const PENDING: i16 = 0;
    /// Claimed by a relay until `locked_until`.
    pub const CLAIMED: i16 = 1;
    /// The sink confirmed it.
    pub const DISPATCHED: i16 = 2;
    /// Quarantined: permanent error or attempts exhausted.
    pub const DEAD: i16 = 3;
}

/// Default limit on payload + topic + key + headers, in bytes (4 MiB).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// The bound on getting a connection from a store's own pool, opening a new one included
/// (TCP connect, TLS, authentication, session setup): 5 s. The first connection a store's
/// `connect` makes, and each (re)connection of the PostgreSQL listener, have the same
/// bound. A call on a connection already established is bounded by the server (for
/// example `statement_timeout`) and by TCP, not by this.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) use crate::error::{Failure, classify};

/// Installs rustls' *ring* provider as the process default (a provider already installed
/// is kept). sqlx builds its TLS client on *ring* itself, but its `verify-ca`/`VERIFY_CA`
/// verifier takes the process default, which rustls cannot choose on its own when a second
/// provider is compiled into the application.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn install_tls_provider() {
    let _ = crate::crypto::ring_provider().install_default();
}

/// A connection idle for this long or longer is pinged before the pool hands it out.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) const PING_AFTER_IDLE: Duration = Duration::from_secs(1);

/// Pool options that ping a connection before handing it out only when it sat idle for
/// [`PING_AFTER_IDLE`] or more (sqlx pings before every acquire by default: one more round
/// trip before each statement of a busy relay). A connection busy until just now is
/// trusted; if the server went away meanwhile, the statement fails as a store error, the
/// relay retries it, and the pool drops the connection.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn ping_when_idle<DB: sqlx::Database>(
    options: sqlx::pool::PoolOptions<DB>,
) -> sqlx::pool::PoolOptions<DB> {
    options
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_AFTER_IDLE {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

/// Runs `connect` (establishing a connection) within [`ACQUIRE_TIMEOUT`].
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn bounded_connect<T>(
    connect: impl std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
) -> Result<T> {
    match tokio::time::timeout(ACQUIRE_TIMEOUT, connect).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(crate::Error::Timeout(ACQUIRE_TIMEOUT)),
    }
}

/// Settings shared by every store.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// PostgreSQL schema, or the SQLite table prefix (`outbox` → `outbox_messages`).
    pub schema: Ident,
    /// Largest message enqueue accepts (payload + topic + key + headers), in bytes.
    pub max_message_bytes: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            schema: Ident::default(),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

/// What a relay asks for when it claims.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// Written to `claimed_by` for operators (host:pid or a name).
    pub relay_id: String,
    /// Most rows to claim at once.
    pub batch_size: u32,
    /// How long the claim holds; after it, other relays may claim the rows again.
    pub lease: Duration,
    /// Topics not to claim besides the stored topic pauses (which every claim honours by
    /// itself): rows whose topic matches one of these stay pending. The relay passes none.
    pub skip_topics: Vec<crate::topic::TopicPattern>,
    /// Per-key ordering: which topics' keyed messages are claimed in id order (none by
    /// default: nothing is held back).
    pub ordering: KeyOrdering,
}

/// Per-key ordering, enforced by the claim itself on every store.
///
/// For a message of an ordered topic with a key, the claim takes it only when every
/// earlier message (smaller `id`) of the same topic and key is dispatched (or deleted), or
/// taken by this same claim, which returns them in `id` order. So while one message of a
/// key is claimed (by any relay), waiting for a retry, not yet available, or dead (unless
/// [`KeyOrdering::skip_dead`]), the later ones of that key stay pending; other keys and
/// unordered topics are not held back. Messages without a key are never held back.
///
/// `id` order is the order in which the inserts were assigned ids: for two transactions
/// writing the same key at once it is not their commit order. A producer that needs
/// strict order writes a key's messages from one transaction at a time (for example under
/// the aggregate's row lock).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeyOrdering {
    /// The ordered topics (empty: no ordering).
    pub topics: Vec<crate::topic::TopicPattern>,
    /// A dead message does not hold back the later ones of its key (the gap stays in the
    /// dead letters): availability over order. Off by default (strict: the key is
    /// blocked until the dead letter is replayed, which delivers it first, or discarded).
    pub skip_dead: bool,
}

/// `none`, or the patterns separated by spaces (with `(skip dead)` when dead letters hold
/// nothing), for logs.
impl std::fmt::Display for KeyOrdering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.topics.is_empty() {
            return f.write_str("none");
        }
        let patterns: Vec<&str> = self.topics.iter().map(|t| t.as_str()).collect();
        write!(f, "{}", patterns.join(" "))?;
        if self.skip_dead {
            f.write_str(" (skip dead)")?;
        }
        Ok(())
    }
}

/// SQL of a pending row (PostgreSQL and SQLite): live (`status` 0, or 1 as rows claimed
/// before their schema version 10 hold it) and holding no claim token. Their claims leave
/// `status` as it is and write only columns no index reads; every release, retry, replay
/// and settle clears the token.
pub(crate) const PENDING_SQL: &str = "status <= 1 AND claim_token IS NULL";
/// SQL of a claimed row (PostgreSQL and SQLite): live and holding a claim token, its lease (`locked_until`) live or
/// expired, until a settle, a release or another claim.
pub(crate) const CLAIMED_SQL: &str = "status <= 1 AND claim_token IS NOT NULL";
/// A row's status as the library names it (0 pending, 1 claimed, 2 dispatched, 3 dead),
/// from its stored `status` and claim token.
pub(crate) const STATE_SQL: &str =
    "(CASE WHEN status <= 1 THEN CASE WHEN claim_token IS NULL THEN 0 ELSE 1 END ELSE status END)";
/// The due rows' lease test (PostgreSQL and SQLite), as a filter to append: a live row is
/// claimable once its `available_at` has passed and it holds no live lease
/// (`locked_until`, the lease end, unset or past). `alias` prefixes the column (`""` or
/// `"m."`), `now` is the store's clock in SQL. Their claims keep a claimed row's `status`
/// and `available_at`, so a claimed row stays where it was in the live index and this
/// test skips it while its lease lasts: a claim reads past the rows in flight (on
/// PostgreSQL, 4,000 leased rows ahead of 1,000 due ones cost under 1 ms).
pub(crate) fn lease_free(alias: &str, now: &str) -> String {
    format!(" AND ({alias}locked_until IS NULL OR {alias}locked_until <= {now})")
}

/// The `available_at` of a parked message ([`Maintenance::park_held`]): 9999-01-01T00:00:00Z,
/// far beyond any real delay, so a parked row is pending but never due. SQLite stores it
/// as [`PARKED_AT_MS`].
pub const PARKED_AT: &str = "9999-01-01T00:00:00Z";

/// [`PARKED_AT`] in milliseconds since the Unix epoch (SQLite's `available_at`).
pub const PARKED_AT_MS: i64 = 253_370_764_800_000;

/// The due rows and what per-key ordering holds back of them ([`Views::due_held_by_order`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DueHeld {
    /// Due rows (pending, or claimed under an expired lease) of ordered keys whose key's
    /// first row not dispatched (nor dead, with `skip_dead`) is another row that is dead
    /// or not due yet: they wait by design.
    pub held: i64,
    /// Seconds the oldest due row that nothing holds has been due (database clock);
    /// `None` when every due row is held, or none is due.
    pub oldest_free_due_s: Option<i64>,
}

/// What strict per-key ordering holds back behind dead letters ([`Views::held_keys`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeldKeys {
    /// Keys (topic and key) of ordered topics with a dead letter: their later messages
    /// wait until it is replayed or discarded.
    pub blocked_keys: i64,
    /// Messages not delivered yet (pending or claimed) behind those dead letters.
    pub held: i64,
    /// Age of the oldest of them in seconds (database clock); `None` when none wait.
    pub oldest_held_age_seconds: Option<i64>,
}

impl KeyOrdering {
    /// True when some topic is ordered.
    pub fn is_on(&self) -> bool {
        !self.topics.is_empty()
    }

    /// True when dead letters hold back their keys: some topic is ordered and
    /// `skip_dead` is off (strict, the default).
    pub fn holds_dead(&self) -> bool {
        self.is_on() && !self.skip_dead
    }

    /// True when `topic` is ordered.
    pub fn covers(&self, topic: &str) -> bool {
        self.topics.iter().any(|t| t.matches(topic))
    }

    /// The ordered topics' regexes ([`crate::topic::TopicPattern::regex`]).
    pub fn regexes(&self) -> Vec<String> {
        self.topics.iter().map(|t| t.regex()).collect()
    }
}

/// A claimed batch: the token that fences every later update, and the rows (by id order).
#[derive(Debug, Clone)]
pub struct Claim {
    /// The claim token written to every row of this claim.
    pub token: Uuid,
    /// The claimed messages, ordered by primary key.
    pub messages: Vec<OutgoingMessage>,
    /// Claimed rows that could not be read as messages (for example headers written by
    /// hand that are not a JSON object of strings). The relay quarantines them with the
    /// reason; they never stop the rest of the batch.
    pub malformed: Vec<Dead>,
    /// The database clock when the claim ran (for enqueue-to-confirm times on the database
    /// clock); `None` when the claim found no rows.
    pub db_now: Option<DateTime<Utc>>,
}

/// A transient failure to reschedule: the row becomes pending again after `delay`
/// (added to the database clock).
#[derive(Debug, Clone, PartialEq)]
pub struct Retry {
    /// Primary key.
    pub id: i64,
    /// Backoff before the row is due again.
    pub delay: Duration,
    /// Error text kept in `last_error` (never the payload).
    pub error: String,
    /// Give back the attempt the claim counted: the failure says nothing about this
    /// message (its destination was unreachable), so it must not bring the message
    /// closer to quarantine.
    pub refund_attempt: bool,
}

/// A row to quarantine, with the reason kept in `last_error`.
#[derive(Debug, Clone, PartialEq)]
pub struct Dead {
    /// Primary key.
    pub id: i64,
    /// Why it was quarantined.
    pub error: String,
}

/// Everything a relay decided about one claim, written by [`Relaying::settle`] in one call.
/// Each id appears at most once across the four lists.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Settlement {
    /// Confirmed by the sink: → dispatched.
    pub dispatched: Vec<i64>,
    /// → pending after their delay, with their error (and the attempt given back when
    /// `refund_attempt`).
    pub retries: Vec<Retry>,
    /// → dead, with their error.
    pub dead: Vec<Dead>,
    /// Given back unpublished (shutdown, a lost lease): → pending, due now, attempt given
    /// back.
    pub release: Vec<i64>,
    /// Delete the `dispatched` rows instead of marking them (the relay's `--on-dispatch
    /// delete`): no history of dispatched messages, and replay only from dead letters.
    /// Retries, dead letters and releases are written as always.
    pub delete_dispatched: bool,
}

impl Settlement {
    /// Rows in the settlement.
    pub fn len(&self) -> usize {
        self.dispatched.len() + self.retries.len() + self.dead.len() + self.release.len()
    }

    /// True when there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every id, in the order dispatched, retries, dead, release.
    pub fn ids(&self) -> Vec<i64> {
        let mut ids = Vec::with_capacity(self.len());
        ids.extend(&self.dispatched);
        ids.extend(self.retries.iter().map(|r| r.id));
        ids.extend(self.dead.iter().map(|d| d.id));
        ids.extend(&self.release);
        ids
    }
}

/// What [`Relaying::settle`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settled {
    /// Rows changed, by primary key, ascending.
    pub changed: Vec<i64>,
    /// Rows of the settlement this claim no longer held (another relay claimed them after
    /// the lease ran out, or they were settled already): nothing was changed for them.
    pub lost: Vec<i64>,
}

/// Row counts by status, as `outbox status --json` prints them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Counts {
    /// Rows waiting (including delayed and backed-off ones).
    pub pending: i64,
    /// Rows under a claim (live or expired lease).
    pub claimed: i64,
    /// Rows the sink confirmed and that retention has not purged yet.
    pub dispatched: i64,
    /// Quarantined rows.
    pub dead: i64,
    /// Seconds since the oldest pending row was enqueued (database clock); `None` when
    /// nothing is pending.
    pub oldest_pending_age_seconds: Option<i64>,
}

/// What one purge batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PurgeBatch {
    /// Dispatched rows deleted.
    pub deleted: u64,
    /// True when another purger holds the purge lock: nothing was deleted, try later.
    pub locked_out: bool,
}

/// Claims whose lease has not ended yet, on the database clock ([`Views::leases`]): rows
/// some relay holds and no other relay can claim until then (a relay that was killed
/// holds its rows until their lease ends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leases {
    /// Claimed rows whose lease ends after the database clock's now.
    pub held: u64,
    /// When the last of those leases ends (database clock); `None` when `held` is 0.
    pub last_ends_at: Option<DateTime<Utc>>,
    /// How long from the database clock's now until `last_ends_at` (millisecond
    /// precision); `None` when `held` is 0.
    pub last_ends_in: Option<Duration>,
}

impl Leases {
    /// From the leases query's row: held rows, last lease end, milliseconds until then.
    pub(crate) fn from_row(
        held: i64,
        last_ends_at: Option<DateTime<Utc>>,
        ms: Option<i64>,
    ) -> Self {
        let held = u64::try_from(held).unwrap_or(0);
        Leases {
            held,
            last_ends_at: last_ends_at.filter(|_| held > 0),
            last_ends_in: ms
                .filter(|_| held > 0)
                .map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
        }
    }
}

/// The pause switch.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PauseState {
    /// True while relays must not publish.
    pub paused: bool,
    /// Why, as given by whoever paused.
    pub reason: Option<String>,
    /// When the switch last changed (database clock).
    pub changed_at: Option<DateTime<Utc>>,
    /// Topic pauses in force (relays skip matching topics; others flow), by pattern in
    /// byte order.
    pub topics: Vec<TopicPause>,
}

/// A store chosen at run time from a database URL.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum AnyStore {
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    Postgres(postgres::PgStore),
    /// SQLite.
    #[cfg(feature = "sqlite")]
    Sqlite(sqlite::SqliteStore),
    /// MySQL / MariaDB.
    #[cfg(feature = "mysql")]
    MySql(mysql::MySqlStore),
}

impl AnyStore {
    /// Connects to `url`: `postgres://…`/`postgresql://…`, `mysql://…`/`mariadb://…`, or
    /// `sqlite://PATH` (the file is
    /// created when missing; `sqlite::memory:` is refused since relays need a shared file).
    ///
    /// # Errors
    /// [`crate::Error::UnsupportedDatabaseUrl`] for other schemes; database errors when the
    /// connection fails.
    pub async fn connect(url: &str, config: StoreConfig) -> Result<Self> {
        #[cfg(feature = "postgres")]
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return Ok(AnyStore::Postgres(
                postgres::PgStore::connect(url, config).await?,
            ));
        }
        #[cfg(feature = "mysql")]
        if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            let url = url.replacen("mariadb://", "mysql://", 1);
            return Ok(AnyStore::MySql(
                mysql::MySqlStore::connect(&url, config).await?,
            ));
        }
        #[cfg(feature = "sqlite")]
        if url.starts_with("sqlite:") && !url.contains(":memory:") {
            return Ok(AnyStore::Sqlite(
                sqlite::SqliteStore::connect(url, config).await?,
            ));
        }
        let _ = config;
        Err(crate::Error::UnsupportedDatabaseUrl(url.to_owned()))
    }

    /// Enqueues `msg` in a transaction of its own. For tools and scripts (the CLI's
    /// `enqueue`); a service enqueues inside the transaction of its business change with
    /// the concrete store's `enqueue`, which is the point of an outbox.
    ///
    /// # Errors
    /// As the concrete store's `enqueue`, plus database errors from begin and commit.
    pub async fn enqueue_alone(&self, msg: &crate::Message) -> Result<crate::Enqueued> {
        use crate::events::Enqueue as _;
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(s) => s.enqueue_alone(msg).await,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(s) => s.enqueue_alone(msg).await,
            #[cfg(feature = "mysql")]
            AnyStore::MySql(s) => s.enqueue_alone(msg).await,
        }
    }

    fn inner(&self) -> &dyn Store {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(s) => s,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(s) => s,
            #[cfg(feature = "mysql")]
            AnyStore::MySql(s) => s,
        }
    }
}

/// Implements a role trait for [`AnyStore`] by forwarding each method to the chosen store
/// (`AnyStore::inner`): `async fn` and plain `fn` methods, signatures as in the trait.
macro_rules! forward {
    ($role:ident {
        $(async fn $name:ident(&self $(, $arg:ident: $ty:ty)*) -> $ret:ty;)*
        $(fn $sname:ident(&self $(, $sarg:ident: $sty:ty)*) -> $sret:ty;)*
    }) => {
        #[async_trait]
        impl $role for AnyStore {
            $(async fn $name(&self $(, $arg: $ty)*) -> $ret {
                self.inner().$name($($arg),*).await
            })*
            $(fn $sname(&self $(, $sarg: $sty)*) -> $sret {
                self.inner().$sname($($sarg),*)
            })*
        }
    };
}

forward!(Relaying {
    async fn check_schema(&self) -> Result<()>;
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim>;
    async fn settle(&self, token: Uuid, settlement: &Settlement) -> Result<Settled>;
    async fn delete_claimed(&self, token: Uuid, ids: &[i64]) -> Result<Vec<i64>>;
    async fn renew(&self, token: Uuid, ids: &[i64], lease: Duration) -> Result<Vec<i64>>;
    async fn pause_state(&self) -> Result<PauseState>;
    fn kind(&self) -> &'static str;
    fn wakeups(&self) -> tokio::sync::watch::Receiver<u64>;
    fn nothing_due(&self, poll_interval: Duration) -> bool;
    fn one_writer(&self) -> bool;
});

forward!(Maintenance {
    async fn migrate(&self) -> Result<()>;
    async fn purge(&self, older_than: Duration, batch_size: u32) -> Result<PurgeBatch>;
    async fn inbox_purge(&self, older_than: Duration, batch_size: u32) -> Result<u64>;
    async fn count_purgeable(&self, older_than: Duration) -> Result<u64>;
    async fn count_inbox_purgeable(&self, older_than: Duration) -> Result<u64>;
    async fn park_held(&self, ordering: &KeyOrdering) -> Result<u64>;
    async fn unpark_released(&self, ordering: &KeyOrdering) -> Result<u64>;
});

forward!(Registry {
    async fn heartbeat(&self, beat: &RelayHeartbeat) -> Result<()>;
    async fn deregister(&self, relay_id: &str, instance: &str) -> Result<()>;
    async fn relays(&self, within: Duration) -> Result<Vec<RelayRecord>>;
});

forward!(Operations {
    async fn set_pause(&self, reason: Option<&str>) -> Result<()>;
    async fn pause_topic(&self, pattern: &TopicPattern, reason: &str, by: &str) -> Result<()>;
    async fn resume_topic(&self, pattern: &str) -> Result<bool>;
    async fn dead_letters(
        &self,
        selector: &DeadSelector,
        limit: u32,
        with_payload: bool
    ) -> Result<Vec<DeadLetter>>;
    async fn count_dead(&self, selector: &DeadSelector) -> Result<u64>;
    async fn replay(&self, request: &ReplayRequest) -> Result<ReplayOutcome>;
    async fn replays(&self, limit: u32) -> Result<Vec<ReplayRecord>>;
    async fn audit(&self, entry: &ops::AuditEntry) -> Result<()>;
});

forward!(Views {
    async fn counts(&self) -> Result<Counts>;
    async fn leases(&self) -> Result<Leases>;
    async fn overview(&self, top_n: u32) -> Result<Overview>;
    async fn held_keys(&self, ordering: &KeyOrdering) -> Result<HeldKeys>;
    async fn due_held_by_order(&self, ordering: &KeyOrdering) -> Result<DueHeld>;
    async fn cleanup_horizon(&self) -> Result<CleanupHorizon>;
    async fn find_messages(
        &self,
        query: &lookup::MessageQuery,
        limit: u32
    ) -> Result<Vec<lookup::MessageLocation>>;
    async fn throughput(&self, minutes: u32) -> Result<Vec<lookup::MinuteCounts>>;
});

/// The message id of row `id`, stored as text (MySQL, SQLite).
///
/// # Errors
/// [`crate::Error::MalformedRow`] naming the row when `text` is not a UUID.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn text_message_id(id: i64, text: &str) -> Result<Uuid> {
    Uuid::parse_str(text).map_err(|e| crate::Error::MalformedRow {
        id,
        reason: format!("message_id {text:?} is not a UUID: {e}"),
    })
}

/// Parses the stored headers JSON (an object of strings) of row `id`.
pub(crate) fn parse_headers(
    id: i64,
    value: serde_json::Value,
) -> Result<std::collections::BTreeMap<String, String>> {
    match value {
        serde_json::Value::Object(map) => map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => Ok((k, s)),
                other => Err(crate::Error::MalformedRow {
                    id,
                    reason: format!("header {k:?} is {other}, not a string"),
                }),
            })
            .collect(),
        other => Err(crate::Error::MalformedRow {
            id,
            reason: format!("headers are {other}, not a JSON object"),
        }),
    }
}

/// `bytes` as text, with U+FFFD for what is not UTF-8: for operators' views of a row whose
/// text may not be UTF-8 (a PostgreSQL `SQL_ASCII` database, SQLite).
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn lossy(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// The `last_error` text for a claimed row that cannot be read as a message.
pub(crate) fn malformed_reason(e: crate::Error) -> String {
    match e {
        crate::Error::MalformedRow { .. } => e.to_string(),
        other => format!("malformed row: {other}"),
    }
}

/// Builds a [`Claim`] from the rows a claim statement returned: each row is decoded on its
/// own (a decoding panic — a driver meeting a value it cannot represent — becomes a
/// malformed row too, so one bad row never takes the relay down), and the messages are
/// ordered by primary key.
pub(crate) fn claim_from_rows<R>(
    token: uuid::Uuid,
    rows: &[R],
    read: fn(&R) -> std::result::Result<OutgoingMessage, Dead>,
    id_of: fn(&R) -> i64,
) -> Claim {
    let mut messages = Vec::with_capacity(rows.len());
    let mut malformed = Vec::new();
    for row in rows {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read(row))) {
            Ok(Ok(m)) => messages.push(m),
            Ok(Err(d)) => malformed.push(d),
            Err(_) => {
                let id = id_of(row);
                malformed.push(Dead {
                    id,
                    error: format!("malformed row {id}: a column could not be decoded"),
                });
            }
        }
    }
    messages.sort_by_key(|m| m.id);
    Claim {
        token,
        messages,
        malformed,
        db_now: None,
    }
}

/// One row of a settlement, flattened for a single statement: id, new status, delay (ms),
/// error (None keeps `last_error`), whether the attempt is given back.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) type SettleRow = (i64, i16, i64, Option<String>, bool);

/// The settlement as rows (see [`SettleRow`]).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn settle_rows(s: &Settlement) -> Vec<SettleRow> {
    let mut rows = Vec::with_capacity(s.len());
    rows.extend(
        s.dispatched
            .iter()
            .map(|&id| (id, status::DISPATCHED, 0, None, false)),
    );
    rows.extend(s.retries.iter().map(|r| {
        (
            r.id,
            status::PENDING,
            millis(r.delay),
            Some(r.error.clone()),
            r.refund_attempt,
        )
    }));
    rows.extend(
        s.dead
            .iter()
            .map(|d| (d.id, status::DEAD, 0, Some(d.error.clone()), false)),
    );
    rows.extend(
        s.release
            .iter()
            .map(|&id| (id, status::PENDING, 0, None, true)),
    );
    rows
}

/// A deleting settlement ([`Settlement::delete_dispatched`]), for every store: the
/// confirmed rows deleted by [`Relaying::delete_claimed`], the rest settled as always; one
/// [`Settled`] over both.
pub(crate) async fn settle_deleting<S: Relaying + ?Sized>(
    store: &S,
    token: Uuid,
    settlement: &Settlement,
) -> Result<Settled> {
    let mut changed = store.delete_claimed(token, &settlement.dispatched).await?;
    let rest = Settlement {
        dispatched: Vec::new(),
        delete_dispatched: false,
        ..settlement.clone()
    };
    if !rest.is_empty() {
        changed.extend(store.settle(token, &rest).await?.changed);
    }
    Ok(settled(settlement, changed))
}

/// `Settled` from the settlement and the ids the store reports changed.
pub(crate) fn settled(s: &Settlement, mut changed: Vec<i64>) -> Settled {
    changed.sort_unstable();
    let lost = s
        .ids()
        .into_iter()
        .filter(|id| changed.binary_search(id).is_err())
        .collect();
    Settled { changed, lost }
}

/// The regex of each stored topic-pause pattern, written again by every `migrate`: for
/// pauses written before the claim matched them in SQL, or before the regex's escaping
/// was what it is now (`<` as `[<]`). A pattern that no longer parses matches nothing
/// (`$^`), so it pauses nothing and `outbox resume --topic` still removes it: one longer
/// than [`crate::sink::router::MAX_PATTERN_BYTES`] (accepted before patterns were
/// bounded) matches no topic anyway, and its regex could be one PostgreSQL refuses as
/// too complex, failing every claim.
pub(crate) fn pause_regexes(patterns: Vec<String>) -> Vec<(String, String)> {
    patterns
        .into_iter()
        .map(|p| {
            let re = pause_regex(&p);
            (p, re)
        })
        .collect()
}

/// The regex of one stored topic-pause pattern (see [`pause_regexes`]).
pub(crate) fn pause_regex(pattern: &str) -> String {
    TopicPattern::parse(pattern).map_or_else(|_| "$^".to_owned(), |t| t.regex())
}

/// A duration in whole milliseconds, saturating, as the stores bind it.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// `Debug` for a store type (a struct whose `inner.config` is its [`StoreConfig`]): its
/// name and schema (or table prefix), never its URL, which may hold a password.
macro_rules! debug_by_schema {
    ($store:ident) => {
        impl std::fmt::Debug for $store {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($store))
                    .field("schema", &self.inner.config.schema.as_str())
                    .finish_non_exhaustive()
            }
        }
    };
}
pub(crate) use debug_by_schema;

/// `x` rounded to the nearest integer, saturating at the ends of `i64` (NaN is 0): the
/// conversion Rust's `as` performs for floats, named here as the one place the stores
/// use it.
#[allow(clippy::cast_possible_truncation)]
pub(crate) fn round_saturating(x: f64) -> i64 {
    x.round() as i64
}

/// A database's epoch seconds (`extract(epoch …)`, microsecond precision) as a time;
/// `None` when out of chrono's range or not finite.
#[cfg(feature = "postgres")]
pub(crate) fn epoch_secs_to_time(secs: f64) -> Option<chrono::DateTime<chrono::Utc>> {
    if !secs.is_finite() {
        return None;
    }
    chrono::DateTime::from_timestamp_micros(round_saturating(secs * 1e6))
}

/// The counts query's row: pending, claimed, dispatched, dead, oldest pending age (s).
pub(crate) type CountsRow = (i64, i64, i64, i64, Option<i64>);

impl From<CountsRow> for Counts {
    fn from((pending, claimed, dispatched, dead, age): CountsRow) -> Self {
        Counts {
            pending,
            claimed,
            dispatched,
            dead,
            oldest_pending_age_seconds: age.map(|a| a.max(0)),
        }
    }
}

/// A store's wake-up counter ([`Relaying::wakeups`]) and the one background task that moves
/// it, started on first use and stopped when the store is dropped.
pub(crate) struct Wakeup {
    counter: std::sync::Arc<tokio::sync::watch::Sender<u64>>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// Moves a [`Wakeup`] counter: new rows may be due.
#[derive(Clone)]
pub(crate) struct Bump(std::sync::Arc<tokio::sync::watch::Sender<u64>>);

impl Bump {
    pub(crate) fn bump(&self) {
        self.0.send_modify(|n| *n = n.wrapping_add(1));
    }
}

impl Wakeup {
    pub(crate) fn new() -> Self {
        Wakeup {
            counter: std::sync::Arc::new(tokio::sync::watch::Sender::new(0)),
            task: std::sync::Mutex::new(None),
        }
    }

    /// Spawns `watch(bump)` unless it already runs (on the current tokio runtime).
    pub(crate) fn start_once<F, Fut>(&self, watch: F)
    where
        F: FnOnce(Bump) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let Ok(mut slot) = self.task.lock() else {
            return;
        };
        if slot.is_none() {
            *slot = Some(tokio::spawn(watch(Bump(self.counter.clone()))));
        }
    }

    /// A handle that moves the counter from outside the watch task (a commit hook).
    #[cfg(feature = "sqlite")]
    pub(crate) fn bumper(&self) -> Bump {
        Bump(self.counter.clone())
    }

    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.counter.subscribe()
    }
}

impl Drop for Wakeup {
    fn drop(&mut self) {
        if let Ok(mut slot) = self.task.lock()
            && let Some(task) = slot.take()
        {
            task.abort();
        }
    }
}

//! PostgreSQL store: schema `outbox` (configurable), claims with `FOR UPDATE SKIP LOCKED`,
//! wake-up by `LISTEN/NOTIFY` with a poll underneath.
//!
//! Supported: PostgreSQL 13 and later (`gen_random_uuid()` in core).

use self::claim::{SKIP_TOPICS_5, claim_ordered_sql, claim_sql, claim_update};
use super::{CLAIMED_SQL, PENDING_SQL, StoreConfig};
use crate::error::Result;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};
use std::sync::Arc;

mod claim;
mod decode;
mod enqueue;
mod error;
mod listen;
mod ops;
mod ordering;
mod registry;
mod replay;
mod schema;
mod settle;
mod views;

/// Schema version this build creates and expects (4: the consumer inbox; 5: `enqueue(...)`
/// skips its header checks for a message without headers; 6: topic pauses carry their
/// regex, so the claim itself honours them; 7: the `messages_key` index of per-key
/// ordering; 8 and 9: the registry's destinations and instances; 10: the claim writes no
/// indexed column, and the table's pages keep room for it).
pub const SCHEMA_VERSION: i64 = 10;

/// SQL text built once per store from the validated schema name.
struct Sql {
    enqueue: SqlStr,
    claim: SqlStr,
    claim_skip: SqlStr,
    claim_ordered: SqlStr,
    claim_ordered_skip_dead: SqlStr,
    settle: SqlStr,
    mark: SqlStr,
    renew: SqlStr,
    pause_state: SqlStr,
    set_pause: SqlStr,
    counts: SqlStr,
    version: SqlStr,
    purge: SqlStr,
    leases: SqlStr,
    inbox_accept: SqlStr,
    inbox_purge: SqlStr,
}

impl Sql {
    fn new(s: &str) -> Self {
        let q = |text: String| AssertSqlSafe(text).into_sql_str();
        Sql {
            enqueue: q(schema_sql(include_str!("sql/enqueue.sql"), s)),
            claim: q(claim_sql(s, "", &claim_update(s))),
            // Extra topics not to claim: $5 is an array of topic regexes.
            claim_skip: q(claim_sql(s, SKIP_TOPICS_5, &claim_update(s))),
            claim_ordered: q(claim_ordered_sql(s, "", false, &claim_update(s))),
            claim_ordered_skip_dead: q(claim_ordered_sql(s, "", true, &claim_update(s))),
            // One statement for a claim's whole outcome (River's
            // `JobSetStateIfRunningMany`), one data-modifying CTE per kind so each keeps
            // the plan the separate statements had: the marks and releases by
            // `id = ANY(..)` on the primary key, the (few) retries and quarantines joined
            // from their arrays. Every row changes only while this claim holds it. (A
            // single UPDATE joined to one unnest of every outcome planned badly at 1,000
            // rows: measured 0.25 x the four separate statements.) The changed ids come
            // back as one array, not a row each: per row, sqlx's row stream cost the
            // relay more instructions than the statement's whole round trip.
            settle: q(schema_sql(include_str!("sql/settle.sql"), s)),
            // The common case, a batch the sink confirmed whole: the plain mark by
            // primary key (no unnest to plan).
            mark: q(schema_sql(include_str!("sql/mark.sql"), s)),
            renew: q(schema_sql(include_str!("sql/renew.sql"), s)),
            pause_state: q(schema_sql(include_str!("sql/pause_state.sql"), s)),
            set_pause: q(schema_sql(include_str!("sql/set_pause.sql"), s)),
            counts: q(format!(
                "SELECT count(*) FILTER (WHERE {PENDING_SQL}),
                        count(*) FILTER (WHERE {CLAIMED_SQL}),
                        count(*) FILTER (WHERE status = 2),
                        count(*) FILTER (WHERE status = 3),
                        floor(extract(epoch FROM now() - min({OCCURRED_AT}) FILTER (WHERE {PENDING_SQL})))::bigint
                 FROM {s}.messages"
            )),
            version: q(schema_sql(include_str!("sql/schema_version.sql"), s)),
            purge: q(schema_sql(include_str!("sql/purge.sql"), s)),
            leases: q(schema_sql(include_str!("sql/leases.sql"), s)),
            // Insert first: a duplicate waits for a concurrent accept to end and then does
            // nothing (no unique-violation exception, so the caller's transaction lives).
            inbox_accept: q(schema_sql(include_str!("sql/inbox_accept.sql"), s)),
            // Oldest first over the received_at index; rows a concurrent purger (or a
            // consumer's accept) holds are skipped, not waited for.
            inbox_purge: q(schema_sql(include_str!("sql/inbox_purge.sql"), s)),
        }
    }
}

struct Inner {
    pool: PgPool,
    config: StoreConfig,
    sql: Sql,
    url: Option<String>,
    wakeup: super::Wakeup,
}

/// The PostgreSQL store. Cheap to clone (an `Arc` inside).
///
/// ```no_run
/// # async fn f() -> Result<(), outbox::Error> {
/// use outbox::{Message, postgres::PgStore, StoreConfig};
/// let store = PgStore::connect("postgres://localhost/app", StoreConfig::default()).await?;
/// let mut tx = store.pool().begin().await?;
/// // ... the business change on &mut *tx ...
/// store.enqueue(&mut tx, &Message::new("orders.order-placed.v1", b"{}".to_vec())).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgStore {
    inner: Arc<Inner>,
}

crate::store::debug_by_schema!(PgStore);

impl PgStore {
    /// Connects a pool of its own to `url` (the relay's connections).
    ///
    /// TLS follows the URL (sqlx's parameters, named as libpq's): `sslmode=disable`,
    /// `prefer` (the default: TLS when the server offers it, its certificate not checked),
    /// `require` (TLS, not checked), `verify-ca` (the chain) or `verify-full` (the chain and
    /// the host name); `sslrootcert=PATH` adds CAs to the system's roots;
    /// `sslcert=PATH&sslkey=PATH` is a client certificate. Without a password in the URL,
    /// `PGPASSWORD` or the password file (`PGPASSFILE`, `~/.pgpass`) supplies it.
    ///
    /// # Errors
    /// Database errors when the connection fails.
    pub async fn connect(url: &str, config: StoreConfig) -> Result<Self> {
        super::install_tls_provider();
        // One direct connection first: an unreachable server or a bad password is
        // reported as itself at once, not as a pool timeout later. sqlx has no connect
        // timeout for PostgreSQL, so the bound is ours: a server that accepts TCP and never
        // answers fails this within ACQUIRE_TIMEOUT.
        let conn =
            super::bounded_connect(<sqlx::PgConnection as sqlx::Connection>::connect(url)).await?;
        sqlx::Connection::close(conn).await?;
        // The pool's acquire_timeout bounds the wait for a connection, opening one included.
        let pool = super::ping_when_idle(PgPoolOptions::new())
            .max_connections(8)
            .acquire_timeout(super::ACQUIRE_TIMEOUT)
            .connect(url)
            .await?;
        let mut store = Self::from_pool(pool, config);
        if let Some(inner) = Arc::get_mut(&mut store.inner) {
            inner.url = Some(url.to_owned());
        }
        Ok(store)
    }

    /// Uses an existing pool (for example the application's). Wake-up by `LISTEN` then
    /// needs [`PgStore::connect`]'s URL; with a pool alone the relay polls.
    pub fn from_pool(pool: PgPool, config: StoreConfig) -> Self {
        let sql = Sql::new(config.schema.as_str());
        PgStore {
            inner: Arc::new(Inner {
                pool,
                config,
                sql,
                url: None,
                wakeup: super::Wakeup::new(),
            }),
        }
    }

    /// The pool this store uses.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The store's settings.
    pub fn config(&self) -> &StoreConfig {
        &self.inner.config
    }

    fn s(&self) -> &str {
        self.inner.config.schema.as_str()
    }
}

/// A statement of `sql/` (each a fixed text but for the schema) with its schema
/// placeholder `{s}` replaced by the schema name `s` (an [`Ident`](crate::Ident), so safe
/// to splice).
fn schema_sql(text: &str, s: &str) -> String {
    text.replace("{s}", s)
}

/// A row's time as read for people and for ages: clamped to the years chrono (and so
/// sqlx's decoding) can represent, -4713 to 262142. PostgreSQL stores later years and
/// `±infinity` in a hand-written row; sqlx panics decoding a time past chrono's range, and
/// `now() - 'infinity'` is an error, so one such row would fail `dead list`, the message
/// look-up and `status` for every row.
macro_rules! shown_time {
    ($col:literal) => {
        concat!(
            "CASE WHEN ", $col, " IS NULL THEN NULL ELSE greatest(least(", $col,
            ", '262142-12-31 00:00:00+00'::timestamptz), '4713-11-24 00:00:00+00 BC'::timestamptz) END"
        )
    };
}
const OCCURRED_AT: &str = shown_time!("occurred_at");
const AVAILABLE_AT: &str = shown_time!("available_at");
/// `available_at` as the views show it: on a claimed row, when its lease ends (the claim
/// keeps the row's own `available_at`; see [`CLAIMED_SQL`](crate::store::CLAIMED_SQL)).
const SHOWN_AVAILABLE_AT: &str = shown_time!(
    "(CASE WHEN status <= 1 AND claim_token IS NOT NULL THEN greatest(available_at, locked_until) ELSE available_at END)"
);
const LOCKED_UNTIL: &str = shown_time!("locked_until");
const DISPATCHED_AT: &str = shown_time!("dispatched_at");

/// The encoding `convert_to(text, …)` is given to read text as UTF-8 bytes: UTF-8, but in a
/// `SQL_ASCII` database (which holds bytes with no encoding to convert from) the bytes as
/// they are stored, for the reader to check.
const UTF8_BYTES: &str =
    "CASE getdatabaseencoding() WHEN 'SQL_ASCII' THEN 'SQL_ASCII' ELSE 'UTF8' END";

//! MySQL / MariaDB store: MariaDB ≥ 10.6 or MySQL ≥ 8.0.13 (`SKIP LOCKED`, expression
//! defaults, stored generated columns). Tested here on MariaDB 10.11.
//!
//! Tables are `{prefix}_messages`, `{prefix}_control`, `{prefix}_schema_migrations`,
//! `{prefix}_replays` (the audit of dead-row replays and discards), `{prefix}_relays` (the
//! relay registry), `{prefix}_topic_pauses` and `{prefix}_inbox` (the consumer inbox) in
//! the connected database, plus the procedures `{prefix}_enqueue(...)` and
//! `{prefix}_inbox_accept(...)`. Times are
//! `DATETIME(6)` in UTC, always from `UTC_TIMESTAMP(6)`, so neither the session time zone
//! nor the relay's clock matters.
//!
//! Locking: the relay's connections use `READ COMMITTED`, where InnoDB takes no gap locks
//! for searches, so claims, marks and purges never block a producer's insert. The claim is
//! one short transaction: `SELECT … FOR UPDATE SKIP LOCKED` over the live-row index, then
//! an `UPDATE` by primary key. InnoDB has no partial indexes: the stored generated column
//! `live_at` (= `available_at` while status ≤ 1, else NULL) and its index play the part of
//! PostgreSQL's partial index, so the claim range never reaches dispatched rows. Dead rows
//! are read by when they died the same way: `dead_at` (= `available_at` while status = 3,
//! else NULL) and its index; being NULL on every live row, it costs the claim path no
//! index writes.

mod claim;
mod enqueue;
mod ops;
mod ordering;
mod probe;
mod registry;
mod replay;
mod retention;
mod schema;
mod settle;
mod statements;
mod views;

pub(crate) use crate::error::codes::mysql::error_number;

use super::StoreConfig;
use crate::error::{Error, Result};
use probe::Quiet;
use sqlx::Executor;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use statements::Sql;
use std::fmt::Write as _;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// Schema version this build creates and expects (2: `{prefix}_enqueue` validates headers
/// as `outbox.enqueue` does on PostgreSQL; 3: dead letters, replays, the relay registry and
/// topic pauses; 4: the consumer inbox, `{prefix}_inbox` and `{prefix}_inbox_accept`; 5:
/// topic pauses carry their regex, so the claim itself honours them; 6: `order_key` and its
/// index, for per-key ordering; 7: the relay registry keeps destinations; 8:
/// `{prefix}_inbox_accept` takes the id's inbox lock, as `MySqlStore::inbox_accept` does).
pub const SCHEMA_VERSION: i64 = 9;

const NOW: &str = "UTC_TIMESTAMP(6)";

/// [`super::PARKED_AT`] as a `DATETIME(6)` literal.
const PARKED: &str = "9999-01-01 00:00:00";

/// Most ids one replay or discard statement names (a replay runs as many as it needs, in
/// one transaction): a large selection never makes a statement over `max_allowed_packet`,
/// and the list stays under MariaDB's `in_predicate_conversion_threshold` (1000), past
/// which an `IN` list becomes a join that may scan, and lock, rows it does not name.
const REPLAY_CHUNK: usize = 500;

/// `column REGEXP ? OR …` over `count` parameters (`FALSE` when `count` is 0).
fn regexp_any(column: &str, count: usize) -> String {
    if count == 0 {
        return "FALSE".to_owned();
    }
    vec![format!("{column} REGEXP ?"); count].join(" OR ")
}

struct Inner {
    pool: MySqlPool,
    config: StoreConfig,
    sql: Sql,
    max_packet: usize,
    wakeup: super::Wakeup,
    quiet: Arc<Quiet>,
}

/// The MySQL / MariaDB store. Cheap to clone.
#[derive(Clone)]
pub struct MySqlStore {
    inner: Arc<Inner>,
}

crate::store::debug_by_schema!(MySqlStore);

/// How many times a statement chosen as an InnoDB deadlock victim is run again before the
/// error is returned (the relay then retries on its own backoff).
const DEADLOCK_ATTEMPTS: u32 = 4;

/// Runs `op` again when InnoDB chose it as a deadlock victim (error 1213). InnoDB rolls the
/// victim's whole transaction back, so a claim, a settle or a purge batch can simply be
/// rerun: MySQL's manual ("How to Minimize and Handle Deadlocks") asks applications to be
/// ready to do so, since even `READ COMMITTED` and single-statement transactions deadlock
/// when their record locks meet in different orders (a claim's `UPDATE` of pending rows,
/// a settle moving rows into the dispatched range, a purge deleting from it).
async fn retry_deadlock<T, F>(mut op: impl FnMut() -> F) -> Result<T>
where
    F: std::future::Future<Output = Result<T>>,
{
    let mut attempt = 1;
    loop {
        match op().await {
            Err(Error::Database(e))
                if attempt < DEADLOCK_ATTEMPTS && error_number(&e) == Some(1213) =>
            {
                // A short, growing, jittered pause so the two victims do not meet again.
                let ms = u64::from(attempt) * 2 + u64::from(rand::random::<u8>() % 5);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                attempt += 1;
            }
            other => return other,
        }
    }
}

impl MySqlStore {
    /// Connects a pool of its own to `url` (`mysql://user:pass@host:port/database`). Its
    /// connections use `READ COMMITTED` and the UTC session time zone.
    ///
    /// TLS follows the URL (sqlx's parameters): `ssl-mode=DISABLED`, `PREFERRED` (the
    /// default: TLS when the server offers it, its certificate not checked), `REQUIRED`
    /// (TLS, not checked), `VERIFY_CA` (the chain) or `VERIFY_IDENTITY` (the chain and the
    /// host name); `ssl-ca=PATH` adds CAs to the system's roots; `ssl-cert=PATH&ssl-key=PATH`
    /// is a client certificate.
    ///
    /// # Errors
    /// Database errors when the connection fails.
    pub async fn connect(url: &str, config: StoreConfig) -> Result<Self> {
        super::install_tls_provider();
        let options = MySqlConnectOptions::from_str(url)?.timezone(Some("+00:00".to_owned()));
        // One direct connection first: an unreachable server or a bad password is
        // reported as itself at once, not as a pool timeout later; bounded by
        // ACQUIRE_TIMEOUT (a server that accepts TCP and never answers fails it).
        let conn = super::bounded_connect(<MySqlConnectOptions as sqlx::ConnectOptions>::connect(
            &options,
        ))
        .await?;
        sqlx::Connection::close(conn).await?;
        // The pool's acquire_timeout bounds the wait for a connection, opening one included.
        let pool = super::ping_when_idle(MySqlPoolOptions::new())
            .max_connections(8)
            .acquire_timeout(super::ACQUIRE_TIMEOUT)
            .after_connect(|conn, _meta| {
                Box::pin(async move {
                    conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                        .await?;
                    Ok(())
                })
            })
            .connect_with(options)
            .await?;
        Self::from_pool(pool, config).await
    }

    /// Uses an existing pool. Give its connections `READ COMMITTED` (see
    /// [`MySqlStore::connect`]) if the relay uses it, or claims may take gap locks.
    ///
    /// # Errors
    /// Database errors reading `max_allowed_packet`.
    pub async fn from_pool(pool: MySqlPool, config: StoreConfig) -> Result<Self> {
        let sql = Sql::new(config.schema.as_str());
        let max_packet: i64 = sqlx::query_scalar(sql.max_packet.clone())
            .fetch_one(&pool)
            .await?;
        Ok(MySqlStore {
            inner: Arc::new(Inner {
                pool,
                config,
                sql,
                max_packet: usize::try_from(max_packet).unwrap_or(usize::MAX),
                wakeup: super::Wakeup::new(),
                quiet: Arc::default(),
            }),
        })
    }

    /// The pool this store uses.
    pub fn pool(&self) -> &MySqlPool {
        &self.inner.pool
    }

    /// The store's settings.
    pub fn config(&self) -> &StoreConfig {
        &self.inner.config
    }
}

// Statements whose text varies per call (id lists: settle, renew) go by the text
// protocol with their values inlined (integers, a UUID we formatted,
// `MySqlStore::text_literal`): a one-off prepared statement ends with `COM_STMT_CLOSE`,
// which the server never answers, so the connection's next command waited for the
// server's delayed ACK (Nagle; sqlx sets no `TCP_NODELAY`): 40 ms per statement, ~90 ms
// per claim.
impl MySqlStore {
    /// `id IN (…)` for ids from the store itself (integers, formatted, never user text).
    fn id_list(ids: &[i64]) -> String {
        let mut s = String::with_capacity(ids.len() * 8);
        for (i, id) in ids.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            let _ = write!(s, "{id}");
        }
        s
    }

    /// `CONVERT(X'…' USING utf8mb4)`: any text as a SQL literal, whatever the `sql_mode`
    /// (hex digits only, nothing to escape).
    fn text_literal(text: &str) -> String {
        let mut s = String::with_capacity(text.len() * 2 + 28);
        s.push_str("CONVERT(X'");
        for b in text.as_bytes() {
            let _ = write!(s, "{b:02x}");
        }
        s.push_str("' USING utf8mb4)");
        s
    }
}

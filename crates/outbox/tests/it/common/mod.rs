//! Shared helpers of the integration tests: the real services on this machine
//! (PostgreSQL, NATS JetStream, SQLite files), per-test isolation (a PostgreSQL schema, a
//! JetStream stream, a temp dir each), a private `nats-server` for outage tests, and small
//! sinks that record what the relay hands them.
//!
//! A missing service is a loud failure that says how to start it, never a skip.

#![allow(clippy::unwrap_used)]

use async_trait::async_trait;
use outbox::message::{Enqueued, Message, OutgoingMessage};
use outbox::postgres::PgStore;
use outbox::sink::Confirmations;
use outbox::sink::{PublishError, Sink};
use outbox::sqlite::SqliteStore;
use outbox::store::prelude::*;
use outbox::{Ident, RelayConfig, Store, StoreConfig};
use sqlx::{AssertSqlSafe, Connection};
use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tempfile::TempDir;
use uuid::Uuid;

/// PostgreSQL of this machine (trust auth); `OUTBOX_TEST_PG_URL` overrides it.
pub(crate) fn pg_url() -> String {
    std::env::var("OUTBOX_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// NATS with JetStream of this machine; `OUTBOX_TEST_NATS_URL` overrides it.
pub(crate) fn nats_url() -> String {
    std::env::var("OUTBOX_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// The `nats-server` binary used for private servers; `OUTBOX_TEST_NATS_SERVER` overrides it.
pub(crate) fn nats_server_bin() -> String {
    std::env::var("OUTBOX_TEST_NATS_SERVER").unwrap_or_else(|_| "/usr/sbin/nats-server".into())
}

/// A short random suffix: lower-case hex, valid in identifiers, stream names and subjects.
pub(crate) fn unique() -> String {
    Uuid::new_v4().simple().to_string()[..12].to_owned()
}

/// Polls `check` every 50 ms until it returns `Ok(())`; panics after `timeout` with `what`
/// and the last state `check` described.
pub(crate) async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let start = Instant::now();
    loop {
        match check().await {
            Ok(()) => return,
            Err(state) if start.elapsed() >= timeout => {
                panic!("timed out after {timeout:?} waiting for {what}; last state: {state}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Waits until the relay behind `handle` has started `n` more claims than when called
/// (each a claim statement, whether it found rows or not): it looked that often.
pub(crate) async fn wait_claims(
    what: &str,
    handle: &outbox::RelayHandle,
    n: u64,
    timeout: Duration,
) {
    let from = handle.stats().claims;
    wait_until(what, timeout, || async move {
        let claims = handle.stats().claims - from;
        if claims >= n {
            Ok(())
        } else {
            Err(format!("{claims}/{n} claims"))
        }
    })
    .await;
}

/// Waits until something accepts TCP connections on 127.0.0.1:`port`.
pub(crate) async fn wait_listening(what: &str, port: u16, timeout: Duration) {
    wait_until(what, timeout, || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    })
    .await;
}

/// Waits until `store` counts `n` dispatched rows.
pub(crate) async fn wait_dispatched(
    what: &str,
    store: &Arc<dyn Store>,
    n: usize,
    timeout: Duration,
) {
    wait_until(what, timeout, || {
        let s = store.clone();
        async move {
            let c = s.counts().await.unwrap();
            if c.dispatched == n as i64 {
                Ok(())
            } else {
                Err(format!("{c:?}"))
            }
        }
    })
    .await;
}

/// Waits until `store` counts `dispatched` dispatched and `dead` dead rows, and none
/// pending or claimed.
pub(crate) async fn wait_settled(
    what: &str,
    store: &Arc<dyn Store>,
    dispatched: i64,
    dead: i64,
    timeout: Duration,
) {
    wait_until(what, timeout, || {
        let s = store.clone();
        async move {
            let c = s.counts().await.unwrap();
            if c.dispatched == dispatched && c.dead == dead && c.pending == 0 && c.claimed == 0 {
                Ok(())
            } else {
                Err(format!("{c:?}"))
            }
        }
    })
    .await;
}

/// An operator's replay or discard (`action`) of the dead letters `ids`, by "alice".
pub(crate) fn replay_ids(
    ids: Vec<i64>,
    action: outbox::store::ReplayAction,
) -> outbox::store::ReplayRequest {
    outbox::store::ReplayRequest {
        selector: outbox::store::DeadSelector {
            ids,
            ..outbox::store::DeadSelector::default()
        },
        action,
        limit: None,
        by: "alice".into(),
        reason: "fixed the consumer".into(),
        rate_per_s: None,
        dry_run: false,
        append_to: None,
    }
}

/// A port nothing listens on right now (for a private broker).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// How long the outage tests keep their broker down: `OUTBOX_TEST_OUTAGE_SECONDS`, 60 s
/// by default.
pub(crate) fn outage_length() -> Duration {
    Duration::from_secs(
        std::env::var("OUTBOX_TEST_OUTAGE_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(60),
    )
}

/// A producer writing one message on `topic` every 100 ms for `length`; returns them.
pub(crate) async fn produce_for<B: crate::store::conformance::Backend>(
    db: Arc<B>,
    topic: String,
    length: Duration,
) -> Vec<Enqueued> {
    let mut all = Vec::new();
    let end = Instant::now() + length;
    while Instant::now() < end {
        all.extend(db.enqueue_all(&messages(&topic, 1)).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    all
}

/// After an outage: nothing quarantined, and no pending row has spent an attempt.
pub(crate) async fn assert_outage_spent_nothing<B: crate::store::conformance::Backend>(db: &B) {
    let rows = db.rows().await;
    assert_eq!(rows.iter().filter(|r| r.status >= 3).count(), 0);
    for r in rows.iter().filter(|r| r.status == 0) {
        assert_eq!(r.attempts, 0, "the outage used up an attempt: {r:?}");
    }
}

/// Relay settings for tests: short waits everywhere, a lease long enough not to expire.
/// Settings not named here keep their defaults.
#[allow(clippy::needless_update)]
pub(crate) fn relay_config(relay_id: &str) -> RelayConfig {
    RelayConfig {
        relay_id: relay_id.to_owned(),
        batch_size: 100,
        lease: Duration::from_secs(30),
        max_attempts: 10,
        poll_interval: Duration::from_millis(100),
        publish_timeout: Duration::from_secs(10),
        backoff_base: Duration::from_millis(50),
        backoff_max: Duration::from_millis(200),
        shutdown_grace: Duration::from_secs(2),
        drain: false,
        ..RelayConfig::default()
    }
}

/// `n` messages on `topic`, payload `payload-<i>`.
pub(crate) fn messages(topic: &str, n: usize) -> Vec<Message> {
    (0..n)
        .map(|i| Message::new(topic, format!("payload-{i}").into_bytes()))
        .collect()
}

// ---------------------------------------------------------------------------------------
// PostgreSQL
// ---------------------------------------------------------------------------------------

/// Connects a plain connection, failing loudly with how to start PostgreSQL.
pub(crate) async fn pg_connect() -> sqlx::PgConnection {
    let url = pg_url();
    match sqlx::PgConnection::connect(&url).await {
        Ok(c) => c,
        Err(e) => panic!(
            "PostgreSQL is not reachable at {url} ({e}). Start it with \
             `pg_ctlcluster 15 main start` (or `service postgresql start`); it must accept \
             trust auth for user postgres and have a database `test` \
             (`createdb -U postgres -h 127.0.0.1 test`). Set OUTBOX_TEST_PG_URL to use another server."
        ),
    }
}

/// Runs `cleanup` to its end on a runtime of its own, on a thread of its own: a guard's
/// `Drop` cannot await, and may run while the test's runtime is unwinding. Best effort:
/// the cleanup's errors are its own to ignore.
pub(crate) fn cleanup_blocking<F>(cleanup: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let _ = std::thread::spawn(move || {
        if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            rt.block_on(cleanup);
        }
    })
    .join();
}

/// A schema of its own for one test; dropped (best effort) when the guard drops, even when
/// the test panicked.
pub(crate) struct PgSchema {
    pub(crate) name: String,
}

impl PgSchema {
    pub(crate) fn new(label: &str) -> Self {
        PgSchema {
            name: format!("t_{label}_{}", unique()),
        }
    }

    pub(crate) fn ident(&self) -> Ident {
        Ident::new(&self.name).unwrap()
    }
}

impl Drop for PgSchema {
    fn drop(&mut self) {
        let name = self.name.clone();
        cleanup_blocking(async move {
            let Ok(mut c) = sqlx::PgConnection::connect(&pg_url()).await else {
                return;
            };
            let _ = sqlx::query("SET lock_timeout = '5s'").execute(&mut c).await;
            let _ = sqlx::query(AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {name} CASCADE"
            )))
            .execute(&mut c)
            .await;
        });
    }
}

/// A migrated PostgreSQL store in a fresh schema.
pub(crate) async fn pg_store(label: &str) -> (PgStore, PgSchema) {
    pg_store_with(label, DEFAULT_MAX).await
}

const DEFAULT_MAX: usize = outbox::store::DEFAULT_MAX_MESSAGE_BYTES;

/// As [`pg_store`] with a message size limit.
pub(crate) async fn pg_store_with(label: &str, max_message_bytes: usize) -> (PgStore, PgSchema) {
    let (store, schema) = pg_store_unmigrated(label, max_message_bytes).await;
    store.migrate().await.unwrap();
    (store, schema)
}

/// A PostgreSQL store over a schema nobody migrated.
pub(crate) async fn pg_store_unmigrated(
    label: &str,
    max_message_bytes: usize,
) -> (PgStore, PgSchema) {
    drop(pg_connect().await); // the loud failure when PostgreSQL is down
    let schema = PgSchema::new(label);
    let config = StoreConfig {
        schema: schema.ident(),
        max_message_bytes,
    };
    let store = PgStore::connect(&pg_url(), config).await.unwrap();
    (store, schema)
}

// ---------------------------------------------------------------------------------------
// MySQL / MariaDB
// ---------------------------------------------------------------------------------------

/// MariaDB of this machine (root, empty password); `OUTBOX_TEST_MYSQL_URL` overrides it.
pub(crate) fn mysql_url() -> String {
    std::env::var("OUTBOX_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// Connects a plain connection, failing loudly with how to start MariaDB.
pub(crate) async fn mysql_connect() -> sqlx::MySqlConnection {
    let url = mysql_url();
    match sqlx::MySqlConnection::connect(&url).await {
        Ok(c) => c,
        Err(e) => panic!(
            "MariaDB is not reachable at {url} ({e}). Start it with \
             `start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd` \
             (Debian package mariadb-server); user root must connect over TCP with an empty \
             password and a database `test` must exist \
             (`mariadb -uroot -e 'CREATE DATABASE IF NOT EXISTS test'`). Set \
             OUTBOX_TEST_MYSQL_URL to use another server."
        ),
    }
}

/// A table prefix of its own for one test (`<prefix>_messages`, …); the tables, the
/// procedure and any `<prefix>_*` table a test made are dropped (best effort) when the guard
/// drops, even when the test panicked.
pub(crate) struct MySqlPrefix {
    pub(crate) name: String,
}

impl MySqlPrefix {
    pub(crate) fn new(label: &str) -> Self {
        MySqlPrefix {
            name: format!("t_{label}_{}", unique()),
        }
    }

    pub(crate) fn ident(&self) -> Ident {
        Ident::new(&self.name).unwrap()
    }
}

impl Drop for MySqlPrefix {
    fn drop(&mut self) {
        let name = self.name.clone();
        cleanup_blocking(async move {
            let Ok(mut c) = sqlx::MySqlConnection::connect(&mysql_url()).await else {
                return;
            };
            let _ = sqlx::query("SET SESSION lock_wait_timeout = 5")
                .execute(&mut c)
                .await;
            let tables: Vec<String> = sqlx::query_scalar(
                "SELECT CAST(table_name AS CHAR) FROM information_schema.tables
             WHERE table_schema = DATABASE() AND table_name LIKE CONCAT(?, '\\_%')",
            )
            .bind(&name)
            .fetch_all(&mut c)
            .await
            .unwrap_or_default();
            for t in tables {
                let _ = sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS `{t}`")))
                    .execute(&mut c)
                    .await;
            }
            for procedure in ["enqueue", "inbox_accept"] {
                let _ = sqlx::query(AssertSqlSafe(format!(
                    "DROP PROCEDURE IF EXISTS {name}_{procedure}"
                )))
                .execute(&mut c)
                .await;
            }
        });
    }
}

// ---------------------------------------------------------------------------------------
// SQLite
// ---------------------------------------------------------------------------------------

/// A migrated SQLite store in a file of a fresh temp dir (kept alive by the returned dir).
pub(crate) async fn sqlite_store() -> (SqliteStore, TempDir) {
    sqlite_store_with(DEFAULT_MAX).await
}

/// As [`sqlite_store`] with a message size limit.
pub(crate) async fn sqlite_store_with(max_message_bytes: usize) -> (SqliteStore, TempDir) {
    let (store, dir) = sqlite_store_unmigrated(max_message_bytes).await;
    store.migrate().await.unwrap();
    (store, dir)
}

/// A SQLite store over a file nobody migrated.
pub(crate) async fn sqlite_store_unmigrated(max_message_bytes: usize) -> (SqliteStore, TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let config = StoreConfig {
        schema: Ident::new("outbox").unwrap(),
        max_message_bytes,
    };
    let store = SqliteStore::connect(&url, config).await.unwrap();
    (store, dir)
}

// ---------------------------------------------------------------------------------------
// NATS
// ---------------------------------------------------------------------------------------

/// Connects to the machine's NATS, failing loudly with how to start it.
pub(crate) async fn nats_connect() -> async_nats::Client {
    let url = nats_url();
    match async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(3))
        .connect(&url)
        .await
    {
        Ok(c) => c,
        Err(e) => panic!(
            "NATS is not reachable at {url} ({e}). Start it with JetStream enabled: \
             `nats-server -js -a 127.0.0.1 -p 4222 -sd /var/lib/nats-server &` \
             (Debian package nats-server). Set OUTBOX_TEST_NATS_URL to use another server."
        ),
    }
}

/// A JetStream stream of one test: name `T<hex>`, subjects `t<hex>.>`, a 2 minute
/// duplicate window. Deleted (best effort) when the guard drops.
pub(crate) struct TestStream {
    pub(crate) name: String,
    /// Subject prefix; publish on `{prefix}.anything`.
    pub(crate) prefix: String,
    url: String,
}

impl TestStream {
    /// Creates the stream on the server at `url` through `client`.
    pub(crate) async fn create(
        client: &async_nats::Client,
        url: &str,
        storage: async_nats::jetstream::stream::StorageType,
    ) -> Self {
        Self::create_with(client, url, storage, Duration::from_secs(120)).await
    }

    /// [`TestStream::create`] with a duplicate window of its own.
    pub(crate) async fn create_with(
        client: &async_nats::Client,
        url: &str,
        storage: async_nats::jetstream::stream::StorageType,
        duplicate_window: Duration,
    ) -> Self {
        let u = unique();
        let name = format!("T{u}");
        let prefix = format!("t{u}");
        let js = async_nats::jetstream::new(client.clone());
        let config = async_nats::jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window,
            storage,
            num_replicas: 1,
            ..Default::default()
        };
        // A server just started may need a moment before JetStream answers.
        let what = format!(
            "JetStream stream {name} created at {url} (is JetStream enabled, `nats-server -js`?)"
        );
        let (js, config) = (&js, &config);
        wait_until(&what, Duration::from_secs(10), || async move {
            js.create_stream(config.clone())
                .await
                .map(drop)
                .map_err(|e| e.to_string())
        })
        .await;
        TestStream {
            name,
            prefix,
            url: url.to_owned(),
        }
    }

    /// On the machine's shared NATS, in memory.
    pub(crate) async fn shared(client: &async_nats::Client) -> Self {
        Self::create(
            client,
            &nats_url(),
            async_nats::jetstream::stream::StorageType::Memory,
        )
        .await
    }

    pub(crate) fn subject(&self, rest: &str) -> String {
        format!("{}.{rest}", self.prefix)
    }

    /// Messages the stream holds now.
    pub(crate) async fn message_count(&self, client: &async_nats::Client) -> u64 {
        let js = async_nats::jetstream::new(client.clone());
        let mut stream = js.get_stream(&self.name).await.unwrap();
        stream.info().await.unwrap().state.messages
    }

    /// Every stored message's `Nats-Msg-Id` header, in stream order.
    pub(crate) async fn msg_ids(&self, client: &async_nats::Client) -> Vec<String> {
        let js = async_nats::jetstream::new(client.clone());
        let mut stream = js.get_stream(&self.name).await.unwrap();
        let state = stream.info().await.unwrap().state.clone();
        let mut out = Vec::new();
        for seq in state.first_sequence..=state.last_sequence {
            if state.messages == 0 {
                break;
            }
            let m = stream.get_raw_message(seq).await.unwrap();
            let id = m
                .headers
                .get("Nats-Msg-Id")
                .map(|v| v.as_str().to_owned())
                .unwrap_or_default();
            out.push(id);
        }
        out
    }
}

impl Drop for TestStream {
    fn drop(&mut self) {
        let name = self.name.clone();
        let url = self.url.clone();
        cleanup_blocking(async move {
            let Ok(Ok(client)) = tokio::time::timeout(
                Duration::from_secs(3),
                async_nats::ConnectOptions::new()
                    .connection_timeout(Duration::from_secs(2))
                    .connect(&url),
            )
            .await
            else {
                return;
            };
            let js = async_nats::jetstream::new(client);
            let _ = tokio::time::timeout(Duration::from_secs(3), js.delete_stream(&name)).await;
        });
    }
}

/// A private `nats-server -js` on a free port with its own store dir, for outage tests.
/// Killed (SIGKILL, by its pid) when stopped or dropped.
pub(crate) struct NatsServer {
    child: Option<Child>,
    pub(crate) port: u16,
    dir: TempDir,
}

impl NatsServer {
    pub(crate) async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let mut s = NatsServer {
            child: None,
            port,
            dir,
        };
        s.restart().await;
        s
    }

    pub(crate) fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// Starts the server (again) on the same port and store dir; waits until it accepts
    /// connections.
    pub(crate) async fn restart(&mut self) {
        assert!(self.child.is_none(), "server already running");
        let bin = nats_server_bin();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap();
        let store = self.dir.path().join("js");
        let child = Command::new(&bin)
            .args(["-js", "-sd"])
            .arg(&store)
            .args(["-p", &self.port.to_string(), "-a", "127.0.0.1"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {bin} ({e}): install NATS with `apt-get install nats-server` or set \
                     OUTBOX_TEST_NATS_SERVER to a nats-server binary (v2.9+)"
                )
            });
        self.child = Some(child);
        let (port, log) = (self.port, self.log_path());
        let child = &mut self.child;
        let what = format!("the private nats-server on port {port} to accept connections");
        wait_until(&what, Duration::from_secs(10), || {
            if let Some(c) = child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                panic!(
                    "private nats-server exited with {status}; log:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            let log = log.clone();
            async move {
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .map(drop)
                    .map_err(|e| {
                        let log = std::fs::read_to_string(&log).unwrap_or_default();
                        format!("{e}; log:\n{log}")
                    })
            }
        })
        .await;
    }

    /// Kills the server (SIGKILL) and waits for it to exit.
    pub(crate) fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub(crate) async fn connect(&self) -> async_nats::Client {
        async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(3))
            .connect(self.url())
            .await
            .unwrap()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---------------------------------------------------------------------------------------
// Sinks
// ---------------------------------------------------------------------------------------

/// How many times each message id was handed to a sink.
pub(crate) type Seen = Arc<Mutex<HashMap<Uuid, u32>>>;

pub(crate) fn record(seen: &Seen, batch: &[OutgoingMessage]) {
    let mut map = seen.lock().unwrap();
    for m in batch {
        *map.entry(m.message_id).or_insert(0) += 1;
    }
}

/// Records every message id it is handed and confirms each at once.
pub(crate) struct RecordingSink {
    pub(crate) seen: Seen,
}

impl RecordingSink {
    pub(crate) fn new() -> (Arc<Self>, Seen) {
        let seen: Seen = Arc::default();
        (Arc::new(RecordingSink { seen: seen.clone() }), seen)
    }
}

#[async_trait]
impl Sink for RecordingSink {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        let results: Vec<Result<(), PublishError>> = async {
            record(&self.seen, batch);
            vec![Ok(()); batch.len()]
        }
        .await;
        for (i, r) in results.into_iter().enumerate() {
            confirm.set(i, r);
        }
    }

    fn describe(&self) -> String {
        "recording".into()
    }
}

/// The machine's NATS through the real sink, waiting at most 2 s for each PubAck.
pub(crate) async fn nats_sink() -> outbox::sink::nats::NatsSink {
    outbox::sink::nats::NatsSink::connect(
        &nats_url(),
        outbox::sink::nats::NatsOptions {
            ack_timeout: Duration::from_secs(2),
        },
    )
    .await
    .unwrap()
}

/// Runs a relay with `cfg` over `store` until it has published one batch through NATS
/// and every message is confirmed, then kills it before it can mark (the crash between
/// confirmation and mark); returns that batch's outcomes, all checked `Ok`.
pub(crate) async fn relay_killed_after_confirmation(
    store: &Arc<dyn Store>,
    cfg: RelayConfig,
) -> Vec<Result<(), PublishError>> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let relay = outbox::Relay::new(
        store.clone(),
        Arc::new(ConfirmThenHang {
            inner: nats_sink().await,
            confirmed: tx,
        }),
        cfg,
    )
    .spawn();
    let results = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("the relay never published")
        .unwrap();
    relay.abort();
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    results
}

/// Publishes through the real NATS sink, reports the confirmations, then hangs forever:
/// the relay never gets to mark, as if it crashed right after the PubAcks arrived.
pub(crate) struct ConfirmThenHang {
    pub(crate) inner: outbox::sink::nats::NatsSink,
    pub(crate) confirmed:
        tokio::sync::mpsc::UnboundedSender<Vec<Result<(), outbox::sink::PublishError>>>,
}

#[async_trait::async_trait]
impl outbox::sink::Sink for ConfirmThenHang {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        let results: Vec<Result<(), outbox::sink::PublishError>> = async {
            let results = self.inner.publish_all(batch).await;
            let _ = self.confirmed.send(results);
            std::future::pending().await
        }
        .await;
        for (i, r) in results.into_iter().enumerate() {
            confirm.set(i, r);
        }
    }

    fn describe(&self) -> String {
        "confirm-then-hang".into()
    }
}

/// Records, then wraps another sink.
pub(crate) struct RecordingWrapper<S> {
    pub(crate) inner: S,
    pub(crate) seen: Seen,
}

#[async_trait]
impl<S: Sink> Sink for RecordingWrapper<S> {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        let results: Vec<Result<(), PublishError>> = async {
            record(&self.seen, batch);
            self.inner.publish_all(batch).await
        }
        .await;
        for (i, r) in results.into_iter().enumerate() {
            confirm.set(i, r);
        }
    }

    async fn close(&self) {
        self.inner.close().await;
    }

    fn describe(&self) -> String {
        format!("recording({})", self.inner.describe())
    }
}

/// Total number of publishes recorded.
pub(crate) fn total(seen: &Seen) -> u32 {
    seen.lock().unwrap().values().sum()
}

// ---------------------------------------------------------------------------------------
// A TCP proxy that can fail on demand
// ---------------------------------------------------------------------------------------

/// What a [`TcpProxy`] does with its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProxyMode {
    /// Forwards bytes both ways.
    Forward,
    /// A server that stopped answering: connections stay open, but nothing is forwarded
    /// (bytes read are held), and new connections are accepted and never answered.
    Stall,
    /// A server that is down: every connection is closed, new ones at once.
    Refuse,
}

/// A TCP proxy on a free local port in front of `upstream`, whose [`ProxyMode`] a test
/// switches (a database outage without stopping the shared database).
pub(crate) struct TcpProxy {
    pub(crate) port: u16,
    mode: Arc<tokio::sync::watch::Sender<ProxyMode>>,
    task: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    pub(crate) async fn start(upstream: (String, u16)) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let mode = Arc::new(tokio::sync::watch::Sender::new(ProxyMode::Forward));
        let m = mode.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let rx = m.subscribe();
                let upstream = upstream.clone();
                let now = *rx.borrow();
                match now {
                    ProxyMode::Refuse => drop(client),
                    ProxyMode::Stall => {
                        // Held until the proxy refuses or goes away.
                        tokio::spawn(async move {
                            let mut rx = rx;
                            let _ = rx.wait_for(|m| *m == ProxyMode::Refuse).await;
                            drop(client);
                        });
                    }
                    ProxyMode::Forward => {
                        tokio::spawn(async move {
                            let Ok(server) =
                                tokio::net::TcpStream::connect((upstream.0.as_str(), upstream.1))
                                    .await
                            else {
                                return;
                            };
                            let (cr, cw) = client.into_split();
                            let (sr, sw) = server.into_split();
                            tokio::join!(pipe(cr, sw, rx.clone()), pipe(sr, cw, rx));
                        });
                    }
                }
            }
        });
        TcpProxy { port, mode, task }
    }

    pub(crate) fn set(&self, mode: ProxyMode) {
        self.mode.send_replace(mode);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.mode.send_replace(ProxyMode::Refuse);
    }
}

/// Copies `from` to `to` while the mode forwards; holds what it read while stalled; ends
/// (closing both) when the mode refuses or either side closes.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut mode: tokio::sync::watch::Receiver<ProxyMode>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = {
            let refused = mode.clone();
            let mut refused = refused;
            tokio::select! {
                r = from.read(&mut buf) => match r {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                },
                _ = refused.wait_for(|m| *m == ProxyMode::Refuse) => return,
            }
        };
        match mode.wait_for(|m| *m != ProxyMode::Stall).await {
            Ok(m) if *m == ProxyMode::Forward => {}
            _ => return,
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A listener on a free local port that accepts every connection and never answers: a
/// server that is up at the TCP level only.
pub(crate) async fn silent_server() -> (u16, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    (port, task)
}

/// Log lines written while the returned guard lives, on this thread (a current-thread
/// runtime's tasks included), as plain text.
pub(crate) fn capture_logs() -> (Arc<Mutex<Vec<u8>>>, tracing::subscriber::DefaultGuard) {
    #[derive(Clone)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Arc::new(Mutex::new(Vec::new()));
    let writer = Buf(buf.clone());
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    (buf, tracing::subscriber::set_default(subscriber))
}

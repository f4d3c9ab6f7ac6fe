//! The store conformance suite (`store/conformance/mod.rs`) on SQLite: each test with a
//! database file in a temp dir of its own (table prefix `outbox`, as documented). Plus the
//! SQLite-only case: an application writing through its own pool while two relays drain.
//!
//! Producers use an application pool of their own, built with
//! `outbox::sqlite::connect_options` as the store documents.

#![allow(clippy::unwrap_used)]

use crate::common::{RecordingSink, relay_config};
use crate::store::conformance::{Backend, Kind, Row, SqlCall, TxOpts, assert_in_source};
use async_trait::async_trait;
use outbox::message::{Enqueued, Message};
use outbox::sqlite::SqliteStore;
use outbox::store::prelude::*;
use outbox::{Ident, Relay, Store, StoreConfig};
use sqlx::sqlite::{SqlitePool, SqlitePoolOptions, SqliteRow};
use sqlx::{AssertSqlSafe, Row as _, Sqlite, Transaction};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tempfile::TempDir;
use uuid::Uuid;

const STORE_SOURCE: &str = include_str!("../../../src/store/sqlite/claim.rs");
const STORE_MOD_SOURCE: &str = include_str!("../../../src/store/mod.rs");

/// The store's clock expression (`NOW_MS` in the store), checked against its source.
const NOW_MS: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)";

const P: &str = "outbox";

pub(crate) struct SqliteBackend {
    pub(crate) store: SqliteStore,
    /// The application's own pool (producers, inspection).
    pub(crate) app: SqlitePool,
    _dir: TempDir,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap()
}

impl SqliteBackend {
    async fn run_tx(
        &self,
        mut tx: Transaction<'_, Sqlite>,
        msgs: &[Message],
        opts: TxOpts,
    ) -> Result<Vec<outbox::Result<Enqueued>>, String> {
        if let Some(id) = opts.business_row {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {P}_orders (id, note) VALUES (?1, 'order')"
            )))
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        }
        crate::store::conformance::enqueue_and_end(&self.store, tx, msgs, opts.end).await
    }
}

fn to_row(r: &SqliteRow) -> Row {
    let uuid = |s: String| Uuid::parse_str(&s).unwrap();
    let us = |v: Option<i64>| v.map(|ms| ms * 1000);
    let headers: String = r.get(5);
    Row {
        id: r.get(0),
        message_id: uuid(r.get(1)),
        topic: r.get(2),
        key: r.get(3),
        payload: r.get(4),
        headers: serde_json::from_str(&headers).unwrap(),
        status: r.get(6),
        attempts: r.get(7),
        claimed_by: r.get(8),
        claim_token: r.get::<Option<String>, _>(9).map(uuid),
        occurred_at: r.get::<i64, _>(10) * 1000,
        available_at: r.get::<i64, _>(11) * 1000,
        locked_until: us(r.get(12)),
        dispatched_at: us(r.get(13)),
        last_error: r.get(14),
    }
}

#[async_trait]
impl Backend for SqliteBackend {
    const KIND: Kind = Kind::Sqlite;
    const SCHEMA_VERSION: i64 = outbox::sqlite::SCHEMA_VERSION;
    const SINGLE_WRITER: bool = true;
    const SQL_ENTRY_CHECKS: bool = false;
    const PLAN_ROWS: u64 = 1_000_000;
    const NOW: &'static str = NOW_MS;
    const TEXT_HOLDS_NUL: bool = true;
    type Database = sqlx::Sqlite;
    type Enqueuer = SqliteStore;

    async fn unmigrated(&self) -> (Arc<dyn Store>, String) {
        let url = format!("sqlite://{}", self._dir.path().join("outbox.db").display());
        let config = StoreConfig {
            schema: Ident::new("none").unwrap(),
            ..StoreConfig::default()
        };
        let store = SqliteStore::connect(&url, config).await.unwrap();
        (Arc::new(store), "none".to_owned())
    }

    async fn create(_label: &str, max_message_bytes: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
        let config = StoreConfig {
            schema: Ident::new(P).unwrap(),
            max_message_bytes,
        };
        let store = SqliteStore::connect(&url, config).await.unwrap();
        store.migrate().await.unwrap();
        let app = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(outbox::sqlite::connect_options(&url).unwrap())
            .await
            .unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {P}_orders (id INTEGER PRIMARY KEY, note TEXT NOT NULL);
             CREATE TABLE {P}_business (message_id TEXT NOT NULL, consumer TEXT NOT NULL)"
        )))
        .execute(&app)
        .await
        .unwrap();
        SqliteBackend {
            store,
            app,
            _dir: dir,
        }
    }

    fn store(&self) -> Arc<dyn Store> {
        Arc::new(self.store.clone())
    }

    async fn try_produce(
        &self,
        msgs: &[Message],
        opts: TxOpts,
    ) -> Result<Vec<outbox::Result<Enqueued>>, String> {
        // SQLite has no session time zone: its clock is UTC milliseconds whatever the
        // producer's zone, which the case checks against the test's own UTC clock.
        let tx = self.app.begin().await.map_err(|e| e.to_string())?;
        self.run_tx(tx, msgs, opts).await
    }

    async fn select_rows(&self, filter: &str) -> Vec<Row> {
        let sql = format!(
            "SELECT id, message_id, topic, key, payload, headers, status, attempts, claimed_by,
                    claim_token, occurred_at, available_at, locked_until, dispatched_at,
                    last_error
             FROM {} WHERE {filter} ORDER BY id",
            self.messages()
        );
        sqlx::query(AssertSqlSafe(sql))
            .fetch_all(&self.app)
            .await
            .unwrap()
            .iter()
            .map(to_row)
            .collect()
    }

    fn before(&self, time: &str, by: Duration) -> String {
        format!("({time} - {})", by.as_millis())
    }

    fn table(&self, name: &str) -> String {
        format!("{P}_{name}")
    }

    /// A claimed row keeps `status` 0 and holds a token (schema version 9).
    fn messages(&self) -> String {
        crate::store::conformance::status_by_token(&self.table("messages"), "INTEGER")
    }

    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.app)
            .await
            .unwrap()
    }

    async fn execute_in(
        &self,
        tx: &mut Transaction<'_, Sqlite>,
        sql: &str,
    ) -> Result<u64, sqlx::Error> {
        let r = sqlx::query(AssertSqlSafe(sql.to_owned()))
            .execute(&mut **tx)
            .await?;
        Ok(r.rows_affected())
    }

    /// The documented plain statement and `changes()`, in the consumer's transaction.
    async fn sql_inbox_accept_in(
        &self,
        tx: &mut Transaction<'_, Sqlite>,
        consumer: &str,
        id: Uuid,
    ) -> Result<bool, String> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {P}_inbox (consumer, message_id) VALUES (?1, ?2)
             ON CONFLICT DO NOTHING"
        )))
        .bind(consumer)
        .bind(id.hyphenated().to_string())
        .execute(&mut **tx)
        .await
        .map_err(|e| e.to_string())?;
        let changes: i64 = sqlx::query_scalar("SELECT changes()")
            .fetch_one(&mut **tx)
            .await
            .map_err(|e| e.to_string())?;
        Ok(changes == 1)
    }

    async fn lock_waiters(&self) -> Option<i64> {
        None
    }

    /// The store's own pool: its connections wait for the write lock in the store's busy
    /// handler (a deferred transaction whose first statement is the accept, a write).
    fn consumer_pool(&self) -> &SqlitePool {
        self.store.pool()
    }

    async fn db_now_us(&self) -> i64 {
        let ms: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT {NOW_MS}")))
            .fetch_one(&self.app)
            .await
            .unwrap();
        ms * 1000
    }

    async fn bulk_insert_dispatched(&self, n: u64, ago: Duration) {
        let tag = &Uuid::new_v4().simple().to_string()[..8];
        sqlx::query(AssertSqlSafe(format!(
            "WITH RECURSIVE seq(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM seq WHERE n < ?1)
             INSERT INTO {P}_messages
                 (message_id, topic, payload, headers, status, attempts, occurred_at,
                  available_at, dispatched_at)
             SELECT printf('%s-0000-7000-8000-%012x', ?2, n), 't.bulk.v1', x'00', '{{}}', 2, 1,
                    t, t, t
             FROM seq, (SELECT {NOW_MS} - ?3 AS t)"
        )))
        .bind(i64::try_from(n).unwrap())
        .bind(tag)
        .bind(ms(ago))
        .execute(&self.app)
        .await
        .unwrap();
    }

    async fn analyze(&self) {
        sqlx::query("ANALYZE").execute(&self.app).await.unwrap();
    }

    async fn assert_claim_uses_live_index(&self) {
        // The claim's subquery, as the store has it ({n} is the store's NOW_MS).
        let template = "SELECT id FROM {p}_messages
                      WHERE status <= 1 AND available_at <= {n}{lease}{skip}
                        AND NOT EXISTS (SELECT 1 FROM {p}_control c WHERE c.id = 1 AND c.paused)
                      ORDER BY available_at, id LIMIT ?4";
        assert_in_source(STORE_SOURCE, template, "src/store/sqlite/claim.rs");
        assert_in_source(
            STORE_MOD_SOURCE,
            &format!("const SQLITE_NOW_MS: &str = {NOW_MS:?};"),
            "src/store/mod.rs",
        );
        let query = template
            .replace("{p}", P)
            .replace("{n}", NOW_MS)
            .replace(
                "{lease}",
                &format!(" AND (locked_until IS NULL OR locked_until <= {NOW_MS})"),
            )
            .replace("{skip}", "")
            .replace("?4", "100");
        let plan: Vec<String> = sqlx::query(AssertSqlSafe(format!("EXPLAIN QUERY PLAN {query}")))
            .fetch_all(&self.app)
            .await
            .unwrap()
            .iter()
            .map(|r| r.get::<String, _>("detail"))
            .collect();
        let plan = plan.join("\n");
        eprintln!("claim plan:\n{plan}");
        assert!(
            plan.contains(&format!("USING INDEX {P}_messages_live"))
                || plan.contains(&format!("USING COVERING INDEX {P}_messages_live")),
            "the claim does not use the live-row index:\n{plan}"
        );
        assert!(
            !plan.contains(&format!("SCAN {P}_messages")),
            "the claim scans the table:\n{plan}"
        );
        assert!(!plan.contains("TEMP B-TREE"), "the claim sorts:\n{plan}");
        // The ordered claim: candidates by the live index, each key's head and fence by
        // the key index.
        let plan = self
            .store
            .explain_ordered_claim(&crate::store::conformance::ordered_plan_request())
            .await
            .unwrap();
        eprintln!("ordered claim plans:\n{plan}");
        for line in [
            format!("SEARCH m USING INDEX {P}_messages_live"),
            format!("SEARCH h USING INDEX {P}_messages_key"),
            format!("SEARCH e USING INDEX {P}_messages_key"),
        ] {
            assert!(
                plan.lines().any(|l| l.starts_with(&line)),
                "no `{line}` in the ordered claim's plans:\n{plan}"
            );
        }
        assert!(
            !plan
                .lines()
                .any(|l| ["SCAN m", "SCAN h", "SCAN e"].contains(&l.trim())),
            "the ordered claim scans the table:\n{plan}"
        );
    }

    async fn hold_write_lock(&self) -> sqlx::Transaction<'static, Self::Database> {
        self.app.begin_with("BEGIN IMMEDIATE").await.unwrap()
    }

    async fn sql_enqueue(&self, calls: &[SqlCall]) -> Result<Vec<i64>, String> {
        // The documented plain INSERT for producers in other languages.
        let mut tx = self.app.begin().await.unwrap();
        let mut out = Vec::new();
        for c in calls {
            let mid = c.message_id.unwrap().hyphenated().to_string();
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {P}_messages (message_id, topic, key, payload, headers)
                 VALUES (?, ?, ?, ?, ?) ON CONFLICT (message_id) DO NOTHING"
            )))
            .bind(&mid)
            .bind(&c.topic)
            .bind(c.key.as_deref())
            .bind(&c.payload)
            .bind(c.headers.to_string())
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
            let id: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT id FROM {P}_messages WHERE message_id = ?"
            )))
            .bind(&mid)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
            out.push(id);
        }
        tx.commit().await.map_err(|e| e.to_string())?;
        Ok(out)
    }

    fn enqueuer(&self) -> &SqliteStore {
        &self.store
    }

    fn app(&self) -> &sqlx::Pool<Self::Database> {
        &self.app
    }
}

crate::store::conformance::conformance_cases!(SqliteBackend);

/// An application writing business rows and their messages through its own pool for ~3 s
/// while two relays drain: the application never sees a busy error, no row is handed to
/// the sink twice, and everything is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn app_writes_while_two_relays_drain() {
    let b = Arc::new(SqliteBackend::create("app", crate::store::conformance::DEFAULT_MAX).await);
    let store = b.store();
    let (sink, seen) = RecordingSink::new();
    let relays: Vec<_> = (0..2)
        .map(|i| {
            Relay::new(
                store.clone(),
                sink.clone(),
                relay_config(&format!("lite-{i}")),
            )
            .spawn()
        })
        .collect();

    let deadline = Instant::now() + Duration::from_secs(3);
    let writers: Vec<_> = (0..2i64)
        .map(|w| {
            let b = b.clone();
            tokio::spawn(async move {
                let (mut ids, mut errors) = (Vec::new(), Vec::new());
                let mut order = w * 1_000_000;
                while Instant::now() < deadline {
                    order += 1;
                    let msgs = vec![
                        Message::new("t.app.v1", format!("{{\"order\":{order}}}")),
                        Message::new("t.app.v1", format!("{{\"audit\":{order}}}")),
                    ];
                    let opts = TxOpts {
                        business_row: Some(order),
                        ..TxOpts::default()
                    };
                    match b.try_produce(&msgs, opts).await {
                        Ok(results) => {
                            for r in results {
                                match r {
                                    Ok(e) => ids.push(e.message_id),
                                    Err(e) => errors.push(e.to_string()),
                                }
                            }
                        }
                        Err(e) => errors.push(e),
                    }
                }
                (order - w * 1_000_000, ids, errors)
            })
        })
        .collect();
    let mut produced = Vec::new();
    let mut orders = 0;
    for w in writers {
        let (n, ids, errors) = w.await.unwrap();
        assert!(errors.is_empty(), "the application saw errors: {errors:?}");
        orders += n;
        produced.extend(ids);
    }
    assert!(orders > 0);
    let all_orders: i64 =
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {P}_orders")))
            .fetch_one(&b.app)
            .await
            .unwrap();
    assert_eq!(all_orders, orders, "every business row committed");
    assert_eq!(produced.len() as i64, 2 * orders);

    let s = store.clone();
    let want = produced.len() as i64;
    crate::common::wait_dispatched(
        "all delivered",
        &s,
        usize::try_from(want).unwrap(),
        Duration::from_secs(20),
    )
    .await;
    let mut stats = Vec::new();
    for r in relays {
        stats.push(r.shutdown().await.unwrap());
    }
    eprintln!("{orders} orders, {want} messages; relays: {stats:?}");
    assert_eq!(
        stats.iter().map(|s| s.claimed).sum::<u64>(),
        want as u64,
        "{stats:?}"
    );
    assert_eq!(
        stats.iter().map(|s| s.lost_claims).sum::<u64>(),
        0,
        "{stats:?}"
    );
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), produced.len());
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        twice.is_empty(),
        "handed to the sink more than once: {twice:?}"
    );
    assert!(produced.iter().all(|id| seen.contains_key(id)));
}

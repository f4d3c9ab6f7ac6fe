//! The store conformance suite (`store/conformance/mod.rs`) on PostgreSQL: each test in a
//! schema of its own (`StoreConfig.schema`), dropped afterwards.

#![allow(clippy::unwrap_used)]

use crate::common::{PgSchema, pg_connect, pg_url};
use crate::store::conformance::{Backend, Kind, Row, SqlCall, TxOpts};
use async_trait::async_trait;
use outbox::message::{Enqueued, Message};
use outbox::postgres::PgStore;
use outbox::store::ClaimRequest;
use outbox::store::prelude::*;
use outbox::{Ident, Store, StoreConfig};
use sqlx::postgres::{PgPool, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Connection, Postgres, Row as _, Transaction};
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

pub(crate) struct PgBackend {
    pub(crate) store: PgStore,
    /// The application's own pool (producers, inspection).
    pub(crate) app: PgPool,
    pub(crate) schema: PgSchema,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap()
}

impl PgBackend {
    fn s(&self) -> &str {
        &self.schema.name
    }

    async fn run_tx(
        &self,
        mut tx: Transaction<'_, Postgres>,
        msgs: &[Message],
        opts: TxOpts,
    ) -> Result<Vec<outbox::Result<Enqueued>>, String> {
        if let Some(id) = opts.business_row {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {}.orders (id, note) VALUES ($1, 'order')",
                self.s()
            )))
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        }
        crate::store::conformance::enqueue_and_end(&self.store, tx, msgs, opts.end).await
    }
}

fn to_row(r: &PgRow) -> Row {
    Row {
        id: r.get(0),
        message_id: r.get(1),
        topic: r.get(2),
        key: r.get(3),
        payload: r.get(4),
        headers: r.get(5),
        status: r.get(6),
        attempts: r.get(7),
        claimed_by: r.get(8),
        claim_token: r.get(9),
        occurred_at: r.get(10),
        available_at: r.get(11),
        locked_until: r.get(12),
        dispatched_at: r.get(13),
        last_error: r.get(14),
    }
}

#[async_trait]
impl Backend for PgBackend {
    const KIND: Kind = Kind::Postgres;
    const SCHEMA_VERSION: i64 = outbox::postgres::SCHEMA_VERSION;
    const SINGLE_WRITER: bool = false;
    const SQL_ENTRY_CHECKS: bool = true;
    const PLAN_ROWS: u64 = 1_000_000;
    const NOW: &'static str = "now()";
    const TEXT_HOLDS_NUL: bool = false;
    type Database = sqlx::Postgres;
    type Enqueuer = PgStore;

    async fn unmigrated(&self) -> (Arc<dyn Store>, String) {
        let name = format!("{}_none", self.schema.name);
        let config = StoreConfig {
            schema: Ident::new(&name).unwrap(),
            ..StoreConfig::default()
        };
        let store = PgStore::connect(&pg_url(), config).await.unwrap();
        (Arc::new(store), name)
    }

    async fn create(label: &str, max_message_bytes: usize) -> Self {
        drop(pg_connect().await); // the loud failure when PostgreSQL is down
        let schema = PgSchema::new(label);
        let config = StoreConfig {
            schema: schema.ident(),
            max_message_bytes,
        };
        let store = PgStore::connect(&pg_url(), config).await.unwrap();
        store.migrate().await.unwrap();
        let app = PgPoolOptions::new()
            .max_connections(8)
            .connect(&pg_url())
            .await
            .unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {s}.orders (id bigint PRIMARY KEY, note text NOT NULL);
             CREATE TABLE {s}.business (message_id uuid NOT NULL, consumer text NOT NULL)",
            s = schema.name
        )))
        .execute(&app)
        .await
        .unwrap();
        PgBackend { store, app, schema }
    }

    fn store(&self) -> Arc<dyn Store> {
        Arc::new(self.store.clone())
    }

    async fn try_produce(
        &self,
        msgs: &[Message],
        opts: TxOpts,
    ) -> Result<Vec<outbox::Result<Enqueued>>, String> {
        if opts.far_time_zone {
            // A producer session of its own, 14 hours ahead of UTC.
            let mut conn = pg_connect().await;
            sqlx::query("SET TIME ZONE 'Pacific/Kiritimati'")
                .execute(&mut conn)
                .await
                .unwrap();
            let offset: i32 = sqlx::query_scalar("SELECT extract(timezone FROM now())::int4")
                .fetch_one(&mut conn)
                .await
                .unwrap();
            assert_eq!(offset, 14 * 3600, "the producer session is at +14:00");
            let tx = conn.begin().await.map_err(|e| e.to_string())?;
            let out = self.run_tx(tx, msgs, opts).await;
            conn.close().await.unwrap();
            out
        } else {
            let tx = self.app.begin().await.map_err(|e| e.to_string())?;
            self.run_tx(tx, msgs, opts).await
        }
    }

    async fn select_rows(&self, filter: &str) -> Vec<Row> {
        let us = |c: &str| format!("(extract(epoch FROM {c}) * 1000000)::int8");
        let sql = format!(
            "SELECT id, message_id, topic, key, payload, headers, status, attempts, claimed_by,
                    claim_token, {}, {}, {}, {}, last_error
             FROM {} WHERE {filter} ORDER BY id",
            us("occurred_at"),
            us("available_at"),
            us("locked_until"),
            us("dispatched_at"),
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
        format!("({time} - interval '{} microseconds')", by.as_micros())
    }

    fn table(&self, name: &str) -> String {
        format!("{}.{name}", self.s())
    }

    /// A claimed row keeps `status` 0 and holds a token (schema version 10).
    fn messages(&self) -> String {
        crate::store::conformance::status_by_token(&self.table("messages"), "smallint")
    }

    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.app)
            .await
            .unwrap()
    }

    async fn execute_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        sql: &str,
    ) -> Result<u64, sqlx::Error> {
        let r = sqlx::query(AssertSqlSafe(sql.to_owned()))
            .execute(&mut **tx)
            .await?;
        Ok(r.rows_affected())
    }

    async fn sql_inbox_accept_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        consumer: &str,
        id: Uuid,
    ) -> Result<bool, String> {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT {}.inbox_accept($1, $2)",
            self.s()
        )))
        .bind(consumer)
        .bind(id)
        .fetch_one(&mut **tx)
        .await
        .map_err(|e| e.to_string())
    }

    async fn lock_waiters(&self) -> Option<i64> {
        let waiting = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE wait_event_type = 'Lock' AND query LIKE $1",
        )
        .bind(format!("%{}.%", self.s()))
        .fetch_one(&self.app)
        .await
        .unwrap();
        Some(waiting)
    }

    async fn db_now_us(&self) -> i64 {
        sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000000)::int8")
            .fetch_one(&self.app)
            .await
            .unwrap()
    }

    async fn bulk_insert_dispatched(&self, n: u64, ago: Duration) {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.messages
                 (message_id, topic, payload, status, attempts, occurred_at, available_at,
                  dispatched_at)
             SELECT gen_random_uuid(), 't.bulk.v1', '\\x00'::bytea, 2, 1, t, t, t
             FROM generate_series(1, $1::int8), (SELECT now() - $2 * interval '1 millisecond' AS t) x",
            self.s()
        )))
        .bind(i64::try_from(n).unwrap())
        .bind(ms(ago))
        .execute(&self.app)
        .await
        .unwrap();
    }

    async fn analyze(&self) {
        sqlx::query(AssertSqlSafe(format!("ANALYZE {}.messages", self.s())))
            .execute(&self.app)
            .await
            .unwrap();
    }

    async fn assert_claim_uses_live_index(&self) {
        // The store's own claim statements, planned with real values.
        let req = ClaimRequest {
            relay_id: "plan".into(),
            batch_size: 100,
            lease: Duration::from_secs(30),
            skip_topics: Vec::new(),
            ordering: Default::default(),
        };
        let plan = self.store.explain_claim(&req).await.unwrap();
        eprintln!("claim plan:\n{plan}");
        // The pause switch and the topic pauses are one-row and tiny tables read by
        // subplans; the messages table must never be scanned.
        assert!(
            !plan.contains("Seq Scan on messages"),
            "the claim scans the table:\n{plan}"
        );
        assert!(
            plan.contains("messages_live"),
            "the claim does not use the live-row index:\n{plan}"
        );
        // The ordered claim: the live rows by the live index, each key's rows by the key
        // index (the head of a candidate's key, the fence of each key claimed).
        let plan = self
            .store
            .explain_claim(&crate::store::conformance::ordered_plan_request())
            .await
            .unwrap();
        eprintln!("ordered claim plan:\n{plan}");
        assert!(
            !plan.contains("Seq Scan on messages"),
            "the ordered claim scans the table:\n{plan}"
        );
        assert!(
            plan.contains("messages_live") && plan.matches("messages_key").count() >= 2,
            "the ordered claim does not read the live and key indexes:\n{plan}"
        );
    }

    async fn hold_write_lock(&self) -> sqlx::Transaction<'static, Self::Database> {
        let mut tx = self.app.begin().await.unwrap();
        sqlx::query(AssertSqlSafe(format!(
            "LOCK TABLE {}.messages IN SHARE MODE",
            self.s()
        )))
        .execute(&mut *tx)
        .await
        .unwrap();
        tx
    }

    async fn sql_enqueue(&self, calls: &[SqlCall]) -> Result<Vec<i64>, String> {
        let mut tx = self.app.begin().await.unwrap();
        let mut out = Vec::new();
        for c in calls {
            let id: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT {}.enqueue($1, $2, $3, $4, $5)",
                self.s()
            )))
            .bind(&c.topic)
            .bind(&c.payload)
            .bind(c.key.as_deref())
            .bind(c.message_id)
            .bind(&c.headers)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
            out.push(id);
        }
        tx.commit().await.map_err(|e| e.to_string())?;
        Ok(out)
    }

    fn enqueuer(&self) -> &PgStore {
        &self.store
    }

    fn app(&self) -> &sqlx::Pool<Self::Database> {
        &self.app
    }
}

crate::store::conformance::conformance_cases!(PgBackend);

/// The unordered claim sets `synchronous_commit = off` for its own transaction only (its
/// effect, one WAL flush less before the publish, shows in the relay bench's latency): on
/// the claim's connection (a pool of one, so the same one) the setting is the server's
/// again afterwards, the claimed row is visible to other sessions at once, and the settle
/// and the ordered claim leave the setting alone too.
#[tokio::test]
async fn postgres_claim_leaves_the_connections_commit_setting_alone() {
    let db = PgBackend::create("asyncclaim", crate::store::conformance::DEFAULT_MAX).await;
    let (pool, store) = one_connection_store(&db).await;
    let setting = |pool: PgPool| async move {
        sqlx::query_scalar::<_, String>("SHOW synchronous_commit")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = setting(pool.clone()).await;
    assert_ne!(before, "off", "the server's own setting is not off");
    let ids: Vec<i64> = db
        .enqueue_all(&[
            Message::new("a.t", b"1".to_vec()),
            Message::new("o.t", b"2".to_vec()).key("k"),
        ])
        .await
        .iter()
        .map(|e| e.id)
        .collect();
    let mut req = ClaimRequest {
        relay_id: "async".into(),
        batch_size: 1,
        lease: Duration::from_secs(30),
        skip_topics: Vec::new(),
        ordering: Default::default(),
    };
    let claim = store.claim(&req).await.unwrap();
    assert_eq!(claim.messages[0].id, ids[0]);
    assert_eq!(setting(pool.clone()).await, before, "after the claim");
    let status: i16 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT status FROM {} WHERE id = $1",
        db.messages()
    )))
    .bind(ids[0])
    .fetch_one(&db.app)
    .await
    .unwrap();
    assert_eq!(status, 1, "the claim is visible to another session at once");
    store.mark_dispatched(claim.token, &[ids[0]]).await.unwrap();
    req.ordering = crate::relay::ordering::ordered("o.>");
    let ordered = store.claim(&req).await.unwrap();
    assert_eq!(ordered.messages[0].id, ids[1]);
    assert_eq!(
        setting(pool.clone()).await,
        before,
        "after the ordered claim"
    );
}

/// A store of `db`'s outbox on a pool of one connection of its own (what one session sees
/// and keeps), and that pool.
async fn one_connection_store(db: &PgBackend) -> (PgPool, PgStore) {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&pg_url())
        .await
        .unwrap();
    let store = PgStore::from_pool(pool.clone(), db.store.config().clone());
    (pool, store)
}

/// A claim writes no indexed column (schema version 10), so PostgreSQL updates every
/// claimed row in place, as a heap-only tuple with no index entry; a lease renewal too.
/// The table's statistics count each such update as HOT.
///
/// Each row is updated twice here. At the schema's fillfactor (50) its page has room for
/// one new version per row; the second fits only once the first's dead version is pruned,
/// which an open transaction elsewhere on the server can prevent (other tests run
/// beside this one). The test's table is filled to 30% so that both versions fit without
/// pruning: what is measured is that no update writes an index entry.
#[tokio::test]
async fn postgres_claim_and_renew_update_rows_in_place() {
    const N: usize = 200;
    let db = PgBackend::create("hotclaim", crate::store::conformance::DEFAULT_MAX).await;
    sqlx::query(AssertSqlSafe(format!(
        "ALTER TABLE {}.messages SET (fillfactor = 30)",
        db.s()
    )))
    .execute(&db.app)
    .await
    .unwrap();
    // One connection, so the statistics it keeps can be flushed on demand.
    let (pool, store) = one_connection_store(&db).await;
    let msgs: Vec<Message> = (0..N)
        .map(|i| Message::new("hot.t", vec![b'x'; 300]).key(format!("k{i}")))
        .collect();
    db.enqueue_all(&msgs).await;
    let stats_sql = format!(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
         WHERE schemaname = '{}' AND relname = 'messages'",
        db.s()
    );
    let stats = || async {
        sqlx::query_as::<_, (i64, i64)>(AssertSqlSafe(stats_sql.clone()))
            .fetch_one(&db.app)
            .await
            .unwrap()
    };
    let flush = || async {
        sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(&pool)
            .await
            .unwrap();
        sqlx::query("SELECT 1").execute(&pool).await.unwrap();
    };
    let (upd0, hot0) = stats().await;
    let claim = store
        .claim(&ClaimRequest {
            relay_id: "hot".into(),
            batch_size: N as u32,
            lease: Duration::from_secs(30),
            skip_topics: Vec::new(),
            ordering: crate::relay::ordering::ordered("other.>"),
        })
        .await
        .unwrap();
    assert_eq!(claim.messages.len(), N);
    let ids: Vec<i64> = claim.messages.iter().map(|m| m.id).collect();
    let renewed = store
        .renew(claim.token, &ids, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(renewed.len(), N);
    flush().await;
    let want = 2 * N as i64;
    crate::common::wait_until(
        "the claim's and the renewal's updates in the statistics",
        Duration::from_secs(20),
        || async {
            let (upd, _) = stats().await;
            if upd - upd0 >= want {
                Ok(())
            } else {
                Err(format!("{} updates so far", upd - upd0))
            }
        },
    )
    .await;
    let (upd, hot) = stats().await;
    assert_eq!(
        (upd - upd0, hot - hot0),
        (want, want),
        "(updates, of which HOT): every claimed and renewed row is updated in place"
    );
}

//! The store conformance suite (`store/conformance/mod.rs`) on MySQL / MariaDB: each test
//! with a table prefix of its own (`StoreConfig.schema` → `<prefix>_messages`, …), whose
//! tables and procedure are dropped afterwards.
//!
//! Producers use an application pool with the server's defaults (`REPEATABLE READ`), as an
//! application would; the store's own pool runs `READ COMMITTED` at `+00:00`.

#![allow(clippy::unwrap_used)]

use crate::common::{MySqlPrefix, mysql_connect, mysql_url};
use crate::store::conformance::{Backend, Kind, Row, SqlCall, TxOpts, assert_in_source};
use async_trait::async_trait;
use outbox::message::{Enqueued, Message};
use outbox::mysql::MySqlStore;
use outbox::store::prelude::*;
use outbox::{Ident, Store, StoreConfig};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions, MySqlRow};
use sqlx::{AssertSqlSafe, Connection, MySql, Row as _, Transaction};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

const STORE_SOURCE: &str = include_str!("../../../src/store/mysql/claim.rs");
const STORE_MOD_SOURCE: &str = include_str!("../../../src/store/mysql/mod.rs");

pub(crate) struct MySqlBackend {
    pub(crate) store: MySqlStore,
    /// The application's own pool (producers, inspection), server-default isolation.
    app: MySqlPool,
    prefix: MySqlPrefix,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap()
}

/// Microseconds since the epoch of a `DATETIME(6)` column holding UTC (independent of the
/// session time zone, unlike `UNIX_TIMESTAMP`).
fn us(col: &str) -> String {
    format!("TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {col})")
}

impl MySqlBackend {
    pub(crate) fn p(&self) -> &str {
        &self.prefix.name
    }

    async fn run_tx(
        &self,
        mut tx: Transaction<'_, MySql>,
        msgs: &[Message],
        opts: TxOpts,
    ) -> Result<Vec<outbox::Result<Enqueued>>, String> {
        if let Some(id) = opts.business_row {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {}_orders (id, note) VALUES (?, 'order')",
                self.p()
            )))
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        }
        crate::store::conformance::enqueue_and_end(&self.store, tx, msgs, opts.end).await
    }
}

fn to_row(r: &MySqlRow) -> Row {
    let uuid = |s: String| Uuid::parse_str(&s).unwrap();
    let headers: String = r.get(5);
    Row {
        id: r.get(0),
        message_id: uuid(r.get(1)),
        topic: r.get(2),
        key: r.get(3),
        payload: r.get(4),
        headers: serde_json::from_str(&headers).unwrap(),
        status: i16::try_from(r.get::<i64, _>(6)).unwrap(),
        attempts: r.get(7),
        claimed_by: r.get(8),
        claim_token: r.get::<Option<String>, _>(9).map(uuid),
        occurred_at: r.get(10),
        available_at: r.get(11),
        locked_until: r.get(12),
        dispatched_at: r.get(13),
        last_error: r.get(14),
    }
}

#[async_trait]
impl Backend for MySqlBackend {
    const KIND: Kind = Kind::MySql;
    const SCHEMA_VERSION: i64 = outbox::mysql::SCHEMA_VERSION;
    const SINGLE_WRITER: bool = false;
    const SQL_ENTRY_CHECKS: bool = true;
    const PLAN_ROWS: u64 = 200_000;
    const NOW: &'static str = "UTC_TIMESTAMP(6)";
    const TEXT_HOLDS_NUL: bool = true;
    type Database = sqlx::MySql;
    type Enqueuer = MySqlStore;

    async fn unmigrated(&self) -> (Arc<dyn Store>, String) {
        let name = format!("{}_none", self.prefix.name);
        let config = StoreConfig {
            schema: Ident::new(&name).unwrap(),
            ..StoreConfig::default()
        };
        let store = MySqlStore::connect(&mysql_url(), config).await.unwrap();
        (Arc::new(store), name)
    }

    async fn create(label: &str, max_message_bytes: usize) -> Self {
        drop(mysql_connect().await); // the loud failure when MariaDB is down
        let prefix = MySqlPrefix::new(label);
        let config = StoreConfig {
            schema: prefix.ident(),
            max_message_bytes,
        };
        let store = MySqlStore::connect(&mysql_url(), config).await.unwrap();
        store.migrate().await.unwrap();
        let app = MySqlPoolOptions::new()
            .max_connections(8)
            .connect(&mysql_url())
            .await
            .unwrap();
        for table in [
            "orders (id BIGINT PRIMARY KEY, note TEXT NOT NULL)",
            "business (message_id CHAR(36) NOT NULL, consumer TEXT NOT NULL, KEY (message_id))",
        ] {
            sqlx::query(AssertSqlSafe(format!(
                "CREATE TABLE {}_{table} ENGINE = InnoDB",
                prefix.name
            )))
            .execute(&app)
            .await
            .unwrap();
        }
        MySqlBackend { store, app, prefix }
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
            // A producer session of its own, 13 hours ahead of UTC.
            let options = MySqlConnectOptions::from_str(&mysql_url())
                .unwrap()
                .timezone(None);
            let mut conn = sqlx::MySqlConnection::connect_with(&options).await.unwrap();
            sqlx::query("SET time_zone = '+13:00'")
                .execute(&mut conn)
                .await
                .unwrap();
            let offset: i64 =
                sqlx::query_scalar("SELECT TIMESTAMPDIFF(MINUTE, UTC_TIMESTAMP(), NOW())")
                    .fetch_one(&mut conn)
                    .await
                    .unwrap();
            assert_eq!(offset, 13 * 60, "the producer session is at +13:00");
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
        let sql = format!(
            "SELECT id, message_id, topic, `key`, payload, headers, CAST(status AS SIGNED),
                    attempts, claimed_by, claim_token, {}, {}, {}, {}, last_error
             FROM {}_messages WHERE {filter} ORDER BY id",
            us("occurred_at"),
            us("available_at"),
            us("locked_until"),
            us("dispatched_at"),
            self.p()
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
        format!("TIMESTAMPADD(MICROSECOND, -{}, {time})", by.as_micros())
    }

    fn table(&self, name: &str) -> String {
        format!("{}_{name}", self.p())
    }

    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.app)
            .await
            .unwrap()
    }

    async fn execute_in(
        &self,
        tx: &mut Transaction<'_, MySql>,
        sql: &str,
    ) -> Result<u64, sqlx::Error> {
        let r = sqlx::query(AssertSqlSafe(sql.to_owned()))
            .execute(&mut **tx)
            .await?;
        Ok(r.rows_affected())
    }

    async fn sql_inbox_accept_in(
        &self,
        tx: &mut Transaction<'_, MySql>,
        consumer: &str,
        id: Uuid,
    ) -> Result<bool, String> {
        let row = sqlx::query(AssertSqlSafe(format!(
            "CALL {}_inbox_accept(?, ?)",
            self.p()
        )))
        .bind(consumer)
        .bind(id.hyphenated().to_string())
        .fetch_one(&mut **tx)
        .await
        .map_err(|e| e.to_string())?;
        let fresh: i64 = row.try_get("fresh").map_err(|e| e.to_string())?;
        Ok(fresh == 1)
    }

    /// Sessions running a statement of this prefix that wait on a row lock (an InnoDB
    /// lock wait; an insert's shows as state `Update`) or on a user lock (`GET_LOCK`, the
    /// inbox's lock of an id).
    async fn lock_waiters(&self) -> Option<i64> {
        let waiting = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST
             WHERE COMMAND <> 'Sleep' AND INFO LIKE ?
               AND (STATE IN ('Update', 'User lock')
                    OR ID IN (SELECT trx_mysql_thread_id FROM information_schema.INNODB_TRX
                              WHERE trx_state = 'LOCK WAIT'))",
        )
        .bind(format!("%{}%", self.p()))
        .fetch_one(&self.app)
        .await
        .unwrap();
        Some(waiting)
    }

    async fn db_now_us(&self) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT {}", us("UTC_TIMESTAMP(6)"))))
            .fetch_one(&self.app)
            .await
            .unwrap()
    }

    async fn bulk_insert_dispatched(&self, n: u64, ago: Duration) {
        // MariaDB's sequence engine (`seq_1_to_N`); message ids unique per call.
        let tag = &Uuid::new_v4().simple().to_string()[..8];
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {p}_messages
                 (message_id, topic, payload, headers, status, attempts, occurred_at,
                  available_at, dispatched_at)
             SELECT CONCAT('{tag}-0000-7000-8000-', LPAD(HEX(seq), 12, '0')), 't.bulk.v1',
                    x'00', '{{}}', 2, 1, t, t, t
             FROM seq_1_to_{n},
                  (SELECT TIMESTAMPADD(MICROSECOND, -? * 1000, UTC_TIMESTAMP(6)) AS t) x",
            p = self.p()
        )))
        .bind(ms(ago))
        .execute(&self.app)
        .await
        .unwrap();
    }

    async fn analyze(&self) {
        sqlx::query(AssertSqlSafe(format!(
            "ANALYZE TABLE {}_messages",
            self.p()
        )))
        .fetch_all(&self.app)
        .await
        .unwrap();
    }

    async fn assert_claim_uses_live_index(&self) {
        // The claim's SELECT, as the store has it ({n} is the store's NOW).
        let template = "SELECT id FROM {p}_messages m
         WHERE live_at <= {NOW}{extra}
           AND NOT EXISTS (SELECT 1 FROM {p}_control c WHERE c.id = 1 AND c.paused)
           AND (NOT EXISTS (SELECT 1 FROM {p}_topic_pauses)
                OR NOT EXISTS (SELECT 1 FROM {p}_topic_pauses tp
                               WHERE tp.regex IS NULL OR m.topic REGEXP tp.regex))
         ORDER BY live_at, id
         LIMIT ?
         FOR UPDATE SKIP LOCKED";
        assert_in_source(STORE_SOURCE, template, "src/store/mysql/claim.rs");
        assert_in_source(
            STORE_MOD_SOURCE,
            "const NOW: &str = \"UTC_TIMESTAMP(6)\";",
            "src/store/mysql/mod.rs",
        );
        let query = template
            .replace("{p}", self.p())
            .replace("{NOW}", "UTC_TIMESTAMP(6)")
            .replace("{extra}", "")
            .replace("LIMIT ?", "LIMIT 100");
        let rows = sqlx::query(AssertSqlSafe(format!("EXPLAIN {query}")))
            .fetch_all(&self.app)
            .await
            .unwrap();
        // The messages table's row of the plan (the pause subqueries read the one-row
        // control table and the topic pauses, each once).
        let row = rows
            .iter()
            .find(|r| r.try_get::<Option<String>, _>("table").unwrap().as_deref() == Some("m"))
            .expect("the messages table in the plan");
        let key: Option<String> = row.try_get("key").unwrap();
        let kind: Option<String> = row.try_get("type").unwrap();
        // MariaDB reports the row estimate as text.
        let estimate: Option<u64> = row
            .try_get::<Option<String>, _>("rows")
            .unwrap()
            .map(|r| r.parse().unwrap());
        let extra: Option<String> = row.try_get("Extra").unwrap();
        let plan = format!("type={kind:?} key={key:?} rows={estimate:?} extra={extra:?}");
        eprintln!("claim plan: {plan}");
        assert_eq!(
            key.as_deref(),
            Some(format!("{}_messages_live", self.p()).as_str()),
            "the claim does not use the live-row index: {plan}"
        );
        assert_eq!(kind.as_deref(), Some("range"), "{plan}");
        assert!(
            estimate.is_some_and(|r| r <= 1_000),
            "the claim reads many rows: {plan}"
        );
        assert!(
            !extra.unwrap_or_default().contains("filesort"),
            "the claim sorts: {plan}"
        );
        // The ordered claim: candidates by the live index (alias m), each key's head (h)
        // and fence (e) by the key index.
        let plan = self
            .store
            .explain_ordered_claim(&crate::store::conformance::ordered_plan_request())
            .await
            .unwrap();
        eprintln!("ordered claim plans:\n{plan}");
        let p = self.p();
        for line in [
            format!("m {p}_messages_live"),
            format!("h {p}_messages_key"),
            format!("e {p}_messages_key"),
        ] {
            assert!(
                plan.lines().any(|l| l == line),
                "no `{line}` in the ordered claim's plans:\n{plan}"
            );
        }
    }

    async fn hold_write_lock(&self) -> sqlx::Transaction<'static, Self::Database> {
        // A row lock on the first row by id that a purge of rows dispatched over an hour ago
        // deletes (it deletes in id order), so the purge waits on it whichever index its
        // plan reads. (A lock on the first dispatched row of any age held up only a purge
        // that walked the primary key: with the dispatched index's range it never waited.)
        let mut tx = self.app.begin().await.unwrap();
        sqlx::query(AssertSqlSafe(format!(
            "SELECT id FROM {}_messages
             WHERE status = 2 AND dispatched_at < TIMESTAMPADD(HOUR, -1, UTC_TIMESTAMP(6))
             ORDER BY id LIMIT 1 FOR UPDATE",
            self.p()
        )))
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        tx
    }

    async fn sql_enqueue(&self, calls: &[SqlCall]) -> Result<Vec<i64>, String> {
        let mut tx = self.app.begin().await.unwrap();
        let mut out = Vec::new();
        for c in calls {
            let row = sqlx::query(AssertSqlSafe(format!(
                "CALL {}_enqueue(?, ?, ?, ?, ?)",
                self.p()
            )))
            .bind(&c.topic)
            .bind(&c.payload)
            .bind(c.key.as_deref())
            .bind(c.message_id.map(|m| m.hyphenated().to_string()))
            .bind(c.headers.to_string())
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
            let id = row
                .try_get::<u64, _>("id")
                .map(|v| i64::try_from(v).unwrap())
                .or_else(|_| row.try_get::<i64, _>("id"))
                .unwrap();
            out.push(id);
        }
        tx.commit().await.map_err(|e| e.to_string())?;
        Ok(out)
    }

    fn enqueuer(&self) -> &MySqlStore {
        &self.store
    }

    fn app(&self) -> &sqlx::Pool<Self::Database> {
        &self.app
    }
}

crate::store::conformance::conformance_cases!(MySqlBackend);

//! `outbox::transaction`: a serialization failure (or deadlock) forced on the first attempt
//! commits on the second, with exactly one business row and one outbox row; an error a
//! retry cannot fix is not retried; a conflict on every attempt gives up. PostgreSQL,
//! MariaDB and SQLite.

#![allow(clippy::unwrap_used)]

use crate::common::{MySqlPrefix, mysql_url, pg_store};
use outbox::store::prelude::*;
use outbox::transaction::{RetryPolicy, TransactionError, transaction, transaction_with};
use outbox::{Message, StoreConfig};
use sqlx::AssertSqlSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

const FAST: RetryPolicy = RetryPolicy {
    max_attempts: 3,
    base: Duration::from_millis(1),
    max: Duration::from_millis(5),
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_serialization_failure_is_retried_once() {
    let (store, schema) = pg_store("txretry").await;
    let s = schema.ident().as_str().to_owned();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {s}.orders (id uuid PRIMARY KEY)"
    )))
    .execute(store.pool())
    .await
    .unwrap();
    let order = uuid::Uuid::now_v7();
    let attempts = Arc::new(AtomicU32::new(0));
    transaction(store.pool(), |tx| {
        let (store, attempts) = (store.clone(), attempts.clone());
        let s = s.clone();
        Box::pin(async move {
            let n = attempts.fetch_add(1, Ordering::SeqCst) + 1;
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {s}.orders (id) VALUES ($1)"
            )))
            .bind(order)
            .execute(&mut **tx)
            .await?;
            let msg = Message::new("orders.order-placed.v1", b"{}".to_vec()).message_id(order);
            store.enqueue(tx, &msg).await?;
            if n == 1 {
                // What a SERIALIZABLE transaction that lost a conflict gets.
                sqlx::raw_sql(
                    "DO $$ BEGIN RAISE EXCEPTION 'forced' USING ERRCODE = '40001'; END $$",
                )
                .execute(&mut **tx)
                .await?;
            }
            Ok::<_, outbox::Error>(())
        })
    })
    .await
    .unwrap();
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    let orders: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {s}.orders")))
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(orders, 1);
    let c = store.counts().await.unwrap();
    assert_eq!(c.pending, 1, "{c:?}");

    // Not a conflict: not retried, nothing committed.
    let attempts = Arc::new(AtomicU32::new(0));
    let r = transaction(store.pool(), |tx| {
        let attempts = attempts.clone();
        let s = s.clone();
        Box::pin(async move {
            attempts.fetch_add(1, Ordering::SeqCst);
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {s}.orders (id) VALUES ($1)"
            )))
            .bind(order)
            .execute(&mut **tx)
            .await?;
            Ok::<_, outbox::Error>(())
        })
    })
    .await;
    assert!(matches!(r, Err(TransactionError::Failed(_))), "{r:?}");
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        1,
        "a duplicate key is not retried"
    );

    // A conflict every time: gives up after the policy's attempts.
    let attempts = Arc::new(AtomicU32::new(0));
    let r = transaction_with(store.pool(), &FAST, |tx| {
        let attempts = attempts.clone();
        Box::pin(async move {
            attempts.fetch_add(1, Ordering::SeqCst);
            sqlx::raw_sql("DO $$ BEGIN RAISE EXCEPTION 'forced' USING ERRCODE = '40P01'; END $$")
                .execute(&mut **tx)
                .await?;
            Ok::<_, sqlx::Error>(())
        })
    })
    .await;
    match r {
        Err(TransactionError::Exhausted { attempts: 3, .. }) => {}
        other => panic!("expected Exhausted after 3, got {other:?}"),
    }
    assert_eq!(attempts.load(Ordering::SeqCst), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_deadlock_is_retried_once() {
    let prefix = MySqlPrefix::new("txretry");
    let store = outbox::mysql::MySqlStore::connect(
        &mysql_url(),
        StoreConfig {
            schema: prefix.ident(),
            ..StoreConfig::default()
        },
    )
    .await
    .unwrap();
    store.migrate().await.unwrap();
    let p = prefix.name.clone();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {p}_orders (id CHAR(36) PRIMARY KEY) ENGINE = InnoDB;
         CREATE PROCEDURE {p}_deadlock() SIGNAL SQLSTATE '40001' SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'forced';"
    )))
    .execute(store.pool())
    .await
    .unwrap();
    let order = uuid::Uuid::now_v7();
    let attempts = Arc::new(AtomicU32::new(0));
    transaction(store.pool(), |tx| {
        let (store, attempts) = (store.clone(), attempts.clone());
        let p = p.clone();
        Box::pin(async move {
            let n = attempts.fetch_add(1, Ordering::SeqCst) + 1;
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {p}_orders (id) VALUES (?)"
            )))
            .bind(order.to_string())
            .execute(&mut **tx)
            .await?;
            let msg = Message::new("orders.order-placed.v1", b"{}".to_vec()).message_id(order);
            store.enqueue(tx, &msg).await?;
            if n == 1 {
                sqlx::query(AssertSqlSafe(format!("CALL {p}_deadlock()")))
                    .execute(&mut **tx)
                    .await?;
            }
            Ok::<_, outbox::Error>(())
        })
    })
    .await
    .unwrap();
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    let orders: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {p}_orders")))
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(orders, 1);
    assert_eq!(store.counts().await.unwrap().pending, 1);
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE {p}_orders; DROP PROCEDURE {p}_deadlock"
    )))
    .execute(store.pool())
    .await
    .unwrap();
}

/// SQLite: another connection holds the write lock when the first attempt writes (a busy
/// timeout of 50 ms on the application's pool), and lets go; the second attempt commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_busy_is_retried() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("tx.db").display());
    let store = outbox::sqlite::SqliteStore::connect(&url, StoreConfig::default())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let app = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(
            outbox::sqlite::connect_options(&url)
                .unwrap()
                .busy_timeout(Duration::from_millis(50)),
        )
        .await
        .unwrap();
    // The lock holder: BEGIN IMMEDIATE on a connection of its own, released once the
    // transaction runs a second time (its first met the lock, past the busy timeout).
    let holder = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    let attempts = Arc::new(AtomicU32::new(0));
    let release = {
        let attempts = attempts.clone();
        tokio::spawn(async move {
            crate::common::wait_until("a second attempt", Duration::from_secs(10), || {
                let n = attempts.load(Ordering::SeqCst);
                async move {
                    if n >= 2 {
                        Ok(())
                    } else {
                        Err(format!("{n} attempts"))
                    }
                }
            })
            .await;
            holder.rollback().await.unwrap();
        })
    };
    let policy = RetryPolicy {
        max_attempts: 10,
        base: Duration::from_millis(20),
        max: Duration::from_millis(100),
    };
    transaction_with(&app, &policy, |tx| {
        let (store, attempts) = (store.clone(), attempts.clone());
        Box::pin(async move {
            attempts.fetch_add(1, Ordering::SeqCst);
            let msg = Message::new("orders.order-placed.v1", b"{}".to_vec())
                .message_id(uuid::Uuid::from_u128(7));
            store.enqueue(tx, &msg).await?;
            Ok::<_, outbox::Error>(())
        })
    })
    .await
    .unwrap();
    release.await.unwrap();
    assert!(
        attempts.load(Ordering::SeqCst) >= 2,
        "the first attempt met the lock"
    );
    assert_eq!(store.counts().await.unwrap().pending, 1);
}

#[derive(serde::Serialize)]
struct OrderShippedV1 {
    order_id: String,
}

impl outbox::Contract for OrderShippedV1 {
    const TOPIC: &'static str = "orders.order-shipped.v1";
}

#[derive(serde::Serialize)]
struct InvoiceDueV1 {
    order_id: String,
    cents: i64,
}

impl outbox::Contract for InvoiceDueV1 {
    const TOPIC: &'static str = "billing.invoice-due.v1";
}

/// Events collected once survive a failed attempt: the retried transaction enqueues them
/// again and commits them once, and running the whole operation again (a redelivery)
/// finds them already there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collected_events_survive_a_retried_transaction() {
    use outbox::events::Events;
    let (store, _schema) = pg_store("events").await;
    let order = uuid::Uuid::now_v7();
    let mut events = Events::new();
    events
        .push_with(
            outbox::follow_up_id(order, "shipped"),
            &OrderShippedV1 {
                order_id: order.to_string(),
            },
            |m| m.key(order.to_string()),
        )
        .unwrap();
    events
        .push(
            outbox::follow_up_id(order, "invoice"),
            &InvoiceDueV1 {
                order_id: order.to_string(),
                cents: 1250,
            },
        )
        .unwrap();
    assert_eq!(events.len(), 2);
    let events = Arc::new(events);
    for run in 0..2 {
        let attempts = Arc::new(AtomicU32::new(0));
        let inserted = transaction(store.pool(), |tx| {
            let (store, attempts, events) = (store.clone(), attempts.clone(), events.clone());
            Box::pin(async move {
                let n = attempts.fetch_add(1, Ordering::SeqCst) + 1;
                let enqueued = events.enqueue_all(&store, tx).await?;
                if run == 0 && n == 1 {
                    sqlx::raw_sql(
                        "DO $$ BEGIN RAISE EXCEPTION 'forced' USING ERRCODE = '40001'; END $$",
                    )
                    .execute(&mut **tx)
                    .await?;
                }
                Ok::<_, outbox::Error>(enqueued.iter().filter(|e| e.inserted).count())
            })
        })
        .await
        .unwrap();
        let want_attempts = if run == 0 { 2 } else { 1 };
        assert_eq!(attempts.load(Ordering::SeqCst), want_attempts, "run {run}");
        assert_eq!(inserted, if run == 0 { 2 } else { 0 }, "run {run}");
        assert_eq!(store.counts().await.unwrap().pending, 2, "run {run}");
    }
    let c = claim_all(&store).await;
    let topics: Vec<(String, uuid::Uuid, Option<String>)> = c
        .into_iter()
        .map(|m| (m.topic, m.message_id, m.key))
        .collect();
    assert_eq!(
        topics,
        vec![
            (
                "orders.order-shipped.v1".to_owned(),
                outbox::follow_up_id(order, "shipped"),
                Some(order.to_string())
            ),
            (
                "billing.invoice-due.v1".to_owned(),
                outbox::follow_up_id(order, "invoice"),
                None
            ),
        ]
    );
}

async fn claim_all(store: &outbox::postgres::PgStore) -> Vec<outbox::OutgoingMessage> {
    store
        .claim(&outbox::store::ClaimRequest {
            relay_id: "t".into(),
            batch_size: 10,
            lease: Duration::from_secs(30),
            skip_topics: Vec::new(),
            ordering: Default::default(),
        })
        .await
        .unwrap()
        .messages
}

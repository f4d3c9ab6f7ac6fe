//! Guarantees 1 and 2 against real stores: the business change and its messages commit or
//! roll back together, and enqueue is idempotent on the message id (from Rust, and from
//! plain SQL through `<schema>.enqueue(...)` in PostgreSQL).

#![allow(clippy::unwrap_used)]

mod common;

use common::{pg_store, sqlite_store};
use outbox::Message;
use sqlx::AssertSqlSafe;
use std::time::Duration;
use uuid::Uuid;

// ------------------------------------------------------------------ atomicity

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_rollback_drops_business_row_and_message_commit_keeps_both() {
    let (store, schema) = pg_store("atom").await;
    let s = &schema.name;
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {s}.orders (id bigint PRIMARY KEY, note text NOT NULL)"
    )))
    .execute(store.pool())
    .await
    .unwrap();
    let orders = |id: i64| {
        let q = format!("SELECT count(*) FROM {s}.orders WHERE id = $1");
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(q))
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let messages = |mid: Uuid| {
        let q = format!("SELECT count(*) FROM {s}.messages WHERE message_id = $1");
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(q))
                .bind(mid)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };

    // Rolled back explicitly.
    let m1 = Message::new("orders.order-placed.v1", b"{\"order\":1}".to_vec());
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {s}.orders VALUES (1, 'one')"
    )))
    .execute(&mut *tx)
    .await
    .unwrap();
    let e1 = store.enqueue(&mut tx, &m1).await.unwrap();
    assert!(e1.inserted);
    // Inside the transaction both are visible ...
    let inside: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {s}.messages WHERE id = $1"
    )))
    .bind(e1.id)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(inside, 1);
    // ... and outside neither, before the commit.
    assert_eq!(messages(m1.id()).await, 0);
    tx.rollback().await.unwrap();
    assert_eq!(orders(1).await, 0);
    assert_eq!(messages(m1.id()).await, 0);

    // Dropped without commit (an early return / panic in the handler) = rolled back.
    let m2 = Message::new("orders.order-placed.v1", b"{\"order\":2}".to_vec());
    {
        let mut tx = store.pool().begin().await.unwrap();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.orders VALUES (2, 'two')"
        )))
        .execute(&mut *tx)
        .await
        .unwrap();
        store.enqueue(&mut tx, &m2).await.unwrap();
    }
    assert_eq!(orders(2).await, 0);
    assert_eq!(messages(m2.id()).await, 0);

    // Committed: both.
    let m3 = Message::new("orders.order-placed.v1", b"{\"order\":3}".to_vec()).key("order-3");
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {s}.orders VALUES (3, 'three')"
    )))
    .execute(&mut *tx)
    .await
    .unwrap();
    let e3 = store.enqueue(&mut tx, &m3).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(orders(3).await, 1);
    assert_eq!(messages(m3.id()).await, 1);
    let (topic, key, payload, status): (String, Option<String>, Vec<u8>, i16) =
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT topic, key, payload, status FROM {s}.messages WHERE id = $1"
        )))
        .bind(e3.id)
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(topic, "orders.order-placed.v1");
    assert_eq!(key.as_deref(), Some("order-3"));
    assert_eq!(payload, b"{\"order\":3}");
    assert_eq!(status, 0);
    let total: i64 =
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {s}.messages")))
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(total, 1, "only the committed message exists");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_rollback_drops_business_row_and_message_commit_keeps_both() {
    let (store, _dir) = sqlite_store().await;
    sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, note TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let count = |sql: &'static str, arg: String| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .bind(arg)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let orders = |id: i64| count("SELECT count(*) FROM orders WHERE id = ?1", id.to_string());
    let messages = |mid: Uuid| {
        count(
            "SELECT count(*) FROM outbox_messages WHERE message_id = ?1",
            mid.hyphenated().to_string(),
        )
    };

    let m1 = Message::new("orders.order-placed.v1", b"one".to_vec());
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query("INSERT INTO orders VALUES (1, 'one')")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert!(store.enqueue(&mut tx, &m1).await.unwrap().inserted);
    tx.rollback().await.unwrap();
    assert_eq!(orders(1).await, 0);
    assert_eq!(messages(m1.id()).await, 0);

    let m2 = Message::new("orders.order-placed.v1", b"two".to_vec());
    {
        let mut tx = store.pool().begin().await.unwrap();
        sqlx::query("INSERT INTO orders VALUES (2, 'two')")
            .execute(&mut *tx)
            .await
            .unwrap();
        store.enqueue(&mut tx, &m2).await.unwrap();
    }
    assert_eq!(orders(2).await, 0);
    assert_eq!(messages(m2.id()).await, 0);

    let m3 = Message::new("orders.order-placed.v1", b"three".to_vec());
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query("INSERT INTO orders VALUES (3, 'three')")
        .execute(&mut *tx)
        .await
        .unwrap();
    store.enqueue(&mut tx, &m3).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(orders(3).await, 1);
    assert_eq!(messages(m3.id()).await, 1);
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(total, 1);
}

// ------------------------------------------------------------------ idempotence

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_enqueue_is_idempotent_on_message_id() {
    let (store, schema) = pg_store("idem").await;
    let s = &schema.name;
    let id = Uuid::now_v7();
    let first = Message::new("t.idem.v1", b"first".to_vec()).message_id(id);
    let second = Message::new("t.idem.v1", b"second".to_vec()).message_id(id);

    // Twice in one transaction: same row, inserted=false, and the transaction still works.
    let mut tx = store.pool().begin().await.unwrap();
    let a = store.enqueue(&mut tx, &first).await.unwrap();
    let b = store.enqueue(&mut tx, &second).await.unwrap();
    assert!(a.inserted);
    assert!(!b.inserted);
    assert_eq!(a.id, b.id);
    assert_eq!(b.message_id, id);
    let other = store
        .enqueue(&mut tx, &Message::new("t.idem.v1", b"other".to_vec()))
        .await
        .unwrap();
    assert!(other.inserted);
    assert_ne!(other.id, a.id);
    tx.commit().await.unwrap();

    // Again in a later transaction.
    let mut tx = store.pool().begin().await.unwrap();
    let c = store.enqueue(&mut tx, &second).await.unwrap();
    assert_eq!((c.id, c.inserted), (a.id, false));
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();

    let rows: Vec<(i64, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, payload FROM {s}.messages WHERE message_id = $1"
    )))
    .bind(id)
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(
        rows,
        vec![(a.id, b"first".to_vec())],
        "the first payload is kept"
    );

    // Concurrent producers with the same id: the second waits for the first, then gets
    // the committed row back instead of an error.
    let id2 = Uuid::now_v7();
    let m = Message::new("t.idem.v1", b"race".to_vec()).message_id(id2);
    let mut tx1 = store.pool().begin().await.unwrap();
    let e1 = store.enqueue(&mut tx1, &m).await.unwrap();
    let (st2, m2) = (store.clone(), m.clone());
    let racer = tokio::spawn(async move {
        let mut tx2 = st2.pool().begin().await.unwrap();
        let e = st2.enqueue(&mut tx2, &m2).await.unwrap();
        tx2.commit().await.unwrap();
        e
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !racer.is_finished(),
        "the second producer waits on the first's uncommitted row"
    );
    tx1.commit().await.unwrap();
    let e2 = racer.await.unwrap();
    assert_eq!((e2.id, e2.inserted), (e1.id, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_sql_enqueue_function_is_idempotent() {
    let (store, schema) = pg_store("idemsql").await;
    let s = &schema.name;
    let call = format!("SELECT {s}.enqueue($1, $2, $3, $4, $5)");
    let id = Uuid::now_v7();

    // Twice in one plain-SQL transaction, as a non-Rust producer would.
    let mut tx = store.pool().begin().await.unwrap();
    let mut got = Vec::new();
    for payload in [&b"one"[..], &b"two"[..]] {
        let row_id: i64 = sqlx::query_scalar(AssertSqlSafe(call.clone()))
            .bind("t.sql.v1")
            .bind(payload)
            .bind(Some("k1"))
            .bind(id)
            .bind(serde_json::json!({"tenant": "acme"}))
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        got.push(row_id);
    }
    assert_eq!(got[0], got[1]);
    tx.commit().await.unwrap();

    // Again outside, then through the Rust API: all the same row.
    let again: i64 = sqlx::query_scalar(AssertSqlSafe(call.clone()))
        .bind("t.sql.v1")
        .bind(&b"three"[..])
        .bind(None::<String>)
        .bind(id)
        .bind(serde_json::json!({}))
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(again, got[0]);
    let mut tx = store.pool().begin().await.unwrap();
    let e = store
        .enqueue(
            &mut tx,
            &Message::new("t.sql.v1", b"four".to_vec()).message_id(id),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!((e.id, e.inserted), (got[0], false));

    let (n, payload, key, headers): (i64, Vec<u8>, Option<String>, serde_json::Value) =
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*) OVER (), payload, key, headers FROM {s}.messages WHERE message_id = $1"
        )))
        .bind(id)
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(n, 1);
    assert_eq!(payload, b"one");
    assert_eq!(key.as_deref(), Some("k1"));
    assert_eq!(headers, serde_json::json!({"tenant": "acme"}));

    // Without an id the function makes a fresh UUIDv7 each call.
    let ids: Vec<Uuid> = {
        let mut v = Vec::new();
        for _ in 0..2 {
            let row: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT {s}.enqueue('t.sql.v1', '\\x00'::bytea)"
            )))
            .fetch_one(store.pool())
            .await
            .unwrap();
            let mid: Uuid = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT message_id FROM {s}.messages WHERE id = $1"
            )))
            .bind(row)
            .fetch_one(store.pool())
            .await
            .unwrap();
            v.push(mid);
        }
        v
    };
    assert_ne!(ids[0], ids[1]);
    assert!(ids.iter().all(|u| u.get_version_num() == 7), "{ids:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_enqueue_is_idempotent_on_message_id() {
    let (store, _dir) = sqlite_store().await;
    let id = Uuid::now_v7();
    let first = Message::new("t.idem.v1", b"first".to_vec()).message_id(id);
    let second = Message::new("t.idem.v1", b"second".to_vec()).message_id(id);

    let mut tx = store.pool().begin().await.unwrap();
    let a = store.enqueue(&mut tx, &first).await.unwrap();
    let b = store.enqueue(&mut tx, &second).await.unwrap();
    assert!(a.inserted);
    assert!(!b.inserted);
    assert_eq!(a.id, b.id);
    let other = store
        .enqueue(&mut tx, &Message::new("t.idem.v1", b"other".to_vec()))
        .await
        .unwrap();
    assert!(other.inserted);
    tx.commit().await.unwrap();

    let mut tx = store.pool().begin().await.unwrap();
    let c = store.enqueue(&mut tx, &second).await.unwrap();
    assert_eq!((c.id, c.inserted), (a.id, false));
    tx.commit().await.unwrap();

    let rows: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT id, payload FROM outbox_messages WHERE message_id = ?1")
            .bind(id.hyphenated().to_string())
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(rows, vec![(a.id, b"first".to_vec())]);
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_messages")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(total, 2);
}

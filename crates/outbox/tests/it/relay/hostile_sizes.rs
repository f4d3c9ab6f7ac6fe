//! Hostile sizes on every store and through every sink of this machine: a 64 MiB payload,
//! 10,000 headers, a 10 KiB key. Enqueued through the library, the oversized message is
//! refused with `MessageTooLarge` before any SQL runs; written behind the validation by
//! plain SQL, it is claimed and delivered (the file sink, Redis, MQTT, webhooks) or
//! quarantined with a reason naming the limit it broke (NATS `max_payload`, RabbitMQ's
//! largest message), and a normal message enqueued after it is delivered within a bound:
//! one hostile row never stalls the relay.
//!
//! What bounds the relay's memory for such a row: a claim reads at most `batch_size` rows,
//! each no larger than its database lets a row be (PostgreSQL `bytea` 1 GiB, SQLite
//! 1,000,000,000 bytes, MariaDB the server's `max_allowed_packet`, which also refuses to
//! store a larger one); the relay then holds a batch in memory while the sink publishes it,
//! so a batch costs at most `batch_size` × the largest row, times the copies a sink's
//! encoding makes (the file sink's JSON line, base64 for binary payloads).

#![allow(clippy::unwrap_used)]

use crate::common::{relay_config, wait_until};
use crate::sink::publisher_conformance::Harness;
use crate::store::conformance::{Backend, DEFAULT_MAX, Kind, TxOpts};
use crate::store::conformance_mysql::MySqlBackend;
use crate::store::conformance_postgres::PgBackend;
use crate::store::conformance_sqlite::SqliteBackend;
use outbox::{Error, Message, Relay, Store};
use sqlx::AssertSqlSafe;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

/// The hostile payload: 64 MiB (the issue's 200 MB case is the same path, only larger).
const HUGE: usize = 64 << 20;
/// MariaDB's `max_allowed_packet` on this machine is 16 MiB: the largest row it can store
/// and send back is a little under it.
const MARIADB_HUGE: usize = 15 << 20;
const HEADERS: usize = 10_000;
const KEY_BYTES: usize = 10 * 1024;
/// How long the relay may take for the hostile rows and the normal one after them.
const BOUND: Duration = Duration::from_secs(240);

/// 10,000 headers `h00000`…`h09999`, values of 16 bytes.
fn many_headers(topic: &str) -> Message {
    (0..HEADERS).fold(Message::new(topic, b"headers".to_vec()), |m, i| {
        m.header(format!("h{i:05}"), format!("value-{i:010}"))
    })
}

fn long_key(topic: &str) -> Message {
    Message::new(topic, b"long key".to_vec()).key("k".repeat(KEY_BYTES))
}

/// Writes a row with `payload` by plain SQL, behind the library's validation (the
/// documented INSERT for SQLite, an INSERT into the table for the others).
async fn raw_insert<B: Backend>(db: &B, topic: &str, payload: &[u8]) -> Result<Uuid, String> {
    let id = Uuid::now_v7();
    let r = match B::KIND {
        Kind::Postgres => {
            let db = (db as &dyn std::any::Any)
                .downcast_ref::<PgBackend>()
                .unwrap();
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {}.messages (message_id, topic, payload, headers) VALUES ($1, $2, $3, '{{}}')",
                db.schema.name
            )))
            .bind(id)
            .bind(topic)
            .bind(payload)
            .execute(&db.app)
            .await
            .map(|_| ())
        }
        Kind::MySql => {
            let db = (db as &dyn std::any::Any)
                .downcast_ref::<MySqlBackend>()
                .unwrap();
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {}_messages (message_id, topic, payload, headers) VALUES (?, ?, ?, '{{}}')",
                db.p()
            )))
            .bind(id.hyphenated().to_string())
            .bind(topic)
            .bind(payload)
            .execute(db.app())
            .await
            .map(|_| ())
        }
        Kind::Sqlite => {
            let db = (db as &dyn std::any::Any)
                .downcast_ref::<SqliteBackend>()
                .unwrap();
            sqlx::query(
                "INSERT INTO outbox_messages (message_id, topic, payload, headers) VALUES (?, ?, ?, '{}')",
            )
            .bind(id.hyphenated().to_string())
            .bind(topic)
            .bind(payload)
            .execute(&db.app)
            .await
            .map(|_| ())
        }
    };
    r.map(|()| id).map_err(|e| e.to_string())
}

/// Waits until the `n` rows of `store` are settled (dispatched or dead).
async fn wait_all_settled(what: &str, store: &Arc<dyn Store>, n: i64) {
    wait_until(what, BOUND, || {
        let s = store.clone();
        async move {
            // A read may wait out the pool's acquire timeout while the relay moves a
            // 64 MiB row on a busy machine: that is a later look, not a failure.
            let c = s.counts().await.map_err(|e| e.to_string())?;
            if c.dispatched + c.dead == n && c.pending == 0 && c.claimed == 0 {
                Ok(())
            } else {
                Err(format!("{c:?}"))
            }
        }
    })
    .await;
}

/// On store `B`: the library refuses a 64 MiB message by its size; a row of that size
/// written by SQL (MariaDB: refused by the server over `max_allowed_packet`, so one just
/// under it), one with 10,000 headers, one with a 10 KiB key (MariaDB: refused by the
/// server, its `key` column holds 1,024 characters) and a normal one after them all reach
/// the file sink, byte for byte.
async fn store_case<B: Backend>(label: &str) {
    let db = B::create(label, DEFAULT_MAX).await;
    let topic = "t.hostile.v1";
    let refused = db
        .produce(&[Message::new(topic, vec![b'x'; HUGE])], TxOpts::default())
        .await;
    match &refused[..] {
        [Err(e @ Error::MessageTooLarge { size, limit })] => {
            assert!(*size > HUGE && *limit == DEFAULT_MAX, "{e}");
            assert!(e.to_string().contains("message too large"), "{e}");
        }
        other => panic!("a 64 MiB message was not refused by its size: {other:?}"),
    }
    assert_eq!(db.store().counts().await.unwrap().pending, 0);

    let huge_len = match B::KIND {
        Kind::MySql => {
            // The server refuses a packet over max_allowed_packet by closing the
            // connection: the row is not written.
            raw_insert(&db, topic, &vec![b'x'; HUGE]).await.unwrap_err();
            MARIADB_HUGE
        }
        _ => HUGE,
    };
    let huge_payload: Vec<u8> = (0..huge_len).map(|i| (i % 251) as u8).collect();
    let huge_id = raw_insert(&db, topic, &huge_payload).await.unwrap();
    let mut enq = db.enqueue_all(&[many_headers(topic)]).await;
    if B::KIND == Kind::MySql {
        // MariaDB's `key` column is VARCHAR(1024): the server refuses a longer key, naming
        // the column, and the transaction writes nothing.
        let refused = db.produce(&[long_key(topic)], TxOpts::default()).await;
        let error = format!("{:?}", refused[0]);
        assert!(error.contains("Data too long for column 'key'"), "{error}");
    } else {
        enq.extend(db.enqueue_all(&[long_key(topic)]).await);
    }
    let normal = db
        .enqueue_all(&[Message::new(topic, b"normal".to_vec())])
        .await;
    let rows = 2 + enq.len();

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.jsonl");
    let sink = Arc::new(outbox::sink::file::FileSink::open(&path).await.unwrap());
    let store = db.store();
    let mut cfg = relay_config(label);
    // Encoding and fsyncing a 64 MiB line takes seconds in a debug build on a busy machine.
    cfg.publish_timeout = Duration::from_secs(60);
    let handle = Relay::new(store.clone(), sink, cfg).spawn();
    wait_all_settled("the hostile rows and the normal one", &store, rows as i64).await;
    handle.shutdown().await.unwrap();
    assert_eq!(db.row(normal[0].id).await.status, 2, "the normal row");

    let text = std::fs::read(&path).unwrap();
    let lines: Vec<outbox::envelope::Envelope> = text
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| outbox::envelope::from_json_line(l).unwrap())
        .collect();
    assert_eq!(lines.len(), rows);
    let by_id = |id: Uuid| lines.iter().find(|e| e.message_id == id).unwrap();
    assert_eq!(by_id(huge_id).payload.as_ref(), huge_payload.as_slice());
    assert_eq!(by_id(enq[0].message_id).headers.len(), HEADERS);
    if let Some(keyed) = enq.get(1) {
        assert_eq!(
            by_id(keyed.message_id).key.as_deref().map(str::len),
            Some(KEY_BYTES)
        );
    }
    assert_eq!(by_id(normal[0].message_id).payload.as_ref(), b"normal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_refuses_huge_enqueues_and_delivers_hostile_rows() {
    store_case::<SqliteBackend>("hostile_lite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_refuses_huge_enqueues_and_delivers_hostile_rows() {
    store_case::<PgBackend>("hostile_pg").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_refuses_huge_enqueues_and_delivers_hostile_rows() {
    store_case::<MySqlBackend>("hostile_my").await;
}

/// Through sink `H` (from a SQLite store): a 64 MiB row written by SQL, one with 10,000
/// headers and one with a 10 KiB key are each dispatched, or dead after one attempt with a
/// reason containing one of `limit_words`; the normal row after them is dispatched within
/// [`BOUND`].
async fn sink_case<H: Harness>(label: &str, limit_words: &[&str]) {
    let h = H::setup().await;
    let topic = h.topic("hostile");
    let db = SqliteBackend::create(label, DEFAULT_MAX).await;
    let huge = raw_insert(&db, &topic, &vec![b'x'; HUGE]).await.unwrap();
    let enq = db
        .enqueue_all(&[many_headers(&topic), long_key(&topic)])
        .await;
    let normal = db
        .enqueue_all(&[Message::new(topic.clone(), b"normal".to_vec())])
        .await;
    let sink: Arc<dyn outbox::Sink> = Arc::from(h.sink().await);
    let store = db.store();
    let mut cfg = relay_config(label);
    cfg.publish_timeout = Duration::from_secs(30);
    cfg.max_attempts = 3;
    let handle = Relay::new(store.clone(), sink, cfg).spawn();
    wait_all_settled("the hostile rows and the normal one", &store, 4).await;
    handle.shutdown().await.unwrap();
    assert_eq!(db.row(normal[0].id).await.status, 2, "the normal row");

    let rows = db.rows().await;
    for (what, id) in [
        ("64 MiB payload", huge),
        ("10,000 headers", enq[0].message_id),
        ("10 KiB key", enq[1].message_id),
    ] {
        let row = rows.iter().find(|r| r.message_id == id).unwrap();
        let error = row.last_error.clone().unwrap_or_default();
        eprintln!(
            "{label}: {what}: status {} after {} attempt(s): {error}",
            row.status, row.attempts
        );
        match row.status {
            2 => {}
            3 => assert!(
                limit_words
                    .iter()
                    .any(|w| error.to_lowercase().contains(&w.to_lowercase())),
                "{label}: {what} is dead for a reason that names no limit ({limit_words:?}): {error}"
            ),
            s => panic!("{label}: {what}: status {s}"),
        }
    }
    h.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_delivers_or_quarantines_hostile_rows() {
    sink_case::<crate::sink::publisher_conformance::nats::NatsHarness>(
        "hostile_nats",
        &["max_payload", "maximum"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_delivers_or_quarantines_hostile_rows() {
    sink_case::<crate::sink::publisher_conformance::redis::RedisHarness>(
        "hostile_redis",
        &["max_message_bytes", "proto-max-bulk-len"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_delivers_or_quarantines_hostile_rows() {
    sink_case::<crate::sink::publisher_conformance::rabbitmq::RabbitMqHarness>(
        "hostile_amqp",
        &["max_message_bytes", "max_message_size", "frame"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_delivers_or_quarantines_hostile_rows() {
    sink_case::<crate::sink::publisher_conformance::mqtt::MqttHarness>(
        "hostile_mqtt",
        &["packet size", "maximum packet", "too large"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_delivers_or_quarantines_hostile_rows() {
    sink_case::<crate::sink::publisher_conformance::http::HttpHarness>(
        "hostile_http",
        &["413", "too large", "431"],
    )
    .await;
}

/// A relay id of 10 KiB is refused by the relay before anything is claimed, naming the
/// bound (MariaDB's `claimed_by` and relay registry hold 255 bytes); nothing is published
/// and the row stays pending. An id of exactly 255 bytes drains the outbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_id_over_255_bytes_is_refused_before_claiming() {
    let db = MySqlBackend::create("hostile_id", DEFAULT_MAX).await;
    db.enqueue_all(&[Message::new("t.id.v1", b"x".to_vec())])
        .await;
    let (sink, seen) = crate::common::RecordingSink::new();
    let mut cfg = relay_config("unused");
    cfg.drain = true;
    cfg.relay_id = "r".repeat(KEY_BYTES);
    let r = tokio::time::timeout(
        Duration::from_secs(30),
        Relay::new(db.store(), sink.clone(), cfg.clone())
            .spawn()
            .wait(),
    )
    .await
    .expect("the relay with a 10 KiB id neither ended nor refused within 30 s");
    match r {
        Err(outbox::RelayError::Config(text)) => {
            assert!(text.contains("relay_id") && text.contains("255"), "{text}");
        }
        other => panic!("a 10 KiB relay id was not refused: {other:?}"),
    }
    assert!(seen.lock().unwrap().is_empty(), "nothing published");
    assert_eq!(db.store().counts().await.unwrap().pending, 1);

    cfg.relay_id = "r".repeat(outbox::relay::MAX_RELAY_ID_BYTES);
    Relay::new(db.store(), sink, cfg)
        .spawn()
        .wait()
        .await
        .unwrap();
    assert_eq!(seen.lock().unwrap().len(), 1);
}

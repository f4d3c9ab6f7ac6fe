//! Bad input is refused where it enters, with an error that names it: a relay on an
//! unmigrated store, an unknown sink URL, and a NATS subject that no stream covers
//! (quarantined at once). Oversized messages and text a store cannot hold are refused at
//! enqueue: see the conformance suite (`payloads_and_headers_survive_byte_for_byte`).

#![allow(clippy::unwrap_used)]

use crate::common::{
    RecordingWrapper, Seen, TestStream, nats_connect, nats_url, pg_store_unmigrated, relay_config,
    sqlite_store_unmigrated, wait_until,
};
use crate::conformance::Backend as _;
use outbox::sink::SinkError;
use outbox::sink::nats::{NatsOptions, NatsSink};
use outbox::{Error, Message, Relay, RelayError};
use sqlx::AssertSqlSafe;
use std::sync::Arc;
use std::time::Duration;

const LIMIT: usize = 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_on_unmigrated_store_fails_with_not_migrated() {
    let (pg, schema) = pg_store_unmigrated("unmig", LIMIT).await;
    let (sink, _seen) = crate::common::RecordingSink::new();
    let r = Relay::new(Arc::new(pg), sink.clone(), relay_config("unmigrated"))
        .spawn()
        .wait()
        .await;
    match r {
        Err(RelayError::Store(Error::NotMigrated {
            schema: got,
            found,
            expected,
        })) => {
            assert_eq!(got, schema.name);
            assert_eq!(found, 0);
            assert_eq!(expected, outbox::postgres::SCHEMA_VERSION);
        }
        other => panic!("expected NotMigrated, got {other:?}"),
    }

    let (lite, _dir) = sqlite_store_unmigrated(LIMIT).await;
    let r = Relay::new(Arc::new(lite), sink, relay_config("unmigrated"))
        .spawn()
        .wait()
        .await;
    assert!(
        matches!(
            r,
            Err(RelayError::Store(Error::NotMigrated { found: 0, .. }))
        ),
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unknown_sink_url_is_invalid() {
    for url in ["kafka+bogus://x", "file:", "ftp://host/x"] {
        match outbox::sink::open(url).await {
            Err(SinkError::InvalidUrl { url: got, .. }) => assert_eq!(got, url),
            Err(other) => panic!("{url}: expected InvalidUrl, got {other}"),
            Ok(s) => panic!("{url}: expected InvalidUrl, got a sink {}", s.describe()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_subject_without_stream_is_quarantined_at_once() {
    let client = nats_connect().await;
    let stream = TestStream::shared(&client).await;
    let db = crate::conformance_postgres::PgBackend::create(
        "nostream",
        outbox::store::DEFAULT_MAX_MESSAGE_BYTES,
    )
    .await;
    // A subject next to the stream's, but outside it.
    let uncovered = format!("{}x.orders", stream.prefix);
    let msgs = vec![
        Message::new(stream.subject("ok1"), b"1".to_vec()),
        Message::new(uncovered.clone(), b"2".to_vec()),
        Message::new(stream.subject("ok2"), b"3".to_vec()),
        // Text a store holds but NATS headers cannot carry.
        Message::new(stream.subject("crlf"), b"4".to_vec()).header("note", "a\r\nb"),
    ];
    let enq = db.enqueue_all(&msgs).await;
    // A row written by hand with headers that are not a JSON object of strings.
    let malformed_id: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "INSERT INTO {}.messages (message_id, topic, payload, headers)
         VALUES (gen_random_uuid(), $1, '\\x00', '{{\"n\": 1}}') RETURNING id",
        db.schema.name
    )))
    .bind(stream.subject("malformed"))
    .fetch_one(&db.app)
    .await
    .unwrap();

    let sink = NatsSink::connect(
        &nats_url(),
        NatsOptions {
            ack_timeout: Duration::from_secs(2),
        },
    )
    .await
    .unwrap();
    let seen: Seen = Arc::default();
    let sink = Arc::new(RecordingWrapper {
        inner: sink,
        seen: seen.clone(),
    });
    let mut cfg = relay_config("nostream");
    cfg.max_attempts = 5;
    let handle = Relay::new(db.store(), sink, cfg).spawn();
    let store = db.store();
    wait_until("2 dispatched and 3 dead", Duration::from_secs(15), || {
        let store = store.clone();
        async move {
            let c = store.counts().await.unwrap();
            if c.dispatched == 2 && c.dead == 3 && c.pending == 0 && c.claimed == 0 {
                Ok(())
            } else {
                Err(format!("{c:?}"))
            }
        }
    })
    .await;
    handle.shutdown().await.unwrap();

    let dead = db.row(enq[1].id).await;
    assert_eq!(dead.status, 3);
    assert_eq!(dead.attempts, 1, "a permanent error is not retried");
    let err = dead.last_error.unwrap_or_default();
    assert!(err.contains("no JetStream stream covers"), "{err}");
    assert!(err.contains(&uncovered), "{err}");
    assert_eq!(seen.lock().unwrap()[&msgs[1].id()], 1);

    let crlf = db.row(enq[3].id).await;
    assert_eq!((crlf.status, crlf.attempts), (3, 1));
    let err = crlf.last_error.unwrap_or_default();
    assert!(err.contains("CR or LF") && err.contains("note"), "{err}");

    let malformed = db.row(malformed_id).await;
    assert_eq!(malformed.status, 3);
    let err = malformed.last_error.unwrap_or_default();
    assert!(err.contains("malformed row"), "{err}");
    assert!(
        !seen.lock().unwrap().contains_key(&malformed.message_id),
        "a malformed row never reaches the sink"
    );

    assert_eq!(stream.message_count(&client).await, 2);
}

/// A sink that panics (a bug in it): the relay ends with `RelayError::Task` naming the
/// panic, and the rows it held come back to a healthy relay after the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_sink_ends_the_relay_with_the_panic_and_loses_nothing() {
    struct Panics;
    #[async_trait::async_trait]
    impl outbox::Sink for Panics {
        async fn publish(
            &self,
            _batch: &[outbox::OutgoingMessage],
            _confirm: &outbox::sink::Confirmations,
        ) {
            panic!("sink bug");
        }
        fn describe(&self) -> String {
            "panics".into()
        }
    }
    let db =
        crate::conformance_sqlite::SqliteBackend::create("sqlite", crate::conformance::DEFAULT_MAX)
            .await;
    let enq = db.enqueue_all(&crate::common::messages("t.panic", 5)).await;
    let mut cfg = relay_config("relay-panics");
    cfg.lease = Duration::from_millis(500);
    let r = Relay::new(db.store(), Arc::new(Panics), cfg)
        .spawn()
        .wait()
        .await;
    match r {
        Err(RelayError::Task(text)) => assert!(text.contains("sink bug"), "{text}"),
        other => panic!("expected RelayError::Task, got {other:?}"),
    }
    let (sink, seen) = crate::common::RecordingSink::new();
    let second = Relay::new(db.store(), sink, relay_config("relay-after")).spawn();
    crate::common::wait_dispatched(
        "all dispatched after the panic",
        &db.store(),
        enq.len(),
        Duration::from_secs(10),
    )
    .await;
    second.shutdown().await.unwrap();
    assert_eq!(seen.lock().unwrap().len(), enq.len());
}

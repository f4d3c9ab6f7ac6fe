//! A broker outage delays delivery and loses nothing: with a private `nats-server` down,
//! rows stay pending with the last error, and the outage does not use up their attempts
//! (none is quarantined, however small `max_attempts` is); once the server is back, every
//! message is delivered exactly once into the stream.

#![allow(clippy::unwrap_used)]

use crate::common::{
    NatsServer, TestStream, assert_outage_spent_nothing, messages, outage_length, produce_for,
    relay_config, wait_dispatched, wait_until,
};
use crate::store::conformance::Backend as _;
use async_nats::jetstream::stream::StorageType;
use outbox::Relay;
use outbox::sink::nats::{NatsOptions, NatsSink};
use outbox::store::status;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

const N: usize = 50;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_outage_keeps_rows_pending_then_delivers_all() {
    let mut server = NatsServer::start().await;
    let admin = server.connect().await;
    let stream = TestStream::create(&admin, &server.url(), StorageType::File).await;
    drop(admin);
    server.stop();

    let db = crate::store::conformance_postgres::PgBackend::create(
        "outage",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let store = db.store();
    let enq = db
        .enqueue_all(&messages(&stream.subject("orders"), N))
        .await;

    // The sink connects in the background: a broker that is down at start does not fail it.
    let sink = NatsSink::connect(
        &server.url(),
        NatsOptions {
            ack_timeout: Duration::from_secs(1),
        },
    )
    .await
    .unwrap();
    let mut cfg = relay_config("relay-outage");
    cfg.publish_timeout = Duration::from_secs(1);
    cfg.lease = Duration::from_secs(5);
    cfg.backoff_base = Duration::from_millis(100);
    cfg.backoff_max = Duration::from_millis(500);
    cfg.max_attempts = 2; // an outage must not burn attempts
    cfg.batch_size = 20; // several batches in flight over the outage
    let handle = Relay::new(store.clone(), Arc::new(sink), cfg).spawn();

    // While the broker is down: every row was tried (more than once) and carries the error;
    // none is dispatched or dead.
    let d = &db;
    wait_until(
        "every row retried with an error",
        Duration::from_secs(20),
        || async move {
            let rows = d.rows().await;
            let settled: Vec<_> = rows.iter().filter(|r| r.status >= 2).collect();
            assert!(
                settled.is_empty(),
                "rows settled while the broker was down: {settled:?}"
            );
            let retried = rows.iter().filter(|r| r.last_error.is_some()).count();
            if retried == N {
                Ok(())
            } else {
                Err(format!("{retried}/{N} rows retried with an error"))
            }
        },
    )
    .await;
    // Several more outage retries past max_attempts = 2: every row claimed three more
    // times on average; then a moment when rows wait in pending between attempts.
    let from = handle.stats().claimed;
    let h = &handle;
    let between = std::sync::Mutex::new(Vec::new());
    wait_until(
        "three more claims of every row, then rows pending between attempts",
        Duration::from_secs(20),
        || async {
            let more = h.stats().claimed - from;
            if more < 3 * N as u64 {
                return Err(format!("{more} rows claimed since"));
            }
            let rows = db.rows().await;
            if rows.iter().any(|r| r.status == status::PENDING) {
                *between.lock().unwrap() = rows;
                Ok(())
            } else {
                Err("every row claimed".into())
            }
        },
    )
    .await;
    let rows = between.into_inner().unwrap();
    let mut pending = 0;
    for r in &rows {
        assert!(r.status == status::PENDING || r.status == status::CLAIMED);
        pending += usize::from(r.status == status::PENDING);
        let e = r.last_error.as_deref().unwrap();
        assert!(e.starts_with("unavailable"), "{e}");
        assert_eq!(r.dispatched_at, None);
        // Given back after every outage retry: 0 while pending, 1 while claimed.
        assert!(
            r.attempts <= i32::from(r.status == status::CLAIMED),
            "the outage used up attempts: {r:?}"
        );
    }
    assert!(pending > 0, "rows wait in pending between attempts");
    eprintln!(
        "during the outage: attempts {:?}, last_error {:?}",
        rows.iter().map(|r| r.attempts).collect::<Vec<_>>(),
        rows[0].last_error
    );
    let c = store.counts().await.unwrap();
    assert_eq!((c.dispatched, c.dead), (0, 0), "{c:?}");
    assert_eq!(handle.stats().dispatched, 0);

    // The broker comes back on the same port and store.
    server.restart().await;
    let back = std::time::Instant::now();
    let s = store.clone();
    crate::common::wait_dispatched(
        "all delivered after the restart",
        &s,
        N,
        Duration::from_secs(20),
    )
    .await;
    eprintln!("delivered {:?} after the restart", back.elapsed());
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.dispatched, N as u64, "{stats:?}");
    assert_eq!(stats.quarantined, 0, "{stats:?}");

    let c = store.counts().await.unwrap();
    assert_eq!(
        (c.pending, c.claimed, c.dispatched, c.dead),
        (0, 0, N as i64, 0)
    );
    for r in db.rows().await {
        assert_eq!(r.last_error, None, "a mark clears the error");
    }
    let admin = server.connect().await;
    assert_eq!(
        stream.message_count(&admin).await,
        N as u64,
        "exactly one copy each"
    );
    let in_stream: HashSet<String> = stream.msg_ids(&admin).await.into_iter().collect();
    let ours: HashSet<String> = enq.iter().map(|e| e.message_id.to_string()).collect();
    assert_eq!(in_stream, ours);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_killed_mid_run_then_restarted_loses_nothing() {
    let mut server = NatsServer::start().await;
    let admin = server.connect().await;
    let stream = TestStream::create(&admin, &server.url(), StorageType::File).await;
    drop(admin);

    let db = crate::store::conformance_postgres::PgBackend::create(
        "midrun",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let store = db.store();
    let sink = NatsSink::connect(
        &server.url(),
        NatsOptions {
            ack_timeout: Duration::from_secs(1),
        },
    )
    .await
    .unwrap();
    let mut cfg = relay_config("relay-midrun");
    cfg.publish_timeout = Duration::from_secs(1);
    cfg.lease = Duration::from_secs(5);
    cfg.backoff_base = Duration::from_millis(100);
    cfg.backoff_max = Duration::from_millis(500);
    cfg.max_attempts = 2;
    let handle = Relay::new(store.clone(), Arc::new(sink), cfg).spawn();

    // Healthy first.
    let mut enq = db.enqueue_all(&messages(&stream.subject("a"), 20)).await;
    let dispatched = |n: i64| {
        let s = store.clone();
        move || {
            let s = s.clone();
            async move {
                let c = s.counts().await.unwrap();
                if c.dispatched == n {
                    Ok(())
                } else {
                    Err(format!("{c:?}"))
                }
            }
        }
    };
    wait_until("healthy delivery", Duration::from_secs(10), dispatched(20)).await;

    // The broker dies under the running relay (SIGKILL), producers go on.
    server.stop();
    enq.extend(db.enqueue_all(&messages(&stream.subject("b"), 30)).await);
    let d = &db;
    wait_until(
        "new rows retried with an error",
        Duration::from_secs(15),
        || async move {
            let rows = d.rows().await;
            assert_eq!(rows.iter().filter(|r| r.status == 3).count(), 0);
            let retried = rows
                .iter()
                .filter(|r| r.status != 2 && r.last_error.is_some())
                .count();
            if retried == 30 {
                Ok(())
            } else {
                Err(format!("{retried}/30 retried"))
            }
        },
    )
    .await;
    assert_eq!(store.counts().await.unwrap().dispatched, 20);

    server.restart().await;
    wait_until(
        "delivery after the restart",
        Duration::from_secs(15),
        dispatched(50),
    )
    .await;
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.quarantined, 0, "{stats:?}");
    let admin = server.connect().await;
    assert_eq!(
        stream.message_count(&admin).await,
        50,
        "the file store kept the first 20"
    );
    let in_stream: HashSet<String> = stream.msg_ids(&admin).await.into_iter().collect();
    let ours: HashSet<String> = enq.iter().map(|e| e.message_id.to_string()).collect();
    assert_eq!(in_stream, ours);
}

/// At default settings, a broker outage of a minute (`OUTBOX_TEST_OUTAGE_SECONDS`) while a
/// producer keeps writing: nothing is quarantined, no attempt is counted, and the whole
/// backlog is delivered within 5 s of the broker's return.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_nats_outage_recovers_within_seconds() {
    let outage = outage_length();
    let mut server = NatsServer::start().await;
    let admin = server.connect().await;
    let stream = TestStream::create(&admin, &server.url(), StorageType::File).await;
    drop(admin);

    let db = std::sync::Arc::new(
        crate::store::conformance_postgres::PgBackend::create(
            "long_outage",
            crate::store::conformance::DEFAULT_MAX,
        )
        .await,
    );
    let store = db.store();
    let sink = NatsSink::connect(&server.url(), NatsOptions::default())
        .await
        .unwrap();
    let cfg = outbox::RelayConfig {
        relay_id: "relay-long-outage".into(),
        ..outbox::RelayConfig::default()
    };
    let handle = Relay::new(store.clone(), Arc::new(sink), cfg).spawn();
    let mut enq = db
        .enqueue_all(&messages(&stream.subject("before"), 10))
        .await;
    wait_dispatched("healthy delivery", &store, 10, Duration::from_secs(10)).await;

    server.stop();
    enq.extend(produce_for(db.clone(), stream.subject("during"), outage).await);
    let n = enq.len();
    assert_outage_spent_nothing(&*db).await;

    server.restart().await;
    let back = std::time::Instant::now();
    wait_dispatched("the backlog delivered", &store, n, Duration::from_secs(30)).await;
    let took = back.elapsed();
    eprintln!(
        "{} messages enqueued during a {outage:?} outage delivered {took:?} after the broker's return",
        n - 10
    );
    assert!(
        took < Duration::from_secs(5),
        "backlog took {took:?} after the broker's return"
    );
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.quarantined, 0, "{stats:?}");
    let admin = server.connect().await;
    let in_stream: HashSet<String> = stream.msg_ids(&admin).await.into_iter().collect();
    let ours: HashSet<String> = enq.iter().map(|e| e.message_id.to_string()).collect();
    assert_eq!(in_stream, ours);
    assert_eq!(
        stream.message_count(&admin).await,
        n as u64,
        "one copy each"
    );
}

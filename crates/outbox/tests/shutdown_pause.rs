//! Graceful shutdown gives claims back (attempt included) when the sink does not answer
//! within the grace period; the pause switch stops relays but not producers, and a drain
//! on a paused outbox refuses to start.

#![allow(clippy::unwrap_used)]

mod common;

use async_trait::async_trait;
use common::{RecordingSink, TestDb, messages, relay_config, total, wait_until};
use outbox::message::OutgoingMessage;
use outbox::sink::{PublishError, Sink};
use outbox::store::status;
use outbox::{Relay, RelayError};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Reports each batch it is handed, then never answers.
struct BlackHole {
    handed: mpsc::UnboundedSender<usize>,
}

#[async_trait]
impl Sink for BlackHole {
    async fn publish(&self, batch: &[OutgoingMessage]) -> Vec<Result<(), PublishError>> {
        let _ = self.handed.send(batch.len());
        std::future::pending().await
    }

    fn describe(&self) -> String {
        "black hole".into()
    }
}

async fn shutdown_releases_in_flight_claims(db: TestDb) {
    let name = db.name();
    let store = db.store();
    let enq = db.enqueue_all(&messages("t.shutdown.v1", 5)).await;

    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut cfg = relay_config("relay-shutdown");
    cfg.shutdown_grace = Duration::from_millis(300);
    cfg.publish_timeout = Duration::from_secs(20);
    cfg.lease = Duration::from_secs(30);
    let handle = Relay::new(
        store.clone(),
        std::sync::Arc::new(BlackHole { handed: tx }),
        cfg,
    )
    .spawn();
    let n = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("the relay never published")
        .unwrap();
    assert_eq!(n, 5, "{name}");
    for r in db.rows().await {
        assert_eq!(r.status, i32::from(status::CLAIMED), "{name}");
        assert_eq!(r.attempts, 1, "{name}");
    }

    let start = Instant::now();
    let stats = tokio::time::timeout(Duration::from_secs(10), handle.shutdown())
        .await
        .expect("shutdown() did not return")
        .unwrap();
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(250),
        "{name}: shutdown must wait the grace period, took {took:?}"
    );
    assert!(took < Duration::from_secs(3), "{name}: took {took:?}");
    assert_eq!(stats.released, 5, "{name}: {stats:?}");
    assert_eq!(stats.dispatched, 0, "{name}: {stats:?}");

    for r in db.rows().await {
        assert_eq!(r.status, i32::from(status::PENDING), "{name}: {r:?}");
        assert_eq!(r.attempts, 0, "{name}: the claim's attempt is given back");
        assert_eq!(r.claim_token, None, "{name}");
        assert_eq!(r.locked_until, None, "{name}");
        assert!(
            db.is_due(r.id).await,
            "{name}: released rows are due at once"
        );
    }

    // Another relay picks them up right away.
    let (sink, seen) = RecordingSink::new();
    let mut cfg = relay_config("relay-after");
    cfg.drain = true;
    let stats = Relay::new(store.clone(), sink, cfg)
        .spawn()
        .wait()
        .await
        .unwrap();
    assert_eq!(stats.dispatched, 5, "{name}");
    let seen = seen.lock().unwrap().clone();
    for e in &enq {
        assert_eq!(seen.get(&e.message_id), Some(&1), "{name}");
    }
    assert!(db.rows().await.iter().all(|r| r.attempts == 1), "{name}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_shutdown_releases_in_flight_claims() {
    shutdown_releases_in_flight_claims(TestDb::pg("shut").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_shutdown_releases_in_flight_claims() {
    shutdown_releases_in_flight_claims(TestDb::sqlite().await).await;
}

async fn pause_stops_relays_not_producers(db: TestDb) {
    let name = db.name();
    let store = db.store();
    store.set_pause(Some("x")).await.unwrap();
    let p = store.pause_state().await.unwrap();
    assert!(p.paused, "{name}");
    assert_eq!(p.reason.as_deref(), Some("x"));

    let (sink, seen) = RecordingSink::new();
    let handle = Relay::new(store.clone(), sink, relay_config("relay-paused")).spawn();
    // Producers keep writing while paused.
    let enq = db.enqueue_all(&messages("t.pause.v1", 10)).await;
    assert!(enq.iter().all(|e| e.inserted));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(total(&seen), 0, "{name}: published while paused");
    let c = store.counts().await.unwrap();
    assert_eq!((c.pending, c.claimed, c.dispatched), (10, 0, 0), "{name}");

    // A drain on a paused outbox refuses, naming the reason.
    let mut cfg = relay_config("relay-drain");
    cfg.drain = true;
    let (sink2, seen2) = RecordingSink::new();
    match Relay::new(store.clone(), sink2, cfg).spawn().wait().await {
        Err(RelayError::Paused { reason }) => assert_eq!(reason, "x"),
        other => panic!("{name}: expected Paused, got {other:?}"),
    }
    assert_eq!(total(&seen2), 0);

    store.set_pause(None).await.unwrap();
    assert!(!store.pause_state().await.unwrap().paused);
    let s = store.clone();
    wait_until("delivery after resume", Duration::from_secs(5), || {
        let s = s.clone();
        async move {
            let c = s.counts().await.unwrap();
            if c.dispatched == 10 {
                Ok(())
            } else {
                Err(format!("{c:?}"))
            }
        }
    })
    .await;
    assert_eq!(total(&seen), 10, "{name}: each once");

    // Paused again under the running relay: once it has seen the switch (it reads it at
    // most a second apart), new rows wait.
    store.set_pause(Some("again")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1600)).await;
    db.enqueue_all(&messages("t.pause.v1", 3)).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(total(&seen), 10, "{name}: published while paused");
    assert_eq!(store.counts().await.unwrap().pending, 3);
    // Shutdown of a paused relay is prompt.
    let start = std::time::Instant::now();
    let stats = handle.shutdown().await.unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(stats.dispatched, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_pause_stops_relays_not_producers() {
    pause_stops_relays_not_producers(TestDb::pg("pause").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_pause_stops_relays_not_producers() {
    pause_stops_relays_not_producers(TestDb::sqlite().await).await;
}

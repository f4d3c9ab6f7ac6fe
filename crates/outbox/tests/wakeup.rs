//! The relay loop wakes on the store's signal (PostgreSQL `NOTIFY`, SQLite
//! `data_version`), not only on its poll: with a poll interval far longer than the test, a
//! commit still gets delivered at once.

#![allow(clippy::unwrap_used)]

mod common;

use common::{RecordingSink, TestDb, messages, relay_config, wait_until};
use outbox::Relay;
use std::time::{Duration, Instant};

async fn commit_wakes_an_idle_relay(db: TestDb) {
    let name = db.name();
    let store = db.store();
    let (sink, _seen) = RecordingSink::new();
    let mut cfg = relay_config("relay-idle");
    cfg.poll_interval = Duration::from_secs(60);
    let handle = Relay::new(store.clone(), sink, cfg).spawn();
    // Let it find nothing and go to sleep on its wake-up channel.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(handle.stats().batches, 0);

    for round in 1..=3 {
        let start = Instant::now();
        db.enqueue_all(&messages("t.wake.v1", 1)).await;
        let s = store.clone();
        wait_until("delivery without polling", Duration::from_secs(5), || {
            let s = s.clone();
            async move {
                let c = s.counts().await.unwrap();
                if c.dispatched == round {
                    Ok(())
                } else {
                    Err(format!("{c:?}"))
                }
            }
        })
        .await;
        let took = start.elapsed();
        assert!(
            took < Duration::from_secs(3),
            "{name}: woke too late: {took:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.dispatched, 3, "{name}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_commit_wakes_an_idle_relay() {
    commit_wakes_an_idle_relay(TestDb::pg("wake").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_commit_wakes_an_idle_relay() {
    commit_wakes_an_idle_relay(TestDb::sqlite().await).await;
}

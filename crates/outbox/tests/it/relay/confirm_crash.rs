//! Guarantee 3: a crash between the broker's confirmation and the mark causes a duplicate
//! publish with the same message id, never a loss; JetStream's duplicate window (keyed on
//! `Nats-Msg-Id` = message id) keeps exactly one copy in the stream.

#![allow(clippy::unwrap_used)]

use crate::common::relay_config;
use crate::common::{RecordingWrapper, Seen, TestStream, messages, nats_connect};
use crate::store::conformance::Backend as _;
use outbox::Relay;
use outbox::store::status;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

const N: usize = 50;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_after_confirmation_republishes_same_id_and_stream_dedups() {
    let client = nats_connect().await;
    let stream = TestStream::shared(&client).await;
    let db = crate::store::conformance_postgres::PgBackend::create(
        "crash",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let store = db.store();
    let enq = db
        .enqueue_all(&messages(&stream.subject("orders"), N))
        .await;
    let ours: HashSet<String> = enq.iter().map(|e| e.message_id.to_string()).collect();

    // Relay 1 publishes everything, gets every PubAck, and dies before marking.
    let mut cfg = relay_config("relay-crashing");
    cfg.batch_size = 100;
    cfg.lease = Duration::from_secs(3);
    cfg.publish_timeout = Duration::from_millis(2500);
    let results = crate::common::relay_killed_after_confirmation(&store, cfg).await;
    assert_eq!(results.len(), N);

    // The broker has every message; the store still has every row claimed.
    assert_eq!(stream.message_count(&client).await, N as u64);
    for r in db.rows().await {
        assert_eq!(r.status, status::CLAIMED, "{r:?}");
        assert_eq!(r.attempts, 1);
        assert_eq!(r.claimed_by.as_deref(), Some("relay-crashing"));
    }

    // Relay 2 takes the rows over after relay 1's lease and publishes them again.
    let seen: Seen = Arc::default();
    let mut cfg = relay_config("relay-recovering");
    cfg.lease = Duration::from_secs(10);
    cfg.publish_timeout = Duration::from_secs(5);
    let second = Relay::new(
        store.clone(),
        Arc::new(RecordingWrapper {
            inner: crate::common::nats_sink().await,
            seen: seen.clone(),
        }),
        cfg,
    )
    .spawn();
    let s = store.clone();
    crate::common::wait_dispatched("all dispatched by relay 2", &s, N, Duration::from_secs(15))
        .await;
    let stats = second.shutdown().await.unwrap();
    assert_eq!(stats.dispatched, N as u64, "{stats:?}");

    // Relay 2 really published every message a second time ...
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), N);
        assert!(seen.values().all(|&n| n == 1), "{seen:?}");
    }
    for r in db.rows().await {
        assert_eq!(r.status, status::DISPATCHED);
        assert_eq!(r.attempts, 2, "one attempt per claim");
        assert_eq!(r.claimed_by.as_deref(), Some("relay-recovering"));
    }
    // ... with the same Nats-Msg-Id, so the stream kept exactly one copy of each.
    assert_eq!(stream.message_count(&client).await, N as u64);
    let ids = stream.msg_ids(&client).await;
    assert_eq!(ids.len(), N);
    assert_eq!(ids.iter().cloned().collect::<HashSet<_>>(), ours);
}

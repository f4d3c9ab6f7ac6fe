//! The relay over a store, on SQLite with recording sinks: what the relay decides (pause,
//! graceful shutdown, poison, crash loops). What each needs of a store (the pause switch,
//! release, retry, quarantine, attempts counted at the claim) is a store-suite case run
//! on every store (`store::conformance::pause`, `store::conformance::lifecycle`); these run once.

use crate::common::wait_dispatched;
use crate::common::{RecordingSink, Seen, messages, record, relay_config, total};
use crate::store::conformance::{Backend, DEFAULT_MAX, claim};
use crate::store::conformance_sqlite::SqliteBackend as B;
use async_trait::async_trait;
use outbox::message::{Message, OutgoingMessage};
use outbox::sink::{Confirmations, PublishError, Sink};
use outbox::store::status;
use outbox::{Relay, RelayError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// While paused, a running relay publishes nothing and producers keep writing; a drain
/// refuses to start, naming the reason; resume delivers everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pause_stops_relays_not_producers() {
    let b = B::create("pause", DEFAULT_MAX).await;
    let store = b.store();
    let p = store.pause_state().await.unwrap();
    assert!(!p.paused && p.reason.is_none(), "{p:?}");

    let (sink, seen) = RecordingSink::new();
    let handle = Relay::new(store.clone(), sink, relay_config("relay-pause")).spawn();
    b.enqueue_all(&messages("t.pause.v1", 5)).await;
    wait_dispatched("5 rows dispatched", &store, 5, Duration::from_secs(10)).await;

    let t0 = b.db_now_us().await;
    store.set_pause(Some("maintenance window")).await.unwrap();
    let t1 = b.db_now_us().await;
    let p = store.pause_state().await.unwrap();
    assert!(p.paused);
    assert_eq!(p.reason.as_deref(), Some("maintenance window"));
    let changed = p.changed_at.unwrap().timestamp_micros();
    assert!(
        changed >= t0 - 1_000 && changed <= t1 + 1_000,
        "changed_at on the database clock: {changed} vs [{t0}, {t1}]"
    );

    // The claim itself honours the switch: from now on the relay publishes nothing, while
    // producers keep writing.
    let later = b.enqueue_all(&messages("t.pause.v1", 10)).await;
    assert!(later.iter().all(|e| e.inserted));
    // Ten claims after the commit (a poll every 100 ms): each found nothing.
    crate::common::wait_claims(
        "ten claims while paused",
        &handle,
        10,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(total(&seen), 5, "published while paused");
    let c = store.counts().await.unwrap();
    assert_eq!((c.pending, c.claimed, c.dispatched), (10, 0, 5), "{c:?}");

    let mut cfg = relay_config("relay-drain");
    cfg.drain = true;
    let (sink2, seen2) = RecordingSink::new();
    match Relay::new(store.clone(), sink2, cfg).spawn().wait().await {
        Err(RelayError::Paused { reason }) => assert_eq!(reason, "maintenance window"),
        other => panic!("expected Paused, got {other:?}"),
    }
    assert_eq!(total(&seen2), 0);

    store.set_pause(None).await.unwrap();
    let p = store.pause_state().await.unwrap();
    assert!(!p.paused && p.reason.is_none(), "{p:?}");
    wait_dispatched("15 rows dispatched", &store, 15, Duration::from_secs(10)).await;
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.dispatched, 15);
    let seen = seen.lock().unwrap().clone();
    for e in &later {
        assert_eq!(seen.get(&e.message_id), Some(&1));
    }
}

/// Reports each batch it is handed, then never answers.
struct BlackHole {
    handed: tokio::sync::mpsc::UnboundedSender<usize>,
}

#[async_trait]
impl Sink for BlackHole {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        let results: Vec<Result<(), PublishError>> = async {
            let _ = self.handed.send(batch.len());
            std::future::pending().await
        }
        .await;
        for (i, r) in results.into_iter().enumerate() {
            confirm.set(i, r);
        }
    }

    fn describe(&self) -> String {
        "black hole".into()
    }
}

/// Graceful shutdown with a sink that never answers: after the grace period the relay
/// releases its claims (attempt given back, due at once), and another relay delivers them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_releases_in_flight_claims() {
    let b = B::create("shut", DEFAULT_MAX).await;
    let store = b.store();
    let enq = b.enqueue_all(&messages("t.shutdown.v1", 5)).await;
    let ids: Vec<i64> = enq.iter().map(|e| e.id).collect();

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut cfg = relay_config("relay-shutdown");
    cfg.shutdown_grace = Duration::from_millis(300);
    cfg.publish_timeout = Duration::from_secs(20);
    let handle = Relay::new(store.clone(), Arc::new(BlackHole { handed: tx }), cfg).spawn();
    let n = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("the relay never published")
        .unwrap();
    assert_eq!(n, 5);
    for r in b.rows_of(&ids).await {
        assert_eq!((r.status, r.attempts), (status::CLAIMED, 1), "{r:?}");
    }

    let start = Instant::now();
    let stats = tokio::time::timeout(Duration::from_secs(10), handle.shutdown())
        .await
        .expect("shutdown() did not return")
        .unwrap();
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(250),
        "shutdown skipped the grace: {took:?}"
    );
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert_eq!((stats.released, stats.dispatched), (5, 0), "{stats:?}");
    let now = b.db_now_us().await;
    for r in b.rows_of(&ids).await {
        assert_eq!((r.status, r.attempts), (status::PENDING, 0), "{r:?}");
        assert_eq!((r.claim_token, r.locked_until), (None, None));
        assert!(r.available_at <= now, "released rows are due at once");
    }

    let (sink, seen) = RecordingSink::new();
    let mut cfg = relay_config("relay-after");
    cfg.drain = true;
    let stats = Relay::new(store.clone(), sink, cfg)
        .spawn()
        .wait()
        .await
        .unwrap();
    assert_eq!(stats.dispatched, 5);
    let seen = seen.lock().unwrap().clone();
    for e in &enq {
        assert_eq!(seen.get(&e.message_id), Some(&1));
    }
    assert!(b.rows_of(&ids).await.iter().all(|r| r.attempts == 1));
}

/// Fails `permanent` with a permanent error and `transient` with a transient one, always;
/// confirms everything else. Counts every message it is handed.
struct Poisoned {
    inner: Arc<RecordingSink>,
    permanent: Uuid,
    transient: Uuid,
    handed: Seen,
}

#[async_trait]
impl Sink for Poisoned {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        let results: Vec<Result<(), PublishError>> = async {
            record(&self.handed, batch);
            let healthy: Vec<OutgoingMessage> = batch
                .iter()
                .filter(|m| m.message_id != self.permanent && m.message_id != self.transient)
                .cloned()
                .collect();
            let mut inner = self.inner.publish_all(&healthy).await.into_iter();
            batch
                .iter()
                .map(|m| {
                    if m.message_id == self.permanent {
                        Err(PublishError::permanent(
                            "broker refused: unauthorised topic",
                        ))
                    } else if m.message_id == self.transient {
                        Err(PublishError::transient("broker busy, try later"))
                    } else {
                        inner.next().unwrap()
                    }
                })
                .collect()
        }
        .await;
        for (i, r) in results.into_iter().enumerate() {
            confirm.set(i, r);
        }
    }

    fn describe(&self) -> String {
        "poisoned".into()
    }
}

/// A relay (max_attempts 3) over a queue headed by a permanently failing and a forever
/// transiently failing message: the first is dead after 1 attempt, the second after 3,
/// and every row behind them is dispatched once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn poison_is_bounded_and_later_rows_flow() {
    let b = B::create("poison", DEFAULT_MAX).await;
    let store = b.store();
    let permanent = Message::new("t.poison.v1", b"perm".to_vec());
    let transient = Message::new("t.poison.v1", b"trans".to_vec());
    let mut msgs = vec![permanent.clone(), transient.clone()];
    msgs.extend(messages("t.poison.v1", 20));
    let enq = b.enqueue_all(&msgs).await;

    let (inner, delivered) = RecordingSink::new();
    let handed: Seen = Arc::default();
    let sink = Arc::new(Poisoned {
        inner,
        permanent: permanent.id(),
        transient: transient.id(),
        handed: handed.clone(),
    });
    let mut cfg = relay_config("relay-poison");
    cfg.max_attempts = 3;
    cfg.batch_size = 8;
    cfg.backoff_base = Duration::from_millis(50);
    cfg.backoff_max = Duration::from_millis(100);
    let handle = Relay::new(store.clone(), sink, cfg).spawn();
    // Rows enqueued while the poison is being retried flow too.
    let late = b.enqueue_all(&messages("t.poison.v1", 5)).await;
    crate::common::wait_settled(
        "healthy rows dispatched, 2 dead",
        &store,
        25,
        2,
        Duration::from_secs(15),
    )
    .await;
    // The relay counts a settled batch once its settle returns.
    crate::common::wait_until(
        "the relay counted every outcome",
        Duration::from_secs(10),
        || {
            let s = handle.stats();
            async move {
                if (s.quarantined, s.retried, s.dispatched) == (2, 2, 25) {
                    Ok(())
                } else {
                    Err(format!("{s:?}"))
                }
            }
        },
    )
    .await;
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.quarantined, 2, "{stats:?}");
    assert_eq!(stats.retried, 2, "{stats:?}");
    assert_eq!(stats.dispatched, 25, "{stats:?}");

    let perm = b.row(enq[0].id).await;
    assert_eq!((perm.status, perm.attempts), (status::DEAD, 1), "{perm:?}");
    let e = perm.last_error.unwrap();
    assert!(e.contains("unauthorised topic"), "{e}");
    let trans = b.row(enq[1].id).await;
    assert_eq!(
        (trans.status, trans.attempts),
        (status::DEAD, 3),
        "{trans:?}"
    );
    let e = trans.last_error.unwrap();
    assert!(
        e.contains("broker busy, try later") && e.contains("3 attempts"),
        "{e}"
    );

    let handed = handed.lock().unwrap().clone();
    assert_eq!(handed[&permanent.id()], 1);
    assert_eq!(handed[&transient.id()], 3);
    let delivered = delivered.lock().unwrap().clone();
    assert_eq!(delivered.len(), 25);
    for e in enq.iter().skip(2).chain(&late) {
        assert_eq!(delivered.get(&e.message_id), Some(&1));
    }
    assert_eq!(b.count("1 = 1").await, 27, "dead rows are kept for replay");
}

/// A message whose every claim ends without an outcome (it crashes the relay) is
/// quarantined once its claims exceed `max_attempts`, without being published again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_looping_claims_are_bounded() {
    let b = B::create("crashloop", DEFAULT_MAX).await;
    let store = b.store();
    let enq = b.enqueue_all(&messages("t.crashloop.v1", 1)).await;
    for i in 0..2 {
        let c = claim(
            &store,
            &format!("crashed-{i}"),
            10,
            Duration::from_millis(300),
        )
        .await;
        assert_eq!(c.messages.len(), 1);
        crate::common::wait_until(
            "the crashed claim's lease ended",
            Duration::from_secs(10),
            || {
                let store = store.clone();
                async move {
                    match store.overview(0).await.unwrap().expired_claims {
                        1 => Ok(()),
                        n => Err(format!("{n} expired claims")),
                    }
                }
            },
        )
        .await;
    }
    let (sink, seen) = RecordingSink::new();
    let mut cfg = relay_config("relay-survivor");
    cfg.max_attempts = 2;
    cfg.drain = true;
    let stats = Relay::new(store.clone(), sink, cfg)
        .spawn()
        .wait()
        .await
        .unwrap();
    assert_eq!(stats.quarantined, 1, "{stats:?}");
    assert!(
        seen.lock().unwrap().is_empty(),
        "published past max_attempts"
    );
    let r = b.row(enq[0].id).await;
    assert_eq!((r.status, r.attempts), (status::DEAD, 3), "{r:?}");
    let e = r.last_error.unwrap();
    assert!(e.contains("exceeds max_attempts 2"), "{e}");
}

/// `--on-dispatch delete`: every confirmed row is deleted in its settle, each message is
/// delivered once, and nothing is left to purge.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleting_relay_delivers_everything_and_keeps_no_rows() {
    let b = B::create("delete", DEFAULT_MAX).await;
    let store = b.store();
    let enq = b.enqueue_all(&messages("t.delete.v1", 30)).await;
    let (sink, seen) = RecordingSink::new();
    let mut cfg = relay_config("relay-delete");
    cfg.drain = true;
    cfg.batch_size = 8;
    cfg.on_dispatch = outbox::OnDispatch::Delete;
    let stats = Relay::new(store.clone(), sink, cfg)
        .spawn()
        .wait()
        .await
        .unwrap();
    assert_eq!(stats.dispatched, 30, "{stats:?}");
    let seen = seen.lock().unwrap().clone();
    for e in &enq {
        assert_eq!(seen.get(&e.message_id), Some(&1));
    }
    assert_eq!(b.count("1 = 1").await, 0, "no dispatched rows are kept");
    let c = store.counts().await.unwrap();
    assert_eq!((c.pending, c.claimed, c.dispatched, c.dead), (0, 0, 0, 0));
}

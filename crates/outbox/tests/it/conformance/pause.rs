//! Store conformance: pause, and graceful shutdown.

use super::*;

/// While paused, a running relay publishes nothing and producers keep writing; a drain
/// refuses to start, naming the reason; resume delivers everything.
pub(crate) async fn pause_stops_relays_not_producers<B: Backend>() {
    let b = B::create("pause", DEFAULT_MAX).await;
    let store = b.store();
    let p = store.pause_state().await.unwrap();
    assert!(!p.paused && p.reason.is_none(), "{p:?}");

    let (sink, seen) = RecordingSink::new();
    let handle = Relay::new(store.clone(), sink, relay_config("relay-pause")).spawn();
    b.enqueue_all(&messages("t.pause.v1", 5)).await;
    wait_dispatched(&store, 5, Duration::from_secs(10)).await;

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

    // A relay reads the switch at most a second apart; from then on it publishes nothing,
    // while producers keep writing.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let later = b.enqueue_all(&messages("t.pause.v1", 10)).await;
    assert!(later.iter().all(|e| e.inserted));
    tokio::time::sleep(Duration::from_millis(1500)).await;
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
    wait_dispatched(&store, 15, Duration::from_secs(10)).await;
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
pub(crate) async fn shutdown_releases_in_flight_claims<B: Backend>() {
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

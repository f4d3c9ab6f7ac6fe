//! Store conformance: poison messages.

use super::*;

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
pub(crate) async fn poison_is_bounded_and_later_rows_flow<B: Backend>() {
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
    let s = store.clone();
    wait_until(
        "healthy rows dispatched, 2 dead",
        Duration::from_secs(15),
        || {
            let s = s.clone();
            async move {
                let c = s.counts().await.unwrap();
                if c.dispatched == 25 && c.dead == 2 && c.pending == 0 && c.claimed == 0 {
                    Ok(())
                } else {
                    Err(format!("{c:?}"))
                }
            }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
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
pub(crate) async fn crash_looping_claims_are_bounded<B: Backend>() {
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
        tokio::time::sleep(Duration::from_millis(400)).await;
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

//! Guarantee 6: a poison message is retried a bounded number of times, then quarantined;
//! a permanent error quarantines at once; every other message keeps flowing.

#![allow(clippy::unwrap_used)]

mod common;

use async_trait::async_trait;
use common::{RecordingSink, Seen, TestDb, messages, record, relay_config, wait_until};
use outbox::message::OutgoingMessage;
use outbox::sink::{PublishError, Sink};
use outbox::store::{ClaimRequest, status};
use outbox::{Message, Relay};
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

/// Fails `permanent` with a permanent error and `transient` with a transient one, always;
/// hands everything else to the inner sink. Counts every message it is handed.
struct Poisoned {
    inner: Arc<RecordingSink>,
    permanent: Uuid,
    transient: Uuid,
    handed: Seen,
}

#[async_trait]
impl Sink for Poisoned {
    async fn publish(&self, batch: &[OutgoingMessage]) -> Vec<Result<(), PublishError>> {
        record(&self.handed, batch);
        let healthy: Vec<OutgoingMessage> = batch
            .iter()
            .filter(|m| m.message_id != self.permanent && m.message_id != self.transient)
            .cloned()
            .collect();
        let mut inner = self.inner.publish(&healthy).await.into_iter();
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

    fn describe(&self) -> String {
        "poisoned".into()
    }
}

async fn poison_is_bounded_and_others_flow(db: TestDb) {
    let name = db.name();
    let store = db.store();
    let mut msgs = messages("t.poison.v1", 20);
    // The poison messages come first, so they head the queue.
    let permanent = Message::new("t.poison.v1", b"perm".to_vec());
    let transient = Message::new("t.poison.v1", b"trans".to_vec());
    msgs.insert(0, transient.clone());
    msgs.insert(0, permanent.clone());
    let enq = db.enqueue_all(&msgs).await;

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
    cfg.backoff_base = Duration::from_millis(20);
    cfg.backoff_max = Duration::from_millis(50);
    let handle = Relay::new(store.clone(), sink, cfg).spawn();

    // Later messages flow while the transient one is still being retried.
    let late = db.enqueue_all(&messages("t.poison.v1", 5)).await;
    let s = store.clone();
    wait_until(
        "all healthy dispatched, 2 dead",
        Duration::from_secs(10),
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
    // A little longer: nothing more happens to the dead rows.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stats = handle.shutdown().await.unwrap();
    assert_eq!(stats.quarantined, 2, "{name}: {stats:?}");
    assert_eq!(stats.retried, 2, "{name}: {stats:?}");
    assert_eq!(stats.dispatched, 25, "{name}: {stats:?}");

    let perm = db.row(enq[0].id).await;
    assert_eq!(perm.status, i32::from(status::DEAD), "{name}");
    assert_eq!(perm.attempts, 1, "{name}: permanent errors are not retried");
    let e = perm.last_error.unwrap();
    assert!(e.contains("unauthorised topic"), "{name}: {e}");
    assert!(e.starts_with("permanent"), "{name}: {e}");

    let trans = db.row(enq[1].id).await;
    assert_eq!(trans.status, i32::from(status::DEAD), "{name}");
    assert_eq!(trans.attempts, 3, "{name}: exactly max_attempts");
    let e = trans.last_error.unwrap();
    assert!(e.contains("broker busy, try later"), "{name}: {e}");
    assert!(e.contains("3 attempts"), "{name}: {e}");

    let handed = handed.lock().unwrap().clone();
    assert_eq!(handed[&permanent.id()], 1, "{name}");
    assert_eq!(handed[&transient.id()], 3, "{name}");
    let delivered = delivered.lock().unwrap().clone();
    assert_eq!(delivered.len(), 25, "{name}");
    for e in enq.iter().skip(2).chain(&late) {
        assert_eq!(delivered.get(&e.message_id), Some(&1), "{name}");
    }
    // Dead rows stay in the table (for replay); nothing was deleted.
    assert_eq!(db.rows().await.len(), 27);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_poison_is_bounded_and_others_flow() {
    poison_is_bounded_and_others_flow(TestDb::pg("poison").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_poison_is_bounded_and_others_flow() {
    poison_is_bounded_and_others_flow(TestDb::sqlite().await).await;
}

/// A message that kills every relay that claims it (each claim ends without an outcome)
/// is quarantined once its claims exceed `max_attempts`, without being published again.
async fn crashing_claims_are_bounded(db: TestDb) {
    let name = db.name();
    let store = db.store();
    let enq = db.enqueue_all(&messages("t.crashloop.v1", 1)).await;
    for i in 0..2 {
        let c = store
            .claim(&ClaimRequest {
                relay_id: format!("crashed-{i}"),
                batch_size: 10,
                lease: Duration::from_millis(300),
            })
            .await
            .unwrap();
        assert_eq!(c.messages.len(), 1, "{name}");
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
    assert_eq!(stats.quarantined, 1, "{name}: {stats:?}");
    assert!(
        seen.lock().unwrap().is_empty(),
        "{name}: published past max_attempts"
    );
    let r = db.row(enq[0].id).await;
    assert_eq!(
        (r.status, r.attempts),
        (i32::from(status::DEAD), 3),
        "{name}"
    );
    let e = r.last_error.unwrap();
    assert!(e.contains("exceeds max_attempts 2"), "{name}: {e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_crashing_claims_are_bounded() {
    crashing_claims_are_bounded(TestDb::pg("crashloop").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_crashing_claims_are_bounded() {
    crashing_claims_are_bounded(TestDb::sqlite().await).await;
}

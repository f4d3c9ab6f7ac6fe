//! Guarantee 5: a stale claimant (its lease expired and another relay claimed the rows)
//! cannot mark, retry, kill or release rows it no longer owns; the new owner can.

#![allow(clippy::unwrap_used)]

mod common;

use common::{TestDb, messages};
use outbox::store::{ClaimRequest, Dead, Retry, status};
use std::time::Duration;

async fn stale_claimant_changes_nothing(db: TestDb) {
    let name = db.name();
    let store = db.store();
    let enq = db.enqueue_all(&messages("t.stale.v1", 3)).await;
    let ids: Vec<i64> = enq.iter().map(|e| e.id).collect();

    let old = store
        .claim(&ClaimRequest {
            relay_id: "relay-old".into(),
            batch_size: 10,
            lease: Duration::from_millis(700),
        })
        .await
        .unwrap();
    assert_eq!(
        old.messages.iter().map(|m| m.id).collect::<Vec<_>>(),
        ids,
        "{name}"
    );
    // While the lease holds, nobody else gets the rows.
    let during = store
        .claim(&ClaimRequest {
            relay_id: "relay-eager".into(),
            batch_size: 10,
            lease: Duration::from_secs(30),
        })
        .await
        .unwrap();
    assert!(during.messages.is_empty(), "{name}: claims overlapped");

    tokio::time::sleep(Duration::from_millis(900)).await;
    let new = store
        .claim(&ClaimRequest {
            relay_id: "relay-new".into(),
            batch_size: 10,
            lease: Duration::from_secs(30),
        })
        .await
        .unwrap();
    assert_ne!(new.token, old.token);
    assert_eq!(new.messages.len(), 3, "{name}: expired claims come back");
    assert!(
        new.messages.iter().all(|m| m.attempts == 2),
        "{name}: the expired claim's attempt stays counted"
    );

    let before = db.rows().await;
    for r in &before {
        assert_eq!(r.status, i32::from(status::CLAIMED));
        assert_eq!(r.claimed_by.as_deref(), Some("relay-new"));
        assert_eq!(
            r.claim_token.as_deref().map(str::to_lowercase),
            Some(new.token.hyphenated().to_string())
        );
    }

    // Every update by the old token is a no-op.
    assert_eq!(
        store.mark_dispatched(old.token, &ids).await.unwrap(),
        0,
        "{name}"
    );
    assert_eq!(db.rows().await, before, "{name}: stale mark changed rows");
    let retries: Vec<Retry> = ids
        .iter()
        .map(|&id| Retry {
            id,
            delay: Duration::from_secs(60),
            error: "stale retry".into(),
        })
        .collect();
    assert_eq!(
        store.reschedule(old.token, &retries).await.unwrap(),
        0,
        "{name}"
    );
    assert_eq!(
        db.rows().await,
        before,
        "{name}: stale reschedule changed rows"
    );
    let dead: Vec<Dead> = ids
        .iter()
        .map(|&id| Dead {
            id,
            error: "stale kill".into(),
        })
        .collect();
    assert_eq!(
        store.quarantine(old.token, &dead).await.unwrap(),
        0,
        "{name}"
    );
    assert_eq!(
        db.rows().await,
        before,
        "{name}: stale quarantine changed rows"
    );
    assert_eq!(store.release(old.token, &ids).await.unwrap(), 0, "{name}");
    assert_eq!(
        db.rows().await,
        before,
        "{name}: stale release changed rows"
    );

    // The new owner's updates work, one of each.
    assert_eq!(
        store.mark_dispatched(new.token, &ids[..1]).await.unwrap(),
        1
    );
    assert_eq!(
        store
            .reschedule(
                new.token,
                &[Retry {
                    id: ids[1],
                    delay: Duration::from_secs(60),
                    error: "try later".into(),
                }]
            )
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        store
            .quarantine(
                new.token,
                &[Dead {
                    id: ids[2],
                    error: "poison".into(),
                }]
            )
            .await
            .unwrap(),
        1
    );
    let after = db.rows().await;
    assert_eq!(after[0].status, i32::from(status::DISPATCHED), "{name}");
    assert!(after[0].dispatched_at.is_some());
    assert_eq!(after[1].status, i32::from(status::PENDING), "{name}");
    assert_eq!(after[1].last_error.as_deref(), Some("try later"));
    assert!(!db.is_due(ids[1]).await, "{name}: backoff is in the row");
    assert_eq!(after[2].status, i32::from(status::DEAD), "{name}");
    assert_eq!(after[2].last_error.as_deref(), Some("poison"));
    for r in &after {
        assert_eq!(r.claim_token, None, "{name}: settled rows drop the token");
    }

    // Once settled, even the right token changes nothing a second time.
    assert_eq!(store.mark_dispatched(new.token, &ids).await.unwrap(), 0);
    assert_eq!(store.release(new.token, &ids).await.unwrap(), 0);
    assert_eq!(db.rows().await, after, "{name}");
    let c = store.counts().await.unwrap();
    assert_eq!((c.pending, c.claimed, c.dispatched, c.dead), (1, 0, 1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_stale_claimant_changes_nothing() {
    stale_claimant_changes_nothing(TestDb::pg("stale").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_stale_claimant_changes_nothing() {
    stale_claimant_changes_nothing(TestDb::sqlite().await).await;
}

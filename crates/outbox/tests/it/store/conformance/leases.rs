//! Store conformance: lease expiry and the stale claimant.

use super::*;
use outbox::store::prelude::*;

/// A claim with a short lease that is never settled: while it holds, nobody else gets the
/// rows; after it, another claim does (attempt 2), and the stale claimant's mark,
/// reschedule, quarantine and release each change nothing.
pub(crate) async fn expired_lease_fences_the_stale_claimant<B: Backend>() {
    let b = B::create("stale", DEFAULT_MAX).await;
    let store = b.store();
    let enq = b.enqueue_all(&messages("t.stale.v1", 3)).await;
    let ids: Vec<i64> = enq.iter().map(|e| e.id).collect();

    let old = claim(&store, "relay-old", 10, Duration::from_secs(1)).await;
    assert_eq!(claim_ids(&old), ids);
    let during = claim(&store, "relay-eager", 10, LONG).await;
    assert!(
        during.messages.is_empty(),
        "claims overlapped while the lease held"
    );

    wait_until("relay-old's lease ended", Duration::from_secs(10), || {
        let store = store.clone();
        async move {
            match store.overview(0).await.unwrap().expired_claims {
                3 => Ok(()),
                n => Err(format!("{n} expired claims")),
            }
        }
    })
    .await;
    let new = claim(&store, "relay-new", 10, LONG).await;
    assert_ne!(new.token, old.token);
    assert_eq!(claim_ids(&new), ids, "expired claims come back");
    assert!(
        new.messages.iter().all(|m| m.attempts == 2),
        "the expired claim's attempt stays counted"
    );

    let before = b.rows_of(&ids).await;
    for r in &before {
        assert_eq!(r.status, status::CLAIMED);
        assert_eq!(r.claimed_by.as_deref(), Some("relay-new"));
        assert_eq!(r.claim_token, Some(new.token));
    }

    // Every update by the stale token is a no-op: 0 rows, and no column changes.
    assert_eq!(store.mark_dispatched(old.token, &ids).await.unwrap(), 0);
    assert_eq!(b.rows_of(&ids).await, before, "stale mark changed rows");
    let retries: Vec<Retry> = ids
        .iter()
        .map(|&id| Retry {
            id,
            delay: Duration::from_secs(60),
            error: "stale retry".into(),
            refund_attempt: false,
        })
        .collect();
    assert_eq!(store.reschedule(old.token, &retries).await.unwrap(), 0);
    assert_eq!(
        b.rows_of(&ids).await,
        before,
        "stale reschedule changed rows"
    );
    let dead: Vec<Dead> = ids
        .iter()
        .map(|&id| Dead {
            id,
            error: "stale kill".into(),
        })
        .collect();
    assert_eq!(store.quarantine(old.token, &dead).await.unwrap(), 0);
    assert_eq!(
        b.rows_of(&ids).await,
        before,
        "stale quarantine changed rows"
    );
    assert_eq!(store.release(old.token, &ids).await.unwrap(), 0);
    assert_eq!(b.rows_of(&ids).await, before, "stale release changed rows");

    // The owner's updates work, one of each.
    assert_eq!(
        store.mark_dispatched(new.token, &ids[..1]).await.unwrap(),
        1
    );
    let retry = Retry {
        id: ids[1],
        delay: Duration::from_secs(60),
        error: "try later".into(),
        refund_attempt: false,
    };
    assert_eq!(store.reschedule(new.token, &[retry]).await.unwrap(), 1);
    let kill = Dead {
        id: ids[2],
        error: "poison".into(),
    };
    assert_eq!(store.quarantine(new.token, &[kill]).await.unwrap(), 1);
    let after = b.rows_of(&ids).await;
    assert_eq!(after[0].status, status::DISPATCHED);
    assert_eq!(after[1].status, status::PENDING);
    assert_eq!(after[1].last_error.as_deref(), Some("try later"));
    assert_eq!(after[2].status, status::DEAD);
    assert_eq!(after[2].last_error.as_deref(), Some("poison"));
    assert!(after.iter().all(|r| r.claim_token.is_none()));
    // The stale token still changes nothing after the owner settled.
    assert_eq!(store.mark_dispatched(old.token, &ids).await.unwrap(), 0);
    assert_eq!(store.release(old.token, &ids).await.unwrap(), 0);
    assert_eq!(b.rows_of(&ids).await, after);
}

/// `Views::leases` counts claimed rows whose lease has not ended on the database clock and
/// says when the last one ends: pending rows (delayed ones included), expired claims and
/// settled rows are not counted; nothing held is `0, None, None`.
pub(crate) async fn leases_count_live_claims_until_their_last_end<B: Backend>() {
    let b = B::create("leases", DEFAULT_MAX).await;
    let store = b.store();
    let nothing = outbox::store::Leases {
        held: 0,
        last_ends_at: None,
        last_ends_in: None,
    };
    assert_eq!(store.leases().await.unwrap(), nothing, "an empty outbox");
    let mut msgs = messages("t.leases.v1", 5);
    msgs.push(Message::new("t.leases.v1", b"later".to_vec()).delay(Duration::from_secs(3600)));
    b.enqueue_all(&msgs).await;
    assert_eq!(
        store.leases().await.unwrap(),
        nothing,
        "pending rows hold no lease"
    );

    let short = claim(&store, "relay-short", 2, Duration::from_millis(1500)).await;
    let long_lease = Duration::from_secs(60);
    let before = b.db_now_us().await;
    let long = claim(&store, "relay-long", 2, long_lease).await;
    let after = b.db_now_us().await;
    assert_eq!((short.messages.len(), long.messages.len()), (2, 2));

    let l = store.leases().await.unwrap();
    assert_eq!(l.held, 4, "{l:?}");
    let ends_at = l.last_ends_at.expect("a last lease end").timestamp_micros();
    // The long claim's lease end, on the database clock (ms precision on SQLite).
    assert!(
        ends_at >= before + us(long_lease) - 1_000 && ends_at <= after + us(long_lease) + 1_000,
        "last lease end {ends_at} not within the long claim's [{before}, {after}] + 60 s"
    );
    let ends_in = l.last_ends_in.expect("time until the last lease end");
    assert!(
        ends_in > long_lease - Duration::from_secs(5)
            && ends_in <= long_lease + Duration::from_millis(1),
        "{ends_in:?}"
    );

    // Once the short lease has ended, its rows are claimable and no longer held.
    let s = store.clone();
    wait_until("the short lease ends", Duration::from_secs(10), || {
        let s = s.clone();
        async move {
            let l = s.leases().await.unwrap();
            if l.held == 2 {
                Ok(())
            } else {
                Err(format!("{l:?}"))
            }
        }
    })
    .await;
    assert_eq!(
        b.count("status = 1").await,
        4,
        "the expired claim is still status 1"
    );
    let l = store.leases().await.unwrap();
    assert_eq!(l.last_ends_at.map(|t| t.timestamp_micros()), Some(ends_at));

    // Settled rows hold nothing.
    assert_eq!(
        store
            .mark_dispatched(long.token, &claim_ids(&long))
            .await
            .unwrap(),
        2
    );
    assert_eq!(store.leases().await.unwrap(), nothing);
}

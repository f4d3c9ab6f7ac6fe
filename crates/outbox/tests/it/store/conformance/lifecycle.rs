//! Store conformance: row lifecycle.

use super::*;
use outbox::store::prelude::*;

/// pending → claim (status 1, attempts 1, token, lease on the database clock) → mark (2);
/// transient → reschedule (0, due after the delay on the database clock, last_error);
/// permanent → dead (3); release gives the claim's attempt back and makes the row due now.
pub(crate) async fn row_lifecycle<B: Backend>() {
    let b = B::create("life", DEFAULT_MAX).await;
    let store = b.store();
    let msgs = messages("t.life.v1", 4);
    let enq = b.enqueue_all(&msgs).await;
    let ids: Vec<i64> = enq.iter().map(|e| e.id).collect();
    assert!(enq.iter().all(|e| e.inserted));
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids grow: {ids:?}");
    let (a, bb, c, d) = (ids[0], ids[1], ids[2], ids[3]);

    let now = b.db_now_us().await;
    for r in b.rows_of(&ids).await {
        assert_eq!((r.status, r.attempts), (status::PENDING, 0), "{r:?}");
        assert_eq!(r.claimed_by, None);
        assert_eq!(r.claim_token, None);
        assert_eq!(r.locked_until, None);
        assert_eq!(r.dispatched_at, None);
        assert_eq!(r.last_error, None);
        assert!(r.available_at <= now, "a new row is due at once: {r:?}");
        assert!(
            r.occurred_at <= now && r.occurred_at > now - 10_000_000,
            "{r:?}"
        );
    }

    // Claim: all four, in id order, attempt counted, token and lease written.
    let t0 = b.db_now_us().await;
    // A relay id with quotes, a backslash and non-ASCII text: stored as given.
    let relay = "relay-ä 'a\\\"b";
    let first = claim(&store, relay, 10, Duration::from_secs(30)).await;
    let t1 = b.db_now_us().await;
    assert_eq!(claim_ids(&first), ids);
    assert!(first.malformed.is_empty());
    for (m, sent) in first.messages.iter().zip(&msgs) {
        assert_eq!(m.attempts, 1);
        assert_eq!(m.message_id, sent.id());
        assert_eq!(m.topic, "t.life.v1");
        assert_eq!(&m.payload[..], sent.payload());
    }
    for r in b.rows_of(&ids).await {
        assert_eq!((r.status, r.attempts), (status::CLAIMED, 1), "{r:?}");
        assert_eq!(r.claim_token, Some(first.token));
        assert_eq!(r.claimed_by.as_deref(), Some(relay));
        let lease = r.locked_until.unwrap();
        assert!(
            lease >= t0 + us(Duration::from_secs(30)) - 1_000
                && lease <= t1 + us(Duration::from_secs(30)) + 1_000,
            "locked_until = now + lease on the database clock: {lease} vs [{t0}, {t1}] + 30 s"
        );
    }
    // Held rows are not claimable.
    assert!(claim(&store, "relay-b", 10, LONG).await.messages.is_empty());

    // Mark: dispatched, token and lease cleared.
    assert_eq!(store.mark_dispatched(first.token, &[a]).await.unwrap(), 1);
    let t2 = b.db_now_us().await;
    let ra = b.row(a).await;
    assert_eq!((ra.status, ra.attempts), (status::DISPATCHED, 1), "{ra:?}");
    let at = ra.dispatched_at.unwrap();
    assert!(at >= t1 - 1_000 && at <= t2 + 1_000, "{at} vs [{t1}, {t2}]");
    assert_eq!(
        (ra.claim_token, ra.locked_until, ra.last_error),
        (None, None, None)
    );

    // Transient failure: pending again, due after the delay on the database clock.
    let delay = Duration::from_secs(5);
    let t3 = b.db_now_us().await;
    let n = store
        .reschedule(
            first.token,
            &[Retry {
                id: bb,
                delay,
                error: "broker busy".into(),
                refund_attempt: false,
            }],
        )
        .await
        .unwrap();
    let t4 = b.db_now_us().await;
    assert_eq!(n, 1);
    let rb = b.row(bb).await;
    assert_eq!((rb.status, rb.attempts), (status::PENDING, 1), "{rb:?}");
    assert_eq!(rb.last_error.as_deref(), Some("broker busy"));
    assert_eq!((rb.claim_token, rb.locked_until), (None, None));
    assert!(
        rb.available_at >= t3 + us(delay) - 1_000 && rb.available_at <= t4 + us(delay) + 1_000,
        "available_at = now + delay: {} vs [{t3}, {t4}] + 5 s",
        rb.available_at
    );

    // Permanent failure: dead, with the reason.
    let n = store
        .quarantine(
            first.token,
            &[Dead {
                id: c,
                error: "permanent: unroutable".into(),
            }],
        )
        .await
        .unwrap();
    assert_eq!(n, 1);
    let rc = b.row(c).await;
    assert_eq!((rc.status, rc.attempts), (status::DEAD, 1), "{rc:?}");
    assert_eq!(rc.last_error.as_deref(), Some("permanent: unroutable"));
    assert_eq!((rc.claim_token, rc.locked_until), (None, None));

    // Release (graceful shutdown): pending, attempt given back, due now.
    let t5 = b.db_now_us().await;
    assert_eq!(store.release(first.token, &[d]).await.unwrap(), 1);
    let t6 = b.db_now_us().await;
    let rd = b.row(d).await;
    assert_eq!((rd.status, rd.attempts), (status::PENDING, 0), "{rd:?}");
    assert_eq!((rd.claim_token, rd.locked_until), (None, None));
    assert!(
        rd.available_at >= t5 - 1_000 && rd.available_at <= t6 + 1_000,
        "a released row is due now: {} vs [{t5}, {t6}]",
        rd.available_at
    );

    // Settled rows: the same token changes nothing any more.
    let snapshot = b.rows_of(&ids).await;
    assert_eq!(store.mark_dispatched(first.token, &ids).await.unwrap(), 0);
    assert_eq!(store.release(first.token, &ids).await.unwrap(), 0);
    let retries: Vec<Retry> = ids
        .iter()
        .map(|&id| Retry {
            id,
            delay: Duration::ZERO,
            error: "x".into(),
            refund_attempt: false,
        })
        .collect();
    assert_eq!(store.reschedule(first.token, &retries).await.unwrap(), 0);
    let dead: Vec<Dead> = ids
        .iter()
        .map(|&id| Dead {
            id,
            error: "x".into(),
        })
        .collect();
    assert_eq!(store.quarantine(first.token, &dead).await.unwrap(), 0);
    assert_eq!(b.rows_of(&ids).await, snapshot);
    let counts = store.counts().await.unwrap();
    assert_eq!(
        (
            counts.pending,
            counts.claimed,
            counts.dispatched,
            counts.dead
        ),
        (2, 0, 1, 1),
        "{counts:?}"
    );

    // Only the released row is due (the rescheduled one waits for its backoff).
    let second = claim(&store, "relay-c", 10, LONG).await;
    assert_eq!(claim_ids(&second), vec![d]);
    assert_eq!(second.messages[0].attempts, 1);
    store
        .reschedule(
            second.token,
            &[Retry {
                id: d,
                delay: Duration::ZERO,
                error: "again".into(),
                refund_attempt: false,
            }],
        )
        .await
        .unwrap();
    let third = claim(&store, "relay-c", 10, LONG).await;
    assert_eq!(claim_ids(&third), vec![d]);
    assert_eq!(
        third.messages[0].attempts, 2,
        "a retried attempt stays counted"
    );
    assert_eq!(store.release(third.token, &[d]).await.unwrap(), 1);
    let rd = b.row(d).await;
    assert_eq!(
        (rd.status, rd.attempts),
        (status::PENDING, 1),
        "release gives back only the released claim's attempt: {rd:?}"
    );
    assert_eq!(rd.last_error.as_deref(), Some("again"));
}

/// A deleting settlement (`--on-dispatch delete`): the confirmed rows are gone, the
/// retried, dead and released ones are written as always, a stale token deletes nothing,
/// and settling a deleted row again reports it lost.
pub(crate) async fn a_deleting_settle_removes_only_confirmed_rows<B: Backend>() {
    use outbox::store::Settlement;
    let b = B::create("delete", DEFAULT_MAX).await;
    let store = b.store();
    let enq = b.enqueue_all(&messages("t.delete.v1", 5)).await;
    let ids: Vec<i64> = enq.iter().map(|e| e.id).collect();
    let c = claim(&store, "relay-delete", 10, LONG).await;
    assert_eq!(claim_ids(&c), ids);
    assert!(
        store
            .delete_claimed(Uuid::now_v7(), &ids)
            .await
            .unwrap()
            .is_empty(),
        "a stale token deletes nothing"
    );
    let s = Settlement {
        dispatched: vec![ids[0], ids[1]],
        retries: vec![Retry {
            id: ids[2],
            delay: Duration::from_secs(60),
            error: "broker busy".into(),
            refund_attempt: false,
        }],
        dead: vec![Dead {
            id: ids[3],
            error: "refused".into(),
        }],
        release: vec![ids[4]],
        delete_dispatched: true,
    };
    let settled = store.settle(c.token, &s).await.unwrap();
    let mut changed = settled.changed.clone();
    changed.sort_unstable();
    assert_eq!(changed, ids, "{settled:?}");
    assert!(settled.lost.is_empty(), "{settled:?}");
    let rows = b.rows_of(&ids).await;
    assert_eq!(
        rows.iter().map(|r| r.id).collect::<Vec<_>>(),
        ids[2..].to_vec(),
        "only the confirmed rows are deleted"
    );
    assert_eq!((rows[0].status, rows[0].attempts), (status::PENDING, 1));
    assert_eq!(rows[0].last_error.as_deref(), Some("broker busy"));
    assert_eq!(rows[1].status, status::DEAD);
    assert_eq!((rows[2].status, rows[2].attempts), (status::PENDING, 0));
    assert_eq!(store.counts().await.unwrap().dispatched, 0);
    let again = store
        .settle(
            c.token,
            &Settlement {
                dispatched: vec![ids[0]],
                delete_dispatched: true,
                ..Settlement::default()
            },
        )
        .await
        .unwrap();
    assert!(again.changed.is_empty(), "{again:?}");
    assert_eq!(again.lost, vec![ids[0]]);
}

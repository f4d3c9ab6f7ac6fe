//! Store conformance: purge.

use super::*;
use outbox::store::prelude::*;

/// Purge deletes dispatched rows older than the retention, at most `batch_size` per call;
/// pending, claimed and dead rows (even with an old `dispatched_at`) and young dispatched
/// rows are untouched. One purger at a time: a second one is locked out on PostgreSQL and
/// MariaDB, and waits on SQLite (one writer). Producers inserting while purges run never
/// see an error (no deadlock or lock wait timeout on MariaDB).
pub(crate) async fn purge_deletes_old_dispatched_rows_in_bounded_batches<B: Backend>() {
    let b = Arc::new(B::create("purge", DEFAULT_MAX).await);
    let store = b.store();
    let hour = Duration::from_secs(3600);

    // 250 old dispatched, 10 young dispatched, 5 pending (in backoff), 5 claimed, 5 dead.
    let enq = b.enqueue_all(&messages("t.purge.v1", 275)).await;
    let ids: Vec<i64> = enq.iter().map(|e| e.id).collect();
    let c = claim(&store, "relay-purge", 300, Duration::from_secs(600)).await;
    assert_eq!(c.messages.len(), 275);
    let (old, rest) = ids.split_at(250);
    let (young, rest) = rest.split_at(10);
    let (pending, rest) = rest.split_at(5);
    let (claimed, dead) = rest.split_at(5);
    assert_eq!(store.mark_dispatched(c.token, old).await.unwrap(), 250);
    assert_eq!(store.mark_dispatched(c.token, young).await.unwrap(), 10);
    let retries: Vec<Retry> = pending
        .iter()
        .map(|&id| Retry {
            id,
            delay: hour,
            error: "later".into(),
            refund_attempt: false,
        })
        .collect();
    assert_eq!(store.reschedule(c.token, &retries).await.unwrap(), 5);
    let kills: Vec<Dead> = dead
        .iter()
        .map(|&id| Dead {
            id,
            error: "dead".into(),
        })
        .collect();
    assert_eq!(store.quarantine(c.token, &kills).await.unwrap(), 5);
    // Old rows are old; so (as far as their times go) are the rows purge must not touch.
    let mut aged: Vec<i64> = old.to_vec();
    aged.extend(pending.iter().chain(claimed).chain(dead));
    b.set_dispatched_at_ago(&aged, 2 * hour).await;
    let untouchable: Vec<i64> = young
        .iter()
        .chain(pending)
        .chain(claimed)
        .chain(dead)
        .copied()
        .collect();
    let keep = b.rows_of(&untouchable).await;

    let mut deleted = Vec::new();
    loop {
        let r = store.purge(hour, 100).await.unwrap();
        assert!(!r.locked_out, "a lone purger is never locked out");
        deleted.push(r.deleted);
        if r.deleted < 100 {
            break;
        }
    }
    assert_eq!(deleted, vec![100, 100, 50], "batch size respected per call");
    let r = store.purge(hour, 100).await.unwrap();
    assert_eq!((r.deleted, r.locked_out), (0, false), "nothing old is left");
    assert_eq!(
        b.rows_of(&untouchable).await,
        keep,
        "purge touched other rows"
    );
    assert_eq!(b.count("1 = 1").await, 25);

    // Two purgers at once: the first waits on a lock held from outside, mid-delete.
    b.bulk_insert_dispatched(2_000, 2 * hour).await;
    let held = b.hold_write_lock().await;
    let first = {
        let store = store.clone();
        tokio::spawn(async move { store.purge(hour, 500).await.unwrap() })
    };
    // The first purger took the purge lock and waits on the held lock.
    b.wait_for_lock_waiters(1, Duration::from_millis(500)).await;
    assert!(
        !first.is_finished(),
        "the first purge should wait on the held lock"
    );
    let second = {
        let store = store.clone();
        tokio::spawn(async move { store.purge(hour, 500).await.unwrap() })
    };
    if !B::SINGLE_WRITER {
        {
            // Answers at once, while the first purger still holds the purge lock.
            let r = tokio::time::timeout(Duration::from_secs(5), second)
                .await
                .expect("a second purger must not wait for the first")
                .unwrap();
            assert!(!first.is_finished());
            assert!(r.locked_out, "a second purger is locked out: {r:?}");
            assert_eq!(r.deleted, 0);
            held.rollback().await.unwrap();
            let r = first.await.unwrap();
            assert_eq!((r.deleted, r.locked_out), (500, false));
        }
    } else {
        {
            // One writer at a time: the second purge queues behind the first.
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(
                !second.is_finished(),
                "SQLite purges wait for the write lock"
            );
            held.rollback().await.unwrap();
            let r1 = first.await.unwrap();
            let r2 = second.await.unwrap();
            assert_eq!((r1.deleted, r1.locked_out), (500, false));
            assert_eq!((r2.deleted, r2.locked_out), (500, false));
        }
    }
    assert_eq!(b.rows_of(&untouchable).await, keep);

    // Purge at full retention speed while two producers insert and a claimer marks, ~3 s.
    let deadline = Instant::now() + Duration::from_secs(3);
    let running = Arc::new(AtomicBool::new(true));
    let producers: Vec<_> = (0..2)
        .map(|p| {
            let b = b.clone();
            tokio::spawn(async move {
                let mut produced = Vec::new();
                let mut errors = Vec::new();
                while Instant::now() < deadline {
                    let msgs = messages(&format!("t.purge.p{p}"), 20);
                    match b.try_produce(&msgs, TxOpts::default()).await {
                        Ok(results) => {
                            for r in results {
                                match r {
                                    Ok(e) => produced.push(e.message_id),
                                    Err(e) => errors.push(e.to_string()),
                                }
                            }
                        }
                        Err(e) => errors.push(e),
                    }
                }
                (produced, errors)
            })
        })
        .collect();
    let claimer = {
        let (store, running) = (store.clone(), running.clone());
        tokio::spawn(async move {
            let mut marked = Vec::new();
            claim_until_drained(&store, "relay-purge", 100, &running, |c| {
                marked.extend(c.messages.iter().map(|m| m.message_id));
            })
            .await;
            marked
        })
    };
    let purgers: Vec<_> = (0..2)
        .map(|_| {
            let (store, running) = (store.clone(), running.clone());
            tokio::spawn(async move {
                let (mut deleted, mut locked_out, mut errors) = (0u64, 0u32, Vec::new());
                while running.load(Ordering::SeqCst) {
                    match store.purge(Duration::ZERO, 200).await {
                        Ok(r) => {
                            assert!(r.deleted <= 200, "batch size exceeded: {r:?}");
                            deleted += r.deleted;
                            locked_out += u32::from(r.locked_out);
                            if r.deleted == 0 {
                                tokio::time::sleep(Duration::from_millis(5)).await;
                            }
                        }
                        Err(e) => errors.push(e.to_string()),
                    }
                }
                (deleted, locked_out, errors)
            })
        })
        .collect();
    let mut produced = HashSet::new();
    let mut producer_errors = Vec::new();
    for p in producers {
        let (ids, errors) = p.await.unwrap();
        produced.extend(ids);
        producer_errors.extend(errors);
    }
    running.store(false, Ordering::SeqCst);
    let marked = claimer.await.unwrap();
    let (mut purge_errors, mut locked_out) = (Vec::new(), 0);
    for p in purgers {
        let (_, l, e) = p.await.unwrap();
        locked_out += l;
        purge_errors.extend(e);
    }
    eprintln!(
        "{:?}: {} messages produced during purges; second purger locked out {locked_out} times",
        B::KIND,
        produced.len()
    );
    assert!(
        producer_errors.is_empty(),
        "producers saw errors while purges ran: {producer_errors:?}"
    );
    assert!(purge_errors.is_empty(), "purge errors: {purge_errors:?}");
    assert!(!produced.is_empty());
    if B::SINGLE_WRITER {
        assert_eq!(
            locked_out, 0,
            "SQLite purges wait for the write lock instead"
        );
    }
    let marked_set: HashSet<Uuid> = marked.iter().copied().collect();
    assert_eq!(marked.len(), marked_set.len(), "a row was marked twice");
    assert_eq!(
        marked_set, produced,
        "every produced row was dispatched (a purge deleted none before)"
    );
    loop {
        let r = store.purge(Duration::ZERO, 1_000).await.unwrap();
        if r.deleted == 0 && !r.locked_out {
            break;
        }
    }
    // Only the never-purgeable rows are left (retention 0 takes the young ones too).
    assert_eq!(b.count("1 = 1").await, 15);
    let left = b.rows_of(&untouchable[10..]).await;
    assert_eq!(left, keep[10..].to_vec(), "purge touched live or dead rows");
}

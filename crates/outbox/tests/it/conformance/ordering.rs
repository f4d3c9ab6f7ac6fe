//! Store conformance: per-key ordering, enforced by the claim.

use super::*;
use outbox::sink::router::TopicPattern;
use outbox::store::{DeadSelector, HeldKeys, KeyOrdering, ReplayAction, ReplayRequest, Settlement};

fn ordering(skip_dead: bool) -> KeyOrdering {
    KeyOrdering {
        topics: vec![TopicPattern::parse("o.>").unwrap()],
        skip_dead,
    }
}

async fn claim_ordered(store: &Arc<dyn Store>, batch: u32, ordering: &KeyOrdering) -> Claim {
    store
        .claim(&ClaimRequest {
            relay_id: "ordered".into(),
            batch_size: batch,
            lease: LONG,
            skip_topics: Vec::new(),
            ordering: ordering.clone(),
        })
        .await
        .unwrap()
}

fn keyed(topic: &str, key: Option<&str>) -> Message {
    let m = Message::new(topic, b"x".to_vec());
    match key {
        Some(k) => m.key(k),
        None => m,
    }
}

fn replay(ids: Vec<i64>, action: ReplayAction) -> ReplayRequest {
    ReplayRequest {
        selector: DeadSelector {
            ids,
            ..DeadSelector::default()
        },
        action,
        limit: None,
        by: "alice".into(),
        reason: "fixed the consumer".into(),
        rate_per_s: None,
        dry_run: false,
        append_to: None,
    }
}

/// Enqueues two messages of `key` on `o.t` and quarantines the first (claimed alone);
/// returns their ids.
async fn first_of_two_dead<B: Backend>(b: &B, key: &str) -> Vec<i64> {
    let store = b.store();
    let ids: Vec<i64> = b
        .enqueue_all(&[keyed("o.t", Some(key)), keyed("o.t", Some(key))])
        .await
        .iter()
        .map(|e| e.id)
        .collect();
    let c = claim_ordered(&store, 1, &ordering(false)).await;
    assert_eq!(claim_ids(&c), vec![ids[0]]);
    let dead = Dead {
        id: ids[0],
        error: "permanent: rejected".into(),
    };
    assert_eq!(store.quarantine(c.token, &[dead]).await.unwrap(), 1);
    ids
}

/// A row of an ordered key is claimed only when every earlier row of its topic and key is
/// dispatched or in the same claim: a claim cut off by its limit, a key's row in flight, a
/// retry waiting for its time and (strict) a dead letter each hold back the key's later
/// rows and nothing else; rows without a key, of unordered topics and of another topic
/// with the same key are never held. A replayed dead letter goes first again; a discarded
/// one releases its key; with `skip_dead` a dead letter holds nothing.
pub(crate) async fn ordered_claims_follow_each_key<B: Backend>() {
    let b = B::create("order", DEFAULT_MAX).await;
    let store = b.store();
    let strict = ordering(false);
    let ids: Vec<i64> = b
        .enqueue_all(&[
            keyed("o.t", Some("a")), // 0 a1
            keyed("o.t", Some("b")), // 1 b1
            keyed("o.t", Some("a")), // 2 a2
            keyed("o.t", None),      // 3 no key
            keyed("u.t", Some("a")), // 4 unordered topic
            keyed("o.t", Some("a")), // 5 a3
            keyed("o.u", Some("a")), // 6 ordered, another topic: its own sequence
            keyed("u.t", Some("a")), // 7 unordered topic
            keyed("o.u", Some("a")), // 8 o.u's a2
        ])
        .await
        .iter()
        .map(|e| e.id)
        .collect();
    let id = |i: usize| ids[i];

    // The limit cuts after a1, b1: a2 and a3 wait for a1, the rest flows.
    let first = claim_ordered(&store, 2, &strict).await;
    assert_eq!(claim_ids(&first), vec![id(0), id(1)]);
    let second = claim_ordered(&store, 100, &strict).await;
    assert_eq!(
        claim_ids(&second),
        vec![id(3), id(4), id(6), id(7), id(8)],
        "a1 in flight holds a2 and a3 back, nothing else (o.u's a is its own sequence)"
    );
    assert!(
        claim_ordered(&store, 100, &strict)
            .await
            .messages
            .is_empty()
    );

    // a1 confirmed: a2 and a3 come together, in id order (one claim may take a run).
    store.mark_dispatched(first.token, &[id(0)]).await.unwrap();
    let run = claim_ordered(&store, 100, &strict).await;
    assert_eq!(claim_ids(&run), vec![id(2), id(5)]);

    // a2 fails transiently and a3 is given back: a3 and a new a4 wait for a2's retry.
    store
        .settle(
            run.token,
            &Settlement {
                retries: vec![Retry {
                    id: id(2),
                    delay: LONG,
                    error: "busy".into(),
                    refund_attempt: false,
                }],
                release: vec![id(5)],
                ..Settlement::default()
            },
        )
        .await
        .unwrap();
    let a4 = b.enqueue_all(&[keyed("o.t", Some("a"))]).await[0].id;
    let c1 = b.enqueue_all(&[keyed("o.t", Some("c"))]).await[0].id;
    assert_eq!(
        claim_ids(&claim_ordered(&store, 100, &strict).await),
        vec![c1],
        "key a waits for its retry; a new key flows"
    );
    // Without ordering the same rows would be claimed at once.
    assert_eq!(
        b.count(&format!("id IN ({}, {a4}) AND status = 0", id(5)))
            .await,
        2
    );

    // Strict: a dead letter blocks its key; replayed, it goes first again.
    let d = first_of_two_dead(&b, "d").await;
    assert!(
        claim_ordered(&store, 100, &strict)
            .await
            .messages
            .is_empty(),
        "d2 waits behind the dead d1"
    );
    let held = store.held_keys(&strict).await.unwrap();
    assert_eq!((held.blocked_keys, held.held), (1, 1), "{held:?}");
    assert!(
        held.oldest_held_age_seconds.is_some_and(|a| a >= 0),
        "{held:?}"
    );
    assert_eq!(
        store.held_keys(&KeyOrdering::default()).await.unwrap(),
        HeldKeys::default()
    );
    let skip = claim_ordered(&store, 100, &ordering(true)).await;
    assert_eq!(
        claim_ids(&skip),
        vec![d[1]],
        "skip_dead: the dead letter holds nothing"
    );
    store.release(skip.token, &[d[1]]).await.unwrap();
    let out = store
        .replay(&replay(vec![d[0]], ReplayAction::Replay))
        .await
        .unwrap();
    assert_eq!(out.count, 1);
    let c = claim_ordered(&store, 100, &strict).await;
    assert_eq!(
        claim_ids(&c),
        vec![d[0]],
        "the replayed dead letter comes first"
    );
    store.mark_dispatched(c.token, &[d[0]]).await.unwrap();
    assert_eq!(
        claim_ids(&claim_ordered(&store, 100, &strict).await),
        vec![d[1]],
        "then the rest of its key"
    );
    assert_eq!(store.held_keys(&strict).await.unwrap(), HeldKeys::default());

    // Discarding a blocking dead letter releases the rest of its key.
    let e = first_of_two_dead(&b, "e").await;
    assert!(
        claim_ordered(&store, 100, &strict)
            .await
            .messages
            .is_empty()
    );
    let out = store
        .replay(&replay(vec![e[0]], ReplayAction::Discard))
        .await
        .unwrap();
    assert_eq!(out.count, 1);
    assert_eq!(
        claim_ids(&claim_ordered(&store, 100, &strict).await),
        vec![e[1]]
    );

    // Rows given back at different times: f1, f3 and f2 become available in that order.
    // A claim of two takes f1 and stops at f2's fence (f3 waits for it); rows given back
    // later than their key's later rows still go first: no key waits forever.
    let f: Vec<i64> = b
        .enqueue_all(&[
            keyed("o.t", Some("f")),
            keyed("o.t", Some("f")),
            keyed("o.t", Some("f")),
        ])
        .await
        .iter()
        .map(|e| e.id)
        .collect();
    let c = claim_ordered(&store, 100, &strict).await;
    assert_eq!(claim_ids(&c), f);
    for i in [0, 2, 1] {
        assert_eq!(store.release(c.token, &[f[i]]).await.unwrap(), 1);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let c = claim_ordered(&store, 2, &strict).await;
    assert_eq!(claim_ids(&c), vec![f[0]], "f3 is before f2's fence");
    store.mark_dispatched(c.token, &[f[0]]).await.unwrap();
    let c = claim_ordered(&store, 1, &strict).await;
    assert_eq!(
        claim_ids(&c),
        vec![f[1]],
        "f2, given back last, goes before f3"
    );
    store.mark_dispatched(c.token, &[f[1]]).await.unwrap();
    let c = claim_ordered(&store, 1, &strict).await;
    assert_eq!(claim_ids(&c), vec![f[2]]);
}

/// Four claimers take 50 keys × 20 rows of an ordered topic in small claims, marking each
/// claim before the next: a key is never in two claims at once, and each claim's rows of
/// a key are that key's next rows in id order.
pub(crate) async fn concurrent_ordered_claims_keep_each_key_in_order<B: Backend>() {
    const KEYS: usize = 50;
    const PER_KEY: usize = 20;
    const CLAIMERS: usize = 4;
    let b = Arc::new(B::create("ordconc", DEFAULT_MAX).await);
    let store = b.store();
    let mut expected: HashMap<String, Vec<i64>> = HashMap::new();
    for _ in 0..PER_KEY {
        let msgs: Vec<Message> = (0..KEYS)
            .map(|k| keyed("o.conc", Some(&format!("k{k}"))))
            .collect();
        for (k, e) in b.enqueue_all(&msgs).await.iter().enumerate() {
            expected.entry(format!("k{k}")).or_default().push(e.id);
        }
    }
    struct Seen {
        next: HashMap<String, usize>,
        held: HashSet<String>,
    }
    let seen = Arc::new(Mutex::new(Seen {
        next: HashMap::new(),
        held: HashSet::new(),
    }));
    let expected = Arc::new(expected);
    let tasks: Vec<_> = (0..CLAIMERS)
        .map(|i| {
            let (store, seen, expected) = (store.clone(), seen.clone(), expected.clone());
            tokio::spawn(async move {
                let ord = ordering(false);
                let mut empty = 0;
                while empty < 3 {
                    let c = claim_ordered(&store, 7 + i as u32, &ord).await;
                    if c.messages.is_empty() {
                        empty += 1;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    }
                    empty = 0;
                    let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
                    for m in &c.messages {
                        by_key.entry(m.key.clone().unwrap()).or_default().push(m.id);
                    }
                    {
                        let mut s = seen.lock().unwrap();
                        for (k, got) in &by_key {
                            assert!(s.held.insert(k.clone()), "key {k} in two claims at once");
                            let from = s.next.get(k).copied().unwrap_or(0);
                            assert_eq!(
                                got[..],
                                expected[k][from..from + got.len()],
                                "key {k}: not its next rows in id order"
                            );
                        }
                    }
                    // Let the others claim while this claim is held.
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    {
                        let mut s = seen.lock().unwrap();
                        for (k, got) in &by_key {
                            s.held.remove(k);
                            *s.next.entry(k.clone()).or_insert(0) += got.len();
                        }
                    }
                    let ids = claim_ids(&c);
                    assert_eq!(
                        store.mark_dispatched(c.token, &ids).await.unwrap(),
                        ids.len() as u64
                    );
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    {
        let s = seen.lock().unwrap();
        for (k, ids) in expected.iter() {
            assert_eq!(
                s.next.get(k),
                Some(&ids.len()),
                "key {k}: not every row claimed"
            );
        }
    }
    let c = store.counts().await.unwrap();
    assert_eq!(c.dispatched, (KEYS * PER_KEY) as i64, "{c:?}");
}

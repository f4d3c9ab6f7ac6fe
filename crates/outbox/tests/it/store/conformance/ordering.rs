//! Store conformance: per-key ordering, enforced by the claim.

use super::*;
use outbox::sink::router::TopicPattern;
use outbox::store::prelude::*;
use outbox::store::{HeldKeys, KeyOrdering, ReplayAction, Settlement};

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
    // Due, but held behind their key's first row (waiting out its retry): counted as held.
    let strict_view = store.due_held_by_order(&strict).await.unwrap();
    assert_eq!(strict_view.held, 2, "a3 and a4 wait behind a2's retry");
    assert_eq!(
        strict_view.oldest_free_due_s, None,
        "every due row is held: none is free"
    );
    let unordered = store
        .due_held_by_order(&KeyOrdering::default())
        .await
        .unwrap();
    assert_eq!(unordered.held, 0);
    assert!(
        unordered.oldest_free_due_s.is_some_and(|s| s >= 0),
        "without ordering a3 and a4 are free: {unordered:?}"
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
    assert_eq!(
        store.due_held_by_order(&strict).await.unwrap().held,
        3,
        "d2 behind its dead letter, a3 and a4 behind a2's retry"
    );
    assert_eq!(
        store.due_held_by_order(&ordering(true)).await.unwrap().held,
        2,
        "skip_dead: only the retry holds"
    );
    let skip = claim_ordered(&store, 100, &ordering(true)).await;
    assert_eq!(
        claim_ids(&skip),
        vec![d[1]],
        "skip_dead: the dead letter holds nothing"
    );
    store.release(skip.token, &[d[1]]).await.unwrap();
    // The replay is stamped after the release: given back in the same millisecond, d1
    // would be due as early as its head and join it in the claim (in order, which is
    // allowed); this case checks the head alone first.
    clock_moves_on(&b).await;
    let out = store
        .replay(&crate::common::replay_ids(vec![d[0]], ReplayAction::Replay))
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
        .replay(&crate::common::replay_ids(
            vec![e[0]],
            ReplayAction::Discard,
        ))
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
        clock_moves_on(&b).await;
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

/// Claims and marks until nothing is claimable under `ordering`; the ids in claim order.
async fn drain(store: &Arc<dyn Store>, ordering: &KeyOrdering) -> Vec<i64> {
    let mut out = Vec::new();
    loop {
        let c = claim_ordered(store, 100, ordering).await;
        if c.messages.is_empty() {
            return out;
        }
        let ids = claim_ids(&c);
        store.mark_dispatched(c.token, &ids).await.unwrap();
        out.extend(ids);
    }
}

/// Enqueues `n` messages of `key` on `o.t`; their ids.
async fn of_key<B: Backend>(b: &B, key: &str, n: usize) -> Vec<i64> {
    let msgs: Vec<Message> = (0..n).map(|_| keyed("o.t", Some(key))).collect();
    b.enqueue_all(&msgs).await.iter().map(|e| e.id).collect()
}

/// Rows held behind a dead letter are parked: no claim reads them (even one without
/// ordering), only the blocked key's rows after its dead letter are parked, a second call
/// parks nothing new, and skip_dead parks nothing. Replaying the dead letter brings back
/// its key's parked rows up to the key's next dead letter, after the replayed one;
/// discarding releases them; `unpark_released` gives back what no dead letter holds under
/// the ordering it is given.
pub(crate) async fn parked_rows_wait_behind_dead_letters_until_released<B: Backend>() {
    let b = B::create("park", DEFAULT_MAX).await;
    let store = b.store();
    let strict = ordering(false);
    let none = KeyOrdering::default();

    // k1 dead; k2 (from first_of_two_dead), k3, k4 behind it; m1 and an unordered topic's
    // row of key k flow.
    let k = first_of_two_dead(&b, "k").await;
    let k34 = of_key(&b, "k", 2).await;
    let flow: Vec<i64> = b
        .enqueue_all(&[keyed("o.t", Some("m")), keyed("u.t", Some("k"))])
        .await
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(store.park_held(&strict).await.unwrap(), 3, "k2, k3, k4");
    assert_eq!(store.park_held(&strict).await.unwrap(), 0, "parked once");
    assert_eq!(store.park_held(&ordering(true)).await.unwrap(), 0);
    assert_eq!(store.park_held(&none).await.unwrap(), 0);
    let held = store.held_keys(&strict).await.unwrap();
    assert_eq!(
        (held.blocked_keys, held.held),
        (1, 3),
        "parked rows are still held: {held:?}"
    );
    assert_eq!(
        drain(&store, &none).await,
        flow,
        "parked rows are not due, even to a claim without ordering"
    );
    assert_eq!(
        store.unpark_released(&strict).await.unwrap(),
        0,
        "k is blocked"
    );
    let found = store
        .find_messages(
            &outbox::store::lookup::MessageQuery::Key {
                key: "k".into(),
                topic: Some("o.t".into()),
            },
            10,
        )
        .await
        .unwrap();
    let states: Vec<(i64, &str)> = found.iter().map(|m| (m.id, m.status)).collect();
    assert!(
        states.contains(&(k[1], "parked")) && states.contains(&(k[0], "dead")),
        "a parked row shows as parked: {states:?}"
    );
    let c = store.counts().await.unwrap();
    assert_eq!(
        (c.pending, c.dead),
        (3, 1),
        "k2..k4 and the dead k1 are kept: {c:?}"
    );

    // A row written after the park is due; the claim holds it back, the next park parks it.
    let k5 = of_key(&b, "k", 1).await[0];
    assert!(drain(&store, &strict).await.is_empty());
    assert_eq!(store.park_held(&strict).await.unwrap(), 1);

    // Replayed: k1 first, then the rest of k in id order.
    let out = store
        .replay(&crate::common::replay_ids(vec![k[0]], ReplayAction::Replay))
        .await
        .unwrap();
    assert_eq!(out.count, 1);
    assert_eq!(
        drain(&store, &strict).await,
        vec![k[0], k[1], k34[0], k34[1], k5]
    );
    assert_eq!(store.held_keys(&strict).await.unwrap(), HeldKeys::default());

    // Discarded: the rest of e comes back.
    let e = first_of_two_dead(&b, "e").await;
    assert_eq!(store.park_held(&strict).await.unwrap(), 1);
    store
        .replay(&crate::common::replay_ids(
            vec![e[0]],
            ReplayAction::Discard,
        ))
        .await
        .unwrap();
    assert_eq!(drain(&store, &strict).await, vec![e[1]]);

    // Two dead letters of g (g1, g3): replaying g1 brings back g2, not g4 (behind g3).
    let g = of_key(&b, "g", 4).await;
    let c = claim_ordered(&store, 1, &strict).await;
    assert_eq!(claim_ids(&c), vec![g[0]]);
    let dead = |id| Dead {
        id,
        error: "permanent: rejected".into(),
    };
    store.quarantine(c.token, &[dead(g[0])]).await.unwrap();
    let c = claim_ordered(&store, 100, &none).await;
    assert_eq!(claim_ids(&c), g[1..].to_vec());
    store.quarantine(c.token, &[dead(g[2])]).await.unwrap();
    store.release(c.token, &[g[1], g[3]]).await.unwrap();
    assert_eq!(store.park_held(&strict).await.unwrap(), 2, "g2 and g4");
    store
        .replay(&crate::common::replay_ids(vec![g[0]], ReplayAction::Replay))
        .await
        .unwrap();
    assert_eq!(drain(&store, &strict).await, vec![g[0], g[1]]);
    assert!(
        drain(&store, &none).await.is_empty(),
        "g4 stays parked behind g3"
    );
    store
        .replay(&crate::common::replay_ids(vec![g[2]], ReplayAction::Replay))
        .await
        .unwrap();
    assert_eq!(drain(&store, &strict).await, vec![g[2], g[3]]);

    // Released by the ordering itself: skip_dead, or the topic no longer ordered.
    let f = first_of_two_dead(&b, "f").await;
    let h = first_of_two_dead(&b, "h").await;
    assert_eq!(store.park_held(&strict).await.unwrap(), 2);
    assert!(drain(&store, &none).await.is_empty());
    assert_eq!(store.unpark_released(&ordering(true)).await.unwrap(), 2);
    assert_eq!(drain(&store, &ordering(true)).await, vec![f[1], h[1]]);
    let j = first_of_two_dead(&b, "j").await;
    assert_eq!(store.park_held(&strict).await.unwrap(), 1);
    let elsewhere = KeyOrdering {
        topics: vec![TopicPattern::parse("x.>").unwrap()],
        skip_dead: false,
    };
    assert_eq!(store.unpark_released(&elsewhere).await.unwrap(), 1);
    assert_eq!(drain(&store, &elsewhere).await, vec![j[1]]);
    assert_eq!(
        store.counts().await.unwrap().pending,
        0,
        "nothing left parked"
    );
}

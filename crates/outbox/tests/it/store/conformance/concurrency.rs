//! Store conformance: concurrent claimers.

use super::*;

/// Six claimers loop claim → mark over thousands of rows while a producer adds more: no
/// row is ever in two claims (with a lease longer than the test, each id is claimed exactly
/// once), and every row ends dispatched.
pub(crate) async fn concurrent_claimers_never_overlap<B: Backend>() {
    const BACKLOG: usize = 2_000;
    const LATE: usize = 1_000;
    const CLAIMERS: usize = 6;
    let b = Arc::new(B::create("conc", DEFAULT_MAX).await);
    let store = b.store();
    let mut expected: HashSet<i64> = HashSet::new();
    for chunk in messages("t.conc.v1", BACKLOG).chunks(500) {
        expected.extend(b.enqueue_all(chunk).await.iter().map(|e| e.id));
    }

    let producing = Arc::new(AtomicBool::new(true));
    let producer = {
        let (b, producing) = (b.clone(), producing.clone());
        tokio::spawn(async move {
            let mut ids = Vec::new();
            for chunk in messages("t.conc.v1", LATE).chunks(50) {
                ids.extend(b.enqueue_all(chunk).await.iter().map(|e| e.id));
            }
            producing.store(false, Ordering::SeqCst);
            ids
        })
    };
    let claimed: Arc<Mutex<HashMap<i64, u32>>> = Arc::default();
    let claimers: Vec<_> = (0..CLAIMERS)
        .map(|i| {
            let (store, claimed, producing) = (store.clone(), claimed.clone(), producing.clone());
            tokio::spawn(async move {
                let mut mine = 0usize;
                claim_until_drained(&store, &format!("claimer-{i}"), 50, &producing, |c| {
                    let mut map = claimed.lock().unwrap();
                    for m in &c.messages {
                        *map.entry(m.id).or_insert(0) += 1;
                    }
                    mine += c.messages.len();
                })
                .await;
                mine
            })
        })
        .collect();
    expected.extend(producer.await.unwrap());
    let mut per_claimer = Vec::new();
    for c in claimers {
        per_claimer.push(c.await.unwrap());
    }
    let total_rows = BACKLOG + LATE;
    assert_eq!(expected.len(), total_rows);
    let claimed = claimed.lock().unwrap().clone();
    let twice: Vec<_> = claimed.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "rows claimed more than once: {twice:?}");
    let claimed_ids: HashSet<i64> = claimed.keys().copied().collect();
    assert_eq!(claimed_ids, expected, "every row claimed");
    assert!(
        per_claimer.iter().filter(|n| **n > 0).count() >= 2,
        "the claimers did not really compete: {per_claimer:?}"
    );
    let c = store.counts().await.unwrap();
    assert_eq!(
        (c.pending, c.claimed, c.dispatched, c.dead),
        (0, 0, total_rows as i64, 0),
        "{c:?}"
    );
    assert_eq!(b.count("attempts <> 1").await, 0, "a row was claimed twice");
}

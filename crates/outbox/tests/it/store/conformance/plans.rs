//! Store conformance: the claim's plan.

use super::*;

/// With many dispatched rows and a few pending ones, the claim reads the live-row index,
/// not the table (latency is for the benchmark; this asserts the plan).
pub(crate) async fn claim_uses_the_live_row_index<B: Backend>() {
    let b = B::create("plan", DEFAULT_MAX).await;
    let store = b.store();
    let n = B::PLAN_ROWS;
    let start = Instant::now();
    b.bulk_insert_dispatched(n, Duration::from_secs(60)).await;
    eprintln!(
        "{:?}: {n} dispatched rows inserted in {:?}",
        B::KIND,
        start.elapsed()
    );
    let live = b.enqueue_all(&messages("t.plan.v1", 5)).await;
    b.analyze().await;
    b.assert_claim_uses_live_index().await;
    let c = claim(&store, "relay-plan", 100, LONG).await;
    assert_eq!(claim_ids(&c), live.iter().map(|e| e.id).collect::<Vec<_>>());
    let counts = store.counts().await.unwrap();
    assert_eq!((counts.dispatched, counts.claimed), (n as i64, 5));
}

//! Store conformance: wake-ups. A producer's commit moves the store's wake-up counter
//! (PostgreSQL `NOTIFY`, MySQL's `MAX(id)` probe, SQLite's file watcher) well before any
//! poll interval, so an idle relay hears of new rows at once.

use super::*;

pub(crate) async fn a_commit_moves_the_wakeup_counter<B: Backend>() {
    let b = B::create("wake", DEFAULT_MAX).await;
    let store = b.store();
    let mut rx = store.wakeups();
    // Let the signal's source settle (a listener connecting, the probe slowing to idle).
    tokio::time::sleep(Duration::from_millis(500)).await;
    rx.borrow_and_update();
    let mut waits = Vec::new();
    for i in 0..3 {
        let r = b
            .produce(&messages(&format!("t.wake.{i}"), 1), TxOpts::default())
            .await;
        assert!(r.iter().all(Result::is_ok), "{r:?}");
        let t0 = Instant::now();
        tokio::time::timeout(Duration::from_secs(2), rx.changed())
            .await
            .unwrap_or_else(|_| panic!("{:?}: no wake-up within 2 s of commit {i}", B::KIND))
            .unwrap();
        waits.push(t0.elapsed());
        rx.borrow_and_update();
        // Idle again before the next commit.
        tokio::time::sleep(Duration::from_millis(300)).await;
        rx.borrow_and_update();
    }
    eprintln!("{:?}: commit to wake-up {waits:?}", B::KIND);
}

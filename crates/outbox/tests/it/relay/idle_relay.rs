//! What an idle relay asks of the store, counted by the relay's own count of claim
//! statements (`RelayStats::claims`, one per statement whether it found rows or not; a
//! count read from sqlx's statement log through a scoped subscriber missed statements
//! when the whole suite ran in one process): no claim between polls while nothing is due,
//! and one claim per wake-up however many workers wait, not one per worker.

use crate::common::{RecordingSink, pg_store, relay_config, total, wait_until};
use outbox::message::Message;
use outbox::store::Store;
use outbox::{Relay, RelayConfig};
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "current_thread")]
async fn idle_workers_share_one_wakeup_and_do_not_poll_between_intervals() {
    let (pg, _schema) = pg_store("idle").await;
    let store: Arc<dyn Store> = Arc::new(pg.clone());
    let (sink, seen) = RecordingSink::new();
    let handle = Relay::new(
        store.clone(),
        sink,
        RelayConfig {
            in_flight_batches: 4,
            poll_interval: Duration::from_secs(60),
            heartbeat_interval: Duration::ZERO,
            sample_interval: Duration::ZERO,
            summary_interval: Duration::ZERO,
            ..relay_config("relay-idle")
        },
    )
    .spawn();
    // Started: the workers' first claims found nothing, the listener is connected (the
    // first claim, however long a loaded machine takes to get there, then half a second).
    crate::common::wait_claims(
        "the relay's first claim",
        &handle,
        1,
        Duration::from_secs(20),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let claims = || handle.stats().claims;
    let c0 = claims();
    assert!(c0 >= 1, "the count sees the relay's claims");

    // Idle, with the poll interval far away: not a single claim.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(claims(), c0, "claims while idle");

    // Ten commits, one at a time: each wake-up is one claim (which finds the row) and the
    // claim right after a batch (which finds nothing); four workers each claiming on
    // every wake-up would be five.
    const COMMITS: u64 = 10;
    for i in 1..=COMMITS {
        let mut tx = pg.pool().begin().await.unwrap();
        pg.enqueue(&mut tx, &Message::new("t.idle.v1", b"x".to_vec()))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        wait_until("the message delivered", Duration::from_secs(10), || {
            let n = u64::from(total(&seen));
            async move {
                if n >= i {
                    Ok(())
                } else {
                    Err(format!("{n} delivered"))
                }
            }
        })
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let during = claims() - c0;
    eprintln!("{during} claims for {COMMITS} commits");
    assert!(
        (COMMITS..=2 * COMMITS + 2).contains(&during),
        "{during} claims for {COMMITS} commits with 4 workers"
    );
    handle.shutdown().await.unwrap();
}

//! What an idle relay asks of the store, counted from sqlx's statement log (one event per
//! statement; the runtime is single-threaded, so the scoped subscriber sees every task of
//! the test and nothing of the others): no claim between polls while nothing is due, and
//! one claim per wake-up however many workers wait, not one per worker.

use crate::common::{RecordingSink, pg_store, relay_config, total, wait_until};
use outbox::message::Message;
use outbox::store::Store;
use outbox::{Relay, RelayConfig};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tracing_subscriber::layer::{Context, SubscriberExt};

/// Counts the claim statements sqlx runs (their text starts `WITH due AS`).
struct CountClaims(Arc<AtomicU64>);

struct Statement(bool);

impl tracing::field::Visit for Statement {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "db.statement" && value.trim_start().starts_with("WITH due AS") {
            self.0 = true;
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "db.statement" {
            self.record_str(
                field,
                &format!("{value:?}").replace("\\n", "\n").replace('"', ""),
            );
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CountClaims {
    fn enabled(&self, m: &tracing::Metadata<'_>, _: Context<'_, S>) -> bool {
        m.target() == "sqlx::query"
    }
    fn on_event(&self, e: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut v = Statement(false);
        e.record(&mut v);
        if v.0 {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn idle_workers_share_one_wakeup_and_do_not_poll_between_intervals() {
    let claims = Arc::new(AtomicU64::new(0));
    let _scope = tracing::subscriber::set_default(
        tracing_subscriber::registry().with(CountClaims(claims.clone())),
    );
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
    // Started: the workers' first claims found nothing, the listener is connected.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let c0 = claims.load(Ordering::Relaxed);
    assert!(c0 >= 1, "the count sees the relay's claims");

    // Idle, with the poll interval far away: not a single claim.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(claims.load(Ordering::Relaxed), c0, "claims while idle");

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
    let during = claims.load(Ordering::Relaxed) - c0;
    eprintln!("{during} claims for {COMMITS} commits");
    assert!(
        (COMMITS..=2 * COMMITS + 2).contains(&during),
        "{during} claims for {COMMITS} commits with 4 workers"
    );
    handle.shutdown().await.unwrap();
}

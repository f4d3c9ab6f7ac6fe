//! One relay, several destinations: routes by topic pattern, "no route" quarantines, and a
//! destination that is down or slow neither slows the others nor burns its messages'
//! attempts (circuit breaker + per-destination timeout).

#![allow(clippy::unwrap_used)]

use crate::common::{RecordingSink, messages, relay_config, wait_until};
use crate::store::conformance::Backend as _;
use async_trait::async_trait;
use outbox::sink::Confirmations;
use outbox::sink::router::{BreakerState, Router, RouterOptions, TopicPattern};
use outbox::sink::{PublishError, Sink};
use outbox::{OutgoingMessage, Relay};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Down (unavailable) until switched up; counts publish calls.
struct Flaky {
    up: AtomicBool,
    calls: AtomicU32,
    inner: Arc<RecordingSink>,
}

#[async_trait]
impl Sink for Flaky {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        let results: Vec<Result<(), PublishError>> = async {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.up.load(Ordering::SeqCst) {
                self.inner.publish_all(batch).await
            } else {
                vec![Err(PublishError::unavailable("connection refused")); batch.len()]
            }
        }
        .await;
        for (i, r) in results.into_iter().enumerate() {
            confirm.set(i, r);
        }
    }
    fn describe(&self) -> String {
        "flaky".into()
    }
}

/// Takes a minute to answer.
struct Slow;

#[async_trait]
impl Sink for Slow {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        let results: Vec<Result<(), PublishError>> = async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            vec![Ok(()); batch.len()]
        }
        .await;
        for (i, r) in results.into_iter().enumerate() {
            confirm.set(i, r);
        }
    }
    fn describe(&self) -> String {
        "slow".into()
    }
}

fn pattern(p: &str) -> TopicPattern {
    TopicPattern::parse(p).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outage_and_slowness_stay_with_their_destination() {
    let db = crate::store::conformance_postgres::PgBackend::create(
        "routing",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let (healthy, healthy_seen) = RecordingSink::new();
    let (flaky_inner, flaky_seen) = RecordingSink::new();
    let flaky = Arc::new(Flaky {
        up: AtomicBool::new(false),
        calls: AtomicU32::new(0),
        inner: flaky_inner,
    });
    let router = Router::new(
        vec![
            (pattern("orders.*"), healthy.clone() as Arc<dyn Sink>),
            (pattern("billing.>"), flaky.clone() as Arc<dyn Sink>),
            (pattern("slow.*"), Arc::new(Slow) as Arc<dyn Sink>),
        ],
        RouterOptions {
            failure_threshold: 2,
            open_base: Duration::from_millis(500),
            open_max: Duration::from_secs(1),
        },
    );
    let mut cfg = relay_config("router");
    cfg.max_attempts = 2; // an outage must not use them up
    cfg.batch_size = 50;
    cfg.backoff_base = Duration::from_millis(50);
    cfg.backoff_max = Duration::from_millis(300);
    cfg.publish_timeout = Duration::from_millis(300);
    let relay = Relay::with_router(db.store(), router, cfg);
    let router = relay.router().clone();
    let handle = relay.spawn();

    db.enqueue_all(&messages("billing.invoice.v1", 100)).await;
    db.enqueue_all(&messages("slow.x", 20)).await;
    db.enqueue_all(&messages("nowhere.v1", 3)).await;
    let started = Instant::now();
    db.enqueue_all(&messages("orders.placed", 500)).await;

    // The healthy destination gets everything promptly, outage and slowness notwithstanding.
    let seen = healthy_seen.clone();
    wait_until("orders delivered", Duration::from_secs(10), || {
        let seen = seen.clone();
        async move {
            let n = seen.lock().unwrap().len();
            if n == 500 {
                Ok(())
            } else {
                Err(format!("{n}/500"))
            }
        }
    })
    .await;
    let healthy_time = started.elapsed();
    assert!(
        healthy_time < Duration::from_secs(5),
        "orders took {healthy_time:?}"
    );

    // Let the outage run for a while, thirty claims (a poll every 100 ms): the breaker
    // opens, nothing is quarantined for it.
    crate::common::wait_claims(
        "thirty claims in the outage",
        &handle,
        30,
        Duration::from_secs(20),
    )
    .await;
    let breakers = router.breakers();
    assert!(
        matches!(breakers[1].1, BreakerState::Open { .. }),
        "billing breaker: {breakers:?}"
    );
    let calls_during_outage = flaky.calls.load(Ordering::SeqCst);
    let rows = db.rows().await;
    let dead: Vec<_> = rows.iter().filter(|r| r.status == 3).collect();
    assert_eq!(dead.len(), 3, "only the unroutable ones are dead: {dead:?}");
    for d in &dead {
        assert!(
            d.last_error
                .as_deref()
                .unwrap()
                .contains("no route for topic \"nowhere.v1\""),
            "{d:?}"
        );
        assert_eq!(d.attempts, 1);
    }
    // With the breaker open most claims skip the publish: far fewer calls than claims.
    assert!(
        calls_during_outage < 20,
        "publish attempts while open: {calls_during_outage}"
    );

    // The destination recovers: its messages arrive, none lost.
    flaky.up.store(true, Ordering::SeqCst);
    let seen = flaky_seen.clone();
    wait_until(
        "billing delivered after recovery",
        Duration::from_secs(15),
        || {
            let seen = seen.clone();
            async move {
                let n = seen.lock().unwrap().len();
                if n == 100 {
                    Ok(())
                } else {
                    Err(format!("{n}/100"))
                }
            }
        },
    )
    .await;
    assert!(matches!(
        router.breakers()[1].1,
        BreakerState::Closed { failures: 0 }
    ));
    handle.shutdown().await.unwrap();
    let rows = db.rows().await;
    // Slow messages never confirmed: still waiting (pending/claimed), attempts not used up.
    for r in rows.iter().filter(|r| r.status != 2 && r.status != 3) {
        assert!(r.attempts <= 1, "{r:?}");
    }
    assert_eq!(rows.iter().filter(|r| r.status == 2).count(), 600);
}

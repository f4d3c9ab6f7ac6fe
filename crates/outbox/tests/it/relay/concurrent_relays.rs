//! Whole relays competing over one PostgreSQL outbox: four relays over 10,000 messages
//! never publish a message twice while its lease holds, and a crashed relay's claims are
//! delivered by another after the lease.

#![allow(clippy::unwrap_used)]

use crate::common::{RecordingSink, messages, relay_config, total, wait_until};
use crate::store::conformance::Backend as _;
use async_trait::async_trait;
use outbox::sink::Confirmations;
use outbox::sink::{PublishError, Sink};
use outbox::{OutgoingMessage, Relay};
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_relays_over_ten_thousand_messages_publish_each_once() {
    let db = crate::store::conformance_postgres::PgBackend::create(
        "four_relays",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let (sink, seen) = RecordingSink::new();
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let mut cfg = relay_config(&format!("relay-{i}"));
            cfg.batch_size = 50;
            Relay::new(db.store(), sink.clone(), cfg).spawn()
        })
        .collect();
    // Producers keep committing while the relays run.
    for chunk in 0..10 {
        db.enqueue_all(&messages(&format!("four.t{chunk}"), 1_000))
            .await;
    }
    let store = db.store();
    crate::common::wait_dispatched(
        "10,000 dispatched",
        &store,
        usize::try_from(10_000).unwrap(),
        Duration::from_secs(60),
    )
    .await;
    let mut per_relay = Vec::new();
    for h in handles {
        per_relay.push(h.shutdown().await.unwrap().dispatched);
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 10_000, "every message published");
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "published more than once: {twice:?}");
    assert_eq!(per_relay.iter().sum::<u64>(), 10_000);
    assert!(
        per_relay.iter().filter(|n| **n > 0).count() >= 2,
        "the relays competed: {per_relay:?}"
    );
}

/// Never answers: the relay holding its claims is then "crashed" with `abort`.
struct Hang;

#[async_trait]
impl Sink for Hang {
    async fn publish(&self, _batch: &[OutgoingMessage], confirm: &Confirmations) {
        let results: Vec<Result<(), PublishError>> = async { std::future::pending().await }.await;
        for (i, r) in results.into_iter().enumerate() {
            confirm.set(i, r);
        }
    }
    fn describe(&self) -> String {
        "hang".into()
    }
}

/// Backends of this server whose `application_name` is `name`.
async fn backends(conn: &mut sqlx::PgConnection, name: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
        .bind(name)
        .fetch_one(conn)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crashed_relays_claims_are_delivered_after_the_lease() {
    let db = crate::store::conformance_postgres::PgBackend::create(
        "crashed_relay",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let enq = db.enqueue_all(&messages("crash.t", 200)).await;
    // The doomed relay has a store (a pool) of its own, with its own application_name, so
    // that its crash can include its connections.
    let schema = &db.schema;
    let app = format!("doomed_{}", crate::common::unique());
    let doomed_store = outbox::postgres::PgStore::connect(
        &format!("{}?application_name={app}", crate::common::pg_url()),
        outbox::StoreConfig {
            schema: schema.ident(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut cfg = relay_config("doomed");
    cfg.lease = Duration::from_millis(1_500);
    cfg.publish_timeout = Duration::from_millis(1_000);
    let doomed = Relay::new(Arc::new(doomed_store.clone()), Arc::new(Hang), cfg).spawn();
    let d = &db;
    wait_until(
        "the doomed relay holds claims",
        Duration::from_secs(5),
        || async move {
            let held = d
                .rows()
                .await
                .iter()
                .filter(|r| r.claimed_by.as_deref() == Some("doomed") && r.status == 1)
                .count();
            if held > 0 {
                Ok(())
            } else {
                Err("no claims yet".into())
            }
        },
    )
    .await;
    // A crash: nothing released. `abort` only asks the task to stop, and a statement it
    // had sent (its other worker's claim, say) still runs in the server; so the crash also
    // ends its connections and waits until they are gone. Only then is the set of rows it
    // holds final: reading it earlier raced that claim, whose rows were then counted as
    // never held (attempts 2 seen, 1 expected).
    doomed.abort();
    drop(doomed_store);
    let admin = tokio::sync::Mutex::new(crate::common::pg_connect().await);
    let (admin, app) = (&admin, app.as_str());
    wait_until(
        "the doomed relay's connections gone",
        Duration::from_secs(10),
        || async move {
            let mut admin = admin.lock().await;
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            )
            .bind(app)
            .execute(&mut *admin)
            .await
            .unwrap();
            match backends(&mut admin, app).await {
                0 => Ok(()),
                n => Err(format!("{n} connections of the doomed relay still there")),
            }
        },
    )
    .await;
    let held: Vec<i64> = db
        .rows()
        .await
        .iter()
        .filter(|r| r.status == 1)
        .map(|r| r.id)
        .collect();
    assert!(!held.is_empty());

    let (sink, seen) = RecordingSink::new();
    let rescuer = Relay::new(db.store(), sink, relay_config("rescuer")).spawn();
    let store = db.store();
    crate::common::wait_dispatched(
        "all 200 dispatched",
        &store,
        usize::try_from(200).unwrap(),
        Duration::from_secs(15),
    )
    .await;
    rescuer.shutdown().await.unwrap();
    assert_eq!(
        total(&seen),
        200,
        "each message published once by the rescuer"
    );
    for r in db.rows().await {
        assert_eq!(r.status, 2);
        let expected_attempts = if held.contains(&r.id) { 2 } else { 1 };
        assert_eq!(r.attempts, expected_attempts, "{r:?}");
    }
    assert_eq!(enq.len(), 200);
}

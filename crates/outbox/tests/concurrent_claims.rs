//! Guarantee 4 on PostgreSQL: any number of relays may run against one store; claims never
//! overlap while a lease holds, and a dead relay's claims come back after the lease.

#![allow(clippy::unwrap_used)]

mod common;

use common::{RecordingSink, TestDb, messages, pg_store, relay_config, total, wait_until};
use outbox::store::{ClaimRequest, status};
use outbox::{Relay, RelayStats, Store};
use sqlx::AssertSqlSafe;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

const N: i64 = 10_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_relays_publish_each_message_exactly_once_and_dead_claims_return() {
    let (pg, schema) = pg_store("conc").await;
    let s = schema.name.clone();
    let pool = pg.pool().clone();
    let store: Arc<dyn Store> = Arc::new(pg.clone());
    let insert = |from: i64, to: i64| {
        // The documented plain INSERT, as a non-Rust producer would write it.
        let q = format!(
            "INSERT INTO {s}.messages (message_id, topic, payload)
             SELECT gen_random_uuid(), 't.conc.v1', int8send(g) FROM generate_series($1::int8, $2::int8) g"
        );
        let pool = pool.clone();
        async move {
            sqlx::query(AssertSqlSafe(q))
                .bind(from)
                .bind(to)
                .execute(&pool)
                .await
                .unwrap();
        }
    };
    // Half the backlog before the relays start, half while they run.
    insert(1, N / 2).await;

    let (sink, seen) = RecordingSink::new();
    let mut handles = Vec::new();
    for i in 0..4 {
        let mut cfg = relay_config(&format!("relay-{i}"));
        cfg.lease = Duration::from_secs(120); // no lease expires during the test
        cfg.publish_timeout = Duration::from_secs(60);
        handles.push(Relay::new(store.clone(), sink.clone(), cfg).spawn());
    }
    let producers: Vec<_> = (0..10)
        .map(|i| {
            let from = N / 2 + 1 + i * (N / 20);
            tokio::spawn(insert(from, from + N / 20 - 1))
        })
        .collect();
    for p in producers {
        p.await.unwrap();
    }

    let st = store.clone();
    wait_until("all dispatched", Duration::from_secs(60), || {
        let st = st.clone();
        async move {
            let c = st.counts().await.unwrap();
            if c.dispatched == N {
                Ok(())
            } else {
                Err(format!("{c:?}"))
            }
        }
    })
    .await;
    let mut stats = Vec::new();
    for h in handles {
        stats.push(h.shutdown().await.unwrap());
    }
    eprintln!("relay stats: {stats:?}");
    let sum = |f: fn(&RelayStats) -> u64| stats.iter().map(f).sum::<u64>();
    assert_eq!(
        sum(|s| s.claimed),
        N as u64,
        "no row claimed twice: {stats:?}"
    );
    assert!(
        stats.iter().filter(|s| s.claimed > 0).count() >= 2,
        "the relays did not really compete: {stats:?}"
    );
    assert_eq!(sum(|s| s.dispatched), N as u64, "{stats:?}");
    assert_eq!(sum(|s| s.lost_claims), 0, "{stats:?}");
    assert_eq!(
        sum(|s| s.retried + s.quarantined + s.released),
        0,
        "{stats:?}"
    );

    let ids: HashSet<Uuid> = sqlx::query_scalar::<_, Uuid>(AssertSqlSafe(format!(
        "SELECT message_id FROM {s}.messages"
    )))
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert_eq!(ids.len(), N as usize);
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), N as usize, "every id published");
        let twice: Vec<_> = seen.iter().filter(|(_, n)| **n != 1).collect();
        assert!(twice.is_empty(), "published more than once: {twice:?}");
        assert!(seen.keys().all(|k| ids.contains(k)));
    }
    let attempts: Vec<i32> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT DISTINCT attempts FROM {s}.messages"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(attempts, vec![1]);

    // A relay that dies holding claims: claim directly and never settle.
    let db = TestDb::Pg(pg, schema);
    let extra = db.enqueue_all(&messages("t.conc.v1", 30)).await;
    let dead_claim = store
        .claim(&ClaimRequest {
            relay_id: "relay-killed".into(),
            batch_size: 100,
            lease: Duration::from_millis(1500),
        })
        .await
        .unwrap();
    assert_eq!(dead_claim.messages.len(), 30);
    let before = total(&seen);
    let mut cfg = relay_config("relay-rescuer");
    cfg.poll_interval = Duration::from_millis(100);
    let rescuer = Relay::new(store.clone(), sink.clone(), cfg).spawn();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let extra_ids: HashSet<i64> = extra.iter().map(|e| e.id).collect();
    let held: Vec<_> = db
        .rows()
        .await
        .into_iter()
        .filter(|r| extra_ids.contains(&r.id))
        .collect();
    assert_eq!(
        total(&seen),
        before,
        "claimed rows published while the lease held"
    );
    assert_eq!(held.len(), 30);
    for r in &held {
        assert_eq!(r.status, i32::from(status::CLAIMED), "{r:?}");
        assert_eq!(r.claimed_by.as_deref(), Some("relay-killed"));
    }
    let st = store.clone();
    wait_until(
        "dead relay's claims dispatched",
        Duration::from_secs(10),
        || {
            let st = st.clone();
            async move {
                let c = st.counts().await.unwrap();
                if c.dispatched == N + 30 {
                    Ok(())
                } else {
                    Err(format!("{c:?}"))
                }
            }
        },
    )
    .await;
    let stats = rescuer.shutdown().await.unwrap();
    assert_eq!(stats.dispatched, 30);
    let rows = db.rows().await;
    for e in &extra {
        let r = rows.iter().find(|r| r.id == e.id).unwrap();
        assert_eq!(r.status, i32::from(status::DISPATCHED));
        assert_eq!(r.attempts, 2, "the dead claim's attempt stays counted");
        assert_eq!(r.claimed_by.as_deref(), Some("relay-rescuer"));
        assert_eq!(seen.lock().unwrap().get(&e.message_id), Some(&1));
    }
    // The dead relay's late mark changes nothing now.
    let late: Vec<i64> = extra.iter().map(|e| e.id).collect();
    assert_eq!(
        store
            .mark_dispatched(dead_claim.token, &late)
            .await
            .unwrap(),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_three_relays_never_publish_a_message_twice() {
    const M: usize = 3_000;
    let db = TestDb::sqlite().await;
    let store = db.store();
    let (sink, seen) = RecordingSink::new();
    let mut handles = Vec::new();
    for i in 0..3 {
        let mut cfg = relay_config(&format!("lite-{i}"));
        cfg.lease = Duration::from_secs(120);
        cfg.publish_timeout = Duration::from_secs(60);
        handles.push(Relay::new(store.clone(), sink.clone(), cfg).spawn());
    }
    // Producers commit while the relays claim (SQLite serializes the writers).
    for chunk in messages("t.lite.v1", M).chunks(250) {
        db.enqueue_all(chunk).await;
    }
    let st = store.clone();
    wait_until("all dispatched", Duration::from_secs(30), || {
        let st = st.clone();
        async move {
            let c = st.counts().await.unwrap();
            if c.dispatched == M as i64 {
                Ok(())
            } else {
                Err(format!("{c:?}"))
            }
        }
    })
    .await;
    let mut stats = Vec::new();
    for h in handles {
        stats.push(h.shutdown().await.unwrap());
    }
    assert_eq!(
        stats.iter().map(|s| s.claimed).sum::<u64>(),
        M as u64,
        "{stats:?}"
    );
    assert_eq!(
        stats.iter().map(|s| s.lost_claims).sum::<u64>(),
        0,
        "{stats:?}"
    );
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), M);
    assert!(seen.values().all(|&n| n == 1));
}

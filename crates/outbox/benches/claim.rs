//! Claim latency with a million dispatched rows retained, per store. Prints figures;
//! asserts nothing about speed. Run: `cargo bench -p outbox --bench claim` (PostgreSQL and
//! MariaDB must be running; see the README). `BENCH_RETAINED` changes the row count.
//!
//! For each store: claim + mark 100 rows at a time over 3,000 pending rows in an empty
//! outbox (the baseline), then again after `BENCH_RETAINED` dispatched rows were added and
//! statistics refreshed. The live-row index should keep the two close. Then topic pauses:
//! the same claims with no pause, with 10 topic pauses whose topics have no rows, and with
//! 10 topic pauses while 1,000 rows of the paused topics are due ahead of the claimed ones
//! (the claim skips them on every call). Then per-key ordering (`--ordered`): the ordered
//! claim over the same rows with the retained rows still there, and with a key blocked
//! behind a dead letter with `BENCH_BLOCKED` (50,000) rows waiting: claims while those rows
//! are due, then after `Maintenance::park_held` parked them.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]
#![allow(clippy::cast_possible_truncation)]

use outbox::mysql::MySqlStore;
use outbox::postgres::PgStore;
use outbox::sqlite::SqliteStore;
use outbox::store::prelude::*;
use outbox::store::{ClaimRequest, Dead, KeyOrdering, Store};
use outbox::{Ident, Message, StoreConfig};
use sqlx::AssertSqlSafe;
use std::time::{Duration, Instant};
use uuid::Uuid;

const PG: &str = "postgres://postgres@127.0.0.1:5432/test";
const MYSQL: &str = "mysql://root@127.0.0.1:3306/test";

fn config(prefix: &str) -> StoreConfig {
    StoreConfig {
        schema: Ident::new(prefix).unwrap(),
        ..Default::default()
    }
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1e3
}

/// Claims and marks batches of 100 until nothing is due, with `pauses` topic pauses in
/// force (`paused.tN.>`, lifted afterwards: the claim statement skips their topics);
/// returns per-batch latencies.
async fn claim_all(store: &dyn Store, pauses: usize) -> Vec<Duration> {
    claim_all_ordered(store, pauses, &KeyOrdering::default()).await
}

/// [`claim_all`] with `ordering`.
async fn claim_all_ordered(
    store: &dyn Store,
    pauses: usize,
    ordering: &KeyOrdering,
) -> Vec<Duration> {
    let req = ClaimRequest {
        relay_id: "bench".into(),
        batch_size: 100,
        lease: Duration::from_secs(60),
        skip_topics: Vec::new(),
        ordering: ordering.clone(),
    };
    let patterns: Vec<_> = (0..pauses)
        .map(|i| outbox::sink::router::TopicPattern::parse(&format!("paused.t{i}.>")).unwrap())
        .collect();
    for p in &patterns {
        store.pause_topic(p, "bench", "bench").await.unwrap();
    }
    let mut out = Vec::new();
    loop {
        let t = Instant::now();
        let c = store.claim(&req).await.unwrap();
        if c.messages.is_empty() {
            for p in &patterns {
                store.resume_topic(p.as_str()).await.unwrap();
            }
            return out;
        }
        let ids: Vec<i64> = c.messages.iter().map(|m| m.id).collect();
        store.mark_dispatched(c.token, &ids).await.unwrap();
        out.push(t.elapsed());
    }
}

enum Db {
    Pg(PgStore),
    My(MySqlStore),
    Lite(SqliteStore),
}

impl Db {
    fn store(&self) -> &dyn Store {
        match self {
            Db::Pg(s) => s,
            Db::My(s) => s,
            Db::Lite(s) => s,
        }
    }

    async fn enqueue(&self, n: usize) {
        self.enqueue_topic(n, |_| "bench.claim.v1".to_owned()).await;
    }

    async fn enqueue_topic(&self, n: usize, topic: impl Fn(usize) -> String) {
        self.enqueue_keyed(n, topic, |i| format!("k{}", i % 8))
            .await;
    }

    async fn enqueue_keyed(
        &self,
        n: usize,
        topic: impl Fn(usize) -> String,
        key: impl Fn(usize) -> String,
    ) {
        let msgs: Vec<Message> = (0..n)
            .map(|i| Message::new(topic(i), vec![b'x'; 100]).key(key(i)))
            .collect();
        match self {
            Db::Pg(s) => {
                let mut tx = s.pool().begin().await.unwrap();
                for m in &msgs {
                    s.enqueue(&mut tx, m).await.unwrap();
                }
                tx.commit().await.unwrap();
            }
            Db::My(s) => {
                let mut tx = s.pool().begin().await.unwrap();
                for m in &msgs {
                    s.enqueue(&mut tx, m).await.unwrap();
                }
                tx.commit().await.unwrap();
            }
            Db::Lite(s) => {
                let mut tx = s.pool().begin().await.unwrap();
                for m in &msgs {
                    s.enqueue(&mut tx, m).await.unwrap();
                }
                tx.commit().await.unwrap();
            }
        }
    }

    /// Adds `n` dispatched rows in bulk, then refreshes planner statistics.
    async fn retain(&self, n: usize, p: &str) {
        match self {
            Db::Pg(s) => {
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "INSERT INTO {p}.messages (message_id, topic, payload, status, dispatched_at)
                     SELECT gen_random_uuid(), 'bench.old.v1', '\\x00', 2, now() - interval '1 day'
                     FROM generate_series(1, {n});
                     ANALYZE {p}.messages;"
                )))
                .execute(s.pool())
                .await
                .unwrap();
            }
            Db::My(s) => {
                let mut left = n;
                while left > 0 {
                    let k = left.min(100_000);
                    sqlx::raw_sql(AssertSqlSafe(format!(
                        "INSERT INTO {p}_messages (message_id, topic, payload, headers, status, dispatched_at)
                         SELECT UUID(), 'bench.old.v1', 'x', '{{}}', 2, UTC_TIMESTAMP(6) FROM seq_1_to_{k}"
                    )))
                    .execute(s.pool())
                    .await
                    .unwrap();
                    left -= k;
                }
                sqlx::raw_sql(AssertSqlSafe(format!("ANALYZE TABLE {p}_messages")))
                    .execute(s.pool())
                    .await
                    .unwrap();
            }
            Db::Lite(s) => {
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {n})
                     INSERT INTO {p}_messages (message_id, topic, payload, status, dispatched_at)
                     SELECT printf('%08x-0000-7000-8000-%012x', x, x), 'bench.old.v1', x'00', 2, 0 FROM c;
                     ANALYZE;"
                )))
                .execute(s.pool())
                .await
                .unwrap();
            }
        }
    }

    async fn drop_all(&self, p: &str) {
        match self {
            Db::Pg(s) => {
                sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {p} CASCADE")))
                    .execute(s.pool())
                    .await
                    .unwrap();
            }
            Db::My(s) => {
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "DROP PROCEDURE IF EXISTS {p}_enqueue;
                     DROP PROCEDURE IF EXISTS {p}_inbox_accept;
                     DROP TABLE {p}_messages, {p}_control, {p}_schema_migrations, {p}_replays,
                         {p}_relays, {p}_topic_pauses, {p}_inbox"
                )))
                .execute(s.pool())
                .await
                .unwrap();
            }
            Db::Lite(_) => {}
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let retained: usize = std::env::var("BENCH_RETAINED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let blocked: usize = std::env::var("BENCH_BLOCKED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000);
    println!(
        "claim+mark latency, batches of 100 over 3,000 pending rows, before and after {retained} dispatched rows are retained"
    );
    let dir = tempfile::tempdir().unwrap();
    for kind in ["postgres", "mariadb", "sqlite"] {
        let p = format!("bclaim_{}", &Uuid::new_v4().simple().to_string()[..8]);
        let db = match kind {
            "postgres" => Db::Pg(
                PgStore::connect(PG, config(&p))
                    .await
                    .expect("PostgreSQL on 127.0.0.1:5432"),
            ),
            "mariadb" => Db::My(
                MySqlStore::connect(MYSQL, config(&p))
                    .await
                    .expect("MariaDB on 127.0.0.1:3306"),
            ),
            _ => {
                let url = format!("sqlite://{}", dir.path().join("claim.db").display());
                Db::Lite(SqliteStore::connect(&url, config(&p)).await.unwrap())
            }
        };
        db.store().migrate().await.unwrap();
        db.enqueue(3_000).await;
        let mut before = claim_all(db.store(), 0).await;
        let t = Instant::now();
        db.retain(retained, &p).await;
        let fill = t.elapsed();
        db.enqueue(3_000).await;
        let mut after = claim_all(db.store(), 0).await;
        let (b50, b99) = (pct(&mut before, 0.5), pct(&mut before, 0.99));
        let (a50, a99) = (pct(&mut after, 0.5), pct(&mut after, 0.99));
        println!(
            "{kind:<9} empty: p50 {b50:6.2} ms p99 {b99:6.2} ms | {retained} retained (filled in {:.1} s): p50 {a50:6.2} ms p99 {a99:6.2} ms | p50 ratio {:.2}",
            fill.as_secs_f64(),
            a50 / b50
        );
        // Topic pauses: none; 10 whose topics have no rows; 10 with 1,000 of their rows
        // due ahead of the claimed ones.
        db.enqueue(3_000).await;
        let mut none = claim_all(db.store(), 0).await;
        db.enqueue(3_000).await;
        let mut idle = claim_all(db.store(), 10).await;
        db.enqueue_topic(1_000, |i| format!("paused.t{}.x", i % 10))
            .await;
        db.enqueue(3_000).await;
        let mut ten = claim_all(db.store(), 10).await;
        let (n50, n99) = (pct(&mut none, 0.5), pct(&mut none, 0.99));
        let (i50, i99) = (pct(&mut idle, 0.5), pct(&mut idle, 0.99));
        let (t50, t99) = (pct(&mut ten, 0.5), pct(&mut ten, 0.99));
        println!(
            "{kind:<9} 0 topic pauses: p50 {n50:6.2} ms p99 {n99:6.2} ms | 10 pauses, none of their rows due: p50 {i50:6.2} ms p99 {i99:6.2} ms (x{:.2}) | 10 pauses, 1,000 paused rows due: p50 {t50:6.2} ms p99 {t99:6.2} ms (x{:.2})",
            i50 / n50,
            t50 / n50
        );
        // Per-key ordering: the ordered claim over 8 keys with the retained rows there,
        // then a key blocked behind a dead letter with `blocked` rows waiting.
        let ordering = KeyOrdering {
            topics: vec![outbox::sink::router::TopicPattern::parse("bench.>").unwrap()],
            skip_dead: false,
        };
        db.enqueue(3_000).await;
        let mut ordered = claim_all_ordered(db.store(), 0, &ordering).await;
        let (o50, o99) = (pct(&mut ordered, 0.5), pct(&mut ordered, 0.99));
        db.enqueue_keyed(1, |_| "bench.claim.v1".into(), |_| "blocked".into())
            .await;
        let c = db
            .store()
            .claim(&ClaimRequest {
                relay_id: "bench".into(),
                batch_size: 1,
                lease: Duration::from_secs(60),
                skip_topics: Vec::new(),
                ordering: ordering.clone(),
            })
            .await
            .unwrap();
        let dead: Vec<Dead> = c
            .messages
            .iter()
            .map(|m| Dead {
                id: m.id,
                error: "bench".into(),
            })
            .collect();
        assert_eq!(dead.len(), 1);
        db.store().quarantine(c.token, &dead).await.unwrap();
        let mut left = blocked;
        while left > 0 {
            let k = left.min(10_000);
            db.enqueue_keyed(k, |_| "bench.claim.v1".into(), |_| "blocked".into())
                .await;
            left -= k;
        }
        db.enqueue(1_000).await;
        let mut due = claim_all_ordered(db.store(), 0, &ordering).await;
        let t = Instant::now();
        let parked = db.store().park_held(&ordering).await.unwrap();
        let park = t.elapsed();
        db.enqueue(1_000).await;
        let mut after_park = claim_all_ordered(db.store(), 0, &ordering).await;
        let (d50, d99) = (pct(&mut due, 0.5), pct(&mut due, 0.99));
        let (k50, k99) = (pct(&mut after_park, 0.5), pct(&mut after_park, 0.99));
        println!(
            "{kind:<9} ordered, 8 keys, {retained} retained: p50 {o50:6.2} ms p99 {o99:6.2} ms (x{:.2} unordered) | 1 key blocked, {blocked} rows behind it due: p50 {d50:8.2} ms p99 {d99:8.2} ms | parked ({parked} rows in {:.2} s): p50 {k50:6.2} ms p99 {k99:6.2} ms (x{:.3})",
            o50 / n50,
            park.as_secs_f64(),
            k50 / d50
        );
        db.drop_all(&p).await;
    }
}

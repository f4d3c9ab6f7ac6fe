//! Jobs benchmark: in-process handlers ([`outbox::job`]) against the relay's file sink,
//! on PostgreSQL and SQLite. Prints figures; asserts nothing about speed. Run:
//! `cargo bench -p outbox --bench jobs` (PostgreSQL must listen on 127.0.0.1:5432).
//!
//! 1. Throughput: a backlog of `BENCH_JOBS` (20,000) ~300-byte jobs drained by one relay at
//!    its defaults, once into a `file:` sink (appended and fsynced per batch: the relay's
//!    own cheapest destination) and once through a handler that does nothing, in
//!    alternating rounds; jobs/s of each and the ratio handler / file.
//! 2. Enqueue → handler start latency, p50/p99/max, at 100 and 1,000 jobs/s offered by
//!    single-row producer transactions for `BENCH_LATENCY_SECS` (5) s, a relay at its
//!    defaults (each store's wake-up: PostgreSQL's NOTIFY, SQLite's file watch).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]
#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use outbox::events::Enqueue;
use outbox::job::{Handler, Job, JobError};
use outbox::postgres::PgStore;
use outbox::sink::router::Router;
use outbox::sqlite::SqliteStore;
use outbox::store::Store;
use outbox::store::prelude::*;
use outbox::{Ident, Message, Relay, RelayConfig, StoreConfig};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const PG: &str = "postgres://postgres@127.0.0.1:5432/test";

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `n` jobs of ~300 bytes in transactions of 1,000.
async fn fill<S: Enqueue>(store: &S, n: usize) {
    let payload = vec![b'x'; 300];
    for chunk in 0..n.div_ceil(1000) {
        let mut tx = store.pool().begin().await.unwrap();
        for _ in 0..1000.min(n - chunk * 1000) {
            store
                .enqueue_in(&mut tx, &Message::new("jobs.bench", payload.clone()))
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
    }
}

fn drain_config() -> RelayConfig {
    RelayConfig {
        drain: true,
        ..RelayConfig::default()
    }
}

/// Drains the backlog through `router`; jobs/s.
async fn drain(store: Arc<dyn Store>, router: Router, n: usize) -> f64 {
    let began = Instant::now();
    let stats = Relay::with_router(store, router, drain_config())
        .run(CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(stats.dispatched as usize, n, "{stats:?}");
    n as f64 / began.elapsed().as_secs_f64()
}

fn noop() -> Handler {
    Handler::new("noop", |_job: Job| async { Ok::<(), JobError>(()) })
}

async fn file_router(dir: &std::path::Path) -> Router {
    let url = format!("file:{}", dir.join("jobs.jsonl").display());
    Router::single(Arc::from(outbox::sink::open(&url).await.unwrap()))
}

async fn throughput<S: Enqueue>(
    label: &str,
    store: &S,
    dyn_store: Arc<dyn Store>,
    dir: &std::path::Path,
) {
    let n = env_u64("BENCH_JOBS", 20_000) as usize;
    let (mut file, mut jobs) = (Vec::new(), Vec::new());
    for round in 0..4 {
        fill(store, n).await;
        if round % 2 == 0 {
            file.push(drain(dyn_store.clone(), file_router(dir).await, n).await);
        } else {
            let router = Router::builder().handle("jobs.>", noop()).build().unwrap();
            jobs.push(drain(dyn_store.clone(), router, n).await);
        }
    }
    let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    println!(
        "{label:<10} {n} jobs, best of 2 alternating: file sink {:>8.0}/s, no-op handler {:>8.0}/s, handler / file {:.2}x",
        best(&file),
        best(&jobs),
        best(&jobs) / best(&file)
    );
}

/// Commit → handler start, at `rate` jobs/s for `secs` s.
async fn latency<S: Enqueue>(
    label: &str,
    store: &S,
    dyn_store: Arc<dyn Store>,
    rate: u32,
    secs: u64,
) {
    let before: Arc<Mutex<HashMap<Uuid, Instant>>> = Arc::default();
    let started: Arc<Mutex<HashMap<Uuid, Instant>>> = Arc::default();
    let s = started.clone();
    let router = Router::builder()
        .handle(
            "jobs.>",
            Handler::new("timed", move |job: Job| {
                s.lock().unwrap().insert(job.message_id, Instant::now());
                async { Ok::<(), JobError>(()) }
            }),
        )
        .build()
        .unwrap();
    let cancel = CancellationToken::new();
    let relay = tokio::spawn(
        Relay::with_router(dyn_store, router, RelayConfig::default()).run(cancel.clone()),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let n = rate as u64 * secs;
    let every = Duration::from_secs_f64(1.0 / f64::from(rate));
    let t0 = Instant::now();
    for i in 0..n {
        let due = t0 + every * (i as u32);
        tokio::time::sleep_until(due.into()).await;
        let m = Message::new("jobs.latency", vec![b'x'; 300]);
        let id = m.id();
        let mut tx = store.pool().begin().await.unwrap();
        store.enqueue_in(&mut tx, &m).await.unwrap();
        before.lock().unwrap().insert(id, Instant::now());
        tx.commit().await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while started.lock().unwrap().len() < n as usize && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cancel.cancel();
    relay.await.unwrap().unwrap();
    let before = before.lock().unwrap();
    let started = started.lock().unwrap();
    let mut lat: Vec<f64> = before
        .iter()
        .filter_map(|(id, b)| {
            started
                .get(id)
                .map(|s| s.saturating_duration_since(*b).as_secs_f64() * 1e3)
        })
        .collect();
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    println!(
        "{label:<10} {rate:>5} jobs/s offered: {} of {n} started; enqueue → start p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        lat.len(),
        pct(0.50),
        pct(0.99),
        lat.last().copied().unwrap_or(0.0)
    );
}

#[tokio::main]
async fn main() {
    let dir = tempfile::tempdir().unwrap();
    let secs = env_u64("BENCH_LATENCY_SECS", 5);
    println!(
        "jobs benchmark ({} CPUs)",
        std::thread::available_parallelism().map_or(0, usize::from)
    );

    // PostgreSQL: a schema of its own, dropped at the end.
    let schema = format!("bench_jobs_{}", &Uuid::new_v4().simple().to_string()[..8]);
    let pg = PgStore::connect(
        PG,
        StoreConfig {
            schema: Ident::new(&schema).unwrap(),
            ..Default::default()
        },
    )
    .await
    .expect("PostgreSQL must listen on 127.0.0.1:5432");
    pg.migrate().await.unwrap();
    let pg_dyn: Arc<dyn Store> = Arc::new(pg.clone());
    throughput("postgresql", &pg, pg_dyn.clone(), dir.path()).await;

    let url = format!("sqlite://{}", dir.path().join("jobs.db").display());
    let sqlite = SqliteStore::connect(&url, StoreConfig::default())
        .await
        .unwrap();
    sqlite.migrate().await.unwrap();
    let sqlite_dyn: Arc<dyn Store> = Arc::new(sqlite.clone());
    throughput("sqlite", &sqlite, sqlite_dyn.clone(), dir.path()).await;

    for rate in [100, 1_000] {
        latency("postgresql", &pg, pg_dyn.clone(), rate, secs).await;
        latency("sqlite", &sqlite, sqlite_dyn.clone(), rate, secs).await;
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(pg.pool())
        .await
        .unwrap();
}

//! Relay benchmark: PostgreSQL → NATS JetStream on this machine. Prints figures; asserts
//! nothing about speed. Run: `cargo bench -p outbox --bench relay` (PostgreSQL and NATS
//! must be running; see the README).
//!
//! Figures, each measured in the same run so ratios survive a noisy machine:
//! 1. baselines: the store alone (claim + mark, no broker) and JetStream alone (pipelined
//!    publishes, no database);
//!    and settling a mixed batch in one store call against one call per outcome kind;
//!    and the relay over the store alone keeping confirmed rows (`keep`) against deleting
//!    them (`--on-dispatch delete`), alternating rounds;
//! 2. relay throughput draining a backlog, batch 100 and 1,000;
//! 3. relay throughput while producers insert at full speed (the claim-plan trap);
//! 4. commit-to-confirm latency p50/p99 at a steady producer rate, batch 100 and 1,000;
//! 5. the producer-side cost of the NOTIFY trigger (single-row transactions, on vs off).
//!
//! 6. what an enqueue costs a producer: single-row transactions of a business insert
//!    alone, a plain INSERT of the same outbox row, the Rust `enqueue` and the SQL
//!    `outbox.enqueue(...)`, each with NOTIFY on and off, in interleaved rounds.
//!
//! 7. idle cost per store (PostgreSQL, MariaDB, SQLite): one relay at the defaults with
//!    nothing due, statements/s and CPU over `BENCH_IDLE_SECS` (60);
//! 8. steady state at the defaults: two producers of 100-row transactions at full speed
//!    for `BENCH_STEADY_SECS` (60): produced vs relayed rows/s, the backlog's trend;
//! 9. commit → confirmation latency p50/p99/max at 100 and 1,000 msg/s offered
//!    (single-row transactions, relays at the defaults) for PostgreSQL and for SQLite with
//!    the producer in the relay's process and on a pool of its own (as another process).
//!
//! `cargo bench -p outbox --bench relay -- on-dispatch` runs only the keep/delete rounds;
//! `-- enqueue` only the enqueue costs; `-- idle`, `-- steady` and `-- latency` only
//! figures 7, 8 and 9 (MariaDB must run for `idle`).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]
#![allow(clippy::cast_possible_truncation)]

use async_trait::async_trait;
use outbox::postgres::PgStore;
use outbox::sink::Confirmations;
use outbox::sink::nats::{NatsOptions, NatsSink};
use outbox::sink::{PublishError, Sink};
use outbox::store::AnyStore;
use outbox::store::Store;
use outbox::store::prelude::*;
use outbox::{Ident, Message, OutgoingMessage, Relay, RelayConfig, StoreConfig};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uuid::Uuid;

const PG: &str = "postgres://postgres@127.0.0.1:5432/test";
const NATS: &str = "nats://127.0.0.1:4222";
const MYSQL: &str = "mysql://root@127.0.0.1:3306/test";

/// Per message id: when the sink was handed it (its claim done) and when it was confirmed.
type Times = Arc<Mutex<HashMap<Uuid, (Instant, Instant)>>>;

/// Confirms at once (the store-only baseline).
struct NullSink;

#[async_trait]
impl Sink for NullSink {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        let results: Vec<Result<(), PublishError>> = async { vec![Ok(()); batch.len()] }.await;
        for (i, r) in results.into_iter().enumerate() {
            confirm.set(i, r);
        }
    }
    fn describe(&self) -> String {
        "null".into()
    }
}

/// Records when each message was confirmed.
struct Timed<S> {
    inner: S,
    confirmed: Times,
}

#[async_trait]
impl<S: Sink> Sink for Timed<S> {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        let results: Vec<Result<(), PublishError>> = async {
            let handed = Instant::now();
            let r = self.inner.publish_all(batch).await;
            let now = Instant::now();
            let mut c = self.confirmed.lock().unwrap();
            for (m, r) in batch.iter().zip(&r) {
                if r.is_ok() {
                    c.entry(m.message_id).or_insert((handed, now));
                }
            }
            r
        }
        .await;
        for (i, r) in results.into_iter().enumerate() {
            confirm.set(i, r);
        }
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}

async fn fresh_store(tag: &str) -> PgStore {
    let schema = format!("bench_{tag}_{}", &Uuid::new_v4().simple().to_string()[..8]);
    let store = PgStore::connect(
        PG,
        StoreConfig {
            schema: Ident::new(&schema).unwrap(),
            ..Default::default()
        },
    )
    .await
    .expect("PostgreSQL must listen on 127.0.0.1:5432");
    store.migrate().await.unwrap();
    store
}

async fn drop_store(store: &PgStore) {
    let s = store.config().schema.clone();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {s} CASCADE")))
        .execute(store.pool())
        .await
        .unwrap();
}

/// Inserts `n` messages in transactions of 1,000 with a 100-byte payload.
async fn prefill(store: &PgStore, topic: &str, n: usize) {
    let payload = vec![b'x'; 100];
    for chunk in 0..n.div_ceil(1000) {
        let mut tx = store.pool().begin().await.unwrap();
        for i in 0..1000.min(n - chunk * 1000) {
            let m = Message::new(topic.to_owned(), payload.clone()).key(format!("k{}", i % 16));
            store.enqueue(&mut tx, &m).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
}

fn relay_config(batch: u32, in_flight: u32) -> RelayConfig {
    RelayConfig {
        batch_size: batch,
        in_flight_batches: in_flight,
        drain: true,
        lease: Duration::from_secs(60),
        publish_timeout: Duration::from_secs(30),
        poll_interval: Duration::from_millis(100),
        ..RelayConfig::default()
    }
}

async fn drain(
    store: &PgStore,
    sink: Arc<dyn Sink>,
    batch: u32,
    in_flight: u32,
) -> (u64, Duration) {
    let t = Instant::now();
    let stats = Relay::new(
        Arc::new(store.clone()),
        sink,
        relay_config(batch, in_flight),
    )
    .run(Default::default())
    .await
    .unwrap();
    (stats.dispatched, t.elapsed())
}

/// Claims and settles until `n` rows were settled; returns (rows settled, time).
async fn settle_loop(store: &PgStore, batch: u32, one_call: bool) -> (u64, Duration) {
    use outbox::store::{ClaimRequest, Dead, Retry, Settlement};
    let req = ClaimRequest {
        relay_id: "bench-settle".into(),
        batch_size: batch,
        lease: Duration::from_secs(60),
        skip_topics: Vec::new(),
        ordering: Default::default(),
    };
    let t = Instant::now();
    let mut rows = 0u64;
    while t.elapsed() < Duration::from_secs(3) {
        let claim = store.claim(&req).await.unwrap();
        if claim.messages.is_empty() {
            break;
        }
        let mut s = Settlement::default();
        for (i, m) in claim.messages.iter().enumerate() {
            match i % 10 {
                7 => s.retries.push(Retry {
                    id: m.id,
                    delay: Duration::ZERO,
                    error: "transient: busy".into(),
                    refund_attempt: false,
                }),
                8 => s.dead.push(Dead {
                    id: m.id,
                    error: "permanent: refused".into(),
                }),
                9 => s.release.push(m.id),
                _ => s.dispatched.push(m.id),
            }
        }
        rows += s.len() as u64;
        if one_call {
            store.settle(claim.token, &s).await.unwrap();
        } else {
            store
                .mark_dispatched(claim.token, &s.dispatched)
                .await
                .unwrap();
            store.reschedule(claim.token, &s.retries).await.unwrap();
            store.quarantine(claim.token, &s.dead).await.unwrap();
            store.release(claim.token, &s.release).await.unwrap();
        }
    }
    (rows, t.elapsed())
}

async fn stream(js: &async_nats::jetstream::Context, subject_root: &str) -> String {
    let name = subject_root.replace('.', "_").to_uppercase();
    let _ = js.delete_stream(&name).await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![format!("{subject_root}.>")],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .expect("NATS with JetStream must listen on 127.0.0.1:4222");
    name
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1e3
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "idle") {
        idle_costs().await;
        return;
    }
    if std::env::args().any(|a| a == "cpu") {
        cpu_per_message().await;
        return;
    }
    let n: usize = std::env::var("BENCH_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30_000);
    let root = format!("bench{}", &Uuid::new_v4().simple().to_string()[..6]);
    let client = async_nats::connect(NATS)
        .await
        .expect("NATS must listen on 127.0.0.1:4222");
    let js = async_nats::jetstream::new(client);
    let stream_name = stream(&js, &root).await;
    let topic = format!("{root}.orders.v1");
    println!(
        "relay benchmark: PostgreSQL 127.0.0.1:5432 -> NATS JetStream 127.0.0.1:4222, {n} messages of 100 bytes"
    );

    // 1a. JetStream alone: pipelined publishes of n messages, then all acks.
    let nats = NatsSink::connect(NATS, NatsOptions::default())
        .await
        .unwrap();
    let msgs: Vec<OutgoingMessage> = (0..n)
        .map(|i| OutgoingMessage {
            id: i as i64,
            message_id: Uuid::now_v7(),
            topic: topic.clone(),
            key: None,
            payload: vec![b'x'; 100].into(),
            headers: Default::default(),
            occurred_at: chrono::Utc::now(),
            attempts: 1,
        })
        .collect();
    let t = Instant::now();
    for chunk in msgs.chunks(1000) {
        let r = nats.publish_all(chunk).await;
        assert!(r.iter().all(Result::is_ok));
    }
    let nats_rate = n as f64 / t.elapsed().as_secs_f64();
    println!("baseline  JetStream alone (batches of 1,000 pipelined)      {nats_rate:>9.0} msg/s");

    if std::env::args().any(|a| a == "steady") {
        steady_state(&topic).await;
        let _ = js.delete_stream(&stream_name).await;
        return;
    }
    if std::env::args().any(|a| a == "ordering") {
        ordering_costs(&root).await;
        let _ = js.delete_stream(&stream_name).await;
        return;
    }
    if std::env::args().any(|a| a == "latency") {
        latencies(&topic).await;
        let _ = js.delete_stream(&stream_name).await;
        return;
    }
    let only_on_dispatch = std::env::args().any(|a| a == "on-dispatch");
    if std::env::args().any(|a| a == "enqueue") {
        enqueue_costs(&topic).await;
        let _ = js.delete_stream(&stream_name).await;
        return;
    }
    let mut store_rates = HashMap::new();
    for batch in [100u32, 1000] {
        // 1d. Keep against delete on dispatch: the relay over the store alone (a sink
        //     that confirms at once), alternating rounds on fresh schemas.
        let mut kd = [0.0f64; 2];
        for round in 0..4 {
            let delete = round % 2 == 1;
            let store = fresh_store("dispatch").await;
            prefill(&store, &topic, n).await;
            let mut cfg = relay_config(batch, 1);
            if delete {
                cfg.on_dispatch = outbox::OnDispatch::Delete;
            }
            let t = Instant::now();
            let stats = Relay::new(Arc::new(store.clone()), Arc::new(NullSink), cfg)
                .run(Default::default())
                .await
                .unwrap();
            assert_eq!(stats.dispatched as usize, n);
            kd[usize::from(delete)] += n as f64 / t.elapsed().as_secs_f64() / 2.0;
            let left = store.counts().await.unwrap();
            assert_eq!(left.dispatched, if delete { 0 } else { n as i64 });
            drop_store(&store).await;
        }
        println!(
            "store     relay over the store alone, batch {batch:>5}: keep {:>9.0} msg/s, delete {:>9.0} msg/s (delete/keep = {:.2})",
            kd[0],
            kd[1],
            kd[1] / kd[0]
        );
        if only_on_dispatch {
            continue;
        }
        // 1b. The store alone: claim + mark, confirming at once.
        let store = fresh_store("base").await;
        prefill(&store, &topic, n).await;
        let (done, el) = drain(&store, Arc::new(NullSink), batch, 1).await;
        assert_eq!(done as usize, n);
        let store_rate = done as f64 / el.as_secs_f64();
        store_rates.insert(batch, store_rate);
        println!(
            "baseline  PostgreSQL claim+mark alone, batch {batch:>5}          {store_rate:>9.0} msg/s"
        );
        drop_store(&store).await;

        // 1c. Settling a mixed batch (70% confirmed, 10% each retried, quarantined,
        //     released): one `settle` call against the four calls (one per kind) it
        //     replaced, alternating, in the same run.
        let mut rates = [0.0f64; 2];
        for round in 0..4 {
            let one_call = round % 2 == 0;
            let store = fresh_store("settle").await;
            prefill(&store, &topic, n).await;
            let (rows, el) = settle_loop(&store, batch, one_call).await;
            rates[usize::from(!one_call)] += rows as f64 / el.as_secs_f64() / 2.0;
            drop_store(&store).await;
        }
        println!(
            "store     claim + settle a mixed batch of {batch:>5}: one call {:>9.0} rows/s, four calls {:>9.0} rows/s (one/four = {:.2})",
            rates[0],
            rates[1],
            rates[0] / rates[1]
        );

        // 2. The relay, PostgreSQL -> JetStream, draining a backlog.
        for in_flight in [1u32, 2, 4] {
            let store = fresh_store("relay").await;
            prefill(&store, &topic, n).await;
            let sink = NatsSink::connect(NATS, NatsOptions::default())
                .await
                .unwrap();
            let (done, el) = drain(&store, Arc::new(sink), batch, in_flight).await;
            assert_eq!(done as usize, n);
            let rate = done as f64 / el.as_secs_f64();
            let bound = store_rate.min(nats_rate);
            println!(
                "relay     PostgreSQL -> JetStream backlog, batch {batch:>5}, {in_flight} in flight {rate:>9.0} msg/s  ({:.0}% of the slower baseline)",
                100.0 * rate / bound
            );
            drop_store(&store).await;
        }
    }

    if only_on_dispatch {
        let _ = js.delete_stream(&stream_name).await;
        return;
    }

    // 3. Draining while two producers insert transactions of 100 at full speed, from an
    //    empty outbox that fills up (the claim-plan trap).
    {
        let store = fresh_store("conc").await;
        let sink = NatsSink::connect(NATS, NatsOptions::default())
            .await
            .unwrap();
        let mut cfg = relay_config(1000, 2);
        cfg.drain = false;
        let handle = Relay::new(Arc::new(store.clone()), Arc::new(sink), cfg).spawn();
        let t = Instant::now();
        let run_for = Duration::from_secs(8);
        let mut producers = Vec::new();
        for _ in 0..2 {
            let store = store.clone();
            let topic = topic.clone();
            producers.push(tokio::spawn(async move {
                let mut inserted = 0u64;
                while t.elapsed() < run_for {
                    let mut tx = store.pool().begin().await.unwrap();
                    for _ in 0..100 {
                        store
                            .enqueue(&mut tx, &Message::new(topic.clone(), vec![b'x'; 100]))
                            .await
                            .unwrap();
                    }
                    tx.commit().await.unwrap();
                    inserted += 100;
                }
                inserted
            }));
        }
        let mut inserted = 0;
        for p in producers {
            inserted += p.await.unwrap();
        }
        let produced_in = t.elapsed();
        let dispatched_during = handle.stats().dispatched;
        // Let it catch up, then stop.
        while store.counts().await.unwrap().pending > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let caught_up = t.elapsed();
        let stats = handle.shutdown().await.unwrap();
        println!(
            "relay     under 2 producers (tx of 100): produced {:>7.0} msg/s, relayed {:>7.0} msg/s meanwhile; backlog cleared {:.2} s after producers stopped ({} dispatched)",
            inserted as f64 / produced_in.as_secs_f64(),
            dispatched_during as f64 / produced_in.as_secs_f64(),
            (caught_up - produced_in).as_secs_f64(),
            stats.dispatched
        );
        drop_store(&store).await;
    }

    // 4. Commit-to-confirm latency at a steady 500 msg/s (single-message transactions).
    for batch in [100u32, 1000] {
        let store = fresh_store("lat").await;
        let confirmed: Times = Arc::default();
        let sink = Timed {
            inner: NatsSink::connect(NATS, NatsOptions::default())
                .await
                .unwrap(),
            confirmed: confirmed.clone(),
        };
        let mut cfg = relay_config(batch, 2);
        cfg.drain = false;
        let handle = Relay::new(Arc::new(store.clone()), Arc::new(sink), cfg).spawn();
        tokio::time::sleep(Duration::from_millis(200)).await; // listener connected
        let mut committed = HashMap::new();
        let mut tick = tokio::time::interval(Duration::from_millis(2));
        for _ in 0..3_000 {
            tick.tick().await;
            let mut tx = store.pool().begin().await.unwrap();
            let m = Message::new(topic.clone(), vec![b'x'; 100]);
            store.enqueue(&mut tx, &m).await.unwrap();
            tx.commit().await.unwrap();
            committed.insert(m.id(), Instant::now());
        }
        while store.counts().await.unwrap().pending > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        handle.shutdown().await.unwrap();
        let mut lat: Vec<Duration> = {
            let c = confirmed.lock().unwrap();
            committed
                .iter()
                .filter_map(|(id, t0)| c.get(id).map(|t| t.1.saturating_duration_since(*t0)))
                .collect()
        };
        println!(
            "latency   commit -> PubAck at 500 msg/s, batch {batch:>5}:  p50 {:.2} ms  p99 {:.2} ms  ({} samples)",
            pct(&mut lat, 0.5),
            pct(&mut lat, 0.99),
            lat.len()
        );
        drop_store(&store).await;
    }

    // 5. What the NOTIFY trigger costs producers: single-row transactions, on vs off.
    {
        let store = fresh_store("notify").await;
        let mut rates = Vec::new();
        for round in 0..4 {
            let on = round % 2 == 0;
            store.set_notify(on).await.unwrap();
            let t = Instant::now();
            for _ in 0..2_000 {
                let mut tx = store.pool().begin().await.unwrap();
                store
                    .enqueue(&mut tx, &Message::new(topic.clone(), vec![b'x'; 100]))
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
            }
            rates.push((on, 2_000.0 / t.elapsed().as_secs_f64()));
        }
        let avg = |want: bool| {
            let v: Vec<f64> = rates
                .iter()
                .filter(|(on, _)| *on == want)
                .map(|r| r.1)
                .collect();
            v.iter().sum::<f64>() / v.len() as f64
        };
        println!(
            "producer  single-row tx: NOTIFY on {:.0} tx/s, off {:.0} tx/s (on/off = {:.2})",
            avg(true),
            avg(false),
            avg(true) / avg(false)
        );
        drop_store(&store).await;
    }
    enqueue_costs(&topic).await;
    let _ = js.delete_stream(&stream_name).await;
    let _ = store_rates;
}

/// Figure 6: single-row producer transactions, 2,000 per round, three interleaved rounds
/// of each way of writing, on one schema: transactions/s and the cost against a plain
/// INSERT of the same outbox row.
async fn enqueue_costs(topic: &str) {
    const N: usize = 2_000;
    let store = fresh_store("enqueue").await;
    let s = store.config().schema.to_string();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {s}.orders (id bigserial PRIMARY KEY, note text NOT NULL)"
    )))
    .execute(store.pool())
    .await
    .unwrap();
    let ways = [
        "business INSERT alone",
        "plain INSERT of the outbox row",
        "Rust enqueue, NOTIFY on",
        "Rust enqueue, NOTIFY off",
        "SQL outbox.enqueue, NOTIFY on",
        "SQL outbox.enqueue, NOTIFY off",
    ];
    let mut rates = vec![0.0f64; ways.len()];
    let payload = vec![b'x'; 100];
    for _round in 0..3 {
        for (w, _) in ways.iter().enumerate() {
            store.set_notify(matches!(w, 2 | 4)).await.unwrap();
            let t = Instant::now();
            for _ in 0..N {
                let mut tx = store.pool().begin().await.unwrap();
                match w {
                    0 => {
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "INSERT INTO {s}.orders (note) VALUES ('order')"
                        )))
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    }
                    1 => {
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "INSERT INTO {s}.messages (message_id, topic, payload, headers)
                             VALUES ($1, $2, $3, '{{}}')"
                        )))
                        .bind(Uuid::now_v7())
                        .bind(topic)
                        .bind(&payload)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    }
                    2 | 3 => {
                        store
                            .enqueue(&mut tx, &Message::new(topic, payload.clone()))
                            .await
                            .unwrap();
                    }
                    _ => {
                        sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {s}.enqueue($1, $2)")))
                            .bind(topic)
                            .bind(&payload)
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                    }
                }
                tx.commit().await.unwrap();
            }
            rates[w] += N as f64 / t.elapsed().as_secs_f64() / 3.0;
        }
    }
    for (w, name) in ways.iter().enumerate() {
        println!(
            "producer  {name:<32} {:>7.0} tx/s   cost {:.2} x the plain outbox INSERT, {:.2} x the business insert alone",
            rates[w],
            rates[1] / rates[w],
            rates[0] / rates[w]
        );
    }
    drop_store(&store).await;
}

/// Counts the statements sqlx runs (its `sqlx::query` log events, one per statement),
/// with every other event disabled, and each statement's summary (its first words).
struct CountStatements(Arc<AtomicU64>, Arc<std::sync::Mutex<HashMap<String, u64>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CountStatements {
    fn enabled(
        &self,
        m: &tracing::Metadata<'_>,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        m.target() == "sqlx::query"
    }
    fn on_event(&self, e: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Summary(String);
        impl tracing::field::Visit for Summary {
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                if f.name() == "summary" {
                    self.0 = format!("{v:?}");
                }
            }
            fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
                if f.name() == "summary" {
                    v.clone_into(&mut self.0);
                }
            }
        }
        if e.metadata().target() == "sqlx::query" {
            self.0.fetch_add(1, Ordering::Relaxed);
            let mut summary = Summary(String::new());
            e.record(&mut summary);
            if let Ok(mut m) = self.1.lock() {
                *m.entry(summary.0).or_default() += 1;
            }
        }
    }
}

/// This process's CPU time (user + system) from `/proc/self/stat`.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after ')'.
    let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    Duration::from_millis(ticks * 10) // USER_HZ is 100 on Linux
}

/// A store of each kind with a fresh prefix, and how to remove it afterwards.
async fn any_store(kind: &str, dir: &std::path::Path) -> (AnyStore, String) {
    let prefix = format!("bench_{}", &Uuid::new_v4().simple().to_string()[..8]);
    let url = match kind {
        "PostgreSQL" => PG.to_owned(),
        "MariaDB" => MYSQL.to_owned(),
        _ => format!("sqlite://{}/{prefix}.db", dir.display()),
    };
    let store = AnyStore::connect(
        &url,
        StoreConfig {
            schema: Ident::new(&prefix).unwrap(),
            ..Default::default()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{kind} at {url}: {e}"));
    store.migrate().await.unwrap();
    (store, prefix)
}

async fn drop_any(store: &AnyStore, prefix: &str) {
    match store {
        AnyStore::Postgres(s) => drop_store(s).await,
        AnyStore::MySql(s) => {
            let tables: Vec<String> = sqlx::query_scalar(
                "SELECT CAST(table_name AS CHAR) FROM information_schema.tables
                 WHERE table_schema = DATABASE() AND table_name LIKE CONCAT(?, '\\_%')",
            )
            .bind(prefix)
            .fetch_all(s.pool())
            .await
            .unwrap();
            for t in tables {
                sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
                    .execute(s.pool())
                    .await
                    .unwrap();
            }
            for p in ["enqueue", "inbox_accept"] {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP PROCEDURE IF EXISTS {prefix}_{p}"
                )))
                .execute(s.pool())
                .await
                .unwrap();
            }
        }
        _ => {}
    }
}

/// Figure 7: what an idle relay costs, per store: one relay at the default settings with
/// nothing due, statements per second (every statement sqlx ran, wake-up probes and the
/// registry heartbeat included) and the process's CPU over `BENCH_IDLE_SECS` (60).
async fn idle_costs() {
    let secs: u64 = std::env::var("BENCH_IDLE_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let count = Arc::new(AtomicU64::new(0));
    let kinds = Arc::new(std::sync::Mutex::new(HashMap::new()));
    {
        use tracing_subscriber::layer::SubscriberExt;
        let subscriber =
            tracing_subscriber::registry().with(CountStatements(count.clone(), kinds.clone()));
        tracing::subscriber::set_global_default(subscriber).unwrap();
    }
    // BENCH_IDLE_STORES: a comma-separated subset (postgresql,mariadb,sqlite).
    let only = std::env::var("BENCH_IDLE_STORES")
        .unwrap_or_default()
        .to_lowercase();
    let dir = tempfile::tempdir().unwrap();
    for kind in ["PostgreSQL", "MariaDB", "SQLite"] {
        if !only.is_empty() && !only.split(',').any(|k| k.trim() == kind.to_lowercase()) {
            continue;
        }
        let (store, prefix) = any_store(kind, dir.path()).await;
        let store = Arc::new(store);
        let handle = Relay::new(store.clone(), Arc::new(NullSink), RelayConfig::default()).spawn();
        // Past the start (first heartbeat and sample).
        tokio::time::sleep(Duration::from_secs(2)).await;
        kinds.lock().unwrap().clear();
        let (n0, cpu0, t0) = (count.load(Ordering::Relaxed), cpu_time(), Instant::now());
        tokio::time::sleep(Duration::from_secs(secs)).await;
        let (n1, cpu1, el) = (count.load(Ordering::Relaxed), cpu_time(), t0.elapsed());
        let mut seen: Vec<(String, u64)> = kinds.lock().unwrap().drain().collect();
        handle.shutdown().await.unwrap();
        println!(
            "idle      {kind:<10} one relay at defaults, nothing due, {secs} s: {:>6.2} statements/s, CPU {:>5.2} ms/s",
            (n1 - n0) as f64 / el.as_secs_f64(),
            (cpu1.saturating_sub(cpu0)).as_secs_f64() * 1e3 / el.as_secs_f64()
        );
        seen.sort_by_key(|k| std::cmp::Reverse(k.1));
        for (summary, n) in seen {
            println!(
                "idle      {kind:<10}   {:>6.2}/s  {}",
                n as f64 / el.as_secs_f64(),
                summary.chars().take(70).collect::<String>()
            );
        }
        drop_any(&store, &prefix).await;
    }
}

/// Figure 8: steady state at the default settings. `BENCH_STEADY_PRODUCERS` (2)
/// producers write transactions of 100 rows at full speed for `BENCH_STEADY_SECS` (60) while one relay at
/// `RelayConfig::default()` publishes to JetStream: produced and relayed rows/s and the
/// backlog every tenth of the run (bounded when the relay keeps up).
async fn steady_state(topic: &str) {
    let secs: u64 = std::env::var("BENCH_STEADY_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let producers_n: usize = std::env::var("BENCH_STEADY_PRODUCERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let store = fresh_store("steady").await;
    let sink = NatsSink::connect(NATS, NatsOptions::default())
        .await
        .unwrap();
    let handle = Relay::new(
        Arc::new(store.clone()),
        Arc::new(sink),
        RelayConfig::default(),
    )
    .spawn();
    let t = Instant::now();
    let run_for = Duration::from_secs(secs);
    let produced = Arc::new(AtomicU64::new(0));
    let mut producers = Vec::new();
    for _ in 0..producers_n {
        let (store, topic, produced) = (store.clone(), topic.to_owned(), produced.clone());
        producers.push(tokio::spawn(async move {
            while t.elapsed() < run_for {
                let mut tx = store.pool().begin().await.unwrap();
                for _ in 0..100 {
                    store
                        .enqueue(&mut tx, &Message::new(topic.clone(), vec![b'x'; 300]))
                        .await
                        .unwrap();
                }
                tx.commit().await.unwrap();
                produced.fetch_add(100, Ordering::Relaxed);
            }
        }));
    }
    // The backlog from the live-row index (a full count would slow as the table grows).
    let live = format!(
        "SELECT count(*) FROM {}.messages WHERE status <= 1",
        store.config().schema
    );
    let mut backlog = Vec::new();
    for i in 1..=10u32 {
        tokio::time::sleep_until((t + run_for * i / 10).into()).await;
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(live.clone()))
            .fetch_one(store.pool())
            .await
            .unwrap();
        backlog.push(n);
    }
    let (n, relayed, el) = (
        produced.load(Ordering::Relaxed),
        handle.stats().dispatched,
        t.elapsed(),
    );
    for p in producers {
        p.await.unwrap();
    }
    let stats = handle.shutdown().await.unwrap();
    println!(
        "steady    {producers_n} producers (tx of 100 rows of 300 B), relay at defaults, {secs} s: produced {:>7.0} rows/s, relayed {:>7.0} rows/s ({:.2} of produced)",
        n as f64 / el.as_secs_f64(),
        relayed as f64 / el.as_secs_f64(),
        relayed as f64 / n.max(1) as f64
    );
    println!(
        "steady    backlog (pending + claimed) every {:.0} s: {backlog:?}; {} dispatched by shutdown",
        (run_for / 10).as_secs_f64(),
        stats.dispatched
    );
    drop_store(&store).await;
}

/// Commit → confirmation latencies of single-row producer transactions at `rate` msg/s
/// for `secs`, spread over four producer tasks; `enqueue` commits one message and
/// returns its id. Returns the latencies of the messages confirmed.
async fn offered_load<F, Fut>(
    rate: u32,
    secs: u64,
    confirmed: &Times,
    enqueue: F,
) -> Vec<(Duration, Duration)>
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Uuid> + Send,
{
    const PRODUCERS: u32 = 4;
    // Warm-up, not counted: 20 messages through every connection the run will open.
    let warm: Vec<_> = (0..20).map(|_| enqueue()).collect();
    futures::future::join_all(warm).await;
    let wait = Instant::now();
    while wait.elapsed() < Duration::from_secs(5) && confirmed.lock().unwrap().len() < 20 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    confirmed.lock().unwrap().clear();
    let per = rate / PRODUCERS;
    let each = per as u64 * secs;
    let mut tasks = Vec::new();
    for _ in 0..PRODUCERS {
        let enqueue = enqueue.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1) / per);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut committed = Vec::new();
            for _ in 0..each {
                tick.tick().await;
                let id = enqueue().await;
                committed.push((id, Instant::now()));
            }
            committed
        }));
    }
    let mut committed = Vec::new();
    for t in tasks {
        committed.extend(t.await.unwrap());
    }
    // Everything confirmed, or two seconds more.
    let wait = Instant::now();
    while wait.elapsed() < Duration::from_secs(2)
        && confirmed.lock().unwrap().len() < committed.len()
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let c = confirmed.lock().unwrap();
    committed
        .iter()
        .filter_map(|(id, t0)| {
            c.get(id).map(|(handed, t1)| {
                (
                    t1.saturating_duration_since(*t0),
                    handed.saturating_duration_since(*t0),
                )
            })
        })
        .collect()
}

/// Prints commit → confirmation p50/p99/max of `lat` (pairs of that latency and the part
/// of it until the sink was handed the message: waiting for and running the claim).
fn print_latency(what: &str, rate: u32, lat: Vec<(Duration, Duration)>, offered: u64) {
    let (mut total, mut claimed): (Vec<Duration>, Vec<Duration>) = lat.into_iter().unzip();
    println!(
        "latency   {what:<44} {rate:>5} msg/s: p50 {:>6.2} ms  p99 {:>6.2} ms  max {:>7.2} ms  ({} of {offered} confirmed; until claimed p50 {:.2} ms, p99 {:.2} ms)",
        pct(&mut total, 0.5),
        pct(&mut total, 0.99),
        pct(&mut total, 1.0),
        total.len(),
        pct(&mut claimed, 0.5),
        pct(&mut claimed, 0.99),
    );
}

/// Figure 9: commit → confirmation at 100 and 1,000 msg/s offered (single-row producer
/// transactions), relays at `RelayConfig::default()`, to JetStream: PostgreSQL (NOTIFY);
/// SQLite with the relay in the producer's process (the commit wakes it) and with the
/// producer on a pool of its own, as another process would be (the file watch wakes it).
async fn latencies(topic: &str) {
    let secs: u64 = std::env::var("BENCH_LATENCY_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    // BENCH_LATENCY_STORES: a comma-separated subset (postgresql,sqlite).
    let only = std::env::var("BENCH_LATENCY_STORES").unwrap_or_default();
    let runs = |store: &str| only.is_empty() || only.split(',').any(|s| s.trim() == store);
    let dir = tempfile::tempdir().unwrap();
    for rate in [100u32, 1000] {
        if runs("postgresql") {
            pg_latency(topic, rate, secs).await;
        }
        if runs("sqlite") {
            sqlite_latency(dir.path(), topic, rate, secs).await;
        }
    }
}

/// [`latencies`] on PostgreSQL at `rate`: the bare loop (this machine's floor), then the relay.
async fn pg_latency(topic: &str, rate: u32, secs: u64) {
    // This machine's floor for the same path, then PostgreSQL → JetStream.
    let lat = bare_latency(topic, rate, secs).await;
    print_latency(
        "PostgreSQL -> JetStream, bare loop (floor)",
        rate,
        lat,
        rate as u64 * secs,
    );
    let store = fresh_store("lat").await;
    let lat = relay_latency(Arc::new(store.clone()), store.clone(), topic, rate, secs).await;
    print_latency(
        "PostgreSQL -> JetStream, commit -> PubAck",
        rate,
        lat,
        rate as u64 * secs,
    );
    drop_store(&store).await;
}

/// [`latencies`] on SQLite at `rate`: the producer in the relay's process, then on a pool
/// of its own (as another process would be), files under `dir`.
async fn sqlite_latency(dir: &std::path::Path, topic: &str, rate: u32, secs: u64) {
    for own_pool in [false, true] {
        let path = dir.join(format!("lat-{rate}-{own_pool}.db"));
        let url = format!("sqlite://{}", path.display());
        let store = outbox::sqlite::SqliteStore::connect(&url, StoreConfig::default())
            .await
            .unwrap();
        store.migrate().await.unwrap();
        let producer = if own_pool {
            let options: sqlx::sqlite::SqliteConnectOptions = url.parse().unwrap();
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(4)
                .connect_with(
                    options
                        .clone()
                        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                        .busy_timeout(Duration::from_secs(5)),
                )
                .await
                .unwrap();
            outbox::sqlite::SqliteStore::from_pool(pool, options, StoreConfig::default())
        } else {
            store.clone()
        };
        let lat = relay_latency(Arc::new(store), producer, topic, rate, secs).await;
        let what = if own_pool {
            "SQLite -> JetStream, producer's own pool"
        } else {
            "SQLite -> JetStream, relay in the producer"
        };
        print_latency(what, rate, lat, rate as u64 * secs);
    }
}

/// The floor of the PostgreSQL → JetStream path on this machine, measured beside the
/// relay: the same producers and, instead of the relay, one bare loop that `LISTEN`s on the
/// outbox's channel and, on each notification, claims by one `UPDATE … RETURNING` (`SKIP
/// LOCKED`; no lease token, pause filter, headers or envelope), publishes the rows to
/// JetStream with their PubAcks pipelined and claims again until a claim finds nothing;
/// the marks run beside it, not in its way. Returns the commit → PubAck latencies.
async fn bare_latency(topic: &str, rate: u32, secs: u64) -> Vec<(Duration, Duration)> {
    let store = fresh_store("bare").await;
    let s = store.config().schema.clone();
    let confirmed: Times = Arc::default();
    let js = async_nats::jetstream::new(async_nats::connect(NATS).await.unwrap());
    let mut listener = sqlx::postgres::PgListener::connect(PG).await.unwrap();
    listener.listen(&format!("{s}_messages")).await.unwrap();
    let claim = format!(
        "UPDATE {s}.messages SET status = 1, attempts = attempts + 1,
                available_at = now() + interval '30 s', locked_until = now() + interval '30 s'
         WHERE id IN (SELECT id FROM {s}.messages WHERE status <= 1 AND available_at <= now()
                      ORDER BY available_at, id LIMIT 1000 FOR UPDATE SKIP LOCKED)
         RETURNING id, message_id, payload"
    );
    let mark = format!(
        "UPDATE {s}.messages SET status = 2, dispatched_at = now(), locked_until = NULL
         WHERE id = ANY($1)"
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (pool, times, subject, halt) = (
        store.pool().clone(),
        confirmed.clone(),
        topic.to_owned(),
        stop.clone(),
    );
    let bare = tokio::spawn(async move {
        while !halt.load(Ordering::Relaxed) {
            let _ = tokio::time::timeout(Duration::from_millis(100), listener.recv()).await;
            loop {
                let rows: Vec<(i64, Uuid, Vec<u8>)> =
                    sqlx::query_as(sqlx::AssertSqlSafe(claim.clone()))
                        .fetch_all(&pool)
                        .await
                        .unwrap();
                if rows.is_empty() {
                    break;
                }
                let handed = Instant::now();
                let mut acks = Vec::with_capacity(rows.len());
                for (_, _, payload) in &rows {
                    acks.push(
                        js.publish(subject.clone(), payload.clone().into())
                            .await
                            .unwrap(),
                    );
                }
                for ack in acks {
                    ack.await.unwrap();
                }
                let now = Instant::now();
                {
                    let mut c = times.lock().unwrap();
                    for (_, id, _) in &rows {
                        c.insert(*id, (handed, now));
                    }
                }
                let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
                let (pool, mark) = (pool.clone(), mark.clone());
                tokio::spawn(async move {
                    sqlx::query(sqlx::AssertSqlSafe(mark))
                        .bind(ids)
                        .execute(&pool)
                        .await
                        .unwrap();
                });
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (producer, topic) = (store.clone(), topic.to_owned());
    let enqueue = move || {
        let (p, topic) = (producer.clone(), topic.clone());
        async move {
            let m = Message::new(topic, vec![b'x'; 300]);
            outbox::events::Enqueue::enqueue_alone(&p, &m)
                .await
                .unwrap();
            m.id()
        }
    };
    let lat = offered_load(rate, secs, &confirmed, enqueue).await;
    stop.store(true, Ordering::Relaxed);
    bare.await.unwrap();
    drop_store(&store).await;
    lat
}

/// One relay at `RelayConfig::default()` over `store`, publishing to JetStream, while
/// [`offered_load`] commits single-row transactions (300-byte messages on `topic`) through
/// `producer` at `rate` msg/s for `secs`; returns the commit → PubAck latencies.
async fn relay_latency<E>(
    store: Arc<dyn Store>,
    producer: E,
    topic: &str,
    rate: u32,
    secs: u64,
) -> Vec<(Duration, Duration)>
where
    E: outbox::events::Enqueue + Clone + 'static,
{
    let topic = topic.to_owned();
    let enqueue = move || {
        let (p, topic) = (producer.clone(), topic.clone());
        async move {
            let m = Message::new(topic, vec![b'x'; 300]);
            p.enqueue_alone(&m).await.unwrap();
            m.id()
        }
    };
    let confirmed: Times = Arc::default();
    let sink = Timed {
        inner: NatsSink::connect(NATS, NatsOptions::default())
            .await
            .unwrap(),
        confirmed: confirmed.clone(),
    };
    let handle = Relay::new(store, Arc::new(sink), RelayConfig::default()).spawn();
    tokio::time::sleep(Duration::from_millis(300)).await; // the wake-up source is up
    let lat = offered_load(rate, secs, &confirmed, enqueue).await;
    let stats = handle.shutdown().await.unwrap();
    println!(
        "latency   (the relay: {} claims, {} of them finding rows, for {} messages)",
        stats.claims, stats.batches, stats.dispatched
    );
    lat
}

/// Figure 10 (for profilers): the relay's own work per message. `BENCH_CPU_MESSAGES`
/// (10,000) rows of 300 bytes are inserted by one server-side statement (no client work),
/// then one relay drains them to a sink that confirms at once, batch 1,000, one batch in
/// flight. Run it under `valgrind --tool=callgrind` at two sizes: the difference in
/// instructions over the difference in messages is the relay's cost per message.
async fn cpu_per_message() {
    let n: u64 = std::env::var("BENCH_CPU_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let store = fresh_store("cpu").await;
    let s = store.config().schema.to_string();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {s}.messages (message_id, topic, key, payload, headers)
         SELECT gen_random_uuid(), 'bench.cpu.v1', 'k' || (i % 16), convert_to(repeat('x', 300), 'UTF8'), '{{}}'
         FROM generate_series(1, $1) AS i"
    )))
    .bind(n as i64)
    .execute(store.pool())
    .await
    .unwrap();
    let cfg = RelayConfig {
        batch_size: 1000,
        min_batch_size: 1000,
        in_flight_batches: 1,
        ..relay_config(1000, 1)
    };
    let t = Instant::now();
    let stats = Relay::new(Arc::new(store.clone()), Arc::new(NullSink), cfg)
        .run(Default::default())
        .await
        .unwrap();
    assert_eq!(stats.dispatched, n);
    println!(
        "cpu       relay over the store alone, {n} messages, batch 1,000: {:.0} msg/s",
        n as f64 / t.elapsed().as_secs_f64()
    );
    drop_store(&store).await;
}

/// Figure 11: per-key ordering on vs off. `BENCH_ORDER_MESSAGES` (20,000) rows of 100 bytes
/// inserted by one server-side statement over K keys, drained by one relay at the default
/// settings (adaptive claims up to 1,000, four batches in flight) to JetStream; first
/// without ordering (10,000 keys), then ordered with 10,000, 100 and 1 key(s), each
/// run twice, alternating with the unordered one. Prints msg/s, the ratio to the
/// unordered run next to it, and the rows per claim that found rows in each (what one
/// database round trip takes).
async fn ordering_costs(root: &str) {
    let n: i64 = std::env::var("BENCH_ORDER_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let topic = format!("{root}.ordered.v1");
    let ordered = outbox::store::KeyOrdering {
        topics: vec![outbox::sink::router::TopicPattern::parse(&format!("{root}.>")).unwrap()],
        skip_dead: false,
    };
    // BENCH_ORDER_LIVE=1: a running relay that stops once everything is dispatched,
    // instead of a drain (whose workers end at their first empty claim).
    let live = std::env::var("BENCH_ORDER_LIVE").is_ok_and(|v| v == "1");
    let run = |keys: i64, ordering: outbox::store::KeyOrdering| {
        let topic = topic.clone();
        async move {
            let store = fresh_store("ord").await;
            let s = store.config().schema.clone();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {s}.messages (message_id, topic, key, payload, headers)
                 SELECT gen_random_uuid(), $2, 'k' || (i % $3), convert_to(repeat('x', 100), 'UTF8'), '{{}}'
                 FROM generate_series(1, $1) AS i"
            )))
            .bind(n)
            .bind(&topic)
            .bind(keys)
            .execute(store.pool())
            .await
            .unwrap();
            sqlx::query(sqlx::AssertSqlSafe(format!("ANALYZE {s}.messages")))
                .execute(store.pool())
                .await
                .unwrap();
            let sink = NatsSink::connect(NATS, NatsOptions::default())
                .await
                .unwrap();
            let cfg = RelayConfig {
                drain: !live,
                ordering,
                lease: Duration::from_secs(120),
                ..RelayConfig::default()
            };
            let t = Instant::now();
            let relay = Relay::new(Arc::new(store.clone()), Arc::new(sink), cfg);
            let stats = if live {
                // A running relay (not a drain): its idle workers stay, and claim again
                // when woken.
                let handle = relay.spawn();
                while store.counts().await.unwrap().dispatched < n {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let stats = handle.shutdown().await.unwrap();
                println!(
                    "ordering  (live relay: {} claims, {} of them with rows)",
                    stats.claims, stats.batches
                );
                stats
            } else {
                relay.run(Default::default()).await.unwrap()
            };
            let rate = stats.dispatched as f64 / t.elapsed().as_secs_f64();
            assert_eq!(stats.dispatched, n as u64);
            drop_store(&store).await;
            // Rows per claim that found rows: what one database round trip takes.
            (rate, stats.dispatched as f64 / stats.batches.max(1) as f64)
        }
    };
    println!("ordering  {n} messages of 100 bytes, relay defaults, PostgreSQL -> JetStream");
    for keys in [10_000i64, 100, 1] {
        for _ in 0..2 {
            let (off, off_per) = run(10_000, Default::default()).await;
            let (on, on_per) = run(keys, ordered.clone()).await;
            println!(
                "ordering  unordered {off:>9.0} msg/s   ordered, {keys:>6} keys {on:>9.0} msg/s   ratio {:.2}   rows per claim {off_per:.0} / {on_per:.0}",
                on / off
            );
        }
    }
}

//! `outbox demo`: the whole story on SQLite in a temporary directory.
//!
//! An orders service commits orders together with their `orders.order-placed.v1` messages
//! (and rolls every tenth back); one poison message is injected; a relay delivers to a
//! file sink and is killed between a confirmation and its mark; a second relay takes over
//! after the lease; a consumer deduplicates by message id through an inbox table. The run
//! ends with a table and fails (exit 1) when business effects differ from committed orders.

use outbox::message::OutgoingMessage;
use outbox::sink::file::FileSink;
use outbox::sink::{Confirmations, PublishError, Sink};
use outbox::sqlite::SqliteStore;
use outbox::store::prelude::*;
use outbox::{Contract, Message, Relay, RelayConfig, StoreConfig};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use uuid::Uuid;

#[derive(Serialize, Deserialize)]
struct OrderPlacedV1 {
    order_id: i64,
    total_cents: i64,
}

impl Contract for OrderPlacedV1 {
    const TOPIC: &'static str = "orders.order-placed.v1";
}

type Times = Arc<Mutex<HashMap<Uuid, Instant>>>;

/// The demo's sink: the file sink, plus
/// - a contract check (a JSON topic whose payload is not JSON is refused, permanently);
/// - the confirmation time of each message (for commit-to-confirm latency);
/// - on the batch numbered `crash_on_batch`, a crash right after the confirmation: it
///   signals `crashed` and never returns, so the relay never marks that batch.
struct DemoSink {
    inner: FileSink,
    confirmed: Times,
    batches: AtomicU32,
    crash_on_batch: Option<u32>,
    crashed: Arc<Notify>,
}

#[async_trait::async_trait]
impl Sink for DemoSink {
    async fn publish(&self, batch: &[OutgoingMessage], confirm: &Confirmations) {
        let mut valid = Vec::new();
        let mut index = Vec::new();
        for (i, m) in batch.iter().enumerate() {
            let json =
                m.headers.get("content-type").map(String::as_str) == Some("application/json");
            if json && serde_json::from_slice::<serde_json::Value>(&m.payload).is_err() {
                confirm.set(
                    i,
                    Err(PublishError::permanent(format!(
                        "payload of {} is not valid JSON although content-type says so",
                        m.message_id
                    ))),
                );
            } else {
                valid.push(m.clone());
                index.push(i);
            }
        }
        let n = self.batches.fetch_add(1, Ordering::SeqCst) + 1;
        let crash = Some(n) == self.crash_on_batch;
        // On the crash batch the file confirms, but the relay never hears of it: it dies
        // between the confirmation and the mark.
        let inner = if crash {
            Confirmations::new(valid.len())
        } else {
            confirm.subset(&index)
        };
        self.inner.publish(&valid, &inner).await;
        let now = Instant::now();
        {
            let mut confirmed = self.confirmed.lock().unwrap_or_else(|e| e.into_inner());
            for (j, m) in valid.iter().enumerate() {
                if matches!(inner.get(j), Some(Ok(()))) {
                    confirmed.entry(m.message_id).or_insert(now);
                }
            }
        }
        if crash {
            self.crashed.notify_one();
            std::future::pending::<()>().await;
        }
    }

    fn describe(&self) -> String {
        format!("demo({})", self.inner.describe())
    }
}

pub(crate) async fn run(orders: u32) -> anyhow::Result<ExitCode> {
    let dir = tempfile::tempdir()?;
    let db_url = format!("sqlite://{}", dir.path().join("orders.db").display());
    let delivered_path = dir.path().join("delivered.jsonl");
    println!("outbox demo in {}", dir.path().display());

    let store = SqliteStore::connect(&db_url, StoreConfig::default()).await?;
    store.migrate().await?;
    sqlx::query(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT NOT NULL, total_cents INTEGER NOT NULL)",
    )
    .execute(store.pool())
    .await?;

    let committed_at: Times = Arc::default();
    let confirmed: Times = Arc::default();
    let crashed = Arc::new(Notify::new());
    let sink = async |crash_on_batch| -> anyhow::Result<_> {
        Ok(DemoSink {
            inner: FileSink::open(&delivered_path).await?,
            confirmed: confirmed.clone(),
            batches: AtomicU32::new(0),
            crash_on_batch,
            crashed: crashed.clone(),
        })
    };
    let relay_config = RelayConfig {
        relay_id: "demo-relay-1".into(),
        batch_size: 50,
        lease: Duration::from_secs(2),
        publish_timeout: Duration::from_secs(1),
        poll_interval: Duration::from_millis(200),
        max_attempts: 5,
        ..RelayConfig::default()
    };
    let started = Instant::now();
    let relay1 = Relay::new(
        Arc::new(store.clone()),
        Arc::new(sink(Some(3)).await?),
        relay_config.clone(),
    )
    .spawn();

    // The orders service: one transaction per order; every tenth rolls back.
    let producer = {
        let store = store.clone();
        let committed_at = committed_at.clone();
        tokio::spawn(async move {
            let (mut committed, mut rolled_back) = (0u32, 0u32);
            for i in 0..orders {
                let mut tx = store.pool().begin().await?;
                let total = 1_000 + i64::from(i % 97) * 10;
                let order_id: i64 = sqlx::query_scalar(
                    "INSERT INTO orders (customer, total_cents) VALUES (?1, ?2) RETURNING id",
                )
                .bind(format!("customer-{}", i % 13))
                .bind(total)
                .fetch_one(&mut *tx)
                .await?;
                let msg = Message::from_contract(&OrderPlacedV1 {
                    order_id,
                    total_cents: total,
                })?
                .key(format!("order-{order_id}"));
                store.enqueue(&mut tx, &msg).await?;
                if i % 10 == 9 {
                    tx.rollback().await?;
                    rolled_back += 1;
                } else {
                    tx.commit().await?;
                    committed_at
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(msg.id(), Instant::now());
                    committed += 1;
                }
                if i == orders / 2 {
                    // A poison message: says JSON, is not.
                    let mut tx = store.pool().begin().await?;
                    let poison = Message::new(OrderPlacedV1::TOPIC, vec![0xff, 0xfe, b'{'])
                        .header("content-type", "application/json");
                    store.enqueue(&mut tx, &poison).await?;
                    tx.commit().await?;
                }
            }
            anyhow::Ok((committed, rolled_back))
        })
    };

    // The crash: relay 1 confirmed batch 3 and dies before marking it.
    tokio::time::timeout(Duration::from_secs(60), crashed.notified())
        .await
        .map_err(|_| anyhow::anyhow!("relay 1 never reached its third batch"))?;
    relay1.abort();
    println!(
        "relay 1 crashed after a confirmation, before the mark; relay 2 takes over after the 2 s lease"
    );
    let relay2 = Relay::new(
        Arc::new(store.clone()),
        Arc::new(sink(None).await?),
        RelayConfig {
            relay_id: "demo-relay-2".into(),
            ..relay_config
        },
    )
    .spawn();

    // Progress on a terminal (indicatif draws nothing when stderr is not one).
    let progress = indicatif::ProgressBar::new(u64::from(orders)).with_style(
        indicatif::ProgressStyle::with_template("  {bar:40} {pos}/{len} messages dispatched")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let (committed, rolled_back) = loop {
        if producer.is_finished() {
            break producer.await??;
        }
        progress.set_position(u64::try_from(store.counts().await?.dispatched).unwrap_or(0));
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    progress.set_length(u64::from(committed) + 1);
    // Wait until nothing is pending or claimed.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let c = store.counts().await?;
        progress.set_position(u64::try_from(c.dispatched + c.dead).unwrap_or(0));
        if c.pending == 0 && c.claimed == 0 {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "relay did not finish: {c:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    progress.finish_and_clear();
    let relay_elapsed = started.elapsed();
    let stats = relay2.shutdown().await?;
    let counts = store.counts().await?;

    // The consumer: its own database, with the library's inbox. `inbox_accept` inserts the
    // inbox row first, under the unique key, in the same transaction as the business effect
    // (a shipment per order), so a duplicate delivery can never ship twice.
    let consumer_url = format!("sqlite://{}", dir.path().join("shipping.db").display());
    let inbox = SqliteStore::connect(&consumer_url, StoreConfig::default()).await?;
    inbox.migrate().await?;
    let consumer = inbox.pool().clone();
    sqlx::raw_sql(
        "CREATE TABLE shipments (order_id INTEGER PRIMARY KEY, total_cents INTEGER NOT NULL);",
    )
    .execute(&consumer)
    .await?;
    let text = tokio::fs::read_to_string(&delivered_path).await?;
    let (mut delivered, mut duplicates, mut effects) = (0u64, 0u64, 0u64);
    for line in text.lines() {
        delivered += 1;
        // The file sink's line, read back with the library's decoder.
        let envelope = outbox::envelope::from_json_line(line.as_bytes())?;
        let event: OrderPlacedV1 = serde_json::from_slice(&envelope.payload)?;
        let mut tx = consumer.begin().await?;
        if inbox.inbox_accept(&mut tx, "shipping", &envelope).await? == outbox::Accepted::Duplicate
        {
            duplicates += 1;
            tx.rollback().await?;
            continue;
        }
        sqlx::query("INSERT INTO shipments (order_id, total_cents) VALUES (?1, ?2)")
            .bind(event.order_id)
            .bind(event.total_cents)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        effects += 1;
    }

    let mut latencies: Vec<Duration> = {
        let c = committed_at.lock().unwrap_or_else(|e| e.into_inner());
        let f = confirmed.lock().unwrap_or_else(|e| e.into_inner());
        c.iter()
            .filter_map(|(id, t0)| f.get(id).map(|t1| t1.saturating_duration_since(*t0)))
            .collect()
    };
    latencies.sort();
    // The `p`-th percentile in ms: the sample at (len - 1) × p / 100, rounded half up.
    let pct = |p: usize| -> f64 {
        if latencies.is_empty() {
            return f64::NAN;
        }
        let i = ((latencies.len() - 1) * p + 50) / 100;
        latencies[i].as_secs_f64() * 1000.0
    };
    let orders_in_db: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(store.pool())
        .await?;

    let rows: [(&str, String); 10] = [
        ("orders committed", committed.to_string()),
        ("orders rolled back (no message)", rolled_back.to_string()),
        ("messages delivered (file lines)", delivered.to_string()),
        ("duplicates seen by the consumer", duplicates.to_string()),
        ("business effects applied", effects.to_string()),
        ("quarantined (dead)", counts.dead.to_string()),
        ("dispatched rows", counts.dispatched.to_string()),
        (
            "relay throughput",
            format!(
                "{:.0} msg/s over {:.2} s (paced by the producer)",
                counts.dispatched as f64 / relay_elapsed.as_secs_f64(),
                relay_elapsed.as_secs_f64()
            ),
        ),
        (
            "commit-to-confirm p50",
            format!("{:.1} ms (first confirmation)", pct(50)),
        ),
        ("commit-to-confirm p99", format!("{:.1} ms", pct(99))),
    ];
    println!();
    for (k, v) in &rows {
        println!("  {k:<34} {v}");
    }
    println!();
    let ok = effects == u64::from(committed)
        && orders_in_db == i64::from(committed)
        && counts.dead == 1
        && counts.dispatched == i64::from(committed);
    if ok {
        println!(
            "OK: every committed order produced exactly one business effect; the inbox absorbed the {duplicates} duplicate {} caused by the crash; the poison message is quarantined (relay 2: {} dispatched, {} quarantined).",
            if duplicates == 1 {
                "delivery"
            } else {
                "deliveries"
            },
            stats.dispatched,
            stats.quarantined
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!("FAILED: the figures above do not add up");
        Ok(ExitCode::FAILURE)
    }
}

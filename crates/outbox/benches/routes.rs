//! One relay, six destinations, and a RabbitMQ outage. Prints figures; asserts only that
//! every message arrived. Run by hand (it stops and starts this machine's RabbitMQ):
//! `cargo bench -p outbox --features kafka --bench routes` with every service of
//! `scripts/services` running.
//!
//! Routes: `orders.*` → Kafka, `billing.*` → RabbitMQ (a direct exchange bound to a durable
//! queue), `audit.*` → Redis Streams, `devices.*` → MQTT, `hooks.*` → an HTTP endpoint,
//! everything else → NATS JetStream. Phase 1: 1,000 messages per destination enqueued
//! through `outbox.enqueue(...)`, relayed, counted at each destination. Phase 2: producers
//! enqueue steadily for 10 s, then RabbitMQ is stopped for 30 s while they go on: the
//! other destinations' delivery rate and backlog before and during the outage, then every
//! message counted once RabbitMQ is back, and nothing quarantined.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]
#![allow(clippy::cast_possible_truncation)]

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use outbox::postgres::PgStore;
use outbox::sink::router::{Router, RouterOptions};
use outbox::store::prelude::*;
use outbox::{Ident, Relay, RelayConfig, StoreConfig};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::AssertSqlSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const PG: &str = "postgres://postgres@127.0.0.1:5432/test";
const TOPICS: [&str; 6] = [
    "orders.placed",
    "billing.invoiced",
    "audit.login",
    "devices.reading",
    "hooks.called",
    "misc.other",
];

fn sh(cmd: &str, args: &[&str]) {
    let st = std::process::Command::new(cmd).args(args).status().unwrap();
    assert!(st.success(), "{cmd} {args:?} failed");
}

async fn count_kafka(topic: &str) -> usize {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", "127.0.0.1:9092")
        .set("group.id", format!("bench-{}", uuid::Uuid::new_v4()))
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..3 {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    c.assign(&tpl).unwrap();
    let mut n = 0;
    let mut idle = 0;
    while idle < 10 {
        match c.poll(Duration::from_millis(200)) {
            Some(Ok(_)) => {
                n += 1;
                idle = 0;
            }
            _ => idle += 1,
        }
    }
    n
}

async fn dispatched_by_prefix(store: &PgStore, s: &str) -> Vec<i64> {
    let mut out = Vec::new();
    for t in TOPICS {
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {s}.messages WHERE topic LIKE $1 AND status = 2"
        )))
        .bind(format!("{}.%", t.split('.').next().unwrap()))
        .fetch_one(store.pool())
        .await
        .unwrap();
        out.push(n);
    }
    out
}

async fn enqueue_each(store: &PgStore, s: &str, run: &str, n: usize) {
    for t in TOPICS {
        sqlx::query(AssertSqlSafe(format!(
            "SELECT {s}.enqueue($1, convert_to('{{\"n\":' || g || '}}', 'UTF8'), 'k' || (g % 10))
             FROM generate_series(1, $2) g"
        )))
        .bind(format!("{t}.{run}"))
        .bind(n as i32)
        .execute(store.pool())
        .await
        .unwrap();
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let s = format!("broutes_{tag}");
    let store = PgStore::connect(
        PG,
        StoreConfig {
            schema: Ident::new(&s).unwrap(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    store.migrate().await.unwrap();

    // Destinations.
    let (run_a, run_b) = (format!("a{tag}"), format!("b{tag}"));
    let kafka_topics: Vec<String> = [&run_a, &run_b]
        .iter()
        .map(|r| format!("orders.placed.{r}"))
        .collect();
    for t in &kafka_topics {
        let _ = std::process::Command::new(format!(
            "{}/.cargo/bin/tansu",
            std::env::var("HOME").unwrap()
        ))
        .args([
            "topic",
            "create",
            "--broker",
            "tcp://127.0.0.1:9092",
            "--partitions",
            "3",
            t,
        ])
        .output();
    }
    let amqp = lapin::Connection::connect(
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        lapin::ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let ch = amqp.create_channel().await.unwrap();
    let exchange = format!("bench-{tag}");
    let queue = format!("bench-billing-{tag}");
    ch.exchange_declare(
        exchange.as_str().into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        queue.as_str().into(),
        exchange.as_str().into(),
        "billing.#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let js = async_nats::jetstream::new(async_nats::connect("127.0.0.1:4222").await.unwrap());
    let stream = format!("BENCH_{tag}");
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec!["misc.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    // HTTP endpoint and MQTT subscriber count what arrives.
    let hooks = Arc::new(AtomicU64::new(0));
    let h = hooks.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move || {
            let h = h.clone();
            async move {
                h.fetch_add(1, Ordering::Relaxed);
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hook_url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let mqtt_seen = Arc::new(AtomicU64::new(0));
    let mut opts = rumqttc::v5::MqttOptions::new(format!("bench-sub-{tag}"), "127.0.0.1", 1883);
    opts.set_keep_alive(Duration::from_secs(5));
    let (client, mut events) = rumqttc::v5::AsyncClient::new(opts, 1000);
    for run in [&run_a, &run_b] {
        client
            .subscribe(
                format!("devices.reading.{run}"),
                rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
            )
            .await
            .unwrap();
    }
    let m = mqtt_seen.clone();
    tokio::spawn(async move {
        while let Ok(ev) = events.poll().await {
            if let rumqttc::v5::Event::Incoming(rumqttc::v5::mqttbytes::v5::Packet::Publish(_)) = ev
            {
                m.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;

    let routes = vec![
        ("orders.*.*".to_owned(), "kafka://127.0.0.1:9092".to_owned()),
        (
            "billing.*.*".to_owned(),
            format!("amqp://guest:guest@127.0.0.1:5672/%2f?exchange={exchange}"),
        ),
        ("audit.*.*".to_owned(), "redis://127.0.0.1:6379".to_owned()),
        ("devices.*.*".to_owned(), "mqtt://127.0.0.1:1883".to_owned()),
        ("hooks.*.*".to_owned(), hook_url.clone()),
        (">".to_owned(), "nats://127.0.0.1:4222".to_owned()),
    ];
    // Phase 0: each sink alone, 10 batches of 1,000 messages of 100 bytes.
    let _ = std::process::Command::new(format!(
        "{}/.cargo/bin/tansu",
        std::env::var("HOME").unwrap()
    ))
    .args([
        "topic",
        "create",
        "--broker",
        "tcp://127.0.0.1:9092",
        "--partitions",
        "3",
        "orders.placed.t",
    ])
    .output();
    for (pattern, url) in &routes {
        let topic = match pattern.as_str() {
            ">" => "misc.other.t".to_owned(),
            p => p.replace("*.*", "x.t"),
        };
        let topic = if topic.starts_with("orders") {
            "orders.placed.t".to_owned()
        } else {
            topic
        };
        let sink = outbox::sink::open(url).await.unwrap();
        let batch = || -> Vec<outbox::OutgoingMessage> {
            (0..1000)
                .map(|i| outbox::OutgoingMessage {
                    id: i,
                    message_id: uuid::Uuid::now_v7(),
                    topic: topic.clone(),
                    key: Some(format!("k{}", i % 10)),
                    payload: vec![b'x'; 100].into(),
                    headers: Default::default(),
                    occurred_at: chrono::Utc::now(),
                    attempts: 1,
                })
                .collect()
        };
        // Fresh message ids for every batch: a broker that deduplicates (NATS) must store
        // every one.
        let batches: Vec<_> = (0..10).map(|_| batch()).collect();
        let t = Instant::now();
        for b in &batches {
            let r = outbox::Sink::publish_all(&*sink, b).await;
            assert!(
                r.iter().all(Result::is_ok),
                "{url}: {:?}",
                r.iter().find(|r| r.is_err())
            );
        }
        println!(
            "sink alone {:<8} batch 1,000: {:>8.0} msg/s",
            url.split(':').next().unwrap(),
            10_000.0 / t.elapsed().as_secs_f64()
        );
        outbox::Sink::close(&*sink).await;
    }

    let router = Router::open(&routes, RouterOptions::default())
        .await
        .unwrap();
    let cfg = RelayConfig {
        batch_size: 1000,
        backoff_max: Duration::from_secs(5),
        ..RelayConfig::default()
    };
    let relay = Relay::with_router(Arc::new(store.clone()), router, cfg).spawn();

    // Phase 1.
    let t = Instant::now();
    enqueue_each(&store, &s, &run_a, 1_000).await;
    while store.counts().await.unwrap().pending > 0 || store.counts().await.unwrap().claimed > 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let el = t.elapsed();
    let mut redis = redis::Client::open("redis://127.0.0.1:6379")
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let xlen: usize = redis::cmd("XLEN")
        .arg(format!("audit.login.{run_a}"))
        .query_async(&mut redis)
        .await
        .unwrap();
    let q = ch
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap()
        .message_count();
    let nats = js
        .get_stream(&stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    println!(
        "phase 1: 6,000 messages through 6 routes in {:.2} s ({:.0} msg/s); arrived: kafka {}, rabbitmq {q}, redis {xlen}, mqtt {}, http {}, nats {nats}",
        el.as_secs_f64(),
        6000.0 / el.as_secs_f64(),
        count_kafka(&format!("orders.placed.{run_a}")).await,
        mqtt_seen.load(Ordering::Relaxed),
        hooks.load(Ordering::Relaxed)
    );

    // Phase 2: steady producers (20 per destination every 100 ms = 200/s each).
    let producing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (ps, pst, pp, rb) = (store.clone(), s.clone(), producing.clone(), run_b.clone());
    let producer = tokio::spawn(async move {
        let mut n = 0;
        while pp.load(Ordering::Relaxed) {
            enqueue_each(&ps, &pst, &rb, 20).await;
            n += 20;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        n
    });
    let sample = |secs: u64| {
        let store = store.clone();
        let s = s.clone();
        async move {
            let before = dispatched_by_prefix(&store, &s).await;
            let mut max_backlog = 0i64;
            for _ in 0..secs * 4 {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let backlog: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                    "SELECT count(*) FROM {s}.messages WHERE status <= 1 AND topic NOT LIKE 'billing.%'"
                )))
                .fetch_one(store.pool())
                .await
                .unwrap();
                max_backlog = max_backlog.max(backlog);
            }
            let after = dispatched_by_prefix(&store, &s).await;
            let others: i64 = (0..6)
                .filter(|i| *i != 1)
                .map(|i| after[i] - before[i])
                .sum();
            (
                others as f64 / secs as f64,
                max_backlog,
                after[1] - before[1],
            )
        }
    };
    let (base_rate, base_backlog, _) = sample(10).await;
    sh("rabbitmqctl", &["-q", "stop_app"]);
    let (outage_rate, outage_backlog, billing_during) = sample(30).await;
    sh("rabbitmqctl", &["-q", "start_app"]);
    producing.store(false, Ordering::Relaxed);
    let produced = producer.await.unwrap();
    let dead_during = store.counts().await.unwrap().dead;
    let back = Instant::now();
    loop {
        let c = store.counts().await.unwrap();
        if c.pending == 0 && c.claimed == 0 {
            break;
        }
        assert!(
            back.elapsed() < Duration::from_secs(120),
            "not drained: {c:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let drained_in = back.elapsed();
    relay.shutdown().await.unwrap();
    let c = store.counts().await.unwrap();
    let q = lapin::Connection::connect(
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        lapin::ConnectionProperties::default(),
    )
    .await
    .unwrap()
    .create_channel()
    .await
    .unwrap()
    .queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap()
    .message_count();
    println!(
        "phase 2: other destinations delivered {base_rate:.0} msg/s before the outage (max backlog {base_backlog}) and {outage_rate:.0} msg/s during 30 s without RabbitMQ (max backlog {outage_backlog}); billing delivered during the outage: {billing_during}; dead {dead_during}"
    );
    println!(
        "after RabbitMQ returned: drained in {:.1} s; {} produced per destination in phase 2; rabbitmq queue holds {q} (expect {}); totals: dispatched {}, dead {}",
        drained_in.as_secs_f64(),
        produced,
        10_000 + 1000 + produced,
        c.dispatched,
        c.dead
    );
    let _ = js.delete_stream(&stream).await;
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {s} CASCADE")))
        .execute(store.pool())
        .await
        .unwrap();
}

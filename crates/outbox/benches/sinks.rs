//! Each sink alone against its real server: the same batches of 100-byte messages, the time
//! from the first publish to the last confirmation, printed as messages/s. Asserts only
//! that every message was confirmed (and, where the destination can be counted, arrived).
//! Run with every service of `scripts/services` up:
//! `cargo bench -p outbox --bench sinks` (optionally `-- nats redis …` to pick sinks).
//!
//! The file sink (fsync per batch, no network) runs first as the same-run reference: on a
//! shared machine the ratios to it are steadier than the absolute figures.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]
#![allow(clippy::cast_possible_truncation)]

use bytes::Bytes;
use chrono::Utc;
use outbox::OutgoingMessage;
use outbox::sink::Sink;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use uuid::Uuid;

const TOTAL: usize = 20_000;
const BATCH: usize = 1_000;

fn batches(topic: &str, total: usize) -> Vec<Vec<OutgoingMessage>> {
    (0..total / BATCH)
        .map(|b| {
            (0..BATCH)
                .map(|i| OutgoingMessage {
                    id: (b * BATCH + i) as i64,
                    message_id: Uuid::now_v7(),
                    topic: topic.to_owned(),
                    key: None,
                    payload: Bytes::from(vec![b'x'; 100]),
                    headers: BTreeMap::new(),
                    occurred_at: Utc::now(),
                    attempts: 1,
                })
                .collect()
        })
        .collect()
}

/// Publishes every batch in turn and returns the elapsed time.
async fn run(sink: &dyn Sink, batches: &[Vec<OutgoingMessage>]) -> Duration {
    let start = Instant::now();
    for b in batches {
        let results = sink.publish_all(b).await;
        assert!(
            results.iter().all(Result::is_ok),
            "{}: {:?}",
            sink.describe(),
            results.iter().find(|r| r.is_err())
        );
    }
    start.elapsed()
}

fn report(name: &str, total: usize, took: Duration, reference: Option<f64>) -> f64 {
    let rate = total as f64 / took.as_secs_f64();
    let ratio = reference.map_or(String::new(), |r| format!(", {:.2} × file", rate / r));
    println!(
        "{name:<24} {total} × 100 B, batch {BATCH}: {:>8.3} s, {rate:>9.0} messages/s{ratio}",
        took.as_secs_f64()
    );
    rate
}

fn unique() -> String {
    Uuid::now_v7().simple().to_string()[20..].to_owned()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let wanted = |name: &str| only.is_empty() || only.iter().any(|o| o == name);
    let dir = tempfile::tempdir().unwrap();

    let file = outbox::sink::file::FileSink::open(dir.path().join("out.jsonl"))
        .await
        .unwrap();
    let took = run(&file, &batches("bench", TOTAL)).await;
    let reference = Some(report("file (reference)", TOTAL, took, None));

    if wanted("nats") {
        let client = async_nats::connect("nats://127.0.0.1:4222").await.unwrap();
        let js = async_nats::jetstream::new(client);
        let name = format!("BENCH{}", unique());
        js.create_stream(async_nats::jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            storage: async_nats::jetstream::stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .unwrap();
        let sink = outbox::sink::nats::NatsSink::connect(
            "nats://127.0.0.1:4222",
            outbox::sink::nats::NatsOptions::default(),
        )
        .await
        .unwrap();
        let took = run(&sink, &batches(&format!("{name}.x"), TOTAL)).await;
        report("nats jetstream", TOTAL, took, reference);
        let _ = js.delete_stream(&name).await;
    }

    if wanted("rabbitmq") {
        use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
        let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
        let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        let queue = format!("outbox.bench.{}", unique());
        ch.queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
        let sink = outbox::sink::rabbitmq::RabbitMqSink::connect(url)
            .await
            .unwrap();
        let took = run(&sink, &batches(&queue, TOTAL)).await;
        report("rabbitmq (durable)", TOTAL, took, reference);
        let n = ch
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
        assert_eq!(n, TOTAL as u32, "messages in the queue");
    }

    if wanted("redis") {
        use redis::AsyncCommands as _;
        let url = "redis://127.0.0.1:6379";
        let mut admin = redis::Client::open(url)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let stream = format!("outbox.bench.{}", unique());
        let sink = outbox::sink::redis_streams::RedisStreamsSink::connect(url)
            .await
            .unwrap();
        let took = run(&sink, &batches(&stream, TOTAL)).await;
        report("redis streams", TOTAL, took, reference);
        let len: usize = admin.xlen(&stream).await.unwrap();
        assert_eq!(len, TOTAL);
        let _: () = admin.del(&stream).await.unwrap();
    }

    if wanted("mqtt") {
        for qos in [1, 2] {
            let sink =
                outbox::sink::mqtt::MqttSink::connect(&format!("mqtt://127.0.0.1:1883?qos={qos}"))
                    .await
                    .unwrap();
            let took = run(
                &sink,
                &batches(&format!("outbox/bench/{}", unique()), TOTAL),
            )
            .await;
            report(&format!("mqtt qos {qos}"), TOTAL, took, reference);
            sink.close().await;
        }
    }

    if wanted("http") {
        use axum::http::StatusCode;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new().route(
            "/in",
            axum::routing::post(|_body: axum::body::Bytes| async { StatusCode::NO_CONTENT }),
        );
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let sink = outbox::sink::http::WebhookSink::connect_with(
            &format!("http://{addr}/in"),
            outbox::sink::http::WebhookOptions::default(),
        )
        .await
        .unwrap();
        // One request per message: a quarter of the others' count.
        let took = run(&sink, &batches("hooks.bench", TOTAL / 4)).await;
        report("http webhook (local)", TOTAL / 4, took, reference);
        server.abort();
    }
}

//! Kafka (tansu on 127.0.0.1:9092): a topic of its own per instance, created with the
//! tansu CLI, read back from the beginning of every partition.

use super::{Harness, Received, closed_port};
use crate::common::unique;
use async_trait::async_trait;
use outbox::sink::kafka::KafkaSink;
use outbox::sink::{Sink, SinkError};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message as _;
use rdkafka::{Offset, TopicPartitionList};
use std::time::{Duration, Instant};
use uuid::Uuid;

pub(crate) const BROKER: &str = "127.0.0.1:9092";
pub(crate) const PARTITIONS: i32 = 3;
/// librdkafka's default `message.max.bytes`, checked before a record is sent.
const MESSAGE_MAX_BYTES: usize = 1_000_000;

/// Creates `topic` with the tansu CLI (topics are never created by the relay).
pub(crate) fn create_topic(topic: &str) {
    let tansu = std::env::var("HOME")
        .map(|h| format!("{h}/.cargo/bin/tansu"))
        .unwrap();
    let out = std::process::Command::new(&tansu)
        .args([
            "topic",
            "create",
            "--broker",
            &format!("tcp://{BROKER}"),
            "--partitions",
            &PARTITIONS.to_string(),
            topic,
        ])
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "tansu must be installed ({e}); run scripts/services, which installs and starts it"
            )
        });
    assert!(
        out.status.success(),
        "creating topic {topic} failed (is the broker on {BROKER}? run scripts/services): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub(crate) fn unique_topic(label: &str) -> String {
    format!("t{}.{label}", unique())
}

/// Reads every record of `topic` from the beginning until `n` arrived (or 30 s passed),
/// then `grace` longer for extras.
///
/// A fetch that stalls (no record for 3 s while the partitions' high watermarks say more
/// are there) is given up and the partitions are read again from the next offsets by a
/// new consumer, so a broker that leaves one fetch unanswered slows the read instead of
/// shortening it. Each record is kept once, by (partition, offset). A short read panics
/// with what the broker holds per partition, so it tells a lost record from a stalled
/// read.
pub(crate) fn consume(
    topic: &str,
    n: usize,
    grace: Duration,
) -> Vec<rdkafka::message::OwnedMessage> {
    use std::collections::BTreeMap;
    let open = |next: &BTreeMap<i32, i64>| -> BaseConsumer {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", BROKER)
            .set("group.id", format!("outbox-test-{}", Uuid::new_v4()))
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            let at = next
                .get(&p)
                .map_or(Offset::Beginning, |&o| Offset::Offset(o));
            tpl.add_partition_offset(topic, p, at).unwrap();
        }
        consumer.assign(&tpl).unwrap();
        consumer
    };
    let held = |consumer: &BaseConsumer| -> Vec<(i32, i64)> {
        (0..PARTITIONS)
            .map(|p| {
                let high = consumer
                    .fetch_watermarks(topic, p, Duration::from_secs(5))
                    .map_or(-1, |(_, h)| h);
                (p, high)
            })
            .collect()
    };
    let mut next: BTreeMap<i32, i64> = BTreeMap::new();
    let mut out = Vec::new();
    fn take(
        m: &rdkafka::message::BorrowedMessage<'_>,
        next: &mut BTreeMap<i32, i64>,
        out: &mut Vec<rdkafka::message::OwnedMessage>,
    ) {
        let seen = next.get(&m.partition()).is_some_and(|&o| m.offset() < o);
        if !seen {
            next.insert(m.partition(), m.offset() + 1);
            out.push(m.detach());
        }
    }
    let mut consumer = open(&next);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last_progress = Instant::now();
    let mut reopened = 0;
    while out.len() < n && Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                take(&m, &mut next, &mut out);
                last_progress = Instant::now();
            }
            Some(Err(e)) => eprintln!("consume {topic}: {e}"),
            None if last_progress.elapsed() > Duration::from_secs(3) => {
                eprintln!(
                    "consume {topic}: no record for 3 s at {} of {n} (next offsets {next:?}, \
                     high watermarks {:?}): reading again with a new consumer",
                    out.len(),
                    held(&consumer)
                );
                consumer = open(&next);
                reopened += 1;
                last_progress = Instant::now();
            }
            None => {}
        }
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            take(&m, &mut next, &mut out);
        }
    }
    assert!(
        out.len() >= n,
        "read {} of {n} records of {topic} in 30 s ({reopened} fresh consumers); next offsets \
         {next:?}; the broker's high watermarks (partition, offset) {:?}",
        out.len(),
        held(&consumer)
    );
    out
}

/// `ENVELOPE`: [`super::OUTBOX`], [`super::CE`] or [`super::CE_STRUCTURED`].
pub(crate) struct KafkaHarness<const ENVELOPE: u8 = { super::OUTBOX }> {
    topic: String,
}

#[async_trait]
impl<const ENVELOPE: u8> Harness for KafkaHarness<ENVELOPE> {
    const DEDUPLICATES: bool = false;
    const PERMANENT_CODE: &'static str = "no_destination";

    async fn setup() -> Self {
        let topic = unique_topic("conformance");
        create_topic(&topic);
        KafkaHarness { topic }
    }

    /// One topic per instance: every label routes to it.
    fn topic(&self, _label: &str) -> String {
        self.topic.clone()
    }

    async fn sink(&self) -> Box<dyn Sink> {
        Box::new(
            KafkaSink::connect(&super::with_envelope(
                &format!("kafka://{BROKER}?message_timeout_ms=5000"),
                ENVELOPE,
                "",
            ))
            .await
            .unwrap(),
        )
    }

    async fn size_limit(&self) -> Option<usize> {
        Some(MESSAGE_MAX_BYTES)
    }

    async fn read(&mut self, expected: usize) -> Vec<Received> {
        let topic = self.topic.clone();
        let got = tokio::task::spawn_blocking(move || {
            consume(&topic, expected, Duration::from_millis(500))
        })
        .await
        .unwrap();
        assert!(
            got.len() >= expected,
            "read {}/{expected} records",
            got.len()
        );
        got.iter()
            .map(|m| {
                let env = outbox::envelope::from_kafka(m).unwrap();
                let record_key = m.key().map(|k| String::from_utf8(k.to_vec()).unwrap());
                assert_eq!(record_key, env.key, "record key = envelope key");
                assert_eq!(m.topic(), env.topic, "record topic = topic");
                Received::from(env)
            })
            .collect()
    }

    async fn down_sink() -> Result<Box<dyn Sink>, SinkError> {
        let url = format!(
            "kafka://127.0.0.1:{}?message_timeout_ms=1500",
            closed_port()
        );
        Ok(Box::new(KafkaSink::connect(&url).await?))
    }

    async fn permanent_topic(&mut self) -> String {
        // Never created.
        unique_topic("missing")
    }

    async fn cleanup(self) {
        let tansu = std::env::var("HOME")
            .map(|h| format!("{h}/.cargo/bin/tansu"))
            .unwrap();
        let _ = std::process::Command::new(tansu)
            .args([
                "topic",
                "delete",
                "--broker",
                &format!("tcp://{BROKER}"),
                &self.topic,
            ])
            .output();
    }
}

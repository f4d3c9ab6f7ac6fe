//! The Kafka sink against a Kafka-protocol broker on 127.0.0.1:9092 (tansu, started by
//! `scripts/services`): delivery reports before Ok, envelope in record headers, keys to
//! partitions, byte fidelity, oversize refused before publishing, an unknown topic
//! quarantined, brokers down reported as unavailable.
#![cfg(feature = "kafka")]
#![allow(clippy::unwrap_used)]

use crate::publisher_conformance::kafka::{BROKER, consume, create_topic, unique_topic};
use outbox::sink::kafka::KafkaSink;
use outbox::sink::{ErrorKind, Sink};
use outbox::{Message, OutgoingMessage};
use rdkafka::message::{Headers, Message as _};
use std::collections::HashMap;
use std::time::Duration;

fn outgoing(topic: &str, key: Option<&str>, payload: Vec<u8>) -> OutgoingMessage {
    let m = Message::new(topic, payload);
    OutgoingMessage {
        id: 1,
        message_id: m.id(),
        topic: topic.to_owned(),
        key: key.map(str::to_owned),
        payload: m.payload().to_vec().into(),
        headers: [("tenant".to_owned(), "åsa ✓".to_owned())].into(),
        occurred_at: chrono::Utc::now(),
        attempts: 1,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivery_reports_envelope_keys_and_bytes() {
    let topic = unique_topic("bytes");
    create_topic(&topic);
    let sink = KafkaSink::connect(&format!("kafka://{BROKER}"))
        .await
        .unwrap();
    let mut all: Vec<u8> = (0..=255u8).collect();
    all.extend_from_slice(&[0, 0, 0xff]);
    let batch = vec![
        outgoing(&topic, Some("k1"), all.clone()),
        outgoing(&topic, Some("k1"), Vec::new()),
        outgoing(&topic, None, vec![7u8; 512 * 1024]),
        outgoing(&topic, Some("k2"), b"plain".to_vec()),
    ];
    let results = sink.publish_all(&batch).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let got = consume(&topic, batch.len(), Duration::ZERO);
    assert_eq!(got.len(), batch.len());
    let by_id: HashMap<String, &rdkafka::message::OwnedMessage> = got
        .iter()
        .map(|m| {
            let h = m.headers().unwrap();
            let id = h
                .iter()
                .find(|h| h.key == "message-id")
                .and_then(|h| h.value)
                .map(|v| String::from_utf8(v.to_vec()).unwrap())
                .unwrap();
            (id, m)
        })
        .collect();
    let mut k1_partitions = Vec::new();
    for sent in &batch {
        let m = by_id[&sent.message_id.to_string()];
        assert_eq!(m.payload().unwrap_or_default(), &sent.payload[..]);
        assert_eq!(
            m.key().map(|k| String::from_utf8(k.to_vec()).unwrap()),
            sent.key
        );
        let tenant = m
            .headers()
            .unwrap()
            .iter()
            .find(|h| h.key == "tenant")
            .unwrap();
        assert_eq!(tenant.value.unwrap(), "åsa ✓".as_bytes());
        if sent.key.as_deref() == Some("k1") {
            k1_partitions.push(m.partition());
        }
    }
    assert_eq!(
        k1_partitions[0], k1_partitions[1],
        "same key, same partition"
    );
    sink.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_unknown_topic_and_down_brokers_are_classified() {
    let topic = unique_topic("errors");
    create_topic(&topic);
    let sink = KafkaSink::connect(&format!("kafka://{BROKER}?message_timeout_ms=4000"))
        .await
        .unwrap();
    // librdkafka's message.max.bytes (1,000,000) is known before publishing.
    let r = sink
        .publish_all(&[
            outgoing(&topic, None, vec![1u8; 2 * 1024 * 1024]),
            outgoing(&topic, None, b"ok".to_vec()),
        ])
        .await;
    assert_eq!(
        r[0].as_ref().unwrap_err().kind,
        ErrorKind::Permanent,
        "{r:?}"
    );
    assert!(
        r[1].is_ok(),
        "the other record of the batch still goes: {r:?}"
    );

    let r = sink
        .publish_all(&[outgoing(&unique_topic("missing"), None, b"x".to_vec())])
        .await;
    let e = r[0].as_ref().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Permanent, "{e:?}");
    assert!(e.message.contains("does not exist"), "{e:?}");

    // Nothing listens on port 1: connect succeeds, publishing reports the destination.
    let down = KafkaSink::connect("kafka://127.0.0.1:1?message_timeout_ms=1500")
        .await
        .unwrap();
    let r = down
        .publish_all(&[outgoing(&topic, None, b"x".to_vec())])
        .await;
    // No delivery report in time: the router turns it into "unavailable" when the
    // destination confirmed nothing.
    assert_eq!(
        r[0].as_ref().unwrap_err().kind,
        ErrorKind::TimedOut,
        "{r:?}"
    );
}

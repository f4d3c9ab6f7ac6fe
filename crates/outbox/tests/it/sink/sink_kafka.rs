//! The Kafka sink against a Kafka-protocol broker on 127.0.0.1:9092 (tansu, started by
//! `scripts/services`): delivery reports before Ok, envelope in record headers, keys to
//! partitions, byte fidelity, oversize refused before publishing, an unknown topic
//! quarantined, brokers down reported as unavailable; per-key ordering through two
//! relays into a topic of three partitions; and `envelope=cloudevents` records read back
//! by `envelope::from_kafka` and by the CloudEvents Python SDK's Kafka bindings.
#![cfg(feature = "kafka")]
#![allow(clippy::unwrap_used)]

use crate::sink::publisher_conformance::kafka::{BROKER, consume, create_topic, unique_topic};
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

/// Per-key ordering into Kafka: two relays with four batches in flight each, 10,000
/// messages over 50 keys on an ordered topic of three partitions; every key's records, read back in
/// partition order, are in id order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_keep_every_keys_order_into_kafka() {
    use crate::store::conformance::Backend as _;
    use outbox::store::KeyOrdering;
    use outbox::{Relay, RelayConfig};
    use std::sync::Arc;
    const KEYS: usize = 50;
    const PER_KEY: usize = 200;
    let topic = unique_topic("ordered");
    create_topic(&topic);
    let db = crate::store::conformance_postgres::PgBackend::create(
        "ordered_kafka",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let mut handles = Vec::new();
    for i in 0..2 {
        let cfg = RelayConfig {
            batch_size: 200,
            min_batch_size: 20,
            in_flight_batches: 4,
            ordering: KeyOrdering {
                topics: vec![outbox::sink::router::TopicPattern::parse(&topic).unwrap()],
                skip_dead: false,
            },
            ..crate::common::relay_config(&format!("kafka-ordered-{i}"))
        };
        let sink = KafkaSink::connect(&format!("kafka://{BROKER}"))
            .await
            .unwrap();
        handles.push(Relay::new(db.store(), Arc::new(sink), cfg).spawn());
    }
    let messages: Vec<Message> = (0..PER_KEY)
        .flat_map(|seq| {
            let topic = topic.clone();
            (0..KEYS).map(move |k| {
                Message::new(topic.clone(), format!("k{k}:{seq}").into_bytes()).key(format!("k{k}"))
            })
        })
        .collect();
    for chunk in messages.chunks(500) {
        db.enqueue_all(chunk).await;
    }
    let store = db.store();
    crate::common::wait_dispatched(
        "10,000 dispatched",
        &store,
        KEYS * PER_KEY,
        Duration::from_secs(120),
    )
    .await;
    let mut dispatched = 0;
    for h in handles {
        dispatched += h.shutdown().await.unwrap().dispatched;
    }
    assert_eq!(dispatched, (KEYS * PER_KEY) as u64, "each published once");
    let got = consume(&topic, KEYS * PER_KEY, Duration::ZERO);
    assert_eq!(got.len(), KEYS * PER_KEY);
    let mut seen: HashMap<String, Vec<u32>> = HashMap::new();
    for m in &got {
        let text = std::str::from_utf8(m.payload().unwrap()).unwrap();
        let (k, seq) = text.split_once(':').unwrap();
        seen.entry(k.to_owned())
            .or_default()
            .push(seq.parse().unwrap());
    }
    let want: Vec<u32> = (0..PER_KEY as u32).collect();
    assert_eq!(seen.len(), KEYS);
    for (k, seqs) in &seen {
        assert_eq!(seqs, &want, "key {k} arrived out of order");
    }
}

/// TLS and SASL settings reach librdkafka and it accepts them (it refuses `SSL` and the
/// SCRAM mechanisms when built without OpenSSL), and a property it does not know is a
/// clear error at open. The Kafka-protocol broker here cannot serve either (tansu 0.6
/// takes a certificate but never wraps a connection in TLS, and with `--authentication`
/// no first user can be created), so delivery over them is not tested here.
#[tokio::test]
async fn tls_and_sasl_settings_are_accepted_by_librdkafka() {
    let pki = crate::sink::tls::Pki::new();
    let files = format!(
        "ca={}&cert={}&key={}",
        pki.show("ca.pem"),
        pki.show("client.pem"),
        pki.show("client.key")
    );
    for url in [
        format!("kafkas://127.0.0.1:9?{files}"),
        format!("kafkas://app:pw@127.0.0.1:9?sasl_mechanism=SCRAM-SHA-512&{files}"),
        "kafka://app:pw@127.0.0.1:9?sasl_mechanism=SCRAM-SHA-256".to_owned(),
        "kafka://app:pw@127.0.0.1:9?kafka.client.id=relay-1".to_owned(),
    ] {
        let sink = KafkaSink::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert!(!sink.describe().contains("pw"), "{}", sink.describe());
    }
    let e = KafkaSink::connect("kafka://127.0.0.1:9?kafka.no.such.property=1")
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("librdkafka refused the configuration"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_records_decode_with_from_kafka_and_the_sdk() {
    use base64::Engine as _;
    use outbox::cloudevents::Mode;
    use serde_json::json;
    for (envelope, mode) in [
        ("cloudevents", Mode::Binary),
        ("cloudevents-structured", Mode::Structured),
    ] {
        let topic = unique_topic("ce");
        create_topic(&topic);
        let url = format!(
            "kafka://{BROKER}?envelope={envelope}&{}",
            crate::sink::cloudevents::source_param("")
        );
        let sink = KafkaSink::connect(&url).await.unwrap();
        let batch = crate::sink::cloudevents::messages(&topic);
        let results = sink.publish_all(&batch).await;
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        let got = consume(&topic, batch.len(), Duration::ZERO);
        assert_eq!(got.len(), batch.len());
        for record in &got {
            let decoded = outbox::envelope::from_kafka(record).unwrap();
            let m = batch
                .iter()
                .find(|m| m.message_id == decoded.message_id)
                .unwrap();
            let key = record.key().map(|k| String::from_utf8(k.to_vec()).unwrap());
            assert_eq!(key, m.key, "record key = key");
            let mut headers = serde_json::Map::new();
            for h in record.headers().unwrap().iter() {
                assert!(
                    !["message-id", "topic", "key", "occurred-at"].contains(&h.key),
                    "{}",
                    h.key
                );
                let v = String::from_utf8(h.value.unwrap().to_vec()).unwrap();
                headers.insert(h.key.to_owned(), json!(v));
            }
            if mode == Mode::Structured {
                assert_eq!(
                    headers.get("content-type"),
                    Some(&json!("application/cloudevents+json"))
                );
            } else {
                assert_eq!(headers.get("ce_id"), Some(&json!(m.message_id.to_string())));
            }
            let value = record.payload().unwrap_or_default();
            let read = crate::sink::cloudevents::sdk(&json!({
                "binding": "kafka",
                "headers": headers,
                "key": key,
                "body_base64": base64::engine::general_purpose::STANDARD.encode(value),
            }));
            crate::sink::cloudevents::check(&read, m, mode, decoded);
        }
        sink.close().await;
    }
}

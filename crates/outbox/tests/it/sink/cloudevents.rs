//! What the sinks send with `envelope=cloudevents`, read by the official CloudEvents Python
//! SDK (`cloudevents_sdk.py`, package `cloudevents` 2.2 or later: its `cloudevents.core`
//! HTTP, Kafka and AMQP bindings and JSON format, and the 1.x-compatible `cloudevents.v1`
//! HTTP and Kafka API), and by the library's own decoders; and the sinks that have no
//! binding refusing it.
//!
//! Each message goes through the real server (an in-test HTTP endpoint, RabbitMQ, NATS
//! JetStream, Mosquitto) except the Kafka ones, which are built from the shared mapping
//! (`outbox::cloudevents`) here; `sink_kafka.rs` sends them through a Kafka broker.

#![allow(clippy::unwrap_used)]

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use chrono::{DateTime, Utc};
use outbox::OutgoingMessage;
use outbox::cloudevents::{Binding, CloudEvents, Mode};
use outbox::sink::{ErrorKind, Sink, SinkError};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::Write as _;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use uuid::Uuid;

pub(crate) const SOURCE: &str = "https://shop.example.com/orders";
const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// What the SDK read, per SDK API (`api`: `core.http`, `v1.http`, `core.kafka`, …).
pub(crate) struct SdkRead {
    version: String,
    events: Vec<Value>,
}

/// Runs `cloudevents_sdk.py` on `input` (see the script for its shape).
pub(crate) fn sdk(input: &Value) -> SdkRead {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/it/sink/cloudevents_sdk.py"
    );
    let mut child = Command::new("python3")
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run python3 ({e}): the CloudEvents SDK checks need Python 3 and \
                 `python3 -m pip install 'cloudevents>=2.2,<3'` (scripts/test installs it)"
            )
        });
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the CloudEvents SDK refused the message ({}):\n{}\ninput: {input}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    SdkRead {
        version: v["sdk"].as_str().unwrap().to_owned(),
        events: v["events"].as_array().unwrap().clone(),
    }
}

/// The messages every test sends: JSON, binary and text payloads, with and without a key,
/// trace context, correlation and causation ids, a `subject`, a non-ASCII extension.
pub(crate) fn messages(topic: &str) -> Vec<OutgoingMessage> {
    let at = |s: &str| DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc);
    let mut headers = BTreeMap::new();
    headers.insert("content-type".to_owned(), "application/json".to_owned());
    headers.insert("traceparent".to_owned(), TRACEPARENT.to_owned());
    headers.insert("tracestate".to_owned(), "congo=t61rcWkgMzE".to_owned());
    headers.insert("correlation-id".to_owned(), "req 7".to_owned());
    headers.insert("causation-id".to_owned(), Uuid::now_v7().to_string());
    headers.insert("tenant".to_owned(), "grüße ✓ 東京 \"100%\"".to_owned());
    headers.insert("subject".to_owned(), "order/42".to_owned());
    let json = OutgoingMessage {
        id: 1,
        message_id: Uuid::now_v7(),
        topic: topic.to_owned(),
        key: Some("order-42".into()),
        payload: Bytes::from_static(br#"{"order_id":42,"items":["a","b"]}"#),
        headers,
        occurred_at: at("2026-11-30T10:11:12.123456Z"),
        attempts: 1,
    };
    let mut binary = json.clone();
    binary.id = 2;
    binary.message_id = Uuid::now_v7();
    binary.key = None;
    binary.payload = Bytes::from_static(&[0, 159, 146, 150, 255, 10]);
    binary.headers = BTreeMap::from([(
        "content-type".to_owned(),
        "application/x-protobuf".to_owned(),
    )]);
    let mut text = json.clone();
    text.id = 3;
    text.message_id = Uuid::now_v7();
    text.payload = Bytes::from_static("grüße, plain".as_bytes());
    text.headers = BTreeMap::from([("content-type".to_owned(), "text/plain".to_owned())]);
    text.occurred_at = at("2026-12-01T00:00:00Z");
    vec![json, binary, text]
}

/// Asserts that what an SDK API read is `m` as the mapping defines it.
fn assert_sdk_event(read: &Value, m: &OutgoingMessage, mode: Mode) {
    let api = read["api"].as_str().unwrap();
    let attrs = read["attributes"].as_object().unwrap();
    // The 1.x-compatible HTTP API does not percent-decode header values (the 2.x one
    // does): decode them here, as the binding tells a receiver to.
    let attr = |name: &str| -> Option<String> {
        let v = attrs.get(name)?.as_str()?.to_owned();
        Some(if api == "v1.http" && mode == Mode::Binary {
            outbox::cloudevents::percent_decode(name, &v).unwrap()
        } else {
            v
        })
    };
    let ctx = format!("{api} ({mode:?}) of message {}: {read}", m.id);
    assert_eq!(attr("specversion").as_deref(), Some("1.0"), "{ctx}");
    assert_eq!(attr("id"), Some(m.message_id.to_string()), "{ctx}");
    assert_eq!(attr("type").as_deref(), Some(m.topic.as_str()), "{ctx}");
    assert_eq!(attr("source").as_deref(), Some(SOURCE), "{ctx}");
    let time = DateTime::parse_from_rfc3339(&attr("time").unwrap().replace(' ', "T")).unwrap();
    assert_eq!(time, m.occurred_at, "{ctx}");
    assert_eq!(attr("partitionkey"), m.key.clone(), "{ctx}");
    // The 1.x-compatible Kafka API reads a structured record's `content-type` header (the
    // event format's media type, as the binding requires) as `datacontenttype`.
    let want_type = if api == "v1.kafka" && mode == Mode::Structured {
        Some("application/cloudevents+json")
    } else {
        m.headers.get("content-type").map(String::as_str)
    };
    assert_eq!(attr("datacontenttype").as_deref(), want_type, "{ctx}");
    for (header, attribute) in [
        ("traceparent", "traceparent"),
        ("tracestate", "tracestate"),
        ("correlation-id", "correlationid"),
        ("causation-id", "causationid"),
        ("tenant", "tenant"),
        ("subject", "subject"),
    ] {
        assert_eq!(
            attr(attribute).as_deref(),
            m.headers.get(header).map(String::as_str),
            "{attribute}: {ctx}"
        );
    }
    for outbox_header in ["message-id", "topic", "key", "occurred-at"] {
        assert!(!attrs.contains_key(outbox_header), "{outbox_header}: {ctx}");
    }
    // The data: the payload, as the SDK API presents it (bytes, text, or parsed JSON).
    let data = &read["data"];
    let bytes: Vec<u8> = match data["kind"].as_str().unwrap() {
        "bytes" => BASE64.decode(data["value"].as_str().unwrap()).unwrap(),
        "text" => data["value"].as_str().unwrap().as_bytes().to_vec(),
        "json" => serde_json::to_vec(&data["value"]).unwrap(),
        _ => Vec::new(),
    };
    if m.headers.get("content-type").map(String::as_str) == Some("application/json") {
        // JSON data may come back re-serialized: compare as JSON.
        let got: Value = serde_json::from_slice(&bytes).unwrap();
        let want: Value = serde_json::from_slice(&m.payload).unwrap();
        assert_eq!(got, want, "data of {ctx}");
    } else {
        assert_eq!(bytes, m.payload.to_vec(), "data of {ctx}");
    }
}

/// Checks every SDK API's reading of one message, and the library decoder's.
pub(crate) fn check(read: &SdkRead, m: &OutgoingMessage, mode: Mode, decoded: outbox::Envelope) {
    let version: Vec<u32> = read
        .version
        .split('.')
        .take(2)
        .map(|p| p.parse().unwrap_or(0))
        .collect();
    assert!(
        version >= vec![2, 2],
        "CloudEvents SDK {} (2.2 or later expected)",
        read.version
    );
    assert!(!read.events.is_empty());
    for e in &read.events {
        assert_sdk_event(e, m, mode);
    }
    assert_eq!(decoded.message_id, m.message_id);
    assert_eq!(decoded.topic, m.topic);
    assert_eq!(decoded.key, m.key);
    assert_eq!(decoded.occurred_at, m.occurred_at);
    assert_eq!(decoded.headers, m.headers);
    assert_eq!(decoded.payload, m.payload);
}

type Requests = Arc<Mutex<Vec<(HeaderMap, Bytes)>>>;

async fn record(State(reqs): State<Requests>, headers: HeaderMap, body: Bytes) -> StatusCode {
    reqs.lock().unwrap().push((headers, body));
    StatusCode::NO_CONTENT
}

/// An HTTP endpoint recording every request.
async fn endpoint() -> (String, Requests, tokio::task::JoinHandle<()>) {
    let requests: Requests = Arc::default();
    let app = Router::new().fallback(record).with_state(requests.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (format!("http://{addr}/events?token=abc"), requests, task)
}

pub(crate) fn source_param(prefix: &str) -> String {
    format!(
        "{prefix}ce_source={}",
        url::form_urlencoded::byte_serialize(SOURCE.as_bytes()).collect::<String>()
    )
}

#[cfg(feature = "http")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_requests_decode_with_the_sdk_in_both_modes() {
    use outbox::sink::http::{WebhookOptions, WebhookSink};
    use outbox::webhook::WebhookSecret;
    let secret = WebhookSecret::from_bytes(b"ce-test-key".to_vec());
    for (envelope, mode) in [
        ("cloudevents", Mode::Binary),
        ("cloudevents-structured", Mode::Structured),
    ] {
        let (base, requests, task) = endpoint().await;
        let url = format!(
            "{base}&outbox_envelope={envelope}&{}",
            source_param("outbox_")
        );
        let sink = WebhookSink::connect_with(
            &url,
            WebhookOptions {
                secret: Some(secret.clone()),
                ..WebhookOptions::default()
            },
        )
        .await
        .unwrap();
        assert!(
            sink.describe().contains("CloudEvents"),
            "{}",
            sink.describe()
        );
        let batch = messages("orders.order-placed.v1");
        for r in sink.publish_all(&batch).await {
            r.unwrap();
        }
        let got = requests.lock().unwrap().clone();
        assert_eq!(got.len(), batch.len());
        for (headers, body) in got {
            // The endpoint's own query is untouched; the sink's parameters are gone (the
            // recorder does not see the URI, but a parameter left in would be refused
            // by nothing: check the request shape instead).
            let decoded =
                outbox::envelope::from_verified_webhook(&secret, &headers, body.clone()).unwrap();
            let m = batch
                .iter()
                .find(|m| m.message_id == decoded.message_id)
                .unwrap();
            let content_type = headers.get("content-type").map(|v| v.to_str().unwrap());
            match mode {
                Mode::Binary => {
                    assert_eq!(
                        content_type,
                        m.headers.get("content-type").map(String::as_str)
                    );
                    assert_eq!(body, m.payload);
                    for name in ["message-id", "topic", "key", "occurred-at", "tenant"] {
                        assert!(headers.get(name).is_none(), "{name}");
                    }
                    if m.headers.contains_key("tenant") {
                        assert_eq!(
                            headers["ce-tenant"],
                            "gr%C3%BC%C3%9Fe%20%E2%9C%93%20%E6%9D%B1%E4%BA%AC%20%22100%25%22"
                        );
                    }
                }
                Mode::Structured => {
                    assert_eq!(content_type, Some("application/cloudevents+json"));
                    assert!(headers.keys().all(|n| !n.as_str().starts_with("ce-")));
                }
            }
            assert_eq!(
                headers["idempotency-key"].to_str().unwrap(),
                m.message_id.to_string()
            );
            let header_map: serde_json::Map<String, Value> = headers
                .iter()
                .map(|(n, v)| (n.to_string(), json!(v.to_str().unwrap())))
                .collect();
            let read = sdk(&json!({
                "binding": "http",
                "headers": header_map,
                "body_base64": BASE64.encode(&body),
            }));
            assert_eq!(read.events.len(), 2, "core.http and v1.http");
            check(&read, m, mode, decoded);
        }
        sink.close().await;
        task.abort();
    }
}

#[test]
fn kafka_shaped_messages_decode_with_the_sdk_kafka_bindings() {
    // The record a Kafka sink with envelope=cloudevents(-structured) writes: headers, the
    // value and the key, from the shared mapping (`sink::kafka` adds nothing else).
    for mode in [Mode::Binary, Mode::Structured] {
        let ce = CloudEvents::new(mode, SOURCE).unwrap();
        for m in messages("orders.order-placed.v1") {
            let event = ce.event(&m).unwrap();
            let mut headers = serde_json::Map::new();
            let (content_type, value) = match mode {
                Mode::Binary => {
                    for (n, v) in event.binary_headers(Binding::Kafka) {
                        assert!(n.starts_with("ce_"), "{n}");
                        headers.insert(n, json!(v));
                    }
                    (event.datacontenttype.clone(), event.data.to_vec())
                }
                Mode::Structured => (
                    Some("application/cloudevents+json".to_owned()),
                    event.to_json(),
                ),
            };
            if let Some(ct) = content_type {
                headers.insert("content-type".into(), json!(ct));
            }
            let read = sdk(&json!({
                "binding": "kafka",
                "headers": headers,
                "key": m.key,
                "body_base64": BASE64.encode(&value),
            }));
            assert_eq!(read.events.len(), 2, "core.kafka and v1.kafka");
            let decoded = match mode {
                Mode::Binary => {
                    let pairs: Vec<(String, String)> = event.binary_headers(Binding::Kafka);
                    outbox::cloudevents::from_binary(
                        Binding::Kafka,
                        pairs.iter().map(|(n, v)| (n.as_str(), v.as_bytes())),
                        event.datacontenttype.as_deref(),
                        value.clone(),
                    )
                    .unwrap()
                }
                Mode::Structured => outbox::cloudevents::from_structured(&value).unwrap(),
            };
            check(&read, &m, mode, decoded);
        }
    }
}

#[cfg(feature = "rabbitmq")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_deliveries_decode_with_the_sdk_amqp_binding() {
    use crate::sink::publisher_conformance::rabbitmq::{admin, amqp_url};
    use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::{AMQPValue, FieldTable};
    use outbox::sink::rabbitmq::RabbitMqSink;
    let (_conn, ch) = admin().await;
    let queue = format!("outbox.ce.{}", crate::common::unique());
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions {
            auto_delete: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    for (envelope, mode) in [
        ("cloudevents", Mode::Binary),
        ("cloudevents-structured", Mode::Structured),
    ] {
        let url = format!("{}?envelope={envelope}&{}", amqp_url(), source_param(""));
        let sink = RabbitMqSink::connect(&url).await.unwrap();
        let batch = messages(&queue);
        for r in sink.publish_all(&batch).await {
            r.unwrap();
        }
        for m in &batch {
            let got = ch
                .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
                .expect("a message in the queue");
            let d = &got.delivery;
            let decoded = outbox::envelope::from_amqp(d).unwrap();
            assert_eq!(decoded.message_id, m.message_id, "in order");
            assert_eq!(
                d.properties.message_id().as_ref().unwrap().as_str(),
                m.message_id.to_string()
            );
            let mut properties = serde_json::Map::new();
            if let Some(table) = d.properties.headers() {
                for (n, v) in table.inner() {
                    let AMQPValue::LongString(s) = v else {
                        panic!("{n} is {v:?}, not a long string");
                    };
                    assert!(n.as_str().starts_with("cloudEvents:"), "{n}");
                    properties.insert(
                        n.as_str().to_owned(),
                        json!(String::from_utf8(s.as_bytes().to_vec()).unwrap()),
                    );
                }
            }
            let content_type = d
                .properties
                .content_type()
                .as_ref()
                .map(|c| c.as_str().to_owned());
            if mode == Mode::Structured {
                assert!(properties.is_empty());
                assert_eq!(
                    content_type.as_deref(),
                    Some("application/cloudevents+json")
                );
            }
            let read = sdk(&json!({
                "binding": "amqp",
                "headers": properties,
                "content_type": content_type,
                "body_base64": BASE64.encode(&d.data),
            }));
            check(&read, m, mode, decoded);
        }
        sink.close().await;
    }
    let _ = ch
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_messages_decode_with_the_sdk_json_format() {
    use crate::common::{TestStream, nats_connect, nats_url};
    use outbox::sink::nats::{NatsOptions, NatsSink};
    let client = nats_connect().await;
    let stream = TestStream::shared(&client).await;
    let url = format!("{}?envelope=cloudevents&{}", nats_url(), source_param(""));
    let sink = NatsSink::connect(&url, NatsOptions::default())
        .await
        .unwrap();
    let batch = messages(&stream.subject("ce"));
    for r in sink.publish_all(&batch).await {
        r.unwrap();
    }
    let js = async_nats::jetstream::new(client.clone());
    let mut s = js.get_stream(&stream.name).await.unwrap();
    let first = s.info().await.unwrap().state.first_sequence;
    for (i, m) in batch.iter().enumerate() {
        let raw = s.get_raw_message(first + i as u64).await.unwrap();
        assert_eq!(
            raw.headers.get("Content-Type").map(|v| v.as_str()),
            Some("application/cloudevents+json")
        );
        assert_eq!(
            raw.headers.get("Nats-Msg-Id").map(|v| v.as_str()),
            Some(m.message_id.to_string().as_str())
        );
        let decoded =
            outbox::envelope::from_nats_headers(&raw.headers, raw.payload.clone()).unwrap();
        let read = sdk(&json!({
            "binding": "json",
            "body_base64": BASE64.encode(&raw.payload),
        }));
        check(&read, m, Mode::Structured, decoded);
    }
    sink.close().await;
    drop(stream);
}

#[cfg(feature = "mqtt")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_publishes_make_valid_sdk_events() {
    use crate::sink::publisher_conformance::mqtt::{Subscriber, require_broker};
    use outbox::sink::mqtt::MqttSink;
    use rumqttc::v5::mqttbytes::QoS;
    let broker = require_broker().await;
    let root = format!("outbox-ce/{}", crate::common::unique());
    let mut sub = Subscriber::start(&broker, &format!("{root}/#"), QoS::AtLeastOnce).await;
    for (envelope, mode) in [
        ("cloudevents", Mode::Binary),
        ("cloudevents-structured", Mode::Structured),
    ] {
        let url = format!("{broker}?envelope={envelope}&{}", source_param(""));
        let sink = MqttSink::connect(&url).await.unwrap();
        let batch = messages(&format!("{root}/orders"));
        for r in sink.publish_all(&batch).await {
            r.unwrap();
        }
        let got = sub.take(batch.len(), Duration::from_secs(10)).await;
        for p in got {
            let decoded = outbox::envelope::from_mqtt(&p).unwrap();
            let m = batch
                .iter()
                .find(|m| m.message_id == decoded.message_id)
                .unwrap();
            let props = p.properties.as_ref().unwrap();
            let input = match mode {
                Mode::Binary => {
                    let user: serde_json::Map<String, Value> = props
                        .user_properties
                        .iter()
                        .map(|(n, v)| (n.clone(), json!(v)))
                        .collect();
                    json!({
                        "binding": "mqtt",
                        "headers": user,
                        "content_type": props.content_type,
                        "body_base64": BASE64.encode(&p.payload),
                    })
                }
                Mode::Structured => {
                    assert_eq!(
                        props.content_type.as_deref(),
                        Some("application/cloudevents+json")
                    );
                    assert!(props.user_properties.is_empty());
                    json!({"binding": "json", "body_base64": BASE64.encode(&p.payload)})
                }
            };
            check(&sdk(&input), m, mode, decoded);
        }
        sink.close().await;
    }
}

#[tokio::test]
async fn sinks_without_a_binding_refuse_cloudevents() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("out.jsonl");
    for url in [
        "redis://127.0.0.1:6379?envelope=cloudevents".to_owned(),
        "redis://127.0.0.1:6379?envelope=cloudevents-structured&ce_source=%2Fx".to_owned(),
        "stdout?envelope=cloudevents".to_owned(),
        format!("file:{}?envelope=cloudevents", file.display()),
    ] {
        match outbox::sink::open(&url).await {
            Err(SinkError::InvalidUrl { reason, .. }) => {
                assert!(reason.contains("no protocol binding"), "{url}: {reason}");
            }
            Err(e) => panic!("{url}: {e}"),
            Ok(s) => panic!("{url}: opened {}", s.describe()),
        }
    }
    assert!(!file.exists(), "a refused file sink creates nothing");
    // The outbox envelope, named explicitly, is fine (and not part of the file's name).
    let sink = outbox::sink::open(&format!("file:{}?envelope=outbox", file.display()))
        .await
        .unwrap();
    assert_eq!(sink.describe(), format!("file:{}", file.display()));
    // NATS binding 1.0.2 has no binary mode; an unknown envelope is named.
    for (url, says) in [
        (
            "nats://127.0.0.1:4222?envelope=cloudevents-binary",
            "structured",
        ),
        ("mqtt://127.0.0.1:1883?envelope=cloudevent", "not one of"),
        (
            "amqp://guest:guest@127.0.0.1:5672/%2f?ce_source=%2Fx",
            "needs envelope=cloudevents",
        ),
        (
            "http://127.0.0.1:9/x?outbox_envelope=cloudevents&outbox_ce_source=a%20b",
            "URI-reference",
        ),
    ] {
        match outbox::sink::open(url).await {
            Err(SinkError::InvalidUrl { reason, .. }) => {
                assert!(reason.contains(says), "{url}: {reason}");
            }
            Err(e) => panic!("{url}: {e}"),
            Ok(s) => panic!("{url}: opened {}", s.describe()),
        }
    }
}

#[cfg(feature = "http")]
#[tokio::test]
async fn headers_that_cannot_be_attributes_fail_permanently_before_sending() {
    use outbox::sink::http::{WebhookOptions, WebhookSink};
    let (base, requests, task) = endpoint().await;
    let sink = WebhookSink::connect_with(
        &format!("{base}&outbox_envelope=cloudevents"),
        WebhookOptions::default(),
    )
    .await
    .unwrap();
    let mut batch = messages("orders.order-placed.v1");
    batch[0].headers.insert("tenant-id".into(), "acme".into());
    batch[1].headers.insert("id".into(), "x".into());
    let results = sink.publish_all(&batch).await;
    for (i, r) in results.iter().take(2).enumerate() {
        let e = r.as_ref().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Permanent, "{i}: {e}");
        assert_eq!(e.code, "invalid_header");
    }
    assert!(
        results[0]
            .as_ref()
            .unwrap_err()
            .message
            .contains("\"tenant-id\"")
    );
    assert!(results[2].is_ok(), "{:?}", results[2]);
    assert_eq!(
        requests.lock().unwrap().len(),
        1,
        "only the good message was sent"
    );
    task.abort();
}

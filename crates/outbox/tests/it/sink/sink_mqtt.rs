//! The MQTT v5 sink against Mosquitto (127.0.0.1:1883; `OUTBOX_TEST_MQTT_URL` overrides),
//! read back by a rumqttc v5 subscriber: QoS 1 and QoS 2 deliver payload bytes (binary,
//! empty, 1 MiB) and the envelope as user properties (non-ASCII included) with the content
//! type property; a publish is confirmed only by its own acknowledgement; an unreachable
//! broker is unavailable without failing `connect`; unpublishable topics and headers fail
//! permanently without breaking the connection; a private Mosquitto shows the broker's
//! maximum packet size (permanent) and a broker restart (unavailable, then delivered);
//! 200 messages go through the relay from SQLite.
//! Tests talk to Mosquitto only (the project's rule: real services, no stand-ins), so
//! acknowledgements that arrive out of order or are refused are not exercised here.

#![allow(clippy::unwrap_used)]

use crate::common::{relay_config, unique};
use crate::sink::publisher_conformance::mqtt::{Subscriber, require_broker};
use crate::store::conformance::Backend as _;
use outbox::message::OutgoingMessage;
use outbox::sink::mqtt::{MqttSink, MqttSinkOptions};
use outbox::sink::{ErrorKind, Sink};
use outbox::{Message, Relay};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::Publish;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tempfile::TempDir;

// ---------------------------------------------------------------------------------------
// Brokers and subscribers
// ---------------------------------------------------------------------------------------

fn url_with(base: &str, query: &str) -> String {
    if query.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{query}")
    }
}

/// A Mosquitto of the test's own on a free port (with extra config lines), for outages and
/// broker limits. Killed (by its pid) when stopped or dropped.
struct PrivateBroker {
    child: Option<Child>,
    port: u16,
    dir: TempDir,
    extra: String,
}

impl PrivateBroker {
    async fn start(extra: &str) -> Self {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut b = PrivateBroker {
            child: None,
            port,
            dir: tempfile::tempdir().unwrap(),
            extra: extra.to_owned(),
        };
        b.restart().await;
        b
    }

    fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("mosquitto.log")
    }

    async fn restart(&mut self) {
        assert!(self.child.is_none());
        let conf = self.dir.path().join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "listener {} 127.0.0.1\nallow_anonymous true\npersistence false\nlog_dest file {}\n{}\n",
                self.port,
                self.log().display(),
                self.extra
            ),
        )
        .unwrap();
        let child = Command::new("mosquitto")
            .arg("-c")
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run mosquitto ({e}): install it with `apt-get install mosquitto`")
            });
        self.child = Some(child);
        let (port, log) = (self.port, self.log());
        let child = &mut self.child;
        crate::common::wait_until(
            "private mosquitto to listen",
            Duration::from_secs(10),
            || {
                if let Some(c) = child.as_mut()
                    && let Ok(Some(status)) = c.try_wait()
                {
                    panic!(
                        "private mosquitto exited with {status}; log:\n{}",
                        std::fs::read_to_string(&log).unwrap_or_default()
                    );
                }
                async move {
                    tokio::net::TcpStream::connect(("127.0.0.1", port))
                        .await
                        .map(drop)
                        .map_err(|e| e.to_string())
                }
            },
        )
        .await;
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for PrivateBroker {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

fn outgoing(topic: &str, payload: Vec<u8>) -> OutgoingMessage {
    crate::sink::publisher_conformance::outgoing(1, topic, None, payload)
}

fn with_header(mut m: OutgoingMessage, name: &str, value: &str) -> OutgoingMessage {
    m.headers.insert(name.to_owned(), value.to_owned());
    m
}

fn props(p: &Publish) -> HashMap<String, String> {
    p.properties
        .as_ref()
        .map(|pp| pp.user_properties.iter().cloned().collect())
        .unwrap_or_default()
}

fn topic_of(p: &Publish) -> String {
    String::from_utf8(p.topic.to_vec()).unwrap()
}

/// A topic of its own for one test (dots kept: MQTT allows them).
fn test_topic(label: &str) -> String {
    format!("outbox-test/{}/{label}.v1", unique())
}

// ---------------------------------------------------------------------------------------
// Against Mosquitto
// ---------------------------------------------------------------------------------------

async fn delivers_bytes_and_envelope(qos: QoS, query: &str) {
    let url = require_broker().await;
    let topic = test_topic("orders.order-placed");
    let mut sub = Subscriber::start(&url, &topic, qos).await;
    let sink = MqttSink::connect(&url_with(&url, query)).await.unwrap();
    assert!(sink.is_connected());

    let binary: Vec<u8> = (0..=255u8).chain([0, 0xff, 0x00]).collect();
    let big: Vec<u8> = (0..1024 * 1024).map(|i| (i * 13 % 251) as u8).collect();
    let mut a = with_header(
        with_header(outgoing(&topic, binary), "correlation-id", "req-7"),
        "tenant",
        "Grüße, Zoë ✓ 東京",
    );
    a.key = Some("order-42".into());
    let b = with_header(
        outgoing(&topic, Vec::new()),
        "content-type",
        "application/json",
    );
    let c = outgoing(&topic, big);
    let batch = vec![a, b, c];
    let results = sink.publish_all(&batch).await;
    assert_eq!(results, vec![Ok(()), Ok(()), Ok(())]);

    let got = sub.take(3, Duration::from_secs(10)).await;
    let by_id: HashMap<String, &Publish> = got
        .iter()
        .map(|p| (props(p)["message-id"].clone(), p))
        .collect();
    for m in &batch {
        let p = by_id[&m.message_id.to_string()];
        assert_eq!(topic_of(p), m.topic, "topic unchanged, dots included");
        assert_eq!(p.payload.as_ref(), m.payload.as_ref(), "payload bytes");
        let pr = props(p);
        assert_eq!(pr["topic"], m.topic);
        assert_eq!(pr.get("key"), m.key.as_ref());
        let occurred = chrono::DateTime::parse_from_rfc3339(&pr["occurred-at"]).unwrap();
        assert_eq!(
            occurred.timestamp_micros(),
            m.occurred_at.timestamp_micros()
        );
        for (k, v) in &m.headers {
            assert_eq!(&pr[k], v, "user property {k}");
        }
    }
    let pa = by_id[&batch[0].message_id.to_string()];
    assert_eq!(
        props(pa)["tenant"],
        "Grüße, Zoë ✓ 東京",
        "non-ASCII unchanged"
    );
    let pb = by_id[&batch[1].message_id.to_string()];
    assert_eq!(
        pb.properties.as_ref().unwrap().content_type.as_deref(),
        Some("application/json")
    );
    assert_eq!(pa.properties.as_ref().unwrap().content_type, None);
    sink.close().await;
}

#[tokio::test]
async fn qos1_delivers_payload_bytes_and_envelope_properties() {
    delivers_bytes_and_envelope(QoS::AtLeastOnce, "").await;
}

#[tokio::test]
async fn qos2_delivers_payload_bytes_and_envelope_properties() {
    delivers_bytes_and_envelope(QoS::ExactlyOnce, "qos=2").await;
}

#[tokio::test]
async fn a_confirmed_message_has_reached_the_broker() {
    // Mosquitto acknowledges after routing the message to current subscribers: by the time
    // publish says Ok, the subscriber's copy is on its way (no further publish needed).
    let url = require_broker().await;
    for (qos, query) in [(QoS::AtLeastOnce, "qos=1"), (QoS::ExactlyOnce, "qos=2")] {
        let topic = test_topic("confirm");
        let mut sub = Subscriber::start(&url, &topic, qos).await;
        let sink = MqttSink::connect(&url_with(&url, query)).await.unwrap();
        for i in 0..20 {
            let m = outgoing(&topic, format!("m{i}").into_bytes());
            assert_eq!(
                sink.publish_all(std::slice::from_ref(&m)).await,
                vec![Ok(())]
            );
            let got = sub.take(1, Duration::from_secs(2)).await;
            assert_eq!(props(&got[0])["message-id"], m.message_id.to_string());
        }
        sink.close().await;
    }
}

#[tokio::test]
async fn unreachable_broker_is_unavailable_and_connect_succeeds() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let start = Instant::now();
    let sink = MqttSink::connect_with(
        &format!("mqtt://user:hunter2@127.0.0.1:{port}?client_id=outbox-test-down"),
        MqttSinkOptions {
            initial_connect_wait: Duration::from_millis(300),
            ..MqttSinkOptions::default()
        },
    )
    .await
    .unwrap();
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(!sink.is_connected());
    let d = sink.describe();
    assert!(!d.contains("hunter2"), "{d}");
    let r = sink
        .publish_all(&[outgoing("a.b", b"x".to_vec()), outgoing("c.d", vec![])])
        .await;
    for e in r {
        let e = e.unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
        assert!(!e.message.contains("hunter2"), "{e}");
    }
    // TLS builds its configuration (system roots, the ring provider) and fails the same way.
    let tls = MqttSink::connect_with(
        &format!("mqtts://127.0.0.1:{port}"),
        MqttSinkOptions {
            initial_connect_wait: Duration::from_millis(300),
            ..MqttSinkOptions::default()
        },
    )
    .await
    .unwrap();
    let e = tls.publish_all(&[outgoing("a.b", b"x".to_vec())]).await[0]
        .clone()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
    sink.close().await;
    tls.close().await;
}

#[tokio::test]
async fn unpublishable_topics_and_headers_fail_permanently_and_the_rest_still_go() {
    let url = require_broker().await;
    let topic = test_topic("mixed");
    let mut sub = Subscriber::start(&url, &topic, QoS::AtLeastOnce).await;
    let sink = MqttSink::connect(&url).await.unwrap();
    let batch = vec![
        outgoing("a/+/b", b"1".to_vec()),
        outgoing("a/#", b"2".to_vec()),
        outgoing("$SYS/outbox", b"3".to_vec()),
        with_header(
            outgoing(&topic, b"4".to_vec()),
            "note",
            "line one\nline two",
        ),
        outgoing(&topic, b"5".to_vec()),
    ];
    let r = sink.publish_all(&batch).await;
    for (i, e) in r[..4].iter().enumerate() {
        assert_eq!(
            e.clone().unwrap_err().kind,
            ErrorKind::Permanent,
            "{i}: {e:?}"
        );
    }
    assert_eq!(r[4], Ok(()));
    let got = sub.take(1, Duration::from_secs(5)).await;
    assert_eq!(got[0].payload.as_ref(), b"5");
    // The connection is still good.
    assert!(sink.is_connected());
    assert_eq!(
        sink.publish_all(&[outgoing(&topic, b"6".to_vec())]).await,
        vec![Ok(())]
    );
    sink.close().await;
}

#[tokio::test]
async fn over_the_brokers_maximum_packet_size_is_permanent() {
    let broker = PrivateBroker::start("max_packet_size 2000").await;
    let sink = MqttSink::connect(&broker.url()).await.unwrap();
    let r = sink
        .publish_all(&[
            outgoing("big.v1", vec![7u8; 5000]),
            outgoing("small.v1", vec![7u8; 100]),
        ])
        .await;
    let e = r[0].clone().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Permanent, "{e}");
    assert!(e.message.contains("maximum packet size of 2000"), "{e}");
    assert_eq!(r[1], Ok(()));
    sink.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_is_unavailable_then_delivers() {
    let mut broker = PrivateBroker::start("").await;
    let sink = MqttSink::connect(&broker.url()).await.unwrap();
    assert_eq!(
        sink.publish_all(&[outgoing("before.v1", b"x".to_vec())])
            .await,
        vec![Ok(())]
    );
    broker.stop();
    let r = sink
        .publish_all(&[
            outgoing("during.v1", b"x".to_vec()),
            outgoing("during.v1", b"y".to_vec()),
        ])
        .await;
    for e in r {
        let e = e.unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
    }
    assert!(!sink.is_connected());
    broker.restart().await;
    let start = Instant::now();
    loop {
        let r = sink
            .publish_all(&[outgoing("after.v1", b"z".to_vec())])
            .await;
        if r == vec![Ok(())] {
            break;
        }
        assert_eq!(r[0].clone().unwrap_err().kind, ErrorKind::Unavailable);
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "not reconnected within 10 s: {r:?}"
        );
    }
    sink.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_that_breaks_the_connection_is_quarantined_not_retried_forever() {
    // Mosquitto answers a payload over `message_size_limit` with PUBACK reason 0x95, which
    // MQTT v5 does not define for PUBACK: rumqttc drops the connection. The message must
    // fail as transient (attempts count), not as unavailable (attempt given back forever).
    let broker = PrivateBroker::start("message_size_limit 1000").await;
    let sink = MqttSink::connect(&broker.url()).await.unwrap();
    let r = sink
        .publish_all(&[outgoing("big.v1", vec![7u8; 5000])])
        .await;
    let e = r[0].clone().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Transient, "{e}");
    // The sink reconnects and carries on.
    let start = Instant::now();
    while sink
        .publish_all(&[outgoing("small.v1", vec![7u8; 10])])
        .await
        != vec![Ok(())]
    {
        assert!(start.elapsed() < Duration::from_secs(5), "no reconnect");
    }

    // Through the relay: the big message ends up dead after max_attempts; the small ones
    // claimed before it in the same batch are delivered once.
    const SMALL: usize = 20;
    let db = crate::store::conformance_sqlite::SqliteBackend::create(
        "sqlite",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let mut msgs = crate::common::messages("small.v1", SMALL);
    msgs.push(Message::new("big.v1", vec![7u8; 5000]));
    let enq = db.enqueue_all(&msgs).await;
    let big_id = enq[SMALL].id;
    let mut cfg = relay_config("relay-mqtt-poison");
    cfg.max_attempts = 3;
    let handle = Relay::new(db.store(), Arc::new(sink), cfg).spawn();
    let d = &db;
    crate::common::wait_until(
        "the big message quarantined",
        Duration::from_secs(20),
        || async move {
            let rows = d.rows().await;
            let settled = rows.iter().filter(|r| r.status >= 2).count();
            if settled == SMALL + 1 {
                Ok(())
            } else {
                Err(format!("{settled} settled: {rows:?}"))
            }
        },
    )
    .await;
    handle.shutdown().await.unwrap();
    for r in db.rows().await {
        if r.id == big_id {
            assert_eq!((r.status, r.attempts), (3, 3), "{r:?}");
        } else {
            assert_eq!((r.status, r.attempts), (2, 1), "{r:?}");
        }
    }
}

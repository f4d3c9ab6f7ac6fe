//! The Redis Streams sink against the machine's Redis: `Ok` only once XADD replied, with
//! every field readable from the stream byte for byte; a key that is not a stream is
//! permanent while the rest of the batch goes through; a server that cannot be reached is
//! unavailable; the relay delivers through it end to end.
//!
//! Each test uses its own stream keys (deleted afterwards, even on panic). A Redis that is
//! not running is a loud failure naming how to start it.

#![cfg(feature = "redis")]
#![allow(clippy::unwrap_used)]

use crate::common::unique;
use crate::sink::publisher_conformance::redis::{admin, entries, redis_url, text};
use outbox::OutgoingMessage;
use outbox::sink::redis_streams::RedisStreamsSink;
use outbox::sink::{ErrorKind, Sink};
use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;
use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

/// Keys of one test, deleted (best effort) when dropped.
struct Keys {
    prefix: String,
}

impl Keys {
    fn new() -> Self {
        Keys {
            prefix: format!("outbox.test.{}", unique()),
        }
    }

    /// A key (stream name, topic) under this test's prefix.
    fn key(&self, rest: &str) -> String {
        format!("{}.{rest}", self.prefix)
    }
}

impl Drop for Keys {
    fn drop(&mut self) {
        let pattern = format!("{}.*", self.prefix);
        let _ = std::thread::spawn(move || {
            let Ok(client) = redis::Client::open(redis_url().as_str()) else {
                return;
            };
            let Ok(mut c) = client.get_connection_with_timeout(Duration::from_secs(3)) else {
                return;
            };
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(&pattern)
                .query(&mut c)
                .unwrap_or_default();
            if !keys.is_empty() {
                let _: redis::RedisResult<()> = redis::cmd("DEL").arg(keys).query(&mut c);
            }
        })
        .join();
    }
}

fn outgoing(id: i64, topic: &str, payload: Vec<u8>) -> OutgoingMessage {
    crate::sink::publisher_conformance::outgoing(id, topic, None, payload)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_entries_arrive_byte_for_byte_with_the_envelope() {
    let mut admin = admin().await;
    let keys = Keys::new();
    let stream = keys.key("orders.order-placed.v1");

    let binary: Vec<u8> = (0..=255u8).chain([0, 0xff, 0xfe]).collect();
    let big: Vec<u8> = (0..1024 * 1024).map(|i| (i * 7 % 251) as u8).collect();
    let mut batch = vec![
        outgoing(1, &stream, binary.clone()),
        outgoing(2, &stream, Vec::new()),
        outgoing(3, &stream, big.clone()),
    ];
    batch[0].key = Some("order-42".into());
    batch[0]
        .headers
        .insert("content-type".into(), "application/octet-stream".into());
    batch[0]
        .headers
        .insert("correlation-id".into(), "req-7".into());
    batch[1]
        .headers
        .insert("tenant".into(), "grüße ✓ 東京".into());

    let sink = RedisStreamsSink::connect(&redis_url()).await.unwrap();
    let results = sink.publish_all(&batch).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    // Ok means XADD replied: the entries are in the stream by the time publish returns.
    let got = entries(&mut admin, &stream).await;
    assert_eq!(got.len(), 3);
    for (sent, (_, fields)) in batch.iter().zip(&got) {
        assert_eq!(
            fields["payload"],
            sent.payload.as_ref(),
            "payload of {}",
            sent.id
        );
        assert_eq!(text(fields, "message_id"), sent.message_id.to_string());
        assert_eq!(text(fields, "topic"), stream);
        assert_eq!(text(fields, "key"), sent.key.clone().unwrap_or_default());
        assert_eq!(
            text(fields, "occurred_at"),
            sent.occurred_at
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
        );
        let headers: BTreeMap<String, String> =
            serde_json::from_str(&text(fields, "headers")).unwrap();
        assert_eq!(headers, sent.headers, "headers of {}", sent.id);
        assert_eq!(fields.len(), 6, "{:?}", fields.keys());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_is_not_a_stream_is_permanent_and_the_rest_go_through() {
    let mut admin = admin().await;
    let keys = Keys::new();
    let good = keys.key("good");
    let string_key = keys.key("taken");
    let _: () = admin.set(&string_key, "not a stream").await.unwrap();

    let sink = RedisStreamsSink::connect(&redis_url()).await.unwrap();
    let batch = vec![
        outgoing(1, &good, b"one".to_vec()),
        outgoing(2, &string_key, b"two".to_vec()),
        outgoing(3, &good, b"three".to_vec()),
    ];
    let results = sink.publish_all(&batch).await;
    assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
    let e = results[1].as_ref().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Permanent, "{e}");
    assert!(e.message.contains("WRONGTYPE"), "{e}");
    assert!(e.message.contains("is not a stream"), "{e}");
    let got = entries(&mut admin, &good).await;
    let payloads: Vec<&[u8]> = got.iter().map(|(_, f)| f["payload"].as_slice()).collect();
    assert_eq!(payloads, [b"one".as_slice(), b"three".as_slice()]);
    let v: String = admin.get(&string_key).await.unwrap();
    assert_eq!(v, "not a stream", "the other key is untouched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_down_is_unavailable_and_connect_still_succeeds() {
    let started = Instant::now();
    // Nothing listens on port 1: the server is "down".
    let sink = RedisStreamsSink::connect("redis://:secret@127.0.0.1:1/0")
        .await
        .expect("a server that is down must not fail connect");
    assert!(!sink.describe().contains("secret"), "{}", sink.describe());
    let batch: Vec<OutgoingMessage> = (0..3).map(|i| outgoing(i, "t.down.v1", vec![1])).collect();
    let results = sink.publish_all(&batch).await;
    assert_eq!(results.len(), 3);
    for r in &results {
        let e = r.as_ref().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
        assert!(e.message.contains("127.0.0.1:1"), "{e}");
        assert!(
            !e.message.contains("secret"),
            "no credentials in errors: {e}"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// Client ids of the server's normal connections.
async fn client_ids(c: &mut MultiplexedConnection) -> HashSet<String> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .arg("TYPE")
        .arg("normal")
        .query_async(c)
        .await
        .unwrap();
    list.lines()
        .filter_map(|l| l.split(' ').find_map(|f| f.strip_prefix("id=")))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_connection_is_unavailable_then_replaced() {
    let mut admin = admin().await;
    let keys = Keys::new();
    let stream = keys.key("reconnect");
    // The sink's connection is the one new client id; other tests connect concurrently,
    // so try again until exactly one appeared.
    let mut found = None;
    for _ in 0..20 {
        let before = client_ids(&mut admin).await;
        let sink = RedisStreamsSink::connect(&redis_url()).await.unwrap();
        let new: Vec<String> = client_ids(&mut admin)
            .await
            .difference(&before)
            .cloned()
            .collect();
        if let [id] = new.as_slice() {
            found = Some((sink, id.clone()));
            break;
        }
    }
    let (sink, id) = found.expect("could not single out the sink's connection");
    assert!(
        sink.publish_all(&[outgoing(1, &stream, b"a".to_vec())])
            .await[0]
            .is_ok()
    );

    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(&id)
        .query_async(&mut admin)
        .await
        .unwrap();
    // The first batch may find the dead socket (unavailable); a later one reconnects.
    let mut delivered = false;
    for i in 2..6 {
        match sink
            .publish_all(&[outgoing(i, &stream, b"b".to_vec())])
            .await
            .remove(0)
        {
            Ok(()) => {
                delivered = true;
                break;
            }
            Err(e) => {
                eprintln!("after the kill: {e}");
                assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
            }
        }
    }
    assert!(delivered, "the sink never reconnected");
    let len: usize = admin.xlen(&stream).await.unwrap();
    assert_eq!(len, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maxlen_trims_and_oversized_messages_are_permanent() {
    let mut admin = admin().await;
    let keys = Keys::new();
    let stream = keys.key("trimmed");
    let sink =
        RedisStreamsSink::connect(&format!("{}?maxlen=10&max_message_bytes=1000", redis_url()))
            .await
            .unwrap();
    assert!(
        sink.describe().contains("maxlen ~10"),
        "{}",
        sink.describe()
    );
    for _ in 0..5 {
        let batch: Vec<OutgoingMessage> = (0..100)
            .map(|i| outgoing(i, &stream, vec![1; 10]))
            .collect();
        assert!(sink.publish_all(&batch).await.iter().all(Result::is_ok));
    }
    // Approximate trimming removes whole macro nodes (100 entries by default).
    let len: usize = admin.xlen(&stream).await.unwrap();
    assert!((10..=110).contains(&len), "XLEN {len}");

    let results = sink
        .publish_all(&[
            outgoing(1, &stream, vec![0; 1000]),
            outgoing(2, &stream, vec![0; 10]),
        ])
        .await;
    let e = results[0].as_ref().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Permanent, "{e}");
    assert!(
        e.message.contains("exceeds the Redis limit of 1000 bytes"),
        "{e}"
    );
    assert!(results[1].is_ok(), "{results:?}");
}

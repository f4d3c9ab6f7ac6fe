//! The publisher conformance suite: the same cases against every sink and its real server.
//!
//! Each sink implements [`Harness`] in a submodule here (so the read-back code lives in one
//! place); `sink/conformance.rs` instantiates every case for it, a module per sink, with
//! [`publisher_conformance_tests!`], one `#[tokio::test]` per case.
//!
//! Cases:
//! 1. confirmation then fidelity: every result `Ok` (or a documented size refusal,
//!    permanent), then reading back yields exactly the confirmed messages, payload bytes,
//!    key and envelope headers unchanged;
//! 2. broker down: `connect` succeeds, every message is `Unavailable`;
//! 3. a permanent error is `Permanent` and the rest of the batch still succeeds;
//! 4. a duplicate publish of one message id is `Ok` twice; deduplicating brokers store one
//!    copy, the others two copies with the same message id;
//! 5. a relay (SQLite store) delivers 200 messages through the sink, each once, unchanged.
//!
//! The NATS, Kafka, RabbitMQ, MQTT and HTTP harnesses take the envelope as a const
//! parameter ([`OUTBOX`], [`CE`], [`CE_STRUCTURED`]): `sink::conformance::cloudevents`
//! (Kafka: `sink::conformance::kafka`) runs the same cases with CloudEvents, read back
//! through the same decoders.

#![allow(clippy::unwrap_used)]

use crate::store::conformance::Backend as _;
use async_trait::async_trait;
use chrono::Utc;
use outbox::OutgoingMessage;
use outbox::sink::{ErrorKind, PublishError, Sink, SinkError};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use uuid::Uuid;

pub(crate) mod file;
#[cfg(feature = "http")]
pub(crate) mod http;
#[cfg(feature = "kafka")]
pub(crate) mod kafka;
#[cfg(feature = "mqtt")]
pub(crate) mod mqtt;
#[cfg(feature = "nats")]
pub(crate) mod nats;
#[cfg(feature = "rabbitmq")]
pub(crate) mod rabbitmq;
#[cfg(feature = "redis")]
pub(crate) mod redis;
#[cfg(feature = "nats")]
pub(crate) mod router;

/// One message as a consumer of the destination reads it back: through the library's
/// decoder for that sink (`outbox::envelope::from_*`), so case 1 is also the round trip of
/// every envelope field through the real broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Received {
    pub(crate) message_id: Uuid,
    pub(crate) topic: String,
    pub(crate) key: Option<String>,
    pub(crate) payload: Vec<u8>,
    /// The envelope headers (`message-id`, `topic`, `key`, `occurred-at`, user headers),
    /// nothing the transport adds.
    pub(crate) headers: BTreeMap<String, String>,
}

impl From<outbox::Envelope> for Received {
    /// What the library's decoder for the sink (`outbox::envelope::from_*`) read back.
    fn from(e: outbox::Envelope) -> Self {
        Received {
            message_id: e.message_id,
            headers: e.wire_headers(),
            topic: e.topic,
            key: e.key,
            payload: e.payload.to_vec(),
        }
    }
}

/// One sink against its real server, with a fresh destination per instance.
#[async_trait]
pub(crate) trait Harness: Send + Sized + 'static {
    /// Does the broker drop a re-publish of the same message id (one stored copy)?
    const DEDUPLICATES: bool;

    /// The reason code (`PublishError::code`) of the failure on [`Harness::permanent_topic`].
    const PERMANENT_CODE: &'static str = "none";

    /// Makes a fresh destination (stream, topic, queue, key prefix, endpoint).
    async fn setup() -> Self;

    /// A topic that routes to this instance's destination; `label` tells topics apart
    /// (a sink may route every label to one destination).
    fn topic(&self, label: &str) -> String;

    /// A sink publishing to the destination.
    async fn sink(&self) -> Box<dyn Sink>;

    /// The largest message the sink accepts, when below 1 MiB + headers (a larger one must
    /// be refused as permanent before it is sent); `None` when 1 MiB fits.
    async fn size_limit(&self) -> Option<usize>;

    /// Every message delivered to the destination: waits until at least `expected`
    /// arrived (panics after a timeout), then briefly for any extra.
    async fn read(&mut self, expected: usize) -> Vec<Received>;

    /// A sink of this kind pointed at a port nothing listens on (a broker sink; a local one
    /// instantiates the suite with `local` and never gets here).
    async fn down_sink() -> Result<Box<dyn Sink>, SinkError> {
        unreachable!("a local sink has no broker to be down")
    }

    /// A topic whose messages the sink must fail as permanent (no stream, unknown topic,
    /// unroutable, wrong key type, invalid topic, a 400 answer).
    async fn permanent_topic(&mut self) -> String {
        unreachable!("a local sink refuses no topic")
    }

    /// Deletes what `setup` made (best effort; guards also clean up on panic).
    async fn cleanup(self);
}

/// A message on `topic` with a fresh id and the given payload.
pub(crate) fn outgoing(
    id: i64,
    topic: &str,
    key: Option<&str>,
    payload: Vec<u8>,
) -> OutgoingMessage {
    OutgoingMessage {
        id,
        message_id: Uuid::now_v7(),
        topic: topic.to_owned(),
        key: key.map(str::to_owned),
        payload: payload.into(),
        headers: BTreeMap::new(),
        occurred_at: Utc::now(),
        attempts: 1,
    }
}

/// What a consumer should read back for `m`.
pub(crate) fn expected(m: &OutgoingMessage) -> Received {
    Received {
        message_id: m.message_id,
        topic: m.topic.clone(),
        key: m.key.clone(),
        payload: m.payload.to_vec(),
        headers: m
            .envelope_headers()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
    }
}

fn by_id(got: &[Received]) -> BTreeMap<Uuid, Vec<&Received>> {
    let mut map: BTreeMap<Uuid, Vec<&Received>> = BTreeMap::new();
    for r in got {
        map.entry(r.message_id).or_default().push(r);
    }
    map
}

/// Asserts `got` holds exactly one delivery of each of `sent`, each unchanged.
fn assert_exactly(got: &[Received], sent: &[&OutgoingMessage]) {
    let map = by_id(got);
    assert_eq!(
        got.len(),
        sent.len(),
        "read back {} messages, {} confirmed: {:?}",
        got.len(),
        sent.len(),
        map.keys().collect::<Vec<_>>()
    );
    for m in sent {
        let copies = map
            .get(&m.message_id)
            .unwrap_or_else(|| panic!("confirmed message {} was not delivered", m.message_id));
        assert_eq!(copies.len(), 1, "message {} delivered twice", m.message_id);
        let r = copies[0];
        let want = expected(m);
        assert_eq!(
            r.payload.len(),
            want.payload.len(),
            "payload length of {}",
            m.message_id
        );
        assert!(
            r.payload == want.payload,
            "payload bytes of {}",
            m.message_id
        );
        assert_eq!(r.topic, want.topic, "topic of {}", m.message_id);
        assert_eq!(r.key, want.key, "key of {}", m.message_id);
        assert_eq!(
            r.headers, want.headers,
            "envelope headers of {}",
            m.message_id
        );
    }
}

fn assert_permanent(r: &Result<(), PublishError>, what: &str) {
    match r {
        Err(e) => assert_eq!(e.kind, ErrorKind::Permanent, "{what}: {e}"),
        Ok(()) => panic!("{what}: Ok, expected a permanent error"),
    }
}

/// Case 1: Ok means confirmed, and what was confirmed arrives unchanged.
pub(crate) async fn confirmation_then_fidelity<H: Harness>() {
    let mut h = H::setup().await;
    let topic = h.topic("fidelity");
    let binary: Vec<u8> = (0..=255u8).chain([0, 0, 0xff]).collect();
    let big: Vec<u8> = (0..1024 * 1024).map(|i| (i * 7 % 251) as u8).collect();
    let mut batch = vec![
        outgoing(1, &topic, Some("order-42"), binary),
        outgoing(2, &topic, None, Vec::new()),
        outgoing(3, &topic, Some("k-ü ✓"), b"plain text".to_vec()),
        outgoing(4, &topic, None, big),
    ];
    batch[0]
        .headers
        .insert("correlation-id".into(), "req-7".into());
    batch[0]
        .headers
        .insert("causation-id".into(), Uuid::now_v7().to_string());
    batch[0]
        .headers
        .insert("content-type".into(), "application/x-protobuf".into());
    batch[1]
        .headers
        .insert("tenant".into(), "grüße ✓ 東京 Zoë".into());
    batch[2].headers.insert(
        "traceparent".into(),
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
    );
    batch[2]
        .headers
        .insert("note".into(), "100% sure, ä".into());
    let limit = h.size_limit().await;
    let big_fits = limit.is_none_or(|l| batch[3].size() + 1024 < l);
    let sink = h.sink().await;
    let started = Instant::now();
    let results = sink.publish_all(&batch).await;
    let took = started.elapsed();
    assert_eq!(results.len(), batch.len());
    for (m, r) in batch.iter().zip(&results).take(3) {
        assert!(r.is_ok(), "message {}: {r:?}", m.id);
    }
    let mut confirmed: Vec<&OutgoingMessage> = batch[..3].iter().collect();
    if big_fits {
        assert!(
            results[3].is_ok(),
            "1 MiB payload (limit {limit:?}): {:?}",
            results[3]
        );
        confirmed.push(&batch[3]);
    } else {
        assert_permanent(
            &results[3],
            &format!("1 MiB payload over the limit {limit:?}"),
        );
        assert_eq!(results[3].as_ref().unwrap_err().code, "too_large");
        // Refused before publishing: quickly, without a broker round trip timing out.
        assert!(took < Duration::from_secs(5), "{took:?}");
    }
    let got = h.read(confirmed.len()).await;
    assert_exactly(&got, &confirmed);
    sink.close().await;
    h.cleanup().await;
}

/// Case 2: a broker that is down fails no `connect` and makes every message unavailable,
/// as the relay sees it (through the router, which judges a sink's "timed out" against
/// what the destination confirmed: nothing, so unavailable).
pub(crate) async fn broker_down_is_unavailable<H: Harness>() {
    let sink: std::sync::Arc<dyn Sink> = H::down_sink()
        .await
        .expect("connect must not fail when the broker is down")
        .into();
    let batch: Vec<OutgoingMessage> = (0..3)
        .map(|i| outgoing(i, "outbox.down.v1", None, vec![i as u8]))
        .collect();
    let started = Instant::now();
    let router = outbox::sink::router::Router::single(sink.clone());
    let confirm = outbox::sink::Confirmations::new(batch.len());
    router
        .publish(&batch, &confirm, Duration::from_secs(14))
        .await;
    for i in 0..batch.len() {
        match confirm.get(i) {
            Some(Err(e)) => assert_eq!(e.kind, ErrorKind::Unavailable, "message {i}: {e}"),
            Some(Ok(())) => panic!("message {i} confirmed by a broker that is down"),
            None => panic!("message {i} has no outcome after the router returned"),
        }
    }
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    sink.close().await;
}

/// Case 3: a permanent error is permanent and does not fail the rest of the batch.
pub(crate) async fn permanent_error_spares_the_batch<H: Harness>() {
    let mut h = H::setup().await;
    let good = h.topic("good");
    let bad = h.permanent_topic().await;
    let batch = vec![
        outgoing(1, &good, None, b"one".to_vec()),
        outgoing(2, &bad, None, b"two".to_vec()),
        outgoing(3, &good, Some("k"), b"three".to_vec()),
    ];
    let sink = h.sink().await;
    let results = sink.publish_all(&batch).await;
    assert_eq!(results.len(), 3);
    assert!(results[0].is_ok(), "{results:?}");
    assert_permanent(&results[1], &format!("topic {bad:?}"));
    assert_eq!(
        results[1].as_ref().unwrap_err().code,
        H::PERMANENT_CODE,
        "the reason code says why, without reading the text"
    );
    assert!(results[2].is_ok(), "{results:?}");
    let got = h.read(2).await;
    assert_exactly(&got, &[&batch[0], &batch[2]]);
    // The sink is still good for the next batch.
    let next = [outgoing(4, &good, None, b"four".to_vec())];
    assert_eq!(sink.publish_all(&next).await, vec![Ok(())]);
    let got = h.read(3).await;
    assert_exactly(&got, &[&batch[0], &batch[2], &next[0]]);
    sink.close().await;
    h.cleanup().await;
}

/// Case 5: a relay (SQLite store, drain mode, batches of 64) delivers 200 messages with
/// keys and correlation ids through the sink: every one arrives once, unchanged, and every
/// row is dispatched at its first attempt.
pub(crate) async fn relay_delivers_200_messages_end_to_end<H: Harness>() {
    const N: usize = 200;
    let mut h = H::setup().await;
    let topic = h.topic("e2e");
    let db = crate::store::conformance_sqlite::SqliteBackend::create(
        "sqlite",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let msgs: Vec<outbox::Message> = (0..N)
        .map(|i| {
            outbox::Message::new(topic.as_str(), format!("payload-{i}").into_bytes())
                .key(format!("k{}", i % 5))
                .correlation_id(format!("req-{i}"))
        })
        .collect();
    db.enqueue_all(&msgs).await;
    let mut cfg = crate::common::relay_config("relay-e2e");
    cfg.drain = true;
    cfg.batch_size = 64;
    let stats = outbox::Relay::new(db.store(), h.sink().await.into(), cfg)
        .spawn()
        .wait()
        .await
        .unwrap();
    assert_eq!(stats.dispatched, N as u64, "{stats:?}");
    let got = h.read(N).await;
    let map = by_id(&got);
    assert_eq!(map.len(), N, "distinct message ids received");
    for (i, m) in msgs.iter().enumerate() {
        let copies = map
            .get(&m.id())
            .unwrap_or_else(|| panic!("message {} was not delivered", m.id()));
        assert_eq!(copies.len(), 1, "message {} delivered twice", m.id());
        let r = copies[0];
        assert_eq!(&r.payload[..], m.payload());
        assert_eq!(r.key, Some(format!("k{}", i % 5)));
        assert_eq!(r.headers.get("correlation-id"), Some(&format!("req-{i}")));
    }
    assert!(
        db.rows()
            .await
            .iter()
            .all(|r| r.status == 2 && r.attempts == 1)
    );
    h.cleanup().await;
}

/// Case 4: the relay crashed between confirmation and mark, so it publishes again.
pub(crate) async fn duplicate_publish_keeps_the_message_id<H: Harness>() {
    let mut h = H::setup().await;
    let topic = h.topic("dup");
    let m = outgoing(1, &topic, Some("k"), b"once".to_vec());
    let other = outgoing(2, &topic, None, b"other".to_vec());
    let sink = h.sink().await;
    assert_eq!(
        sink.publish_all(std::slice::from_ref(&m)).await,
        vec![Ok(())]
    );
    // Again, as a fresh attempt of the same row, with another message in the batch.
    let mut again = m.clone();
    again.attempts = 2;
    assert_eq!(
        sink.publish_all(&[again, other.clone()]).await,
        vec![Ok(()), Ok(())]
    );
    if H::DEDUPLICATES {
        let got = h.read(2).await;
        assert_exactly(&got, &[&m, &other]);
    } else {
        let got = h.read(3).await;
        assert_eq!(got.len(), 3, "{got:?}");
        let map = by_id(&got);
        let copies = &map[&m.message_id];
        assert_eq!(copies.len(), 2, "both copies, each with the message id");
        for c in copies {
            assert_eq!(c.headers.get("message-id"), Some(&m.message_id.to_string()));
            assert_eq!(c.payload, b"once");
        }
        assert_eq!(map[&other.message_id].len(), 1);
    }
    sink.close().await;
    h.cleanup().await;
}

/// One `#[tokio::test]` per case for the harness type `$h`; `$h, local` for a sink with no
/// broker (the file sink): without the broker-down and permanent-topic cases.
#[macro_export]
macro_rules! publisher_conformance_tests {
    ($h:ty) => {
        $crate::publisher_conformance_tests!($h, local);

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn broker_down_is_unavailable() {
            $crate::sink::publisher_conformance::broker_down_is_unavailable::<$h>().await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn permanent_error_spares_the_batch() {
            $crate::sink::publisher_conformance::permanent_error_spares_the_batch::<$h>().await;
        }
    };
    ($h:ty, local) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn confirmation_then_fidelity() {
            $crate::sink::publisher_conformance::confirmation_then_fidelity::<$h>().await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn relay_delivers_200_messages_end_to_end() {
            $crate::sink::publisher_conformance::relay_delivers_200_messages_end_to_end::<$h>()
                .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn duplicate_publish_keeps_the_message_id() {
            $crate::sink::publisher_conformance::duplicate_publish_keeps_the_message_id::<$h>()
                .await;
        }
    };
}

/// A harness's envelope (its const parameter): the outbox envelope.
pub(crate) const OUTBOX: u8 = 0;
/// CloudEvents as `envelope=cloudevents` selects it (binary mode; NATS: structured).
pub(crate) const CE: u8 = 1;
/// CloudEvents structured mode (`envelope=cloudevents-structured`).
pub(crate) const CE_STRUCTURED: u8 = 2;

/// `url` with the query parameters selecting the envelope `mode` (one of [`OUTBOX`],
/// [`CE`], [`CE_STRUCTURED`]); `prefix` is the sink's parameter prefix (`outbox_` for
/// webhooks).
pub(crate) fn with_envelope(url: &str, mode: u8, prefix: &str) -> String {
    let envelope = match mode {
        OUTBOX => return url.to_owned(),
        CE => "cloudevents",
        _ => "cloudevents-structured",
    };
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{prefix}envelope={envelope}&{prefix}ce_source=%2Fconformance%2Ftests")
}

/// Polls `read` until it holds at least `expected` items (panics after `timeout`), then
/// once more after `grace` to catch extras.
pub(crate) async fn poll_read<T, F, Fut>(
    expected: usize,
    timeout: Duration,
    grace: Duration,
    read: F,
) -> Vec<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Vec<T>>,
{
    let read = tokio::sync::Mutex::new(read);
    crate::common::wait_until(&format!("{expected} messages read"), timeout, || async {
        let next = (*read.lock().await)();
        let n = next.await.len();
        if n >= expected {
            Ok(())
        } else {
            Err(format!("{n}/{expected} read"))
        }
    })
    .await;
    tokio::time::sleep(grace).await;
    let mut read = read.into_inner();
    read().await
}

/// A local port nothing listens on.
pub(crate) fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

//! The RabbitMQ sink against the machine's RabbitMQ: `Ok` only after the publisher
//! confirm, with every byte and envelope header readable from the queue; unroutable
//! messages are permanent; a broker that cannot be reached (down at connect, missing
//! exchange) is unavailable and the sink recovers once it can; the relay delivers through
//! it end to end.
//!
//! Each test uses its own queue and exchange names (deleted afterwards, even on panic).
//! A RabbitMQ that is not running is a loud failure naming how to start it.

#![cfg(feature = "rabbitmq")]
#![allow(clippy::unwrap_used)]

use crate::common::{relay_config, unique};
use crate::sink::publisher_conformance::rabbitmq::{admin, amqp_url, header_text};
use crate::store::conformance::Backend as _;
use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox::sink::rabbitmq::RabbitMqSink;
use outbox::sink::{ErrorKind, Sink};
use outbox::{Message, OutgoingMessage, Relay};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Queues and exchanges of one test, deleted (best effort) when dropped.
#[derive(Default)]
struct Cleanup {
    queues: Vec<String>,
    exchanges: Vec<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let queues = std::mem::take(&mut self.queues);
        let exchanges = std::mem::take(&mut self.exchanges);
        crate::common::cleanup_blocking(async move {
            let Ok(Ok(conn)) = tokio::time::timeout(
                Duration::from_secs(3),
                Connection::connect(&amqp_url(), ConnectionProperties::default()),
            )
            .await
            else {
                return;
            };
            for q in queues {
                // A channel each: a failure closes the channel.
                if let Ok(ch) = conn.create_channel().await {
                    let _ = ch
                        .queue_delete(q.into(), QueueDeleteOptions::default())
                        .await;
                }
            }
            for x in exchanges {
                if let Ok(ch) = conn.create_channel().await {
                    let _ = ch
                        .exchange_delete(x.into(), ExchangeDeleteOptions::default())
                        .await;
                }
            }
            let _ = conn.close(200, "done".into()).await;
        });
    }
}

impl Cleanup {
    /// Declares a durable queue named `name`.
    async fn queue(&mut self, ch: &Channel, name: &str) {
        ch.queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        self.queues.push(name.to_owned());
    }

    /// Declares a direct exchange named `name`.
    async fn exchange(&mut self, ch: &Channel, name: &str) {
        ch.exchange_declare(
            name.into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        self.exchanges.push(name.to_owned());
    }
}

/// Messages in `queue` now.
async fn queue_len(ch: &Channel, queue: &str) -> u32 {
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap()
    .message_count()
}

fn outgoing(id: i64, topic: &str, payload: Vec<u8>) -> OutgoingMessage {
    crate::sink::publisher_conformance::outgoing(id, topic, None, payload)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_messages_arrive_byte_for_byte_with_the_envelope() {
    let (_conn, ch) = admin().await;
    let mut cleanup = Cleanup::default();
    let queue = format!("outbox.test.{}", unique());
    cleanup.queue(&ch, &queue).await;

    let binary: Vec<u8> = (0..=255u8).chain([0, 0xff, 0xfe]).collect();
    let big: Vec<u8> = (0..1024 * 1024).map(|i| (i * 7 % 251) as u8).collect();
    let mut batch = vec![
        outgoing(1, &queue, binary.clone()),
        outgoing(2, &queue, Vec::new()),
        outgoing(3, &queue, big.clone()),
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
    batch[2].headers.insert(
        "traceparent".into(),
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
    );

    let sink = RabbitMqSink::connect(&amqp_url()).await.unwrap();
    assert!(!sink.describe().contains("guest:"), "{}", sink.describe());
    let results = sink.publish_all(&batch).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    // Ok means confirmed: the broker holds every message by the time publish returns.
    assert_eq!(queue_len(&ch, &queue).await, 3);

    for sent in &batch {
        let got = ch
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .expect("a message in the queue");
        let d = &got.delivery;
        let p = &d.properties;
        assert_eq!(
            d.data,
            sent.payload.as_ref(),
            "payload of message {}",
            sent.id
        );
        assert_eq!(d.routing_key.as_str(), queue);
        assert_eq!(
            p.message_id().as_ref().map(|s| s.as_str().to_owned()),
            Some(sent.message_id.to_string())
        );
        assert_eq!(*p.delivery_mode(), Some(2), "persistent");
        assert_eq!(
            *p.timestamp(),
            Some(u64::try_from(sent.occurred_at.timestamp()).unwrap())
        );
        let h = p.headers().as_ref().expect("headers table");
        for (name, value) in sent.envelope_headers() {
            assert_eq!(
                header_text(h, name).as_deref(),
                Some(value.as_str()),
                "header {name}"
            );
        }
        assert_eq!(
            header_text(h, "message-id"),
            Some(sent.message_id.to_string())
        );
        assert_eq!(header_text(h, "topic").as_deref(), Some(queue.as_str()));
        assert_eq!(
            header_text(h, "key"),
            sent.key.clone(),
            "key header only when the message has a key"
        );
        assert!(header_text(h, "occurred-at").unwrap().ends_with('Z'));
        assert_eq!(
            p.content_type().as_ref().map(|s| s.as_str().to_owned()),
            sent.headers.get("content-type").cloned()
        );
    }
    assert_eq!(queue_len(&ch, &queue).await, 0);
    sink.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_messages_are_permanent_and_the_rest_go_through() {
    let (_conn, ch) = admin().await;
    let mut cleanup = Cleanup::default();
    let u = unique();
    let exchange = format!("outbox.test.x.{u}");
    let queue = format!("outbox.test.q.{u}");
    let bound = format!("orders.placed.{u}");
    let unbound = format!("orders.nobody-listens.{u}");
    cleanup.exchange(&ch, &exchange).await;
    cleanup.queue(&ch, &queue).await;
    ch.queue_bind(
        queue.as_str().into(),
        exchange.as_str().into(),
        bound.as_str().into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();

    let sink = RabbitMqSink::connect(&format!("{}?exchange={exchange}", amqp_url()))
        .await
        .unwrap();
    assert!(sink.describe().contains(&exchange), "{}", sink.describe());
    let batch = vec![
        outgoing(1, &bound, b"one".to_vec()),
        outgoing(2, &unbound, b"two".to_vec()),
        outgoing(3, &bound, b"three".to_vec()),
    ];
    let results = sink.publish_all(&batch).await;
    assert!(results[0].is_ok(), "{results:?}");
    assert!(results[2].is_ok(), "{results:?}");
    let e = results[1].as_ref().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Permanent, "{e}");
    assert!(
        e.message
            .starts_with("unroutable: no queue bound for routing key"),
        "{e}"
    );
    assert!(e.message.contains(&unbound), "{e}");
    assert_eq!(queue_len(&ch, &queue).await, 2);

    // The default exchange: no queue is named like the topic.
    let sink = RabbitMqSink::connect(&amqp_url()).await.unwrap();
    let results = sink
        .publish_all(&[outgoing(4, &format!("no.such.queue.{u}"), b"x".to_vec())])
        .await;
    assert_eq!(results[0].as_ref().unwrap_err().kind, ErrorKind::Permanent);
    // The channel survives a return: the next batch goes through on the same link.
    let results = sink
        .publish_all(&[outgoing(5, &queue, b"y".to_vec())])
        .await;
    assert!(results[0].is_ok(), "{results:?}");
    assert_eq!(queue_len(&ch, &queue).await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_batches_keep_each_outcome_with_its_message() {
    let (_conn, ch) = admin().await;
    let mut cleanup = Cleanup::default();
    let u = unique();
    let queue = format!("outbox.test.{u}");
    cleanup.queue(&ch, &queue).await;
    let unroutable = format!("no.such.queue.{u}");

    // Four batches at once on one sink (one channel); every third message is unroutable.
    let sink = Arc::new(RabbitMqSink::connect(&amqp_url()).await.unwrap());
    let tasks: Vec<_> = (0..4i64)
        .map(|b| {
            let sink = sink.clone();
            let batch: Vec<OutgoingMessage> = (0..300i64)
                .map(|i| {
                    let topic = if i % 3 == 0 { &unroutable } else { &queue };
                    outgoing(b * 1000 + i, topic, format!("{b}-{i}").into_bytes())
                })
                .collect();
            tokio::spawn(async move {
                let results = sink.publish_all(&batch).await;
                (batch, results)
            })
        })
        .collect();
    let mut routed = 0;
    for t in tasks {
        let (batch, results) = t.await.unwrap();
        for (m, r) in batch.iter().zip(&results) {
            if m.topic == unroutable {
                let e = r.as_ref().unwrap_err();
                assert_eq!(e.kind, ErrorKind::Permanent, "message {}: {e}", m.id);
            } else {
                assert!(r.is_ok(), "message {}: {r:?}", m.id);
                routed += 1;
            }
        }
    }
    assert_eq!(routed, 800);
    assert_eq!(queue_len(&ch, &queue).await, 800);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_down_is_unavailable_and_connect_still_succeeds() {
    // Nothing listens on port 1: the broker is "down". A refused connection fails at
    // once; on a loaded machine the attempt can stall, and then the connection timeout
    // (2 s here) is what bounds it.
    let started = Instant::now();
    let sink = RabbitMqSink::connect("amqp://guest:guest@127.0.0.1:1/%2f?connection_timeout=2000")
        .await
        .expect("a broker that is down must not fail connect");
    let batch: Vec<OutgoingMessage> = (0..3).map(|i| outgoing(i, "t.down.v1", vec![1])).collect();
    let results = sink.publish_all(&batch).await;
    assert_eq!(results.len(), 3);
    for r in &results {
        let e = r.as_ref().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
        assert!(e.message.contains("127.0.0.1:1"), "{e}");
        assert!(
            !e.message.contains("guest:guest"),
            "no credentials in errors: {e}"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    sink.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_exchange_is_unavailable_until_it_exists() {
    let (_conn, ch) = admin().await;
    let mut cleanup = Cleanup::default();
    let u = unique();
    let exchange = format!("outbox.test.x.{u}");
    let queue = format!("outbox.test.q.{u}");
    cleanup.queue(&ch, &queue).await;

    // The exchange does not exist yet: connect succeeds, publishes are unavailable.
    let sink = RabbitMqSink::connect(&format!("{}?exchange={exchange}", amqp_url()))
        .await
        .unwrap();
    let results = sink.publish_all(&[outgoing(1, "k", b"a".to_vec())]).await;
    let e = results[0].as_ref().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
    assert!(e.message.contains(&exchange), "{e}");

    // Created and bound: the next batch reconnects and goes through.
    cleanup.exchange(&ch, &exchange).await;
    ch.queue_bind(
        queue.as_str().into(),
        exchange.as_str().into(),
        "k".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let results = sink.publish_all(&[outgoing(2, "k", b"b".to_vec())]).await;
    assert!(results[0].is_ok(), "{results:?}");

    // Deleted under a live link: the broker closes the channel (404), the batch is
    // unavailable, and the sink reconnects once the exchange is back.
    ch.exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    let results = sink.publish_all(&[outgoing(3, "k", b"c".to_vec())]).await;
    let e = results[0].as_ref().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
    cleanup.exchange(&ch, &exchange).await;
    ch.queue_bind(
        queue.as_str().into(),
        exchange.as_str().into(),
        "k".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let results = sink.publish_all(&[outgoing(4, "k", b"d".to_vec())]).await;
    assert!(results[0].is_ok(), "{results:?}");
    assert_eq!(queue_len(&ch, &queue).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_messages_are_permanent_without_being_sent() {
    let (_conn, ch) = admin().await;
    let mut cleanup = Cleanup::default();
    let queue = format!("outbox.test.{}", unique());
    cleanup.queue(&ch, &queue).await;

    let sink = RabbitMqSink::connect(&format!("{}?max_message_bytes=1000", amqp_url()))
        .await
        .unwrap();
    let mut batch = vec![
        outgoing(1, &queue, vec![7; 100]),
        outgoing(2, &queue, vec![7; 1000]),
        outgoing(3, &queue, vec![7; 100]),
        outgoing(4, &queue, vec![7; 10]),
    ];
    // Headers count too; and headers larger than one AMQP frame (128 KiB) cannot be sent.
    batch[3].headers.insert("h".into(), "v".repeat(995));
    let results = sink.publish_all(&batch).await;
    assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
    for i in [1, 3] {
        let e = results[i].as_ref().unwrap_err();
        assert_eq!(e.kind, ErrorKind::Permanent, "{e}");
        assert!(
            e.message
                .contains("exceeds the RabbitMQ limit of 1000 bytes"),
            "{e}"
        );
    }
    let sink = RabbitMqSink::connect(&amqp_url()).await.unwrap();
    let mut huge = outgoing(5, &queue, Vec::new());
    huge.headers.insert("h".into(), "v".repeat(200 * 1024));
    let results = sink
        .publish_all(&[huge, outgoing(6, &queue, b"ok".to_vec())])
        .await;
    let e = results[0].as_ref().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Permanent, "{e}");
    assert!(e.message.contains("frame_max"), "{e}");
    assert!(results[1].is_ok(), "{results:?}");
    assert_eq!(queue_len(&ch, &queue).await, 3);
}

/// An unroutable message is quarantined at once (no queue is bound); once the operator
/// binds one and replays the dead row, the relay delivers it with the same message id, and
/// the replay is audited.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unroutable_then_bound_then_replayed_is_delivered() {
    let (_conn, ch) = admin().await;
    let mut cleanup = Cleanup::default();
    let u = unique();
    let exchange = format!("outbox.test.x.{u}");
    let queue = format!("outbox.test.q.{u}");
    let topic = format!("billing.invoice.v1.{u}");
    cleanup.exchange(&ch, &exchange).await;
    cleanup.queue(&ch, &queue).await;

    let db = crate::store::conformance_sqlite::SqliteBackend::create(
        "sqlite",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let store = db.store();
    let enq = db
        .enqueue_all(&[Message::new(topic.as_str(), b"invoice-1".to_vec())])
        .await;
    let url = format!("{}?exchange={exchange}", amqp_url());
    let mut cfg = relay_config("relay-replay");
    cfg.drain = true;
    let stats = Relay::new(
        store.clone(),
        Arc::new(RabbitMqSink::connect(&url).await.unwrap()),
        cfg.clone(),
    )
    .spawn()
    .wait()
    .await
    .unwrap();
    assert_eq!((stats.dispatched, stats.quarantined), (0, 1), "{stats:?}");
    let dead = store
        .dead_letters(&outbox::store::DeadSelector::default(), 10, false)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message_id, enq[0].message_id);
    let error = dead[0].last_error.clone().unwrap();
    assert!(error.contains("unroutable"), "{error}");

    // The operator restores the binding and replays the dead row.
    ch.queue_bind(
        queue.as_str().into(),
        exchange.as_str().into(),
        topic.as_str().into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let replay = store
        .replay(&outbox::store::ReplayRequest {
            selector: outbox::store::DeadSelector {
                ids: vec![dead[0].id],
                ..outbox::store::DeadSelector::default()
            },
            action: outbox::store::ReplayAction::Replay,
            limit: None,
            by: "ops".into(),
            reason: "binding restored".into(),
            rate_per_s: None,
            dry_run: false,
            append_to: None,
        })
        .await
        .unwrap();
    assert_eq!(replay.count, 1);
    let stats = Relay::new(
        store.clone(),
        Arc::new(RabbitMqSink::connect(&url).await.unwrap()),
        cfg,
    )
    .spawn()
    .wait()
    .await
    .unwrap();
    assert_eq!((stats.dispatched, stats.quarantined), (1, 0), "{stats:?}");
    let got = ch
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("the replayed message is in the queue");
    assert_eq!(
        got.delivery
            .properties
            .message_id()
            .as_ref()
            .unwrap()
            .as_str(),
        enq[0].message_id.to_string()
    );
    assert_eq!(got.delivery.data, b"invoice-1");
    let audit = store.replays(10).await.unwrap();
    assert_eq!(audit.len(), 1);
    assert_eq!(
        (audit[0].count, audit[0].reason.as_str()),
        (1, "binding restored")
    );
}

/// A quorum queue adds `x-delivery-count` (a number) and dead-lettering adds `x-death` (a
/// list) and `x-first-death-*`: the decoder reads those deliveries like the first one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivered_and_dead_lettered_deliveries_decode_like_the_first() {
    use lapin::options::{BasicGetOptions, BasicNackOptions, BasicRejectOptions};
    use lapin::types::{AMQPValue, ShortString};
    let (_conn, ch) = admin().await;
    let mut cleanup = Cleanup::default();
    let u = unique();
    let (dlq, main, quorum) = (
        format!("outbox.test.dlq.{u}"),
        format!("outbox.test.main.{u}"),
        format!("outbox.test.quorum.{u}"),
    );
    let declare = |name: String, args: FieldTable, durable: bool| {
        let ch = ch.clone();
        async move {
            ch.queue_declare(
                name.as_str().into(),
                QueueDeclareOptions {
                    durable,
                    ..QueueDeclareOptions::default()
                },
                args,
            )
            .await
            .unwrap();
        }
    };
    declare(dlq.clone(), FieldTable::default(), false).await;
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-dead-letter-exchange"),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        ShortString::from("x-dead-letter-routing-key"),
        AMQPValue::LongString(dlq.as_str().into()),
    );
    declare(main.clone(), args, false).await;
    let mut qargs = FieldTable::default();
    qargs.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString("quorum".into()),
    );
    declare(quorum.clone(), qargs, true).await;
    cleanup
        .queues
        .extend([dlq.clone(), main.clone(), quorum.clone()]);

    let mut a = outgoing(1, &main, b"{}".to_vec());
    let mut b = outgoing(2, &quorum, vec![0, 255]);
    for m in [&mut a, &mut b] {
        m.key = Some("k".into());
        m.headers.insert("tenant".into(), "grüße".into());
    }
    let sink = RabbitMqSink::connect(&amqp_url()).await.unwrap();
    let r = sink.publish_all(&[a.clone(), b.clone()]).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    let get = |queue: String, no_ack: bool| {
        let ch = ch.clone();
        async move {
            let slot = std::sync::Mutex::new(None);
            let (ch, q, s) = (&ch, queue.as_str(), &slot);
            crate::common::wait_until(
                &format!("a message in {queue}"),
                Duration::from_secs(5),
                || async move {
                    match ch
                        .basic_get(q.into(), BasicGetOptions { no_ack })
                        .await
                        .unwrap()
                    {
                        Some(m) => {
                            *s.lock().unwrap() = Some(m);
                            Ok(())
                        }
                        None => Err(format!("nothing in {q}")),
                    }
                },
            )
            .await;
            slot.into_inner().unwrap().unwrap()
        }
    };
    let same = |m: &OutgoingMessage, e: outbox::Envelope| {
        assert_eq!(e.message_id, m.message_id);
        assert_eq!(e.key, m.key);
        assert_eq!(e.headers, m.headers, "only the envelope's headers");
        assert_eq!(&e.payload[..], &m.payload[..]);
    };

    // Dead-lettered: x-death, x-first-death-queue/-reason/-exchange (RabbitMQ 3.13+ also
    // x-last-death-*).
    let first = get(main.clone(), false).await;
    same(&a, outbox::envelope::from_amqp(&first.delivery).unwrap());
    first
        .delivery
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    let dead = get(dlq.clone(), true).await;
    let table = dead.delivery.properties.headers().clone().unwrap();
    assert!(table.inner().contains_key("x-death"), "{table:?}");
    same(&a, outbox::envelope::from_amqp(&dead.delivery).unwrap());

    // A quorum queue: x-delivery-count, on the redelivery at least.
    let q1 = get(quorum.clone(), false).await;
    same(&b, outbox::envelope::from_amqp(&q1.delivery).unwrap());
    q1.delivery
        .nack(BasicNackOptions {
            requeue: true,
            multiple: false,
        })
        .await
        .unwrap();
    let q2 = get(quorum.clone(), true).await;
    assert!(q2.delivery.redelivered);
    let table = q2.delivery.properties.headers().clone().unwrap();
    assert!(table.inner().contains_key("x-delivery-count"), "{table:?}");
    same(&b, outbox::envelope::from_amqp(&q2.delivery).unwrap());
    sink.close().await;
}

//! The whole chain, end to end: producer transactions (PostgreSQL) → relay → NATS
//! JetStream → the example consumer (`examples/nats_consumer.rs`, compiled in as a module,
//! so this runs exactly the code users copy) with its inbox → a follow-up message through
//! the outbox → relay → NATS.
//!
//! The first relay is killed between the broker's confirmation and its mark, and the
//! orders stream's duplicate window is shorter than the lease, so the second relay's
//! re-publish is stored as a second copy: the consumer really receives every order twice.
//! Business effects must still equal committed orders, and follow-ups too.

#![allow(clippy::unwrap_used)]

#[path = "../../../examples/nats_consumer.rs"]
#[allow(dead_code, unreachable_pub, missing_docs)]
mod consumer;

use crate::common::{TestStream, nats_connect, nats_url, pg_store, relay_config, unique};
use outbox::{Message, Relay, Store};
use sqlx::AssertSqlSafe;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

const ORDERS: usize = 40;
const ROLLED_BACK: usize = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn orders_to_invoices_once_each_through_a_relay_crash_and_redeliveries() {
    let client = nats_connect().await;
    let storage = async_nats::jetstream::stream::StorageType::Memory;
    // Orders: a duplicate window far shorter than the first relay's lease.
    let orders =
        TestStream::create_with(&client, &nats_url(), storage, Duration::from_millis(100)).await;
    let invoices = TestStream::shared(&client).await;
    let (store, schema) = pg_store("e2e").await;
    let s = &schema.name;
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {s}.orders (id text PRIMARY KEY, amount_cents bigint NOT NULL)"
    )))
    .execute(store.pool())
    .await
    .unwrap();

    // Producer: each order and its message in one transaction; some roll back.
    let topic = orders.subject("placed");
    let mut committed: BTreeMap<Uuid, String> = BTreeMap::new();
    for i in 0..ORDERS + ROLLED_BACK {
        let order_id = format!("order-{i}");
        let mut tx = store.pool().begin().await.unwrap();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.orders (id, amount_cents) VALUES ($1, $2)"
        )))
        .bind(&order_id)
        .bind(100 + i as i64)
        .execute(&mut *tx)
        .await
        .unwrap();
        let msg = Message::json(
            &topic,
            &serde_json::json!({ "order_id": order_id, "amount_cents": 100 + i as i64 }),
        )
        .unwrap()
        .key(order_id.clone())
        .correlation_id(format!("req-{i}"));
        let e = store.enqueue(&mut tx, &msg).await.unwrap();
        if i % 5 == 4 {
            tx.rollback().await.unwrap();
        } else {
            tx.commit().await.unwrap();
            committed.insert(e.message_id, order_id);
        }
    }
    assert_eq!(committed.len(), ORDERS);
    let pg = store.clone();
    let store: Arc<dyn Store> = Arc::new(store);

    // Relay 1 publishes every order, gets every PubAck, and is killed before marking.
    let mut cfg = relay_config("relay-killed");
    cfg.lease = Duration::from_secs(2);
    cfg.publish_timeout = Duration::from_millis(1500);
    let results = crate::common::relay_killed_after_confirmation(&store, cfg).await;
    assert_eq!(results.len(), ORDERS);

    // The consumer, as users run it.
    let durable = format!("billing{}", unique());
    let ccfg = consumer::Config {
        database_url: crate::common::pg_url(),
        schema: s.clone(),
        nats_url: nats_url(),
        stream: orders.name.clone(),
        subjects: format!("{}.>", orders.prefix),
        durable: durable.clone(),
        follow_up_topic: invoices.subject("invoice-requested"),
        follow_up_stream: invoices.name.clone(),
        follow_up_subjects: format!("{}.>", invoices.prefix),
    };
    // Two copies on one durable, as a scaled-out consumer runs: the two stored copies of an
    // order can be in flight at both at once.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running: Vec<_> = (0..2)
        .map(|_| {
            let mut stopped = stopped.clone();
            tokio::spawn(consumer::run(ccfg.clone(), async move {
                let _ = stopped.wait_for(|s| *s).await;
            }))
        })
        .collect();
    // Poison, which must be terminated, not retried: not an outbox envelope; an envelope
    // whose payload is not an order; an order the database refuses (NUL in text).
    let js = async_nats::jetstream::new(client.clone());
    let poison = poison(&orders.subject("placed"));
    for (headers, payload) in &poison {
        js.publish_with_headers(orders.subject("placed"), headers.clone(), payload.clone())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    // Relay 2 takes the orders over after the lease, publishes them again (stored twice),
    // and then relays the consumer's follow-ups.
    crate::common::wait_until("relay 1's leases ended", Duration::from_secs(10), || {
        let store = store.clone();
        async move {
            match store.overview(0).await.unwrap().expired_claims {
                n if n == ORDERS as i64 => Ok(()),
                n => Err(format!("{n} expired claims")),
            }
        }
    })
    .await;
    let second = Relay::new(
        store.clone(),
        Arc::new(crate::common::nats_sink().await),
        relay_config("relay-2"),
    )
    .spawn();
    let want = (2 * ORDERS) as i64;
    let st = store.clone();
    crate::common::wait_dispatched(
        "orders and follow-ups dispatched",
        &st,
        usize::try_from(want).unwrap(),
        Duration::from_secs(30),
    )
    .await;

    // Every delivery handled and acknowledged or terminated: 2 × ORDERS (the re-publish is
    // stored) and the poison.
    let stored = (2 * ORDERS + poison.len()) as u64;
    let stream = js.get_stream(&orders.name).await.unwrap();
    crate::common::wait_until("consumer caught up", Duration::from_secs(20), || {
        let stream = stream.clone();
        let durable = durable.clone();
        async move {
            let mut c: async_nats::jetstream::consumer::PullConsumer = stream
                .get_consumer(&durable)
                .await
                .map_err(|e| e.to_string())?;
            let info = c.info().await.map_err(|e| e.to_string())?;
            if info.ack_floor.stream_sequence >= stored && info.num_ack_pending == 0 {
                Ok(())
            } else {
                Err(format!(
                    "ack floor {} pending {}",
                    info.ack_floor.stream_sequence, info.num_ack_pending
                ))
            }
        }
    })
    .await;
    assert_eq!(
        orders.message_count(&client).await,
        stored,
        "the re-publish after the kill is a second stored copy"
    );
    // Poison was terminated at its first delivery, never redelivered.
    let mut c: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer(&durable).await.unwrap();
    let info = c.info().await.unwrap();
    assert_eq!(info.num_redelivered, 0, "{info:?}");
    assert_eq!(info.delivered.consumer_sequence, stored, "{info:?}");
    stop.send(true).unwrap();
    let mut fresh = 0;
    for r in running {
        fresh += r.await.unwrap().unwrap();
    }
    second.shutdown().await.unwrap();
    assert_eq!(fresh, ORDERS as u64, "fresh handlings over both copies");

    // One invoice per committed order, none for a rolled-back one.
    let rows: Vec<(Uuid, String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT order_message_id, order_id, count(*) FROM {s}.invoices GROUP BY 1, 2"
    )))
    .fetch_all(pg.pool())
    .await
    .unwrap();
    let got: BTreeMap<Uuid, String> = rows
        .iter()
        .map(|(id, order, n)| {
            assert_eq!(*n, 1, "order {order} invoiced {n} times");
            (*id, order.clone())
        })
        .collect();
    assert_eq!(got, committed, "invoices = committed orders");

    // One follow-up per committed order, with the derived id, on the broker once each.
    let follow_ups: Vec<(Uuid, serde_json::Value)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT message_id, headers FROM {s}.messages WHERE topic = $1"
    )))
    .bind(invoices.subject("invoice-requested"))
    .fetch_all(pg.pool())
    .await
    .unwrap();
    let ids: HashSet<Uuid> = follow_ups.iter().map(|(id, _)| *id).collect();
    let expected: HashSet<Uuid> = committed
        .keys()
        .map(|id| outbox::follow_up_id(*id, &invoices.subject("invoice-requested")))
        .collect();
    assert_eq!(
        ids, expected,
        "follow-up ids derive from the order message ids"
    );
    for (_, headers) in &follow_ups {
        let cause = Uuid::parse_str(headers["causation-id"].as_str().unwrap()).unwrap();
        assert!(committed.contains_key(&cause), "causation id {cause}");
        assert!(
            headers["correlation-id"]
                .as_str()
                .unwrap()
                .starts_with("req-")
        );
    }
    let on_wire: HashSet<String> = invoices.msg_ids(&client).await.into_iter().collect();
    assert_eq!(on_wire.len(), ORDERS);
    assert_eq!(
        on_wire,
        expected.iter().map(Uuid::to_string).collect::<HashSet<_>>()
    );
}

/// Three deliveries the consumer can never handle.
fn poison(subject: &str) -> Vec<(async_nats::HeaderMap, bytes::Bytes)> {
    let envelope = |payload: &[u8]| {
        let mut h = async_nats::HeaderMap::new();
        h.insert("message-id", Uuid::now_v7().to_string().as_str());
        h.insert("topic", subject);
        h.insert("occurred-at", "2026-12-01T00:00:00.000000Z");
        (h, bytes::Bytes::copy_from_slice(payload))
    };
    let mut foreign = async_nats::HeaderMap::new();
    foreign.insert("tenant", "acme");
    vec![
        (foreign, bytes::Bytes::from_static(b"{}")),
        envelope(b"not json"),
        envelope(br#"{"order_id": "nul\u0000inside", "amount_cents": 1}"#),
    ]
}

//! Per-key ordering through whole relays: two relays with four batches in flight keep
//! every key's order into JetStream; a transient failure holds back only its own key; a
//! dead letter blocks its key until it is replayed (delivered first) or discarded (the
//! rest follows, audited).

#![allow(clippy::unwrap_used)]

use crate::common::{TestStream, nats_connect, nats_url, relay_config, wait_until};
use crate::sink::sink_http::{Reply, TestServer, webhook};
use crate::store::conformance::Backend as _;
use crate::store::conformance_postgres::PgBackend;
use outbox::sink::nats::{NatsOptions, NatsSink};
use outbox::sink::router::TopicPattern;
use outbox::store::prelude::*;
use outbox::store::{ClaimRequest, KeyOrdering, ReplayAction};
use outbox::{Message, Relay, RelayConfig};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub(crate) fn ordered(pattern: &str) -> KeyOrdering {
    KeyOrdering {
        topics: vec![TopicPattern::parse(pattern).unwrap()],
        skip_dead: false,
    }
}

/// A claim by hand of up to `batch_size` rows, strict ordering on `o.>`, a 30 s lease.
fn ordered_claim(relay_id: &str, batch_size: u32) -> ClaimRequest {
    ClaimRequest {
        relay_id: relay_id.into(),
        batch_size,
        lease: Duration::from_secs(30),
        skip_topics: Vec::new(),
        ordering: ordered("o.>"),
    }
}

/// `key:seq` payloads of `per_key` messages for each of `keys` keys, interleaved
/// (k0:0, k1:0, …, k0:1, …).
fn interleaved(topic: &str, keys: usize, per_key: usize) -> Vec<Message> {
    (0..per_key)
        .flat_map(|seq| {
            (0..keys).map(move |k| {
                Message::new(topic, format!("k{k}:{seq}").into_bytes()).key(format!("k{k}"))
            })
        })
        .collect()
}

/// `key:seq` → (key, seq).
fn parse(body: &[u8]) -> (String, u32) {
    let text = std::str::from_utf8(body).unwrap();
    let (k, seq) = text.split_once(':').unwrap();
    (k.to_owned(), seq.parse().unwrap())
}

/// Per key, the sequence numbers in the order they arrived.
fn by_key<'a>(bodies: impl IntoIterator<Item = &'a [u8]>) -> BTreeMap<String, Vec<u32>> {
    let mut map: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for b in bodies {
        let (k, seq) = parse(b);
        map.entry(k).or_default().push(seq);
    }
    map
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_keep_every_keys_order_into_jetstream() {
    const KEYS: usize = 50;
    const PER_KEY: usize = 200;
    let db = PgBackend::create("ordered_nats", crate::store::conformance::DEFAULT_MAX).await;
    let client = nats_connect().await;
    let stream = TestStream::shared(&client).await;
    let topic = stream.subject("orders.placed");
    let relays: Vec<_> = (0..2)
        .map(|i| {
            let cfg = RelayConfig {
                batch_size: 200,
                min_batch_size: 20,
                in_flight_batches: 4,
                ordering: ordered(&format!("{}.>", stream.prefix)),
                ..relay_config(&format!("ordered-{i}"))
            };
            (cfg, db.store())
        })
        .collect();
    let mut handles = Vec::new();
    for (cfg, store) in relays {
        let sink = NatsSink::connect(&nats_url(), NatsOptions::default())
            .await
            .unwrap();
        handles.push(Relay::new(store, Arc::new(sink), cfg).spawn());
    }
    // 100 producer transactions of 100 messages while the relays run.
    for chunk in interleaved(&topic, KEYS, PER_KEY).chunks(100) {
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
    let mut per_relay = Vec::new();
    for h in handles {
        per_relay.push(h.shutdown().await.unwrap().dispatched);
    }
    assert_eq!(
        per_relay.iter().sum::<u64>(),
        (KEYS * PER_KEY) as u64,
        "each published once"
    );
    assert!(
        per_relay.iter().all(|n| *n > 0),
        "both relays delivered: {per_relay:?}"
    );

    assert_eq!(stream.message_count(&client).await, (KEYS * PER_KEY) as u64);
    let bodies = stream_payloads(&client, &stream, KEYS * PER_KEY).await;
    let seen = by_key(bodies.iter().map(Vec::as_slice));
    assert_eq!(seen.len(), KEYS);
    let want: Vec<u32> = (0..PER_KEY as u32).collect();
    for (k, seqs) in &seen {
        assert_eq!(seqs, &want, "key {k} arrived out of order");
    }
}

/// Relays crash (their tasks aborted mid-batch: no release, no mark) and are replaced three
/// times while 5,000 messages over 50 keys flow; a crashed relay's claims come back after
/// their 1 s lease. JetStream's duplicate window drops the messages published again, so
/// the stream holds each message once, in the order first accepted: per key, id order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crashed_relays_keep_every_keys_order() {
    const KEYS: usize = 50;
    const PER_KEY: usize = 100;
    let db = PgBackend::create("ordered_crash", crate::store::conformance::DEFAULT_MAX).await;
    let client = nats_connect().await;
    let stream = TestStream::shared(&client).await;
    let topic = stream.subject("orders.placed");
    let ordering = ordered(&format!("{}.>", stream.prefix));
    let spawn = |i: usize| {
        let cfg = RelayConfig {
            batch_size: 100,
            min_batch_size: 20,
            in_flight_batches: 4,
            lease: Duration::from_secs(1),
            ordering: ordering.clone(),
            ..relay_config(&format!("crashing-{i}"))
        };
        let store = db.store();
        async move {
            let sink = NatsSink::connect(&nats_url(), NatsOptions::default())
                .await
                .unwrap();
            Relay::new(store, Arc::new(sink), cfg).spawn()
        }
    };
    let mut relays = vec![spawn(0).await, spawn(1).await];
    let messages = interleaved(&topic, KEYS, PER_KEY);
    let mut next = 2;
    for (i, chunk) in messages.chunks(100).enumerate() {
        db.enqueue_all(chunk).await;
        if i % 12 == 11 && next < 5 {
            // One relay crashes mid-run and a new one starts.
            relays.remove(0).abort();
            relays.push(spawn(next).await);
            next += 1;
        }
    }
    let store = db.store();
    crate::common::wait_dispatched(
        "5,000 dispatched",
        &store,
        KEYS * PER_KEY,
        Duration::from_secs(120),
    )
    .await;
    for h in relays {
        h.shutdown().await.unwrap();
    }
    assert_eq!(next, 5, "three crashes");
    assert_eq!(stream.message_count(&client).await, (KEYS * PER_KEY) as u64);
    let bodies = stream_payloads(&client, &stream, KEYS * PER_KEY).await;
    let seen = by_key(bodies.iter().map(Vec::as_slice));
    let want: Vec<u32> = (0..PER_KEY as u32).collect();
    for (k, seqs) in &seen {
        assert_eq!(seqs, &want, "key {k} arrived out of order");
    }
}

/// The first `n` payloads of `stream`, in stream order (an ephemeral pull consumer).
async fn stream_payloads(
    client: &async_nats::Client,
    stream: &TestStream,
    n: usize,
) -> Vec<Vec<u8>> {
    use futures::StreamExt as _;
    let js = async_nats::jetstream::new(client.clone());
    let s = js.get_stream(&stream.name).await.unwrap();
    let consumer = s
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let m = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("the stream's messages")
            .unwrap()
            .unwrap();
        out.push(m.payload.to_vec());
    }
    out
}

/// The relay settings of the HTTP cases: one relay, everything in one claim, a retry
/// 1 s after a failure.
fn http_config(id: &str) -> RelayConfig {
    RelayConfig {
        batch_size: 100,
        min_batch_size: 100,
        backoff_base: Duration::from_secs(1),
        backoff_max: Duration::from_secs(1),
        ordering: ordered("o.>"),
        ..relay_config(id)
    }
}

/// What the test server answered, in arrival order: (key, seq, status, when).
type Answers = Arc<std::sync::Mutex<Vec<(String, u32, u16, Instant)>>>;

/// A server answering `status(body)` and logging each answer.
async fn answering(status: impl Fn(&[u8]) -> u16 + Send + Sync + 'static) -> (TestServer, Answers) {
    let answers: Answers = Arc::default();
    let log = answers.clone();
    let server = TestServer::start(move |r, _| {
        let code = status(&r.body);
        let (k, seq) = parse(&r.body);
        log.lock().unwrap().push((k, seq, code, r.at));
        Reply::status(code)
    })
    .await;
    (server, answers)
}

/// Per key, the sequence numbers accepted (200), in arrival order.
fn accepted(answers: &Answers) -> BTreeMap<String, Vec<u32>> {
    let mut map: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for (k, seq, code, _) in answers.lock().unwrap().iter() {
        if *code == 200 {
            map.entry(k.clone()).or_default().push(*seq);
        }
    }
    map
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_failure_holds_back_only_its_own_key() {
    let db = PgBackend::create("ordered_retry", crate::store::conformance::DEFAULT_MAX).await;
    // k0:3 fails once (500); everything else is accepted.
    let failed_once = Arc::new(AtomicBool::new(false));
    let f = failed_once.clone();
    let (server, answers) = answering(move |body| {
        if body == b"k0:3" && !f.swap(true, Ordering::SeqCst) {
            500
        } else {
            200
        }
    })
    .await;
    db.enqueue_all(&interleaved("o.t", 2, 10)).await;
    let sink = webhook(&server.url).await;
    let handle = Relay::new(db.store(), Arc::new(sink), http_config("retry")).spawn();
    let store = db.store();
    crate::common::wait_dispatched("20 dispatched", &store, 20, Duration::from_secs(20)).await;
    handle.shutdown().await.unwrap();

    let seen = accepted(&answers);
    assert_eq!(
        seen["k0"],
        (0..10).collect::<Vec<_>>(),
        "k0's later messages came after its retry"
    );
    assert_eq!(seen["k1"], (0..10).collect::<Vec<_>>());
    let log = answers.lock().unwrap().clone();
    assert_eq!(
        log.len(),
        21,
        "one failed attempt, nothing sent twice: {log:?}"
    );
    let at = |key: &str, seq: u32, code: u16| {
        log.iter()
            .find(|(k, s, c, _)| k == key && *s == seq && *c == code)
            .unwrap()
            .3
    };
    let failed_at = at("k0", 3, 500);
    let retried_at = at("k0", 3, 200);
    let k1_done = at("k1", 9, 200);
    assert!(
        retried_at >= failed_at + Duration::from_millis(400),
        "the retry waited for its backoff: {:?}",
        retried_at - failed_at
    );
    assert!(
        k1_done < retried_at,
        "k1 was not held back by k0's retry: done {:?} after the failure, the retry {:?} after",
        k1_done.saturating_duration_since(failed_at),
        retried_at - failed_at
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_blocks_its_key_until_replayed_or_discarded() {
    let db = PgBackend::create("ordered_dead", crate::store::conformance::DEFAULT_MAX).await;
    // k0:2 and k1:2 are refused (400, permanent) until `fixed`; k2 is never refused.
    let fixed = Arc::new(AtomicBool::new(false));
    let f = fixed.clone();
    let (server, answers) = answering(move |body| {
        let refused = body == b"k0:2" || body == b"k1:2";
        if refused && !f.load(Ordering::SeqCst) {
            400
        } else {
            200
        }
    })
    .await;
    let ids: Vec<i64> = db
        .enqueue_all(&interleaved("o.t", 3, 6))
        .await
        .iter()
        .map(|e| e.id)
        .collect();
    let sink = webhook(&server.url).await;
    let handle = Relay::new(db.store(), Arc::new(sink), http_config("dead")).spawn();
    let store = db.store();
    // k2's six, and k0:0-1, k1:0-1: ten dispatched; k0:2 and k1:2 dead.
    crate::common::wait_dispatched("10 dispatched", &store, 10, Duration::from_secs(20)).await;
    wait_until("two dead letters", Duration::from_secs(10), || {
        let store = store.clone();
        async move {
            match store.counts().await.unwrap().dead {
                2 => Ok(()),
                n => Err(format!("{n} dead")),
            }
        }
    })
    .await;
    // Nothing more of k0 or k1 goes out while their dead letters block them: fifteen
    // more claims (a poll every 100 ms), none of which took them.
    crate::common::wait_claims("fifteen more claims", &handle, 15, Duration::from_secs(10)).await;
    let seen = accepted(&answers);
    assert_eq!(seen["k0"], vec![0, 1], "k0 blocked behind its dead letter");
    assert_eq!(seen["k1"], vec![0, 1], "k1 blocked behind its dead letter");
    assert_eq!(seen["k2"], (0..6).collect::<Vec<_>>(), "k2 flows");
    assert_eq!(
        answers.lock().unwrap().len(),
        12,
        "k0:2 and k1:2 tried once each"
    );
    assert_eq!(
        store.counts().await.unwrap().pending,
        6,
        "k0:3-5 and k1:3-5 wait"
    );
    // The relay parked them on quarantining: pending, but no longer due, so no claim
    // reads them again.
    wait_until("k0:3-5 and k1:3-5 parked", Duration::from_secs(5), || {
        let store = store.clone();
        async move {
            match store.overview(10).await.unwrap().due {
                0 => Ok(()),
                n => Err(format!("{n} due")),
            }
        }
    })
    .await;

    // The consumer is fixed: replay k0's dead letter (k0:2 is ids[6]), discard k1's (ids[7]).
    fixed.store(true, Ordering::SeqCst);
    let request = |id: i64, action| crate::common::replay_ids(vec![id], action);
    let replayed = store
        .replay(&request(ids[6], ReplayAction::Replay))
        .await
        .unwrap();
    assert_eq!(replayed.count, 1);
    let discarded = store
        .replay(&request(ids[7], ReplayAction::Discard))
        .await
        .unwrap();
    assert_eq!(discarded.count, 1);
    crate::common::wait_dispatched("17 dispatched", &store, 17, Duration::from_secs(20)).await;
    handle.shutdown().await.unwrap();
    let audit = store.replays(10).await.unwrap();
    assert_eq!(audit.len(), 2, "both changes audited: {audit:?}");

    let seen = accepted(&answers);
    assert_eq!(
        seen["k0"],
        (0..6).collect::<Vec<_>>(),
        "the replayed dead letter went first, then the rest of k0"
    );
    assert_eq!(
        seen["k1"],
        vec![0, 1, 3, 4, 5],
        "discarded: the rest of k1 followed"
    );
    assert_eq!(store.counts().await.unwrap().dead, 0);
}

/// Rows parked behind a dead letter come back when a relay starts whose ordering no
/// longer holds them (here: a drain without `--ordered`), and are delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_no_longer_orders_gives_parked_rows_back() {
    use crate::store::conformance_sqlite::SqliteBackend;
    let db = SqliteBackend::create("unpark_at_start", crate::store::conformance::DEFAULT_MAX).await;
    let store = db.store();
    let ids: Vec<i64> = db
        .enqueue_all(&interleaved("o.t", 1, 4))
        .await
        .iter()
        .map(|e| e.id)
        .collect();
    // k0:0 dies; k0:1-3 are parked behind it.
    let strict = ordered("o.>");
    let claim = store.claim(&ordered_claim("by-hand", 1)).await.unwrap();
    assert_eq!(claim.messages.len(), 1);
    store
        .quarantine(
            claim.token,
            &[outbox::store::Dead {
                id: ids[0],
                error: "permanent: rejected".into(),
            }],
        )
        .await
        .unwrap();
    assert_eq!(store.park_held(&strict).await.unwrap(), 3);
    assert_eq!(store.overview(10).await.unwrap().due, 0);

    let (server, answers) = answering(|_| 200).await;
    let sink = webhook(&server.url).await;
    // A drain: the rows come back before its first claim, so it delivers them (a give-back
    // racing the first claim let the drain end with them still pending).
    let config = RelayConfig {
        ordering: KeyOrdering::default(),
        drain: true,
        ..http_config("unordered")
    };
    let stats = Relay::new(store.clone(), Arc::new(sink), config)
        .run(Default::default())
        .await
        .unwrap();
    assert_eq!(stats.dispatched, 3, "{stats:?}");
    let mut delivered = accepted(&answers)["k0"].clone();
    delivered.sort_unstable(); // no ordering: any order
    assert_eq!(delivered, vec![1, 2, 3]);
    assert_eq!(
        store.counts().await.unwrap().dead,
        1,
        "the dead letter stays"
    );
}

/// One hot ordered key and four workers: while one worker's claim holds the key, the
/// others' claims find nothing (and read every due row to find it out); after the first
/// such empty claim, full claims stop bringing the idle workers in. Without that, each
/// full claim woke three workers for three empty claims.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_hot_key_does_not_wake_the_idle_workers_for_nothing() {
    let db = PgBackend::create("ordered_hot", crate::store::conformance::DEFAULT_MAX).await;
    // Each request answered after 3 ms: a claim of 50 rows of one key is in flight for
    // 150 ms or more, one message after another.
    let server = TestServer::start(|_, _| Reply::status(200).after(Duration::from_millis(3))).await;
    db.enqueue_all(&interleaved("o.t", 1, 300)).await;
    let sink = webhook(&server.url).await;
    let config = RelayConfig {
        batch_size: 50,
        min_batch_size: 50,
        in_flight_batches: 4,
        // No poll-driven claims within the test.
        poll_interval: Duration::from_secs(30),
        ..http_config("hot")
    };
    let handle = Relay::new(db.store(), Arc::new(sink), config).spawn();
    let store = db.store();
    crate::common::wait_dispatched("300 dispatched", &store, 300, Duration::from_secs(30)).await;
    let stats = handle.shutdown().await.unwrap();
    let empty = stats.claims - stats.batches;
    assert!(
        stats.batches >= 6,
        "300 rows in claims of at most 50: {stats:?}"
    );
    // Three woken by the first full claim, at most one on the store's wake-up (the
    // enqueue's notification may arrive after the relay subscribed), and the last claim,
    // which finds the outbox empty. Without the rule: 16 in this setup.
    assert!(
        empty <= 5,
        "the first full claim woke three workers; no later one should: {empty} empty claims, {stats:?}"
    );
}

/// SQLite keeps any type in any column: rows written by hand with a BLOB key or topic do
/// not fail the ordered claim (which would stop every key); they are claimed and come
/// back malformed, to be quarantined, while the other rows are claimed as usual.
#[tokio::test]
async fn sqlite_rows_with_blob_keys_do_not_stop_the_ordered_claim() {
    use crate::store::conformance_sqlite::SqliteBackend;
    let db = SqliteBackend::create("blob", crate::store::conformance::DEFAULT_MAX).await;
    sqlx::raw_sql(
        "INSERT INTO outbox_messages (message_id, topic, key, payload) VALUES
           ('00000000-0000-7000-8000-000000000001', 'o.a', X'6B31', X'00'),
           ('00000000-0000-7000-8000-000000000002', X'6F2E61', 'k2', X'00'),
           ('00000000-0000-7000-8000-000000000003', 'o.a', X'FF', X'00')",
    )
    .execute(db.app())
    .await
    .unwrap();
    let good = db
        .enqueue_all(&[
            Message::new("o.a", b"x".to_vec()).key("k1"),
            Message::new("u.a", b"x".to_vec()),
        ])
        .await;
    let claim = db.store().claim(&ordered_claim("blob", 100)).await.unwrap();
    let ids: Vec<i64> = claim.messages.iter().map(|m| m.id).collect();
    assert_eq!(ids, good.iter().map(|e| e.id).collect::<Vec<_>>());
    assert_eq!(claim.malformed.len(), 3, "{:?}", claim.malformed);
}

/// A dead letter whose topic is not UTF-8 (quarantined as malformed, its key kept) matches
/// no ordered topic: the background's statements over dead letters (what strict ordering
/// holds, parking and giving back) read it without failing, and it holds nothing back.
#[tokio::test]
async fn sqlite_dead_letters_with_non_utf8_topics_do_not_fail_the_background() {
    use crate::store::conformance_sqlite::SqliteBackend;
    let db = SqliteBackend::create("deadblob", crate::store::conformance::DEFAULT_MAX).await;
    // Dead: `o.\xff` keyed `k` and `o.a` keyed `k1`; pending behind each, one of each key.
    sqlx::raw_sql(
        "INSERT INTO outbox_messages (message_id, topic, key, payload, status) VALUES
           ('00000000-0000-7000-8000-000000000001', CAST(X'6F2EFF' AS TEXT), 'k', X'00', 3),
           ('00000000-0000-7000-8000-000000000002', 'o.a', 'k1', X'00', 3),
           ('00000000-0000-7000-8000-000000000003', CAST(X'6F2EFF' AS TEXT), 'k', X'00', 0),
           ('00000000-0000-7000-8000-000000000004', 'o.a', 'k1', X'00', 0)",
    )
    .execute(db.app())
    .await
    .unwrap();
    let store = db.store();
    let strict = ordered("o.>");
    let held = store.held_keys(&strict).await.unwrap();
    assert_eq!((held.blocked_keys, held.held), (1, 1), "{held:?}");
    assert_eq!(
        store.park_held(&strict).await.unwrap(),
        1,
        "only o.a's k1 is held"
    );
    assert_eq!(
        store.unpark_released(&strict).await.unwrap(),
        0,
        "k1 is still held"
    );
    // Once the dead letter of `k1` goes, its follower is given back.
    sqlx::raw_sql(
        "DELETE FROM outbox_messages WHERE message_id = '00000000-0000-7000-8000-000000000002'",
    )
    .execute(db.app())
    .await
    .unwrap();
    assert_eq!(store.unpark_released(&strict).await.unwrap(), 1);
    let held = store.held_keys(&strict).await.unwrap();
    assert_eq!((held.blocked_keys, held.held), (0, 0), "{held:?}");
}

/// PostgreSQL indexes a key by its hash: a key longer than a btree entry may be (2,704
/// bytes) is enqueued and claimed in order like any other.
#[tokio::test]
async fn postgres_takes_keys_longer_than_an_index_entry() {
    let db = PgBackend::create("longkey", crate::store::conformance::DEFAULT_MAX).await;
    let key: String = (0..400)
        .map(|_| uuid::Uuid::new_v4().simple().to_string())
        .collect();
    assert!(key.len() > 10_000);
    let ids: Vec<i64> = db
        .enqueue_all(&[
            Message::new("o.a", b"1".to_vec()).key(key.clone()),
            Message::new("o.a", b"2".to_vec()).key(key.clone()),
        ])
        .await
        .iter()
        .map(|e| e.id)
        .collect();
    let req = ordered_claim("long", 1);
    let store = db.store();
    let first = store.claim(&req).await.unwrap();
    assert_eq!(
        first.messages.iter().map(|m| m.id).collect::<Vec<_>>(),
        vec![ids[0]]
    );
    assert!(
        store.claim(&req).await.unwrap().messages.is_empty(),
        "the second waits"
    );
    store.mark_dispatched(first.token, &[ids[0]]).await.unwrap();
    let second = store.claim(&req).await.unwrap();
    assert_eq!(
        second.messages.iter().map(|m| m.id).collect::<Vec<_>>(),
        vec![ids[1]]
    );
    assert_eq!(second.messages[0].key.as_deref(), Some(key.as_str()));
}

/// A key whose head is locked by a claim still in progress (another relay's statement,
/// skipped by `SKIP LOCKED`) gives the claim none of its rows, whether one of them or
/// several are due: the head is outside the claim, so it fences the whole key. Other keys
/// flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_holds_a_key_whose_head_another_claim_has_locked() {
    let db = PgBackend::create("headlock", crate::store::conformance::DEFAULT_MAX).await;
    let ids: Vec<i64> = db
        .enqueue_all(&[
            Message::new("o.a", b"a1".to_vec()).key("a"),
            Message::new("o.a", b"a2".to_vec()).key("a"),
            Message::new("o.a", b"b1".to_vec()).key("b"),
            Message::new("o.a", b"c1".to_vec()).key("c"),
            Message::new("o.a", b"c2".to_vec()).key("c"),
            Message::new("o.a", b"c3".to_vec()).key("c"),
        ])
        .await
        .iter()
        .map(|e| e.id)
        .collect();
    let (a1, a2, b1, c1) = (ids[0], ids[1], ids[2], ids[3]);
    // Another claim in progress holds a1 and c1.
    let mut other = db.app.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM {}.messages WHERE id = ANY($1) FOR UPDATE",
        db.schema.name
    )))
    .bind(vec![a1, c1])
    .fetch_all(&mut *other)
    .await
    .unwrap();
    let req = ordered_claim("headlock", 100);
    let store = db.store();
    let claim = store.claim(&req).await.unwrap();
    assert_eq!(
        claim.messages.iter().map(|m| m.id).collect::<Vec<_>>(),
        vec![b1],
        "a2 (alone in the claim) and c2, c3 (two) wait behind their locked heads"
    );
    store.mark_dispatched(claim.token, &[b1]).await.unwrap();
    other.rollback().await.unwrap();
    let claim = store.claim(&req).await.unwrap();
    assert_eq!(
        claim.messages.iter().map(|m| m.id).collect::<Vec<_>>(),
        vec![a1, a2, c1, ids[4], ids[5]],
        "once the heads are free, each key's run comes in id order"
    );
}

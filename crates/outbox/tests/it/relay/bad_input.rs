//! Bad input is refused where it enters, with an error that names it: a relay on an
//! unmigrated store, an unknown sink URL, and a NATS subject that no stream covers
//! (quarantined at once). Rows that cannot be read as messages, text that is not UTF-8
//! included, are quarantined as malformed while the rest flows. Oversized messages and
//! text a store cannot hold are refused at enqueue: see the conformance suite
//! (`payloads_and_headers_survive_byte_for_byte`). A topic pause stored before patterns
//! were bounded, too long to match any topic, stops no claim once migrated.

#![allow(clippy::unwrap_used)]

use crate::common::{
    RecordingWrapper, Seen, TestStream, nats_connect, nats_url, pg_store_unmigrated, relay_config,
    replay_ids, sqlite_store_unmigrated, wait_settled,
};
use crate::store::conformance::Backend as _;
use outbox::sink::SinkError;
use outbox::sink::nats::{NatsOptions, NatsSink};
use outbox::store::prelude::*;
use outbox::{Error, Message, Relay, RelayError};
use sqlx::AssertSqlSafe;
use std::sync::Arc;
use std::time::Duration;

const LIMIT: usize = 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_on_unmigrated_store_fails_with_not_migrated() {
    let (pg, schema) = pg_store_unmigrated("unmig", LIMIT).await;
    let (sink, _seen) = crate::common::RecordingSink::new();
    let r = Relay::new(Arc::new(pg), sink.clone(), relay_config("unmigrated"))
        .spawn()
        .wait()
        .await;
    match r {
        Err(RelayError::Store(Error::NotMigrated {
            schema: got,
            found,
            expected,
        })) => {
            assert_eq!(got, schema.name);
            assert_eq!(found, 0);
            assert_eq!(expected, outbox::postgres::SCHEMA_VERSION);
        }
        other => panic!("expected NotMigrated, got {other:?}"),
    }

    let (lite, _dir) = sqlite_store_unmigrated(LIMIT).await;
    let r = Relay::new(Arc::new(lite), sink, relay_config("unmigrated"))
        .spawn()
        .wait()
        .await;
    assert!(
        matches!(
            r,
            Err(RelayError::Store(Error::NotMigrated { found: 0, .. }))
        ),
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unknown_sink_url_is_invalid() {
    for url in ["kafka+bogus://x", "file:", "ftp://host/x"] {
        match outbox::sink::open(url).await {
            Err(SinkError::InvalidUrl { url: got, .. }) => assert_eq!(got, url),
            Err(other) => panic!("{url}: expected InvalidUrl, got {other}"),
            Ok(s) => panic!("{url}: expected InvalidUrl, got a sink {}", s.describe()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_subject_without_stream_is_quarantined_at_once() {
    let client = nats_connect().await;
    let stream = TestStream::shared(&client).await;
    let db = crate::store::conformance_postgres::PgBackend::create(
        "nostream",
        outbox::store::DEFAULT_MAX_MESSAGE_BYTES,
    )
    .await;
    // A subject next to the stream's, but outside it.
    let uncovered = format!("{}x.orders", stream.prefix);
    let msgs = vec![
        Message::new(stream.subject("ok1"), b"1".to_vec()),
        Message::new(uncovered.clone(), b"2".to_vec()),
        Message::new(stream.subject("ok2"), b"3".to_vec()),
        // Text a store holds but NATS headers cannot carry.
        Message::new(stream.subject("crlf"), b"4".to_vec()).header("note", "a\r\nb"),
    ];
    let enq = db.enqueue_all(&msgs).await;
    // A row written by hand with headers that are not a JSON object of strings.
    let malformed_id: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "INSERT INTO {}.messages (message_id, topic, payload, headers)
         VALUES (gen_random_uuid(), $1, '\\x00', '{{\"n\": 1}}') RETURNING id",
        db.schema.name
    )))
    .bind(stream.subject("malformed"))
    .fetch_one(&db.app)
    .await
    .unwrap();

    let sink = NatsSink::connect(
        &nats_url(),
        NatsOptions {
            ack_timeout: Duration::from_secs(2),
        },
    )
    .await
    .unwrap();
    let seen: Seen = Arc::default();
    let sink = Arc::new(RecordingWrapper {
        inner: sink,
        seen: seen.clone(),
    });
    let mut cfg = relay_config("nostream");
    cfg.max_attempts = 5;
    let handle = Relay::new(db.store(), sink, cfg).spawn();
    let store = db.store();
    wait_settled(
        "2 dispatched and 3 dead",
        &store,
        2,
        3,
        Duration::from_secs(15),
    )
    .await;
    handle.shutdown().await.unwrap();

    let dead = db.row(enq[1].id).await;
    assert_eq!(dead.status, 3);
    assert_eq!(dead.attempts, 1, "a permanent error is not retried");
    let err = dead.last_error.unwrap_or_default();
    assert!(err.contains("no JetStream stream covers"), "{err}");
    assert!(err.contains(&uncovered), "{err}");
    assert_eq!(seen.lock().unwrap()[&msgs[1].id()], 1);

    let crlf = db.row(enq[3].id).await;
    assert_eq!((crlf.status, crlf.attempts), (3, 1));
    let err = crlf.last_error.unwrap_or_default();
    assert!(err.contains("CR or LF") && err.contains("note"), "{err}");

    let malformed = db.row(malformed_id).await;
    assert_eq!(malformed.status, 3);
    let err = malformed.last_error.unwrap_or_default();
    assert!(err.contains("malformed row"), "{err}");
    assert!(
        !seen.lock().unwrap().contains_key(&malformed.message_id),
        "a malformed row never reaches the sink"
    );

    assert_eq!(stream.message_count(&client).await, 2);
}

/// A sink that panics (a bug in it): the relay ends with `RelayError::Task` naming the
/// panic, and the rows it held come back to a healthy relay after the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_sink_ends_the_relay_with_the_panic_and_loses_nothing() {
    struct Panics;
    #[async_trait::async_trait]
    impl outbox::Sink for Panics {
        async fn publish(
            &self,
            _batch: &[outbox::OutgoingMessage],
            _confirm: &outbox::sink::Confirmations,
        ) {
            panic!("sink bug");
        }
        fn describe(&self) -> String {
            "panics".into()
        }
    }
    let db = crate::store::conformance_sqlite::SqliteBackend::create(
        "sqlite",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let enq = db.enqueue_all(&crate::common::messages("t.panic", 5)).await;
    let mut cfg = relay_config("relay-panics");
    cfg.lease = Duration::from_millis(500);
    let r = Relay::new(db.store(), Arc::new(Panics), cfg)
        .spawn()
        .wait()
        .await;
    match r {
        Err(RelayError::Task(text)) => assert!(text.contains("sink bug"), "{text}"),
        other => panic!("expected RelayError::Task, got {other:?}"),
    }
    let (sink, seen) = crate::common::RecordingSink::new();
    let second = Relay::new(db.store(), sink, relay_config("relay-after")).spawn();
    crate::common::wait_dispatched(
        "all dispatched after the panic",
        &db.store(),
        enq.len(),
        Duration::from_secs(10),
    )
    .await;
    second.shutdown().await.unwrap();
    assert_eq!(seen.lock().unwrap().len(), enq.len());
}

/// The URL of a database `name` in `encoding` on the test server (created on first use,
/// collation C).
async fn encoded_db_url(name: &str, encoding: &str) -> String {
    let mut conn = crate::common::pg_connect().await;
    let created = sqlx::query(AssertSqlSafe(format!(
        "CREATE DATABASE {name} ENCODING '{encoding}' TEMPLATE template0
         LC_COLLATE 'C' LC_CTYPE 'C'"
    )))
    .execute(&mut conn)
    .await;
    match created {
        Ok(_) => {}
        // 42P04: it exists; 23505: another test created it at the same moment.
        Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("42P04" | "23505")) => {
        }
        Err(e) => panic!("creating the {encoding} database: {e}"),
    }
    let url = crate::common::pg_url();
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b.to_owned(), format!("?{q}")),
        None => (url.clone(), String::new()),
    };
    let server = base.rsplit_once('/').map_or(base.as_str(), |(s, _)| s);
    format!("{server}/{name}{query}")
}

/// A schema of its own in the database at `url`, dropped (best effort) with the guard.
struct ScratchSchema {
    url: String,
    name: String,
}

impl ScratchSchema {
    fn new(url: &str, label: &str) -> Self {
        ScratchSchema {
            url: url.to_owned(),
            name: format!("t_{label}_{}", crate::common::unique()),
        }
    }
}

impl Drop for ScratchSchema {
    fn drop(&mut self) {
        let (url, schema) = (self.url.clone(), self.name.clone());
        crate::common::cleanup_blocking(async move {
            use sqlx::Connection as _;
            if let Ok(mut c) = sqlx::PgConnection::connect(&url).await {
                let _ = sqlx::query(AssertSqlSafe(format!(
                    "DROP SCHEMA IF EXISTS {schema} CASCADE"
                )))
                .execute(&mut c)
                .await;
            }
        });
    }
}

/// A migrated store in `schema`.
async fn scratch_store(schema: &ScratchSchema) -> outbox::postgres::PgStore {
    let config = outbox::StoreConfig {
        schema: outbox::Ident::new(&schema.name).unwrap(),
        max_message_bytes: LIMIT,
    };
    let store = outbox::postgres::PgStore::connect(&schema.url, config)
        .await
        .unwrap();
    outbox::store::Maintenance::migrate(&store).await.unwrap();
    store
}

/// What an operator sees of three dead letters, `bad`: a topic, a key and headers that
/// are not UTF-8 (`t.bad.\xff`, `o.keyed` keyed `k\xfe`, `t.hdr` with `{"h": "v\xff"}`),
/// each quarantined as malformed. The dead letters, the overview and the message search
/// show them with U+FFFD; the keyed one is replayed (its parked followers are looked up by
/// its key) and the other two are discarded.
async fn operators_see_replay_and_discard(store: &Arc<dyn outbox::Store>, bad: [i64; 3]) {
    use outbox::store::ReplayAction;
    let dead = store
        .dead_letters(&Default::default(), 10, false)
        .await
        .unwrap();
    assert_eq!(dead.iter().map(|d| d.id).collect::<Vec<_>>(), bad);
    for d in &dead {
        let error = d.last_error.clone().unwrap_or_default();
        assert!(error.contains("malformed row"), "{}: {error}", d.id);
    }
    let keyed_dead = dead[1].message_id;
    let shown: Vec<(String, Option<String>, String)> = dead
        .into_iter()
        .map(|d| (d.topic, d.key, d.headers))
        .collect();
    assert_eq!(
        shown,
        [
            ("t.bad.\u{fffd}".into(), None, "{}".into()),
            ("o.keyed".into(), Some("k\u{fffd}".into()), "{}".into()),
            ("t.hdr".into(), None, "{\"h\": \"v\u{fffd}\"}".into()),
        ]
    );
    let mut dead_topics = store.overview(5).await.unwrap().dead_by_topic;
    dead_topics.sort();
    assert_eq!(
        dead_topics,
        [
            ("o.keyed".into(), 1),
            ("t.bad.\u{fffd}".into(), 1),
            ("t.hdr".into(), 1)
        ]
    );
    let found = store
        .find_messages(
            &outbox::store::lookup::MessageQuery::MessageId(keyed_dead),
            10,
        )
        .await
        .unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].key.as_deref(), Some("k\u{fffd}"));
    let replayed = store
        .replay(&replay_ids(vec![bad[1]], ReplayAction::Replay))
        .await
        .unwrap();
    assert_eq!(replayed.count, 1);
    let discarded = store
        .replay(&replay_ids(vec![bad[0], bad[2]], ReplayAction::Discard))
        .await
        .unwrap();
    assert_eq!(discarded.count, 2);
}

/// In a `SQL_ASCII` database a row's text may hold bytes that are not UTF-8, which the
/// server refuses to send to a UTF-8 client (SQLSTATE 22021), failing the whole claim
/// statement that returns it. Such a row is quarantined as malformed, naming its column,
/// and the rows around it are published: one bad row never stalls the relay. Both the
/// unordered and the ordered claim are covered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_text_that_is_not_utf8_is_quarantined_and_the_rest_flows() {
    let url = encoded_db_url("outbox_sql_ascii", "SQL_ASCII").await;
    let schema = ScratchSchema::new(&url, "sqlascii");
    let store = scratch_store(&schema).await;
    let app = sqlx::PgPool::connect(&url).await.unwrap();
    let s = &schema.name;
    // (topic, key, headers), each written as SQL; the bad ones hold a byte 0xff or 0xfe.
    let rows: [(&str, &str, &str, bool); 7] = [
        ("'t.ok.1'", "NULL", "'{}'", true),
        ("E't.bad.\\xff'", "NULL", "'{}'", false),
        ("'t.ok.2'", "'k1'", "'{}'", true),
        ("'o.keyed'", "E'k\\xfe'", "'{}'", false),
        ("'t.ok.3'", "NULL", "'{\"h\": \"v\"}'", true),
        ("'t.hdr'", "NULL", "E'{\"h\": \"v\\xff\"}'", false),
        ("'o.keyed'", "'k2'", "'{}'", true),
    ];
    let mut ids = Vec::new();
    for (topic, key, headers, _) in rows {
        let id: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "INSERT INTO {s}.messages (message_id, topic, key, payload, headers)
             VALUES (gen_random_uuid(), {topic}, {key}, '\\x01', {headers}::jsonb) RETURNING id"
        )))
        .fetch_one(&app)
        .await
        .unwrap();
        ids.push(id);
    }
    let (sink, seen) = crate::common::RecordingSink::new();
    for ordered in [false, true] {
        let mut cfg = relay_config("sqlascii");
        if ordered {
            cfg.ordering = crate::relay::ordering::ordered("o.>");
            // The ordered run finds the rows the first one left: put them back.
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {s}.messages SET status = 0, attempts = 0, last_error = NULL,
                        available_at = now(), dispatched_at = NULL"
            )))
            .execute(&app)
            .await
            .unwrap();
        }
        let store: Arc<dyn outbox::Store> = Arc::new(store.clone());
        let handle = Relay::new(store.clone(), sink.clone(), cfg).spawn();
        wait_settled(
            "4 dispatched and 3 dead",
            &store,
            4,
            3,
            Duration::from_secs(15),
        )
        .await;
        handle.shutdown().await.unwrap();
        for ((_, _, _, good), id) in rows.iter().zip(&ids) {
            let (status, error): (i16, Option<String>) = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT status, last_error FROM {s}.messages WHERE id = $1"
            )))
            .bind(id)
            .fetch_one(&app)
            .await
            .unwrap();
            if *good {
                assert_eq!(status, 2, "row {id} (ordered: {ordered}): {error:?}");
            } else {
                assert_eq!(status, 3, "row {id} (ordered: {ordered})");
                let error = error.unwrap_or_default();
                assert!(
                    error.contains("malformed row") && error.contains("not valid UTF-8"),
                    "row {id}: {error}"
                );
            }
        }
    }
    assert_eq!(
        seen.lock().unwrap().len(),
        4,
        "only the good rows reached the sink"
    );
    let store: Arc<dyn outbox::Store> = Arc::new(store);
    operators_see_replay_and_discard(&store, [ids[1], ids[3], ids[5]]).await;
    let left: Vec<(i64, i16)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, status FROM {s}.messages WHERE status <> 2 ORDER BY id"
    )))
    .fetch_all(&app)
    .await
    .unwrap();
    assert_eq!(left, [(ids[3], 0)]);
}

/// In a database whose encoding is neither UTF-8 nor `SQL_ASCII`, a character with no
/// UTF-8 form (SQLSTATE 22P05) fails the claim, and then even the read of the claimed rows
/// as bytes: the rows are read one by one, the one that cannot be sent is quarantined, and
/// the others, non-ASCII text included, are published on their first attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_text_with_no_utf8_form_is_quarantined_and_the_rest_flows() {
    let url = encoded_db_url("outbox_euc_jp", "EUC_JP").await;
    let schema = ScratchSchema::new(&url, "eucjp");
    let store = scratch_store(&schema).await;
    let app = sqlx::PgPool::connect(&url).await.unwrap();
    let s = &schema.name;
    // 0xa4a2 is HIRAGANA A; 0xf5a1 is in EUC-JP's user-defined area, with no UTF-8 form.
    let topics = [
        ("'t.ok.1'", true),
        ("'t.' || convert_from('\\xa4a2', 'EUC_JP')", true),
        ("'t.' || convert_from('\\xf5a1', 'EUC_JP')", false),
        ("'t.ok.2'", true),
    ];
    let mut ids = Vec::new();
    for (topic, _) in topics {
        let id: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "INSERT INTO {s}.messages (message_id, topic, payload)
             VALUES (gen_random_uuid(), {topic}, '\\x01') RETURNING id"
        )))
        .fetch_one(&app)
        .await
        .unwrap();
        ids.push(id);
    }
    let (sink, seen) = crate::common::RecordingSink::new();
    let store: Arc<dyn outbox::Store> = Arc::new(store);
    let handle = Relay::new(store.clone(), sink, relay_config("eucjp")).spawn();
    wait_settled(
        "3 dispatched and 1 dead",
        &store,
        3,
        1,
        Duration::from_secs(15),
    )
    .await;
    handle.shutdown().await.unwrap();
    assert_eq!(seen.lock().unwrap().len(), 3);
    for ((_, good), id) in topics.iter().zip(&ids) {
        let (status, attempts, error): (i16, i32, Option<String>) = sqlx::query_as(AssertSqlSafe(
            format!("SELECT status, attempts, last_error FROM {s}.messages WHERE id = $1"),
        ))
        .bind(id)
        .fetch_one(&app)
        .await
        .unwrap();
        if *good {
            assert_eq!((status, attempts), (2, 1), "row {id}: {error:?}");
        } else {
            assert_eq!(status, 3, "row {id}");
            let error = error.unwrap_or_default();
            assert!(error.contains("cannot be sent as UTF-8"), "{error}");
        }
    }
}

/// SQLite keeps whatever bytes a writer gives a `TEXT` column. A row whose text is not
/// UTF-8 is quarantined as malformed while the others flow, and the operator's views (dead
/// letters, overview, message search) show it with U+FFFD; it can be replayed and
/// discarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_text_that_is_not_utf8_is_quarantined_and_can_be_seen_and_discarded() {
    let db = crate::store::conformance_sqlite::SqliteBackend::create(
        "sqlite",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let p = db.store.config().schema.clone();
    // (topic, key, headers) as SQL; the bad ones hold a byte 0xff or 0xfe.
    let rows: [(&str, &str, &str, bool); 5] = [
        ("'t.ok.1'", "NULL", "'{}'", true),
        ("CAST(x'742e6261642eff' AS TEXT)", "NULL", "'{}'", false),
        ("'o.keyed'", "CAST(x'6bfe' AS TEXT)", "'{}'", false),
        (
            "'t.hdr'",
            "NULL",
            "CAST(x'7b2268223a202276ff227d' AS TEXT)",
            false,
        ),
        ("'t.ok.2'", "'k1'", "'{}'", true),
    ];
    let mut ids = Vec::new();
    for (i, (topic, key, headers, _)) in rows.iter().enumerate() {
        let id: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "INSERT INTO {p}_messages (message_id, topic, key, payload, headers)
             VALUES ('01900000-0000-7000-8000-00000000000{i}', {topic}, {key}, x'01', {headers})
             RETURNING id"
        )))
        .fetch_one(&db.app)
        .await
        .unwrap();
        ids.push(id);
    }
    let store = db.store();
    // Paused, the ordered claim takes nothing, these rows included.
    store.set_pause(Some("maintenance")).await.unwrap();
    let paused = store
        .claim(&outbox::store::ClaimRequest {
            relay_id: "by-hand".into(),
            batch_size: 10,
            lease: Duration::from_secs(30),
            skip_topics: Vec::new(),
            ordering: crate::relay::ordering::ordered("o.>"),
        })
        .await
        .unwrap();
    assert!(paused.messages.is_empty() && paused.malformed.is_empty());
    assert_eq!(store.counts().await.unwrap().pending, 5);
    store.set_pause(None).await.unwrap();
    let (sink, seen) = crate::common::RecordingSink::new();
    let mut cfg = relay_config("sqlite-not-utf8");
    cfg.ordering = crate::relay::ordering::ordered("o.>");
    let handle = Relay::new(store.clone(), sink, cfg).spawn();
    wait_settled(
        "2 dispatched and 3 dead",
        &store,
        2,
        3,
        Duration::from_secs(15),
    )
    .await;
    handle.shutdown().await.unwrap();
    assert_eq!(
        seen.lock().unwrap().len(),
        2,
        "only the good rows reached the sink"
    );

    operators_see_replay_and_discard(&store, [ids[1], ids[2], ids[3]]).await;
    let c = store.counts().await.unwrap();
    assert_eq!((c.pending, c.dead, c.dispatched), (1, 0, 2));
}

/// SQLite: a dead letter whose topic is not UTF-8 (quarantined as malformed, its topic
/// kept) does not break selecting dead letters by topic: the list, the count and a replay
/// by topic see the others, and the pattern never matches it.
#[tokio::test]
async fn sqlite_dead_letters_select_by_topic_beside_a_topic_not_utf8() {
    use crate::store::conformance_sqlite::SqliteBackend;
    use outbox::sink::router::TopicPattern;
    use outbox::store::{DeadSelector, ReplayAction};
    let db = SqliteBackend::create("deadtopic", crate::store::conformance::DEFAULT_MAX).await;
    sqlx::raw_sql(
        "INSERT INTO outbox_messages (id, message_id, topic, payload, status) VALUES
           (1, '00000000-0000-7000-8000-000000000001', CAST(X'6F2EFF' AS TEXT), X'00', 3),
           (2, '00000000-0000-7000-8000-000000000002', 'o.a', X'00', 3),
           (3, '00000000-0000-7000-8000-000000000003', 'p.a', X'00', 3)",
    )
    .execute(db.app())
    .await
    .unwrap();
    let store = db.store();
    for (pattern, expected) in [("o.>", vec![2]), ("p.a", vec![3]), ("x.>", vec![])] {
        let selector = DeadSelector {
            topic: Some(TopicPattern::parse(pattern).unwrap()),
            ..DeadSelector::default()
        };
        let listed: Vec<i64> = store
            .dead_letters(&selector, 10, false)
            .await
            .unwrap()
            .iter()
            .map(|d| d.id)
            .collect();
        assert_eq!(listed, expected, "{pattern}");
        assert_eq!(
            store.count_dead(&selector).await.unwrap(),
            expected.len() as u64,
            "{pattern}"
        );
        let mut req = replay_ids(Vec::new(), ReplayAction::Replay);
        req.selector = selector;
        req.dry_run = true;
        let preview = store.replay(&req).await.unwrap();
        assert_eq!(preview.sample, expected, "{pattern}");
    }
    // Without a topic, every dead letter is listed, the malformed one too.
    let all = store
        .dead_letters(&DeadSelector::default(), 10, false)
        .await
        .unwrap();
    assert_eq!(all.len(), 3);
}

/// SQLite: times written by hand at the far ends of the integer range (an `occurred_at`
/// or `available_at` of i64::MIN) do not break the counts or the overview: the ages
/// overflow SQLite's integers into reals, which are read back as the largest age.
#[tokio::test]
async fn sqlite_times_at_the_integer_limits_do_not_break_status() {
    use crate::store::conformance_sqlite::SqliteBackend;
    let db = SqliteBackend::create("minint", crate::store::conformance::DEFAULT_MAX).await;
    sqlx::raw_sql(
        "INSERT INTO outbox_messages (id, message_id, topic, payload, status, occurred_at, available_at)
         VALUES (1, '00000000-0000-7000-8000-000000000001', 'o.a', X'00', 0,
                 -9223372036854775808, -9223372036854775808)",
    )
    .execute(db.app())
    .await
    .unwrap();
    let store = db.store();
    let counts = store.counts().await.unwrap();
    assert_eq!(counts.pending, 1);
    assert!(
        counts
            .oldest_pending_age_seconds
            .is_some_and(|a| a > 1_000_000_000_000),
        "{counts:?}"
    );
    let overview = store.overview(10).await.unwrap();
    assert_eq!(overview.due, 1);
    assert!(
        overview.oldest_due_s.is_some_and(|a| a > 1_000_000_000_000),
        "{overview:?}"
    );
    // Claimed, it is malformed (no message goes out with a made-up time), and its dead
    // letter shows the earliest time there is, not 1970.
    let claim = store
        .claim(&outbox::store::ClaimRequest {
            relay_id: "r".into(),
            batch_size: 10,
            lease: std::time::Duration::from_secs(30),
            skip_topics: Vec::new(),
            ordering: outbox::store::KeyOrdering::default(),
        })
        .await
        .unwrap();
    assert!(claim.messages.is_empty(), "{:?}", claim.messages);
    assert_eq!(claim.malformed.len(), 1);
    assert!(
        claim.malformed[0]
            .error
            .contains("occurred_at is not a representable time"),
        "{:?}",
        claim.malformed
    );
    store
        .quarantine(claim.token, &claim.malformed)
        .await
        .unwrap();
    let dead = store
        .dead_letters(&outbox::store::DeadSelector::default(), 10, false)
        .await
        .unwrap();
    assert_eq!(
        dead[0].occurred_at,
        chrono::DateTime::<chrono::Utc>::MIN_UTC
    );
}

/// PostgreSQL: times written by hand past what a reader can represent (the year 294276,
/// `±infinity`) do not break what an operator reads: the dead letters, the message
/// look-up, the counts and the overview show such a time clamped, instead of a decoding
/// panic or an error for every row.
#[tokio::test]
async fn postgres_times_past_the_representable_range_do_not_break_status() {
    use outbox::store::DeadSelector;
    use outbox::store::lookup::MessageQuery;
    let db = crate::store::conformance_postgres::PgBackend::create(
        "fartime",
        outbox::store::DEFAULT_MAX_MESSAGE_BYTES,
    )
    .await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {s}.messages (message_id, topic, key, payload, status, occurred_at, available_at)
         VALUES (gen_random_uuid(), 'o.a', 'k', '\\x00', 3, '294276-12-31', '294276-12-31'),
                (gen_random_uuid(), 'o.a', 'k', '\\x00', 0, '-infinity', '-infinity'),
                (gen_random_uuid(), 'o.a', 'k', '\\x00', 0, 'infinity', 'infinity')",
        s = db.schema.name
    )))
    .execute(&db.app)
    .await
    .unwrap();
    let store = db.store();
    let dead = store
        .dead_letters(&DeadSelector::default(), 10, true)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0].occurred_at.format("%Y").to_string().len() >= 6,
        "{dead:?}"
    );
    let found = store
        .find_messages(
            &MessageQuery::Key {
                key: "k".into(),
                topic: Some("o.a".into()),
            },
            10,
        )
        .await
        .unwrap();
    assert_eq!(found.len(), 3);
    let counts = store.counts().await.unwrap();
    assert_eq!((counts.pending, counts.dead), (2, 1));
    assert!(
        counts
            .oldest_pending_age_seconds
            .is_some_and(|a| a > 100_000_000_000),
        "{counts:?}"
    );
    let overview = store.overview(10).await.unwrap();
    assert_eq!(overview.due, 1, "{overview:?}");
    assert!(overview.oldest_due_s.is_some_and(|a| a > 100_000_000_000));
}

/// A topic pause of 50,000 `*` tokens, written as versions without bounds on patterns
/// wrote it (its pattern and its regex), fails the claim as a whole on PostgreSQL
/// ("regular expression is too complex") and on SQLite (the `regex` crate's size limit):
/// nothing is delivered on any topic. `migrate` writes every stored pause's regex again;
/// such a pattern, longer than any topic, matches nothing, and the other topics flow while
/// the pause stays listed, to be resumed. (MariaDB's `pattern` column never held more than
/// 255 characters.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_too_long_for_any_topic_stops_no_claim_after_migrate() {
    use outbox::store::ClaimRequest;
    let pattern = vec!["*"; 50_000].join(".");
    let regex = format!("^{}$", vec!["[^.]+"; 50_000].join("\\."));
    let request = ClaimRequest {
        relay_id: "r".into(),
        batch_size: 10,
        lease: Duration::from_secs(60),
        skip_topics: Vec::new(),
        ordering: Default::default(),
    };

    // PostgreSQL.
    let (pg, schema) = crate::common::pg_store("hugepause").await;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {}.topic_pauses (pattern, reason, paused_by, regex) VALUES ($1, 'x', 'old', $2)",
        schema.name
    )))
    .bind(&pattern)
    .bind(&regex)
    .execute(pg.pool())
    .await
    .unwrap();
    // SQLite.
    let (lite, _dir) = crate::common::sqlite_store().await;
    sqlx::query(
        "INSERT INTO outbox_topic_pauses (pattern, reason, paused_by, regex, paused_at)
         VALUES (?1, 'x', 'old', ?2, 0)",
    )
    .bind(&pattern)
    .bind(&regex)
    .execute(lite.pool())
    .await
    .unwrap();

    let stores: [(&str, Arc<dyn outbox::Store>); 2] = [
        ("PostgreSQL", Arc::new(pg.clone())),
        ("SQLite", Arc::new(lite.clone())),
    ];
    let mut tx = pg.pool().begin().await.unwrap();
    let m = pg
        .enqueue(&mut tx, &Message::new("orders.v1", b"{}".to_vec()))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let mut tx = lite.pool().begin().await.unwrap();
    let l = lite
        .enqueue(&mut tx, &Message::new("orders.v1", b"{}".to_vec()))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    for ((name, store), id) in stores.iter().zip([m.id, l.id]) {
        let before = store.claim(&request).await;
        assert!(
            before.is_err(),
            "{name}: the stored regex fails the claim before migrate: {:?}",
            before.map(|c| c.messages.len())
        );
        store.migrate().await.unwrap();
        let c = store.claim(&request).await.unwrap();
        let ids: Vec<i64> = c.messages.iter().map(|m| m.id).collect();
        assert_eq!(ids, vec![id], "{name}: the other topic flows after migrate");
        let p = store.pause_state().await.unwrap();
        assert_eq!(p.topics.len(), 1, "{name}: the pause stays listed");
        assert!(store.resume_topic(&pattern).await.unwrap(), "{name}");
    }
}

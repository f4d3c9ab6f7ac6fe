//! SQLite end to end, the embedded default: migrate, enqueue, drain a relay into a file
//! sink, and read every message back from the file, bytes and envelope intact.

#![allow(clippy::unwrap_used)]

use crate::common::relay_config;
use crate::store::conformance::Backend as _;
use outbox::sink::file::{FileSink, payload_from_json_line};
use outbox::{Message, Relay};
use std::collections::HashMap;
use std::sync::Arc;
use uuid::Uuid;

const N: usize = 500;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_drain_to_file_delivers_every_message_once() {
    let db = crate::store::conformance_sqlite::SqliteBackend::create(
        "sqlite",
        crate::store::conformance::DEFAULT_MAX,
    )
    .await;
    let store = db.store();
    store.migrate().await.unwrap(); // idempotent: a second migrate changes nothing
    store.check_schema().await.unwrap();

    // Payloads: UTF-8 text, non-ASCII, binary (not UTF-8), empty.
    let payload = |i: usize| -> Vec<u8> {
        match i % 4 {
            0 => format!("{{\"n\":{i}}}").into_bytes(),
            1 => format!("grüße-{i}-✓").into_bytes(),
            2 => vec![0xff, 0x00, 0xfe, (i % 256) as u8],
            _ => Vec::new(),
        }
    };
    let msgs: Vec<Message> = (0..N)
        .map(|i| {
            let m = Message::new("t.e2e.v1", payload(i)).correlation_id(format!("req-{i}"));
            if i % 2 == 0 {
                m.key(format!("k{}", i % 7))
            } else {
                m
            }
        })
        .collect();
    let enq = db.enqueue_all(&msgs).await;
    assert!(enq.iter().all(|e| e.inserted));
    assert_eq!(store.counts().await.unwrap().pending, N as i64);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.jsonl");
    let sink = FileSink::open(&path).await.unwrap();
    let mut cfg = relay_config("relay-e2e");
    cfg.drain = true;
    cfg.batch_size = 64;
    let stats = Relay::new(store.clone(), Arc::new(sink), cfg)
        .spawn()
        .wait()
        .await
        .unwrap();
    assert_eq!(stats.dispatched, N as u64, "{stats:?}");
    assert_eq!(stats.claimed, N as u64, "{stats:?}");
    assert_eq!(stats.batches, N.div_ceil(64) as u64, "{stats:?}");

    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), N);
    let by_id: HashMap<Uuid, &Message> = msgs.iter().map(|m| (m.id(), m)).collect();
    let mut found = HashMap::new();
    for line in lines {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let id = Uuid::parse_str(v["message_id"].as_str().unwrap()).unwrap();
        let m = by_id
            .get(&id)
            .unwrap_or_else(|| panic!("unknown id {id} in the file"));
        assert_eq!(v["topic"], "t.e2e.v1");
        assert_eq!(payload_from_json_line(&v).unwrap(), m.payload(), "{id}");
        assert_eq!(v["attempt"], 1);
        assert!(
            v["headers"]["correlation-id"]
                .as_str()
                .unwrap()
                .starts_with("req-")
        );
        *found.entry(id).or_insert(0) += 1;
    }
    assert_eq!(found.len(), N, "distinct message ids");
    assert!(found.values().all(|&n| n == 1));

    let c = store.counts().await.unwrap();
    assert_eq!(
        (c.pending, c.claimed, c.dispatched, c.dead),
        (0, 0, N as i64, 0)
    );
    assert_eq!(c.oldest_pending_age_seconds, None);
}

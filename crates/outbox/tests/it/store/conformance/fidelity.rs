//! Store conformance: payload and header fidelity.

use super::*;
use outbox::store::prelude::*;

/// Payload bytes and header text come back from a claim exactly as enqueued: every byte
/// value, invalid UTF-8, NUL bytes, empty, 1 MiB; non-ASCII and empty header values and
/// keys. What a store cannot hold is refused at enqueue, inside the producer's
/// transaction, which still commits its other rows.
pub(crate) async fn payloads_and_headers_survive_byte_for_byte<B: Backend>() {
    const LIMIT: usize = 2 * 1024 * 1024;
    let b = B::create("bytes", LIMIT).await;
    let store = b.store();
    let mut big = vec![0u8; 1024 * 1024];
    rand::fill(&mut big[..]);
    let all_bytes: Vec<u8> = (0..=255u8).collect();
    type Case = (
        Vec<u8>,
        Option<&'static str>,
        Vec<(&'static str, &'static str)>,
    );
    let cases: Vec<Case> = vec![
        (
            all_bytes.clone(),
            Some("ключ-1"),
            vec![("note", "grüße ✓ 日本語 🚀")],
        ),
        (
            vec![0xff, 0xfe, 0xc3, 0x28, 0x80, 0xed, 0xa0, 0x80, 0xf8],
            None,
            vec![("empty", ""), ("nokkel", "värde ✓")],
        ),
        (b"\0\0a\0b\0".to_vec(), Some(""), vec![("tab", "a\tb\r\nc")]),
        (
            Vec::new(),
            None,
            vec![("quote", "\"'\\`"), ("json", "{\"x\":[1]}")],
        ),
        (big.clone(), Some("big"), vec![("control", "\u{1}\u{7f}")]),
        (all_bytes.iter().rev().copied().collect(), None, vec![]),
    ];
    let msgs: Vec<Message> = cases
        .iter()
        .map(|(payload, key, headers)| {
            let mut m = Message::new("t.bytes.v1", payload.clone());
            if let Some(k) = key {
                m = m.key(*k);
            }
            for (k, v) in headers {
                m = m.header(*k, *v);
            }
            m
        })
        .collect();
    let enq = b.enqueue_all(&msgs).await;

    let c = claim(&store, "relay-bytes", 100, LONG).await;
    assert!(c.malformed.is_empty(), "{:?}", c.malformed);
    assert_eq!(claim_ids(&c), enq.iter().map(|e| e.id).collect::<Vec<_>>());
    let rows = b.rows_of(&claim_ids(&c)).await;
    for (((m, (payload, key, headers)), sent), row) in
        c.messages.iter().zip(&cases).zip(&msgs).zip(&rows)
    {
        assert_eq!(m.message_id, sent.id());
        assert_eq!(m.topic, "t.bytes.v1");
        assert!(m.payload[..] == payload[..], "payload of {} changed", m.id);
        assert!(
            row.payload == *payload,
            "stored payload of {} changed",
            m.id
        );
        assert_eq!(m.key.as_deref(), *key);
        let expected: BTreeMap<String, String> = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        assert_eq!(m.headers, expected);
    }
    store
        .mark_dispatched(c.token, &claim_ids(&c))
        .await
        .unwrap();

    // Refused inside the transaction; the transaction goes on and commits the rest.
    let too_big =
        Message::new("t.bytes.v1", vec![7u8; LIMIT - 20]).header("tenant", "x".repeat(40));
    let nul_header = Message::new("t.bytes.v1", b"ok".to_vec()).header("h", "a\0b");
    let nul_key = Message::new("t.bytes.v1", b"ok".to_vec()).key("k\0");
    let ok1 = Message::new("t.bytes.v1", b"before".to_vec());
    let ok2 = Message::new("t.bytes.v1", b"after".to_vec());
    let r = b
        .produce(
            &[
                ok1.clone(),
                too_big.clone(),
                nul_header.clone(),
                nul_key.clone(),
                ok2.clone(),
            ],
            TxOpts::default(),
        )
        .await;
    assert!(r[0].is_ok() && r[4].is_ok(), "{r:?}");
    match &r[1] {
        Err(e @ Error::MessageTooLarge { size, limit }) => {
            assert_eq!(*limit, LIMIT);
            assert_eq!(*size, LIMIT - 20 + "t.bytes.v1".len() + "tenant".len() + 40);
            assert!(e.to_string().contains("too large"), "{e}");
        }
        other => panic!("expected MessageTooLarge, got {other:?}"),
    }
    for refused in [&r[2], &r[3]] {
        match refused {
            Err(e @ Error::InvalidMessage(_)) => assert!(e.to_string().contains("NUL"), "{e}"),
            other => panic!("expected InvalidMessage, got {other:?}"),
        }
    }
    for m in [&ok1, &ok2] {
        assert_eq!(b.count(&format!("message_id = '{}'", m.id())).await, 1);
    }
    // Header names are HTTP tokens (what every sink can carry as a header name).
    let bad_name = Message::new("t.bytes.v1", b"ok".to_vec()).header("nøkkel", "v");
    let r = b
        .produce(std::slice::from_ref(&bad_name), TxOpts::default())
        .await;
    match &r[0] {
        Err(e @ Error::InvalidMessage(_)) => assert!(e.to_string().contains("header name"), "{e}"),
        other => panic!("expected InvalidMessage, got {other:?}"),
    }
    assert_eq!(
        b.count(&format!("message_id = '{}'", bad_name.id())).await,
        0
    );
    for m in [&too_big, &nul_header, &nul_key] {
        assert_eq!(b.count(&format!("message_id = '{}'", m.id())).await, 0);
    }

    // The SQL entry point applies the limit too (SQLite's is a plain INSERT: no check).
    if B::SQL_ENTRY_CHECKS {
        let call = SqlCall {
            topic: "t.bytes.v1".into(),
            payload: vec![0u8; LIMIT + 1],
            key: None,
            message_id: Some(Uuid::now_v7()),
            headers: serde_json::json!({}),
        };
        let err = b.sql_enqueue(&[call]).await.unwrap_err();
        assert!(err.contains("too large"), "{err}");
    }
}

//! Store conformance: enqueue: atomic with the business change, idempotent, delayed.

use super::*;
use outbox::store::prelude::*;

/// The business change and its messages commit or roll back together (rollback, and a
/// transaction dropped without commit, leave neither).
pub(crate) async fn enqueue_commits_and_rolls_back_with_the_business_change<B: Backend>() {
    let b = B::create("atom", DEFAULT_MAX).await;
    for (order, end) in [(1, End::Rollback), (2, End::Drop), (3, End::Commit)] {
        let m = Message::new("orders.order-placed.v1", format!("{{\"order\":{order}}}"))
            .key(format!("order-{order}"));
        let r = b
            .produce(
                std::slice::from_ref(&m),
                TxOpts {
                    business_row: Some(order),
                    end,
                    ..TxOpts::default()
                },
            )
            .await;
        let e = r.into_iter().next().unwrap().unwrap();
        assert!(e.inserted);
        let expected = i64::from(end == End::Commit);
        // Dropped transactions roll back on their connection's next use: wait for it.
        if end == End::Drop {
            wait_until(
                "the dropped transaction rolled back",
                Duration::from_secs(10),
                || {
                    let b = &b;
                    async move {
                        match b.orders(order).await {
                            0 => Ok(()),
                            n => Err(format!("{n} business rows")),
                        }
                    }
                },
            )
            .await;
        }
        assert_eq!(b.orders(order).await, expected, "{end:?}: business row");
        let filter = format!("message_id = '{}'", m.id().hyphenated());
        assert_eq!(b.count(&filter).await, expected, "{end:?}: message");
        if end == End::Commit {
            let r = b.row(e.id).await;
            assert_eq!(r.message_id, m.id());
            assert_eq!(r.key.as_deref(), Some("order-3"));
            assert_eq!(r.payload, b"{\"order\":3}");
            assert_eq!(r.status, status::PENDING);
        }
    }
    assert_eq!(
        b.count("1 = 1").await,
        1,
        "only the committed message exists"
    );
}

/// Enqueue is idempotent on the message id: twice in one transaction, across
/// transactions, and from two producers at once (the second waits for the first) → the
/// same row id, `inserted: false`, and the transaction still commits; the store's SQL entry
/// point for other languages is idempotent too. `Message::available_at` and
/// `Message::delay` hold a message back; a past `available_at` is due at once.
pub(crate) async fn enqueue_is_idempotent_and_delays_hold<B: Backend>() {
    let b = Arc::new(B::create("idem", DEFAULT_MAX).await);
    let store = b.store();
    let id = Uuid::now_v7();
    let first = Message::new("t.idem.v1", b"first".to_vec()).message_id(id);
    let second = Message::new("t.idem.v1", b"second".to_vec()).message_id(id);
    let other = Message::new("t.idem.v1", b"other".to_vec());
    let r: Vec<Enqueued> = b
        .produce(
            &[first.clone(), second.clone(), other.clone()],
            TxOpts::default(),
        )
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert!(r[0].inserted && !r[1].inserted && r[2].inserted, "{r:?}");
    assert_eq!(r[0].id, r[1].id);
    assert_eq!(r[1].message_id, id);
    assert_ne!(r[2].id, r[0].id);
    let again = b.enqueue_all(std::slice::from_ref(&second)).await;
    assert_eq!((again[0].id, again[0].inserted), (r[0].id, false));
    let rows = b.select_rows(&format!("message_id = '{id}'")).await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].payload, b"first", "the first payload is kept");
    assert_eq!(b.count("1 = 1").await, 2, "the other message committed too");

    // Two producers at once with the same id: the second waits, then gets the row back.
    let race = Message::new("t.idem.v1", b"race".to_vec());
    let (gate_tx, gate_rx) = tokio::sync::oneshot::channel::<()>();
    let (enqueued_tx, enqueued_rx) = tokio::sync::oneshot::channel::<()>();
    let (b1, m1) = (b.clone(), race.clone());
    let holder = tokio::spawn(async move {
        // Enqueue, then hold the transaction open until told to commit.
        b1.produce_held(&m1, enqueued_tx, gate_rx).await
    });
    enqueued_rx.await.unwrap();
    let (b2, m2) = (b.clone(), race.clone());
    let racer = tokio::spawn(async move { b2.enqueue_all(&[m2]).await.pop().unwrap() });
    b.wait_for_lock_waiters(1, Duration::from_millis(300)).await;
    assert!(
        !racer.is_finished(),
        "the second producer must wait for the first's uncommitted row"
    );
    gate_tx.send(()).unwrap();
    let e1 = holder.await.unwrap();
    let e2 = racer.await.unwrap();
    assert!(e1.inserted);
    assert_eq!((e2.id, e2.inserted), (e1.id, false));

    // The SQL entry point: twice in one transaction, again in another, then from Rust.
    let sql_id = Uuid::now_v7();
    let call = |payload: &[u8]| SqlCall {
        topic: "t.sql.v1".into(),
        payload: payload.to_vec(),
        key: Some("k1".into()),
        message_id: Some(sql_id),
        headers: serde_json::json!({"tenant": "acme"}),
    };
    let got = b.sql_enqueue(&[call(b"one"), call(b"two")]).await.unwrap();
    assert_eq!(got[0], got[1]);
    let got2 = b.sql_enqueue(&[call(b"three")]).await.unwrap();
    assert_eq!(got2[0], got[0]);
    let from_rust = b
        .enqueue_all(&[Message::new("t.sql.v1", b"four".to_vec()).message_id(sql_id)])
        .await;
    assert_eq!((from_rust[0].id, from_rust[0].inserted), (got[0], false));
    let rows = b.select_rows(&format!("message_id = '{sql_id}'")).await;
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!((r.id, r.status), (got[0], status::PENDING));
    assert_eq!(r.payload, b"one");
    assert_eq!(r.key.as_deref(), Some("k1"));
    assert_eq!(r.headers, serde_json::json!({"tenant": "acme"}));
    // A row from the SQL entry point is due at once and claimable like any other.
    let c = claim(&store, "relay-idem", 100, LONG).await;
    let claimed: HashSet<i64> = claim_ids(&c).into_iter().collect();
    assert!(
        claimed.contains(&got[0]),
        "SQL-enqueued row not claimable: {claimed:?}"
    );
    assert_eq!(claimed.len(), 4);
    let m = c.messages.iter().find(|m| m.id == got[0]).unwrap();
    assert_eq!(m.message_id, sql_id);
    assert_eq!(m.headers.get("tenant").map(String::as_str), Some("acme"));
    store
        .mark_dispatched(c.token, &claim_ids(&c))
        .await
        .unwrap();

    // Without a message id, the SQL entry point makes a fresh UUIDv7 per call.
    if B::SQL_ENTRY_CHECKS {
        let call = SqlCall {
            topic: "t.sql.v1".into(),
            payload: vec![0],
            key: None,
            message_id: None,
            headers: serde_json::json!({}),
        };
        let got = b.sql_enqueue(&[call.clone(), call]).await.unwrap();
        assert_ne!(got[0], got[1]);
        let rows = b.rows_of(&got).await;
        assert_eq!(rows.len(), 2);
        assert_ne!(rows[0].message_id, rows[1].message_id);
        for r in &rows {
            assert_eq!(r.message_id.get_version_num(), 7, "{}", r.message_id);
            let ms = r.message_id.get_timestamp().unwrap().to_unix();
            let ms = i64::try_from(ms.0).unwrap() * 1000 + i64::from(ms.1 / 1_000_000);
            assert!(
                (ms - Utc::now().timestamp_millis()).abs() < 10_000,
                "the UUIDv7 time is now: {}",
                r.message_id
            );
        }
        let c = claim(&store, "relay-idem", 100, LONG).await;
        assert_eq!(claim_ids(&c), got);
        store.mark_dispatched(c.token, &got).await.unwrap();
    }

    // Delayed availability.
    let hour = chrono::Duration::hours(1);
    let later_at = Utc::now() + hour;
    let past_at = Utc::now() - hour;
    let t0 = b.db_now_us().await;
    let enq = b
        .enqueue_all(&[
            Message::new("t.delay.v1", b"at".to_vec()).available_at(later_at),
            Message::new("t.delay.v1", b"delay".to_vec()).delay(Duration::from_secs(3600)),
            Message::new("t.delay.v1", b"both".to_vec())
                .available_at(past_at)
                .delay(Duration::from_secs(3600)),
        ])
        .await;
    let t1 = b.db_now_us().await;
    let rows = b
        .rows_of(&enq.iter().map(|e| e.id).collect::<Vec<_>>())
        .await;
    assert!(
        (rows[0].available_at - later_at.timestamp_micros()).abs() <= 1_000,
        "{} vs {}",
        rows[0].available_at,
        later_at.timestamp_micros()
    );
    let hour_us = 3_600_000_000;
    assert!(
        rows[1].available_at >= t0 + hour_us - 1_000
            && rows[1].available_at <= t1 + hour_us + 1_000,
        "delay counts from the database clock: {} vs [{t0}, {t1}] + 1 h",
        rows[1].available_at
    );
    assert!(
        (rows[2].available_at - past_at.timestamp_micros()).abs() <= 1_000,
        "available_at wins over delay"
    );
    let c = claim(&store, "relay-idem", 100, LONG).await;
    assert_eq!(
        claim_ids(&c),
        vec![enq[2].id],
        "only the past-dated message is due"
    );
}

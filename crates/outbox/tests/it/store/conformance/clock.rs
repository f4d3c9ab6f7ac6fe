//! Store conformance: the database clock.

use super::*;
use outbox::store::prelude::*;

/// Claims `store` until every id in `waiting` has been claimed (marking each claim at
/// once), and returns when each was first claimed, measured from `start`.
async fn first_claimed(
    store: &Arc<dyn Store>,
    waiting: &[i64],
    start: Instant,
    timeout: Duration,
) -> HashMap<i64, Duration> {
    let got = Mutex::new(HashMap::new());
    let what = format!("rows {waiting:?} all claimable");
    wait_until(&what, timeout.saturating_sub(start.elapsed()), || async {
        let c = claim(store, "relay-clock", 100, LONG).await;
        let at = start.elapsed();
        // Mark what came back so it does not come back again.
        store
            .mark_dispatched(c.token, &claim_ids(&c))
            .await
            .unwrap();
        let mut got = got.lock().unwrap();
        for m in &c.messages {
            if waiting.contains(&m.id) {
                got.entry(m.id).or_insert(at);
            }
        }
        if got.len() == waiting.len() {
            Ok(())
        } else {
            Err(format!("got {got:?}"))
        }
    })
    .await;
    got.into_inner().unwrap()
}

/// Every eligibility comparison runs on the database clock in UTC: a producer whose session
/// time zone is far from UTC (PostgreSQL +14:00, MariaDB +13:00) enqueues a message that is
/// due at once (not 14 hours late or early); `Message::delay` and `Message::available_at`
/// hold a message back by their time only; a reschedule's delay holds a row back by its
/// delay only. SQLite has no session time zone: its times must be UTC milliseconds.
///
/// Relay clock skew needs no case of its own: the relay never sends a timestamp to the
/// store (claims, leases, backoffs and purges send durations; every `now` is the
/// database's), so a relay's clock cannot move any of these times.
pub(crate) async fn database_clock_decides_eligibility<B: Backend>() {
    let b = B::create("clock", DEFAULT_MAX).await;
    let store = b.store();
    let delay = Duration::from_secs(2);
    let start = Instant::now();
    let absolute = Utc::now() + chrono::Duration::from_std(delay).unwrap();
    let msgs = vec![
        Message::new("t.clock.v1", b"now".to_vec()),
        Message::new("t.clock.v1", b"delayed".to_vec()).delay(delay),
        Message::new("t.clock.v1", b"at".to_vec()).available_at(absolute),
    ];
    let enq: Vec<Enqueued> = b
        .produce(
            &msgs,
            TxOpts {
                far_time_zone: true,
                ..TxOpts::default()
            },
        )
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let ids: Vec<i64> = enq.iter().map(|e| e.id).collect();

    // Stored times are UTC, whatever the producer's session time zone.
    let wall = Utc::now().timestamp_micros();
    for r in b.rows_of(&ids).await {
        assert!(
            (r.occurred_at - wall).abs() < 5_000_000,
            "occurred_at {} is not the UTC time {wall} (off by {} s)",
            r.occurred_at,
            (r.occurred_at - wall) / 1_000_000
        );
    }
    let rows = b.rows_of(&ids).await;
    assert!(
        (rows[2].available_at - absolute.timestamp_micros()).abs() <= 1_000,
        "available_at is kept as given (UTC): {} vs {}",
        rows[2].available_at,
        absolute.timestamp_micros()
    );

    // Due at once: only the undelayed message.
    let now_claim = claim(&store, "relay-clock", 100, LONG).await;
    assert_eq!(
        claim_ids(&now_claim),
        vec![ids[0]],
        "the undelayed message must be due at once, the delayed ones not yet"
    );
    let got = first_claimed(&store, &ids[1..], start, Duration::from_secs(6)).await;
    for id in &ids[1..] {
        let at = got[id];
        assert!(
            at >= delay - Duration::from_millis(50),
            "row {id} claimable after {at:?}, before its {delay:?} delay"
        );
        assert!(
            at < delay + Duration::from_millis(1500),
            "row {id} claimable only after {at:?}, its delay was {delay:?}"
        );
    }

    // A reschedule's delay is on the database clock as well.
    let retry_delay = Duration::from_millis(1500);
    let again = b
        .enqueue_all(&[Message::new("t.clock.v1", b"retry".to_vec())])
        .await;
    let c = claim(&store, "relay-clock", 100, LONG).await;
    assert_eq!(claim_ids(&c), vec![again[0].id]);
    let start = Instant::now();
    let retry = Retry {
        id: again[0].id,
        delay: retry_delay,
        error: "transient".into(),
        refund_attempt: false,
    };
    assert_eq!(store.reschedule(c.token, &[retry]).await.unwrap(), 1);
    assert!(
        claim(&store, "relay-clock", 100, LONG)
            .await
            .messages
            .is_empty(),
        "a rescheduled row is not due before its delay"
    );
    let got = first_claimed(&store, &[again[0].id], start, Duration::from_secs(5)).await;
    let at = got[&again[0].id];
    assert!(
        at >= retry_delay - Duration::from_millis(50),
        "claimable after {at:?}, before the {retry_delay:?} backoff"
    );
    assert!(
        at < retry_delay + Duration::from_millis(1500),
        "claimable only after {at:?}, the backoff was {retry_delay:?}"
    );
}

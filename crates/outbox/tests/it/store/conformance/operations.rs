//! The operator's side of every store: dead letters and their audited replay and discard,
//! the relay registry, topic pauses and the overview.

use super::{Backend, DEFAULT_MAX, LONG, claim, claim_ids, clock_moves_on};
use crate::common::wait_dispatched;
use crate::common::{RecordingSink, messages, relay_config, total, wait_until};
use outbox::sink::router::TopicPattern;
use outbox::store::prelude::*;
use outbox::store::{
    ClaimRequest, Dead, DeadSelector, RELAY_EXPIRY, RelayHeartbeat, ReplayAction, ReplayRequest,
    status,
};
use outbox::{Error, Relay, Store};
use std::sync::Arc;
use std::time::Duration;

/// Quarantines every row the claim returns, with `error`.
async fn quarantine_all(store: &Arc<dyn Store>, n: u32, error: &str) -> Vec<i64> {
    let c = claim(store, "relay-ops", n, LONG).await;
    let dead: Vec<Dead> = c
        .messages
        .iter()
        .map(|m| Dead {
            id: m.id,
            error: error.to_owned(),
        })
        .collect();
    assert_eq!(
        store.quarantine(c.token, &dead).await.unwrap(),
        dead.len() as u64
    );
    claim_ids(&c)
}

fn request(selector: DeadSelector, action: ReplayAction) -> ReplayRequest {
    ReplayRequest {
        selector,
        action,
        limit: None,
        by: "alice".into(),
        reason: "binding restored".into(),
        rate_per_s: None,
        dry_run: false,
        append_to: None,
    }
}

fn topic(p: &str) -> DeadSelector {
    DeadSelector {
        topic: Some(TopicPattern::parse(p).unwrap()),
        ..DeadSelector::default()
    }
}

/// Quarantine 10 + 2 messages; list and filter them; a dry run changes nothing; a replay
/// puts exactly the selected ones back with their message ids, attempts reset and the audit
/// id recorded; named rows that are not dead are refused; discard and purge delete only
/// dead rows; every change is one audit row.
pub(crate) async fn dead_letters_are_listed_replayed_and_audited<B: Backend>() {
    let b = B::create("dead", DEFAULT_MAX).await;
    let store = b.store();
    let orders = b.enqueue_all(&messages("t.ops.orders.v1", 10)).await;
    let dead_orders = quarantine_all(&store, 10, "permanent: Broker REFUSED the message").await;
    b.enqueue_all(&messages("t.other.v1", 2)).await;
    let dead_other = quarantine_all(&store, 2, "permanent: unroutable").await;
    let live = b.enqueue_all(&messages("t.live.v1", 1)).await;

    // Listing and filters.
    let all = store
        .dead_letters(&DeadSelector::default(), 100, false)
        .await
        .unwrap();
    assert_eq!(all.len(), 12);
    assert!(all.windows(2).all(|w| w[0].id < w[1].id), "by id");
    let first = &all[0];
    assert_eq!(first.message_id, orders[0].message_id);
    assert_eq!(first.topic, "t.ops.orders.v1");
    assert_eq!(first.attempts, 1);
    assert_eq!(
        first.last_error.as_deref(),
        Some("permanent: Broker REFUSED the message")
    );
    assert!(first.payload.is_none(), "payload only when asked");
    assert!(first.payload_bytes > 0);
    assert!(first.died_at >= first.occurred_at);
    let with = store
        .dead_letters(&DeadSelector::default(), 1, true)
        .await
        .unwrap();
    assert_eq!(with[0].payload.as_deref(), Some(&b"payload-0"[..]));

    let count = |sel: DeadSelector| {
        let store = store.clone();
        async move { store.count_dead(&sel).await.unwrap() }
    };
    assert_eq!(count(DeadSelector::default()).await, 12);
    assert_eq!(count(topic("t.ops.>")).await, 10);
    assert_eq!(count(topic("t.*.v1")).await, 2);
    assert_eq!(count(topic("t.ops")).await, 0);
    let err = |e: &str| DeadSelector {
        error_contains: Some(e.into()),
        ..DeadSelector::default()
    };
    assert_eq!(count(err("broker refused")).await, 10, "case-insensitive");
    assert_eq!(count(err("unroutable")).await, 2);
    assert_eq!(count(err("100%_")).await, 0, "no LIKE wildcards");
    let ids_sel = DeadSelector {
        ids: vec![dead_orders[0], dead_other[1], live[0].id],
        message_ids: vec![orders[3].message_id],
        ..DeadSelector::default()
    };
    assert_eq!(count(ids_sel).await, 3, "the live row is not dead");
    let range = DeadSelector {
        id_range: Some((dead_orders[2], dead_orders[5])),
        ..DeadSelector::default()
    };
    assert_eq!(count(range).await, 4);
    let within = |d: Duration| DeadSelector {
        died_within: Some(d),
        ..DeadSelector::default()
    };
    let before = DeadSelector {
        died_before_ago: Some(Duration::from_millis(20)),
        ..DeadSelector::default()
    };
    // Once all 12 died more than 20 ms ago, none died within the last 20 ms.
    wait_until(
        "12 dead letters older than 20 ms",
        Duration::from_secs(10),
        || {
            let (store, before) = (store.clone(), before.clone());
            async move {
                match store.count_dead(&before).await.unwrap() {
                    12 => Ok(()),
                    n => Err(format!("{n} older than 20 ms")),
                }
            }
        },
    )
    .await;
    assert_eq!(count(within(Duration::from_secs(3600))).await, 12);
    assert_eq!(count(within(Duration::from_millis(20))).await, 0);
    assert_eq!(count(before).await, 12);

    // Refusals before anything runs.
    for bad in [
        request(DeadSelector::default(), ReplayAction::Replay),
        ReplayRequest {
            reason: " ".into(),
            ..request(topic("t.ops.>"), ReplayAction::Replay)
        },
        ReplayRequest {
            by: String::new(),
            ..request(topic("t.ops.>"), ReplayAction::Replay)
        },
        ReplayRequest {
            rate_per_s: Some(0.0),
            ..request(topic("t.ops.>"), ReplayAction::Replay)
        },
    ] {
        match store.replay(&bad).await {
            Err(Error::InvalidRequest(_)) => {}
            other => panic!("expected InvalidRequest for {bad:?}, got {other:?}"),
        }
    }

    // A dry run counts and samples, and changes nothing.
    let dry = store
        .replay(&ReplayRequest {
            dry_run: true,
            ..request(topic("t.ops.>"), ReplayAction::Replay)
        })
        .await
        .unwrap();
    assert_eq!((dry.count, dry.replay_id), (10, None));
    assert_eq!(dry.sample, dead_orders);
    assert_eq!(count(DeadSelector::default()).await, 12);
    assert!(store.replays(10).await.unwrap().is_empty(), "no audit row");

    // Named rows that are not dead are refused, the dead one goes.
    let named = DeadSelector {
        ids: vec![live[0].id, 999_999, dead_other[0]],
        ..DeadSelector::default()
    };
    let o = store
        .replay(&request(named, ReplayAction::Replay))
        .await
        .unwrap();
    assert_eq!(o.count, 1);
    let mut refused: Vec<(String, String)> = o
        .refused
        .iter()
        .map(|r| (r.what.clone(), r.reason.clone()))
        .collect();
    refused.sort();
    let mut want = vec![
        (live[0].id.to_string(), "pending, not dead".to_owned()),
        ("999999".to_owned(), "unknown id".to_owned()),
    ];
    want.sort();
    assert_eq!(refused, want);
    assert_eq!(b.row(live[0].id).await.status, status::PENDING, "untouched");

    // The replay: same message ids, attempts 0, due now, audit id recorded.
    let o = store
        .replay(&request(topic("t.ops.>"), ReplayAction::Replay))
        .await
        .unwrap();
    assert_eq!(o.count, 10);
    let audit = o.replay_id.unwrap();
    for (id, e) in dead_orders.iter().zip(&orders) {
        let r = b.row(*id).await;
        assert_eq!((r.status, r.attempts), (status::PENDING, 0), "{r:?}");
        assert_eq!(r.message_id, e.message_id);
        assert_eq!(r.claim_token, None);
    }
    let replayed: i64 = b
        .count(&format!("replay_id = {audit} AND status = 0"))
        .await;
    assert_eq!(replayed, 10);
    let again = claim(&store, "relay-ops", 100, LONG).await;
    let mut got = claim_ids(&again);
    got.sort_unstable();
    let mut want: Vec<i64> = dead_orders.clone();
    want.push(dead_other[0]);
    want.push(live[0].id);
    want.sort_unstable();
    assert_eq!(got, want, "replayed rows are claimable at once");
    store.mark_dispatched(again.token, &got).await.unwrap();

    // A replay of rows no longer dead changes nothing and writes no audit row.
    let none = store
        .replay(&request(topic("t.ops.>"), ReplayAction::Replay))
        .await
        .unwrap();
    assert_eq!((none.count, none.replay_id), (0, None));

    // Rate: the rows become due one after another.
    b.enqueue_all(&messages("t.rate.v1", 3)).await;
    let rate_ids = quarantine_all(&store, 3, "permanent: x").await;
    let o = store
        .replay(&ReplayRequest {
            rate_per_s: Some(2.0),
            ..request(topic("t.rate.v1"), ReplayAction::Replay)
        })
        .await
        .unwrap();
    assert_eq!(o.count, 3);
    let rows = b.rows_of(&rate_ids).await;
    let gap1 = rows[1].available_at - rows[0].available_at;
    let gap2 = rows[2].available_at - rows[1].available_at;
    for gap in [gap1, gap2] {
        assert!(
            (490_000..=510_000).contains(&gap),
            "500 ms apart at 2/s: {gap} us"
        );
    }

    // Discard deletes only dead rows; purge can add to one audit row.
    let o = store
        .replay(&ReplayRequest {
            reason: "obsolete event".into(),
            ..request(topic("t.other.v1"), ReplayAction::Discard)
        })
        .await
        .unwrap();
    assert_eq!(o.count, 1, "one of the two was replayed and dispatched");
    assert_eq!(b.count(&format!("id = {}", dead_other[1])).await, 0);
    assert_eq!(b.count(&format!("id = {}", dead_other[0])).await, 1);
    // The replayed t.rate rows become due within a second: deliver them, and quarantine
    // three new ones for the purge.
    b.enqueue_all(&messages("t.purge.v1", 3)).await;
    wait_until(
        "the replayed rows and the new ones due",
        Duration::from_secs(10),
        || {
            let store = store.clone();
            async move {
                match store.overview(10).await.unwrap().due {
                    6 => Ok(()),
                    n => Err(format!("{n} due")),
                }
            }
        },
    )
    .await;
    let c = claim(&store, "relay-ops", 100, LONG).await;
    assert_eq!(c.messages.len(), 6);
    let (purge, rate): (Vec<_>, Vec<_>) = c.messages.iter().partition(|m| m.topic == "t.purge.v1");
    let dead: Vec<Dead> = purge
        .iter()
        .map(|m| Dead {
            id: m.id,
            error: "permanent: y".into(),
        })
        .collect();
    store.quarantine(c.token, &dead).await.unwrap();
    let rate: Vec<i64> = rate.iter().map(|m| m.id).collect();
    store.mark_dispatched(c.token, &rate).await.unwrap();
    let old = DeadSelector {
        died_before_ago: Some(Duration::ZERO),
        ..DeadSelector::default()
    };
    wait_until(
        "the three quarantined rows died before now",
        Duration::from_secs(10),
        || {
            let (store, old) = (store.clone(), old.clone());
            async move {
                match store.count_dead(&old).await.unwrap() {
                    3 => Ok(()),
                    n => Err(format!("{n} died before now")),
                }
            }
        },
    )
    .await;
    let first = store
        .replay(&ReplayRequest {
            limit: Some(2),
            ..request(old.clone(), ReplayAction::Purge)
        })
        .await
        .unwrap();
    assert_eq!(first.count, 2);
    let rest = store
        .replay(&ReplayRequest {
            limit: Some(2),
            append_to: first.replay_id,
            ..request(old, ReplayAction::Purge)
        })
        .await
        .unwrap();
    assert_eq!((rest.count, rest.replay_id), (1, first.replay_id));
    assert_eq!(count(DeadSelector::default()).await, 0);

    // The audit, newest first.
    let audit_rows = store.replays(10).await.unwrap();
    let summary: Vec<(String, i64, String)> = audit_rows
        .iter()
        .map(|r| (r.action.clone(), r.count, r.selection.clone()))
        .collect();
    assert_eq!(
        summary,
        vec![
            ("purge".into(), 3, "died_before_ago=0s limit=2".into()),
            ("discard".into(), 1, "topic=t.other.v1".into()),
            ("replay".into(), 3, "topic=t.rate.v1 rate=2/s".into()),
            ("replay".into(), 10, "topic=t.ops.>".into()),
            (
                "replay".into(),
                1,
                format!("ids={},999999,{}", live[0].id, dead_other[0])
            ),
        ]
    );
    let r = &audit_rows[3];
    assert_eq!(
        (r.id, r.by.as_str(), r.reason.as_str()),
        (audit, "alice", "binding restored")
    );
    let now_us = b.db_now_us().await;
    assert!(
        (now_us - r.at.timestamp_micros()).abs() < 60_000_000,
        "database clock"
    );
}

fn beat(id: &str, last_claim_ago: Option<Duration>) -> RelayHeartbeat {
    RelayHeartbeat {
        relay_id: id.into(),
        instance: format!("{id}-a"),
        host: "host-a".into(),
        pid: 42,
        lease: Duration::from_secs(30),
        version: "0.1.0".into(),
        sink: "nats://127.0.0.1:4222".into(),
        in_flight: 7,
        last_claim_ago,
        destinations: vec![outbox::store::DestinationState {
            name: "nats://127.0.0.1:4222".into(),
            state: "up".into(),
        }],
    }
}

/// Heartbeats upsert one row per relay on the database clock, deregistering removes it,
/// a stale row is not listed, and a running relay registers itself and leaves on exit.
pub(crate) async fn relay_registry_heartbeats_and_expires<B: Backend>() {
    let b = B::create("registry", DEFAULT_MAX).await;
    let store = b.store();
    assert!(store.relays(RELAY_EXPIRY).await.unwrap().is_empty());
    let t0 = b.db_now_us().await;
    store.heartbeat(&beat("r1", None)).await.unwrap();
    store
        .heartbeat(&beat("r2", Some(Duration::from_secs(10))))
        .await
        .unwrap();
    let relays = store.relays(RELAY_EXPIRY).await.unwrap();
    assert_eq!(relays.len(), 2, "{relays:?}");
    let r1 = relays.iter().find(|r| r.relay_id == "r1").unwrap();
    assert_eq!((r1.host.as_str(), r1.pid, r1.in_flight), ("host-a", 42, 7));
    assert_eq!(r1.sink, "nats://127.0.0.1:4222");
    assert_eq!(r1.last_claim_at, None);
    assert_eq!(
        r1.destinations,
        vec![outbox::store::DestinationState {
            name: "nats://127.0.0.1:4222".into(),
            state: "up".into()
        }]
    );
    let seen = r1.last_seen.timestamp_micros();
    assert!(
        (seen - t0).abs() < 5_000_000,
        "database clock: {seen} vs {t0}"
    );
    let r2 = relays.iter().find(|r| r.relay_id == "r2").unwrap();
    let claim_at = r2.last_claim_at.unwrap().timestamp_micros();
    assert!(
        (seen - 10_000_000 - claim_at).abs() < 2_000_000,
        "last claim 10 s before the beat: {claim_at}"
    );

    // A second beat updates, never duplicates; started_at stays.
    clock_moves_on(&b).await;
    let mut again = beat("r1", Some(Duration::ZERO));
    again.in_flight = 0;
    again.destinations[0].state = "open".into();
    store.heartbeat(&again).await.unwrap();
    let relays = store.relays(RELAY_EXPIRY).await.unwrap();
    assert_eq!(relays.len(), 2);
    let r1b = relays.iter().find(|r| r.relay_id == "r1").unwrap();
    assert_eq!(r1b.in_flight, 0);
    assert_eq!(
        r1b.destinations[0].state, "open",
        "the state as of the last beat"
    );
    assert_eq!(r1b.started_at, r1.started_at);
    assert!(r1b.last_seen > r1.last_seen);
    assert!(r1b.last_claim_at.is_some());

    // Freshness: a row not seen within `within` is not listed.
    wait_until("r1 unseen for 200 ms", Duration::from_secs(10), || {
        let store = store.clone();
        async move {
            let fresh = store.relays(Duration::from_millis(200)).await.unwrap();
            if fresh.iter().any(|r| r.relay_id == "r1") {
                Err(format!("{fresh:?}"))
            } else {
                Ok(())
            }
        }
    })
    .await;
    store.heartbeat(&beat("r2", None)).await.unwrap();
    let fresh = store.relays(Duration::from_millis(200)).await.unwrap();
    let ids: Vec<&str> = fresh.iter().map(|r| r.relay_id.as_str()).collect();
    assert_eq!(ids, vec!["r2"]);

    store.deregister("r1", "r1-a").await.unwrap();
    store.deregister("r2", "r2-a").await.unwrap();
    assert!(store.relays(RELAY_EXPIRY).await.unwrap().is_empty());

    // A running relay registers itself, and leaves on a clean exit.
    let mut cfg = relay_config("relay-registered");
    cfg.heartbeat_interval = Duration::from_millis(100);
    let (sink, _seen) = RecordingSink::new();
    let handle = Relay::new(store.clone(), sink, cfg).spawn();
    let s = store.clone();
    wait_until("the relay's registry row", Duration::from_secs(10), || {
        let s = s.clone();
        async move {
            let r = s.relays(RELAY_EXPIRY).await.map_err(|e| e.to_string())?;
            match r.as_slice() {
                [one] if one.relay_id == "relay-registered" && one.sink == "recording" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    handle.shutdown().await.unwrap();
    assert!(store.relays(RELAY_EXPIRY).await.unwrap().is_empty());
}

/// A topic pause holds only matching topics, in the claim itself (others flow); it is
/// listed with who, why and when; resuming lets them flow.
pub(crate) async fn topic_pauses_hold_only_matching_topics<B: Backend>() {
    let b = B::create("topicpause", DEFAULT_MAX).await;
    let store = b.store();
    let t0 = b.db_now_us().await;
    let pattern = TopicPattern::parse("t.held.>").unwrap();
    store
        .pause_topic(&pattern, "consumer migration", "bob")
        .await
        .unwrap();
    store
        .pause_topic(&TopicPattern::parse("t.*.x").unwrap(), "other", "carol")
        .await
        .unwrap();
    // Pausing again updates, never duplicates.
    store
        .pause_topic(&pattern, "consumer migration, day 2", "bob")
        .await
        .unwrap();
    let p = store.pause_state().await.unwrap();
    assert!(!p.paused);
    let listed: Vec<(&str, &str, &str)> = p
        .topics
        .iter()
        .map(|t| (t.pattern.as_str(), t.reason.as_str(), t.by.as_str()))
        .collect();
    assert_eq!(
        listed,
        vec![
            ("t.*.x", "other", "carol"),
            ("t.held.>", "consumer migration, day 2", "bob")
        ]
    );
    let at = p.topics[1].paused_at.timestamp_micros();
    assert!((at - t0).abs() < 5_000_000, "database clock: {at} vs {t0}");

    let held = b.enqueue_all(&messages("t.held.orders", 3)).await;
    let flows = b.enqueue_all(&messages("t.flows.v1", 3)).await;
    // The claim statement honours the stored pauses (no topics passed in).
    let c = store
        .claim(&ClaimRequest {
            relay_id: "r".into(),
            batch_size: 100,
            lease: LONG,
            skip_topics: Vec::new(),
            ordering: Default::default(),
        })
        .await
        .unwrap();
    let got: Vec<i64> = claim_ids(&c);
    assert_eq!(got, flows.iter().map(|e| e.id).collect::<Vec<_>>());
    store.release(c.token, &got).await.unwrap();

    // A relay honours the pause from the store; resuming lets the held topic flow.
    let (sink, seen) = RecordingSink::new();
    let handle = Relay::new(store.clone(), sink, relay_config("relay-topics")).spawn();
    wait_dispatched("3 rows dispatched", &store, 3, Duration::from_secs(10)).await;
    // Five more claims (a poll every 100 ms) pass the held topic by.
    crate::common::wait_claims("five more claims", &handle, 5, Duration::from_secs(10)).await;
    assert_eq!(total(&seen), 3, "only the unpaused topic");
    for e in &held {
        assert_eq!(b.row(e.id).await.status, status::PENDING);
    }
    assert!(
        !store.resume_topic("t.held").await.unwrap(),
        "exact pattern only"
    );
    assert!(store.resume_topic("t.held.>").await.unwrap());
    wait_dispatched("6 rows dispatched", &store, 6, Duration::from_secs(10)).await;
    handle.shutdown().await.unwrap();
    assert_eq!(store.pause_state().await.unwrap().topics.len(), 1);
}

/// The overview: counts, due rows, claims with an ended lease (by claimant), and the
/// largest topics of pending and dead rows.
pub(crate) async fn overview_counts_due_expired_and_topics<B: Backend>() {
    let b = B::create("overview", DEFAULT_MAX).await;
    let store = b.store();
    b.enqueue_all(&messages("t.a.v1", 4)).await;
    // Two claimed by a relay that then vanished (a lease of 50 ms).
    let c = claim(&store, "gone-relay", 2, Duration::from_millis(50)).await;
    assert_eq!(c.messages.len(), 2);
    assert!(c.db_now.is_some(), "the claim reports the database clock");
    b.enqueue_all(&messages("t.b.v1", 3)).await;
    b.enqueue_all(&messages("t.dead.v1", 1)).await;
    b.enqueue_all(&[
        outbox::Message::new("t.later.v1", b"x".to_vec()).delay(Duration::from_secs(3600))
    ])
    .await;
    wait_until("gone-relay's lease ended", Duration::from_secs(10), || {
        let store = store.clone();
        async move {
            match store.overview(2).await.unwrap().expired_claims {
                2 => Ok(()),
                n => Err(format!("{n} expired claims")),
            }
        }
    })
    .await;
    // Quarantine the dead topic's row: claim everything due but only quarantine it.
    let all = claim(&store, "ops", 100, LONG).await;
    let dead_id = all
        .messages
        .iter()
        .find(|m| m.topic == "t.dead.v1")
        .unwrap()
        .id;
    store
        .quarantine(
            all.token,
            &[Dead {
                id: dead_id,
                error: "permanent: z".into(),
            }],
        )
        .await
        .unwrap();
    let others: Vec<i64> = claim_ids(&all)
        .into_iter()
        .filter(|i| *i != dead_id)
        .collect();
    store.release(all.token, &others).await.unwrap();
    // Now: gone-relay's two rows were re-claimed by "ops" and released: all pending.
    let o = store.overview(2).await.unwrap();
    assert_eq!(o.counts.pending, 8, "{o:?}");
    assert_eq!(o.counts.dead, 1);
    assert_eq!(o.due, 7, "the delayed row is not due");
    assert_eq!(o.expired_claims, 0);
    assert!(o.oldest_due_s.is_some());
    assert_eq!(
        o.pending_by_topic,
        vec![("t.a.v1".to_owned(), 4), ("t.b.v1".to_owned(), 3)]
    );
    assert_eq!(o.dead_by_topic, vec![("t.dead.v1".to_owned(), 1)]);

    // A claim whose lease ends shows as expired, by claimant.
    let c = claim(&store, "vanished", 3, Duration::from_millis(50)).await;
    assert_eq!(c.messages.len(), 3);
    wait_until(
        "the vanished relay's lease ended",
        Duration::from_secs(10),
        || {
            let store = store.clone();
            async move {
                match store.overview(10).await.unwrap().expired_claims {
                    3 => Ok(()),
                    n => Err(format!("{n} expired claims")),
                }
            }
        },
    )
    .await;
    let o = store.overview(10).await.unwrap();
    assert_eq!((o.counts.claimed, o.expired_claims), (3, 3), "{o:?}");
    assert_eq!(o.due, 7, "expired claims are due");
    assert_eq!(o.claims_by.len(), 1);
    assert_eq!(o.claims_by[0].relay_id, "vanished");
    assert_eq!((o.claims_by[0].claimed, o.claims_by[0].expired), (3, 3));
}

//! Relay instances: two relays under one relay id each keep a registry row, a relay
//! leaves only its own row, claims made before every live instance of an id started are
//! not counted as theirs, and a second `Relay` under a running id in one program is
//! refused.

use super::{Backend, DEFAULT_MAX, claim, clock_moves_on};
use crate::common::{RecordingSink, messages, relay_config, wait_until};
use outbox::store::{RELAY_EXPIRY, RelayHeartbeat};
use outbox::{Relay, RelayError, Store};
use std::sync::Arc;
use std::time::Duration;

const LEASE: Duration = Duration::from_secs(60);

fn beat(id: &str, instance: &str, pid: i64) -> RelayHeartbeat {
    RelayHeartbeat {
        relay_id: id.into(),
        instance: instance.into(),
        host: "host-b".into(),
        pid,
        lease: LEASE,
        version: "0.1.0".into(),
        sink: "stdout".into(),
        in_flight: 0,
        last_claim_ago: None,
        destinations: Vec::new(),
    }
}

/// (instance, claimed) of the claims of `relay_id`, as the overview attributes them.
async fn claims(store: &Arc<dyn Store>, relay_id: &str) -> Vec<(Option<String>, i64)> {
    store
        .overview(0)
        .await
        .unwrap()
        .claims_by
        .into_iter()
        .filter(|c| c.relay_id == relay_id)
        .map(|c| (c.instance, c.claimed))
        .collect()
}

/// Two instances under one id are two rows; deregistering one leaves the other; a claim
/// goes to the instance whose lifetime holds it, and an earlier process's claim (made
/// before the live instance started) to none.
pub(crate) async fn relay_instances_are_kept_apart<B: Backend>() {
    let b = B::create("instances", DEFAULT_MAX).await;
    let store = b.store();
    b.enqueue_all(&messages("t.inst", 3)).await;
    // The earlier process registers, then claims a row, then dies (its row stays).
    store.heartbeat(&beat("dup", "old", 101)).await.unwrap();
    clock_moves_on(&b).await;
    claim(&store, "dup", 1, LEASE).await;
    assert_eq!(claims(&store, "dup").await, vec![(Some("old".into()), 1)]);
    // Two instances start under the same id afterwards, the later claims one row.
    clock_moves_on(&b).await;
    store.heartbeat(&beat("dup", "new-1", 102)).await.unwrap();
    clock_moves_on(&b).await;
    store.heartbeat(&beat("dup", "new-2", 103)).await.unwrap();
    clock_moves_on(&b).await;
    claim(&store, "dup", 1, LEASE).await;
    let relays = store.relays(RELAY_EXPIRY).await.unwrap();
    let mut listed: Vec<(&str, &str, i64)> = relays
        .iter()
        .map(|r| (r.relay_id.as_str(), r.instance.as_str(), r.pid))
        .collect();
    listed.sort();
    assert_eq!(
        listed,
        vec![
            ("dup", "new-1", 102),
            ("dup", "new-2", 103),
            ("dup", "old", 101)
        ],
        "one registry row per instance"
    );
    // A beat updates its own row only.
    store.heartbeat(&beat("dup", "new-1", 102)).await.unwrap();
    assert_eq!(store.relays(RELAY_EXPIRY).await.unwrap().len(), 3);
    let mut got = claims(&store, "dup").await;
    got.sort();
    assert_eq!(
        got,
        vec![(Some("new-2".into()), 1), (Some("old".into()), 1)],
        "each claim is its own instance's"
    );

    // The dead process's row goes: its claim is no live instance's.
    store.deregister("dup", "old").await.unwrap();
    let left: Vec<String> = store
        .relays(RELAY_EXPIRY)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.instance)
        .collect();
    assert_eq!(left, vec!["new-1".to_owned(), "new-2".to_owned()]);
    let mut got = claims(&store, "dup").await;
    got.sort();
    assert_eq!(
        got,
        vec![(None, 1), (Some("new-2".into()), 1)],
        "the earlier process's claim is not counted as a live instance's"
    );
}

/// A second `Relay` under a relay id that a `Relay` of this program runs is refused
/// (`RelayError::IdTaken`); under another id it runs.
pub(crate) async fn a_second_relay_in_one_program_under_its_id_is_refused<B: Backend>() {
    let b = B::create("instances_local", DEFAULT_MAX).await;
    let store = b.store();
    let mut cfg = relay_config("relay-twice");
    cfg.heartbeat_interval = Duration::from_millis(100);
    let (sink, _seen) = RecordingSink::new();
    let first = Relay::new(store.clone(), sink, cfg.clone()).spawn();
    let s = store.clone();
    wait_until(
        "the first relay's registry row",
        Duration::from_secs(10),
        || {
            let s = s.clone();
            async move {
                let r = s.relays(RELAY_EXPIRY).await.map_err(|e| e.to_string())?;
                if r.iter().any(|r| r.relay_id == "relay-twice") {
                    Ok(())
                } else {
                    Err(format!("{r:?}"))
                }
            }
        },
    )
    .await;
    let (sink, _seen) = RecordingSink::new();
    // Refused at once; a relay that is not refused runs on (and is dropped here).
    let stop = tokio_util::sync::CancellationToken::new();
    let second = tokio::time::timeout(
        Duration::from_secs(10),
        Relay::new(store.clone(), sink, cfg.clone()).run(stop),
    )
    .await
    .expect("the second relay under a running id should be refused, not run on");
    assert!(
        matches!(&second, Err(RelayError::IdTaken { relay_id, pid, .. })
            if relay_id == "relay-twice" && *pid == i64::from(std::process::id())),
        "{second:?}"
    );
    assert_eq!(
        store.relays(RELAY_EXPIRY).await.unwrap().len(),
        1,
        "the refused relay left no registry row"
    );
    first.shutdown().await.unwrap();
}
